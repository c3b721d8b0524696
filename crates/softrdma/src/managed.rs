//! Managed buffers and completions: registered typed buffers that travel with the
//! operations using them, a pool of them, and a completion poller that hands each buffer
//! back with its completion.
//!
//! The verbs layer leaves three chores to every program: registering memory (slow, so
//! programs keep registered buffers around), matching completions to the buffers they
//! belong to (through `wr_id`), and not touching a buffer while an operation uses it. Here
//! the type system does all three:
//!
//! - a [`Buffer<T>`] is registered memory holding `T`s (any plain-data type, [`Pod`]);
//! - posting an operation *moves* the buffer into the returned [`Pending`] (or into the
//!   callback's [`Done`]): while the operation is in flight no code can read, write, drop
//!   or post the buffer again, and the completion gives it back. There is no `wr_id` to
//!   cast;
//! - a [`BufferPool`] registers buffers once and takes them back when they are dropped;
//! - a [`CompletionPoller`] owns a completion queue and its channel and dispatches each
//!   completion to whoever posted the operation: a [`Pending`] (wait for it, or `.await`
//!   it), a callback ([`Connection::post_then`]), or a [`RecvStream`] that keeps receives
//!   posted.
//!
//! ```
//! use softrdma::managed::{Buffer, CompletionPoller, Connection, WaitMode};
//! use softrdma::{Access, ConnectOptions, Context, QpBuilder};
//! use std::sync::Arc;
//!
//! # fn main() -> Result<(), softrdma::Error> {
//! // Two devices on loopback addresses (two hosts, normally).
//! let ca = Context::open("127.0.30.1".parse().unwrap())?;
//! let cb = Context::open("127.0.30.2".parse().unwrap())?;
//! // Each side: a poller (CQ + channel), a QP on its CQ, connected as usual.
//! let (pa, pb) = (CompletionPoller::new(&ca, 64, WaitMode::Event)?, CompletionPoller::new(&cb, 64, WaitMode::Event)?);
//! let (pda, pdb) = (ca.alloc_pd(), cb.alloc_pd());
//! let qa = pda.prepare_qp(&QpBuilder::rc(), pa.cq(), pa.cq())?;
//! let qb = pdb.prepare_qp(&QpBuilder::rc(), pb.cq(), pb.cq())?;
//! let (ea, eb) = (qa.endpoint(), qb.endpoint());
//! let a = Connection::new(Arc::new(qa.handshake(&eb, &ConnectOptions::default())?), &pa)?;
//! let b = Connection::new(Arc::new(qb.handshake(&ea, &ConnectOptions::default())?), &pb)?;
//!
//! // B posts a receive: the buffer moves into the pending operation.
//! let incoming = b.recv(Buffer::<u32>::new(&pdb, 4)?)?;
//! // A sends four numbers.
//! let sent = a.send(Buffer::from_slice(&pda, &[1u32, 2, 3, 4])?)?;
//! let got = incoming.wait().check()?; // the buffer comes back with its completion
//! assert_eq!(got.buffer.to_vec(), [1, 2, 3, 4]);
//! sent.wait().check()?;
//! # Ok(()) }
//! ```
//!
//! # Why copies, not references
//!
//! A buffer's bytes are registered memory, which the network reaches through an L_Key
//! (and, with remote access, an R_Key) that any code of the process could put in a work
//! request. Lending them out as `&[T]` would make such a request undefined behaviour in
//! safe code; so [`Buffer`] reads and writes by copying, through the same atomic word
//! accesses the network uses (see [`crate::MemoryRegion`]). The ownership rules above are
//! what keeps a program from racing its own operations; the copies keep a stray or hostile
//! request from being anything worse than a race on values.
//!
//! # Waiting
//!
//! [`WaitMode::Busy`] polls the CQ in the waiting thread (lowest latency, one core busy);
//! [`WaitMode::Event`] arms the CQ and sleeps on the channel, leaving packet work to the
//! device's progress thread ([`crate::CompletionChannel::get_event_passive`]), so an idle
//! or passive program uses no CPU; [`CompletionPoller::spawn`] gives the poller a thread of
//! its own that waits in event mode and runs callbacks there. Whichever thread waits
//! dispatches every completion it finds, its own or another's; callbacks run in that
//! thread and must not block on other operations.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

pub use bytemuck::{self, Pod, Zeroable};

use crate::cq::{CompletionChannel, CompletionQueue, EMPTY_WC};
use crate::pd::{MemoryRegion, ProtectionDomain, RemoteRegion};
use crate::qp::QueuePair;
use crate::{
    Access, Context, Error, RecvWr, Result, Rkey, SendFlags, SendOp, SendWr, WcStatus, WorkCompletion,
};

fn lock<M>(m: &Mutex<M>) -> MutexGuard<'_, M> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The lock if it is free; a lock poisoned by a panicking callback counts as free.
fn try_lock<M>(m: &Mutex<M>) -> Option<MutexGuard<'_, M>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

// ---------------------------------------------------------------------------------------
// Buffers

/// A registered buffer of `T`s, with a length (elements in use) and a capacity (elements
/// registered), like a `Vec<T>` that the network can reach.
///
/// Reads and writes copy (see the [module docs](self)); posting the buffer moves it into
/// the operation, and its completion gives it back. A buffer taken from a [`BufferPool`]
/// goes back to the pool when dropped; any other is deregistered when dropped.
pub struct Buffer<T: Pod> {
    /// Always `Some` but while the buffer goes back to its pool.
    mr: Option<MemoryRegion>,
    len: usize,
    cap: usize,
    home: Option<Weak<PoolShared>>,
    // Bytes, not `T` values, live in the buffer: it is `Send` and `Sync` whatever `T` is.
    _t: PhantomData<fn() -> T>,
}

impl<T: Pod> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .field("pooled", &self.home.is_some())
            .finish()
    }
}

fn bytes_for<T>(elements: usize) -> Result<usize> {
    if size_of::<T>() == 0 {
        return Err(Error::InvalidArgument("a buffer of a zero-sized type"));
    }
    elements.checked_mul(size_of::<T>()).ok_or(Error::InvalidArgument("buffer size overflows"))
}

impl<T: Pod> Buffer<T> {
    /// Registers a zeroed buffer of `capacity` elements, for messages (SEND/RECV and
    /// the local side of WRITE and READ); its length is its capacity.
    pub fn new(pd: &ProtectionDomain, capacity: usize) -> Result<Buffer<T>> {
        Self::with_access(pd, capacity, Access::LOCAL_WRITE)
    }

    /// Registers a zeroed buffer with other access rights, such as
    /// `LOCAL_WRITE | REMOTE_WRITE` for a buffer the peer writes into. With remote rights
    /// the peer may reach the bytes whenever it has the [`Self::remote`] description:
    /// what tells the program that data has arrived is the protocol (a WRITE with
    /// immediate, a message), as with any RDMA buffer.
    pub fn with_access(pd: &ProtectionDomain, capacity: usize, access: Access) -> Result<Buffer<T>> {
        let mr = pd.register(bytes_for::<T>(capacity)?, access)?;
        Ok(Buffer { mr: Some(mr), len: capacity, cap: capacity, home: None, _t: PhantomData })
    }

    /// Registers a buffer holding a copy of `data`.
    pub fn from_slice(pd: &ProtectionDomain, data: &[T]) -> Result<Buffer<T>> {
        let mut b = Self::new(pd, data.len())?;
        b.write(0, data)?;
        Ok(b)
    }

    fn mr(&self) -> &MemoryRegion {
        self.mr.as_ref().expect("a buffer has its region until dropped")
    }

    /// Elements in use: what a send or write transfers; set by a receive or read.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no element is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements registered.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the length (at most the capacity). Elements keep their values.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.cap {
            return Err(Error::InvalidArgument("buffer length above its capacity"));
        }
        self.len = len;
        Ok(())
    }

    /// The length in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// Copies `out.len()` elements starting at element `at` into `out`.
    pub fn read(&self, at: usize, out: &mut [T]) -> Result<()> {
        let off = bytes_for::<T>(at)?;
        self.mr().read(off, bytemuck::cast_slice_mut(out))
    }

    /// Copies `data` to element `at` onwards (within the capacity; the length is not
    /// changed).
    pub fn write(&mut self, at: usize, data: &[T]) -> Result<()> {
        let off = bytes_for::<T>(at)?;
        self.mr().write(off, bytemuck::cast_slice(data))
    }

    /// Replaces the contents with `data`: writes it and sets the length to its length.
    pub fn copy_from(&mut self, data: &[T]) -> Result<()> {
        if data.len() > self.cap {
            return Err(Error::InvalidArgument("data longer than the buffer's capacity"));
        }
        self.write(0, data)?;
        self.len = data.len();
        Ok(())
    }

    /// The element at `i`, if `i` is below the length.
    pub fn get(&self, i: usize) -> Option<T> {
        if i >= self.len {
            return None;
        }
        let mut v = [T::zeroed()];
        self.read(i, &mut v).ok()?;
        Some(v[0])
    }

    /// Stores `v` at `i` (below the length).
    pub fn set(&mut self, i: usize, v: T) -> Result<()> {
        if i >= self.len {
            return Err(Error::InvalidArgument("index outside the buffer's length"));
        }
        self.write(i, &[v])
    }

    /// A copy of the elements in use.
    pub fn to_vec(&self) -> Vec<T> {
        let mut v = vec![T::zeroed(); self.len];
        self.read(0, &mut v).expect("the length is within the region");
        v
    }

    /// What a peer needs to WRITE or READ this buffer (its whole capacity), if it was
    /// registered with remote rights.
    pub fn remote(&self) -> Option<RemoteRegion> {
        let a = self.mr().access();
        (a.contains(Access::REMOTE_WRITE) || a.contains(Access::REMOTE_READ)).then(|| self.mr().remote())
    }

    fn sge(&self, elements: usize) -> Result<crate::SgList> {
        let bytes = bytes_for::<T>(elements)?;
        Ok(if bytes == 0 { crate::SgList::new() } else { softrdma_proto::sgl![self.mr().sge(0, bytes)?] })
    }
}

impl<T: Pod> Drop for Buffer<T> {
    fn drop(&mut self) {
        if let (Some(home), Some(mr)) = (self.home.as_ref().and_then(Weak::upgrade), self.mr.take()) {
            home.give_back(mr);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Pool

#[derive(Debug)]
struct PoolShared {
    free: Mutex<Vec<MemoryRegion>>,
    returned: Condvar,
    count: usize,
}

impl PoolShared {
    fn give_back(&self, mr: MemoryRegion) {
        lock(&self.free).push(mr);
        self.returned.notify_one();
    }
}

/// Registered buffers, registered once and handed out again and again: registration
/// allocates and maps memory, which costs far more than taking a buffer from here (the
/// README has the figures). A buffer taken from the pool comes back when it is dropped,
/// also after a completion returned it; its contents are not cleared.
pub struct BufferPool<T: Pod> {
    shared: Arc<PoolShared>,
    cap: usize,
    // Bytes, not `T` values, live in the buffer: it is `Send` and `Sync` whatever `T` is.
    _t: PhantomData<fn() -> T>,
}

impl<T: Pod> fmt::Debug for BufferPool<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferPool")
            .field("count", &self.shared.count)
            .field("available", &self.available())
            .field("capacity", &self.cap)
            .finish()
    }
}

impl<T: Pod> BufferPool<T> {
    /// Registers `count` buffers of `capacity` elements each with `access` rights.
    pub fn new(
        pd: &ProtectionDomain,
        count: usize,
        capacity: usize,
        access: Access,
    ) -> Result<BufferPool<T>> {
        let bytes = bytes_for::<T>(capacity)?;
        let free = (0..count).map(|_| pd.register(bytes, access)).collect::<Result<Vec<_>>>()?;
        Ok(BufferPool {
            shared: Arc::new(PoolShared { free: Mutex::new(free), returned: Condvar::new(), count }),
            cap: capacity,
            _t: PhantomData,
        })
    }

    fn wrap(&self, mr: MemoryRegion) -> Buffer<T> {
        Buffer {
            mr: Some(mr),
            len: self.cap,
            cap: self.cap,
            home: Some(Arc::downgrade(&self.shared)),
            _t: PhantomData,
        }
    }

    /// A buffer, if one is free now (its length is its capacity).
    pub fn take(&self) -> Option<Buffer<T>> {
        let mr = lock(&self.shared.free).pop()?;
        Some(self.wrap(mr))
    }

    /// A buffer, waiting at most `timeout` for one to come back.
    pub fn take_timeout(&self, timeout: Duration) -> Result<Buffer<T>> {
        let deadline = Instant::now() + timeout;
        let mut free = lock(&self.shared.free);
        loop {
            if let Some(mr) = free.pop() {
                drop(free);
                return Ok(self.wrap(mr));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::TimedOut("no buffer came back to the pool"));
            }
            free = self.shared.returned.wait_timeout(free, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Buffers free now.
    pub fn available(&self) -> usize {
        lock(&self.shared.free).len()
    }

    /// Buffers the pool registered.
    pub fn count(&self) -> usize {
        self.shared.count
    }

    /// Each buffer's capacity in elements.
    pub fn buffer_capacity(&self) -> usize {
        self.cap
    }
}

// ---------------------------------------------------------------------------------------
// Completions

/// A finished operation: the buffer it used, back in the caller's hands, and its
/// completion.
pub struct Done<T: Pod> {
    /// The buffer: for a receive or READ, with its length set to what arrived (whole
    /// elements).
    pub buffer: Buffer<T>,
    /// The work completion (its `wr_id` is the poller's own).
    pub wc: WorkCompletion,
}

impl<T: Pod> fmt::Debug for Done<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Done").field("buffer", &self.buffer).field("wc", &self.wc).finish()
    }
}

impl<T: Pod> Done<T> {
    /// The completion's status.
    pub fn status(&self) -> WcStatus {
        self.wc.status
    }

    /// The immediate data a receive got, if any.
    pub fn imm(&self) -> Option<u32> {
        self.wc.imm_data
    }

    /// `self` if the operation succeeded, else [`Error::Failed`] with its status (the
    /// buffer is dropped: back to its pool, or deregistered).
    pub fn check(self) -> Result<Done<T>> {
        match self.wc.status {
            WcStatus::Success => Ok(self),
            status => Err(Error::Failed(status)),
        }
    }
}

/// A post that was refused at once (a full queue, a buffer of another protection
/// domain, a remote region too small), with the buffer handed back.
pub struct Refused<T: Pod> {
    /// Why.
    pub error: Error,
    /// The buffer, untouched.
    pub buffer: Buffer<T>,
}

impl<T: Pod> fmt::Debug for Refused<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refused").field("error", &self.error).field("buffer", &self.buffer).finish()
    }
}

impl<T: Pod> fmt::Display for Refused<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "work request refused: {}", self.error)
    }
}

impl<T: Pod> std::error::Error for Refused<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T: Pod> From<Refused<T>> for Error {
    fn from(r: Refused<T>) -> Error {
        r.error
    }
}

/// How the threads that wait on a [`CompletionPoller`] wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitMode {
    /// Poll the CQ in a loop: the lowest latency, one core at 100 %.
    Busy,
    /// Arm the CQ and sleep on the completion channel ("wait for notify").
    Event,
}

type OnDone = Box<dyn FnOnce(WorkCompletion) + Send>;

struct Slot {
    qpn: u32,
    send_side: bool,
    /// An unsignaled send: completed by the next signaled one of its QP.
    unsignaled: bool,
    opcode: crate::WcOpcode,
    on_done: OnDone,
}

#[derive(Default)]
struct Slots {
    next: u64,
    by_id: HashMap<u64, Slot>,
    /// Per QP, the unsignaled sends in posting order.
    unsignaled: HashMap<u32, VecDeque<u64>>,
}

struct PollerShared {
    cq: CompletionQueue,
    channel: CompletionChannel,
    mode: WaitMode,
    slots: Mutex<Slots>,
    /// Held by the thread that polls the CQ and waits on the channel.
    driver: Mutex<()>,
    /// Held from taking a work request's number to posting it, so that the numbers of a
    /// QP's sends rise in posting order (the unsignaled-send rule depends on it).
    posting: Mutex<()>,
    driving: AtomicBool,
    /// Waiters that are not the driver sleep here; the driver wakes them after each
    /// dispatch and when it leaves.
    wake: Mutex<()>,
    woken: Condvar,
    stop: AtomicBool,
    dispatched: AtomicU64,
    strays: AtomicU64,
}

impl fmt::Debug for PollerShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionPoller")
            .field("cq", &self.cq.id())
            .field("mode", &self.mode)
            .field("in_flight", &lock(&self.slots).by_id.len())
            .field("dispatched", &self.dispatched.load(Ordering::Relaxed))
            .finish()
    }
}

impl Drop for PollerShared {
    /// Operations still posted when the poller goes keep their buffers: freeing them (or
    /// handing them back to a pool) while the QP may still use them would break the
    /// guarantee that nothing else touches a buffer in flight. They are leaked, and stay
    /// registered, instead.
    fn drop(&mut self) {
        let slots = std::mem::take(&mut *lock(&self.slots));
        if !slots.by_id.is_empty() {
            std::mem::forget(slots);
        }
    }
}

/// Sets the stop flag when the last poller handle goes.
#[derive(Debug)]
struct Owner(Arc<PollerShared>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Release);
    }
}

/// A completion queue with its channel, and the table of operations in flight on it:
/// each completion goes to the [`Pending`], callback or [`RecvStream`] of its operation,
/// with its buffer. Create QPs on [`Self::cq`] and wrap them in [`Connection`]s.
#[derive(Debug, Clone)]
pub struct CompletionPoller {
    shared: Arc<PollerShared>,
    _owner: Arc<Owner>,
}

impl CompletionPoller {
    /// A poller with a CQ of `depth` entries and its channel; completions are dispatched
    /// by the threads that wait ([`Pending::wait`], [`Self::wait_timeout`]) in `mode`.
    pub fn new(ctx: &Context, depth: usize, mode: WaitMode) -> Result<CompletionPoller> {
        let channel = ctx.create_channel()?;
        let cq = ctx.create_cq(depth, Some(&channel))?;
        let shared = Arc::new(PollerShared {
            cq,
            channel,
            mode,
            slots: Mutex::new(Slots::default()),
            driver: Mutex::new(()),
            posting: Mutex::new(()),
            driving: AtomicBool::new(false),
            wake: Mutex::new(()),
            woken: Condvar::new(),
            stop: AtomicBool::new(false),
            dispatched: AtomicU64::new(0),
            strays: AtomicU64::new(0),
        });
        Ok(CompletionPoller { _owner: Arc::new(Owner(shared.clone())), shared })
    }

    /// A poller with a thread of its own that waits in event mode and runs callbacks
    /// (the seed's `CompletionPoller`). The thread ends when the last handle is dropped.
    pub fn spawn(ctx: &Context, depth: usize) -> Result<CompletionPoller> {
        let p = Self::new(ctx, depth, WaitMode::Event)?;
        let shared = p.shared.clone();
        crate::sys::spawn_quiet("softrdma-poller".into(), move || {
            while !shared.stop.load(Ordering::Acquire) {
                shared.drive(|| false, Some(Instant::now() + Duration::from_millis(100)));
            }
        })
        .map_err(Error::Io)?;
        Ok(p)
    }

    /// The completion queue: create the QPs of this poller's [`Connection`]s on it.
    pub fn cq(&self) -> &CompletionQueue {
        &self.shared.cq
    }

    /// Operations posted and not yet completed.
    pub fn in_flight(&self) -> usize {
        lock(&self.shared.slots).by_id.len()
    }

    /// Completions dispatched so far.
    pub fn dispatched(&self) -> u64 {
        self.shared.dispatched.load(Ordering::Relaxed)
    }

    /// Completions that matched no operation (work requests posted on the CQ's QPs
    /// directly, not through a [`Connection`]); they are dropped.
    pub fn strays(&self) -> u64 {
        self.shared.strays.load(Ordering::Relaxed)
    }

    /// Dispatches the completions waiting now, without blocking; returns how many.
    pub fn poll(&self) -> usize {
        match try_lock(&self.shared.driver) {
            Some(_g) => self.shared.dispatch(),
            None => 0,
        }
    }

    /// Waits up to `timeout` for at least one completion and dispatches all there are
    /// (for programs that use callbacks without a poller thread); returns how many.
    pub fn wait_timeout(&self, timeout: Duration) -> usize {
        let before = self.dispatched();
        self.shared.drive(|| self.dispatched() != before, Some(Instant::now() + timeout));
        (self.dispatched() - before) as usize
    }
}

impl PollerShared {
    /// Polls the CQ and dispatches what it holds; returns how many continuations ran.
    fn dispatch(&self) -> usize {
        let mut wcs = [EMPTY_WC; 32];
        let mut total = 0;
        loop {
            let n = self.cq.poll(&mut wcs);
            total += wcs[..n].iter().map(|wc| self.dispatch_one(wc)).sum::<usize>();
            if n < wcs.len() {
                return total;
            }
        }
    }

    /// Runs the continuation of the operation `wc` completes (and of the unsignaled sends
    /// it completes with it), outside the table's lock.
    fn dispatch_one(&self, wc: &WorkCompletion) -> usize {
        let mut ready: Vec<(OnDone, WorkCompletion)> = Vec::new();
        {
            let mut slots = lock(&self.slots);
            let Some(slot) = slots.by_id.remove(&wc.wr_id) else {
                self.strays.fetch_add(1, Ordering::Relaxed);
                return 0;
            };
            // A send's completion completes the unsignaled ones posted before it on its QP
            // that are still here: a QP's sends complete in order, and one that failed or
            // was flushed would have had a completion of its own before this one, so
            // these succeeded.
            if slot.send_side {
                let earlier = slots.unsignaled.get_mut(&slot.qpn).map(|q| {
                    let k = q.partition_point(|&id| id < wc.wr_id);
                    q.drain(..k).collect::<Vec<_>>()
                });
                for id in earlier.into_iter().flatten() {
                    if let Some(s) = slots.by_id.remove(&id) {
                        let done = WorkCompletion {
                            wr_id: id,
                            status: WcStatus::Success,
                            opcode: s.opcode,
                            byte_len: 0,
                            ..*wc
                        };
                        ready.push((s.on_done, done));
                    }
                }
            }
            if slot.unsignaled {
                if let Some(q) = slots.unsignaled.get_mut(&slot.qpn) {
                    q.retain(|&id| id != wc.wr_id);
                }
            }
            ready.push((slot.on_done, *wc));
        }
        let n = ready.len();
        for (f, wc) in ready {
            f(wc);
        }
        self.dispatched.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// For a task: dispatches what the CQ holds unless a thread is driving, and registers
    /// the task to be woken by the CQ's next arrival either way (the driver may stop
    /// before the task's completion comes). A completion taken off the CQ by the
    /// registration itself is dispatched here.
    fn poll_task(&self, cx: &mut TaskContext<'_>) {
        if let Some(_g) = try_lock(&self.driver) {
            self.dispatch();
        }
        let mut next = std::pin::pin!(self.cq.next());
        if let Poll::Ready(wc) = next.as_mut().poll(cx) {
            self.dispatch_one(&wc);
            cx.waker().wake_by_ref();
        }
    }

    /// Wakes the waiters that are not driving.
    fn kick(&self) {
        let _g = lock(&self.wake);
        self.woken.notify_all();
    }

    /// Waits, driving the CQ when no other thread does, until `ready` or the deadline;
    /// returns `ready()`.
    fn drive(&self, ready: impl Fn() -> bool, deadline: Option<Instant>) -> bool {
        loop {
            if ready() {
                return true;
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return false;
            }
            if let Some(guard) = try_lock(&self.driver) {
                // Cleared however this pass ends (a callback may panic).
                struct Driving<'a>(&'a PollerShared);
                impl Drop for Driving<'_> {
                    fn drop(&mut self) {
                        self.0.driving.store(false, Ordering::Release);
                        self.0.kick();
                    }
                }
                self.driving.store(true, Ordering::Release);
                let on = Driving(self);
                let n = self.dispatch();
                if n == 0 && !ready() {
                    match self.mode {
                        WaitMode::Busy => std::hint::spin_loop(),
                        WaitMode::Event => self.sleep(left.unwrap_or(Duration::from_secs(1))),
                    }
                }
                drop(guard);
                drop(on);
                continue;
            }
            let g = lock(&self.wake);
            if ready() {
                return true;
            }
            if !self.driving.load(Ordering::Acquire) {
                continue;
            }
            let nap = left.unwrap_or(Duration::from_millis(20)).min(Duration::from_millis(20));
            drop(self.woken.wait_timeout(g, nap));
        }
    }

    /// Event mode, as the driver: arm, look again, sleep on the channel.
    fn sleep(&self, left: Duration) {
        if self.cq.req_notify(false).is_err() || self.dispatch() > 0 {
            return;
        }
        if let Ok(Some(_)) = self.channel.get_event_passive(left.min(Duration::from_millis(100))) {
            self.channel.ack_events(1);
        }
        self.dispatch();
    }
}

struct Cell<T: Pod> {
    done: Mutex<Option<Done<T>>>,
    waker: Mutex<Option<Waker>>,
}

impl<T: Pod> Cell<T> {
    fn fill(&self, done: Done<T>) {
        *lock(&self.done) = Some(done);
        if let Some(w) = lock(&self.waker).take() {
            w.wake();
        }
    }
}

/// An operation in flight. It owns the operation's buffer until the completion arrives:
/// [`Self::wait`] (or `.await`) gives both back as a [`Done`]. Dropping it does not cancel
/// the operation; its buffer is released when the completion comes.
#[must_use = "the buffer comes back through the Pending"]
pub struct Pending<T: Pod> {
    cell: Arc<Cell<T>>,
    poller: Arc<PollerShared>,
}

impl<T: Pod> fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending").field("done", &self.is_done()).finish()
    }
}

impl<T: Pod> Pending<T> {
    /// Whether the completion has been dispatched.
    pub fn is_done(&self) -> bool {
        lock(&self.cell.done).is_some()
    }

    fn take(&self) -> Option<Done<T>> {
        lock(&self.cell.done).take()
    }

    /// Waits for the completion, as the poller's [`WaitMode`] says. On RC, every posted
    /// operation completes (successfully, or with an error once retries run out or the QP
    /// fails); a receive waits for a message as long as it takes: use
    /// [`Self::wait_timeout`] where none may come.
    pub fn wait(self) -> Done<T> {
        self.poller.drive(|| self.is_done(), None);
        self.take().expect("drive returns once done")
    }

    /// Waits at most `timeout`; gives the operation back if it has not completed.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Done<T>, Pending<T>> {
        if self.poller.drive(|| self.is_done(), Some(Instant::now() + timeout)) {
            Ok(self.take().expect("done"))
        } else {
            Err(self)
        }
    }

    /// The completion if it is there, without waiting or dispatching.
    pub fn try_take(self) -> std::result::Result<Done<T>, Pending<T>> {
        self.take().ok_or(self)
    }
}

impl<T: Pod> Future for Pending<T> {
    type Output = Done<T>;

    /// Dispatches what the CQ holds (unless another thread is driving) and registers to
    /// be woken both by its own completion and by any arrival on the CQ.
    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Done<T>> {
        if let Some(d) = self.take() {
            return Poll::Ready(d);
        }
        *lock(&self.cell.waker) = Some(cx.waker().clone());
        self.poller.poll_task(cx);
        match self.take() {
            Some(d) => Poll::Ready(d),
            None => Poll::Pending,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Operations

/// What to do with a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// SEND the buffer's elements in use.
    Send,
    /// SEND them with immediate data.
    SendWithImm(u32),
    /// SEND them from a UD QP to a destination (a peer's QP, or a multicast group with
    /// QP 0xFFFFFF).
    SendTo(crate::UdDest),
    /// Receive a message into the buffer (up to its capacity).
    Recv,
    /// RDMA WRITE the elements in use to the start of the peer's region.
    Write(RemoteRegion),
    /// RDMA WRITE with immediate data (consumes a receive at the peer).
    WriteWithImm(RemoteRegion, u32),
    /// RDMA WRITE without a completion of its own: it completes (and its buffer comes
    /// back) when a later signaled send of the same QP completes, as the QP's order
    /// guarantees; an error completes it at once.
    WriteUnsignaled(RemoteRegion),
    /// RDMA READ the start of the peer's region into the buffer's elements in use.
    Read(RemoteRegion),
}

/// A connected QP whose operations take [`Buffer`]s and complete through a
/// [`CompletionPoller`] (whose CQ the QP must use for both queues).
#[derive(Debug, Clone)]
pub struct Connection {
    qp: Arc<QueuePair>,
    poller: CompletionPoller,
}

impl Connection {
    /// Wraps a QP created on `poller.cq()` (as its send and receive CQ; another CQ is
    /// refused: its completions would never reach the poller).
    pub fn new(qp: Arc<QueuePair>, poller: &CompletionPoller) -> Result<Connection> {
        let cq = poller.cq().id();
        if qp.cq_ids() != [cq, cq] {
            return Err(Error::InvalidArgument("the QP's CQs are not the poller's"));
        }
        Ok(Connection { qp, poller: poller.clone() })
    }

    /// The QP.
    pub fn qp(&self) -> &Arc<QueuePair> {
        &self.qp
    }

    /// The poller.
    pub fn poller(&self) -> &CompletionPoller {
        &self.poller
    }

    /// Posts `op` on `buf`; the returned [`Pending`] gives the buffer back with the
    /// completion.
    pub fn post<T: Pod>(&self, op: Op, buf: Buffer<T>) -> std::result::Result<Pending<T>, Refused<T>> {
        let cell = Arc::new(Cell { done: Mutex::new(None), waker: Mutex::new(None) });
        let c = cell.clone();
        self.post_then(op, buf, move |done| c.fill(done))?;
        Ok(Pending { cell, poller: self.poller.shared.clone() })
    }

    /// Posts `op` on `buf` and runs `then` with the buffer and completion, in the thread
    /// that dispatches it (the poller's own with [`CompletionPoller::spawn`]).
    pub fn post_then<T: Pod, F>(&self, op: Op, buf: Buffer<T>, then: F) -> std::result::Result<(), Refused<T>>
    where
        F: FnOnce(Done<T>) + Send + 'static,
    {
        let elements = buf.len;
        let cap = buf.cap;
        let remote_fits = |r: &RemoteRegion| match bytes_for::<T>(elements) {
            Ok(b) if b as u64 <= r.len => Ok(()),
            _ => Err(Error::InvalidArgument("the remote region is smaller than the buffer's length")),
        };
        let send_op = match op {
            Op::Send => Some(SendOp::Send),
            Op::SendWithImm(imm) => Some(SendOp::SendWithImm(imm)),
            Op::SendTo(_) => Some(SendOp::Send),
            Op::Recv => None,
            Op::Write(r) | Op::WriteUnsignaled(r) => {
                Some(SendOp::Write { remote_addr: r.addr, rkey: Rkey(r.rkey) })
            }
            Op::WriteWithImm(r, imm) => {
                Some(SendOp::WriteWithImm { remote_addr: r.addr, rkey: Rkey(r.rkey), imm })
            }
            Op::Read(r) => Some(SendOp::Read { remote_addr: r.addr, rkey: Rkey(r.rkey) }),
        };
        if let Op::Write(r) | Op::WriteUnsignaled(r) | Op::WriteWithImm(r, _) | Op::Read(r) = &op {
            if let Err(error) = remote_fits(r) {
                return Err(Refused { error, buffer: buf });
            }
        }
        let sg_list = match buf.sge(if send_op.is_some() { elements } else { cap }) {
            Ok(s) => s,
            Err(error) => return Err(Refused { error, buffer: buf }),
        };
        let unsignaled = matches!(op, Op::WriteUnsignaled(_));
        let opcode = match op {
            Op::Send | Op::SendWithImm(_) | Op::SendTo(_) => crate::WcOpcode::Send,
            Op::Recv => crate::WcOpcode::Recv,
            Op::Write(_) | Op::WriteUnsignaled(_) | Op::WriteWithImm(..) => crate::WcOpcode::RdmaWrite,
            Op::Read(_) => crate::WcOpcode::RdmaRead,
        };
        let is_read = matches!(op, Op::Read(_));
        let is_recv = send_op.is_none();
        let ud = match op {
            Op::SendTo(dest) => Some(dest),
            _ => None,
        };
        let qpn = self.qp.qpn().get();
        let shared = &self.poller.shared;
        // The buffer travels in the continuation; a refused post takes it out again.
        let parked = Arc::new(Mutex::new(Some(buf)));
        let p2 = parked.clone();
        let on_done: OnDone = Box::new(move |wc: WorkCompletion| {
            let Some(mut buffer) = lock(&p2).take() else { return };
            if wc.status == WcStatus::Success && (is_recv || is_read) {
                let got = if is_recv { wc.byte_len as usize / size_of::<T>() } else { elements };
                buffer.len = got.min(buffer.cap);
            }
            then(Done { buffer, wc });
        });
        // Table first, then post: the completion may be dispatched before post returns.
        let posting = lock(&shared.posting);
        let id = {
            let mut slots = lock(&shared.slots);
            slots.next += 1;
            let id = slots.next;
            slots.by_id.insert(id, Slot { qpn, send_side: !is_recv, unsignaled, opcode, on_done });
            if unsignaled {
                slots.unsignaled.entry(qpn).or_default().push_back(id);
            }
            id
        };
        let res = match send_op {
            None => self.qp.post_recv(RecvWr { wr_id: id, sg_list }),
            Some(op) => self.qp.post_send(SendWr {
                wr_id: id,
                op,
                sg_list,
                flags: SendFlags { signaled: !unsignaled, ..Default::default() },
                ud,
            }),
        };
        drop(posting);
        if let Err(error) = res {
            let mut slots = lock(&shared.slots);
            slots.by_id.remove(&id);
            if let Some(q) = slots.unsignaled.get_mut(&qpn) {
                q.retain(|&x| x != id);
            }
            drop(slots);
            let buffer = lock(&parked).take().expect("a refused post's buffer is still parked");
            return Err(Refused { error, buffer });
        }
        Ok(())
    }

    /// SENDs the buffer's elements in use.
    pub fn send<T: Pod>(&self, buf: Buffer<T>) -> std::result::Result<Pending<T>, Refused<T>> {
        self.post(Op::Send, buf)
    }

    /// Posts a receive into the buffer.
    pub fn recv<T: Pod>(&self, buf: Buffer<T>) -> std::result::Result<Pending<T>, Refused<T>> {
        self.post(Op::Recv, buf)
    }

    /// RDMA WRITEs the buffer's elements in use to the start of `to`.
    pub fn write<T: Pod>(
        &self,
        buf: Buffer<T>,
        to: RemoteRegion,
    ) -> std::result::Result<Pending<T>, Refused<T>> {
        self.post(Op::Write(to), buf)
    }

    /// RDMA READs the start of `from` into the buffer's elements in use.
    pub fn read<T: Pod>(
        &self,
        buf: Buffer<T>,
        from: RemoteRegion,
    ) -> std::result::Result<Pending<T>, Refused<T>> {
        self.post(Op::Read(from), buf)
    }

    /// Keeps the `buffers` posted as receives and yields each one filled, in arrival
    /// order (the tutorial's subscriber: two or more receives always posted).
    pub fn recv_stream<T: Pod>(&self, buffers: Vec<Buffer<T>>) -> Result<RecvStream<T>> {
        let s = RecvStream {
            conn: self.clone(),
            shared: Arc::new(StreamShared { q: Mutex::new(VecDeque::new()), waker: Mutex::new(None) }),
        };
        for b in buffers {
            s.repost(b)?;
        }
        Ok(s)
    }
}

struct StreamShared<T: Pod> {
    q: Mutex<VecDeque<Done<T>>>,
    waker: Mutex<Option<Waker>>,
}

/// Receives kept posted ([`Connection::recv_stream`]): each arrival comes out of
/// [`Self::next_timeout`] or the [`futures_core::Stream`] implementation with its buffer;
/// give the buffer back with [`Self::repost`] once its data is used.
pub struct RecvStream<T: Pod> {
    conn: Connection,
    shared: Arc<StreamShared<T>>,
}

impl<T: Pod> fmt::Debug for RecvStream<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvStream").field("ready", &lock(&self.shared.q).len()).finish()
    }
}

impl<T: Pod> RecvStream<T> {
    /// Posts `buf` as a receive of this stream.
    pub fn repost(&self, buf: Buffer<T>) -> Result<()> {
        let shared = self.shared.clone();
        self.conn
            .post_then(Op::Recv, buf, move |done| {
                lock(&shared.q).push_back(done);
                if let Some(w) = lock(&shared.waker).take() {
                    w.wake();
                }
            })
            .map_err(Error::from)
    }

    /// The next arrival, waiting at most `timeout`.
    pub fn next_timeout(&self, timeout: Duration) -> Option<Done<T>> {
        let deadline = Instant::now() + timeout;
        self.conn.poller.shared.drive(|| !lock(&self.shared.q).is_empty(), Some(deadline));
        lock(&self.shared.q).pop_front()
    }
}

impl<T: Pod> futures_core::Stream for RecvStream<T> {
    type Item = Done<T>;

    /// Never ends by itself: a disconnect yields the flushed receives (with
    /// `WR_FLUSH_ERR`), and the caller stops there.
    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Done<T>>> {
        if let Some(d) = lock(&self.shared.q).pop_front() {
            return Poll::Ready(Some(d));
        }
        *lock(&self.shared.waker) = Some(cx.waker().clone());
        self.conn.poller.shared.poll_task(cx);
        match lock(&self.shared.q).pop_front() {
            Some(d) => Poll::Ready(Some(d)),
            None => Poll::Pending,
        }
    }
}
