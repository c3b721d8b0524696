//! `softrdma perf`'s command line: the benchmark, perftest's options, and their checks;
//! and the server's command line for `--local`.

use super::Fail;

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
    /// Message size.
    #[arg(short = 's', long, default_value_t = 0)]
    pub size: usize,
    /// Iterations (default: 5000 for BW tests, 1000 for latency tests).
    #[arg(short = 'n', long)]
    pub iters: Option<u64>,
    /// All sizes from 2 to 2^23.
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Run each size for this many seconds instead of -n iterations (BW tests).
    #[arg(short = 'D', long)]
    pub duration: Option<f64>,
    /// TCP port of the exchange.
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub port: u16,
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
    /// Sleep on a completion channel instead of busy-polling.
    #[arg(short = 'e', long)]
    pub events: bool,
    /// Largest message sent inline.
    #[arg(short = 'I', long = "inline_size", default_value_t = 0)]
    pub inline: u32,
    /// Operations in flight (BW tests).
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    pub tx_depth: u32,
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
    /// Path MTU (256..4096).
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
}

/// Most queue pairs one run opens (`-q`).
const MAX_QPS: u32 = 64;

/// Refuses the combinations of options that cannot run.
pub(super) fn check(args: &PerfArgs) -> Result<(), Fail> {
    if args.qps == 0 || args.qps > MAX_QPS {
        return Err(format!("-q takes 1 to {MAX_QPS} queue pairs"));
    }
    if args.qps > 1 && !args.test.is_bw() {
        return Err("multiple queue pairs are for the bandwidth tests".into());
    }
    if args.ib_port != 1 {
        return Err("only IB port 1 exists".into());
    }
    if args.connection == Conn::Ud && !args.test.is_send() {
        return Err("UD supports only the send tests".into());
    }
    if args.rdma_cm && args.connection == Conn::Ud {
        return Err("-R connects RC QPs only (UD over rdma_cm is not supported)".into());
    }
    Ok(())
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
        return Err("UD messages are at most one MTU".into());
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
        v.extend(["-D".into(), d.to_string()]);
    }
    if let Some(m) = a.mtu {
        v.extend(["-m".into(), m.to_string()]);
    }
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
    }
}
