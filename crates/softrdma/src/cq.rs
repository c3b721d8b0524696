//! Completion queues and completion channels.
//!
//! A CQ is a queue the application polls without a system call when it has entries. When
//! it is empty, `poll` also drives the engine once (a non-blocking receive), so that a
//! busy-polling thread makes progress itself instead of waiting for the progress thread.
//! Event mode: `req_notify` arms the CQ; the next completion (or next solicited one) pushes
//! an event to its channel and signals the channel's eventfd, a real file descriptor that
//! works with poll, epoll or an async reactor.

use std::collections::VecDeque;
use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::Duration;

use softrdma_proto::qp::WorkCompletion;

use crate::device::{ContextInner, MAX_CQE};
use crate::engine::{CompletionSink, Engine};
use crate::sys::{self, EventFd};
use crate::{Error, Result};

/// Options of a CQ ([`crate::Context::create_cq_with`]).
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct CqOptions {
    /// Record when each completion is delivered to the CQ, for
    /// [`CompletionQueue::poll_timestamped`] (`IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`): one
    /// clock read per completion.
    pub timestamps: bool,
}

impl CqOptions {
    /// Options with completion timestamps on.
    pub fn timestamped() -> Self {
        CqOptions { timestamps: true }
    }
}

/// The clock of completion timestamps: CLOCK_MONOTONIC in nanoseconds (so a device clock
/// of 1 GHz, full 64-bit mask).
pub fn completion_clock_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(t.tv_nsec as u64)
}

const DISARMED: u8 = 0;
const ARMED_ANY: u8 = 1;
const ARMED_SOLICITED: u8 = 2;

/// The state of a CQ shared with the engine.
#[derive(Debug)]
pub(crate) struct CqShared {
    pub(crate) id: u32,
    /// Itself, for the events that name it.
    me: std::sync::Weak<CqShared>,
    q: Mutex<VecDeque<WorkCompletion>>,
    /// `q`'s length, written under its lock and read without it: a busy poll that finds
    /// the CQ empty (nearly every poll) takes no lock. SeqCst with `armed`, so that a
    /// thread that arms and then polls, and a completion pushed meanwhile, cannot both
    /// miss each other (one sees the other's store).
    queued: AtomicUsize,
    /// With [`CqOptions::timestamps`]: when each queued completion was delivered, in
    /// [`completion_clock_ns`] time, beside `q` and behind the same lock.
    stamps: Option<Mutex<VecDeque<u64>>>,
    cap: usize,
    armed: AtomicU8,
    channel: Option<Arc<ChannelShared>>,
    /// Tasks awaiting a completion ([`CompletionQueue::next`]).
    wakers: Mutex<Vec<Waker>>,
    has_wakers: AtomicBool,
    /// The shards of a sharded device whose QPs complete here, a bit each: the ones a
    /// poll drives (shard 0 while there are none).
    shards: AtomicU64,
}

impl CompletionSink for CqShared {
    fn push_all(&self, next: &mut dyn FnMut() -> Option<WorkCompletion>) -> bool {
        self.push_wcs(next)
    }
    fn id(&self) -> u32 {
        self.id
    }
    fn depth(&self) -> (usize, usize) {
        (self.q.lock().unwrap_or_else(|p| p.into_inner()).len(), self.cap)
    }
}

impl CqShared {
    /// A QP of shard `k` completes here.
    pub(crate) fn add_shard(&self, k: usize) {
        self.shards.fetch_or(1 << (k % 64), Ordering::Relaxed);
    }

    /// Queues the completions `next` yields, under one taking of the lock; false if the
    /// CQ is then over its size (an overrun: the completions are kept, the caller raises
    /// the error). The channel fires once for the lot if any of them would have fired it
    /// alone, and waiting tasks wake once.
    fn push_wcs(&self, next: &mut dyn FnMut() -> Option<WorkCompletion>) -> bool {
        // Nothing to queue (a QP with receive completions only, say): no lock taken.
        let Some(first) = next() else { return true };
        let mut solicited = false;
        let len = {
            let mut q = self.q.lock().unwrap_or_else(|p| p.into_inner());
            // Lock order: q, then stamps.
            let mut stamps = self.stamps.as_ref().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()));
            let mut wc = Some(first);
            while let Some(c) = wc {
                if let Some(stamps) = stamps.as_mut() {
                    stamps.push_back(completion_clock_ns());
                }
                solicited |= c.solicited || c.status as u32 != 0;
                q.push_back(c);
                wc = next();
            }
            self.queued.store(q.len(), Ordering::SeqCst);
            q.len()
        };
        let armed = self.armed.load(Ordering::SeqCst);
        let fire = armed == ARMED_ANY || (armed == ARMED_SOLICITED && solicited);
        if fire {
            let mode = self.armed.swap(DISARMED, Ordering::AcqRel);
            if mode != DISARMED {
                if let (Some(ch), Some(me)) = (&self.channel, self.me.upgrade()) {
                    ch.notify(me, mode);
                }
            }
        }
        // A load first (SeqCst, after the SeqCst store of `queued`: a task that registers
        // and then looks at the queue sees these completions, or this sees its flag), the
        // swap only when set: an atomic read-modify-write per delivery saved.
        if self.has_wakers.load(Ordering::SeqCst) && self.has_wakers.swap(false, Ordering::SeqCst) {
            let wakers = std::mem::take(&mut *self.wakers.lock().unwrap_or_else(|p| p.into_inner()));
            wakers.into_iter().for_each(Waker::wake);
        }
        len <= self.cap
    }

    fn is_empty(&self) -> bool {
        self.q.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    fn pop_into(&self, out: &mut [WorkCompletion]) -> usize {
        self.pop_stamped(out, &mut [])
    }

    /// Pops up to `out.len()` completions, and their delivery times into `ts` as far as it
    /// reaches (zero when the CQ keeps no times).
    fn pop_stamped(&self, out: &mut [WorkCompletion], ts: &mut [u64]) -> usize {
        if self.queued.load(Ordering::SeqCst) == 0 {
            return 0;
        }
        let mut q = self.q.lock().unwrap_or_else(|p| p.into_inner());
        let n = out.len().min(q.len());
        let mut stamps = self.stamps.as_ref().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()));
        for (i, slot) in out.iter_mut().take(n).enumerate() {
            if let Some(wc) = q.pop_front() {
                *slot = wc;
            }
            let t = stamps.as_mut().and_then(|s| s.pop_front()).unwrap_or(0);
            if let Some(t_slot) = ts.get_mut(i) {
                *t_slot = t;
            }
        }
        self.queued.store(q.len(), Ordering::SeqCst);
        n
    }
}

/// A completion queue.
#[derive(Debug, Clone)]
pub struct CompletionQueue {
    pub(crate) shared: Arc<CqShared>,
    pub(crate) ctx: Arc<ContextInner>,
}

static NEXT_CQ: AtomicUsize = AtomicUsize::new(1);

impl CompletionQueue {
    pub(crate) fn new(
        ctx: Arc<ContextInner>,
        cqe: usize,
        channel: Option<&CompletionChannel>,
        opts: CqOptions,
    ) -> Result<Self> {
        if cqe == 0 || cqe > MAX_CQE {
            return Err(Error::InvalidArgument("CQ size must be 1 to max_cqe"));
        }
        if let Some(ch) = channel {
            if !Arc::ptr_eq(&ch.ctx, &ctx) {
                return Err(Error::Mismatch);
            }
        }
        let shared = Arc::new_cyclic(|me| CqShared {
            me: me.clone(),
            id: NEXT_CQ.fetch_add(1, Ordering::Relaxed) as u32,
            q: Mutex::new(VecDeque::with_capacity(cqe)),
            queued: AtomicUsize::new(0),
            stamps: opts.timestamps.then(|| Mutex::new(VecDeque::with_capacity(cqe))),
            cap: cqe,
            armed: AtomicU8::new(DISARMED),
            channel: channel.map(|c| c.shared.clone()),
            wakers: Mutex::new(Vec::new()),
            has_wakers: AtomicBool::new(false),
            shards: AtomicU64::new(0),
        });
        Ok(CompletionQueue { shared, ctx })
    }

    /// The CQ's number (events name CQs by it).
    pub fn id(&self) -> u32 {
        self.shared.id
    }

    /// The number of completions the CQ holds.
    pub fn capacity(&self) -> usize {
        self.shared.cap
    }

    /// Whether the CQ's QPs live on several shards of a sharded device. A poll then only
    /// takes what the shards' threads delivered: driving every shard's link from the one
    /// polling thread (and making their threads step aside for it, as a busy poller of an
    /// unsharded device does) would put all their work back on one core.
    fn spans_shards(&self) -> bool {
        self.ctx.shards.len() > 1 && self.shared.shards.load(Ordering::Relaxed).count_ones() > 1
    }

    /// Runs `f` on each engine whose QPs complete here: the device's, or the shards of a
    /// sharded device that hold them.
    fn each_engine(&self, mut f: impl FnMut(&Engine)) {
        each_engine(&self.ctx, &self.shared, &mut f);
    }

    /// Fills `out` with up to `out.len()` completions; returns how many. Drives the engine
    /// once when nothing is queued.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        if self.spans_shards() {
            return self.shared.pop_into(out);
        }
        let n = self.shared.pop_into(out);
        if n > 0 {
            timeline!(Polled, n);
            self.each_engine(Engine::polled_full);
        }
        if n > 0 || out.is_empty() {
            return n;
        }
        self.each_engine(|e| {
            e.try_progress();
        });
        let n = self.shared.pop_into(out);
        if n > 0 {
            timeline!(Polled, n);
            stage!(Polled);
        }
        n
    }

    /// [`Self::poll`] that also fills `ts` with when each completion was delivered
    /// ([`completion_clock_ns`] time; zero unless the CQ was created with
    /// [`CqOptions::timestamps`]).
    pub fn poll_timestamped(&self, out: &mut [WorkCompletion], ts: &mut [u64]) -> usize {
        if self.spans_shards() {
            return self.shared.pop_stamped(out, ts);
        }
        let n = self.shared.pop_stamped(out, ts);
        if n > 0 {
            self.each_engine(Engine::polled_full);
        }
        if n > 0 || out.is_empty() {
            return n;
        }
        self.each_engine(|e| {
            e.try_progress();
        });
        let n = self.shared.pop_stamped(out, ts);
        if n > 0 {
            stage!(Polled);
        }
        n
    }

    /// Whether the CQ records when each completion was delivered.
    pub fn has_timestamps(&self) -> bool {
        self.shared.stamps.is_some()
    }

    /// One completion, if there is one.
    pub fn poll_one(&self) -> Option<WorkCompletion> {
        let mut one = [EMPTY_WC];
        (self.poll(&mut one) == 1).then_some(one[0])
    }

    /// Busy-polls until a completion arrives.
    pub fn wait_one(&self) -> WorkCompletion {
        loop {
            if let Some(wc) = self.poll_one() {
                return wc;
            }
            std::hint::spin_loop();
        }
    }

    /// Polls until a completion arrives or `timeout` passes (yielding the CPU between
    /// polls once the first microseconds are spent).
    pub fn wait_one_timeout(&self, timeout: std::time::Duration) -> Option<WorkCompletion> {
        let start = std::time::Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(wc) = self.poll_one() {
                return Some(wc);
            }
            if start.elapsed() >= timeout {
                return None;
            }
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Arms the CQ: the next completion (with `solicited_only`, the next solicited one or
    /// error) produces an event on its channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.shared.channel.is_none() {
            return Err(Error::InvalidArgument("CQ has no completion channel"));
        }
        let mode = if solicited_only { ARMED_SOLICITED } else { ARMED_ANY };
        self.shared.armed.store(mode, Ordering::SeqCst);
        // A program arms a CQ to wait for its event: what a burst of posts left for the next
        // poll goes now.
        self.each_engine(Engine::send_deferred);
        Ok(())
    }
}

impl CompletionQueue {
    /// The next completion, as a future. The progress thread delivers completions, so no
    /// one needs to poll; the future is woken when one arrives.
    ///
    /// Cancellation-safe: dropping the future loses nothing (a completion that arrives
    /// later stays in the CQ for the next call), and memory in flight belongs to its
    /// [`crate::MemoryRegion`], never to a future, so no transfer can outlive its buffer.
    pub fn next(&self) -> NextCompletion<'_> {
        NextCompletion { cq: self }
    }
}

/// The future of [`CompletionQueue::next`].
#[derive(Debug)]
pub struct NextCompletion<'a> {
    cq: &'a CompletionQueue,
}

impl Future for NextCompletion<'_> {
    type Output = WorkCompletion;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<WorkCompletion> {
        let shared = &self.cq.shared;
        let mut one = [EMPTY_WC];
        if shared.pop_into(&mut one) == 1 {
            return Poll::Ready(one[0]);
        }
        {
            let mut w = shared.wakers.lock().unwrap_or_else(|p| p.into_inner());
            if !w.iter().any(|k| k.will_wake(cx.waker())) {
                w.push(cx.waker().clone());
            }
            shared.has_wakers.store(true, Ordering::SeqCst);
        }
        // A completion may have landed between the first look and the registration.
        if shared.pop_into(&mut one) == 1 {
            return Poll::Ready(one[0]);
        }
        // The task waits: what a burst of posts left unsent must not wait with it (not if
        // another thread holds the engine: a waker may poll from inside a delivery).
        each_engine(&self.cq.ctx, &self.cq.shared, &mut Engine::try_send_deferred);
        Poll::Pending
    }
}

/// [`CompletionQueue::each_engine`], for callers holding the parts.
fn each_engine(ctx: &ContextInner, cq: &CqShared, f: &mut dyn FnMut(&Engine)) {
    if ctx.shards.len() == 1 {
        return f(&ctx.engine);
    }
    let mask = match cq.shards.load(Ordering::Relaxed) {
        0 => 1,
        m => m,
    };
    for (k, e) in ctx.shards.iter().enumerate() {
        if mask & (1 << (k % 64)) != 0 {
            f(e);
        }
    }
}

/// A completion placeholder for output arrays.
pub const EMPTY_WC: WorkCompletion = WorkCompletion {
    wr_id: 0,
    status: softrdma_proto::qp::WcStatus::Success,
    opcode: softrdma_proto::qp::WcOpcode::Send,
    byte_len: 0,
    imm_data: None,
    invalidated_rkey: None,
    qp_num: softrdma_proto::Qpn::new(0),
    src_qp: softrdma_proto::Qpn::new(0),
    src: None,
    grh: false,
    solicited: false,
};

#[derive(Debug)]
pub(crate) struct ChannelShared {
    efd: EventFd,
    /// CQs with an event, each with the arming mode the event consumed.
    events: Mutex<ChannelQueue>,
    unacked: AtomicUsize,
    /// Events signalled through the eventfd (see [`CompletionChannel::fd_signals`]).
    signals: AtomicU64,
}

#[derive(Debug, Default)]
struct ChannelQueue {
    q: VecDeque<(Arc<CqShared>, u8)>,
    /// The eventfd was signalled and not drained since.
    signaled: bool,
}

thread_local! {
    /// The channel (its address) this thread waits on while it processes arrivals itself
    /// (see `wait_event`): events it delivers to that channel need no eventfd signal, as
    /// the same thread looks for them next.
    static DELIVERING_TO: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Marks this thread as delivering to a channel it waits on, until dropped. If a panic
/// ends the delivery, the events it queued without a signal get one, for other waiters.
struct Delivering<'a> {
    ch: &'a ChannelShared,
    before: usize,
}

impl<'a> Delivering<'a> {
    fn to(ch: &'a ChannelShared) -> Delivering<'a> {
        Delivering { ch, before: DELIVERING_TO.with(|d| d.replace(ch as *const ChannelShared as usize)) }
    }
}

impl Drop for Delivering<'_> {
    fn drop(&mut self) {
        DELIVERING_TO.with(|d| d.set(self.before));
        if std::thread::panicking() {
            let mut events = self.ch.events.lock().unwrap_or_else(|p| p.into_inner());
            if !events.q.is_empty() {
                self.ch.efd.signal();
                events.signaled = true;
            }
        }
    }
}

impl ChannelShared {
    fn notify(&self, cq: Arc<CqShared>, mode: u8) {
        // Signal under the lock that `try_get_event` drains under, so that the fd is
        // readable while an event waits: a C program polls the fd, then calls
        // `ibv_get_cq_event`, which must not block. The one exception is an event the
        // waiting thread delivers to itself: it takes it before it could wait again, and
        // signals for whatever it leaves queued (two system calls fewer per event).
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        events.q.push_back((cq, mode));
        // Signalled even if `signaled` says it was: a program that read the fd itself
        // would otherwise never see it readable again.
        let own = DELIVERING_TO.with(std::cell::Cell::get) == self as *const Self as usize;
        if !own {
            self.efd.signal();
            events.signaled = true;
            self.signals.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A completion channel: where armed CQs report new completions.
#[derive(Debug, Clone)]
pub struct CompletionChannel {
    shared: Arc<ChannelShared>,
    ctx: Arc<ContextInner>,
}

impl CompletionChannel {
    pub(crate) fn new(ctx: Arc<ContextInner>) -> Result<Self> {
        let shared = Arc::new(ChannelShared {
            efd: EventFd::exposed()?,
            events: Mutex::new(ChannelQueue::default()),
            unacked: AtomicUsize::new(0),
            signals: AtomicU64::new(0),
        });
        Ok(CompletionChannel { shared, ctx })
    }

    /// The next event without blocking: the CQ that has new completions.
    ///
    /// An event whose completions were all polled before it was read (the program armed
    /// the CQ, then polled the completion that fired it) is not returned: the CQ is armed
    /// again in the same mode, as the program left it, and the next event is looked at.
    /// So a program that takes an event and then polls always finds a completion, which
    /// `ibv_start_poll` users rely on (ENOENT after an event is an error to them).
    pub fn try_get_event(&self) -> Option<CompletionQueue> {
        loop {
            let (cq, mode) = {
                let mut events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
                // The fd is readable while an event waits (it is signalled under this lock
                // as events are queued, see `notify`): clear it when the last one is
                // taken, if it was signalled, and make it readable if one is left.
                let ev = events.q.pop_front()?;
                if events.q.is_empty() {
                    if std::mem::take(&mut events.signaled) {
                        self.shared.efd.drain();
                    }
                } else {
                    self.shared.efd.signal();
                    events.signaled = true;
                }
                ev
            };
            if cq.is_empty() {
                // Re-arm, then look again: a completion that landed in between is either
                // seen now or fires the new arming.
                cq.armed.store(mode, Ordering::Release);
                if cq.is_empty() {
                    continue;
                }
            }
            self.shared.unacked.fetch_add(1, Ordering::Relaxed);
            return Some(CompletionQueue { shared: cq, ctx: self.ctx.clone() });
        }
    }

    /// Blocks until an armed CQ has a new completion, and returns that CQ.
    pub fn get_event(&self) -> Result<CompletionQueue> {
        loop {
            if let Some(cq) = self.get_event_timeout(Duration::from_secs(3600))? {
                return Ok(cq);
            }
        }
    }

    /// [`Self::get_event`], giving up after `timeout` (`Ok(None)`).
    pub fn get_event_timeout(&self, timeout: Duration) -> Result<Option<CompletionQueue>> {
        self.wait_event(timeout, false)
    }

    /// [`Self::get_event_timeout`] for a thread that should do no packet work while it
    /// waits: it sleeps on the channel alone and leaves arrivals to the device's progress
    /// thread, as an application leaves them to a NIC. Its CPU time is then only its own
    /// work (the tutorial's passive server shows 0 %), at the price of one more thread
    /// hop per completion than `get_event_timeout`, which processes arrivals itself.
    pub fn get_event_passive(&self, timeout: Duration) -> Result<Option<CompletionQueue>> {
        self.wait_event(timeout, true)
    }

    fn wait_event(&self, timeout: Duration, passive: bool) -> Result<Option<CompletionQueue>> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(cq) = self.try_get_event() {
                return Ok(Some(cq));
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            // A sharded device's arrivals come on several sockets: its progress threads
            // take them. So do they for a link with more descriptors than a wait below
            // watches (none has today): a watcher leaves the link to no one else.
            // The channel's descriptor and the link's, in one wait.
            const WAIT_FDS: usize = 8;
            let link = self.ctx.engine.link_fds();
            if passive || self.ctx.shards.len() > 1 || link.len() >= WAIT_FDS {
                for e in &self.ctx.shards {
                    e.app_blocking();
                }
                sys::wait_readable_any(&[self.shared.efd.as_raw_fd()], Some(left))?;
                continue;
            }
            // Wait on the device socket too: when a packet arrives, this thread processes it
            // itself, which saves the hop through the progress thread on the way to the
            // event; the progress thread stays off the link meanwhile.
            let mut fds = [-1; WAIT_FDS];
            fds[0] = self.shared.efd.as_raw_fd();
            let n = 1 + link.len();
            fds[1..n].copy_from_slice(link);
            let mut watching = self.ctx.engine.app_watch_begin();
            let ready = sys::wait_readable_any(&fds[..n], Some(left))?;
            if ready & !1 != 0 {
                let _delivering = Delivering::to(&self.shared);
                watching.pass();
            }
            drop(watching);
        }
    }

    /// Acknowledges `n` events (bookkeeping, as `ibv_ack_cq_events`).
    pub fn ack_events(&self, n: usize) {
        let _ = self
            .shared
            .unacked
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| Some(u.saturating_sub(n)));
    }

    /// Events received and not yet acknowledged.
    pub fn unacked_events(&self) -> usize {
        self.shared.unacked.load(Ordering::Relaxed)
    }

    /// Events signalled through the channel's descriptor: delivered by a thread other than
    /// the one waiting (the progress thread, a poller), each a wake-up of the waiter. An
    /// event the waiting thread delivers to itself, from the packet that ended its watch,
    /// is not counted. A diagnostic: in an event-mode ping-pong nearly every event should
    /// be the waiter's own.
    pub fn fd_signals(&self) -> u64 {
        self.shared.signals.load(Ordering::Relaxed)
    }
}

impl AsRawFd for CompletionChannel {
    /// Readable when an event is waiting; `get_event` clears it.
    fn as_raw_fd(&self) -> RawFd {
        self.shared.efd.as_raw_fd()
    }
}
