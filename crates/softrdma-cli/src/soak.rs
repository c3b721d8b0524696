//! `softrdma soak`: mixed RC traffic between two processes through an impaired relay, with
//! every byte and every completion checked, for a given time.
//!
//! This process runs the relay (a thread) and the active endpoint; it starts the passive
//! endpoint as a second process (`softrdma soak --role passive`), talking to it over its
//! stdin and stdout. The active side keeps `--depth` operations in flight: SEND_WITH_IMM,
//! WRITE_WITH_IMM, READ, FetchAdd and CompareSwap, sizes from 0 B to `--max-size` (mostly
//! small). Everything about operation `n` — kind, size, contents, target — follows from
//! `n` and the seed, so each side can check what it sees: the passive side checks every
//! SEND and every WRITE_WITH_IMM when its receive completes (the immediate carries `n`);
//! the active side checks READ data against the passive side's known pattern and every
//! atomic's fetched value against its model of the counter, which only it changes. Both
//! sides check completions come exactly once and in order (the passive side: that the
//! messages arriving are, in order, the SENDs and WRITE_WITH_IMMs the active side posted;
//! the active side: that each completion is that of the oldest operation in flight). At the
//! end the active side READs the counter and compares it with its model, and compares the
//! number of messages the passive side received with the number it completed. The passive
//! side reports, and the last line sums both: `ops=N data-errors=E status-errors=S ...`;
//! any error exits 1.
//!
//! Tests prove each check fires with [`FAULT_VAR`], a switch that makes soak itself
//! misbehave once as a transport bug would.

use std::collections::VecDeque;
use std::io::BufReader;
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softrdma::{
    Access, ConnectOptions, Context, EndpointInfo, MemoryRegion, QpBuilder, QpCaps, QueuePair, RecvWr,
    RemoteRegion, Rkey, SendFlags, SendOp, SendWr, WcOpcode, WcStatus,
};
use softrdma_proto::qp::MAX_MESSAGE;
use softrdma_proto::sim::{Impairments, Rng};

use crate::exchange;
use crate::limits;
use crate::relay::Relay;

/// Arguments of `softrdma soak`.
#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// How long to run, e.g. `40s`, `10m` or a number of seconds.
    #[arg(long, default_value = "40s", value_parser = limits::duration)]
    pub duration: Duration,
    /// Datagrams lost by the relay, in percent.
    #[arg(long, default_value_t = 5.0, value_parser = limits::percent)]
    pub loss: f64,
    /// Datagrams duplicated, in percent.
    #[arg(long, default_value_t = 1.0, value_parser = limits::percent)]
    pub dup: f64,
    /// Datagrams reordered, in percent.
    #[arg(long, default_value_t = 5.0, value_parser = limits::percent)]
    pub reorder: f64,
    /// Datagrams corrupted, in percent.
    #[arg(long, default_value_t = 0.5, value_parser = limits::percent)]
    pub corrupt: f64,
    /// Seed of the workload and of the relay.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Largest message (at most 2 GiB, RDMA's largest).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_size: usize,
    /// Operations in flight (1 to 32).
    #[arg(long, default_value_t = 8)]
    pub depth: usize,
    /// Internal: the passive side, started by the active one.
    #[arg(long, hide = true)]
    pub role: Option<String>,
}

/// WRITE slots at the passive side: many more than operations in flight, so that a slot is
/// not written again before the passive side has checked it.
const SLOTS: u64 = 64;
/// Most operations in flight: half the write slots.
const MAX_DEPTH: usize = SLOTS as usize / 2;
const READ_AREA: usize = 4 << 20;
const PASSIVE_IP: [u8; 4] = [127, 0, 9, 2];
const ACTIVE_IP: [u8; 4] = [127, 0, 9, 3];
const RELAY_A: [u8; 4] = [127, 0, 9, 4];
const RELAY_B: [u8; 4] = [127, 0, 9, 5];

/// TEST-ONLY fault switch: `SOFTRDMA_SOAK_FAULT=<fault>` (one of [`Fault::NAMES`]) makes
/// soak misbehave once, at the first operation from [`FAULT_FROM`] on that the fault fits,
/// as a transport bug would: so that tests/soak.rs can show each of soak's checks reports
/// it. Nothing else sets it; unset, soak runs unchanged. Both sides read it (the passive
/// side inherits the environment) and each injects only its own faults.
const FAULT_VAR: &str = "SOFTRDMA_SOAK_FAULT";
/// The first operation a fault may hit: past the start, with operations before and after.
const FAULT_FROM: u64 = 16;

/// A misbehaviour injected by [`FAULT_VAR`], for tests only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Passive: one byte of one received SEND flipped before the check.
    CorruptSend,
    /// Passive: one byte of one WRITE_WITH_IMM's data flipped before the check.
    CorruptWrite,
    /// Passive: one receive completion ignored (its receive posted again).
    LoseRecv,
    /// Passive: one receive completion handled twice.
    DupRecv,
    /// Active: one byte of one READ's data flipped before the check.
    CorruptRead,
    /// Active: one atomic's fetched value seen off by one.
    WrongFetch,
    /// Active: one FetchAdd applied twice to the model of the counter.
    FetchAddTwice,
    /// Active: one completion ignored.
    LoseCompletion,
    /// Active: one completion handled twice.
    DupCompletion,
}

impl Fault {
    const NAMES: [(&'static str, Fault); 9] = [
        ("corrupt-send", Fault::CorruptSend),
        ("corrupt-write", Fault::CorruptWrite),
        ("lose-recv", Fault::LoseRecv),
        ("dup-recv", Fault::DupRecv),
        ("corrupt-read", Fault::CorruptRead),
        ("wrong-fetch", Fault::WrongFetch),
        ("fetch-add-twice", Fault::FetchAddTwice),
        ("lose-completion", Fault::LoseCompletion),
        ("dup-completion", Fault::DupCompletion),
    ];

    /// The fault [`FAULT_VAR`] asks for, if any.
    fn from_env() -> Result<Option<Fault>, String> {
        let Some(v) = std::env::var_os(FAULT_VAR) else { return Ok(None) };
        let v = v.to_string_lossy();
        Self::NAMES.iter().find(|(name, _)| *name == v).map(|&(_, f)| Some(f)).ok_or_else(|| {
            let names: Vec<&str> = Self::NAMES.iter().map(|(n, _)| *n).collect();
            format!("{FAULT_VAR}={v}: not a fault (test-only; one of {})", names.join(", "))
        })
    }
}

/// The fault asked for, injected once.
struct Faults {
    kind: Option<Fault>,
    fired: bool,
}

impl Faults {
    fn new() -> Faults {
        Faults { kind: Fault::from_env().ok().flatten(), fired: false }
    }

    /// Whether to inject `kind` now, at operation `n` (once: true at most one time).
    fn fire(&mut self, kind: Fault, n: u64) -> bool {
        if self.fired || self.kind != Some(kind) || n < FAULT_FROM {
            return false;
        }
        self.fired = true;
        eprintln!("soak: test fault {kind:?} injected at operation {n}");
        true
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    Write,
    Read,
    FetchAdd,
    CompareSwap,
}

/// Kind and size of operation `n`.
fn plan(seed: u64, n: u64, max: usize) -> (Kind, usize) {
    let mut r = Rng::new(seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let kind = match r.below(10) {
        0..=2 => Kind::Send,
        3..=5 => Kind::Write,
        6..=7 => Kind::Read,
        8 => Kind::FetchAdd,
        _ => Kind::CompareSwap,
    };
    let cap = match r.below(100) {
        0..=69 => 4096,
        70..=94 => 256 << 10,
        _ => max as u64,
    };
    let size = if matches!(kind, Kind::FetchAdd | Kind::CompareSwap) {
        8
    } else {
        r.below(cap.min(max as u64) + 1) as usize
    };
    (kind, size)
}

/// Byte `k` of the message of operation `n`.
fn byte(n: u64, k: usize) -> u8 {
    (n.wrapping_mul(31) as usize).wrapping_add(k.wrapping_mul(7)).wrapping_add(k >> 8) as u8
}

/// Byte `k` of the passive side's read area.
fn read_byte(k: usize) -> u8 {
    (k.wrapping_mul(13) ^ (k >> 10)) as u8
}

/// Where in the read area operation `n` reads `size` bytes.
fn read_offset(n: u64, size: usize) -> usize {
    (n as usize).wrapping_mul(4099) % (READ_AREA - size.min(READ_AREA) + 1)
}

/// Refuses what cannot run: no operation in flight, more than the write slots allow,
/// messages past RDMA's largest, regions past the device's or the host's memory.
fn check(args: &SoakArgs) -> Result<(), String> {
    if !matches!(args.role.as_deref(), None | Some("passive")) {
        return Err("--role takes only \"passive\" (the side soak starts itself)".into());
    }
    Fault::from_env()?;
    if !(1..=MAX_DEPTH).contains(&args.depth) {
        return Err(format!(
            "--depth {}: takes 1 to {MAX_DEPTH} operations in flight (the passive side has {SLOTS} write slots)",
            args.depth
        ));
    }
    if args.max_size as u64 > MAX_MESSAGE {
        return Err(format!("--max-size {}: RDMA messages are at most {MAX_MESSAGE} bytes", args.max_size));
    }
    let attr =
        softrdma::find_device(&IpAddr::from(PASSIVE_IP).to_string()).map_err(|e| e.to_string())?.attr();
    let slot = args.max_size.max(8);
    let regions = [
        limits::mul(slot, SLOTS as usize).and_then(|n| n.checked_add(READ_AREA as u64 + 8)),
        limits::mul(slot, 2 * args.depth),
        limits::mul(slot, args.depth),
    ];
    limits::check_regions(
        &format!("--max-size {} with --depth {}", args.max_size, args.depth),
        &regions,
        &attr,
    )
}

/// Runs the command; returns the process exit status.
pub fn run(args: &SoakArgs) -> i32 {
    if let Err(e) = check(args) {
        eprintln!("softrdma soak: {e}");
        return limits::USAGE;
    }
    let r = if args.role.as_deref() == Some("passive") { passive(args) } else { active(args) };
    match r {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("softrdma soak: {e}");
            2
        }
    }
}

struct Area {
    mr: MemoryRegion,
    slot: usize,
}

fn access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// The passive side: a region (write slots, read area, counter), receives posted; checks
/// each SEND and WRITE_WITH_IMM as it completes; reports when stdin closes.
fn passive(args: &SoakArgs) -> Result<bool, String> {
    let ctx = Context::open_port(IpAddr::from(PASSIVE_IP), 0).map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4 * args.depth + 16, None).map_err(|e| e.to_string())?;
    let slot = args.max_size.max(8);
    // Write slots, then the read area, then the counter.
    let mr = pd.register(slot * SLOTS as usize + READ_AREA + 8, access()).map_err(|e| e.to_string())?;
    let pattern: Vec<u8> = (0..READ_AREA).map(read_byte).collect();
    mr.write(slot * SLOTS as usize, &pattern).map_err(|e| e.to_string())?;
    let recv = pd.register(slot * 2 * args.depth, Access::LOCAL_WRITE).map_err(|e| e.to_string())?;
    let caps = QpCaps { max_recv_wr: (2 * args.depth) as u32, ..QpCaps::default() };
    let prepared =
        pd.prepare_qp(&QpBuilder::rc().access(access()).caps(caps), &cq, &cq).map_err(|e| e.to_string())?;
    for k in 0..2 * args.depth {
        prepared
            .post_recv(RecvWr {
                wr_id: k as u64,
                sg_list: softrdma::sgl![recv.sge(k * slot, slot).map_err(|e| e.to_string())?],
            })
            .map_err(|e| e.to_string())?;
    }
    let mine = EndpointInfo { region: Some(mr.remote()), ..prepared.endpoint() };
    let theirs: EndpointInfo = exchange::stdio_swap(&mine).map_err(|e| e.to_string())?;
    let qp = prepared.handshake(&theirs, &opts()).map_err(|e| e.to_string())?;
    // Watch stdin for the end on another thread.
    let done = Arc::new(AtomicBool::new(false));
    let d2 = done.clone();
    std::thread::spawn(move || {
        let _ = exchange::wait_for_stdin_close();
        d2.store(true, Ordering::Relaxed);
    });
    let (mut received, mut data_errors, mut status_errors) = (0u64, 0u64, 0u64);
    let area = Area { mr, slot };
    let mut faults = Faults::new();
    // The operation from which to look for the next SEND or WRITE_WITH_IMM: they arrive in
    // the order posted, each once. (`n` is the immediate, so this holds for the first 2^32
    // operations.)
    let mut next = 0u64;
    loop {
        // Once stdin closes, what is in the CQ still counts: the active side has seen every
        // operation complete, and READ the counter after, so every receive completion is
        // there.
        let finished = done.load(Ordering::Relaxed);
        let Some(wc) = cq.poll_one() else {
            if finished {
                break;
            }
            std::thread::yield_now();
            continue;
        };
        if wc.status != WcStatus::Success {
            status_errors += 1;
            eprintln!("passive: completion {:?} {:?}", wc.opcode, wc.status);
            continue;
        }
        let n = u64::from(wc.imm_data.unwrap_or(0));
        let times = if faults.fire(Fault::LoseRecv, n) {
            0
        } else if faults.fire(Fault::DupRecv, n) {
            2
        } else {
            1
        };
        for _ in 0..times {
            let want = (next..)
                .find(|&m| matches!(plan(args.seed, m, args.max_size).0, Kind::Send | Kind::Write))
                .unwrap_or(next);
            if n != want {
                status_errors += 1;
                eprintln!("passive: operation {n} arrived where operation {want} was next");
            }
            next = n + 1;
            let (kind, size) = plan(args.seed, n, args.max_size);
            let got = match wc.opcode {
                WcOpcode::Recv => {
                    let mut v = vec![0u8; wc.byte_len as usize];
                    recv.read(wc.wr_id as usize * slot, &mut v).map_err(|e| e.to_string())?;
                    if !v.is_empty() && faults.fire(Fault::CorruptSend, n) {
                        v[0] ^= 1;
                    }
                    (kind == Kind::Send).then_some(v)
                }
                WcOpcode::RecvRdmaWithImm => {
                    let mut v = vec![0u8; wc.byte_len as usize];
                    area.mr.read((n % SLOTS) as usize * area.slot, &mut v).map_err(|e| e.to_string())?;
                    if !v.is_empty() && faults.fire(Fault::CorruptWrite, n) {
                        v[0] ^= 1;
                    }
                    (kind == Kind::Write).then_some(v)
                }
                _ => None,
            };
            match got {
                Some(v) if v.len() == size && v.iter().enumerate().all(|(k, &b)| b == byte(n, k)) => {}
                _ => {
                    data_errors += 1;
                    eprintln!("passive: operation {n} ({kind:?}, {size} bytes) arrived wrong");
                }
            }
            received += 1;
        }
        let sge = recv.sge(wc.wr_id as usize * slot, slot).map_err(|e| e.to_string())?;
        if wc.opcode == WcOpcode::Recv || wc.opcode == WcOpcode::RecvRdmaWithImm {
            qp.post_recv(RecvWr { wr_id: wc.wr_id, sg_list: softrdma::sgl![sge] })
                .map_err(|e| e.to_string())?;
        }
    }
    println!("{{\"received\":{received},\"data_errors\":{data_errors},\"status_errors\":{status_errors}}}");
    Ok(data_errors + status_errors == 0)
}

fn opts() -> ConnectOptions {
    // A short ACK timeout: the relay loses packets on purpose.
    ConnectOptions { timeout: 12, ..ConnectOptions::default() }
}

struct InFlight {
    n: u64,
    kind: Kind,
    size: usize,
    local: usize,
    before: u64,
}

fn active(args: &SoakArgs) -> Result<bool, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args([
            "soak",
            "--role",
            "passive",
            "--seed",
            &args.seed.to_string(),
            "--max-size",
            &args.max_size.to_string(),
        ])
        .args(["--depth", &args.depth.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut child_in = child.stdin.take().ok_or("no stdin")?;
    let mut child_out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let passive: EndpointInfo =
        exchange::recv_line(&mut child_out, exchange::MAX_LINE).map_err(|e| e.about("passive side"))?;
    let region = passive.region.ok_or("passive side offers no region")?;

    let ctx = Context::open_port(IpAddr::from(ACTIVE_IP), 0).map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4 * args.depth + 16, None).map_err(|e| e.to_string())?;
    let slot = args.max_size.max(8);
    let mr = pd.register(slot * args.depth, Access::LOCAL_WRITE).map_err(|e| e.to_string())?;
    let prepared = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).map_err(|e| e.to_string())?;
    let mine = prepared.endpoint();

    // The relay: A = the passive side, B = us.
    let imp = Impairments::from_percent(args.loss, args.dup, args.reorder, args.corrupt);
    let mut relay = Relay::new(
        SocketAddr::new(IpAddr::from(RELAY_A), 0),
        SocketAddr::new(IpAddr::from(RELAY_B), 0),
        passive.addr,
        mine.addr,
        imp,
        args.seed,
    )
    .map_err(|e| e.to_string())?;
    let (a_side, b_side) = relay.sides();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let relay_thread = std::thread::spawn(move || relay.run(&s2, None));

    // Each side's peer is the relay's side facing it.
    let for_passive = EndpointInfo { addr: a_side, ..mine };
    exchange::send_line(&mut child_in, &for_passive)?;
    let qp =
        prepared.handshake(&EndpointInfo { addr: b_side, ..passive }, &opts()).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let r = drive(args, &qp, &cq, &mr, region, slot, start);
    drop(child_in);
    let report: serde_json::Value =
        exchange::recv_line(&mut child_out, exchange::MAX_LINE).unwrap_or_default();
    let _ = child.wait();
    stop.store(true, Ordering::Relaxed);
    let relay_stats = relay_thread.join().map_err(|_| "relay thread failed")?;
    let Driven { ops, delivered, mut data_errors, mut status_errors } = r?;
    data_errors += report["data_errors"].as_u64().unwrap_or(1);
    status_errors += report["status_errors"].as_u64().unwrap_or(1);
    // Every SEND and WRITE_WITH_IMM completed here arrived there, once.
    let received = report["received"].as_u64();
    if received != Some(delivered) {
        status_errors += 1;
        eprintln!("active: {delivered} messages completed, the passive side received {received:?}");
    }
    let q = qp.stats();
    println!(
        "relay: received={} repatched={} {}",
        relay_stats.received, relay_stats.repatched, relay_stats.net
    );
    println!(
        "requester: packets={} retransmits={} timeouts={} seq-naks={} rnr-naks={}",
        q.packets_sent, q.retransmits, q.timeouts, q.seq_naks_received, q.rnr_naks_received
    );
    println!(
        "ops={ops} data-errors={data_errors} status-errors={status_errors} passive-received={} elapsed={:.1}s",
        report["received"].as_u64().unwrap_or(0),
        start.elapsed().as_secs_f64()
    );
    Ok(data_errors + status_errors == 0)
}

/// What [`drive`] saw.
struct Driven {
    /// Operations completed.
    ops: u64,
    /// SENDs and WRITE_WITH_IMMs completed successfully: messages the passive side received.
    delivered: u64,
    data_errors: u64,
    status_errors: u64,
}

/// Keeps `depth` operations in flight until the time is up, then READs the counter.
fn drive(
    args: &SoakArgs,
    qp: &QueuePair,
    cq: &softrdma::CompletionQueue,
    mr: &MemoryRegion,
    region: RemoteRegion,
    slot: usize,
    start: Instant,
) -> Result<Driven, String> {
    let rkey = Rkey(region.rkey);
    let read_base = region.addr + slot as u64 * SLOTS;
    let counter = read_base + READ_AREA as u64;
    let mut model = 0u64;
    let mut inflight: VecDeque<InFlight> = VecDeque::new();
    let mut free: Vec<usize> = (0..args.depth).rev().collect();
    let (mut next, mut done, mut data_errors, mut status_errors) = (0u64, 0u64, 0u64, 0u64);
    let mut delivered = 0u64;
    let mut faults = Faults::new();
    let mut last_progress = Instant::now();
    loop {
        let running = start.elapsed() < args.duration;
        while running && inflight.len() < args.depth {
            let n = next;
            next += 1;
            let (kind, size) = plan(args.seed, n, args.max_size);
            let local = free.pop().ok_or("no free slot")? * slot;
            let imm = n as u32;
            let before = model;
            let op = match kind {
                Kind::Send => SendOp::SendWithImm(imm),
                Kind::Write => {
                    SendOp::WriteWithImm { remote_addr: region.addr + (n % SLOTS) * slot as u64, rkey, imm }
                }
                Kind::Read => {
                    let off = read_offset(n, size);
                    SendOp::Read { remote_addr: read_base + off as u64, rkey }
                }
                Kind::FetchAdd => {
                    model = model.wrapping_add(n);
                    if faults.fire(Fault::FetchAddTwice, n) {
                        model = model.wrapping_add(n);
                    }
                    SendOp::FetchAdd { remote_addr: counter, rkey, add: n }
                }
                Kind::CompareSwap => {
                    let compare = if n % 2 == 0 { before } else { before ^ 1 };
                    if compare == before {
                        model = n;
                    }
                    SendOp::CompareSwap { remote_addr: counter, rkey, compare, swap: n }
                }
            };
            if matches!(kind, Kind::Send | Kind::Write) {
                let data: Vec<u8> = (0..size).map(|k| byte(n, k)).collect();
                mr.write(local, &data).map_err(|e| e.to_string())?;
            }
            let size = size.min(READ_AREA);
            let wr = SendWr {
                wr_id: n,
                op,
                sg_list: softrdma::sgl![mr.sge(local, size).map_err(|e| e.to_string())?],
                flags: SendFlags { signaled: true, ..Default::default() },
                ud: None,
            };
            qp.post_send(wr).map_err(|e| e.to_string())?;
            inflight.push_back(InFlight { n, kind, size, local, before });
        }
        if !running && inflight.is_empty() {
            status_errors += check_counter(qp, cq, mr, rkey, counter, model, &mut data_errors)?;
            return Ok(Driven { ops: done, delivered, data_errors, status_errors });
        }
        let Some(wc) = cq.poll_one() else {
            if last_progress.elapsed() > Duration::from_secs(60) {
                return Err(format!("no completion for 60 s with {} operations in flight", inflight.len()));
            }
            continue;
        };
        last_progress = Instant::now();
        let times = if faults.fire(Fault::LoseCompletion, wc.wr_id) {
            0
        } else if faults.fire(Fault::DupCompletion, wc.wr_id) {
            2
        } else {
            1
        };
        for _ in 0..times {
            // RC completes a QP's work requests once each, in the order posted: this must be
            // the oldest in flight.
            let Some(at) = inflight.iter().position(|op| op.n == wc.wr_id) else {
                status_errors += 1;
                eprintln!("active: completion {} {:?} of no operation in flight", wc.wr_id, wc.status);
                continue;
            };
            for op in inflight.drain(..at) {
                status_errors += 1;
                eprintln!("active: operation {} ({:?}) has no completion, a later one has", op.n, op.kind);
                free.push(op.local / slot);
            }
            let op = inflight.pop_front().ok_or("completion with nothing in flight")?;
            if wc.status != WcStatus::Success {
                status_errors += 1;
                eprintln!("active: operation {} ({:?}): completion {:?}", op.n, op.kind, wc.status);
            } else {
                let ok = match op.kind {
                    Kind::Read => {
                        let off = read_offset(op.n, op.size);
                        let mut v = vec![0u8; op.size];
                        mr.read(op.local, &mut v).map_err(|e| e.to_string())?;
                        if !v.is_empty() && faults.fire(Fault::CorruptRead, op.n) {
                            v[0] ^= 1;
                        }
                        v.iter().enumerate().all(|(k, &b)| b == read_byte(off + k))
                    }
                    Kind::FetchAdd | Kind::CompareSwap => {
                        let mut v = [0u8; 8];
                        mr.read(op.local, &mut v).map_err(|e| e.to_string())?;
                        let mut fetched = u64::from_ne_bytes(v);
                        if faults.fire(Fault::WrongFetch, op.n) {
                            fetched ^= 1;
                        }
                        fetched == op.before
                    }
                    Kind::Send | Kind::Write => {
                        delivered += 1;
                        true
                    }
                };
                if !ok {
                    data_errors += 1;
                    eprintln!(
                        "active: operation {} ({:?}, {} bytes) returned wrong data",
                        op.n, op.kind, op.size
                    );
                }
            }
            done += 1;
            free.push(op.local / slot);
        }
    }
}

/// READs the counter once nothing is in flight and compares it with the model: a FetchAdd
/// or CompareSwap applied twice, or never, shows here even when no atomic follows it.
/// Returns the status errors (0 or 1); a wrong value counts in `data_errors`.
fn check_counter(
    qp: &QueuePair,
    cq: &softrdma::CompletionQueue,
    mr: &MemoryRegion,
    rkey: Rkey,
    counter: u64,
    model: u64,
    data_errors: &mut u64,
) -> Result<u64, String> {
    let wr = SendWr {
        wr_id: u64::MAX,
        op: SendOp::Read { remote_addr: counter, rkey },
        sg_list: softrdma::sgl![mr.sge(0, 8).map_err(|e| e.to_string())?],
        flags: SendFlags { signaled: true, ..Default::default() },
        ud: None,
    };
    if let Err(e) = qp.post_send(wr) {
        // The QP failed earlier (that failure counted already).
        eprintln!("active: the READ of the counter: {e}");
        return Ok(1);
    }
    let start = Instant::now();
    let wc = loop {
        if let Some(wc) = cq.poll_one() {
            break wc;
        }
        if start.elapsed() > Duration::from_secs(60) {
            return Err("no completion for 60 s of the READ of the counter".into());
        }
    };
    if wc.wr_id != u64::MAX || wc.status != WcStatus::Success {
        eprintln!("active: the READ of the counter: completion {} {:?}", wc.wr_id, wc.status);
        return Ok(1);
    }
    let mut v = [0u8; 8];
    mr.read(0, &mut v).map_err(|e| e.to_string())?;
    let counter = u64::from_ne_bytes(v);
    if counter != model {
        *data_errors += 1;
        eprintln!("active: the counter holds {counter}, the model {model}");
    }
    Ok(0)
}
