//! `softrdma pingpong`: the tutorial's ping-pong between two processes, like
//! `ibv_rc_pingpong` and `ibv_ud_pingpong`, with their option letters.
//!
//! The server runs without a host argument and waits on TCP port 18515 (`-p`); the client
//! connects to it. Each side sends its [`EndpointInfo`] as one line of JSON, the client
//! first. Then the client sends `-n` messages of `-s` bytes, and the server answers each;
//! every byte of every message is checked. Results are printed as `ibv_rc_pingpong` prints
//! them; any error exits 1.

use std::io::{BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma::{
    Access, CompletionChannel, CompletionQueue, ConnectOptions, Context, EndpointInfo, MemoryRegion, Mtu,
    Qkey, QpBuilder, QpCaps, QueuePair, RecvWr, SendFlags, SendOp, SendWr, UdDest, WcOpcode, WcStatus,
    WorkCompletion,
};

use crate::exchange::{self, ClientError};
use crate::limits;
use softrdma_proto::qp::MAX_MESSAGE;

/// The Q_Key of the UD ping-pong (as `ibv_ud_pingpong`).
const QKEY: Qkey = Qkey(0x1111_1111);
/// Receives kept posted.
const RX_DEPTH: usize = 64;
/// UD receive buffers start with the 40-byte GRH area.
const GRH: usize = 40;

/// Transport of the ping-pong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// Reliable connected.
    Rc,
    /// Unreliable datagram.
    Ud,
}

/// Arguments of `softrdma pingpong`.
#[derive(Debug, clap::Args)]
pub struct PingPongArgs {
    /// The server to connect to; without it, act as the server.
    pub host: Option<String>,
    /// TCP port of the connection exchange.
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub port: u16,
    /// Local device: its name or address (default 127.0.0.1).
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,
    /// Local address to bind the device on (same as -d with an address).
    #[arg(long)]
    pub bind: Option<IpAddr>,
    /// UDP port of the device (default SOFTRDMA_PORT or 4791; 0 picks a free one).
    #[arg(long)]
    pub udp_port: Option<u16>,
    /// GID index of the device to bind (`softrdma devinfo -v` lists the table).
    #[arg(short = 'g', long = "gid-idx")]
    pub gid_index: Option<u32>,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 4096)]
    pub size: usize,
    /// Round trips.
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub iters: u64,
    /// Sleep on the completion channel instead of busy-polling.
    #[arg(short = 'e', long)]
    pub events: bool,
    /// Path MTU: 256, 512, 1024, 2048 or 4096.
    #[arg(short = 'm', long)]
    pub mtu: Option<u32>,
    /// rc or ud.
    #[arg(long, value_enum, default_value_t = Transport::Rc)]
    pub transport: Transport,
    /// Send to this address instead of the one the peer advertised: the side of a
    /// `softrdma relay` facing this process.
    #[arg(long)]
    pub via: Option<std::net::SocketAddr>,
    /// Talk to the real `ibv_rc_pingpong` / `ibv_ud_pingpong` (on Linux rxe or a NIC): its
    /// 52-byte `lid:qpn:psn:gid` exchange, its buffer contents (not checked), and a foreign
    /// peer's ICRCs. The peer must use an IPv4-mapped GID (`-g` with that index) and port
    /// 4791.
    #[arg(long)]
    pub ibv: bool,
}

type Failure = String;

/// Runs the command; returns the process exit status.
pub fn run(args: &PingPongArgs) -> i32 {
    if let Err(e) = check(args) {
        eprintln!("softrdma pingpong: {e}");
        return limits::USAGE;
    }
    match pingpong(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("softrdma pingpong: {e}");
            1
        }
    }
}

/// The path MTU `-m` asks for.
fn mtu_of(m: u32) -> Result<Mtu, Failure> {
    match m {
        256 => Ok(Mtu::Mtu256),
        512 => Ok(Mtu::Mtu512),
        1024 => Ok(Mtu::Mtu1024),
        2048 => Ok(Mtu::Mtu2048),
        4096 => Ok(Mtu::Mtu4096),
        m => Err(format!("-m {m}: the MTU is one of 256, 512, 1024, 2048, 4096")),
    }
}

/// The address the command line gives the device (`--bind`, or `-d` with an address):
/// the exchange's server listens there too.
fn asked_addr(args: &PingPongArgs) -> Option<IpAddr> {
    args.bind.or_else(|| args.device.as_deref().and_then(|d| d.parse().ok()))
}

/// Refuses the arguments the ping-pong cannot run with, before anything is bound.
fn check(args: &PingPongArgs) -> Result<(), Failure> {
    if args.bind.is_some() && args.gid_index.is_some() {
        return Err("--bind and -g both choose the local address".into());
    }
    if args.port == 0 {
        return Err("-p 0: the peer must know the TCP port of the exchange".into());
    }
    if args.iters == 0 {
        return Err("-n 0: the ping-pong needs at least one round trip".into());
    }
    let mtu = args.mtu.map(mtu_of).transpose()?;
    if args.size as u64 > MAX_MESSAGE {
        return Err(format!("-s {}: RDMA messages are at most {MAX_MESSAGE} bytes", args.size));
    }
    let name = match (asked_addr(args), &args.device) {
        (Some(a), _) => a.to_string(),
        (None, Some(d)) => d.clone(),
        (None, None) => "127.0.0.1".into(),
    };
    let device = softrdma::find_device(&name).map_err(|e| format!("{name}: {e}"))?;
    if let (Some(via), Some(local)) = (args.via, asked_addr(args)) {
        exchange::same_family(SocketAddr::new(local, 0), via).map_err(|e| format!("--via {via}: {e}"))?;
    }
    let ud = args.transport == Transport::Ud;
    let limit = mtu.unwrap_or(device.active_mtu()).bytes() as usize;
    if ud && args.size > limit {
        return Err(format!("-s {}: UD messages are at most one MTU ({limit} bytes)", args.size));
    }
    let slot = args.size + if ud { GRH } else { 0 };
    let regions = [limits::mul(slot, RX_DEPTH), limits::mul(args.size.max(1), 1)];
    limits::check_regions(&format!("-s {}", args.size), &regions, &device.attr())
}

fn open(args: &PingPongArgs) -> Result<Context, Failure> {
    let port = args.udp_port.unwrap_or_else(softrdma::default_port);
    let opened = match (args.bind, &args.device, args.gid_index) {
        (Some(addr), _, _) => Context::open_port(addr, port),
        (None, d, Some(idx)) => Context::open_gid(d.as_deref().unwrap_or("127.0.0.1"), idx, port),
        (None, Some(name), None) => {
            softrdma::find_device(name).and_then(|d| Context::open_port(d.addr, port))
        }
        (None, None, None) => Context::open_port(IpAddr::from([127, 0, 0, 1]), port),
    };
    opened.map_err(|e| e.to_string())
}

/// Trades endpoints with the peer. `connect` runs as soon as the peer's endpoint is known:
/// on the server, before it answers, so that its QP is ready when the client (which starts
/// sending as soon as it has the answer) sends.
///
/// The server drops a client that sends nothing, garbage, too long a line or an endpoint
/// of the other IP family (saying so on stderr) and waits for the next, until one's
/// endpoint connects its QP.
fn exchange(
    args: &PingPongArgs,
    mine: &EndpointInfo,
    connect: impl FnOnce(&EndpointInfo) -> Result<(), Failure>,
) -> Result<EndpointInfo, Failure> {
    let mut connect = Some(connect);
    let mut connect_once = |theirs: &EndpointInfo| -> Result<(), Failure> {
        connect.take().ok_or("the QP is connected already")?(theirs)
    };
    let Some(host) = &args.host else {
        let listener = exchange::Listener::bind(asked_addr(args), args.port)?;
        return listener.serve("softrdma pingpong", |stream| {
            if args.ibv {
                ibv_exchange(args, stream, mine, &mut connect_once)
            } else {
                json_exchange(args, stream, mine, &mut connect_once)
            }
        });
    };
    let stream = exchange::connect(host, args.port, Duration::from_secs(10))?;
    let stream = exchange::Bounded::new(stream, exchange::SERVER_TIMEOUT);
    let r = if args.ibv {
        ibv_exchange(args, stream, mine, &mut connect_once)
    } else {
        json_exchange(args, stream, mine, &mut connect_once)
    };
    r.map_err(|e| match e {
        ClientError::Dropped(e) | ClientError::Fatal(e) => e,
    })
}

/// softrdma's exchange: one JSON line each way, the client's first.
fn json_exchange(
    args: &PingPongArgs,
    stream: exchange::Bounded,
    mine: &EndpointInfo,
    connect: &mut impl FnMut(&EndpointInfo) -> Result<(), Failure>,
) -> Result<EndpointInfo, ClientError> {
    let mut r = BufReader::new(stream);
    let recv = |r: &mut BufReader<exchange::Bounded>| -> Result<EndpointInfo, ClientError> {
        let theirs: EndpointInfo = exchange::recv_line(r, exchange::MAX_LINE)
            .map_err(|e| ClientError::Dropped(e.about("bad endpoint from peer")))?;
        exchange::same_family(mine.addr, theirs.addr).map_err(ClientError::Dropped)?;
        Ok(theirs)
    };
    let fatal = ClientError::Fatal;
    if args.host.is_some() {
        exchange::send_line(r.get_mut(), mine).map_err(fatal)?;
        let theirs = recv(&mut r)?;
        connect(&theirs).map_err(fatal)?;
        Ok(theirs)
    } else {
        let theirs = recv(&mut r)?;
        connect(&theirs).map_err(fatal)?;
        exchange::send_line(r.get_mut(), mine).map_err(fatal)?;
        Ok(theirs)
    }
}

/// `ibv_*_pingpong`'s exchange: `"%04x:%06x:%06x:%s"` (LID, QPN, PSN, the GID as 32 hex
/// digits) in 52 bytes each way, the client first, then the client's `"done"`.
fn ibv_exchange(
    args: &PingPongArgs,
    mut s: exchange::Bounded,
    mine: &EndpointInfo,
    connect: &mut impl FnMut(&EndpointInfo) -> Result<(), Failure>,
) -> Result<EndpointInfo, ClientError> {
    use std::io::Read;
    let gid: String = softrdma::gid_of(mine.addr.ip()).iter().map(|b| format!("{b:02x}")).collect();
    let mut msg = format!("{:04x}:{:06x}:{:06x}:{gid}", 0, mine.qpn, mine.psn).into_bytes();
    msg.resize(52, 0);
    let parse = |m: &[u8]| -> Result<EndpointInfo, Failure> {
        let t = std::str::from_utf8(m.split(|&b| b == 0).next().unwrap_or(&[]))
            .map_err(|_| "exchange not text")?;
        let f: Vec<&str> = t.split(':').collect();
        let hex = |x: &str| u32::from_str_radix(x, 16).map_err(|_| format!("bad field {x:?} in {t:?}"));
        if f.len() != 4 || f[3].len() != 32 {
            return Err(format!("malformed ibv_pingpong message {t:?}"));
        }
        let mut g = [0u8; 16];
        for (k, b) in g.iter_mut().enumerate() {
            *b = u8::from_str_radix(&f[3][2 * k..2 * k + 2], 16).map_err(|_| format!("bad GID in {t:?}"))?;
        }
        let addr = std::net::SocketAddr::new(softrdma::addr_of_gid(g), softrdma_proto::wire::ROCEV2_PORT);
        Ok(EndpointInfo { addr, qpn: hex(f[1])?, psn: hex(f[2])?, mtu: mine.mtu, region: None })
    };
    let mut got = [0u8; 52];
    let (dropped, fatal) = (ClientError::Dropped, ClientError::Fatal);
    let io = |e: std::io::Error| e.to_string();
    if args.host.is_some() {
        s.write_all(&msg).map_err(io).map_err(fatal)?;
        s.read_exact(&mut got).map_err(io).map_err(fatal)?;
        let theirs = parse(&got).map_err(fatal)?;
        connect(&theirs).map_err(fatal)?;
        s.write_all(b"done\0").map_err(io).map_err(fatal)?;
        Ok(theirs)
    } else {
        s.read_exact(&mut got).map_err(io).map_err(dropped)?;
        let theirs = parse(&got).map_err(dropped)?;
        connect(&theirs).map_err(fatal)?;
        s.write_all(&msg).map_err(io).map_err(fatal)?;
        let mut done = [0u8; 5];
        let _ = s.read_exact(&mut done);
        Ok(theirs)
    }
}

/// Byte `k` of message `i` from the side `side`.
fn pattern(i: u64, side: u8, k: usize) -> u8 {
    (i as usize).wrapping_mul(7).wrapping_add(k.wrapping_mul(13)).wrapping_add(usize::from(side)) as u8
}

/// The work request id of the send of message `i`: counted down from the top, apart from
/// the receive slots' ids (0 to [`RX_DEPTH`] - 1).
fn send_wr_id(i: u64) -> u64 {
    u64::MAX - i
}

/// What a work request id stands for, as a person reads it.
fn wr_name(wr_id: u64) -> String {
    if wr_id < RX_DEPTH as u64 {
        format!("receive into slot {wr_id}")
    } else {
        format!("send of message {}", u64::MAX - wr_id)
    }
}

struct Waiter<'a> {
    cq: &'a CompletionQueue,
    channel: Option<&'a CompletionChannel>,
}

impl Waiter<'_> {
    fn next(&self) -> Result<WorkCompletion, Failure> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(wc) = self.cq.poll_one() {
                if wc.status != WcStatus::Success {
                    return Err(format!("{} failed: {:?} ({:?})", wr_name(wc.wr_id), wc.status, wc.opcode));
                }
                return Ok(wc);
            }
            if Instant::now() > deadline {
                return Err("timed out waiting for a completion".into());
            }
            if let Some(ch) = self.channel {
                self.cq.req_notify(false).map_err(|e| e.to_string())?;
                // A completion may have arrived between the poll and the arming.
                if let Some(wc) = self.cq.poll_one() {
                    if wc.status != WcStatus::Success {
                        return Err(format!(
                            "{} failed: {:?} ({:?})",
                            wr_name(wc.wr_id),
                            wc.status,
                            wc.opcode
                        ));
                    }
                    return Ok(wc);
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
}

fn pingpong(args: &PingPongArgs) -> Result<(), Failure> {
    let ud = args.transport == Transport::Ud;
    let ctx = open(args)?;
    let mtu = args.mtu.map(mtu_of).transpose()?;
    if ud && args.size > mtu.unwrap_or(ctx.device().active_mtu()).bytes() as usize {
        return Err(format!("UD messages are at most one MTU ({} bytes)", ctx.device().active_mtu().bytes()));
    }
    let pd = ctx.alloc_pd();
    let channel = if args.events { Some(ctx.create_channel().map_err(|e| e.to_string())?) } else { None };
    let cq = ctx.create_cq(2 * RX_DEPTH + 2, channel.as_ref()).map_err(|e| e.to_string())?;
    let slot = args.size + if ud { GRH } else { 0 };
    let rx = pd.register(slot * RX_DEPTH, Access::LOCAL_WRITE).map_err(|e| e.to_string())?;
    let tx = pd.register(args.size.max(1), Access::NONE).map_err(|e| e.to_string())?;
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: RX_DEPTH as u32, ..QpCaps::default() };
    let builder = if ud { QpBuilder::ud(QKEY) } else { QpBuilder::rc() }.caps(caps);
    let prepared = pd.prepare_qp(&builder, &cq, &cq).map_err(|e| e.to_string())?;
    for k in 0..RX_DEPTH {
        post_recv_slot(&rx, slot, k, &prepared)?;
    }
    let mut mine = prepared.endpoint();
    if let Some(m) = mtu {
        // Advertise the MTU asked for, so that the peer settles on the same path MTU.
        mine.mtu = mine.mtu.min(m.bytes());
    }
    let mut connected = None;
    let theirs = exchange(args, &mine, |theirs| {
        let theirs = &EndpointInfo { addr: args.via.unwrap_or(theirs.addr), ..*theirs };
        let qp = if ud {
            prepared.ready().inspect(|q| q.set_foreign_peer(args.ibv))
        } else {
            let foreign_peer = args.ibv;
            prepared.handshake(theirs, &ConnectOptions { mtu, foreign_peer, ..ConnectOptions::default() })
        };
        connected = Some(qp.map_err(|e| e.to_string())?);
        Ok(())
    })?;
    let qp = connected.ok_or("not connected")?;
    println!("  local address:  QPN {:#08x}, PSN {:#08x}, GID {}", mine.qpn, mine.psn, mine.addr);
    println!("  remote address: QPN {:#08x}, PSN {:#08x}, GID {}", theirs.qpn, theirs.psn, theirs.addr);
    let dest = ud.then(|| UdDest {
        addr: args.via.unwrap_or(theirs.addr),
        qpn: softrdma::Qpn::new(theirs.qpn),
        qkey: QKEY,
        traffic_class: 0,
    });
    let client = args.host.is_some();
    let waiter = Waiter { cq: &cq, channel: channel.as_ref() };
    let mut run = Run {
        args,
        qp: &qp,
        rx: &rx,
        tx: &tx,
        slot,
        ud,
        dest,
        waiter,
        next_rx: 0,
        pending_sends: 0,
        early: Default::default(),
    };
    let start = Instant::now();
    let exchange = |run: &mut Run<'_>| -> Result<(), Failure> {
        for i in 0..args.iters {
            if client {
                run.send(i, 0)?;
                run.receive(i, 1)?;
            } else {
                run.receive(i, 0)?;
                run.send(i, 1)?;
            }
        }
        run.drain_sends()
    };
    exchange(&mut run).map_err(|e| with_oversize_hint(e, &ctx))?;
    let secs = start.elapsed().as_secs_f64();
    if !ud {
        // The peer may still be waiting for our ACK of its last message (lost on the way):
        // stay a moment so that its resends are answered, instead of leaving it to fail
        // with RETRY_EXC_ERR against a QP that is gone.
        std::thread::sleep(Duration::from_millis(200));
    }
    // Wide enough for any -s and -n.
    let bytes = 2 * args.size as u128 * u128::from(args.iters);
    println!("{bytes} bytes in {secs:.2} seconds = {:.2} Mbit/sec", bytes as f64 * 8.0 / secs / 1e6);
    println!(
        "{} iters in {secs:.2} seconds = {:.2} usec/iter",
        args.iters,
        secs * 1e6 / args.iters.max(1) as f64
    );
    Ok(())
}

/// `e`, and what the device saw that explains it: datagrams the kernel refused as larger
/// than the path allows (the usual cause of RETRY_EXC_ERR on a new path).
pub(crate) fn with_oversize_hint(e: Failure, ctx: &Context) -> Failure {
    match ctx.io_stats().oversize {
        0 => e,
        n => format!(
            "{e}; {n} datagrams were refused by the kernel as larger than the path allows: \
             the path MTU (-m) is above what the link carries (1024 for a 1500-byte Ethernet MTU)"
        ),
    }
}

fn post_recv_slot(rx: &MemoryRegion, slot: usize, k: usize, qp: &impl PostRecv) -> Result<(), Failure> {
    let sge = rx.sge(k * slot, slot).map_err(|e| e.to_string())?;
    qp.post(RecvWr { wr_id: k as u64, sg_list: softrdma::sgl![sge] })
}

trait PostRecv {
    fn post(&self, wr: RecvWr) -> Result<(), Failure>;
}

impl PostRecv for softrdma::PreparedQp {
    fn post(&self, wr: RecvWr) -> Result<(), Failure> {
        self.post_recv(wr).map_err(|e| e.to_string())
    }
}

impl PostRecv for QueuePair {
    fn post(&self, wr: RecvWr) -> Result<(), Failure> {
        self.post_recv(wr).map_err(|e| e.to_string())
    }
}

struct Run<'a> {
    args: &'a PingPongArgs,
    qp: &'a QueuePair,
    rx: &'a MemoryRegion,
    tx: &'a MemoryRegion,
    slot: usize,
    ud: bool,
    dest: Option<UdDest>,
    waiter: Waiter<'a>,
    next_rx: u64,
    pending_sends: u32,
    /// Receives that completed while a send was awaited (its ACK can come after the
    /// peer's answer when packets are lost).
    early: std::collections::VecDeque<WorkCompletion>,
}

impl Run<'_> {
    fn send(&mut self, i: u64, side: u8) -> Result<(), Failure> {
        let msg: Vec<u8> = (0..self.args.size).map(|k| pattern(i, side, k)).collect();
        self.tx.write(0, &msg).map_err(|e| e.to_string())?;
        let wr = SendWr {
            wr_id: send_wr_id(i),
            op: SendOp::Send,
            sg_list: softrdma::sgl![self.tx.sge(0, self.args.size).map_err(|e| e.to_string())?],
            flags: SendFlags { signaled: true, ..SendFlags::default() },
            ud: self.dest,
        };
        self.qp.post_send(wr).map_err(|e| e.to_string())?;
        self.pending_sends += 1;
        // The message buffer is rewritten next time: wait until this send is done.
        self.drain_sends()
    }

    fn drain_sends(&mut self) -> Result<(), Failure> {
        while self.pending_sends > 0 {
            let wc = self.waiter.next()?;
            self.account(wc)?;
        }
        Ok(())
    }

    /// Books a completion that arrived while waiting for another kind.
    fn account(&mut self, wc: WorkCompletion) -> Result<(), Failure> {
        match wc.opcode {
            WcOpcode::Send => self.pending_sends -= 1,
            WcOpcode::Recv => self.early.push_back(wc),
            _ => return Err(format!("unexpected completion {:?}", wc.opcode)),
        }
        Ok(())
    }

    fn receive(&mut self, i: u64, side: u8) -> Result<(), Failure> {
        let wc = match self.early.pop_front() {
            Some(wc) => wc,
            None => loop {
                let wc = self.waiter.next()?;
                if wc.opcode == WcOpcode::Recv {
                    break wc;
                }
                self.account(wc)?;
            },
        };
        let k = wc.wr_id as usize;
        if wc.wr_id != self.next_rx % RX_DEPTH as u64 {
            return Err(format!(
                "receive {} completed out of order (expected {})",
                wc.wr_id,
                self.next_rx % RX_DEPTH as u64
            ));
        }
        self.next_rx += 1;
        let skip = if self.ud { GRH } else { 0 };
        if wc.byte_len as usize != self.args.size + skip {
            return Err(format!("message {i}: {} bytes, expected {}", wc.byte_len, self.args.size + skip));
        }
        let mut got = vec![0u8; self.args.size];
        self.rx.read(k * self.slot + skip, &mut got).map_err(|e| e.to_string())?;
        // The real ibv_*_pingpong sends whatever its buffer holds: nothing to check.
        let check = !self.args.ibv;
        if let Some(bad) = (0..self.args.size).filter(|_| check).find(|&b| got[b] != pattern(i, side, b)) {
            return Err(format!(
                "message {i}: byte {bad} is {:#04x}, expected {:#04x}",
                got[bad],
                pattern(i, side, bad)
            ));
        }
        post_recv_slot(self.rx, self.slot, k, self.qp)
    }
}
