//! The progress engine of one opened device: the UDP socket, the sans-IO endpoint, the
//! registry of memory, and the work that moves packets between them.
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
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use softrdma_proto::endpoint::Endpoint;
use softrdma_proto::qp::WorkCompletion;

use crate::cq::CqShared;
use crate::memory::Registry;
use crate::sys::{self, EventFd, OutMsg, RecvBatch};

/// Packets built per `sendmmsg` call (GSO trains count each of their packets).
const BATCH: usize = 64;
/// Datagrams (or GRO trains) per `recvmmsg` call.
const RX_BATCH: usize = 32;
/// Segments per GSO train, and its largest total size.
const GSO_MAX_SEGS: usize = 64;
const GSO_MAX_BYTES: usize = 65_000;
/// Room per outgoing packet: headers and inline data, then the tail, then a bounce buffer
/// for payloads split in more pieces than an iovec array holds.
const HEAD: usize = 1024;
const TAIL: usize = 8;
const BOUNCE: usize = 4096 + 8;
const SLOT: usize = HEAD + TAIL + BOUNCE;
/// The longest the progress thread sleeps: timers due later than its wake-up need no
/// nudge (a system call and a context switch per `post_send`).
const MAX_SLEEP: Duration = Duration::from_millis(20);
/// Empty CQ polls between two passes of the progress thread that mean an application
/// thread is busy-polling, so the progress thread can leave the socket to it.
const BUSY_POLLS: u64 = 16;
/// Receive buffer per datagram: room for a whole GRO train.
const RX_SLOT: usize = 65_536;

/// Where a QP's completions go.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub(crate) send_cq: Arc<CqShared>,
    pub(crate) recv_cq: Arc<CqShared>,
}

/// Socket-level counters of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IoStats {
    /// `sendmmsg` calls.
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
}

#[derive(Debug, Default)]
struct IoCounters {
    send_calls: AtomicU64,
    packets_sent: AtomicU64,
    gso_trains: AtomicU64,
    recv_calls: AtomicU64,
    packets_received: AtomicU64,
    gro_trains: AtomicU64,
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
}

/// Everything behind the engine lock.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) endpoint: Endpoint,
    pub(crate) mem: Registry,
    pub(crate) routes: HashMap<u32, Route>,
    pub(crate) events: VecDeque<AsyncEvent>,
    slots: Vec<u8>,
    rx: RecvBatch,
    out: Vec<OutMsg>,
}

/// One opened device, shared by all its objects and its progress thread.
#[derive(Debug)]
pub(crate) struct Shared {
    core: Mutex<Core>,
    socket: UdpSocket,
    wake: EventFd,
    pub(crate) local: SocketAddr,
    stop: AtomicBool,
    /// Send multi-packet trains with UDP GSO (off after the kernel refuses one).
    gso: AtomicBool,
    io: IoCounters,
    epoch: Instant,
    /// The deadline (ns since `epoch`) the progress thread is sleeping until; u64::MAX
    /// when it sleeps without one.
    sleeping_until: AtomicU64,
    /// CQ polls that found nothing since the progress thread last looked: many mean an
    /// application thread is busy-polling (and receiving itself).
    app_polls: AtomicU64,
    /// The progress thread is napping off the socket.
    napping: AtomicBool,
}

impl std::fmt::Debug for RecvBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecvBatch")
    }
}

impl Shared {
    pub(crate) fn new(socket: UdpSocket, local: SocketAddr) -> std::io::Result<Shared> {
        socket.set_nonblocking(true)?;
        let core = Core {
            endpoint: Endpoint::new(local),
            mem: Registry::new(),
            routes: HashMap::new(),
            events: VecDeque::from([AsyncEvent::PortActive]),
            slots: vec![0; BATCH * SLOT],
            rx: RecvBatch::new(RX_BATCH, RX_SLOT),
            out: Vec::with_capacity(BATCH),
        };
        if std::env::var_os("SOFTRDMA_NO_GRO").is_none() {
            sys::enable_gro(socket.as_raw_fd());
        }
        Ok(Shared {
            core: Mutex::new(core),
            socket,
            wake: EventFd::new()?,
            local,
            stop: AtomicBool::new(false),
            gso: AtomicBool::new(std::env::var_os("SOFTRDMA_NO_GSO").is_none()),
            io: IoCounters::default(),
            epoch: Instant::now(),
            sleeping_until: AtomicU64::new(u64::MAX),
            app_polls: AtomicU64::new(0),
            napping: AtomicBool::new(false),
        })
    }

    /// Protocol time: nanoseconds since the device was opened.
    pub(crate) fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Core> {
        // A panic while holding the lock leaves the protocol state as it was at that
        // point; carrying on is better than poisoning every verbs call after it.
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one pass if the engine is free; returns whether it ran. Called by threads
    /// polling a CQ, which also tells the progress thread that someone is busy-polling.
    pub(crate) fn try_progress(&self) -> bool {
        self.app_polls.fetch_add(1, Ordering::Relaxed);
        match self.core.try_lock() {
            Ok(mut core) => {
                self.progress(&mut core);
                true
            }
            Err(std::sync::TryLockError::Poisoned(p)) => {
                self.progress(&mut p.into_inner());
                true
            }
            Err(std::sync::TryLockError::WouldBlock) => false,
        }
    }

    /// Runs one pass if the engine is free, without counting as a busy poll.
    pub(crate) fn try_progress_quiet(&self) {
        if let Ok(mut core) = self.core.try_lock() {
            self.progress(&mut core);
        }
    }

    /// Receives what is waiting, runs due timers, sends what is ready and delivers
    /// completions. Never blocks.
    pub(crate) fn progress(&self, core: &mut Core) {
        let fd = self.socket.as_raw_fd();
        let now = self.now();
        for _ in 0..8 {
            let Core { endpoint, mem, rx, .. } = &mut *core;
            let n = rx.recv(fd);
            if n > 0 {
                self.io.recv_calls.fetch_add(1, Ordering::Relaxed);
            }
            for i in 0..n {
                if let Some((src, segments)) = rx.get(i) {
                    let src = sys::canonical(src);
                    let mut k = 0;
                    for bytes in segments {
                        endpoint.handle_datagram(now, src, bytes, mem);
                        k += 1;
                    }
                    self.io.packets_received.fetch_add(k, Ordering::Relaxed);
                    if k > 1 {
                        self.io.gro_trains.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if n < RX_BATCH {
                break;
            }
        }
        if core.endpoint.poll_timeout().is_some_and(|t| t <= now) {
            core.endpoint.handle_timeout(now);
        }
        self.flush(core);
    }

    /// Sends every packet the QPs have ready, then delivers completions. Consecutive
    /// packets of one size to one destination go as a GSO train when the kernel allows.
    pub(crate) fn flush(&self, core: &mut Core) {
        let fd = self.socket.as_raw_fd();
        let now = self.now();
        let gso = self.gso.load(Ordering::Relaxed);
        loop {
            let Core { endpoint, mem, slots, out: msgs, .. } = &mut *core;
            msgs.clear();
            // (destination, segment size, segments, bytes, still open) of the last message.
            let mut train: Option<(SocketAddr, usize, usize, usize, bool)> = None;
            for slot in slots.chunks_exact_mut(SLOT) {
                let (head, rest) = slot.split_at_mut(HEAD);
                let (tail, bounce) = rest.split_at_mut(TAIL);
                let Some(t) = endpoint.poll_transmit(now, head, mem) else { break };
                let len = t.len();
                let joins = gso
                    && !t.alone
                    && matches!(train, Some((dst, size, segs, bytes, true))
                        if dst == t.dst && len <= size && segs < GSO_MAX_SEGS && bytes + len <= GSO_MAX_BYTES);
                if !joins {
                    msgs.push(OutMsg::new(t.dst));
                    train = Some((t.dst, len, 0, 0, !t.alone));
                }
                let (Some(msg), Some(tr)) = (msgs.last_mut(), train.as_mut()) else { break };
                tr.2 += 1;
                tr.3 += len;
                // A shorter packet ends the train: only the last segment may be short.
                tr.4 = len == tr.1;
                if tr.2 > 1 {
                    msg.gso = u16::try_from(tr.1).ok();
                }
                msg.iov.push(libc::iovec { iov_base: head.as_mut_ptr().cast(), iov_len: t.head_len });
                if t.payload.len() <= 4 {
                    for seg in &t.payload {
                        let Some((ptr, n)) = mem.raw(t.pd, seg) else { continue };
                        msg.iov.push(libc::iovec { iov_base: ptr as *mut libc::c_void, iov_len: n });
                    }
                } else {
                    // Many small pieces: copy them into one.
                    let mut at = 0;
                    for seg in &t.payload {
                        let _ = softrdma_proto::memory::Memory::gather(&*mem, t.pd, seg, &mut |b| {
                            let n = b.len().min(bounce.len() - at);
                            bounce[at..at + n].copy_from_slice(&b[..n]);
                            at += n;
                        });
                    }
                    msg.iov.push(libc::iovec { iov_base: bounce.as_mut_ptr().cast(), iov_len: at });
                }
                tail[..t.tail_len].copy_from_slice(&t.tail[..t.tail_len]);
                msg.iov.push(libc::iovec { iov_base: tail.as_mut_ptr().cast(), iov_len: t.tail_len });
                self.io.packets_sent.fetch_add(1, Ordering::Relaxed);
            }
            if msgs.is_empty() {
                break;
            }
            // SAFETY: every iovec points into `slots` or into a registered region resolved
            // under the engine lock we hold, which keeps both alive through the call.
            let trains = msgs.iter().filter(|m| m.gso.is_some()).count() as u64;
            let sent = unsafe { sys::send_batch(fd, msgs) };
            if sent.gso_refused {
                self.gso.store(false, Ordering::Relaxed);
            }
            self.io.send_calls.fetch_add(1, Ordering::Relaxed);
            self.io.gso_trains.fetch_add(trains, Ordering::Relaxed);
        }
        self.deliver(core);
    }

    /// Moves completions from the QPs to their CQs.
    fn deliver(&self, core: &mut Core) {
        let Core { endpoint, routes, events, .. } = core;
        let mut overrun = Vec::new();
        for (qpn, route) in routes.iter() {
            let Some(qp) = endpoint.qp_mut(softrdma_proto::Qpn::new(*qpn)) else { continue };
            let mut push = |cq: &Arc<CqShared>, wc: WorkCompletion| {
                if !cq.push(wc) {
                    overrun.push((*qpn, cq.id));
                }
            };
            while let Some(wc) = qp.poll_send_completion() {
                push(&route.send_cq, wc);
            }
            while let Some(wc) = qp.poll_recv_completion() {
                push(&route.recv_cq, wc);
            }
        }
        for (qpn, cq) in overrun {
            // Verbs semantics: an overrun CQ is an error; its QP fails. Nothing is lost:
            // the completions stay queued beyond the CQ's size.
            if !events.contains(&AsyncEvent::CqError { cq }) {
                events.push_back(AsyncEvent::CqError { cq });
            }
            if let Some(qp) = endpoint.qp_mut(softrdma_proto::Qpn::new(qpn)) {
                let attr = softrdma_proto::qp::QpAttr {
                    state: Some(softrdma_proto::qp::QpState::Error),
                    ..Default::default()
                };
                let _ = qp.modify(&attr);
            }
        }
    }

    /// Wakes the progress thread if the protocol now wants attention earlier than it
    /// planned to wake up.
    pub(crate) fn nudge(&self, core: &Core) {
        let Some(deadline) = core.endpoint.poll_timeout() else { return };
        let ns = deadline.as_nanos().min(u128::from(u64::MAX - 1)) as u64;
        if ns < self.sleeping_until.load(Ordering::Acquire) {
            self.wake.signal();
        }
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
        }
    }

    /// The device socket, for threads that wait on it themselves.
    pub(crate) fn socket_fd(&self) -> std::os::fd::RawFd {
        self.socket.as_raw_fd()
    }

    /// An application thread is about to block (on a completion channel): the progress
    /// thread must watch the socket again, at once.
    pub(crate) fn app_blocking(&self) {
        self.app_polls.store(0, Ordering::Relaxed);
        if self.napping.load(Ordering::Acquire) {
            self.wake.signal();
        }
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.signal();
    }

    /// The progress thread's loop.
    ///
    /// While an application thread is busy-polling a CQ it receives the packets itself;
    /// the progress thread then stays off the socket (waking every millisecond to check)
    /// instead of waking for every packet and competing for the CPU and the engine lock.
    pub(crate) fn run(self: Arc<Self>) {
        let fds = [self.socket.as_raw_fd(), self.wake.as_raw_fd()];
        while !self.stop.load(Ordering::Acquire) {
            let timeout = {
                let mut core = self.lock();
                self.progress(&mut core);
                let next = core.endpoint.poll_timeout();
                let ns = next.map_or(u64::MAX, |t| t.as_nanos().min(u128::from(u64::MAX - 1)) as u64);
                self.sleeping_until.store(ns, Ordering::Release);
                next.map(|t| t.saturating_sub(self.now()))
            };
            let now = self.now().as_nanos() as u64;
            if self.app_polls.swap(0, Ordering::Relaxed) >= BUSY_POLLS {
                let nap = Duration::from_millis(1).min(timeout.unwrap_or(Duration::MAX));
                self.sleeping_until.fetch_min(now + nap.as_nanos() as u64, Ordering::AcqRel);
                self.napping.store(true, Ordering::Release);
                let _ = sys::wait_readable([self.wake.as_raw_fd()], Some(nap));
                self.napping.store(false, Ordering::Release);
            } else {
                // Never sleep longer than MAX_SLEEP, so that a timer armed later without a
                // nudge (a far one) still fires on time.
                let cap = timeout.unwrap_or(MAX_SLEEP).min(MAX_SLEEP);
                self.sleeping_until.fetch_min(now + cap.as_nanos() as u64, Ordering::AcqRel);
                let _ = sys::wait_readable(fds, Some(cap));
            }
            self.wake.drain();
        }
    }
}
