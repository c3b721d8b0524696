//! The progress engine of one opened device: its link (UDP sockets, or an in-memory
//! network), the sans-IO endpoint, the registry of memory, and the work that moves packets
//! between them. The API objects (contexts, PDs, CQs, QPs) reach it only through the named
//! operations of [`Engine`]; completions leave it through [`CompletionSink`]s.
//!
//! Who drives it:
//! - the posting thread sends: `post_send` builds the packets and hands them to the kernel
//!   in one `sendmmsg` batch, the payload gathered straight from registered memory;
//! - a thread polling a completion queue that finds it empty runs one non-blocking pass
//!   (`recvmmsg`, timers, sends) — if no one else holds the engine;
//! - a progress thread per device sleeps on the socket, a wake-up eventfd and the next
//!   protocol deadline, so that the passive side of WRITE, READ and atomics, ACKs and
//!   retransmissions progress while the application does something else or nothing. It
//!   never spins: idle, it blocks in `ppoll` with no timeout.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use softrdma_proto::cm::{CmAgent, CmConfig, CmError, CmEvent, CmState, CommId, Rep, Req};
use softrdma_proto::endpoint::{Arrival, Endpoint, EndpointStats};
use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::{
    QpAttr, QpConfig, QpState, QueuePair, RecvWr, SendOp, SendWr, SrqId, WorkCompletion,
};
use softrdma_proto::{Lkey, Qpn};

use crate::link::{Link, OutMsg, RX_BATCH};
use crate::memory::{MrInner, Registry};
use crate::sys::{self, EventFd};
use crate::{Error, Result};

/// Packets built per `sendmmsg` call (GSO trains count each of their packets).
const BATCH: usize = 64;
/// Segments per GSO train, and its largest total size.
const GSO_MAX_SEGS: usize = 64;
const GSO_MAX_BYTES: usize = 65_000;
/// Room for one outgoing packet, whole: headers, the largest payload (an MTU of 4096
/// bytes), pad and tail. Packets are built end to end in one arena of `BATCH` such rooms,
/// each taking only its length, so that a GSO train is one iovec (see `flush_at`).
const ROOM: usize = 1024 + 4096 + 32;
const _: () = assert!(softrdma_proto::qp::TAIL_ROOM <= 32);
/// The longest the progress thread sleeps while its device has work: timers due later
/// than its wake-up need no nudge (a system call and a context switch per `post_send`).
const MAX_SLEEP: Duration = Duration::from_millis(20);
/// The longest it sleeps once its device has had no timer and no arrival for
/// [`IDLE_NAPS`] naps in a row: an idle device's thread then wakes once a second, not fifty
/// times (eight shards' threads took 0.8 % of a CPU doing nothing). A timer armed
/// meanwhile wakes it, as any timer due before its planned wake-up does (`nudge_later`).
const IDLE_SLEEP: Duration = Duration::from_secs(1);
/// Naps of [`MAX_SLEEP`] with nothing to do after which the progress thread naps
/// [`IDLE_SLEEP`].
const IDLE_NAPS: u32 = 50;
/// Empty CQ polls between two passes of the progress thread that mean an application
/// thread is busy-polling, so the progress thread can leave the socket to it.
const BUSY_POLLS: u64 = 16;
/// How long the progress thread keeps polling the link after it last received, while no
/// application thread polls or waits on it, before it sleeps: the thread that serves a
/// one-sided target (READs, WRITEs, atomics, a program that spins on memory) then meets
/// the next request awake, as a NIC would, instead of paying a wake-up from idle for it
/// (~30 us on a VM's vCPU). An idle device never spins.
const SPIN_AFTER_RX: Duration = Duration::from_micros(50);
/// How often the progress threads look whether the machine has a core to spare for their
/// spin (see [`spin_has_a_core`]).
const RUNNABLE_SAMPLE: Duration = Duration::from_millis(10);
/// Samples in a row that must find more runnable threads than cores before the spin stops:
/// an instant's count is noisy (a kernel worker, a thread waking for a moment), and a
/// one-sided target's spin is worth keeping through it.
const OVERSUBSCRIBED_SAMPLES: u32 = 3;

/// Whether a progress thread's spin after an arrival runs on a core no other thread wants:
/// the machine's runnable threads (the fourth field of `/proc/loadavg`, the spinner itself
/// counted) are no more than its online CPUs. Sampled every [`RUNNABLE_SAMPLE`] at most,
/// for the whole process. Both counts are the machine's (or the VM's); a device whose
/// threads may use one CPU only does not spin at all (see `Engine::may_spin`).
///
/// A spin pays only there. With more runnable threads than cores (on two cores, two
/// programs spinning on memory for each other's WRITEs, as perftest's `ib_write_lat` over
/// UC does, and their two progress threads), a spinning progress thread shares its core
/// with a program's thread in time slices of milliseconds, and the peer's packet waits
/// for the slice; a progress thread that sleeps in the kernel instead is woken by the
/// packet and preempts the spinner. The spin stops after [`OVERSUBSCRIBED_SAMPLES`] such
/// samples in a row and resumes at the first that finds a core free. Where
/// `/proc/loadavg` cannot be read, spinning stays on.
fn spin_has_a_core() -> bool {
    // Nanoseconds since the process's first sample (the devices' own clocks start apart).
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    static SAMPLED: AtomicU64 = AtomicU64::new(0);
    // Samples in a row that found more runnable threads than cores.
    static CROWDED: AtomicU32 = AtomicU32::new(0);
    let last = SAMPLED.load(Ordering::Relaxed);
    let now = ns(EPOCH.get_or_init(Instant::now).elapsed()).max(1);
    if (last == 0 || now.saturating_sub(last) >= ns(RUNNABLE_SAMPLE))
        // One thread samples; the others take the last verdict.
        && SAMPLED.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    {
        if let (Some(&cores), Some(runnable)) = (CORES.get(), runnable_threads()) {
            let crowded =
                if runnable > cores { CROWDED.load(Ordering::Relaxed).saturating_add(1) } else { 0 };
            CROWDED.store(crowded, Ordering::Relaxed);
        }
    }
    CROWDED.load(Ordering::Relaxed) < OVERSUBSCRIBED_SAMPLES
}

/// The machine's online CPUs (at least 1).
fn online_cpus() -> usize {
    // SAFETY: sysconf only reads system configuration.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(1)
}

/// `/proc/loadavg`, opened once for the process by the first device's opening (an
/// application thread's call) and kept: the progress threads read it with `pread` and
/// never open or close a descriptor themselves.
///
/// A background thread that opens and closes files churns descriptor numbers under the
/// application, and an application that closes a descriptor twice (iperf3 does, its test
/// stream's socket) then closes the library's file, or a descriptor that took the number
/// meanwhile: iperf3 over rsockets lost its end-of-test message to that in 3 runs of 8
/// while the progress threads opened `/proc/loadavg` for each sample. `tests/descriptors.rs`
/// guards it.
static LOADAVG: OnceLock<Option<std::fs::File>> = OnceLock::new();

/// Opens [`LOADAVG`] and counts the online CPUs, once per process; called where a device
/// opens.
fn open_load_probe() {
    LOADAVG.get_or_init(|| std::fs::File::open("/proc/loadavg").ok());
    CORES.get_or_init(online_cpus);
}

/// The machine's online CPUs, counted by [`open_load_probe`] (`sysconf` reads a file).
static CORES: OnceLock<usize> = OnceLock::new();

/// The machine's runnable threads now (`/proc/loadavg`'s `running/total`), read through
/// the descriptor [`open_load_probe`] opened; `None` if it could not (then the spin stays
/// on). Should the application have closed that descriptor and reused its number, the
/// read fails or finds text that does not parse, and harms nothing.
fn runnable_threads() -> Option<usize> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 128];
    let n = LOADAVG.get()?.as_ref()?.read_at(&mut buf, 0).ok()?;
    runnable_in_loadavg(std::str::from_utf8(&buf[..n]).ok()?)
}

/// The `running` of `/proc/loadavg`'s `running/total` field (the fourth).
fn runnable_in_loadavg(text: &str) -> Option<usize> {
    text.split_whitespace().nth(3)?.split('/').next()?.parse().ok()
}

/// While application threads come and go watching the link (an event-mode program waits,
/// takes its completion, posts and waits again) less than this apart, the progress thread
/// of a lean hand-back (see [`EventWake::Lean`]) naps this long at most and then looks
/// whether the link is watched again, instead of being woken by every watcher that
/// leaves. A watcher that leaves for good then leaves the link unwatched this long at
/// most (and the timer slack of the nap). Watchers that leave further apart wake it as
/// they leave, one wake-up per message, as the warm hand-back's.
const HANDBACK_STEP: Duration = Duration::from_micros(500);
/// Empty CQ polls after a watcher leaves that run no pass. A thread back from a wait on a
/// completion channel polls its CQ to take what the event announced, posts, and polls
/// again before it waits: its own watch pass received what had come, so such a poll's
/// pass would only ask the socket for nothing (a `recvmmsg` that fails with `EAGAIN`, two
/// per message in a ping-pong). Past these, a thread that keeps polling drives the link
/// as any busy poller does.
const QUIET_POLLS: u32 = 4;
/// A poller that ran no pass for this long has left the link (a busy poll passes every
/// few hundred ns; a thread descheduled on a busy machine is away for tens of us).
const POLLER_GONE: Duration = Duration::from_micros(100);
/// `Engine::last_app_pass` before any pass, and after the polling thread went to block.
const NEVER: u64 = u64::MAX;
/// A post that begins within this time of the previous post's return belongs to a burst
/// (a program posting in a loop: perftest posts one WR per `ibv_post_send`); a ping-pong's
/// posts are a round trip apart (and one taken for a burst only moves its send to the
/// poll that follows it).
const POST_BURST: Duration = Duration::from_micros(4);
/// The most work requests a burst leaves for the next pass to send.
const DEFER_MAX: u32 = 32;
/// The largest message a shard's poster builds and sends itself (one packet at most MTUs;
/// a larger one goes to the shard's thread).
const SMALL_WR: u64 = 4096;
/// The largest message a burst's post leaves for the next pass: four packets at MTU 4096,
/// a short train of its own that a burst's next messages can join. (A UC stream of 16 KiB
/// WRITEs, which no ACK paces, sent each message in a system call of its own: perftest's
/// `ib_write_bw -c UC -s 16384` moved 3.1 GB/s against RC's 5.0.)
const BURST_WR: u64 = 16 * 1024;
/// Tries a poster on a shard makes for its lock before it sleeps on it (some tens of
/// microseconds; see `Engine::lock_spinning`).
const LOCK_SPINS: u32 = 2000;
/// Datagrams a shard holds for another at most (see `Engine::hand_over`).
const STRAYS_MAX: usize = 4096;

/// How long the progress thread naps while an application thread busy-polls, between
/// checks that the polling goes on.
///
/// A long nap costs nothing while the poller stays: it receives and runs the timers. But
/// a program may poll its CQ, then stop and spin on memory for a WRITE that only a pass
/// can place (perftest's `ib_write_lat` does, after every completion): the WRITE then
/// waits for the nap's end. So the nap halves (down to `MIN`) each time it ended with
/// the poller gone and packets waiting, and doubles again (up to `MAX`) after each `CLEAN`
/// naps that found the poller at work with no such stall between them. A check that
/// wakes the progress thread takes a core from the pollers on a small machine, so the nap
/// is long unless the program shows that it needs short ones; and a poller that never
/// left anything behind for `EARN` naps in a row earns longer ones still, up to
/// `MAX_EARNED`. On two cores
/// shared by two busy-polling processes each check preempts a poller for several
/// microseconds: at 1 ms naps the checks alone made the slowest 1 % of a ping-pong's
/// messages (`perf send_lat --local`: 99 % 19–23 µs, 8 µs with 8 ms naps). The first
/// stall after a clean run costs at most `MAX_EARNED` (and the 100 µs in which a poller
/// that just ran a pass counts as still there) and drops the nap back to `MAX` at most.
#[derive(Debug)]
struct PolledNap {
    nap: Duration,
    /// Clean naps since the last stall.
    earned: u32,
    /// The last nap found the poller gone: the pass that follows tells whether it had
    /// left packets behind.
    found_gone: bool,
}

impl PolledNap {
    const MAX: Duration = Duration::from_millis(1);
    const MIN: Duration = Duration::from_micros(100);
    const CLEAN: u32 = 16;
    const EARN: u32 = 64;
    const MAX_EARNED: Duration = Duration::from_millis(4);

    fn new() -> PolledNap {
        PolledNap { nap: Self::MAX, earned: 0, found_gone: false }
    }

    /// A nap ended; `polling`: the poller ran a pass lately or runs one now. Returns
    /// whether the progress thread may nap again without a pass.
    fn ended(&mut self, polling: bool) -> bool {
        self.found_gone = !polling;
        if polling {
            self.earned = self.earned.saturating_add(1);
            if self.earned % Self::CLEAN == 0 {
                let cap = if self.earned >= Self::EARN { Self::MAX_EARNED } else { Self::MAX };
                self.nap = (self.nap * 2).min(cap);
            }
        }
        polling
    }

    /// The progress thread ran a pass, which received something or not.
    fn passed(&mut self, received: bool) {
        if std::mem::take(&mut self.found_gone) && received {
            self.nap = (self.nap / 2).clamp(Self::MIN, Self::MAX);
            self.earned = 0;
        }
    }
}

/// The longest an exiting process waits for an engine's lock to send its held ACKs.
const EXIT_LOCK_WAIT: Duration = Duration::from_millis(100);

/// Peers remembered for what their CM messages announced (see `Core::cm_unannounced`);
/// past this many, the memory starts afresh (a flood of forged REQs holds no more).
const MAX_UNANNOUNCED: usize = 4096;

/// Where the engine puts a QP's completions: a completion queue, as far as the engine
/// knows nothing more.
pub(crate) trait CompletionSink: Send + Sync + std::fmt::Debug {
    /// Queues every completion `next` yields, in order (one taking of the sink's lock
    /// for a QP's batch); false if the sink is then over its size (an overrun: the
    /// completions are kept, and the engine fails the QP).
    fn push_all(&self, next: &mut dyn FnMut() -> Option<WorkCompletion>) -> bool;
    /// The number events name the sink by.
    fn id(&self) -> u32;
    /// Completions queued and the sink's size (for introspection).
    fn depth(&self) -> (usize, usize);
}

/// Where the CM's events for a connection or a listener go (an rdma_cm ID). Called
/// without the engine lock held.
pub(crate) trait CmSink: Send + Sync + std::fmt::Debug {
    /// An event of the agent; `foreign` says whether the peer's CM messages needed the
    /// ID-agnostic ICRC check (Linux rxe, a NIC).
    fn cm_event(&self, ev: CmEvent, foreign: bool);
}

/// The active side's QP, which the engine moves to RTR and RTS when the REP arrives,
/// before it sends the RTU (as the kernel's rdma_cm does).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ActiveQp {
    pub(crate) qpn: Qpn,
    /// What the REQ offered.
    pub(crate) req: crate::cm::Offer,
}

/// A connection's route: its ID, and the QP to move for it.
#[derive(Debug)]
struct CmRoute {
    sink: Weak<dyn CmSink>,
    /// Active: the QP to ready when the REP comes.
    qp: Option<ActiveQp>,
    /// The QP to fail when the connection ends.
    qpn: Option<Qpn>,
}

/// Where a QP's completions go.
#[derive(Debug, Clone)]
struct Route {
    send: Arc<dyn CompletionSink>,
    recv: Arc<dyn CompletionSink>,
}

/// Socket-level counters of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IoStats {
    /// Send calls to the link: a `sendmmsg` each, or one per source port in the batch
    /// when QPs send from ports of their own (see `Context::open_source_ports`).
    pub send_calls: u64,
    /// Packets handed to the kernel.
    pub packets_sent: u64,
    /// Of those messages, GSO trains of two or more packets.
    pub gso_trains: u64,
    /// `recvmmsg` calls that returned data.
    pub recv_calls: u64,
    /// Packets received (GRO trains split).
    pub packets_received: u64,
    /// Received GRO trains of two or more packets.
    pub gro_trains: u64,
    /// Datagrams the kernel refused as larger than the path allows (`EMSGSIZE`): a QP's
    /// path MTU is above what the link carries (a 1500-byte Ethernet MTU carries RoCE
    /// MTU 1024 at most), and its packets are lost until it is lowered.
    pub oversize: u64,
    /// Datagrams a shard of a sharded device received for another shard's QP and handed
    /// to it (0 while the kernel steers every datagram to its shard).
    pub strays: u64,
    /// Times an application thread that watched the link while blocked on a completion
    /// channel woke the napping progress thread as it left with its event (the link's
    /// hand-back; with `SOFTRDMA_EVENT_WAKE=lean`, only from a long nap).
    pub handback_wakes: u64,
    /// Times the progress thread, serving the link, kept polling it after an arrival
    /// instead of sleeping (for up to 50 us; not once the machine has had more runnable
    /// threads than cores for three samples in a row, 10 ms apart).
    pub spins: u64,
    /// Receives by application threads' CQ polls that found nothing on the socket (each a
    /// system call, or one per socket of a link with several): what polls without a
    /// message cost the application.
    pub empty_recvs: u64,
}

impl std::ops::AddAssign for IoStats {
    /// Two shards' counters together.
    fn add_assign(&mut self, o: IoStats) {
        let IoStats {
            send_calls,
            packets_sent,
            gso_trains,
            recv_calls,
            packets_received,
            gro_trains,
            oversize,
            strays,
            handback_wakes,
            spins,
            empty_recvs,
        } = o;
        self.send_calls += send_calls;
        self.packets_sent += packets_sent;
        self.gso_trains += gso_trains;
        self.recv_calls += recv_calls;
        self.packets_received += packets_received;
        self.gro_trains += gro_trains;
        self.oversize += oversize;
        self.strays += strays;
        self.handback_wakes += handback_wakes;
        self.spins += spins;
        self.empty_recvs += empty_recvs;
    }
}

#[derive(Debug, Default)]
struct IoCounters {
    send_calls: AtomicU64,
    packets_sent: AtomicU64,
    gso_trains: AtomicU64,
    recv_calls: AtomicU64,
    packets_received: AtomicU64,
    gro_trains: AtomicU64,
    oversize: AtomicU64,
    strays: AtomicU64,
    handback_wakes: AtomicU64,
    spins: AtomicU64,
    empty_recvs: AtomicU64,
}

/// An asynchronous event (`ibv_async_event`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// A completion queue overran: its QPs were moved to the error state.
    CqError {
        /// The CQ's handle number.
        cq: u32,
    },
    /// A QP entered the error state because of a fatal error.
    QpFatal {
        /// The QP.
        qpn: u32,
    },
    /// The port is active.
    PortActive,
    /// A QP attached to a shared receive queue entered the error state: it will take no
    /// more receives from the SRQ (`IBV_EVENT_QP_LAST_WQE_REACHED`), so its owner may
    /// destroy it.
    QpLastWqeReached {
        /// The QP.
        qpn: u32,
    },
}

/// Everything behind the engine lock.
#[derive(Debug)]
struct Core {
    endpoint: Endpoint,
    mem: Registry,
    /// Where each QP's completions go, by QP number (looked up for every completion: one
    /// multiplication hashes it; QP numbers are the device's own, so the default hasher's
    /// resistance to chosen keys would buy nothing).
    routes: HashMap<u32, Route, crate::memory::KeyHashing>,
    /// The device's asynchronous events, shared by its shards.
    events: Arc<AsyncQueue>,
    link: Box<dyn Link>,
    slots: Vec<u8>,
    out: Vec<OutMsg>,
    /// The iovec vectors of messages sent, kept for the next ones (no allocation per send).
    iov_pool: Vec<crate::sys::EmptyIovs>,
    /// The IDs of the CM's connections.
    cm_routes: HashMap<CommId, CmRoute>,
    /// Listening IDs by service ID.
    cm_listeners: HashMap<u64, Weak<dyn CmSink>>,
    /// CM events to hand to their IDs once the lock is released.
    cm_out: Vec<(Weak<dyn CmSink>, CmEvent, bool)>,
    /// Peers whose last REQ or REP lacked softrdma's ECE (at most `MAX_UNANNOUNCED`),
    /// for QPs connected to them by hand.
    cm_unannounced: HashMap<std::net::IpAddr, bool>,
    /// Where every datagram sent and received is written, if capturing.
    capture: Option<crate::capture::SharedCapture>,
}

/// A device's asynchronous events (`ibv_get_async_event`), which all its shards raise.
#[derive(Debug)]
pub(crate) struct AsyncQueue {
    events: Mutex<VecDeque<AsyncEvent>>,
    /// Readable while `events` is not empty (`ibv_context.async_fd`); signalled and drained
    /// under `events`' lock.
    efd: EventFd,
}

impl AsyncQueue {
    fn new() -> std::io::Result<AsyncQueue> {
        let efd = EventFd::exposed()?;
        efd.signal(); // PortActive is queued.
        Ok(AsyncQueue { events: Mutex::new(VecDeque::from([AsyncEvent::PortActive])), efd })
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<AsyncEvent>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The shard a datagram belongs to, among `shards` (a power of two): the low bits of its
/// destination QPN, QP1 and the multicast QPN on shard 0, as the kernel's steering program
/// computes it (`sys::attach_qpn_steering`). A bundle's two packets name the same QP.
fn shard_of(bytes: &[u8], shards: u32) -> u32 {
    let Some(q) = bytes.get(5..8) else { return 0 };
    qpn_shard(u32::from_be_bytes([0, q[0], q[1], q[2]]), shards)
}

/// The shard of QP number `qpn` (see [`shard_of`]).
fn qpn_shard(qpn: u32, shards: u32) -> u32 {
    if qpn == 1 || qpn == softrdma_proto::MASK_24 {
        0
    } else {
        qpn & (shards - 1)
    }
}

/// A device's engines when it is sharded: each owns the QPs whose numbers carry its index
/// in their low bits, with its own socket in the device's `SO_REUSEPORT` group, its own
/// lock and its own progress thread; shard 0 also runs the CM, the SRQs and the UD QPs.
/// Memory regions are entered in every shard under the same keys.
#[derive(Debug)]
struct Sharding {
    /// This engine's index, and how many shards the device has (a power of two).
    index: u32,
    count: u32,
    /// Every shard of the device by index, this one included (set once all exist).
    all: OnceLock<Vec<Weak<Engine>>>,
    /// Datagrams another shard received for this one's QPs (the kernel's steering
    /// program missing, or a GRO train that merged packets to several QPs), taken by the
    /// next pass; `waiting` is set while there are any.
    inbox: Mutex<Vec<(Arrival, Vec<u8>)>>,
    waiting: AtomicBool,
    /// A post left its packets for this shard's thread to send (see [`Engine::post_send`]).
    flush_wanted: AtomicBool,
}

/// One opened device (or one shard of it), shared by all its objects and its progress
/// thread.
#[derive(Debug)]
pub(crate) struct Engine {
    core: Mutex<Core>,
    sharding: Sharding,
    /// The link's file descriptors, for threads that wait on arrivals.
    link_fds: Vec<RawFd>,
    wake: EventFd,
    local: SocketAddr,
    stop: AtomicBool,
    /// The device's threads may use more than one CPU, so that its progress thread's spin
    /// after an arrival (see [`SPIN_AFTER_RX`]) can have one to itself: counted where the
    /// device opens, by the thread that opens it, whose affinity mask the device's threads
    /// inherit, with the cgroup's CPU quota (`std::thread::available_parallelism`; rounded
    /// down, so a quota of 1.5 CPUs counts one). A device held to one CPU (`taskset -c 0`,
    /// a container given one CPU) never spins: the spinner would take that CPU from the
    /// threads it waits for (two event-mode processes under `taskset -c 0` spun 440 times a
    /// second each, a `ppoll` of no timeout every loop, 1.2 system calls a round trip). A
    /// mask changed after the opening is not seen.
    may_spin: bool,
    io: IoCounters,
    epoch: Instant,
    /// The deadline (ns since `epoch`) the progress thread is sleeping until; u64::MAX
    /// when it sleeps without one.
    sleeping_until: AtomicU64,
    /// CQ polls that found nothing since the progress thread last looked: many mean an
    /// application thread is busy-polling (and receiving itself).
    app_polls: AtomicU64,
    /// When the last pass of a thread polling a CQ ran (ns since the epoch, stamped after
    /// its receiving, before its sends; [`NEVER`] before the first and once the thread
    /// blocks): a napping progress thread reads from it whether the polling goes on.
    last_app_pass: AtomicU64,
    /// A CQ poll found completions (and so ran no pass, which stamps `last_app_pass`)
    /// since the last pass of a polling thread, the progress thread's last look at the end
    /// of a nap, or a thread going to block: posts then stamp `last_app_post`.
    polled_full: AtomicBool,
    /// When a post last found [`Engine::polled_full`] set (ns since the epoch; [`NEVER`]
    /// before): a poller that keeps finding completions is at work, and its posts may
    /// wait for company. Only for that: the progress thread's check that the poller is
    /// still there reads `last_app_pass`, which only passes stamp, so that a program whose
    /// polls always find something still has its arrivals received.
    last_app_post: AtomicU64,
    /// When the last `post_send` returned (ns since the epoch), and how many work requests
    /// posts have left unsent since the last flush (see [`Engine::post_send`]).
    last_post: AtomicU64,
    deferred: AtomicU32,
    /// The progress thread naps because an application thread busy-polls: the poller's
    /// next pass, or the progress thread's check when the nap ends, will send what posts
    /// leave behind. Only then may a post leave its packets for later.
    polled_nap: AtomicBool,
    /// The progress thread spins on the link (traffic flows and no application thread
    /// polls): it takes the engine lock for a pass as soon as a burst of posts ends (see
    /// [`Engine::post_send`]), so a burst's posts may wait for company then too.
    spinning: AtomicBool,
    /// The progress thread is napping off the link.
    napping: AtomicBool,
    /// The progress thread sleeps an idle device's long sleep ([`IDLE_SLEEP`]).
    idle_sleep: AtomicBool,
    /// Application threads blocked on a completion channel that watch the link
    /// themselves (and process what arrives): while there are any, the progress thread
    /// stays off the link, so that an arrival wakes one thread, not two.
    app_watching: AtomicU64,
    /// How the link goes back to the progress thread when the last watcher leaves
    /// ([`EventWake`] as a number).
    event_wake: AtomicU8,
    /// A watcher left since the progress thread last looked.
    watcher_left: AtomicBool,
    /// Passes left to skip for CQ polls that follow a watcher's departure (see
    /// [`QUIET_POLLS`]).
    quiet_polls: AtomicU32,
    /// When the last watcher left (ns since the epoch), and whether it left less than
    /// [`HANDBACK_STEP`] after the one before it.
    last_departure: AtomicU64,
    departures_close: AtomicBool,
    /// The progress thread's nap off the link may last past [`HANDBACK_STEP`]: a watcher
    /// that leaves last must wake it.
    napping_long: AtomicBool,
    /// `Core::async_efd`'s descriptor.
    async_fd: RawFd,
    /// CM events wait in `Core::cm_out`.
    cm_waiting: AtomicBool,
    /// Held by the thread handing out CM events.
    cm_turn: Mutex<()>,
    /// RC responders hold early requests and send SACKs to softrdma peers
    /// (`SOFTRDMA_SELECTIVE=0` turns it off; see `QueuePair::set_selective`).
    selective: bool,
    /// A waiting ACK may ride in the datagram of the QP's next request to a softrdma peer
    /// (`SOFTRDMA_BUNDLE=0` turns it off; see `QueuePair::set_bundle_acks`).
    bundle: bool,
}

/// Whether the switch `name` is on: unless it is `0`, `off` or `no`.
fn on_unless_env(name: &str) -> bool {
    !matches!(std::env::var(name).as_deref(), Ok("0" | "off" | "no"))
}

/// How a device hands its link back to its progress thread in event mode.
///
/// A thread blocked on a completion channel (`CompletionChannel::get_event`) watches the
/// device's socket itself and processes the packet that ends its wait, so that an arrival
/// wakes one thread; the progress thread stays off the link meanwhile. When that thread
/// leaves with its event, the link has to go back to the progress thread, unless the
/// thread comes back to wait (the program takes its completion, posts and waits again,
/// microseconds later). Set per device with `Context::set_event_wake`; the default is
/// [`EventWake::Lean`], or what `SOFTRDMA_EVENT_WAKE` (`lean` or `warm`) names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EventWake {
    /// Departures wake no one while they keep coming: the progress thread naps in steps
    /// of 500 us and looks whether the link is watched again, taking it over only when
    /// it is not; a departure wakes it only from a longer nap (no watcher left during
    /// the last step). One thread woken per message, as a NIC's interrupt wakes one,
    /// and no busy thread. A watcher that leaves for good leaves the link unwatched for
    /// 500 us at most.
    Lean = 0,
    /// Every departure wakes the progress thread, which finds the watcher back and naps
    /// again: two threads woken per message. On a VM whose idle vCPUs halt at once (the
    /// `haltpoll` cpuidle driver with `guest_halt_poll_ns` 0), that activity keeps them
    /// from halting, and a message's wake-up takes a few microseconds instead of about
    /// 30, for about twice the CPU time.
    Warm = 1,
}

impl EventWake {
    fn from_env() -> EventWake {
        EventWake::named(std::env::var("SOFTRDMA_EVENT_WAKE").ok().as_deref())
    }

    /// `SOFTRDMA_EVENT_WAKE`'s value: `warm` or `lean` (any case); unset is lean, and so is
    /// anything else, with a warning.
    fn named(v: Option<&str>) -> EventWake {
        match v.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            Some("warm") => EventWake::Warm,
            None | Some("lean" | "") => EventWake::Lean,
            Some(other) => {
                tracing::warn!(value = other, "SOFTRDMA_EVENT_WAKE is `lean` or `warm`: taking lean");
                EventWake::Lean
            }
        }
    }
}

/// An application thread watching the link; dropping it (however the wait ends) hands the
/// link back to the progress thread if it was the last watcher. With the progress
/// thread's side (it sets `napping_long` and `napping`, then looks at `app_watching`,
/// all sequentially consistent), either the progress thread sees no watcher and does not
/// nap off the link, or the last watcher sees it napping and wakes it, or the nap ends
/// within [`HANDBACK_STEP`] (a lean hand-back's short nap, `napping_long` false).
pub(crate) struct WatchGuard<'a> {
    engine: &'a Engine,
    /// The watcher's own pass received what ended its wait: the polls that follow need
    /// not ask the socket again at once (see [`QUIET_POLLS`]).
    received: bool,
}

impl WatchGuard<'_> {
    /// The watcher's pass, once the link is readable (see `Engine::try_progress_quiet`).
    pub(crate) fn pass(&mut self) {
        self.received |= self.engine.try_progress_quiet();
    }
}

impl Drop for WatchGuard<'_> {
    fn drop(&mut self) {
        let e = self.engine;
        let now = ns(e.now());
        let gap = now.saturating_sub(e.last_departure.swap(now, Ordering::Relaxed));
        e.departures_close.store(gap < ns(HANDBACK_STEP), Ordering::Relaxed);
        e.watcher_left.store(true, Ordering::SeqCst);
        if self.received {
            e.quiet_polls.store(QUIET_POLLS, Ordering::Relaxed);
        }
        if e.app_watching.fetch_sub(1, Ordering::SeqCst) == 1
            && e.napping.load(Ordering::SeqCst)
            && e.napping_long.load(Ordering::SeqCst)
        {
            e.io.handback_wakes.fetch_add(1, Ordering::Relaxed);
            e.wake.signal();
        }
    }
}

/// The GSO train being built: ((source port, destination, TOS, destination QPN), segment
/// size, segments, bytes, still open). A train carries one QP's packets: a receiving
/// device with shards gets each train on the socket of the shard its first packet names.
type Train = ((u16, SocketAddr, u8, u32), usize, usize, usize, bool);

/// The running agent.
fn agent(core: &mut Core) -> Result<&mut CmAgent> {
    core.endpoint.cm_mut().ok_or(Error::InvalidArgument("the connection manager is not running"))
}

fn cm_err(e: CmError) -> Error {
    Error::Cm(e)
}

/// A region may be at most `max_mr_size` bytes, as the device advertises.
fn check_mr_size(len: usize) -> Result<()> {
    if len as u64 > crate::device::MAX_MR_SIZE {
        return Err(Error::Limit("max_mr_size (a region is at most 2^40 bytes)"));
    }
    Ok(())
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u128::from(u64::MAX - 1)) as u64
}

impl Engine {
    pub(crate) fn new(link: Box<dyn Link>) -> std::io::Result<Engine> {
        Engine::new_shard(link, 0, 1, None)
    }

    /// Shard `index` of `count` (a power of two) of a device; `primary`, shard 0, for the
    /// others: they raise their asynchronous events on its queue. Link the shards with
    /// [`Engine::set_shards`] once all exist.
    pub(crate) fn new_shard(
        link: Box<dyn Link>,
        index: u32,
        count: u32,
        primary: Option<&Engine>,
    ) -> std::io::Result<Engine> {
        crate::init_logging();
        open_load_probe();
        let local = link.local();
        let link_fds = link.fds();
        let events = match primary {
            Some(p) => p.lock().events.clone(),
            None => Arc::new(AsyncQueue::new()?),
        };
        let async_fd = events.efd.as_raw_fd();
        let mut endpoint = Endpoint::new(local);
        endpoint.set_source_ports(link.source_ports());
        // Unguessable QP numbers: a blind attacker must guess 24 bits to reach a QP.
        endpoint.set_qpn_key(crate::random_u64());
        endpoint.set_qpn_shard(index, count);
        let core = Core {
            endpoint,
            mem: Registry::new(),
            routes: HashMap::default(),
            events,
            link,
            slots: vec![0; BATCH * ROOM],
            out: Vec::with_capacity(BATCH),
            iov_pool: Vec::new(),
            cm_routes: HashMap::new(),
            cm_listeners: HashMap::new(),
            cm_out: Vec::new(),
            cm_unannounced: HashMap::new(),
            capture: crate::capture::from_env(),
        };
        Ok(Engine {
            core: Mutex::new(core),
            sharding: Sharding {
                index,
                count,
                all: OnceLock::new(),
                inbox: Mutex::new(Vec::new()),
                waiting: AtomicBool::new(false),
                flush_wanted: AtomicBool::new(false),
            },
            link_fds,
            wake: EventFd::new()?,
            async_fd,
            local,
            stop: AtomicBool::new(false),
            may_spin: std::thread::available_parallelism().map_or(true, |n| n.get() > 1),
            io: IoCounters::default(),
            epoch: Instant::now(),
            sleeping_until: AtomicU64::new(u64::MAX),
            app_polls: AtomicU64::new(0),
            last_app_pass: AtomicU64::new(NEVER),
            polled_full: AtomicBool::new(false),
            last_app_post: AtomicU64::new(NEVER),
            last_post: AtomicU64::new(0),
            deferred: AtomicU32::new(0),
            polled_nap: AtomicBool::new(false),
            spinning: AtomicBool::new(false),
            napping: AtomicBool::new(false),
            idle_sleep: AtomicBool::new(false),
            app_watching: AtomicU64::new(0),
            event_wake: AtomicU8::new(EventWake::from_env() as u8),
            watcher_left: AtomicBool::new(false),
            quiet_polls: AtomicU32::new(0),
            last_departure: AtomicU64::new(0),
            departures_close: AtomicBool::new(false),
            napping_long: AtomicBool::new(true),
            cm_waiting: AtomicBool::new(false),
            cm_turn: Mutex::new(()),
            selective: on_unless_env("SOFTRDMA_SELECTIVE"),
            bundle: on_unless_env("SOFTRDMA_BUNDLE"),
        })
    }

    /// The device's address and port.
    pub(crate) fn local(&self) -> SocketAddr {
        self.local
    }

    /// Tells each shard of a device about the others (`all`, by index).
    pub(crate) fn set_shards(all: &[Arc<Engine>]) {
        let weak: Vec<Weak<Engine>> = all.iter().map(Arc::downgrade).collect();
        for e in all {
            let _ = e.sharding.all.set(weak.clone());
        }
    }

    /// The shard that owns QP `qpn`.
    pub(crate) fn shard_of_qpn(&self, qpn: Qpn) -> u32 {
        qpn_shard(qpn.get(), self.sharding.count)
    }

    /// Shard `index` of this engine's device, if it is another one and still there.
    fn sibling(&self, index: u32) -> Option<Arc<Engine>> {
        self.sharding.all.get()?.get(index as usize)?.upgrade()
    }

    /// Hands datagrams this shard received for other shards' QPs to them, and wakes them.
    fn hand_over(&self, strays: &mut Vec<(Arrival, Vec<u8>)>) {
        self.io.strays.fetch_add(strays.len() as u64, Ordering::Relaxed);
        let count = self.sharding.count;
        // By owner, each QP's datagrams in their order (the sort is stable); then each
        // owner's run moves to its inbox, no datagram copied again.
        strays.sort_by_key(|(_, b)| shard_of(b, count));
        while let Some(k) = strays.first().map(|(_, b)| shard_of(b, count)) {
            let run = strays.iter().take_while(|(_, b)| shard_of(b, count) == k).count();
            let batch = strays.drain(..run);
            let Some(to) = self.sibling(k) else { continue };
            let mut inbox = to.sharding.inbox.lock().unwrap_or_else(|p| p.into_inner());
            // Bounded as a socket's buffer is: what a shard that stopped passing would
            // leave is lost, as a full socket loses it.
            let room = STRAYS_MAX.saturating_sub(inbox.len());
            inbox.extend(batch.take(room));
            drop(inbox);
            to.sharding.waiting.store(true, Ordering::Release);
            to.wake.signal();
        }
    }

    /// Runs `f` on QP `qpn` wherever it lives: in this engine, which `core` is, or in
    /// another shard, whose lock is taken under this one's (the CM's calls, on shard 0: a
    /// shard's lock is only ever taken under shard 0's, never the reverse); that shard then
    /// sends what `f` readied and delivers its completions.
    fn on_qp<R>(&self, core: &mut Core, qpn: Qpn, f: impl FnOnce(&mut QueuePair) -> R) -> Option<R> {
        let owner = self.shard_of_qpn(qpn);
        if owner == self.sharding.index {
            return core.endpoint.qp_mut(qpn).map(f);
        }
        let other = self.sibling(owner)?;
        let mut them = other.lock();
        let r = them.endpoint.qp_mut(qpn).map(f);
        other.flush(&mut them);
        other.nudge(&mut them);
        r
    }

    /// Protocol time: nanoseconds since the device was opened.
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        // A panic while holding the lock leaves the protocol state as it was at that
        // point; carrying on is better than poisoning every verbs call after it.
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Self::lock`] for a thread posting to a shard, and for the shard's own thread: the
    /// shard's thread holds the lock for one pass at a time, a poster only to queue its work,
    /// and a thread that sleeps on the mutex instead of waiting that out pays a wake-up
    /// (one thread posting to many shards, perftest's `-q`, met one on most posts, and the
    /// shard's thread one on most of its passes). Spins a few microseconds first.
    fn lock_spinning(&self) -> MutexGuard<'_, Core> {
        for _ in 0..LOCK_SPINS {
            match self.core.try_lock() {
                Ok(core) => return core,
                Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => std::hint::spin_loop(),
            }
        }
        self.lock()
    }

    // ---- Queue pairs -------------------------------------------------------------------

    /// Creates a QP in RESET whose completions go to `send` and `recv`; `setup` runs on
    /// it first (settings that are not attributes, such as a UD QP's MTU).
    pub(crate) fn create_qp(
        &self,
        cfg: QpConfig,
        sinks: [Arc<dyn CompletionSink>; 2],
        max_qp: usize,
        setup: impl FnOnce(&mut QueuePair),
    ) -> Result<Qpn> {
        let [send, recv] = sinks;
        let mut core = self.lock();
        if core.endpoint.qp_count() >= max_qp {
            return Err(Error::Limit("max_qp"));
        }
        let qpn = core.endpoint.create_qp(cfg);
        if let Some(qp) = core.endpoint.qp_mut(qpn) {
            qp.set_selective(self.selective);
            qp.set_bundle_acks(self.bundle);
            setup(qp);
        }
        core.routes.insert(qpn.get(), Route { send, recv });
        Ok(qpn)
    }

    /// QPs on this engine.
    pub(crate) fn qp_count(&self) -> usize {
        self.lock().endpoint.qp_count()
    }

    /// Sends the ACK a QP holds back for company, now: before the QP fails, goes away, or
    /// its connection is closed (a DREQ leaves before any QP's packets in a batch), so
    /// that the peer hears about everything that arrived.
    fn release_acks(&self, core: &mut Core, qpn: Qpn) {
        if self.on_qp(core, qpn, QueuePair::send_acks_now).is_some() {
            self.flush(core);
        }
    }

    /// Sends every ACK that waits for company (a delayed ACK), for a process about to
    /// exit. Waits for the engine lock at most `EXIT_LOCK_WAIT`: an exit never hangs on a
    /// thread that holds it.
    pub(crate) fn release_all_acks(&self) {
        if self.sharding.index == 0 {
            for k in 1..self.sharding.count {
                if let Some(s) = self.sibling(k) {
                    s.release_all_acks();
                }
            }
        }
        let since = Instant::now();
        let mut core = loop {
            match self.core.try_lock() {
                Ok(core) => break core,
                // A pass panicked: leave its state alone at exit.
                Err(std::sync::TryLockError::Poisoned(_)) => return,
                Err(std::sync::TryLockError::WouldBlock) if since.elapsed() < EXIT_LOCK_WAIT => {
                    std::thread::yield_now();
                }
                Err(std::sync::TryLockError::WouldBlock) => return,
            }
        };
        let qpns: Vec<Qpn> = core.endpoint.qps().map(QueuePair::qpn).collect();
        for qpn in qpns {
            if let Some(qp) = core.endpoint.qp_mut(qpn) {
                qp.send_acks_now();
            }
        }
        self.flush(&mut core);
    }

    /// Destroys a QP. Its outstanding work requests are flushed to its CQs first
    /// (WR_FLUSH_ERR), so that their buffers can be reclaimed.
    pub(crate) fn destroy_qp(&self, qpn: Qpn) {
        let mut core = self.lock();
        self.release_acks(&mut core, qpn);
        if let Some(qp) = core.endpoint.qp_mut(qpn) {
            if qp.state() != QpState::Reset {
                let _ = qp.modify(&QpAttr { state: Some(QpState::Error), ..Default::default() });
            }
        }
        Self::deliver(&mut core);
        for group in core.endpoint.mcast_groups(qpn) {
            if core.endpoint.detach_mcast(qpn, group) == Ok(true) {
                core.link.leave(group);
            }
        }
        if let Some(qp) = core.endpoint.destroy_qp(qpn) {
            tracing::debug!(qpn = %format_args!("{:#08x}", qpn.get()), stats = ?qp.stats(), "QP destroyed");
        }
        core.routes.remove(&qpn.get());
    }

    /// Attaches a UD QP to a multicast group; the link joins the group with the device's
    /// first QP in it.
    pub(crate) fn attach_mcast(&self, qpn: Qpn, group: IpAddr) -> Result<()> {
        let mut core = self.lock();
        let first = core.endpoint.attach_mcast(qpn, group).map_err(Error::Mcast)?;
        if first {
            if let Err(e) = core.link.join(group) {
                let _ = core.endpoint.detach_mcast(qpn, group);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Detaches a QP from a group; the link leaves it with the device's last QP in it.
    pub(crate) fn detach_mcast(&self, qpn: Qpn, group: IpAddr) -> Result<()> {
        let mut core = self.lock();
        if core.endpoint.detach_mcast(qpn, group).map_err(Error::Mcast)? {
            core.link.leave(group);
        }
        Ok(())
    }

    /// Runs `f` on a QP (read-only queries: state, attributes, counters).
    pub(crate) fn with_qp<R>(&self, qpn: Qpn, f: impl FnOnce(&QueuePair) -> R) -> Option<R> {
        self.lock().endpoint.qp(qpn).map(f)
    }

    /// Posts send WRs with one pass of the engine, so that their packets leave in as few
    /// system calls as possible. Stops at the first WR refused; returns how many were
    /// posted, with the error.
    ///
    /// A doorbell that waits for company: a post that is part of a burst (it begins within
    /// [`POST_BURST`] of the previous post's return) on a device an application thread
    /// busy-polls leaves its packets for the next pass, up to [`DEFER_MAX`] WRs, so that a
    /// program posting one WR per call (perftest does) still sends a burst as GSO trains,
    /// one system call for many packets, instead of one each. The poller's next CQ poll
    /// sends them (a pass always flushes), as does a thread about to block; should the
    /// poller leave without polling again, the progress thread's check finds it gone and
    /// sends them. A lone post, a ping-pong's, goes at once.
    pub(crate) fn post_send(
        &self,
        qpn: Qpn,
        wrs: impl IntoIterator<Item = SendWr>,
    ) -> std::result::Result<usize, (usize, Error)> {
        stage!(PostEntered);
        timeline!(Post, 0);
        let started = self.now();
        let start = ns(started);
        let mut core = if self.sharding.count > 1 { self.lock_spinning() } else { self.lock() };
        stage!(Locked);
        let Core { endpoint, mem, .. } = &mut *core;
        let Some(qp) = endpoint.qp_mut(qpn) else {
            return Err((0, Error::InvalidArgument("QP destroyed")));
        };
        let mut n = 0;
        let mut failed = None;
        // Only short messages wait for company: a large one makes a GSO train of its own.
        let (mut small, mut short) = (true, true);
        for wr in wrs {
            let read = matches!(wr.op, SendOp::Read { .. });
            let len = wr.sg_list.iter().map(|s| u64::from(s.length)).sum::<u64>();
            small &= read || len <= SMALL_WR;
            short &= read || len <= BURST_WR;
            if let Err(e) = qp.post_send(wr, mem) {
                failed = Some(e.into());
                break;
            }
            n += 1;
        }
        stage!(Queued);
        // A poller that finds completions runs no pass to stamp its liveness: its posts
        // do, with the clock read they make anyway.
        if self.polled_full.load(Ordering::SeqCst) {
            self.last_app_post.store(start, Ordering::SeqCst);
            // A thread going to block clears the flag, then the stamps: if it cleared the
            // flag meanwhile, its clearing of the stamp may have come before ours.
            if !self.polled_full.load(Ordering::SeqCst) {
                self.last_app_post.store(NEVER, Ordering::SeqCst);
            }
        }
        let last_app = self.last_app_seen();
        // Beside a spinning progress thread (a program that posts in long runs and polls
        // only between them, perftest's send loop, whose polls alone never make it a
        // busy poller) the burst leaves when the spin sees it end.
        let spinner = self.spinning.load(Ordering::SeqCst);
        let burst = start.saturating_sub(self.last_post.load(Ordering::Relaxed)) < ns(POST_BURST)
            && (spinner
                || last_app != NEVER
                    && start.saturating_sub(last_app) < ns(POLLER_GONE)
                    && self.polled_nap.load(Ordering::SeqCst));
        let held = (self.deferred.load(Ordering::Relaxed) as usize).saturating_add(n);
        // A thread that polled and is about to block clears its stamps, then looks for
        // packets left behind; this looks at the stamps again after leaving them (all
        // SeqCst), so one of the two sees the other and sends them.
        // (The spinner stops spinning, then takes this lock for its pass: if it was
        // spinning when read above, under the lock, that pass comes after and sends them.)
        let deferred = burst && short && failed.is_none() && held < DEFER_MAX as usize && {
            self.deferred.store(held as u32, Ordering::SeqCst);
            spinner || self.last_app_seen() != NEVER
        };
        if deferred {
            drop(core);
        } else if self.sharding.count > 1 && !small && failed.is_none() {
            // On a shard, a large message's packets are built, checksummed and sent by the
            // shard's own thread: one thread posting to many QPs (perftest's -q) would
            // otherwise copy every byte of every shard itself, and the shards would wait on
            // it. The signal costs a system call; the copies it moves cost far more.
            drop(core);
            self.sharding.flush_wanted.store(true, Ordering::Release);
            self.wake.signal();
        } else {
            // Sent as of the post's start (its clock read serves the flush too: the
            // packets' timers and send times are a few hundred nanoseconds early).
            self.flush_and_wake_at(core, started);
        }
        timeline!(PostEnd, n);
        self.last_post.store(ns(self.now()), Ordering::Relaxed);
        match failed {
            None => Ok(n),
            Some(e) => Err((n, e)),
        }
    }

    /// Posts a receive WR.
    pub(crate) fn post_recv(&self, qpn: Qpn, wr: RecvWr) -> Result<()> {
        timeline!(PostRecv, 0);
        let mut core = self.lock();
        let qp = core.endpoint.qp_mut(qpn).ok_or(Error::InvalidArgument("QP destroyed"))?;
        qp.post_recv(wr)?;
        // A receive posted sends nothing; only in ERR does it complete at once (flushed),
        // and that completion is delivered now.
        if qp.state() == QpState::Error {
            self.flush(&mut core);
        }
        Ok(())
    }

    /// Changes a QP's state and attributes (`ibv_modify_qp`); `prepare` runs on the QP
    /// first, under the same lock (settings that are not attributes: foreign peer, UD MTU).
    pub(crate) fn modify_qp(
        &self,
        qpn: Qpn,
        attr: &QpAttr,
        prepare: impl FnOnce(&mut QueuePair),
    ) -> Result<()> {
        // What shard 0, which runs the CM, knows of the peer (see below), asked before
        // this shard's lock is taken (never shard 0's under another's).
        let foreign_to_cm = match self.sibling(0).filter(|_| self.sharding.index != 0) {
            Some(primary) => {
                let remote = attr.remote.or_else(|| self.with_qp(qpn, |q| q.remote()).flatten());
                remote.is_some_and(|r| primary.cm_knows_foreign(r.ip()))
            }
            None => false,
        };
        let mut core = self.lock();
        let qp = core.endpoint.qp_mut(qpn).ok_or(Error::InvalidArgument("QP destroyed"))?;
        prepare(qp);
        if matches!(attr.state, Some(QpState::Error | QpState::Reset)) {
            self.release_acks(&mut core, qpn);
        }
        let qp = core.endpoint.qp_mut(qpn).ok_or(Error::InvalidArgument("QP destroyed"))?;
        let was = qp.state();
        qp.modify(attr)?;
        let state = qp.state();
        // A peer this device's CM found foreign (its MADs needed the ID-agnostic ICRC
        // check, or its last REQ or REP lacked softrdma's ECE) is foreign to every QP
        // connected to it, however it was connected: an external QP an rdma_cm program
        // moves to RTR itself (UCX's) gets no flag from the CM.
        if let Some(remote) = qp.remote().filter(|_| !qp.foreign_peer()) {
            let unannounced = core.cm_unannounced.get(&remote.ip()).copied().unwrap_or(false);
            if unannounced || foreign_to_cm || core.endpoint.peer_is_foreign(remote.ip()) {
                if let Some(qp) = core.endpoint.qp_mut(qpn) {
                    qp.set_foreign_peer(true);
                }
            }
        }
        if was != QpState::Error && state == QpState::Error {
            let srq = core.endpoint.qp(qpn).is_some_and(|q| q.srq().is_some());
            if srq {
                Self::raise(&mut core, AsyncEvent::QpLastWqeReached { qpn: qpn.get() });
            }
        }
        self.flush(&mut core);
        self.nudge(&mut core);
        Ok(())
    }

    /// Whether this engine found `peer` foreign: its CM messages needed the ID-agnostic
    /// ICRC check, or its last REQ or REP lacked softrdma's ECE.
    fn cm_knows_foreign(&self, peer: IpAddr) -> bool {
        let core = self.lock();
        core.cm_unannounced.get(&peer).copied().unwrap_or(false) || core.endpoint.peer_is_foreign(peer)
    }

    /// Marks a QP's peers as foreign or softrdma.
    pub(crate) fn set_foreign_peer(&self, qpn: Qpn, foreign: bool) {
        if let Some(qp) = self.lock().endpoint.qp_mut(qpn) {
            qp.set_foreign_peer(foreign);
        }
    }

    // ---- Shared receive queues ---------------------------------------------------------

    pub(crate) fn create_srq(&self, max_wr: u32, max_sge: u32) -> SrqId {
        self.lock().endpoint.create_srq(max_wr, max_sge)
    }

    pub(crate) fn destroy_srq(&self, id: SrqId) {
        self.lock().endpoint.destroy_srq(id);
    }

    pub(crate) fn srq_post_recv(&self, id: SrqId, wr: RecvWr) -> Result<()> {
        let mut core = self.lock();
        let srq = core.endpoint.srq_mut(id).ok_or(Error::InvalidArgument("SRQ destroyed"))?;
        srq.post_recv(wr)?;
        Ok(())
    }

    pub(crate) fn srq_len(&self, id: SrqId) -> usize {
        self.lock().endpoint.srq_mut(id).map_or(0, |s| s.len())
    }

    // ---- Memory ------------------------------------------------------------------------

    /// Registers a new zeroed region.
    pub(crate) fn register(
        &self,
        pd: PdId,
        len: usize,
        access: Access,
        max_mr: usize,
    ) -> Result<Arc<MrInner>> {
        check_mr_size(len)?;
        let mut core = self.lock();
        if core.mem.len() >= max_mr {
            return Err(Error::Limit("max_mr"));
        }
        core.mem.register(pd, len, access)
    }

    /// What `softrdma res` shows of this device, named `name`.
    pub(crate) fn resources(&self, name: &str) -> crate::introspect::DeviceRes {
        let core = self.lock();
        let qps = core
            .endpoint
            .qps()
            .map(|q| {
                let a = q.attr();
                let s = q.stats();
                let route = core.routes.get(&q.qpn().get());
                crate::introspect::QpRes {
                    send_cq: route.map(|r| r.send.id()),
                    recv_cq: route.map(|r| r.recv.id()),
                    qpn: q.qpn().get(),
                    r#type: format!("{:?}", q.qp_type()).to_uppercase(),
                    state: format!("{:?}", q.state()).to_uppercase(),
                    peer: q.remote().map(|r| r.to_string()),
                    dest_qpn: a.dest_qpn.map(|d| d.get()),
                    sq_psn: a.sq_psn.map(|p| p.get()),
                    rq_psn: a.rq_psn.map(|p| p.get()),
                    send_queue: q.send_queue_len(),
                    recv_queue: q.recv_queue_len(),
                    packets_sent: s.packets_sent,
                    retransmits: s.retransmits,
                    timeouts: s.timeouts,
                    probes: s.probes,
                    sacks_sent: s.sacks_sent,
                    sacks_received: s.sacks_received,
                    held: s.held,
                    dropped: s.dropped,
                    duplicates: s.duplicates,
                    acks_bundled: s.acks_bundled,
                }
            })
            .collect();
        let mut cqs: Vec<crate::introspect::CqRes> = Vec::new();
        for r in core.routes.values() {
            for s in [&r.send, &r.recv] {
                if !cqs.iter().any(|c| c.id == s.id()) {
                    let (queued, size) = s.depth();
                    cqs.push(crate::introspect::CqRes { id: s.id(), queued, size });
                }
            }
        }
        cqs.sort_by_key(|c| c.id);
        let e = core.endpoint.stats();
        let io = self.io_stats();
        crate::introspect::DeviceRes {
            cqs,
            name: name.to_string(),
            addr: self.local.to_string(),
            qps,
            mrs: core.mem.list(),
            packets_received: e.received,
            icrc_errors: e.icrc_errors,
            malformed: e.malformed,
            unknown_qp: e.unknown_qp,
            pkey_violations: e.pkey_violations,
            bundles: e.bundles,
            send_calls: io.send_calls,
            packets_sent: io.packets_sent,
            gso_trains: io.gso_trains,
            recv_calls: io.recv_calls,
        }
    }

    /// Writes every datagram from now on to `capture` (or stops, with `None`).
    pub(crate) fn set_capture(&self, capture: Option<crate::capture::SharedCapture>) {
        self.lock().capture = capture;
    }

    /// Registers a caller's range.
    ///
    /// # Safety
    ///
    /// As [`crate::ProtectionDomain::register_raw`].
    pub(crate) unsafe fn register_raw(
        &self,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        access: Access,
        max_mr: usize,
    ) -> Result<Arc<MrInner>> {
        check_mr_size(len)?;
        let mut core = self.lock();
        if core.mem.len() >= max_mr {
            return Err(Error::Limit("max_mr"));
        }
        // SAFETY: forwarded from this function's contract.
        Ok(unsafe { core.mem.register_raw(pd, ptr, len, access) })
    }

    /// Deregisters a region at once: the engine can no longer reach it when this returns.
    pub(crate) fn deregister(&self, lkey: Lkey) {
        self.lock().mem.deregister(lkey);
    }

    /// Enters a region shard 0 registered in this shard, under the same keys.
    pub(crate) fn adopt(&self, mr: &Arc<MrInner>) {
        self.lock().mem.adopt(mr);
    }

    pub(crate) fn mr_count(&self) -> usize {
        self.lock().mem.len()
    }

    // ---- Device ------------------------------------------------------------------------

    pub(crate) fn pop_async_event(&self) -> Option<AsyncEvent> {
        let queue = self.lock().events.clone();
        let mut events = queue.lock();
        let ev = events.pop_front();
        // Under the lock that pushes signal, so the fd is readable exactly while one waits.
        if events.is_empty() {
            queue.efd.drain();
        }
        ev
    }

    /// Readable while an asynchronous event is queued.
    pub(crate) fn async_fd(&self) -> RawFd {
        self.async_fd
    }

    pub(crate) fn endpoint_stats(&self) -> EndpointStats {
        self.lock().endpoint.stats()
    }

    pub(crate) fn pkey_table(&self) -> Vec<u16> {
        self.lock().endpoint.pkey_table().to_vec()
    }

    pub(crate) fn io_stats(&self) -> IoStats {
        let c = &self.io;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IoStats {
            send_calls: g(&c.send_calls),
            packets_sent: g(&c.packets_sent),
            gso_trains: g(&c.gso_trains),
            recv_calls: g(&c.recv_calls),
            packets_received: g(&c.packets_received),
            gro_trains: g(&c.gro_trains),
            oversize: g(&c.oversize),
            strays: g(&c.strays),
            handback_wakes: g(&c.handback_wakes),
            spins: g(&c.spins),
            empty_recvs: g(&c.empty_recvs),
        }
    }

    // ---- Connection manager ----------------------------------------------------------

    /// Starts the CM on QP1 unless it runs.
    pub(crate) fn cm_enable(&self, cfg: impl FnOnce() -> CmConfig) {
        let mut core = self.lock();
        if core.endpoint.cm().is_none() {
            core.endpoint.enable_cm(cfg());
        }
    }

    /// Runs `f` with the agent under the lock, sends what it queued, then hands out the
    /// events that are waiting.
    fn with_cm<R>(&self, f: impl FnOnce(&mut Core, Duration) -> Result<R>) -> Result<R> {
        // Data posted on other shards before a CM call (a DREQ) leaves before its messages
        // too; asked before this shard's lock is taken (never another's under it but by
        // `on_qp`).
        for k in 1..self.sharding.count {
            if let Some(s) = self.sibling(k) {
                if s.sharding.flush_wanted.load(Ordering::Acquire) {
                    s.flush_and_wake(s.lock());
                } else {
                    s.send_deferred();
                }
            }
        }
        let r = {
            let mut core = self.lock();
            if core.endpoint.cm().is_none() {
                return Err(Error::InvalidArgument("the connection manager is not running"));
            }
            if self.deferred.load(Ordering::Relaxed) > 0 || self.sharding.flush_wanted.load(Ordering::Acquire)
            {
                // Data posted before a CM call (a DREQ) leaves before its messages.
                self.flush(&mut core);
            }
            let now = self.now();
            let r = f(&mut core, now);
            self.flush(&mut core);
            self.nudge(&mut core);
            r
        };
        self.deliver_cm();
        r
    }

    /// Takes REQs and SIDR_REQs for `sid`, reporting them to `sink`.
    pub(crate) fn cm_listen(&self, sid: u64, backlog: usize, sink: Weak<dyn CmSink>) -> Result<()> {
        self.with_cm(|core, _| {
            agent(core)?.listen(sid, backlog).map_err(cm_err)?;
            core.cm_listeners.insert(sid, sink);
            Ok(())
        })
    }

    pub(crate) fn cm_unlisten(&self, sid: u64) {
        let _ = self.with_cm(|core, _| {
            agent(core)?.unlisten(sid);
            core.cm_listeners.remove(&sid);
            Ok(())
        });
    }

    /// Sends a REQ; with `qp`, the engine readies the QP when the REP comes and sends the
    /// RTU itself.
    pub(crate) fn cm_connect(
        &self,
        peer: std::net::IpAddr,
        req: Req,
        sink: Weak<dyn CmSink>,
        qp: Option<ActiveQp>,
    ) -> Result<CommId> {
        self.with_cm(|core, now| {
            let id = agent(core)?.connect(now, peer, req).map_err(cm_err)?;
            core.cm_routes.insert(id, CmRoute { sink, qpn: qp.map(|q| q.qpn), qp });
            Ok(id)
        })
    }

    /// Sends a SIDR_REQ.
    pub(crate) fn cm_sidr_request(
        &self,
        peer: std::net::IpAddr,
        sid: u64,
        private_data: &[u8],
        sink: Weak<dyn CmSink>,
    ) -> Result<CommId> {
        self.with_cm(|core, now| {
            let id = agent(core)?.sidr_request(now, peer, sid, private_data).map_err(cm_err)?;
            core.cm_routes.insert(id, CmRoute { sink, qp: None, qpn: None });
            Ok(id)
        })
    }

    /// Passive: moves the QP (if any) to RTR and RTS with `attrs`, then sends the REP.
    pub(crate) fn cm_accept(
        &self,
        comm: CommId,
        rep: Rep,
        qp: Option<(Qpn, [QpAttr; 2], bool)>,
    ) -> Result<()> {
        self.with_cm(|core, now| {
            if let Some((qpn, attrs, foreign)) = qp {
                self.on_qp(core, qpn, |q| {
                    q.set_foreign_peer(foreign);
                    attrs.iter().try_for_each(|a| q.modify(a))
                })
                .ok_or(Error::InvalidArgument("QP destroyed"))??;
                if let Some(r) = core.cm_routes.get_mut(&comm) {
                    r.qpn = Some(qpn);
                }
            }
            agent(core)?.accept(now, comm, rep).map_err(cm_err)
        })
    }

    /// Passive: answers a SIDR_REQ.
    pub(crate) fn cm_sidr_reply(
        &self,
        comm: CommId,
        status: u8,
        qpn: u32,
        qkey: u32,
        data: &[u8],
    ) -> Result<()> {
        self.with_cm(|core, _| agent(core)?.sidr_reply(comm, status, qpn, qkey, data).map_err(cm_err))
    }

    /// Refuses a request (or a REP) with a REJ.
    pub(crate) fn cm_reject(&self, comm: CommId, reason: u16, data: &[u8]) -> Result<()> {
        self.with_cm(|core, _| agent(core)?.reject(comm, reason, data).map_err(cm_err))
    }

    /// Active without a QP the engine readies: sends the RTU.
    pub(crate) fn cm_rtu(&self, comm: CommId) -> Result<()> {
        self.with_cm(|core, _| agent(core)?.rtu(comm, &[]).map_err(cm_err))
    }

    /// Passive: the connection is in use before the RTU came.
    pub(crate) fn cm_establish(&self, comm: CommId) -> Result<()> {
        self.with_cm(|core, _| agent(core)?.establish(comm).map_err(cm_err))
    }

    /// Moves the QP to ERR (flushing its work requests) and sends a DREQ, if the
    /// connection is one that a DREQ closes; a connection already closing is left alone.
    pub(crate) fn cm_disconnect(&self, comm: CommId, qpn: Option<Qpn>) -> Result<()> {
        self.with_cm(|core, now| {
            if let Some(q) = qpn {
                self.release_acks(core, q);
                self.on_qp(core, q, |q| {
                    let _ = q.modify(&QpAttr { state: Some(QpState::Error), ..Default::default() });
                });
            }
            let cm = agent(core)?;
            match cm.disconnect(now, comm, &[]) {
                Ok(()) | Err(CmError::State(_)) | Err(CmError::UnknownId) => Ok(()),
                Err(e) => Err(cm_err(e)),
            }
        })
    }

    /// Forgets a connection's ID: an established connection is disconnected (the agent
    /// finishes the DREQ on its own), any other is dropped; no more events for it.
    pub(crate) fn cm_destroy(&self, comm: CommId) {
        let _ = self.with_cm(|core, now| {
            if let Some(q) = core.cm_routes.remove(&comm).and_then(|r| r.qpn) {
                self.release_acks(core, q);
            }
            let cm = agent(core)?;
            match cm.state(comm) {
                Some(CmState::Established) => {
                    let _ = cm.disconnect(now, comm, &[]);
                }
                Some(CmState::DreqSent | CmState::Timewait) => {}
                _ => cm.destroy(comm),
            }
            Ok(())
        });
    }

    /// Sends a connection's further events to `sink` (a listener handing a new
    /// connection to its own ID).
    pub(crate) fn cm_set_sink(&self, comm: CommId, sink: Weak<dyn CmSink>) {
        if let Some(r) = self.lock().cm_routes.get_mut(&comm) {
            r.sink = sink;
        }
    }

    /// Whether `peer`'s CM messages needed the ID-agnostic ICRC check.
    pub(crate) fn peer_is_foreign(&self, peer: std::net::IpAddr) -> bool {
        self.lock().endpoint.peer_is_foreign(peer)
    }

    /// Takes the agent's events: readies active QPs and sends their RTU, fails the QPs of
    /// connections that ended, and queues each event for its ID.
    fn cm_pump(&self, core: &mut Core) {
        use softrdma_proto::cm::RejReason;
        let before = core.cm_out.len();
        while let Some(ev) = core.endpoint.cm_mut().and_then(CmAgent::poll_event) {
            let comm = ev.id();
            let peer = core.endpoint.cm().and_then(|c| c.peer(comm));
            // A peer is foreign if its packets need the ID-agnostic ICRC check, or if its
            // REQ or REP does not carry softrdma's ECE (see `cm::SOFTRDMA_ECE` and
            // `SOFTRDMA_ECE_REPLY`): a foreign peer never gets SACKs, whatever its IP
            // Identification looks like.
            let unannounced = match &ev {
                CmEvent::ConnectRequest { req, .. } => Some(req.ece_vendor_id != crate::cm::SOFTRDMA_ECE),
                CmEvent::ConnectResponse { rep, .. } => {
                    Some(rep.ece_vendor_id != crate::cm::SOFTRDMA_ECE_REPLY)
                }
                _ => None,
            };
            if let (Some(p), Some(u)) = (peer, unannounced) {
                if core.cm_unannounced.len() >= MAX_UNANNOUNCED && !core.cm_unannounced.contains_key(&p) {
                    core.cm_unannounced.clear();
                }
                core.cm_unannounced.insert(p, u);
            }
            let foreign = unannounced == Some(true) || peer.is_some_and(|p| core.endpoint.peer_is_foreign(p));
            match &ev {
                CmEvent::ConnectRequest { req, .. } => {
                    let Some(sink) = core.cm_listeners.get(&req.service_id).cloned() else {
                        let _ = agent(core).map(|c| c.reject(comm, RejReason::InvalidServiceId as u16, &[]));
                        continue;
                    };
                    core.cm_routes.insert(comm, CmRoute { sink, qp: None, qpn: None });
                }
                CmEvent::SidrRequest { req, .. } => {
                    let Some(sink) = core.cm_listeners.get(&req.service_id).cloned() else {
                        let _ = agent(core).map(|c| c.sidr_reply(comm, 1, 0, 0, &[]));
                        continue;
                    };
                    core.cm_routes.insert(comm, CmRoute { sink, qp: None, qpn: None });
                }
                CmEvent::ConnectResponse { rep, .. } => {
                    let active = core.cm_routes.get(&comm).and_then(|r| r.qp);
                    if let (Some(a), Some(peer)) = (active, peer) {
                        let attrs =
                            crate::cm::active_attrs(&a.req, rep, SocketAddr::new(peer, self.local.port()));
                        let ready = self
                            .on_qp(core, a.qpn, |q| {
                                q.set_foreign_peer(foreign);
                                attrs.iter().try_for_each(|at| q.modify(at)).is_ok()
                            })
                            .unwrap_or(false);
                        let cm = core.endpoint.cm_mut();
                        if ready {
                            let _ = cm.map(|c| c.rtu(comm, &[]));
                        } else {
                            let _ = cm.map(|c| c.reject(comm, RejReason::NoQp as u16, &[]));
                            let sink = core.cm_routes.remove(&comm).map(|r| r.sink);
                            if let Some(sink) = sink {
                                core.cm_out.push((sink, CmEvent::Unreachable { id: comm }, foreign));
                            }
                            continue;
                        }
                    }
                }
                CmEvent::Rejected { .. } | CmEvent::Unreachable { .. } | CmEvent::Disconnected { .. } => {
                    if let Some(qpn) = core.cm_routes.get(&comm).and_then(|r| r.qpn) {
                        self.on_qp(core, qpn, |q| {
                            let _ = q.modify(&QpAttr { state: Some(QpState::Error), ..Default::default() });
                        });
                    }
                }
                _ => {}
            }
            let ends = matches!(
                ev,
                CmEvent::Rejected { .. }
                    | CmEvent::Unreachable { .. }
                    | CmEvent::TimewaitExit { .. }
                    | CmEvent::SidrResponse { .. }
            );
            let route = if ends { core.cm_routes.remove(&comm) } else { None };
            let sink = route.map(|r| r.sink).or_else(|| core.cm_routes.get(&comm).map(|r| r.sink.clone()));
            if let Some(sink) = sink {
                core.cm_out.push((sink, ev, foreign));
            }
        }
        if core.cm_out.len() > before {
            self.cm_waiting.store(true, Ordering::Release);
            self.wake.signal();
        }
    }

    /// Hands the queued CM events to their IDs, in order, without the engine lock.
    pub(crate) fn deliver_cm(&self) {
        if !self.cm_waiting.load(Ordering::Acquire) {
            return;
        }
        // One thread delivers at a time, so that an ID sees its events in order; a thread
        // that finds another delivering leaves the work to it.
        let Ok(_turn) = self.cm_turn.try_lock() else { return };
        loop {
            let out = {
                let mut core = self.lock();
                self.cm_waiting.store(false, Ordering::Release);
                std::mem::take(&mut core.cm_out)
            };
            if out.is_empty() {
                return;
            }
            for (sink, ev, foreign) in out {
                if let Some(s) = sink.upgrade() {
                    s.cm_event(ev, foreign);
                }
            }
        }
    }

    // ---- Progress ----------------------------------------------------------------------

    /// Runs one pass if the engine is free; returns whether it ran. Called by threads
    /// polling a CQ, which also tells the progress thread that someone is busy-polling.
    /// The first [`QUIET_POLLS`] after a watcher leaves run none.
    pub(crate) fn try_progress(&self) -> bool {
        self.count_app_poll();
        // Checked, never below zero: threads polling at once may race for the last one.
        // Posts a burst left for the next pass go with a pass, as they would have.
        if self.quiet_polls.load(Ordering::Relaxed) > 0
            && self.deferred.load(Ordering::SeqCst) == 0
            && self
                .quiet_polls
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| q.checked_sub(1))
                .is_ok()
        {
            return false;
        }
        let mut core = match self.core.try_lock() {
            Ok(core) => core,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        self.progress(&mut core, true);
        // A timer this pass armed (a delayed ACK, a CM deadline) while the progress thread
        // sleeps an idle device's long sleep must wake it; beside a poller it naps short
        // and the poller's passes run the timers.
        let wake = self.idle_sleep.load(Ordering::SeqCst) && self.nudge_later(&mut core);
        drop(core);
        if wake {
            self.wake.signal();
        }
        true
    }

    /// The longest the progress thread may sleep after `idle_naps` naps with nothing to do:
    /// [`IDLE_SLEEP`] past [`IDLE_NAPS`] of them, unless an application thread has begun
    /// to busy-poll (which `count_app_poll` would otherwise have to wake it for).
    fn idle_longest(&self, idle_naps: u32) -> Duration {
        let idle = idle_naps > IDLE_NAPS;
        self.idle_sleep.store(idle, Ordering::SeqCst);
        if idle && self.app_polls.load(Ordering::SeqCst) < BUSY_POLLS {
            IDLE_SLEEP
        } else {
            MAX_SLEEP
        }
    }

    /// One more CQ poll by an application thread. The poll that makes a busy poller of it
    /// wakes a progress thread in an idle device's long sleep, which would otherwise see
    /// the polling only at its next wake-up (a second away) and, until then, not nap
    /// as it does beside a poller (the state in which posts may wait for company).
    fn count_app_poll(&self) {
        // Sequentially consistent with the progress thread's store of `idle_sleep` and its
        // look at `app_polls` after it (see `Engine::idle_longest`).
        if self.app_polls.fetch_add(1, Ordering::SeqCst) + 1 == BUSY_POLLS
            && self.idle_sleep.load(Ordering::SeqCst)
        {
            self.wake.signal();
        }
    }

    /// A CQ poll found completions and returns without a pass: it still counts as a busy
    /// poll (a program that streams sends finds completions at most polls, and its posts
    /// should wait for company as a poller's do), and it sends what a burst of posts left
    /// for the next pass, which a poller that keeps finding completions never runs.
    pub(crate) fn polled_full(&self) {
        self.count_app_poll();
        if !self.polled_full.load(Ordering::Relaxed) {
            self.polled_full.store(true, Ordering::Relaxed);
        }
        self.try_send_deferred();
    }

    /// When a polling application thread last showed it is at work: its last pass, or its
    /// last post after polls that found completions; [`NEVER`] if neither since it last
    /// went to block.
    fn last_app_seen(&self) -> u64 {
        match (self.last_app_pass.load(Ordering::SeqCst), self.last_app_post.load(Ordering::SeqCst)) {
            (NEVER, post) => post,
            (pass, NEVER) => pass,
            (pass, post) => pass.max(post),
        }
    }

    /// Runs one pass if the engine is free, without counting as a busy poll.
    pub(crate) fn try_progress_quiet(&self) -> bool {
        let Ok(mut core) = self.core.try_lock() else { return false };
        let received = self.progress(&mut core, false);
        // A timer the pass armed (a delayed ACK) is the progress thread's to run: lower its
        // wake-up, and wake it unless it naps a lean hand-back's short step, which ends
        // soon enough (`napping_long` speaks of the nap under way only).
        let short_nap = self.napping.load(Ordering::SeqCst) && !self.napping_long.load(Ordering::SeqCst);
        let wake = self.nudge_later(&mut core) && !short_nap;
        drop(core);
        if wake {
            self.wake.signal();
        }
        received
    }

    /// Receives what is waiting, runs due timers, sends what is ready and delivers
    /// completions. Never blocks. Returns whether it received anything. `polled`: an
    /// application thread polling a CQ runs it.
    fn progress(&self, core: &mut Core, polled: bool) -> bool {
        self.progress_receiving(core, polled, true)
    }

    /// [`Self::progress`], receiving from the link only if `receive`.
    fn progress_receiving(&self, core: &mut Core, polled: bool, receive: bool) -> bool {
        let now = self.now();
        let mut received = false;
        let (shard, shards) = (self.sharding.index, self.sharding.count);
        if shards > 1 {
            // Whatever posts left for this thread goes with this pass's flush.
            self.sharding.flush_wanted.store(false, Ordering::Release);
            if self.sharding.waiting.swap(false, Ordering::AcqRel) {
                received |= self.take_strays(core, now);
            }
        }
        let mut strays: Vec<(Arrival, Vec<u8>)> = Vec::new();
        // Receive calls: up to 8 (see below); none unless `receive`.
        let rounds = if receive { 8 } else { 0 };
        for _ in 0..rounds {
            let Core { endpoint, mem, link, capture, .. } = &mut *core;
            let mut cap = capture.as_ref().map(|c| c.lock().unwrap_or_else(|p| p.into_inner()));
            let got = link.recv(&mut |meta, bytes| {
                if shards > 1 {
                    let owner = shard_of(bytes, shards);
                    if owner != shard {
                        // Group traffic reaches shard 0 by its own sockets: a copy here
                        // (a wildcard address) is not handed on.
                        if bytes.get(5..8) != Some(&[0xff; 3][..]) {
                            strays.push((
                                Arrival { src: meta.src, dst: meta.dst, tos: meta.tos },
                                bytes.to_vec(),
                            ));
                        }
                        return;
                    }
                }
                stage!(PacketIn);
                if let Some(c) = cap.as_mut() {
                    c.packet(meta.src, meta.dst, meta.tos, bytes);
                }
                endpoint.handle_datagram(
                    now,
                    Arrival { src: meta.src, dst: meta.dst, tos: meta.tos },
                    bytes,
                    mem,
                );
                stage!(PacketHandled);
            });
            if got.datagrams == 0 && polled {
                self.io.empty_recvs.fetch_add(1, Ordering::Relaxed);
            }
            if got.datagrams > 0 {
                timeline!(Recv, got.packets);
                stage!(RecvDone);
                received = true;
                // Written through at once: a process may end without dropping the capture.
                if let Some(c) = cap.as_mut() {
                    c.flush();
                }
                self.io.recv_calls.fetch_add(1, Ordering::Relaxed);
                self.io.packets_received.fetch_add(got.packets, Ordering::Relaxed);
                self.io.gro_trains.fetch_add(got.trains, Ordering::Relaxed);
            }
            // Another round after a full batch, and after a GRO train: a stream's sender
            // sends its trains back to back, and the next one has most likely come while
            // this one was handled. Taken now, it is handled before the pass's ACK (one
            // ACK for both) and before the application's turn with the completions of the
            // first, instead of after both. A lone datagram (a ping-pong's) ends the
            // receiving at once.
            if got.datagrams < RX_BATCH && got.trains == 0 {
                break;
            }
        }
        if !strays.is_empty() {
            self.hand_over(&mut strays);
        }
        if core.endpoint.poll_timeout().is_some_and(|t| t <= now) {
            core.endpoint.handle_timeout(now);
        }
        if received {
            stage!(TimersRun);
        }
        // A pass that received nothing took no time worth a second clock read (a
        // busy-polling thread makes millions of them); after arrivals, what is sent now is
        // stamped now, for the round-trip samples.
        let now = if received { self.now() } else { now };
        if polled {
            self.last_app_pass.store(ns(now), Ordering::Relaxed);
            if self.polled_full.load(Ordering::Relaxed) {
                self.polled_full.store(false, Ordering::Relaxed);
            }
        }
        self.flush_at(core, now);
        if received {
            stage!(PassDone);
        }
        received
    }

    /// Handles the datagrams other shards received for this one's QPs; whether there were
    /// any.
    fn take_strays(&self, core: &mut Core, now: Duration) -> bool {
        let strays = std::mem::take(&mut *self.sharding.inbox.lock().unwrap_or_else(|p| p.into_inner()));
        let Core { endpoint, mem, capture, .. } = &mut *core;
        let mut cap = capture.as_ref().map(|c| c.lock().unwrap_or_else(|p| p.into_inner()));
        for (arrival, bytes) in &strays {
            if let Some(c) = cap.as_mut() {
                c.packet(arrival.src, arrival.dst, arrival.tos, bytes);
            }
            endpoint.handle_datagram(now, *arrival, bytes, mem);
        }
        if let Some(c) = cap.as_mut() {
            c.flush();
        }
        !strays.is_empty()
    }

    /// Sends every packet the QPs have ready, then delivers completions. Consecutive
    /// packets of one size to one destination go as a GSO train when the link allows.
    fn flush(&self, core: &mut Core) {
        self.flush_at(core, self.now());
    }

    /// [`Self::flush`] at `now`.
    fn flush_at(&self, core: &mut Core, now: Duration) {
        self.deferred.store(0, Ordering::Relaxed);
        let local = self.local;
        if core.endpoint.cm().is_some() {
            self.cm_pump(core);
        }
        stage!(FlushBegins);
        loop {
            let Core { endpoint, mem, slots, out: msgs, iov_pool, link, capture, .. } = &mut *core;
            let gso = link.gso();
            let sharded = self.sharding.count > 1;
            iov_pool.extend(msgs.drain(..).map(OutMsg::into_iov));
            // The last message's train (see `Train`).
            let mut train: Option<Train> = None;
            // Where the next packet goes in `slots`: right after the last one. Every packet
            // is reached through `base`, so that an iovec merged over several packets
            // points into one allocation through one pointer; `slots` itself is not
            // touched again until the send is over.
            let (base, room) = (slots.as_mut_ptr(), slots.len());
            let mut at = 0;
            let mut built = 0;
            while built < BATCH && at + ROOM <= room {
                // SAFETY: [at, at + ROOM) lies inside `slots` (checked above), and no other
                // live reference covers it: earlier packets lie below `at`.
                let buf = unsafe { std::slice::from_raw_parts_mut(base.add(at), ROOM) };
                let Some(t) = endpoint.poll_transmit(now, buf, mem) else { break };
                built += 1;
                stage!(PacketBuilt);
                let len = t.len();
                let qpn = match buf.get(5..8) {
                    Some(q) if sharded => u32::from_be_bytes([0, q[0], q[1], q[2]]),
                    _ => 0,
                };
                let joins = gso
                    && !t.alone
                    && matches!(train, Some((flow, size, segs, bytes, true))
                        if flow == (t.src_port, t.dst, t.tos, qpn) && len <= size && segs < GSO_MAX_SEGS && bytes + len <= GSO_MAX_BYTES);
                if !joins {
                    let iov = iov_pool.pop().unwrap_or_else(|| crate::sys::EmptyIovs::with_capacity(8));
                    msgs.push(OutMsg::with_iov(SocketAddr::new(local.ip(), t.src_port), t.dst, t.tos, iov));
                    train = Some(((t.src_port, t.dst, t.tos, qpn), len, 0, 0, !t.alone));
                }
                let (Some(msg), Some(tr)) = (msgs.last_mut(), train.as_mut()) else { break };
                tr.2 += 1;
                tr.3 += len;
                // A shorter packet ends the train: only the last segment may be short.
                tr.4 = len == tr.1;
                if tr.2 > 1 {
                    msg.gso = u16::try_from(tr.1).ok();
                }
                self.io.packets_sent.fetch_add(1, Ordering::Relaxed);
                // The protocol copies the payload into `buf` when the packet fits, which
                // every packet of an MTU up to 4096 does: the tail goes right after it, and
                // the packet extends its train's iovec. Segments left in memory (a packet
                // too big for `ROOM`) go as iovecs of their own, the tail after the head,
                // and end the train (a message holds at most `IOV_MAX` iovecs).
                let mut end = t.head_len;
                buf[end..end + t.tail_len].copy_from_slice(&t.tail[..t.tail_len]);
                // SAFETY (both): offsets inside this packet's ROOM of `slots`.
                let (head, tail) = unsafe { (base.add(at), base.add(at + end)) };
                if !t.payload.is_empty() {
                    tr.4 = false;
                    msg.push_iov(head, end);
                    for seg in &t.payload {
                        let Some((ptr, n)) = mem.raw(t.pd, seg) else { continue };
                        msg.iov.push(libc::iovec { iov_base: ptr as *mut libc::c_void, iov_len: n });
                    }
                    msg.iov.push(libc::iovec { iov_base: tail.cast(), iov_len: t.tail_len });
                    at += end + t.tail_len;
                    continue;
                }
                end += t.tail_len;
                msg.push_iov(head, end);
                at += end;
            }
            if msgs.is_empty() {
                break;
            }
            if let Some(c) = capture.as_ref() {
                let mut c = c.lock().unwrap_or_else(|p| p.into_inner());
                for m in msgs.iter() {
                    // SAFETY: as for the send below: every iovec points into `slots` or a
                    // region resolved under the engine lock, which we hold.
                    let bytes = unsafe { m.gather() };
                    let seg = m.gso.map_or(bytes.len(), usize::from).max(1);
                    for d in bytes.chunks(seg) {
                        c.packet(m.src, m.to, m.tos, d);
                    }
                }
                c.flush();
            }
            let trains = msgs.iter().filter(|m| m.gso.is_some()).count() as u64;
            // SAFETY: every iovec points into `slots` or into a registered region resolved
            // under the engine lock we hold, which keeps both alive through the call.
            timeline!(Send, msgs.len());
            let sent = unsafe { link.send(msgs) };
            timeline!(SendEnd, 0);
            if sent.gso_refused {
                link.disable_gso();
            }
            if sent.too_big > 0 {
                let before = self.io.oversize.fetch_add(sent.too_big as u64, Ordering::Relaxed);
                if before == 0 {
                    tracing::warn!(
                        "the kernel refused a datagram as larger than the path allows (EMSGSIZE): \
                         a QP's path MTU is above what the link carries; lower it"
                    );
                }
            }
            self.io.send_calls.fetch_add(1, Ordering::Relaxed);
            self.io.gso_trains.fetch_add(trains, Ordering::Relaxed);
        }
        Self::deliver(core);
    }

    /// Queues an asynchronous event and makes `async_fd` readable.
    fn raise(core: &mut Core, ev: AsyncEvent) {
        let mut events = core.events.lock();
        if matches!(ev, AsyncEvent::CqError { .. }) && events.contains(&ev) {
            return;
        }
        events.push_back(ev);
        core.events.efd.signal();
    }

    /// Moves completions from the QPs that have some to their sinks.
    fn deliver(core: &mut Core) {
        let mut overrun: Vec<(Qpn, u32)> = Vec::new();
        for round in 0..2 {
            let Core { endpoint, routes, .. } = &mut *core;
            endpoint.poll_completions(|qp| {
                let Some(route) = routes.get(&qp.qpn().get()) else { return };
                let qpn = qp.qpn();
                if !route.send.push_all(&mut || qp.poll_send_completion()) && round == 0 {
                    overrun.push((qpn, route.send.id()));
                }
                if !route.recv.push_all(&mut || qp.poll_recv_completion()) && round == 0 {
                    overrun.push((qpn, route.recv.id()));
                }
            });
            if overrun.is_empty() {
                return;
            }
            for (qpn, cq) in overrun.drain(..) {
                // Verbs semantics: an overrun CQ is an error; its QP fails. Nothing is
                // lost: the completions stay queued beyond the CQ's size.
                Self::raise(core, AsyncEvent::CqError { cq });
                if let Some(qp) = core.endpoint.qp_mut(qpn) {
                    let was = qp.state();
                    let _ = qp.modify(&QpAttr { state: Some(QpState::Error), ..Default::default() });
                    if was != QpState::Error && qp.srq().is_some() {
                        Self::raise(core, AsyncEvent::QpLastWqeReached { qpn: qpn.get() });
                    }
                }
            }
            // The second round delivers the flushes of the QPs just failed.
        }
    }

    /// Wakes the progress thread if the protocol now wants attention earlier than it
    /// planned to wake up.
    fn nudge(&self, core: &mut Core) {
        if self.nudge_later(core) {
            self.wake.signal();
        }
    }

    /// Sends what is ready and releases the engine, then nudges the progress thread:
    /// signalled once the lock is free, since a thread woken under it would only block on
    /// the lock, and the unlock would have to wake it a second time.
    fn flush_and_wake(&self, core: MutexGuard<'_, Core>) {
        let now = self.now();
        self.flush_and_wake_at(core, now);
    }

    /// [`Self::flush_and_wake`] at `now`.
    fn flush_and_wake_at(&self, mut core: MutexGuard<'_, Core>, now: Duration) {
        self.flush_at(&mut core, now);
        let wake = self.nudge_later(&mut core);
        drop(core);
        if wake {
            self.wake.signal();
        }
    }

    /// [`Self::nudge`], leaving the signal to the caller: whether it must wake the thread.
    fn nudge_later(&self, core: &mut Core) -> bool {
        // The protocol's next deadline, or the link's (the in-memory network's delayed
        // datagrams, which a send may have just queued).
        let link = core.link.next_wake().map(|d| self.now() + d);
        let Some(deadline) = core.endpoint.poll_timeout().into_iter().chain(link).min() else { return false };
        // Lowered first: a progress thread that wakes and finds the link watched plans its
        // next nap from it without a pass (see `run`).
        ns(deadline) < self.sleeping_until.fetch_min(ns(deadline), Ordering::AcqRel)
    }

    /// At the end of a polled nap: whether the poller is still at work, its passes
    /// running the link and the timers, so that the progress thread naps again without a
    /// pass of its own. A poller found gone stops buying naps with the polls it made, and
    /// the posts it left unsent count as packets left behind (`left_behind`).
    fn poller_at_work(&self, polled: &mut PolledNap, left_behind: &mut bool) -> bool {
        let lately = |t: u64| t != NEVER && ns(self.now()).saturating_sub(t) < ns(POLLER_GONE);
        let recent = lately(self.last_app_pass.load(Ordering::Relaxed));
        // A pass still running (a long one, receiving a burst) holds the lock.
        let busy = matches!(self.core.try_lock(), Err(std::sync::TryLockError::WouldBlock));
        let full_polls = self.polled_full.swap(false, Ordering::SeqCst);
        if !(recent || busy) && full_polls && lately(self.last_app_post.load(Ordering::SeqCst)) {
            // A poller at work whose polls all found completions since the last look (a UD
            // stream's) runs no pass, so nothing receives for it: a pass here, and the
            // polled naps go on; if the pass received anything, the nap halves as for a
            // poller gone, so that its arrivals are received every nap at most.
            polled.ended(false);
            return false;
        }
        let at_work = polled.ended(recent || busy);
        if !at_work {
            self.app_polls.store(0, Ordering::Relaxed);
            *left_behind = self.deferred.load(Ordering::SeqCst) > 0;
        }
        at_work
    }

    /// The link's file descriptors, for threads that wait for arrivals themselves.
    pub(crate) fn link_fds(&self) -> &[RawFd] {
        &self.link_fds
    }

    /// An application thread is about to block (on a completion channel): the progress
    /// thread must watch the link again, at once.
    pub(crate) fn app_blocking(&self) {
        self.poller_leaves();
        if self.napping.load(Ordering::Acquire) {
            self.wake.signal();
        }
    }

    /// Sends what bursts of posts left for the next pass (a thread that polled is about
    /// to block instead).
    pub(crate) fn send_deferred(&self) {
        if self.deferred.load(Ordering::SeqCst) > 0 {
            self.flush_and_wake(self.lock());
        }
    }

    /// [`Self::send_deferred`] unless another thread holds the engine (which sends them
    /// itself, or the progress thread's check does): for callers that may run while this
    /// thread holds it (a waker woken by a completion pushed under the lock).
    pub(crate) fn try_send_deferred(&self) {
        if self.deferred.load(Ordering::SeqCst) > 0 {
            if let Ok(core) = self.core.try_lock() {
                self.flush_and_wake(core);
            }
        }
    }

    /// An application thread stops polling (to block, or to watch the link): its polls
    /// and stamps no longer say a poller is at work, and what its posts left for its next
    /// poll goes now.
    fn poller_leaves(&self) {
        self.app_polls.store(0, Ordering::Relaxed);
        self.polled_full.store(false, Ordering::SeqCst);
        self.last_app_pass.store(NEVER, Ordering::SeqCst);
        self.last_app_post.store(NEVER, Ordering::SeqCst);
        self.send_deferred();
    }

    /// How the link goes back to the progress thread in event mode.
    pub(crate) fn event_wake(&self) -> EventWake {
        match self.event_wake.load(Ordering::Relaxed) {
            1 => EventWake::Warm,
            _ => EventWake::Lean,
        }
    }

    pub(crate) fn set_event_wake(&self, w: EventWake) {
        self.event_wake.store(w as u8, Ordering::Relaxed);
    }

    /// An application thread starts watching the link while it waits for an event.
    pub(crate) fn app_watch_begin(&self) -> WatchGuard<'_> {
        self.poller_leaves();
        self.app_watching.fetch_add(1, Ordering::SeqCst);
        WatchGuard { engine: self, received: false }
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.signal();
    }

    /// The progress thread's loop.
    ///
    /// While an application thread is busy-polling a CQ it receives the packets itself;
    /// the progress thread then stays off the link (waking every [`PolledNap`] to check,
    /// without a pass of its own while the polling goes on) instead of waking for every
    /// packet and competing for the CPU and the engine lock. While no application thread
    /// polls or waits, the progress thread serves the link, and keeps polling it for
    /// [`SPIN_AFTER_RX`] after each arrival before it sleeps.
    pub(crate) fn run(self: Arc<Self>) {
        let mut fds = self.link_fds.clone();
        fds.push(self.wake.as_raw_fd());
        // The eventfd's bit in what a wait on `fds` finds readable; none past the 64 a wait
        // watches (then drained every round).
        let wake_bit = u32::try_from(fds.len() - 1).ok().and_then(|i| 1u64.checked_shl(i)).unwrap_or(0);
        // The last pass found no link wake-up to plan for (the memory network's delayed
        // datagrams), and this wake-up needs no pass (see below).
        let mut link_quiet = false;
        let mut skip = false;
        // When this thread's own pass last received: it spins until SPIN_AFTER_RX later.
        let mut last_rx: Option<Duration> = None;
        let mut polled = PolledNap::new();
        // The last nap found the poller gone with posts it left unsent.
        let mut left_behind = false;
        // Naps in a row with no deadline and nothing received (see `IDLE_SLEEP`).
        let mut idle_naps = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            // The wait found the wake-up eventfd signalled (or failed): drained at the end
            // of the round. A signal that comes after the wait leaves it readable, and the
            // next wait returns at once for it.
            let mut woken = false;
            // Another shard handed this one datagrams since `skip` was decided (its wake-up
            // may have been drained since): a pass takes them.
            skip &= !self.sharding.waiting.load(Ordering::Acquire)
                && !self.sharding.flush_wanted.load(Ordering::Acquire);
            let timeout = if skip {
                // Back to the nap, until the earliest deadline known.
                let until = self.sleeping_until.load(Ordering::Acquire);
                (until != u64::MAX).then(|| Duration::from_nanos(until.saturating_sub(ns(self.now()))))
            } else {
                // On a shard, posters hold the lock only to queue their work: wait it out.
                let mut core = if self.sharding.count > 1 { self.lock_spinning() } else { self.lock() };
                // While a thread watches the link (blocked on a channel, it receives what
                // comes itself), this pass runs the timers that woke this thread and leaves
                // the link to it: a pass that received would take a packet the watcher
                // woke for, and hand its completion on through the channel, a second
                // wake-up. Not a link with arrivals no descriptor announces (the memory
                // network's delayed datagrams): no watcher wakes for those.
                let receive =
                    self.app_watching.load(Ordering::SeqCst) == 0 || core.link.next_wake().is_some();
                let received = self.progress_receiving(&mut core, false, receive);
                if received {
                    last_rx = Some(self.now());
                    idle_naps = 0;
                }
                polled.passed(received || std::mem::take(&mut left_behind));
                let next = core.endpoint.poll_timeout();
                self.sleeping_until.store(next.map_or(u64::MAX, ns), Ordering::Release);
                let link_wake = core.link.next_wake();
                link_quiet = link_wake.is_none();
                let proto = next.map(|t| t.saturating_sub(self.now()));
                proto.into_iter().chain(link_wake).min()
            };
            skip = false;
            self.deliver_cm();
            let now = ns(self.now());
            let watched = self.app_watching.load(Ordering::Acquire) > 0;
            if watched || self.app_polls.swap(0, Ordering::Relaxed) >= BUSY_POLLS {
                // An application thread watches the link (blocked on a channel) or polls it:
                // stay off it, waking for timers while watched, after a `PolledNap` while
                // polled (to notice the polling stop), or when the last watcher leaves. A
                // polling thread runs the timers too (each of its passes does), so that nap
                // need not end at the next one: a delayed ACK's 100 us would otherwise wake
                // this thread for every message and make it fight the poller.
                idle_naps = if watched && timeout.is_none() { idle_naps.saturating_add(1) } else { 0 };
                let longest = self.idle_longest(idle_naps);
                let nap = if watched { longest.min(timeout.unwrap_or(Duration::MAX)) } else { polled.nap };
                self.sleeping_until.fetch_min(now + ns(nap), Ordering::AcqRel);
                // A lean hand-back while watchers come and go, each soon after the last:
                // a short nap, which no departure ends (see `HANDBACK_STEP`).
                let short = watched
                    && self.event_wake() == EventWake::Lean
                    && self.watcher_left.swap(false, Ordering::SeqCst)
                    && self.departures_close.load(Ordering::Relaxed);
                self.napping_long.store(!short, Ordering::SeqCst);
                let nap = if short { nap.min(HANDBACK_STEP) } else { nap };
                self.napping.store(true, Ordering::SeqCst);
                // The last watcher may have left since `watched` was read, before it could
                // see `napping`: then do not nap (see `WatchGuard`).
                if !watched {
                    self.polled_nap.store(true, Ordering::SeqCst);
                }
                if !watched || self.app_watching.load(Ordering::SeqCst) > 0 {
                    woken = sys::wait_readable([self.wake.as_raw_fd()], Some(nap)).map_or(true, |[w]| w);
                }
                self.napping.store(false, Ordering::SeqCst);
                // Woken by a watcher that left (an event-mode thread returning with its
                // event) and is back watching already, with no timer due: the link is
                // watched, nothing needs this thread; nap again without taking the engine
                // lock or looking at the link (in a ping-pong that is every message).
                skip = watched
                    && link_quiet
                    && self.app_watching.load(Ordering::SeqCst) > 0
                    && ns(self.now()) < self.sleeping_until.load(Ordering::Acquire);
                // Still busy-polled after the nap: the poller's passes run the link and
                // the timers, so nap again without a pass of this thread's own (which
                // would take the engine lock from the poller for a pass that finds
                // nothing: on two cores that stalled one message in a hundred by ~20 us).
                if !watched && link_quiet {
                    skip = self.poller_at_work(&mut polled, &mut left_behind);
                }
                // Another shard handed this one datagrams, or a post its packets: a pass
                // takes them.
                skip &= !self.sharding.waiting.load(Ordering::Acquire)
                    && !self.sharding.flush_wanted.load(Ordering::Acquire);
                if !skip {
                    // A pass comes next, and maybe no nap after it: posts send at once.
                    self.polled_nap.store(false, Ordering::SeqCst);
                }
            } else if let Some(t) = last_rx.filter(|&t| {
                let now = self.now();
                now < t + SPIN_AFTER_RX && self.may_spin && spin_has_a_core()
            }) {
                // This thread serves the link and traffic is flowing: stay awake (a post's
                // new timer needs no nudge meanwhile), watching the link without the engine
                // lock, which stays free for the application's posts and polls, until
                // something arrives, a timer is due or the spin ends; then a pass.
                self.sleeping_until.store(0, Ordering::Release);
                self.io.spins.fetch_add(1, Ordering::Relaxed);
                let end = timeout.map_or(t + SPIN_AFTER_RX, |d| (self.now() + d).min(t + SPIN_AFTER_RX));
                self.spinning.store(true, Ordering::SeqCst);
                // A burst of posts that waits for company ends when no post came for
                // POST_BURST: the pass after the spin sends it.
                let burst_over = |now: Duration| {
                    self.deferred.load(Ordering::Relaxed) > 0
                        && ns(now).saturating_sub(self.last_post.load(Ordering::Relaxed)) >= ns(POST_BURST)
                };
                loop {
                    let now = self.now();
                    if self.stop.load(Ordering::Relaxed)
                        || now >= end
                        || burst_over(now)
                        || self.sharding.waiting.load(Ordering::Relaxed)
                        || self.sharding.flush_wanted.load(Ordering::Relaxed)
                        || sys::wait_readable_any(&self.link_fds, Some(Duration::ZERO)).unwrap_or(1) != 0
                    {
                        break;
                    }
                    std::hint::spin_loop();
                }
                self.spinning.store(false, Ordering::SeqCst);
                continue;
            } else {
                last_rx = None;
                // Never sleep longer than MAX_SLEEP while there is work, so that a timer
                // armed later without a nudge (a far one) still fires on time; an idle
                // device sleeps longer, and any timer armed wakes it (see `IDLE_SLEEP`).
                idle_naps = if timeout.is_none() { idle_naps.saturating_add(1) } else { 0 };
                let longest = self.idle_longest(idle_naps);
                let cap = timeout.unwrap_or(longest).min(longest);
                self.sleeping_until.fetch_min(now + ns(cap), Ordering::AcqRel);
                woken = sys::wait_readable_any(&fds, Some(cap))
                    .map_or(true, |m| wake_bit == 0 || m & wake_bit != 0);
            }
            if woken {
                self.wake.drain();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{IoStats, PolledNap};

    #[test]
    fn runnable_threads_come_from_the_fourth_field_of_loadavg() {
        assert_eq!(super::runnable_in_loadavg("0.80 1.32 1.20 3/79 26723\n"), Some(3));
        assert_eq!(super::runnable_in_loadavg("0.80 1.32 1.20"), None);
        assert_eq!(super::runnable_in_loadavg("0.80 1.32 1.20 x/79 1"), None);
        super::open_load_probe();
        assert!(super::runnable_threads().is_some(), "this machine has /proc/loadavg");
    }

    #[test]
    fn the_event_wake_variable_names_warm_or_lean() {
        use super::EventWake::{Lean, Warm};
        let named = super::EventWake::named;
        assert_eq!(named(None), Lean);
        assert_eq!(named(Some("warm")), Warm);
        assert_eq!(named(Some(" Warm ")), Warm);
        assert_eq!(named(Some("lean")), Lean);
        assert_eq!(named(Some("")), Lean);
        assert_eq!(named(Some("hot")), Lean, "an unknown value keeps the default");
    }

    #[test]
    fn io_stats_add_up() {
        let one = |k: u64| IoStats {
            send_calls: k,
            packets_sent: 2 * k,
            gso_trains: 3 * k,
            recv_calls: 4 * k,
            packets_received: 5 * k,
            gro_trains: 6 * k,
            oversize: 7 * k,
            strays: 8 * k,
            handback_wakes: 9 * k,
            spins: 10 * k,
            empty_recvs: 11 * k,
        };
        let mut sum = one(1);
        sum += one(10);
        assert_eq!(sum, one(11));
    }

    /// An engine on a UDP link at 127.0.0.`last` (no progress thread: the test runs its
    /// passes), its address, and a plain UDP socket on 127.0.0.`last + 1` to send to it.
    fn engine_and_sender(last: u8) -> (super::Engine, std::net::SocketAddr, std::net::UdpSocket) {
        let link = crate::link::UdpLink::bind(std::net::SocketAddr::from(([127, 0, 0, last], 0))).unwrap();
        let engine = super::Engine::new(Box::new(link)).unwrap();
        let to = engine.local();
        let tx = std::net::UdpSocket::bind(std::net::SocketAddr::from(([127, 0, 0, last + 1], 0))).unwrap();
        (engine, to, tx)
    }

    #[test]
    fn a_pass_that_receives_a_gro_train_receives_again() {
        // A stream's sender sends its trains back to back: a pass that took one takes the
        // next before it acknowledges and hands over completions, even when the receive
        // batch has shrunk to one datagram a call (as after a ping-pong's lone datagrams).
        let (engine, to, tx) = engine_and_sender(61);
        tx.send_to(&[0u8; 20], to).unwrap();
        engine.try_progress();
        assert_eq!(engine.io_stats().packets_received, 1);
        // Two trains of eight 20-byte segments, both queued before the next pass (a send
        // on loopback has delivered when it returns).
        let fd = std::os::fd::AsRawFd::as_raw_fd(&tx);
        assert!(crate::sys::setsockopt_int(fd, libc::SOL_UDP, libc::UDP_SEGMENT, 20), "UDP_SEGMENT refused");
        for _ in 0..2 {
            tx.send_to(&[0u8; 160], to).unwrap();
        }
        engine.try_progress();
        let io = engine.io_stats();
        assert_eq!(io.packets_received, 17, "one pass took both trains: {io:?}");
        assert_eq!(io.gro_trains, 2, "{io:?}");
    }

    #[test]
    fn a_pass_that_fills_its_batch_receives_again_and_stops_at_a_short_one() {
        // Lone datagrams (a sender without GSO) queued deeper than one receive batch: the
        // pass goes on after a full batch, and the first short one ends it, without a call
        // that finds nothing.
        use crate::link::RX_BATCH;
        let (engine, to, tx) = engine_and_sender(63);
        let extra = 8;
        for _ in 0..2 * RX_BATCH + extra {
            tx.send_to(&[0u8; 20], to).unwrap();
        }
        // Each pass makes one call while the batch asks for fewer than a full one, and a
        // call that fills its ask twice in a row doubles it: 1, 1, 2, 4, 8, 16 datagrams.
        let mut taken = vec![];
        let mut before = 0;
        while before < RX_BATCH as u64 {
            engine.try_progress();
            let now = engine.io_stats().packets_received;
            taken.push(now - before);
            before = now;
        }
        assert_eq!(taken, [1, 1, 2, 4, 8, 16], "one call a pass while the ask grows");
        let io = engine.io_stats();
        // Asking a whole batch now: one pass takes it, then the rest in a second call.
        engine.try_progress();
        let after = engine.io_stats();
        assert_eq!(after.packets_received - io.packets_received, (RX_BATCH + extra) as u64, "{after:?}");
        assert_eq!(after.recv_calls - io.recv_calls, 2, "{after:?}");
        assert_eq!(after.empty_recvs, io.empty_recvs, "no call found nothing: {after:?}");
    }

    #[test]
    fn a_datagram_belongs_to_the_shard_its_qpn_names() {
        let bth = |qpn: u32| {
            let mut b = [0u8; 12];
            b[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
            b
        };
        assert_eq!(super::shard_of(&bth(0x12_3457), 4), 3);
        assert_eq!(super::shard_of(&bth(0x12_3457), 8), 7);
        // QP1 and multicast go to shard 0; so does a datagram too short for a BTH.
        assert_eq!(super::shard_of(&bth(1), 4), 0);
        assert_eq!(super::shard_of(&bth(0xff_ffff), 4), 0);
        assert_eq!(super::shard_of(&[0, 0, 0, 0, 0, 0x12, 0x34], 4), 0);
        assert_eq!(super::shard_of(&bth(0x12_3457), 1), 0);
    }

    #[test]
    fn the_polled_nap_shortens_only_when_the_poller_left_packets_behind() {
        let mut p = PolledNap::new();
        assert_eq!(p.nap, PolledNap::MAX);
        // The poller at work: nap again without a pass.
        assert!(p.ended(true));
        // Gone, but nothing was waiting (the program stopped polling for good): no change.
        assert!(!p.ended(false));
        p.passed(false);
        assert_eq!(p.nap, PolledNap::MAX);
        // A pass of the progress thread's own that received, without a nap that found the
        // poller gone before it (its own traffic): no change either.
        p.passed(true);
        assert_eq!(p.nap, PolledNap::MAX);
        // Gone with packets waiting: halves, each time, down to the floor.
        let mut naps = vec![];
        for _ in 0..8 {
            assert!(!p.ended(false));
            p.passed(true);
            naps.push(p.nap);
        }
        assert_eq!(naps[0], PolledNap::MAX / 2);
        assert_eq!(naps[1], PolledNap::MAX / 4);
        assert_eq!(*naps.last().unwrap(), PolledNap::MIN);
    }

    #[test]
    fn the_polled_nap_grows_back_after_clean_naps_in_a_row() {
        let mut p = PolledNap::new();
        for _ in 0..2 {
            p.ended(false);
            p.passed(true);
        }
        let short = p.nap;
        assert_eq!(short, PolledNap::MAX / 4);
        for _ in 0..PolledNap::CLEAN - 1 {
            p.ended(true);
        }
        assert_eq!(p.nap, short);
        // A stall in between starts the count again.
        p.ended(false);
        p.passed(true);
        assert_eq!(p.nap, short / 2);
        for _ in 0..PolledNap::CLEAN {
            p.ended(true);
        }
        assert_eq!(p.nap, short);
        for _ in 0..PolledNap::CLEAN * 2 {
            p.ended(true);
        }
        assert_eq!(p.nap, PolledNap::MAX);
    }

    #[test]
    fn a_poller_that_never_left_anything_behind_earns_longer_naps() {
        let mut p = PolledNap::new();
        // Under MAX until EARN clean naps in a row.
        for _ in 0..PolledNap::EARN - 1 {
            p.ended(true);
        }
        assert_eq!(p.nap, PolledNap::MAX);
        for _ in 0..PolledNap::CLEAN * 8 {
            p.ended(true);
        }
        assert_eq!(p.nap, PolledNap::MAX_EARNED);
        // One stall: back under MAX at once, and the earning starts again.
        p.ended(false);
        p.passed(true);
        assert_eq!(p.nap, PolledNap::MAX);
        for _ in 0..PolledNap::EARN - 1 {
            p.ended(true);
        }
        assert_eq!(p.nap, PolledNap::MAX);
        // A stall that finds the nap short already halves it as before.
        p.ended(false);
        p.passed(true);
        assert_eq!(p.nap, PolledNap::MAX / 2);
    }
}
