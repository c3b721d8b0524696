//! `softrdma perf`'s command line: the benchmark, perftest's options, and their checks;
//! and the server's command line for `--local`.

use std::time::Duration;

use softrdma::{Device, Mtu};
use softrdma_proto::qp::MAX_MESSAGE;

use super::{Fail, CQ_MOD};
use crate::limits;

/// Which benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
#[allow(clippy::enum_variant_names)]
pub enum Test {
    /// ib_send_lat.
    SendLat,
    /// ib_send_bw.
    SendBw,
    /// ib_write_lat.
    WriteLat,
    /// ib_write_bw.
    WriteBw,
    /// ib_read_lat.
    ReadLat,
    /// ib_read_bw.
    ReadBw,
    /// ib_atomic_lat.
    AtomicLat,
    /// ib_atomic_bw.
    AtomicBw,
}

impl Test {
    pub(super) fn is_bw(self) -> bool {
        matches!(self, Test::SendBw | Test::WriteBw | Test::ReadBw | Test::AtomicBw)
    }
    pub(super) fn title(self) -> &'static str {
        match self {
            Test::SendLat => "Send Latency Test",
            Test::SendBw => "Send BW Test",
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::WriteBw => "RDMA_Write BW Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::AtomicLat => "Atomic FETCH_AND_ADD Latency Test",
            Test::AtomicBw => "Atomic FETCH_AND_ADD BW Test",
        }
    }
    pub(super) fn name(self) -> &'static str {
        match self {
            Test::SendLat => "send_lat",
            Test::SendBw => "send_bw",
            Test::WriteLat => "write_lat",
            Test::WriteBw => "write_bw",
            Test::ReadLat => "read_lat",
            Test::ReadBw => "read_bw",
            Test::AtomicLat => "atomic_lat",
            Test::AtomicBw => "atomic_bw",
        }
    }
    pub(super) fn is_send(self) -> bool {
        matches!(self, Test::SendLat | Test::SendBw)
    }
    pub(super) fn is_atomic(self) -> bool {
        matches!(self, Test::AtomicLat | Test::AtomicBw)
    }
}

/// Connection type (`-c`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Conn {
    /// Reliable connected.
    #[value(name = "RC")]
    Rc,
    /// Unreliable datagram (send tests only).
    #[value(name = "UD")]
    Ud,
}

/// Arguments of `softrdma perf`.
#[derive(Debug, clap::Args)]
pub struct PerfArgs {
    /// The benchmark.
    #[arg(value_enum)]
    pub test: Test,
    /// The server to connect to; without it, act as the server.
    pub host: Option<String>,
    /// Device name or address (default 127.0.0.1; --local uses 127.0.0.2 and .3).
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,
    /// IB port (only port 1 exists).
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    pub ib_port: u8,
    /// Message size (default: 65536 for the bandwidth tests, 2 for the latency tests, 8 for
    /// atomics; at most 2^31 bytes, RDMA's largest message).
    #[arg(short = 's', long, default_value_t = 0, hide_default_value = true)]
    pub size: usize,
    /// Iterations (default: 5000 for BW tests, 1000 for latency tests; at most 10^9 for BW
    /// tests and 10^8 for latency tests, which keep every sample).
    #[arg(short = 'n', long)]
    pub iters: Option<u64>,
    /// All sizes from 2 to 2^23.
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Run each size for this long instead of -n iterations (bandwidth tests only): seconds,
    /// or a number with a unit (ms, s, m, h).
    #[arg(short = 'D', long, value_parser = limits::duration)]
    pub duration: Option<Duration>,
    /// TCP port of the exchange (default 18515; with --local, one that is free).
    #[arg(short = 'p', long)]
    pub port: Option<u16>,
    /// Queue pairs (bandwidth tests; each runs -n iterations).
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    pub qps: u32,
    /// Connection type.
    #[arg(short = 'c', long, value_enum, default_value_t = Conn::Rc)]
    pub connection: Conn,
    /// The peer is Linux rxe or a RoCE NIC running perftest, not softrdma: its ICRCs are
    /// checked without the IPv4 Identification, and nothing goes to it in GSO trains.
    #[arg(long)]
    pub foreign: bool,
    /// Send to the peer through this address (IP and UDP port) instead of the one it
    /// gave: a `softrdma relay` that delays or drops on the way (RC and UC).
    #[arg(long, value_name = "ADDR")]
    pub via: Option<std::net::SocketAddr>,
    /// Sleep on a completion channel instead of busy-polling.
    #[arg(short = 'e', long)]
    pub events: bool,
    /// Largest message sent inline.
    #[arg(short = 'I', long = "inline_size", default_value_t = 0)]
    pub inline: u32,
    /// Operations in flight (BW tests).
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    pub tx_depth: u32,
    /// Signal every this many send work requests (bandwidth tests; perftest's CQ
    /// moderation, default 100; lowered to -t when that is smaller).
    #[arg(short = 'Q', long = "cq-mod")]
    pub cq_mod: Option<u32>,
    /// Local ACK timeout exponent of the QPs: 4.096 us x 2^N, N from 0 to 31 (default 14,
    /// 67 ms, as perftest).
    #[arg(short = 'u', long = "qp-timeout", default_value_t = 14)]
    pub qp_timeout: u8,
    /// Receives posted (send tests).
    #[arg(short = 'r', long = "rx-depth", default_value_t = 512)]
    pub rx_depth: u32,
    /// Accepted for compatibility (perftest's CPU frequency check).
    #[arg(short = 'F', long = "CPU-freq")]
    pub cpu_freq: bool,
    /// Report Gbit/s instead of MiB/s.
    #[arg(long = "report_gbits")]
    pub report_gbits: bool,
    /// GID index of the device to bind (`softrdma devinfo -v` lists the table).
    #[arg(short = 'x', long = "gid-index")]
    pub gid_index: Option<u32>,
    /// Path MTU: 256, 512, 1024, 2048 or 4096 (as perftest, another value runs at the
    /// port's active MTU, and one above it at the active MTU).
    #[arg(short = 'm', long)]
    pub mtu: Option<u32>,
    /// Print user and system CPU as a percentage of the elapsed time.
    #[arg(long = "cpu_util")]
    pub cpu_util: bool,
    /// Results as JSON lines instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Run the server too, as a second process on loopback.
    #[arg(long)]
    pub local: bool,
    /// Connect through the connection manager (perftest's rdma_cm mode): the exchange runs
    /// over an RC connection on rdma_cm port -p, and the QPs are connected by the CM.
    #[arg(short = 'R', long = "rdma_cm")]
    pub rdma_cm: bool,
    /// perftest options softrdma perf does not implement: each is refused with a line that
    /// names it, never ignored.
    #[command(flatten)]
    pub unsupported: Unsupported,
}

/// perftest's options that `softrdma perf` recognises but does not implement.
#[derive(Debug, Default, clap::Args)]
pub struct Unsupported {
    #[arg(short = 'b', long = "bidirectional", hide = true)]
    bidirectional: bool,
    #[arg(long = "report-both", hide = true)]
    report_both: bool,
    #[arg(long = "use-srq", hide = true)]
    use_srq: bool,
    #[arg(short = 'l', long = "post_list", hide = true)]
    post_list: Option<u32>,
    #[arg(long = "run_infinitely", hide = true)]
    run_infinitely: bool,
    #[arg(long = "out_json", hide = true)]
    out_json: bool,
    #[arg(long = "out_json_file", hide = true)]
    out_json_file: Option<String>,
    #[arg(short = 'T', long = "tos", hide = true)]
    tos: Option<u8>,
}

impl PerfArgs {
    /// The exchange's TCP port: -p, or perftest's 18515.
    pub(super) fn tcp_port(&self) -> u16 {
        self.port.unwrap_or(DEFAULT_PORT)
    }
}

/// perftest's default TCP port.
const DEFAULT_PORT: u16 = 18515;

impl Unsupported {
    /// The first option given, with what it would do.
    fn first(&self) -> Option<&'static str> {
        [
            (self.bidirectional, "-b (bidirectional traffic)"),
            (self.report_both, "--report-both (the server's own figures)"),
            (self.use_srq, "--use-srq (a shared receive queue)"),
            (self.post_list.is_some(), "-l/--post_list (several WRs per post)"),
            (self.run_infinitely, "--run_infinitely"),
            (self.out_json, "--out_json (use --json)"),
            (self.out_json_file.is_some(), "--out_json_file (use --json and redirect)"),
            (self.tos.is_some(), "-T/--tos (a traffic class)"),
        ]
        .into_iter()
        .find_map(|(given, what)| given.then_some(what))
    }
}

/// Most queue pairs one run opens (`-q`).
const MAX_QPS: u32 = 64;
/// Most iterations of a bandwidth test (`-n`).
const MAX_BW_ITERS: u64 = 1_000_000_000;
/// Most iterations of a latency test (`-n`): each keeps its sample, 8 bytes.
const MAX_LAT_ITERS: u64 = 100_000_000;

/// The device `-d` names (with `-x`, the GID only changes its address; without `-d`,
/// 127.0.0.1's): its limits are the ones the run must keep.
pub(super) fn device(args: &PerfArgs) -> Result<Device, Fail> {
    let name = args.device.as_deref().unwrap_or("127.0.0.1");
    softrdma::find_device(name).map_err(|e| format!("-d {name}: {e}"))
}

/// Refuses the options that cannot run, before anything is bound or allocated: every
/// count, size and depth against the device's limits and this host's memory.
pub(super) fn check(args: &PerfArgs) -> Result<(), Fail> {
    check_options(args)?;
    let dev = device(args)?;
    let attr = dev.attr();
    for (flag, v) in [("-t", args.tx_depth), ("-r", args.rx_depth)] {
        if v == 0 || v > attr.max_qp_wr {
            return Err(format!(
                "{flag} {v}: takes 1 to {} work requests (the device's max_qp_wr)",
                attr.max_qp_wr
            ));
        }
    }
    if args.inline > softrdma::MAX_INLINE {
        return Err(format!("-I {}: at most {} bytes are sent inline", args.inline, softrdma::MAX_INLINE));
    }
    let cqe = cq_entries(args);
    if cqe > u64::from(attr.max_cqe) {
        return Err(format!(
            "-t {} -r {} -q {}: the completion queue would need {cqe} entries, more than the device's max_cqe ({})",
            args.tx_depth, args.rx_depth, args.qps, attr.max_cqe
        ));
    }
    let sizes = sizes(args, mtu(args, dev.active_mtu()).0.bytes() as usize)?;
    let max = *sizes.iter().max().unwrap_or(&8);
    let what = if args.all { "-a".to_string() } else { format!("-s {}", args.size) };
    let what =
        if args.test.is_send() { format!("{what} -r {} -q {}", args.rx_depth, args.qps) } else { what };
    limits::check_regions(&what, &[region_len(args, max)], &attr)
}

/// The checks that need no device.
fn check_options(args: &PerfArgs) -> Result<(), Fail> {
    if let Some(what) = args.unsupported.first() {
        return Err(format!("{what}: not implemented by softrdma perf"));
    }
    if args.duration.is_some() && !args.test.is_bw() {
        return Err("-D runs the bandwidth tests for a time; the latency tests take -n iterations".into());
    }
    if args.cq_mod == Some(0) {
        return Err("-Q 0: signal at least every 1st work request".into());
    }
    if args.qp_timeout > 31 {
        return Err(format!("-u {}: the ACK timeout exponent is 0 to 31", args.qp_timeout));
    }
    if args.port == Some(0) {
        return Err("-p 0: the client must know the port of the exchange".into());
    }
    let most = if args.test.is_bw() { MAX_BW_ITERS } else { MAX_LAT_ITERS };
    if let Some(n) = args.iters.filter(|&n| n == 0 || n > most) {
        return Err(format!("-n {n}: takes 1 to {most} iterations"));
    }
    if args.size as u64 > MAX_MESSAGE {
        return Err(format!("-s {}: RDMA messages are at most {MAX_MESSAGE} bytes", args.size));
    }
    if args.qps == 0 || args.qps > MAX_QPS {
        return Err(format!("-q takes 1 to {MAX_QPS} queue pairs"));
    }
    if args.qps > 1 && !args.test.is_bw() {
        return Err("multiple queue pairs are for the bandwidth tests".into());
    }
    if args.ib_port != 1 {
        return Err(format!("-i {}: only IB port 1 exists", args.ib_port));
    }
    if args.connection == Conn::Ud && !args.test.is_send() {
        return Err("UD supports only the send tests".into());
    }
    if args.rdma_cm && args.connection == Conn::Ud {
        return Err("-R connects RC QPs only (UD over rdma_cm is not supported)".into());
    }
    Ok(())
}

/// Entries of the completion queue all QPs share: room for every send and receive.
pub(super) fn cq_entries(args: &PerfArgs) -> u64 {
    (u64::from(args.tx_depth.max(args.rx_depth)) * 2 + 16) * u64::from(args.qps.max(1))
}

/// The bytes of the one memory region of a run whose largest message is `max`, and its
/// layout: (region, one buffer, receive slots per QP). `None` when it overflows.
pub(super) fn region_len(args: &PerfArgs, max: usize) -> Option<u64> {
    layout(args, max).map(|l| l.0)
}

/// (region, buffer, receive slots per QP) of a run whose largest message is `max`:
/// receive slots of every QP (with the GRH area on UD), then the local buffer, then the
/// target of the peer's RDMA (which all QPs share). The target is at least the 4096-byte
/// cycle buffer we announce: perftest's small one-sided operations walk through that much
/// of the peer's memory. Receives walk the same way, as perftest's do: through as many
/// slots as fit in the cycle buffer when a message takes at most half of it, else all
/// into one (a slot per receive, 512 of 64 KiB, made the SEND benchmarks measure cache
/// misses: the receiver's stores into the slots cost three times what they cost into one).
pub(super) fn layout(args: &PerfArgs, max: usize) -> Option<(u64, usize, usize)> {
    let slot = max.checked_add(if args.connection == Conn::Ud { 40 } else { 0 })?;
    let buf = slot.max(8).checked_next_multiple_of(64)?;
    let slots = match args.test.is_send() {
        true if buf <= super::CYCLE_BUFFER / 2 => {
            (super::CYCLE_BUFFER / buf).min(args.rx_depth.max(1) as usize)
        }
        _ => 1,
    };
    let target = buf.max(super::CYCLE_BUFFER);
    let len = buf
        .checked_mul(slots)?
        .checked_mul(args.qps.max(1) as usize)?
        .checked_add(buf)?
        .checked_add(target)?;
    Some((u64::try_from(len).ok()?, buf, slots))
}

/// The path MTU a run uses, as perftest's `set_mtu` chooses it: `-m` if it is an IB MTU
/// no larger than the port's `active`, else `active`; and the warning perftest prints when
/// it does not run at `-m`.
pub(super) fn mtu(args: &PerfArgs, active: Mtu) -> (Mtu, Option<String>) {
    let Some(m) = args.mtu else { return (active, None) };
    let asked = match m {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => {
            let why = format!(
                "invalid MTU {m}: the MTU is one of 256, 512, 1024, 2048, 4096; running at the port's active MTU, {}",
                active.bytes()
            );
            return (active, Some(why));
        }
    };
    if asked.bytes() > active.bytes() {
        let why = format!("MTU {m} is above the port's active MTU: running at {}", active.bytes());
        return (active, Some(why));
    }
    (asked, None)
}

/// Signaled send WRs of the bandwidth tests: every `CQ_MOD`-th, or every `-t`-th when
/// fewer are in flight (perftest lowers its CQ moderation to the TX depth, so that a full
/// send queue always holds a signaled WR).
pub(super) fn cq_mod(args: &PerfArgs) -> u64 {
    args.cq_mod.map_or(CQ_MOD, u64::from).min(u64::from(args.tx_depth.max(1)))
}

/// The message sizes to run, given the device's active MTU (which bounds UD messages).
pub(super) fn sizes(args: &PerfArgs, active_mtu: usize) -> Result<Vec<usize>, Fail> {
    let sizes: Vec<usize> = if args.all {
        (1..=23).map(|k| 1usize << k).filter(|&s| !args.test.is_atomic() || s == 8).collect()
    } else if args.test.is_atomic() {
        vec![8]
    } else {
        vec![if args.size == 0 {
            if args.test.is_bw() {
                65536
            } else {
                2
            }
        } else {
            args.size
        }]
    };
    let ud = args.connection == Conn::Ud;
    let mut sizes = sizes;
    if ud && args.all {
        // As perftest: with UD, -a stops at the MTU.
        sizes.retain(|&s| s <= active_mtu);
    }
    let max = *sizes.iter().max().unwrap_or(&8);
    if ud && max > active_mtu {
        return Err(format!("-s {max}: UD messages are at most one MTU ({active_mtu} bytes)"));
    }
    Ok(sizes)
}

pub(super) fn server_flags(a: &PerfArgs) -> Vec<String> {
    let mut v = vec![
        "-s".into(),
        a.size.to_string(),
        "-t".into(),
        a.tx_depth.to_string(),
        "-r".into(),
        a.rx_depth.to_string(),
    ];
    v.extend(["-c".into(), if a.connection == Conn::Ud { "UD".into() } else { "RC".into() }]);
    if let Some(n) = a.iters {
        v.extend(["-n".into(), n.to_string()]);
    }
    if let Some(d) = a.duration {
        v.extend(["-D".into(), d.as_secs_f64().to_string()]);
    }
    if let Some(m) = a.mtu {
        v.extend(["-m".into(), m.to_string()]);
    }
    if let Some(q) = a.cq_mod {
        v.extend(["-Q".into(), q.to_string()]);
    }
    v.extend(["-u".into(), a.qp_timeout.to_string()]);
    for (on, flag) in [(a.all, "-a"), (a.events, "-e"), (a.report_gbits, "--report_gbits"), (a.rdma_cm, "-R")]
    {
        if on {
            v.push(flag.into());
        }
    }
    v.extend(["-I".into(), a.inline.to_string(), "-q".into(), a.qps.to_string()]);
    v
}

pub(super) fn clone_args(a: &PerfArgs) -> PerfArgs {
    PerfArgs {
        test: a.test,
        host: a.host.clone(),
        device: a.device.clone(),
        ib_port: a.ib_port,
        size: a.size,
        iters: a.iters,
        all: a.all,
        duration: a.duration,
        port: a.port,
        qps: a.qps,
        connection: a.connection,
        foreign: a.foreign,
        via: a.via,
        events: a.events,
        inline: a.inline,
        tx_depth: a.tx_depth,
        rx_depth: a.rx_depth,
        cpu_freq: a.cpu_freq,
        report_gbits: a.report_gbits,
        gid_index: a.gid_index,
        mtu: a.mtu,
        cpu_util: a.cpu_util,
        json: a.json,
        local: a.local,
        rdma_cm: a.rdma_cm,
        cq_mod: a.cq_mod,
        qp_timeout: a.qp_timeout,
        unsupported: Unsupported::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::PerfArgs;

    fn args(line: &str) -> PerfArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            perf: PerfArgs,
        }
        <Cli as clap::Parser>::parse_from(std::iter::once("perf").chain(line.split_whitespace())).perf
    }

    /// Receive slots walk the 4096-byte cycle buffer as perftest's receives do: as many as
    /// fit when a message takes at most half of it (no more than the receive queue holds),
    /// else one.
    #[test]
    fn receives_walk_the_cycle_buffer_as_perftests_do() {
        let slots = |line: &str, max: usize| super::layout(&args(line), max).unwrap().2;
        assert_eq!(slots("send_bw", 65536), 1);
        assert_eq!(slots("send_bw", 4096), 1);
        assert_eq!(slots("send_bw", 2048), 2);
        assert_eq!(slots("send_bw", 2), 64);
        assert_eq!(slots("send_bw -r 8", 2), 8);
        assert_eq!(slots("send_bw -c UD", 2048), 1, "a slot holds the GRH area too");
        assert_eq!(slots("write_bw", 2), 1, "no receives");
        let (len, buf, _) = super::layout(&args("send_bw -q 2"), 65536).unwrap();
        assert_eq!(buf, 65536);
        assert_eq!(len, 4 * 65536, "two QPs' slots, the local buffer and the target");
    }
}
