//! `softrdma perf`: perftest's benchmarks (`ib_send_bw`, `ib_write_lat`, ...) on softrdma,
//! with perftest's option names, its connection exchange and its output.
//!
//! The server runs without a host; the client connects to it on TCP port 18515 (`-p`).
//! The exchange follows perftest's framing: a 16-byte version string, the cycle buffer and
//! cache line sizes (4 bytes each), the MTU (2 bytes), then one 108-byte
//! `lid:out_reads:qpn:psn:rkey:vaddr:gid:srqn:` message each way, repeated as a barrier.
//! perftest's messages carry no UDP port: both sides use the device port (4791, or
//! `SOFTRDMA_PORT`). After the run the client sends its results as one more line, so
//! the server can print the same table.
//!
//! Bandwidth tests: the client keeps `-t` operations in flight (signaling every
//! `CQ_MOD`th) and reports peak and average MiB/s and the message rate; the peak is the
//! best of ten equal slices of the run. Latency tests report one-way latency (half a round
//! trip) for SEND and WRITE ping-pongs, and the whole operation for READ and atomics, as
//! perftest does: min, max, typical (median), average, standard deviation and the 99%
//! and 99.9% percentiles. `--local` runs the server as a second process on loopback, so
//! one command needs no set-up.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use softrdma::{
    Access, CompletionChannel, CompletionQueue, ConnectOptions, Context, EndpointInfo, MemoryRegion, Mtu,
    Qkey, QpBuilder, QpCaps, QueuePair, RecvWr, RemoteRegion, Rkey, SendFlags, SendOp, SendWr, UdDest,
    WcOpcode, WcStatus, WorkCompletion,
};

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
    fn is_bw(self) -> bool {
        matches!(self, Test::SendBw | Test::WriteBw | Test::ReadBw | Test::AtomicBw)
    }
    fn title(self) -> &'static str {
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
    fn name(self) -> &'static str {
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
    fn is_send(self) -> bool {
        matches!(self, Test::SendLat | Test::SendBw)
    }
    fn is_atomic(self) -> bool {
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
    /// GID index (only index 0 exists; accepted for compatibility).
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
}

type Fail = String;

/// Operations between signaled ones in BW tests (perftest's CQ moderation).
const CQ_MOD: u64 = 100;
/// The cycle buffer size of perftest's exchange.
const CYCLE_BUFFER: usize = 4096;
/// Most queue pairs one run opens (`-q`).
const MAX_QPS: u32 = 64;
const VERSION: &[u8; 16] = b"6.06\0\0\0\0\0\0\0\0\0\0\0\0";
const LINE: &str = "---------------------------------------------------------------------------------------";
const QKEY: Qkey = Qkey(0x1111_1111);

/// Runs the command; returns the process exit status.
pub fn run(args: &PerfArgs) -> i32 {
    match perf(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("softrdma perf: {e}");
            1
        }
    }
}

fn perf(args: &PerfArgs) -> Result<(), Fail> {
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
    if args.local {
        return local(args);
    }
    let addr = match &args.device {
        Some(d) => softrdma::find_device(d).map_err(|e| e.to_string())?.addr,
        None => IpAddr::V4(Ipv4Addr::LOCALHOST),
    };
    let ctx = Context::open(addr).map_err(|e| e.to_string())?;
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
        sizes.retain(|&s| s <= ctx.device().active_mtu().bytes() as usize);
    }
    let max = *sizes.iter().max().unwrap_or(&8);
    if ud && max > ctx.device().active_mtu().bytes() as usize {
        return Err("UD messages are at most one MTU".into());
    }
    let mut s = Session::new(args, ctx, max)?;
    let mut stream = s.exchange()?;
    s.header();
    if args.json {
        // The table is replaced by JSON lines.
    } else if args.test.is_bw() {
        let unit = if args.report_gbits { "Gb/sec" } else { "MiB/sec" };
        println!(" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]");
    } else {
        println!(
            " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
        );
    }
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    for (k, &size) in sizes.iter().enumerate() {
        if tty && sizes.len() > 1 {
            eprint!("\r[{}/{}] {} bytes ", k + 1, sizes.len(), size);
        }
        // perftest's barrier before each run: the first QP's message again.
        swap(&mut stream, s.client, &s.key())?;
        let cpu0 = cpu_times();
        let t0 = Instant::now();
        let result = if s.client { s.run_client(size)? } else { s.run_server(size, &mut stream)? };
        let elapsed = t0.elapsed().as_secs_f64();
        let cpu = cpu_times().map(|c| (c.0 - cpu0.map_or(0.0, |z| z.0), c.1 - cpu0.map_or(0.0, |z| z.1)));
        // One-sided BW tests: the client's numbers are the results, and it tells the server
        // the way perftest does. send_bw and the latency tests: each side reports what it
        // measured.
        let one_sided_bw = args.test.is_bw() && !args.test.is_send();
        let result = if one_sided_bw { s.report(&mut stream, size, result)? } else { result };
        if s.client || !result.lat.is_empty() || args.test.is_bw() {
            print_result(args, size, &result, cpu.map(|(u, s)| (100.0 * u / elapsed, 100.0 * s / elapsed)));
        }
    }
    // perftest's goodbye: the message once more, then "done" from the server first; its
    // write_lat just closes the connection.
    if args.test != Test::WriteLat {
        swap(&mut stream, s.client, &s.key())?;
        swap(&mut stream, !s.client, b"done\0")?;
    }
    if tty && sizes.len() > 1 {
        eprintln!();
    }
    if !args.json {
        println!("{LINE}");
    }
    Ok(())
}

/// Spawns the server as a second process and runs the client against it.
fn local(args: &PerfArgs) -> Result<(), Fail> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.arg("perf").arg(args.test.name()).args(["-d", "127.0.0.2", "-p", &args.port.to_string()]);
    cmd.args(server_flags(args)).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut server = ServerGuard(cmd.spawn().map_err(|e| e.to_string())?);
    let client = PerfArgs {
        local: false,
        device: Some("127.0.0.3".into()),
        host: Some("127.0.0.1".into()),
        ..clone_args(args)
    };
    let r = perf(&client);
    let status = server.0.wait().map_err(|e| e.to_string())?;
    let mut err = String::new();
    if let Some(mut e) = server.0.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    r?;
    if !status.success() {
        return Err(format!("server failed: {}", err.trim()));
    }
    Ok(())
}

struct ServerGuard(Child);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn server_flags(a: &PerfArgs) -> Vec<String> {
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
    for (on, flag) in [(a.all, "-a"), (a.events, "-e"), (a.report_gbits, "--report_gbits")] {
        if on {
            v.push(flag.into());
        }
    }
    v.extend(["-I".into(), a.inline.to_string(), "-q".into(), a.qps.to_string()]);
    v
}

fn clone_args(a: &PerfArgs) -> PerfArgs {
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
    }
}

/// The client's measurements for one size.
#[derive(Debug, Clone, Serialize, serde::Deserialize, Default)]
struct Measured {
    iters: u64,
    /// BW tests: bytes per second, average and peak.
    bw_avg: f64,
    bw_peak: f64,
    /// Latency tests: microseconds.
    lat: Vec<f64>,
}

fn print_result(args: &PerfArgs, size: usize, m: &Measured, cpu: Option<(f64, f64)>) {
    if args.test.is_bw() {
        let scale = |bps: f64| if args.report_gbits { bps * 8.0 / 1e9 } else { bps / (1 << 20) as f64 };
        let rate = m.bw_avg / size.max(1) as f64 / 1e6;
        if args.json {
            let j = serde_json::json!({"test": args.test.name(), "bytes": size, "iterations": m.iters,
                "bw_peak": scale(m.bw_peak), "bw_average": scale(m.bw_avg), "msg_rate_mpps": rate,
                "unit": if args.report_gbits { "Gb/sec" } else { "MiB/sec" },
                "cpu_user_pct": cpu.map(|c| c.0), "cpu_sys_pct": cpu.map(|c| c.1)});
            println!("{j}");
        } else {
            println!(
                " {:<10} {:<10}       {:<10.2}         {:<10.2}        {:.6}",
                size,
                m.iters,
                scale(m.bw_peak),
                scale(m.bw_avg),
                rate
            );
        }
    } else {
        let mut v = m.lat.clone();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let pick = |q: f64| {
            v.get(((v.len() as f64 * q).ceil() as usize).saturating_sub(1).min(v.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0)
        };
        // `+ 0.0`: an empty sum is -0.0, which would print as "-0.00".
        let avg = v.iter().sum::<f64>() / n + 0.0;
        let sd = (v.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n).sqrt() + 0.0;
        let (min, max, typ) =
            (v.first().copied().unwrap_or(0.0), v.last().copied().unwrap_or(0.0), pick(0.5));
        if args.json {
            let j = serde_json::json!({"test": args.test.name(), "bytes": size, "iterations": m.iters,
                "t_min": min, "t_max": max, "t_typical": typ, "t_avg": avg, "t_stdev": sd,
                "p99": pick(0.99), "p99_9": pick(0.999),
                "cpu_user_pct": cpu.map(|c| c.0), "cpu_sys_pct": cpu.map(|c| c.1)});
            println!("{j}");
        } else {
            println!(
                " {:<7} {:<10}   {:<10.2}     {:<10.2}   {:<10.2}       {:<10.2}     {:<10.2}     {:<10.2}             {:.2}",
                size, m.iters, min, max, typ, avg, sd, pick(0.99), pick(0.999)
            );
        }
    }
    if let (Some((u, s)), false, true) = (cpu, args.json, args.cpu_util) {
        println!(" CPU: user {u:.1}% sys {s:.1}% of elapsed");
    }
}

/// User and system CPU seconds of this process.
fn cpu_times() -> Option<(f64, f64)> {
    // SAFETY: getrusage fills the rusage we pass; all-zero is a valid initial value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return None;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    Some((t(ru.ru_utime), t(ru.ru_stime)))
}

struct Session<'a> {
    args: &'a PerfArgs,
    ctx: Context,
    client: bool,
    cq: CompletionQueue,
    channel: Option<CompletionChannel>,
    mr: MemoryRegion,
    /// The connected queue pairs (`-q` of them), once the exchange is over.
    qps: Vec<QueuePair>,
    prepared: Vec<softrdma::PreparedQp>,
    /// The peer's memory: one region behind all its QPs.
    remote: Option<RemoteRegion>,
    ud_dests: Vec<UdDest>,
    mine: Vec<EndpointInfo>,
    theirs: Vec<EndpointInfo>,
    buf: usize,
    /// Receive slots per QP (SEND tests) and buffers in each.
    slots: usize,
    /// Offset of the buffer that is sent from, written to and read into: after the
    /// receive slots.
    local: usize,
    /// Receives posted so far, per QP.
    posted_recvs: Vec<u64>,
}

impl<'a> Session<'a> {
    fn new(args: &'a PerfArgs, ctx: Context, max: usize) -> Result<Session<'a>, Fail> {
        let client = args.host.is_some();
        let pd = ctx.alloc_pd();
        let channel = if args.events { Some(ctx.create_channel().map_err(|e| e.to_string())?) } else { None };
        let nq = args.qps.max(1) as usize;
        let depth = ((args.tx_depth.max(args.rx_depth) as usize * 2 + 16) * nq).min(softrdma::MAX_CQE);
        let cq = ctx.create_cq(depth, channel.as_ref()).map_err(|e| e.to_string())?;
        let ud = args.connection == Conn::Ud;
        // One buffer per receive slot for SEND tests (with the GRH area on UD), one for the rest.
        let slot = max + if ud { 40 } else { 0 };
        let buf = slot.max(8).next_multiple_of(64);
        let slots = if args.test.is_send() { args.rx_depth.max(1) as usize } else { 1 };
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        // Receive slots of every QP, then the local buffer, then the target of the peer's
        // RDMA (which all QPs share).
        // The target is at least the 4096-byte cycle buffer we announce: perftest's small
        // one-sided operations walk through that much of the peer's memory.
        let target = buf.max(CYCLE_BUFFER);
        let mr = pd.register(buf * slots * nq + buf + target, access).map_err(|e| e.to_string())?;
        let caps = QpCaps {
            max_send_wr: args.tx_depth.clamp(1, softrdma::MAX_QP_WR),
            max_recv_wr: args.rx_depth.clamp(1, softrdma::MAX_QP_WR),
            max_inline_data: args.inline.min(softrdma::MAX_INLINE),
            ..QpCaps::default()
        };
        let b = if ud { QpBuilder::ud(QKEY) } else { QpBuilder::rc().access(access) }.caps(caps);
        let mut prepared = Vec::with_capacity(nq);
        let mut mine = Vec::with_capacity(nq);
        for _ in 0..nq {
            let p = pd.prepare_qp(&b, &cq, &cq).map_err(|e| e.to_string())?;
            let mut e = p.endpoint();
            if let Some(m) = args.mtu {
                e.mtu = e.mtu.min(m);
            }
            // The peer's RDMA lands after our receive slots and local buffer; perftest, as
            // peer, targets exactly what we advertise.
            let r = mr.remote();
            e.region = Some(RemoteRegion {
                addr: r.addr + (buf * slots * nq + buf) as u64,
                len: target as u64,
                rkey: r.rkey,
            });
            prepared.push(p);
            mine.push(e);
        }
        let mut s = Session {
            args,
            ctx,
            client,
            cq,
            channel,
            mr,
            qps: Vec::new(),
            prepared,
            remote: None,
            ud_dests: Vec::new(),
            mine,
            theirs: Vec::new(),
            buf,
            slots,
            local: buf * slots * nq,
            posted_recvs: vec![0; nq],
        };
        if args.test.is_send() {
            for q in 0..nq {
                for _ in 0..args.rx_depth {
                    s.post_recv(q)?;
                }
            }
        }
        Ok(s)
    }

    /// Posts the next receive of QP `q` (into its next slot, round robin).
    fn post_recv(&mut self, q: usize) -> Result<(), Fail> {
        let k = self.posted_recvs[q];
        let slot = q * self.slots + (k % self.slots as u64) as usize;
        let sge = self.mr.sge(slot * self.buf, self.buf).map_err(|e| e.to_string())?;
        let wr = RecvWr { wr_id: k, sg_list: vec![sge] };
        let r = match (self.qps.get(q), self.prepared.get(q)) {
            (Some(qp), _) => qp.post_recv(wr),
            (None, Some(p)) => p.post_recv(wr),
            _ => return Err("no QP".into()),
        };
        self.posted_recvs[q] += 1;
        r.map_err(|e| e.to_string())
    }

    /// Which of our QPs a completion belongs to.
    fn lane(&self, wc: &WorkCompletion) -> Result<usize, Fail> {
        self.qps.iter().position(|q| q.qpn() == wc.qp_num).ok_or_else(|| "completion of an unknown QP".into())
    }

    /// perftest's exchange: version, cycle buffer, cache line, MTU, then the QP message.
    fn exchange(&mut self) -> Result<TcpStream, Fail> {
        let args = self.args;
        let mut s = connect(args)?;
        let mtu_enum =
            [256u32, 512, 1024, 2048, 4096].iter().position(|&m| m == self.mine[0].mtu).map_or(3, |p| p + 1);
        let mut msgs: Vec<Vec<u8>> = vec![
            VERSION.to_vec(),
            (CYCLE_BUFFER as u32).to_be_bytes().to_vec(),
            64u32.to_be_bytes().to_vec(),
        ];
        msgs.push(vec![b'0' + mtu_enum as u8, 0]);
        let mut theirs_mtu = mtu_enum;
        for (i, m) in msgs.iter().enumerate() {
            let got = swap(&mut s, self.client, m)?;
            if i == 0 && !got.starts_with(b"6.") {
                return Err("the peer is not a perftest-compatible benchmark".into());
            }
            if i == 3 {
                theirs_mtu = usize::from(got[0].saturating_sub(b'0'));
            }
        }
        let mtu = [Mtu::Mtu256, Mtu::Mtu512, Mtu::Mtu1024, Mtu::Mtu2048, Mtu::Mtu4096]
            .get(mtu_enum.min(theirs_mtu).clamp(1, 5) - 1)
            .copied();
        // One message per QP, in order: the peer's i-th QP is the partner of our i-th.
        for mine in &self.mine {
            let theirs = parse_key_message(&swap(&mut s, self.client, &key_message(mine))?)?;
            self.theirs.push(EndpointInfo {
                addr: SocketAddr::new(theirs.0, softrdma::default_port()),
                qpn: theirs.1,
                psn: theirs.2,
                mtu: mtu.map_or(1024, |m| m.bytes()),
                region: Some(RemoteRegion { addr: theirs.4, len: u64::MAX, rkey: theirs.3 }),
            });
        }
        for (prepared, remote) in std::mem::take(&mut self.prepared).into_iter().zip(&self.theirs) {
            let qp = if self.args.connection == Conn::Ud {
                self.ud_dests.push(UdDest {
                    addr: remote.addr,
                    qpn: softrdma::Qpn::new(remote.qpn),
                    qkey: QKEY,
                    traffic_class: 0,
                });
                prepared.ready().inspect(|q| q.set_foreign_peer(self.args.foreign))
            } else {
                let foreign_peer = self.args.foreign;
                prepared.handshake(remote, &ConnectOptions { mtu, foreign_peer, ..ConnectOptions::default() })
            }
            .map_err(|e| e.to_string())?;
            self.qps.push(qp);
        }
        self.remote = self.theirs.first().and_then(|t| t.region);
        // perftest repeats the first message as a barrier once all QPs are ready, and once
        // more except in the one-sided BW tests.
        swap(&mut s, self.client, &self.key())?;
        if self.args.test.is_send() || !self.args.test.is_bw() {
            swap(&mut s, self.client, &self.key())?;
        }
        Ok(s)
    }

    /// The message of our first QP, which perftest swaps as a barrier.
    fn key(&self) -> Vec<u8> {
        key_message(&self.mine[0])
    }

    /// perftest's BW report after each run: a barrier, then five 8-byte big-endian fields
    /// (size, iterations, peak MiB/s, average MiB/s, message rate in Mpps), each sent by the
    /// client and answered by the server. Returns the client's numbers on both sides.
    fn report(&self, stream: &mut TcpStream, size: usize, m: Measured) -> Result<Measured, Fail> {
        swap(stream, self.client, &self.key())?;
        const MIB: f64 = 1_048_576.0;
        let rate = if size == 0 { 0.0 } else { m.bw_avg / size as f64 / 1e6 };
        let mine: [u64; 5] = if self.client {
            [size as u64, m.iters, (m.bw_peak / MIB).to_bits(), (m.bw_avg / MIB).to_bits(), rate.to_bits()]
        } else {
            [0; 5]
        };
        let mut got = [0u64; 5];
        for (g, v) in got.iter_mut().zip(mine) {
            let b = swap(stream, self.client, &v.to_be_bytes())?;
            *g = u64::from_be_bytes(b.try_into().map_err(|_| "short report")?);
        }
        if self.client {
            return Ok(m);
        }
        if got[0] != size as u64 {
            return Err(format!("the client reported size {}, expected {size}", got[0]));
        }
        let f = |bits: u64| f64::from_bits(bits) * MIB;
        Ok(Measured { iters: got[1], bw_peak: f(got[2]), bw_avg: f(got[3]), lat: Vec::new() })
    }

    fn header(&self) {
        if self.args.json {
            return;
        }
        let a = self.args;
        let d = self.ctx.device();
        println!("{LINE}");
        println!("                    {}", a.test.title());
        println!(" Dual-port       : OFF\t\tDevice         : {}", d.name);
        println!(" Number of qps   : {}\t\tTransport type : IB", a.qps);
        let conn = if a.connection == Conn::Ud { "UD" } else { "RC" };
        println!(" Connection type : {conn}\t\tUsing SRQ      : OFF");
        if self.client || !a.test.is_bw() {
            println!(" TX depth        : {}", if a.test.is_bw() { a.tx_depth } else { 1 });
        }
        if a.test.is_bw() {
            println!(" CQ Moderation   : {CQ_MOD}");
        }
        println!(" Mtu             : {}[B]", self.mine[0].mtu);
        println!(" Link type       : Ethernet");
        println!(" GID index       : 0");
        println!(" Max inline data : {}[B]", a.inline);
        println!(" rdma_cm QPs\t : OFF");
        println!(" Data ex. method : Ethernet");
        println!("{LINE}");
        let gid =
            |a: IpAddr| softrdma::gid_of(a).iter().map(|b| format!("{b:02}")).collect::<Vec<_>>().join(":");
        let ends = self.mine.iter().map(|e| ("local", e)).chain(self.theirs.iter().map(|e| ("remote", e)));
        for (which, e) in ends {
            let r = e.region.unwrap_or(RemoteRegion { addr: 0, len: 0, rkey: 0 });
            if a.test.is_send() {
                println!(" {which} address: LID 0000 QPN {:#06x} PSN {:#08x}", e.qpn, e.psn);
            } else {
                println!(
                    " {which} address: LID 0000 QPN {:#06x} PSN {:#08x} RKey {:#08x} VAddr {:#016x}",
                    e.qpn, e.psn, r.rkey, r.addr
                );
            }
            println!(" GID: {}", gid(e.addr.ip()));
        }
        println!("{LINE}");
    }

    fn wait(&self) -> Result<WorkCompletion, Fail> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(wc) = self.cq.poll_one() {
                if wc.status != WcStatus::Success {
                    return Err(format!("completion with error: {:?} ({:?})", wc.status, wc.opcode));
                }
                return Ok(wc);
            }
            if Instant::now() > deadline {
                return Err("timed out waiting for a completion".into());
            }
            if let Some(ch) = &self.channel {
                self.cq.req_notify(false).map_err(|e| e.to_string())?;
                if let Some(wc) = self.cq.poll_one() {
                    return if wc.status == WcStatus::Success {
                        Ok(wc)
                    } else {
                        Err(format!("{:?}", wc.status))
                    };
                }
                // Bounded, so that a lost message ends the run with an error, not a hang.
                if ch
                    .get_event_timeout(deadline.saturating_duration_since(Instant::now()))
                    .map_err(|e| e.to_string())?
                    .is_some()
                {
                    ch.ack_events(1);
                }
            }
        }
    }

    fn qp(&self, q: usize) -> Result<&QueuePair, Fail> {
        self.qps.get(q).ok_or_else(|| "not connected".into())
    }

    fn op(&self, size: usize) -> SendOp {
        let r = self.remote.unwrap_or(RemoteRegion { addr: 0, len: 0, rkey: 0 });
        // The target the peer advertised (for softrdma, apart from the buffer it sends from).
        let (remote_addr, rkey) = (r.addr, Rkey(r.rkey));
        match self.args.test {
            Test::SendLat | Test::SendBw => SendOp::Send,
            Test::WriteLat | Test::WriteBw => SendOp::Write { remote_addr, rkey },
            Test::ReadLat | Test::ReadBw => SendOp::Read { remote_addr, rkey },
            Test::AtomicLat | Test::AtomicBw => {
                let _ = size;
                SendOp::FetchAdd { remote_addr, rkey, add: 1 }
            }
        }
    }

    fn wr(&self, q: usize, size: usize, wr_id: u64, signaled: bool) -> Result<SendWr, Fail> {
        let sge = self.mr.sge(self.local, size).map_err(|e| e.to_string())?;
        let one_sided_in =
            matches!(self.args.test, Test::ReadLat | Test::ReadBw) || self.args.test.is_atomic();
        let inline = (size as u32) <= self.args.inline && !one_sided_in;
        let flags = SendFlags { signaled, inline, ..SendFlags::default() };
        Ok(SendWr { wr_id, op: self.op(size), sg_list: vec![sge], flags, ud: self.ud_dests.get(q).copied() })
    }

    /// Posts on QP `q`.
    fn post(&self, q: usize, size: usize, wr_id: u64, signaled: bool) -> Result<(), Fail> {
        let wr = self.wr(q, size, wr_id, signaled)?;
        self.qp(q)?.post_send(wr).map_err(|e| e.to_string())
    }

    fn iters(&self) -> u64 {
        self.args.iters.unwrap_or(if self.args.test.is_bw() { 5000 } else { 1000 })
    }

    fn run_client(&mut self, size: usize) -> Result<Measured, Fail> {
        if self.args.test.is_bw() {
            self.client_bw(size)
        } else {
            self.client_lat(size)
        }
    }

    /// The bandwidth tests: every QP keeps up to `-t` WRs in flight and runs `-n` of them
    /// (or posts until `-D` seconds are over).
    fn client_bw(&mut self, size: usize) -> Result<Measured, Fail> {
        let iters = self.iters();
        let deadline = self.args.duration.map(|d| Instant::now() + Duration::from_secs_f64(d));
        let depth = u64::from(self.args.tx_depth.max(1));
        let nq = self.qps.len();
        // Per QP: WRs posted, completed, and covered by a signaled WR.
        let (mut posted, mut done, mut signaled_to) = (vec![0u64; nq], vec![0u64; nq], vec![0u64; nq]);
        let mut marks = Vec::new();
        let start = Instant::now();
        loop {
            let time_left = deadline.is_none_or(|t| Instant::now() < t);
            let mut finished = true;
            for q in 0..nq {
                let more = time_left && (deadline.is_some() || posted[q] < iters);
                // Post as many as the depth allows in one call (one system call for all).
                let mut batch = Vec::new();
                while more && posted[q] - done[q] < depth && (deadline.is_some() || posted[q] < iters) {
                    // Signal every CQ_MOD-th WR, and the last one.
                    let p = posted[q];
                    let signaled = (p + 1) % CQ_MOD == 0 || (deadline.is_none() && p + 1 == iters);
                    batch.push(self.wr(q, size, p, signaled)?);
                    posted[q] += 1;
                    if signaled {
                        signaled_to[q] = posted[q];
                    }
                }
                if !batch.is_empty() {
                    self.qp(q)?.post_send_many(batch).map_err(|(_, e)| e.to_string())?;
                }
                if !more && signaled_to[q] < posted[q] {
                    // The run ended off a CQ_MOD boundary: one signaled WR covers the rest.
                    self.post(q, size, posted[q], true)?;
                    posted[q] += 1;
                    signaled_to[q] = posted[q];
                }
                finished &= !more && done[q] == posted[q];
            }
            if finished {
                break;
            }
            let wc = self.wait()?;
            let q = self.lane(&wc)?;
            done[q] = done[q].max((wc.wr_id + 1).min(posted[q]));
            marks.push((done.iter().sum(), start.elapsed().as_secs_f64()));
        }
        let total = start.elapsed().as_secs_f64();
        let all: u64 = done.iter().sum();
        let bytes = size as f64 * all as f64;
        let peak = peak(&marks, size).max(bytes / total);
        // perftest reports the iterations of one QP and the bandwidth of all.
        Ok(Measured { iters: all / nq as u64, bw_avg: bytes / total, bw_peak: peak, lat: Vec::new() })
    }

    fn client_lat(&mut self, size: usize) -> Result<Measured, Fail> {
        let iters = self.iters();
        if self.args.test == Test::WriteLat {
            // As perftest: the server writes first and the client answers; a round trip is
            // the time between two arrivals.
            let mut laps = Lap::default();
            for i in 0..iters {
                self.wait_mark(size, i)?;
                laps.lap();
                self.write_mark(size, i)?;
            }
            return Ok(Measured { iters, lat: laps.0, ..Measured::default() });
        }
        let mut lat = Vec::with_capacity(iters as usize);
        for i in 0..iters {
            let t = Instant::now();
            if self.args.test == Test::SendLat {
                self.post(0, size, i, true)?;
                self.wait_kind(WcOpcode::Recv)?;
                self.post_recv(0)?;
                lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            } else {
                self.post(0, size, i, true)?;
                self.wait()?;
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok(Measured { iters, bw_avg: 0.0, bw_peak: 0.0, lat })
    }

    /// Waits for a completion of `kind`, taking any others (our sends) on the way.
    fn wait_kind(&self, kind: WcOpcode) -> Result<(), Fail> {
        loop {
            if self.wait()?.opcode == kind {
                return Ok(());
            }
        }
    }

    /// write_lat: writes iteration `i` into the peer's buffer; its last byte changes last.
    fn write_mark(&self, size: usize, i: u64) -> Result<(), Fail> {
        let mut msg = vec![(i % 251) as u8; size.max(1)];
        msg[size.max(1) - 1] = (i % 251) as u8 + 1;
        self.mr.write(self.local, &msg[..size.max(1)]).map_err(|e| e.to_string())?;
        self.post(0, size.max(1), i, true)?;
        self.wait_kind(WcOpcode::RdmaWrite)
    }

    /// write_lat: spins on the last byte of our buffer until the peer's write `i` landed.
    fn wait_mark(&self, size: usize, i: u64) -> Result<(), Fail> {
        let local = self.local + self.buf + size.max(1) - 1;
        let want = (i % 251) as u8 + 1;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut b = [0u8];
        loop {
            self.mr.read(local, &mut b).map_err(|e| e.to_string())?;
            if b[0] == want {
                return Ok(());
            }
            // Polling the CQ drives the engine, like a busy-polling perftest would.
            let _ = self.cq.poll_one();
            if Instant::now() > deadline {
                return Err("timed out waiting for the peer's write".into());
            }
        }
    }

    fn run_server(&mut self, size: usize, stream: &mut TcpStream) -> Result<Measured, Fail> {
        let iters = self.iters();
        match self.args.test {
            // The server's latency is half the time between two arrivals (a round trip).
            Test::SendLat => {
                let mut lat = Lap::default();
                for i in 0..iters {
                    self.wait_kind(WcOpcode::Recv)?;
                    lat.lap();
                    self.post_recv(0)?;
                    self.post(0, size, i, true)?;
                }
                return Ok(Measured { iters, lat: lat.0, ..Measured::default() });
            }
            Test::WriteLat => {
                let mut lat = Lap::default();
                for i in 0..iters {
                    self.write_mark(size, i)?;
                    self.wait_mark(size, i)?;
                    lat.lap();
                }
                return Ok(Measured { iters, lat: lat.0, ..Measured::default() });
            }
            // RC delivers every message: count them (sleeping on the channel with -e).
            Test::SendBw if self.args.duration.is_none() && self.args.connection == Conn::Rc => {
                let mut got = Received::default();
                while got.n < iters * self.qps.len() as u64 {
                    let wc = self.wait()?;
                    if wc.opcode == WcOpcode::Recv {
                        got.one();
                        self.post_recv(self.lane(&wc)?)?;
                    }
                }
                return Ok(got.measured(size, self.qps.len()));
            }
            // A duration run, or UD, which drops what finds no receive posted: receive
            // until the client's results arrive.
            Test::SendBw => {
                stream.set_nonblocking(true).map_err(|e| e.to_string())?;
                let mut peek = [0u8; 1];
                let mut got = Received::default();
                loop {
                    if let Some(wc) = self.cq.poll_one() {
                        if wc.opcode == WcOpcode::Recv {
                            got.one();
                            self.post_recv(self.lane(&wc)?)?;
                        }
                        continue;
                    }
                    match stream.peek(&mut peek) {
                        Ok(_) => break, // the results, or the client gone (0)
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e.to_string()),
                    }
                }
                stream.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok(got.measured(size, self.qps.len()));
            }
            // One-sided tests: the server has nothing to do; its progress thread answers.
            _ => {}
        }
        Ok(Measured::default())
    }
}

/// send_bw's server: messages received, and when.
#[derive(Default)]
struct Received {
    n: u64,
    start: Option<Instant>,
    /// (count, seconds since the first) every 128 messages, for the peak.
    marks: Vec<(u64, f64)>,
    last: f64,
}

impl Received {
    fn one(&mut self) {
        let start = *self.start.get_or_insert_with(Instant::now);
        self.n += 1;
        self.last = start.elapsed().as_secs_f64();
        if self.n % 128 == 0 {
            self.marks.push((self.n, self.last));
        }
    }

    /// Bandwidth from the first arrival to the last.
    fn measured(&self, size: usize, qps: usize) -> Measured {
        let t = self.last;
        let avg = if t > 0.0 { (self.n * size as u64) as f64 / t } else { 0.0 };
        let peak = peak(&self.marks, size).max(avg);
        Measured { iters: self.n / qps.max(1) as u64, bw_avg: avg, bw_peak: peak, lat: Vec::new() }
    }
}

/// Half-intervals between successive calls, in microseconds.
#[derive(Default)]
struct Lap(Vec<f64>, Option<Instant>);

impl Lap {
    fn lap(&mut self) {
        let now = Instant::now();
        if let Some(prev) = self.1.replace(now) {
            self.0.push((now - prev).as_secs_f64() * 1e6 / 2.0);
        }
    }
}

/// The best bandwidth over ten equal slices of the run.
fn peak(marks: &[(u64, f64)], size: usize) -> f64 {
    let Some(&(_, t)) = marks.last() else { return 0.0 };
    let mut best: f64 = 0.0;
    let mut prev = (0u64, 0f64);
    for &(done, at) in marks {
        // Whole slices only: a short one at the end (a burst of completions) says nothing.
        if at - prev.1 >= t / 10.0 {
            best = best.max((done - prev.0) as f64 * size as f64 / (at - prev.1));
            prev = (done, at);
        }
    }
    best
}

fn connect(args: &PerfArgs) -> Result<TcpStream, Fail> {
    match &args.host {
        Some(host) => {
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                match TcpStream::connect((host.as_str(), args.port)) {
                    Ok(s) => return Ok(s),
                    Err(e) if Instant::now() > deadline => {
                        return Err(format!("cannot reach {host}:{}: {e}", args.port))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        }
        None => {
            if !args.json {
                println!("\n************************************\n* Waiting for client to connect... *\n************************************");
            }
            let l = TcpListener::bind(("0.0.0.0", args.port))
                .map_err(|e| format!("TCP port {}: {e}", args.port))?;
            Ok(l.accept().map_err(|e| e.to_string())?.0)
        }
    }
}

/// Sends `msg` and receives the peer's message of the same length (the client speaks
/// first).
fn swap(s: &mut TcpStream, client: bool, msg: &[u8]) -> Result<Vec<u8>, Fail> {
    let mut got = vec![0u8; msg.len()];
    if client {
        s.write_all(msg).map_err(|e| e.to_string())?;
        s.read_exact(&mut got).map_err(|e| format!("exchange: {e}"))?;
    } else {
        s.read_exact(&mut got).map_err(|e| format!("exchange: {e}"))?;
        s.write_all(msg).map_err(|e| e.to_string())?;
    }
    Ok(got)
}

/// perftest's RoCE QP message: `lid:out_reads:qpn:psn:rkey:vaddr:gid:srqn:` and a NUL, 108
/// bytes.
fn key_message(e: &EndpointInfo) -> Vec<u8> {
    let r = e.region.unwrap_or(RemoteRegion { addr: 0, len: 0, rkey: 0 });
    let gid: String = softrdma::gid_of(e.addr.ip()).iter().map(|b| format!("{b:02x}:")).collect();
    let s = format!(
        "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:{}{:08x}:",
        0, 1, e.qpn, e.psn, r.rkey, r.addr, gid, 0
    );
    let mut v = s.into_bytes();
    v.push(0);
    v.resize(108, 0);
    v
}

/// (address, qpn, psn, rkey, vaddr) of a key message.
fn parse_key_message(m: &[u8]) -> Result<(IpAddr, u32, u32, u32, u64), Fail> {
    let text = std::str::from_utf8(m.split(|&b| b == 0).next().unwrap_or(&[]))
        .map_err(|_| "key message not text")?;
    let f: Vec<&str> = text.split(':').collect();
    if f.len() < 23 {
        return Err(format!("malformed key message {text:?}"));
    }
    let hex = |s: &str| u64::from_str_radix(s, 16).map_err(|_| format!("bad field {s:?} in key message"));
    let mut gid = [0u8; 16];
    for (k, g) in gid.iter_mut().enumerate() {
        *g = hex(f[6 + k])? as u8;
    }
    Ok((softrdma::addr_of_gid(gid), hex(f[2])? as u32, hex(f[3])? as u32, hex(f[4])? as u32, hex(f[5])?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bw_report_fields_are_perftests() {
        // The five fields rxe's ib_write_bw client sent after its run of 100 x 64 bytes in
        // testdata/rxe/write_bw_64.pcap (frames 226-234): size, iterations, then peak and
        // average in MiB/s and the message rate in Mpps, as big-endian doubles.
        let fields: [u64; 5] =
            [0x40, 0x64, 0x3fc0_1117_9dd8_3cfc, 0x3fbf_e55b_80f1_519f, 0x3f60_b8ff_b930_e8d9];
        let (peak, avg, rate) =
            (f64::from_bits(fields[2]), f64::from_bits(fields[3]), f64::from_bits(fields[4]));
        assert_eq!((fields[0], fields[1]), (64, 100));
        assert!(peak >= avg);
        // Average MiB/s and message rate describe the same run, which pins the units.
        let from_rate = rate * 1e6 * 64.0 / 1_048_576.0;
        assert!((from_rate - avg).abs() / avg < 0.01, "{from_rate} vs {avg}");
    }

    #[test]
    fn key_message_matches_perftest_and_round_trips() {
        let e = EndpointInfo {
            addr: "192.168.77.10:4791".parse().unwrap(),
            qpn: 0x21,
            psn: 0x2c27a5,
            mtu: 1024,
            region: Some(RemoteRegion { addr: 0x562b6dc6d000, len: 64, rkey: 0x11e1 }),
        };
        let m = key_message(&e);
        assert_eq!(m.len(), 108);
        // The message rxe's ib_write_bw sent in testdata/rxe/write_bw_64.pcap.
        let want = "0000:0001:000021:2c27a5:000011e1:0000562b6dc6d000:00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:4d:0a:00000000:";
        assert_eq!(&m[..want.len()], want.as_bytes());
        assert_eq!(parse_key_message(&m).unwrap(), (e.addr.ip(), 0x21, 0x2c27a5, 0x11e1, 0x562b6dc6d000));
        assert!(parse_key_message(b"garbage").is_err());
    }
}
