//! Connection management with rdma_cm's shape: event channels, CM IDs, address and route
//! resolution, listen/connect/accept/reject/disconnect, and QPs that the CM moves through
//! their states — over the IB CM on QP1, so that softrdma connects to softrdma and to
//! Linux's rdma_cm (rxe, NICs) alike.
//!
//! | rdma_cm | here |
//! |---|---|
//! | `rdma_create_event_channel` | [`EventChannel::new`] ([`EventChannel::fd`] is pollable) |
//! | `rdma_get_cm_event` / `rdma_ack_cm_event` | [`EventChannel::get_event`] (events own their data; dropping one acks it) |
//! | `rdma_create_id` | [`CmId::new`] with a [`PortSpace`] |
//! | `rdma_bind_addr`, `rdma_resolve_addr`, `rdma_resolve_route` | [`CmId::bind_addr`], [`CmId::resolve_addr`], [`CmId::resolve_route`] |
//! | `rdma_listen`, `rdma_connect`, `rdma_accept`, `rdma_reject` | [`CmId::listen`], [`CmId::connect`], [`CmId::accept`], [`CmId::reject`] |
//! | `rdma_disconnect`, `rdma_establish`, `rdma_destroy_id` | [`CmId::disconnect`], [`CmId::establish`], dropping the last [`CmId`] |
//! | `rdma_create_qp`, `rdma_destroy_qp`, `id->verbs` | [`CmId::create_qp`], [`CmId::destroy_qp`], [`CmId::context`] |
//! | `struct rdma_conn_param` | [`ConnParam`] |
//! | `rdma_migrate_id` | [`CmId::migrate`] |
//! | async code | [`EventChannel::next_event`] (a future), [`EventChannel::events`] (a `Stream`) |
//! | `rdma_getaddrinfo`, `rdma_create_ep`, `rdma_verbs.h` | [`getaddrinfo`], [`Ep`] (see its module) |
//!
//! What rdma_cm does, this does: the REQ carries rdma_cm's service ID (port space and
//! port) and its private-data header (addresses and source port) before the user's
//! private data; the active side's QP is moved to RTR and RTS when the REP arrives and
//! the RTU follows at once (ESTABLISHED); the passive side's QP is moved to RTR and RTS by
//! [`CmId::accept`], before the REP; remote access becomes REMOTE_WRITE, plus READ and
//! ATOMIC when the side grants responder resources; each side's send PSN is random; the
//! path MTU is the smaller of the device's and the REQ's; retry counts follow the REQ and
//! RNR retries the other side's message. UD IDs (port space UDP) resolve the peer's QP
//! with SIDR, and their QPs use rdma_cm's Q_Key 0x01234567.
//!
//! Addresses: an ID bound to an address uses the device of that address (the context a
//! process opens there, which the CM then keeps open for the life of the process, as
//! rdma_cm keeps its devices). An active ID with no source address takes the route's source
//! address; on loopback, if another process already uses that address, the next free
//! address of `127.0.0.0/8` is taken. A listener on a wildcard address listens on every
//! address of every device that this process can open, and on the address
//! `SOFTRDMA_BIND` names ([`crate::BIND_ENV`]: how two processes on one host, at
//! 127.0.0.2 and 127.0.0.3, run programs whose servers listen on a wildcard address).

mod ep;

pub use ep::{getaddrinfo, AddrHints, AddrInfo, Ep, EpQp};

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use softrdma_proto::cm::{CmConfig, CmEvent as AgentEvent, CmPath, CmaHeader, CommId, Rep, Req, SidrRep};
use softrdma_proto::qp::{Mtu, QpAttr, QpState, QpType};
use softrdma_proto::{Psn, Qkey, Qpn};

pub use softrdma_proto::cm::PortSpace;

use crate::context::Context;
use crate::cq::CompletionQueue;
use crate::engine::{ActiveQp, CmSink};
use crate::pd::ProtectionDomain;
use crate::qp::{QpBuilder, QueuePair};
use crate::sys::EventFd;
use crate::{Access, Error, Result};

/// The Q_Key of rdma_cm's UD QPs (`RDMA_UDP_QKEY`).
pub const UDP_QKEY: Qkey = Qkey(0x0123_4567);

/// The Enhanced Connection Establishment vendor ID softrdma puts in its REQs: the
/// announcement that this side is softrdma and takes SACKs (selective recovery, see
/// `QueuePair::set_selective` in the protocol crate). An ECE vendor ID is an IEEE OUI;
/// these two ("SDR", "SDS") have the locally administered bit set, so they name no
/// company.
pub const SOFTRDMA_ECE: u32 = 0x53_4452;
/// The ECE vendor ID of softrdma's REP to a REQ that carried [`SOFTRDMA_ECE`]. Not the
/// same value: Linux's rdma_cm answers a REQ's ECE with the same ECE in its REP (seen
/// from rxe in the lab), so an echo proves nothing. A connection whose peer's REQ lacks
/// [`SOFTRDMA_ECE`], or whose REP lacks this, is treated as foreign (go-back-N, the 128-PSN
/// window, no vendor opcodes), whatever else says the peer is softrdma.
pub const SOFTRDMA_ECE_REPLY: u32 = 0x53_4453;

/// The local ACK timeout the CM gives RC QPs (4.096 µs × 2^14 ≈ 67 ms), and puts in its
/// REQs' path.
pub const ACK_TIMEOUT: u8 = 14;

/// rdma_cm's event types (`enum rdma_cm_event_type`, same order and values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CmEventKind {
    /// `resolve_addr` succeeded.
    AddrResolved = 0,
    /// `resolve_addr` failed (no route, no device).
    AddrError = 1,
    /// `resolve_route` succeeded.
    RouteResolved = 2,
    /// `resolve_route` failed.
    RouteError = 3,
    /// A connection request on a listener; the event's ID is the new connection's.
    ConnectRequest = 4,
    /// Active without a QP: the peer accepted; call [`CmId::establish`].
    ConnectResponse = 5,
    /// The connection failed on our side.
    ConnectError = 6,
    /// The peer did not answer.
    Unreachable = 7,
    /// The peer refused; [`CmEvent::status`] is the REJ reason.
    Rejected = 8,
    /// The connection is up.
    Established = 9,
    /// The connection is closed.
    Disconnected = 10,
    /// The device went away.
    DeviceRemoval = 11,
    /// A multicast join completed.
    MulticastJoin = 12,
    /// A multicast join failed.
    MulticastError = 13,
    /// The address changed.
    AddrChange = 14,
    /// The connection left TIMEWAIT.
    TimewaitExit = 15,
}

impl CmEventKind {
    /// rdma_cm's name (`rdma_event_str`).
    pub fn name(self) -> &'static str {
        match self {
            CmEventKind::AddrResolved => "RDMA_CM_EVENT_ADDR_RESOLVED",
            CmEventKind::AddrError => "RDMA_CM_EVENT_ADDR_ERROR",
            CmEventKind::RouteResolved => "RDMA_CM_EVENT_ROUTE_RESOLVED",
            CmEventKind::RouteError => "RDMA_CM_EVENT_ROUTE_ERROR",
            CmEventKind::ConnectRequest => "RDMA_CM_EVENT_CONNECT_REQUEST",
            CmEventKind::ConnectResponse => "RDMA_CM_EVENT_CONNECT_RESPONSE",
            CmEventKind::ConnectError => "RDMA_CM_EVENT_CONNECT_ERROR",
            CmEventKind::Unreachable => "RDMA_CM_EVENT_UNREACHABLE",
            CmEventKind::Rejected => "RDMA_CM_EVENT_REJECTED",
            CmEventKind::Established => "RDMA_CM_EVENT_ESTABLISHED",
            CmEventKind::Disconnected => "RDMA_CM_EVENT_DISCONNECTED",
            CmEventKind::DeviceRemoval => "RDMA_CM_EVENT_DEVICE_REMOVAL",
            CmEventKind::MulticastJoin => "RDMA_CM_EVENT_MULTICAST_JOIN",
            CmEventKind::MulticastError => "RDMA_CM_EVENT_MULTICAST_ERROR",
            CmEventKind::AddrChange => "RDMA_CM_EVENT_ADDR_CHANGE",
            CmEventKind::TimewaitExit => "RDMA_CM_EVENT_TIMEWAIT_EXIT",
        }
    }
}

impl std::fmt::Display for CmEventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Connection parameters (`struct rdma_conn_param`): what [`CmId::connect`] and
/// [`CmId::accept`] offer, and what CONNECT_REQUEST and ESTABLISHED events report of
/// the peer's offer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnParam {
    /// Private data (REQ: at most 56 bytes after rdma_cm's header; REP: 196; REJ: 148).
    pub private_data: Vec<u8>,
    /// RDMA READs and atomics this side accepts at once as responder.
    pub responder_resources: u8,
    /// RDMA READs and atomics this side issues at once.
    pub initiator_depth: u8,
    /// End-to-end flow control.
    pub flow_control: bool,
    /// Transport retries after a timeout (0–7).
    pub retry_count: u8,
    /// Retries after an RNR NAK (0–7, 7 is infinite).
    pub rnr_retry_count: u8,
    /// The QP is attached to an SRQ.
    pub srq: bool,
    /// The QP number to announce when the ID has no QP of its own.
    pub qp_num: u32,
}

impl Default for ConnParam {
    fn default() -> Self {
        ConnParam {
            private_data: Vec::new(),
            responder_resources: 1,
            initiator_depth: 1,
            flow_control: false,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: false,
            qp_num: 0,
        }
    }
}

/// What a UD event reports: the peer's QP, Q_Key and address (`struct rdma_ud_param`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdParam {
    /// The peer's QP.
    pub qpn: Qpn,
    /// Its Q_Key.
    pub qkey: Qkey,
    /// Its address (RoCE port 4791 or the device's).
    pub addr: SocketAddr,
}

/// An event (`struct rdma_cm_event`).
#[derive(Debug, Clone)]
pub struct CmEvent {
    /// What happened.
    pub kind: CmEventKind,
    /// The ID it happened to (a new ID for CONNECT_REQUEST).
    pub id: CmId,
    /// The listener, for CONNECT_REQUEST.
    pub listen_id: Option<CmId>,
    /// 0, a negative errno, or the REJ reason (REJECTED).
    pub status: i32,
    /// The peer's connection parameters and private data (CONNECT_REQUEST,
    /// CONNECT_RESPONSE, ESTABLISHED, REJECTED's private data).
    pub param: ConnParam,
    /// UD: the peer's QP (CONNECT_REQUEST of a UD listener, ESTABLISHED of a UD ID).
    pub ud: Option<UdParam>,
}

// ---- Event channels ------------------------------------------------------------------

#[derive(Debug)]
struct Chan {
    queue: Mutex<VecDeque<CmEvent>>,
    cond: Condvar,
    /// Readable exactly while an event waits.
    efd: EventFd,
    /// Tasks awaiting an event ([`EventChannel::next_event`], [`Events`]); taken under
    /// the queue's lock, so that a task either finds the event or is woken by it.
    wakers: Mutex<Vec<Waker>>,
}

impl Chan {
    fn push(&self, ev: CmEvent) {
        let mut q = lock(&self.queue);
        q.push_back(ev);
        self.efd.signal();
        self.cond.notify_all();
        let wakers = std::mem::take(&mut *lock(&self.wakers));
        drop(q);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Pops the next event, or registers the task to be woken by the next push.
    fn poll_pop(&self, cx: &mut TaskContext<'_>) -> Poll<CmEvent> {
        let mut q = lock(&self.queue);
        if let Some(ev) = q.pop_front() {
            if q.is_empty() {
                self.efd.drain();
            }
            return Poll::Ready(ev);
        }
        let mut wakers = lock(&self.wakers);
        if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
            wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// An event channel (`rdma_event_channel`): where the events of its IDs queue.
#[derive(Debug, Clone)]
pub struct EventChannel {
    chan: Arc<Chan>,
}

impl EventChannel {
    /// A channel with no events.
    pub fn new() -> Result<EventChannel> {
        let chan = Chan {
            queue: Mutex::new(VecDeque::new()),
            cond: Condvar::new(),
            efd: EventFd::exposed()?,
            wakers: Mutex::new(Vec::new()),
        };
        Ok(EventChannel { chan: Arc::new(chan) })
    }

    /// The next event, for async code: a future that resolves when one waits. It works
    /// with any executor: the event's arrival wakes the task.
    pub fn next_event(&self) -> NextEvent<'_> {
        NextEvent { chan: &self.chan }
    }

    /// The channel's events as an async stream ([`futures_core::Stream`]); it never ends
    /// (a channel can always get more IDs).
    pub fn events(&self) -> Events {
        Events { chan: self.chan.clone() }
    }

    /// A file descriptor readable exactly while an event waits (for `poll`/`epoll`).
    pub fn fd(&self) -> RawFd {
        self.chan.efd.as_raw_fd()
    }

    /// The next event, if one waits.
    pub fn try_get_event(&self) -> Option<CmEvent> {
        let mut q = lock(&self.chan.queue);
        let ev = q.pop_front();
        if q.is_empty() {
            self.chan.efd.drain();
        }
        ev
    }

    /// The next event, waiting as long as it takes.
    pub fn get_event(&self) -> CmEvent {
        loop {
            if let Some(ev) = self.get_event_timeout(Duration::from_secs(3600)) {
                return ev;
            }
        }
    }

    /// The next event, waiting at most `timeout`.
    pub fn get_event_timeout(&self, timeout: Duration) -> Option<CmEvent> {
        let deadline = Instant::now() + timeout;
        let mut q = lock(&self.chan.queue);
        loop {
            if let Some(ev) = q.pop_front() {
                if q.is_empty() {
                    self.chan.efd.drain();
                }
                return Some(ev);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            q = self.chan.cond.wait_timeout(q, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// The future of [`EventChannel::next_event`].
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct NextEvent<'a> {
    chan: &'a Chan,
}

impl Future for NextEvent<'_> {
    type Output = CmEvent;
    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<CmEvent> {
        self.chan.poll_pop(cx)
    }
}

/// The stream of [`EventChannel::events`].
#[derive(Debug, Clone)]
#[must_use = "streams do nothing unless polled"]
pub struct Events {
    chan: Arc<Chan>,
}

impl futures_core::Stream for Events {
    type Item = CmEvent;
    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<CmEvent>> {
        self.chan.poll_pop(cx).map(Some)
    }
}

// ---- IDs -------------------------------------------------------------------------------

/// Where an ID stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    Bound,
    AddrResolved,
    RouteResolved,
    Listening,
    Connecting,
    /// Passive: the request is the user's to accept or reject.
    Requested,
    Accepting,
    Connected,
    Disconnected,
}

#[derive(Debug)]
struct IdState {
    phase: Phase,
    /// The device (several for a wildcard listener).
    ctxs: Vec<Context>,
    /// Our address and rdma_cm port.
    local: Option<SocketAddr>,
    /// The peer's address and rdma_cm port.
    remote: Option<SocketAddr>,
    comm: Option<CommId>,
    /// The service IDs listened on.
    listening: Option<u64>,
    qp: Option<Arc<QueuePair>>,
    /// The PSN this side's receive queue expects first: its CM message's starting PSN.
    psn: Psn,
    /// Passive: the request.
    req: Option<Box<Req>>,
    /// Passive: the peer's CM messages needed the ID-agnostic ICRC check.
    foreign: bool,
    /// Active: the REP's parameters, reported with ESTABLISHED.
    rep: Option<ConnParam>,
    /// Listener: its connections not yet handed to their own IDs' routes.
    children: HashMap<CommId, Weak<IdInner>>,
    /// The port reserved in the process's table.
    reserved: Option<(IpAddr, u16, u16)>,
    /// The multicast groups joined.
    joined: Vec<IpAddr>,
}

#[derive(Debug)]
struct IdInner {
    /// Where the ID's events go ([`CmId::migrate`] changes it).
    chan: Mutex<Arc<Chan>>,
    ps: PortSpace,
    qp_type: QpType,
    me: Weak<IdInner>,
    st: Mutex<IdState>,
}

/// A CM ID (`rdma_cm_id`): one connection, one listener or one UD endpoint, reporting to
/// its event channel. Clones name the same ID; it is destroyed when the last clone (and
/// the last event naming it) is dropped: a connected ID sends its DREQ then.
#[derive(Debug, Clone)]
pub struct CmId {
    inner: Arc<IdInner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// rdma_cm ports reserved in this process: (address, port space, port).
fn ports() -> &'static Mutex<HashSet<(IpAddr, u16, u16)>> {
    static PORTS: OnceLock<Mutex<HashSet<(IpAddr, u16, u16)>>> = OnceLock::new();
    PORTS.get_or_init(Default::default)
}

/// The devices the CM opened, kept open for the life of the process as rdma_cm keeps its
/// devices: connections come and go, the device (its socket and progress thread) stays.
fn open_cm(ip: IpAddr) -> Result<Context> {
    static OPEN: OnceLock<Mutex<HashMap<IpAddr, Context>>> = OnceLock::new();
    let mut table = lock(OPEN.get_or_init(Default::default));
    if let Some(c) = table.get(&ip) {
        return Ok(c.clone());
    }
    let c = Context::open(ip)?;
    table.insert(ip, c.clone());
    Ok(c)
}

/// Whether a QP of `pd` may be the ID's: the ID has a device, it is `pd`'s, and the ID
/// has no QP yet.
fn check_qp_home(st: &IdState, pd: &ProtectionDomain) -> Result<()> {
    if st.qp.is_some() {
        return Err(Error::CmState("the ID already has a QP"));
    }
    let Some(ctx) = st.ctxs.first() else {
        return Err(Error::CmState("create_qp before the ID has a device"));
    };
    if !Arc::ptr_eq(&ctx.inner, &pd.ctx) {
        return Err(Error::Mismatch);
    }
    Ok(())
}

fn random_u32() -> u32 {
    crate::random_u64() as u32
}

impl CmId {
    /// A new ID reporting to `channel`: RC connections for [`PortSpace::Tcp`] and
    /// [`PortSpace::Ib`], UD for [`PortSpace::Udp`] and [`PortSpace::Ipoib`].
    pub fn new(channel: &EventChannel, ps: PortSpace) -> CmId {
        let qp_type = match ps {
            PortSpace::Tcp | PortSpace::Ib => QpType::Rc,
            PortSpace::Udp | PortSpace::Ipoib => QpType::Ud,
        };
        CmId::with_state(channel.chan.clone(), ps, qp_type, IdState::new())
    }

    fn with_state(chan: Arc<Chan>, ps: PortSpace, qp_type: QpType, st: IdState) -> CmId {
        let inner = Arc::new_cyclic(|me| IdInner {
            chan: Mutex::new(chan),
            ps,
            qp_type,
            me: me.clone(),
            st: Mutex::new(st),
        });
        CmId { inner }
    }

    fn st(&self) -> MutexGuard<'_, IdState> {
        lock(&self.inner.st)
    }

    /// The port space.
    pub fn port_space(&self) -> PortSpace {
        self.inner.ps
    }

    /// The QP type of the ID's connections.
    pub fn qp_type(&self) -> QpType {
        self.inner.qp_type
    }

    /// The device the ID uses (`id->verbs`), once bound or resolved (the first one for a
    /// wildcard listener).
    pub fn context(&self) -> Option<Context> {
        self.st().ctxs.first().cloned()
    }

    /// Our address and rdma_cm port (`rdma_get_local_addr`).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.st().local
    }

    /// The peer's address and rdma_cm port (`rdma_get_peer_addr`).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.st().remote
    }

    /// Moves the ID to another event channel (`rdma_migrate_id`): its later events, and
    /// those of its events still waiting on the old channel, go to `channel`.
    pub fn migrate(&self, channel: &EventChannel) {
        let old = std::mem::replace(&mut *lock(&self.inner.chan), channel.chan.clone());
        if Arc::ptr_eq(&old, &channel.chan) {
            return;
        }
        let moved: Vec<CmEvent> = {
            let mut q = lock(&old.queue);
            let (mine, rest): (VecDeque<_>, VecDeque<_>) = q.drain(..).partition(|e| e.id.same(self));
            *q = rest;
            if q.is_empty() {
                old.efd.drain();
            }
            mine.into()
        };
        for ev in moved {
            channel.chan.push(ev);
        }
    }

    /// The ID's QP, once created.
    pub fn qp(&self) -> Option<Arc<QueuePair>> {
        self.st().qp.clone()
    }

    /// A number naming the ID, unique among live IDs (for tables keyed by ID).
    pub fn key(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Destroys the ID now (`rdma_destroy_id`), whatever handles remain: it stops
    /// listening, ends its connection and frees its port at once, so that the port can be
    /// bound again before the last handle (an event being delivered, say) is dropped.
    /// The remaining handles name an idle ID that can do nothing more.
    pub fn destroy(&self) {
        let (ending, qp) = {
            let mut st = self.st();
            st.phase = Phase::Disconnected;
            (Teardown::take(&mut st), st.qp.take())
        };
        ending.run();
        drop(qp);
    }

    /// Joins the multicast group `group` (`rdma_join_multicast`) on the ID's device, which
    /// `resolve_addr` (to the group, from a source address) or `bind_addr` chose. The ID's
    /// UD QP, if it has one, is attached to the group. Reports MULTICAST_JOIN with the
    /// group's address, QP 0xFFFFFF and Q_Key 0x01234567 in its UD parameters (what a
    /// UD send to the group takes), or MULTICAST_ERROR with the reason (a device whose
    /// MTU is below the group's, [`crate::QueuePair::attach_mcast`]).
    pub fn join_multicast(&self, group: IpAddr) -> Result<()> {
        if self.inner.qp_type != QpType::Ud {
            return Err(Error::CmState("multicast needs a UD ID (PortSpace::Udp or Ipoib)"));
        }
        if !group.is_multicast() {
            return Err(Error::InvalidArgument("not a multicast address"));
        }
        let mut st = self.st();
        let ctx =
            st.ctxs.first().cloned().ok_or(Error::CmState("join_multicast before the ID has a device"))?;
        if st.joined.contains(&group) {
            return Err(Error::CmState("the ID already joined the group"));
        }
        let attached = match &st.qp {
            Some(qp) => qp.attach_mcast(group).map(|_| ()),
            None => Ok(()),
        };
        let (kind, status, ud) = match attached {
            Ok(()) => {
                st.joined.push(group);
                let addr = SocketAddr::new(group, ctx.local_addr().port());
                (CmEventKind::MulticastJoin, 0, Some(UdParam { qpn: Qpn::MULTICAST, qkey: UDP_QKEY, addr }))
            }
            // The error event names the group too.
            Err(e) => {
                let addr = SocketAddr::new(group, ctx.local_addr().port());
                (
                    CmEventKind::MulticastError,
                    -e.errno(),
                    Some(UdParam { qpn: Qpn::new(0), qkey: UDP_QKEY, addr }),
                )
            }
        };
        drop(st);
        self.post_ud(kind, status, ud);
        Ok(())
    }

    /// Leaves a group joined with [`Self::join_multicast`] (`rdma_leave_multicast`): the
    /// ID's QP is detached; no event.
    pub fn leave_multicast(&self, group: IpAddr) -> Result<()> {
        let mut st = self.st();
        let at = st
            .joined
            .iter()
            .position(|g| *g == group)
            .ok_or(Error::CmState("the ID did not join the group"))?;
        if let Some(qp) = &st.qp {
            if qp.mcast_groups().contains(&group) {
                qp.detach_mcast(group)?;
            }
        }
        st.joined.remove(at);
        Ok(())
    }

    /// The multicast groups the ID joined.
    pub fn multicast_groups(&self) -> Vec<IpAddr> {
        self.st().joined.clone()
    }

    /// Whether two handles name the same ID.
    pub fn same(&self, other: &CmId) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Binds a local address and rdma_cm port (`rdma_bind_addr`); port 0 picks one. A
    /// wildcard address (0.0.0.0, ::) binds every device, for [`Self::listen`].
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<()> {
        let mut st = self.st();
        if st.phase != Phase::Idle {
            return Err(Error::CmState("the ID is already bound"));
        }
        let ctxs = if addr.ip().is_unspecified() { open_all(addr.ip())? } else { vec![open_cm(addr.ip())?] };
        let port = reserve(&mut st, addr.ip(), self.inner.ps, addr.port())?;
        st.ctxs = ctxs;
        st.local = Some(SocketAddr::new(addr.ip(), port));
        st.phase = Phase::Bound;
        Ok(())
    }

    /// Resolves `dst` to a device and a source address (`rdma_resolve_addr`): the ID's
    /// bound address, `src` if given, or the route's source address. Reports
    /// ADDR_RESOLVED or ADDR_ERROR on the channel.
    pub fn resolve_addr(&self, src: Option<IpAddr>, dst: SocketAddr, _timeout: Duration) -> Result<()> {
        let mut st = self.st();
        if !matches!(st.phase, Phase::Idle | Phase::Bound | Phase::AddrResolved) {
            return Err(Error::CmState("resolve_addr after connect or listen"));
        }
        let result = (|| -> Result<(Context, IpAddr)> {
            if let (Phase::Bound | Phase::AddrResolved, Some(l)) = (st.phase, st.local) {
                if !l.ip().is_unspecified() {
                    return Ok((st.ctxs[0].clone(), l.ip()));
                }
            }
            match src {
                Some(s) if !s.is_unspecified() => Ok((open_cm(s)?, s)),
                _ => open_route_source(dst.ip()),
            }
        })();
        let (kind, status) = match result {
            Ok((ctx, ip)) => {
                if st.reserved.is_none() {
                    let port = reserve(&mut st, ip, self.inner.ps, 0)?;
                    st.local = Some(SocketAddr::new(ip, port));
                } else if let Some(l) = st.local.as_mut() {
                    l.set_ip(ip);
                }
                st.ctxs = vec![ctx];
                st.remote = Some(dst);
                st.phase = Phase::AddrResolved;
                (CmEventKind::AddrResolved, 0)
            }
            Err(e) => (CmEventKind::AddrError, -e.errno()),
        };
        drop(st);
        self.post(kind, status);
        Ok(())
    }

    /// Resolves the route (`rdma_resolve_route`): on RoCE the address is the route;
    /// reports ROUTE_RESOLVED.
    pub fn resolve_route(&self, _timeout: Duration) -> Result<()> {
        let mut st = self.st();
        if st.phase != Phase::AddrResolved {
            return Err(Error::CmState("resolve_route before ADDR_RESOLVED"));
        }
        st.phase = Phase::RouteResolved;
        drop(st);
        self.post(CmEventKind::RouteResolved, 0);
        Ok(())
    }

    fn post(&self, kind: CmEventKind, status: i32) {
        self.post_ud(kind, status, None);
    }

    fn post_ud(&self, kind: CmEventKind, status: i32, ud: Option<UdParam>) {
        self.inner.chan().push(CmEvent {
            kind,
            id: self.clone(),
            listen_id: None,
            status,
            param: ConnParam::default(),
            ud,
        });
    }

    /// Creates the ID's QP on its device (`rdma_create_qp`) and moves it to INIT (RC) or
    /// straight to RTS (UD, with Q_Key 0x01234567): the CM moves an RC QP on.
    pub fn create_qp(
        &self,
        pd: &ProtectionDomain,
        builder: &QpBuilder,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> Result<Arc<QueuePair>> {
        if builder.qp_type() != self.inner.qp_type {
            return Err(Error::InvalidArgument("the QP type does not fit the ID's port space"));
        }
        check_qp_home(&self.st(), pd)?;
        let qp = Arc::new(pd.create_qp(builder, send_cq, recv_cq)?);
        self.attach_qp(qp.clone())?;
        Ok(qp)
    }

    /// Makes `qp`, a new QP in the RESET state on the ID's device, the ID's QP, and moves
    /// it as [`Self::create_qp`] does. For callers that create QPs themselves (the C
    /// library's `rdma_create_qp`).
    pub fn attach_qp(&self, qp: Arc<QueuePair>) -> Result<()> {
        if qp.qp_type() != self.inner.qp_type {
            return Err(Error::InvalidArgument("the QP type does not fit the ID's port space"));
        }
        let mut st = self.st();
        check_qp_home(&st, qp.pd())?;
        let init =
            QpAttr { state: Some(QpState::Init), pkey_index: Some(0), port: Some(1), ..Default::default() };
        if self.inner.qp_type == QpType::Ud {
            qp.modify(&QpAttr { qkey: Some(UDP_QKEY), ..init })?;
            qp.modify(&QpAttr { state: Some(QpState::Rtr), ..Default::default() })?;
            qp.modify(&QpAttr { state: Some(QpState::Rts), sq_psn: Some(st.psn), ..Default::default() })?;
            qp.set_foreign_peer(st.foreign);
        } else {
            qp.modify(&QpAttr { access_flags: Some(Access::NONE), ..init })?;
        }
        st.qp = Some(qp);
        Ok(())
    }

    /// Destroys the ID's QP (`rdma_destroy_qp`); it goes when its last handle does.
    pub fn destroy_qp(&self) {
        self.st().qp = None;
    }

    /// Listens for connection requests (`rdma_listen`); at most `backlog` wait for
    /// [`Self::accept`] or [`Self::reject`] at once. An unbound ID listens on an
    /// ephemeral port of every device.
    pub fn listen(&self, backlog: usize) -> Result<()> {
        if self.st().phase == Phase::Idle {
            let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
            self.bind_addr(any)?;
        }
        let (ctxs, port) = {
            let st = self.st();
            if st.phase != Phase::Bound {
                return Err(Error::CmState("listen needs a bound ID"));
            }
            (st.ctxs.clone(), st.local.map_or(0, |l| l.port()))
        };
        let sid = softrdma_proto::cm::service_id(self.inner.ps, port);
        let me: Weak<dyn CmSink> = self.inner.me.clone();
        // No lock on the ID across engine calls: they hand out events, some maybe to it.
        for (i, ctx) in ctxs.iter().enumerate() {
            enable_cm(ctx);
            if let Err(e) = ctx.inner.engine.cm_listen(sid, backlog, me.clone()) {
                for c in &ctxs[..i] {
                    c.inner.engine.cm_unlisten(sid);
                }
                return Err(e);
            }
        }
        let mut st = self.st();
        st.listening = Some(sid);
        st.phase = Phase::Listening;
        Ok(())
    }

    /// Connects (`rdma_connect`): RC sends a REQ (the QP, if the ID has one, is readied
    /// when the REP comes, then ESTABLISHED is reported); UD sends a SIDR_REQ (ESTABLISHED
    /// carries the peer's QP and Q_Key).
    pub fn connect(&self, param: &ConnParam) -> Result<()> {
        let mut st = self.st();
        if st.phase != Phase::RouteResolved {
            return Err(Error::CmState("connect before ROUTE_RESOLVED"));
        }
        let (Some(local), Some(remote), Some(ctx)) = (st.local, st.remote, st.ctxs.first().cloned()) else {
            return Err(Error::CmState("connect before the addresses are resolved"));
        };
        let header = CmaHeader { src: local, dst: remote.ip() };
        let sid = softrdma_proto::cm::service_id(self.inner.ps, remote.port());
        let me: Weak<dyn CmSink> = self.inner.me.clone();
        enable_cm(&ctx);
        let engine = &ctx.inner.engine;
        if self.inner.qp_type == QpType::Ud {
            let data = header
                .with_user_data(&param.private_data, softrdma_proto::cm::SidrReq::PRIVATE_DATA_LEN)
                .ok_or(Error::InvalidArgument("private data too long or mixed address families"))?;
            st.phase = Phase::Connecting;
            drop(st);
            let comm = engine.cm_sidr_request(remote.ip(), sid, &data, me)?;
            self.st().comm = Some(comm);
            return Ok(());
        }
        let data = header
            .with_user_data(&param.private_data, Req::PRIVATE_DATA_LEN)
            .ok_or(Error::InvalidArgument("private data too long (56 bytes) or mixed address families"))?;
        let mtu = ctx.device().active_mtu();
        let offer = Offer {
            psn: st.psn,
            mtu,
            responder_resources: param.responder_resources.min(crate::MAX_QP_RD_ATOM),
            initiator_depth: param.initiator_depth.min(crate::MAX_QP_RD_ATOM),
            retry_count: param.retry_count.min(7),
            rnr_retry_count: param.rnr_retry_count.min(7),
            ack_timeout: ACK_TIMEOUT,
        };
        let qpn = st.qp.as_ref().map_or(param.qp_num, |q| q.qpn().get());
        let req = Req {
            local_comm_id: 0,
            ece_vendor_id: SOFTRDMA_ECE,
            service_id: sid,
            local_ca_guid: 0,
            local_qkey: 0,
            local_qpn: qpn,
            responder_resources: offer.responder_resources,
            initiator_depth: offer.initiator_depth,
            remote_cm_response_timeout: 0,
            transport_type: 0,
            e2e_flow_control: param.flow_control,
            starting_psn: st.psn.get(),
            local_cm_response_timeout: 0,
            retry_count: offer.retry_count,
            pkey: 0xFFFF,
            path_mtu: mtu as u8,
            rdc_exists: false,
            rnr_retry_count: offer.rnr_retry_count,
            max_cm_retries: 0,
            srq: param.srq || st.qp.as_ref().is_some_and(|q| q.has_srq()),
            extended_transport_type: 0,
            primary_path: path(local.ip(), remote.ip()),
            alternate_path: None,
            private_data: data,
        };
        let active = st.qp.as_ref().map(|q| ActiveQp { qpn: q.qpn(), req: offer });
        st.phase = Phase::Connecting;
        drop(st);
        match engine.cm_connect(remote.ip(), req, me, active) {
            Ok(comm) => {
                self.st().comm = Some(comm);
                Ok(())
            }
            Err(e) => {
                self.st().phase = Phase::RouteResolved;
                Err(e)
            }
        }
    }

    /// Accepts a connection request (`rdma_accept`): moves the ID's QP to RTR and RTS and
    /// sends the REP (ESTABLISHED follows with the RTU); UD answers the SIDR_REQ with the
    /// ID's QP.
    pub fn accept(&self, param: &ConnParam) -> Result<()> {
        let mut st = self.st();
        if st.phase != Phase::Requested {
            return Err(Error::CmState("accept without a connection request"));
        }
        let (Some(comm), Some(ctx), Some(remote)) = (st.comm, st.ctxs.first().cloned(), st.remote) else {
            return Err(Error::CmState("accept without a connection request"));
        };
        let engine = &ctx.inner.engine;
        let qpn = st.qp.as_ref().map_or(param.qp_num, |q| q.qpn().get());
        if self.inner.qp_type == QpType::Ud {
            st.phase = Phase::Connected;
            drop(st);
            return engine.cm_sidr_reply(comm, 0, qpn, UDP_QKEY.0, &param.private_data);
        }
        let Some(req) = st.req.clone() else { return Err(Error::CmState("accept without a request")) };
        let mut mtu = ctx.device().active_mtu();
        if let Some(theirs) = Mtu::from_enum(req.path_mtu) {
            mtu = mtu.min(theirs);
        }
        let ours = Offer {
            psn: st.psn,
            mtu,
            responder_resources: param.responder_resources.min(crate::MAX_QP_RD_ATOM),
            initiator_depth: param.initiator_depth.min(crate::MAX_QP_RD_ATOM),
            retry_count: req.retry_count,
            rnr_retry_count: param.rnr_retry_count.min(7),
            ack_timeout: req.primary_path.local_ack_timeout,
        };
        let rep = Rep {
            local_comm_id: 0,
            remote_comm_id: 0,
            local_qkey: 0,
            local_qpn: qpn,
            local_eecn: 0,
            starting_psn: st.psn.get(),
            // Answered only to a peer that announced itself.
            ece_vendor_id: if req.ece_vendor_id == SOFTRDMA_ECE { SOFTRDMA_ECE_REPLY } else { 0 },
            responder_resources: ours.responder_resources,
            initiator_depth: ours.initiator_depth,
            target_ack_delay: 15,
            failover_accepted: 0,
            e2e_flow_control: param.flow_control,
            rnr_retry_count: ours.rnr_retry_count,
            srq: param.srq || st.qp.as_ref().is_some_and(|q| q.has_srq()),
            local_ca_guid: 0,
            private_data: param.private_data.clone(),
        };
        let peer = SocketAddr::new(remote.ip(), ctx.local_addr().port());
        let qp = st.qp.as_ref().map(|q| (q.qpn(), passive_attrs(&ours, &req, peer), st.foreign));
        st.phase = Phase::Accepting;
        drop(st);
        let r = engine.cm_accept(comm, rep, qp);
        if r.is_err() {
            self.st().phase = Phase::Requested;
        }
        r
    }

    /// Refuses a connection request with private data (`rdma_reject`: REJ reason 28,
    /// consumer defined; UD: SIDR_REP status 1).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let mut st = self.st();
        let (Phase::Requested, Some(comm), Some(ctx)) = (st.phase, st.comm, st.ctxs.first().cloned()) else {
            return Err(Error::CmState("reject without a connection request"));
        };
        st.phase = Phase::Disconnected;
        st.comm = None;
        drop(st);
        if self.inner.qp_type == QpType::Ud {
            ctx.inner.engine.cm_sidr_reply(comm, 1, 0, 0, private_data)
        } else {
            let reason = softrdma_proto::cm::RejReason::ConsumerDefined as u16;
            ctx.inner.engine.cm_reject(comm, reason, private_data)
        }
    }

    /// Active without a QP: answers CONNECT_RESPONSE with the RTU; passive: the
    /// connection is in use before the RTU came (`rdma_establish`).
    pub fn establish(&self) -> Result<()> {
        let st = self.st();
        let (Some(comm), Some(ctx)) = (st.comm, st.ctxs.first().cloned()) else {
            return Err(Error::CmState("establish without a connection"));
        };
        let phase = st.phase;
        drop(st);
        match phase {
            Phase::Connecting => ctx.inner.engine.cm_rtu(comm),
            Phase::Accepting => ctx.inner.engine.cm_establish(comm),
            _ => Err(Error::CmState("establish without a connection being set up")),
        }
    }

    /// Disconnects (`rdma_disconnect`): the QP goes to the error state (its work
    /// requests flush) and a DREQ is sent; both sides see DISCONNECTED. Calling it on a
    /// connection the peer already closed does nothing.
    pub fn disconnect(&self) -> Result<()> {
        let st = self.st();
        let (Some(comm), Some(ctx)) = (st.comm, st.ctxs.first().cloned()) else {
            return Err(Error::CmState("disconnect without a connection"));
        };
        let qpn = st.qp.as_ref().map(|q| q.qpn());
        drop(st);
        ctx.inner.engine.cm_disconnect(comm, qpn)
    }
}

impl IdState {
    fn new() -> IdState {
        IdState {
            phase: Phase::Idle,
            ctxs: Vec::new(),
            local: None,
            remote: None,
            comm: None,
            listening: None,
            qp: None,
            psn: Psn::new(random_u32()),
            req: None,
            foreign: false,
            rep: None,
            children: HashMap::new(),
            reserved: None,
            joined: Vec::new(),
        }
    }
}

/// Reserves an rdma_cm port of `ps` on `ip` for the ID; 0 picks a free ephemeral one.
fn reserve(st: &mut IdState, ip: IpAddr, ps: PortSpace, port: u16) -> Result<u16> {
    let mut table = lock(ports());
    let key = |p: u16| (ip, ps.value(), p);
    let port = if port != 0 {
        let taken = |q| table.contains(&key(q)) || table.contains(&(unspecified(ip), ps.value(), q));
        if taken(port) {
            return Err(Error::Cm(softrdma_proto::cm::CmError::InUse));
        }
        port
    } else {
        let start = 32768 + (random_u32() % 28000) as u16;
        (0..28000u16)
            .map(|i| 32768 + (start - 32768 + i) % 28000)
            .find(|&q| !table.contains(&key(q)))
            .ok_or(Error::Limit("rdma_cm ports"))?
    };
    table.insert(key(port));
    if let Some(old) = st.reserved.replace(key(port)) {
        table.remove(&old);
    }
    Ok(port)
}

fn unspecified(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// The route's source address towards `dst` and its device; on loopback, the next free
/// loopback address if another process uses the route's.
fn open_route_source(dst: IpAddr) -> Result<(Context, IpAddr)> {
    let any = unspecified(dst);
    let sock = UdpSocket::bind(SocketAddr::new(any, 0))?;
    sock.connect(SocketAddr::new(dst, 4791))?;
    let src = sock.local_addr()?.ip();
    match open_cm(src) {
        Ok(ctx) => Ok((ctx, src)),
        Err(Error::AddressInUse { .. }) if src.is_loopback() && src.is_ipv4() => {
            for last in 1..=254u8 {
                let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, last));
                if ip == src || ip == dst {
                    continue;
                }
                if let Ok(ctx) = open_cm(ip) {
                    return Ok((ctx, ip));
                }
            }
            Err(Error::AddressInUse { addr: SocketAddr::new(src, crate::default_port()) })
        }
        Err(e) => Err(e),
    }
}

/// A context on every address of every device of `family`'s kind that opens.
fn open_all(family: IpAddr) -> Result<Vec<Context>> {
    let mut addrs: Vec<IpAddr> =
        crate::devices()?.iter().flat_map(|d| d.gids.iter().map(|g| g.addr)).collect();
    addrs.extend(crate::bind_env());
    let mut out: Vec<Context> = Vec::new();
    for a in addrs {
        if a.is_ipv4() != family.is_ipv4() {
            continue;
        }
        if let Ok(ctx) = open_cm(a) {
            if !out.iter().any(|c| Arc::ptr_eq(&c.inner, &ctx.inner)) {
                out.push(ctx);
            }
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidArgument("no device address could be opened for a wildcard bind"));
    }
    Ok(out)
}

fn enable_cm(ctx: &Context) {
    let guid = ctx.device().node_guid;
    ctx.inner.engine.cm_enable(|| CmConfig {
        ca_guid: guid,
        seed: crate::random_u64(),
        ..CmConfig::default()
    });
}

/// The REQ's primary path: RoCE GIDs, hop limit 64 as rdma_cm fills it.
fn path(local: IpAddr, remote: IpAddr) -> CmPath {
    CmPath {
        local_gid: crate::gid_of(local),
        remote_gid: crate::gid_of(remote),
        local_lid: 0xFFFF,
        remote_lid: 0xFFFF,
        hop_limit: 64,
        packet_rate: 0x10,
        subnet_local: true,
        local_ack_timeout: ACK_TIMEOUT + 1,
        ..CmPath::default()
    }
}

// ---- QP attributes ---------------------------------------------------------------------

/// What one side offers for a connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Offer {
    pub(crate) psn: Psn,
    pub(crate) mtu: Mtu,
    pub(crate) responder_resources: u8,
    pub(crate) initiator_depth: u8,
    pub(crate) retry_count: u8,
    pub(crate) rnr_retry_count: u8,
    pub(crate) ack_timeout: u8,
}

/// Remote access as the CM grants it: WRITE, plus READ and atomics with responder
/// resources.
fn access(responder_resources: u8) -> Access {
    if responder_resources > 0 {
        Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
    } else {
        Access::REMOTE_WRITE
    }
}

#[allow(clippy::too_many_arguments)]
fn rtr_rts(
    peer: SocketAddr,
    dest_qpn: u32,
    rq_psn: Psn,
    sq_psn: u32,
    mtu: Mtu,
    max_dest_rd_atomic: u8,
    max_rd_atomic: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
) -> [QpAttr; 2] {
    let rtr = QpAttr {
        state: Some(QpState::Rtr),
        access_flags: Some(access(max_dest_rd_atomic)),
        path_mtu: Some(mtu),
        remote: Some(crate::sys::canonical(peer)),
        dest_qpn: Some(Qpn::new(dest_qpn & softrdma_proto::MASK_24)),
        rq_psn: Some(rq_psn),
        max_dest_rd_atomic: Some(max_dest_rd_atomic),
        min_rnr_timer: Some(12),
        ..Default::default()
    };
    let rts = QpAttr {
        state: Some(QpState::Rts),
        sq_psn: Some(Psn::new(sq_psn)),
        timeout: Some(timeout.min(31)),
        retry_cnt: Some(retry_cnt.min(7)),
        rnr_retry: Some(rnr_retry.min(7)),
        max_rd_atomic: Some(max_rd_atomic),
        ..Default::default()
    };
    [rtr, rts]
}

/// A CM message's starting PSN is the PSN its sender's receive queue expects first (as
/// Linux's CM reads it): each side sends from the other's and receives from its own.
///
/// The active side's RTR and RTS when the REP comes: the peer's QP and PSN; READs it may
/// send us are what it initiates, READs we may send are its responder resources; RNR
/// retries are the REP's.
pub(crate) fn active_attrs(ours: &Offer, rep: &Rep, peer: SocketAddr) -> [QpAttr; 2] {
    rtr_rts(
        peer,
        rep.local_qpn,
        ours.psn,
        rep.starting_psn,
        ours.mtu,
        rep.initiator_depth.min(ours.responder_resources.max(1)).min(crate::MAX_QP_RD_ATOM),
        rep.responder_resources.min(crate::MAX_QP_RD_ATOM),
        ours.ack_timeout,
        ours.retry_count,
        rep.rnr_retry_count,
    )
}

/// The passive side's RTR and RTS at accept: the REQ's QP, PSN and retry count, the
/// accept's resources.
fn passive_attrs(ours: &Offer, req: &Req, peer: SocketAddr) -> [QpAttr; 2] {
    rtr_rts(
        peer,
        req.local_qpn,
        ours.psn,
        req.starting_psn,
        ours.mtu,
        ours.responder_resources,
        ours.initiator_depth.min(req.responder_resources),
        ours.ack_timeout.max(1),
        req.retry_count,
        req.rnr_retry_count,
    )
}

// ---- Events from the engine ------------------------------------------------------------

impl CmSink for IdInner {
    fn cm_event(&self, ev: AgentEvent, foreign: bool) {
        let Some(me) = self.me.upgrade() else { return };
        let id = CmId { inner: me };
        match ev {
            AgentEvent::ConnectRequest { id: comm, peer, req } => {
                let header = CmaHeader::parse(&req.private_data);
                id.on_request(comm, peer, header, param_of_req(&req), Some(req), foreign)
            }
            AgentEvent::SidrRequest { id: comm, peer, req } => {
                let header = CmaHeader::parse(&req.private_data);
                let data = req.private_data.get(CmaHeader::LEN..).unwrap_or_default().to_vec();
                let param = ConnParam { private_data: data, ..ConnParam::default() };
                id.on_request(comm, peer, header, param, None, foreign)
            }
            ev => {
                // A connection a listener has not handed over yet goes to its own ID.
                let comm = ev.id();
                let child = {
                    let st = self.st_lock();
                    if st.comm == Some(comm) {
                        None
                    } else {
                        st.children.get(&comm).and_then(Weak::upgrade)
                    }
                };
                match child {
                    Some(c) => CmId { inner: c }.on_connection_event(ev),
                    None => id.on_connection_event(ev),
                }
            }
        }
    }
}

impl IdInner {
    fn chan(&self) -> Arc<Chan> {
        lock(&self.chan).clone()
    }

    fn st_lock(&self) -> MutexGuard<'_, IdState> {
        lock(&self.st)
    }
}

fn param_of_req(req: &Req) -> ConnParam {
    ConnParam {
        private_data: req.private_data.get(CmaHeader::LEN..).unwrap_or_default().to_vec(),
        responder_resources: req.responder_resources,
        initiator_depth: req.initiator_depth,
        flow_control: req.e2e_flow_control,
        retry_count: req.retry_count,
        rnr_retry_count: req.rnr_retry_count,
        srq: req.srq,
        qp_num: req.local_qpn,
    }
}

fn param_of_rep(rep: &Rep) -> ConnParam {
    ConnParam {
        private_data: rep.private_data.clone(),
        responder_resources: rep.responder_resources,
        initiator_depth: rep.initiator_depth,
        flow_control: rep.e2e_flow_control,
        retry_count: 0,
        rnr_retry_count: rep.rnr_retry_count,
        srq: rep.srq,
        qp_num: rep.local_qpn,
    }
}

impl CmId {
    /// A listener's new connection: a new ID on the device it came to, reported with
    /// CONNECT_REQUEST. `header` is rdma_cm's (absent when the peer is not rdma_cm).
    fn on_request(
        &self,
        comm: CommId,
        peer: IpAddr,
        header: Option<CmaHeader>,
        param: ConnParam,
        req: Option<Box<Req>>,
        foreign: bool,
    ) {
        let (ctx, local_port) = {
            let st = self.st();
            // The device the request came to: the header's destination, else the first.
            let ctx = header
                .and_then(|h| st.ctxs.iter().find(|c| c.local_addr().ip() == h.dst).cloned())
                .or_else(|| st.ctxs.first().cloned());
            (ctx, st.local.map_or(0, |l| l.port()))
        };
        let Some(ctx) = ctx else { return };
        let mut st = IdState::new();
        st.phase = Phase::Requested;
        st.ctxs = vec![ctx.clone()];
        st.local = Some(SocketAddr::new(ctx.local_addr().ip(), local_port));
        st.remote = Some(SocketAddr::new(peer, header.map_or(0, |h| h.src.port())));
        st.comm = Some(comm);
        st.foreign = foreign;
        st.req = req;
        let child = CmId::with_state(self.inner.chan(), self.inner.ps, self.inner.qp_type, st);
        {
            let mut st = self.st();
            st.children.retain(|_, w| w.strong_count() > 0);
            st.children.insert(comm, Arc::downgrade(&child.inner));
        }
        let sink: Weak<dyn CmSink> = child.inner.me.clone();
        ctx.inner.engine.cm_set_sink(comm, sink);
        self.inner.chan().push(CmEvent {
            kind: CmEventKind::ConnectRequest,
            id: child,
            listen_id: Some(self.clone()),
            status: 0,
            param,
            ud: None,
        });
    }

    /// An event about the ID's own connection.
    fn on_connection_event(&self, ev: AgentEvent) {
        let mut st = self.st();
        let (kind, status, param, ud) = match ev {
            AgentEvent::ConnectResponse { rep, .. } => {
                let p = param_of_rep(&rep);
                if st.qp.is_some() {
                    // The engine readied the QP and sent the RTU: ESTABLISHED follows.
                    st.rep = Some(p);
                    return;
                }
                (CmEventKind::ConnectResponse, 0, p, None)
            }
            AgentEvent::Established { .. } => {
                st.phase = Phase::Connected;
                (CmEventKind::Established, 0, st.rep.take().unwrap_or_default(), None)
            }
            AgentEvent::Rejected { reason, private_data, .. } => {
                st.phase = Phase::Disconnected;
                st.comm = None;
                let p = ConnParam { private_data, ..ConnParam::default() };
                (CmEventKind::Rejected, i32::from(reason), p, None)
            }
            AgentEvent::Unreachable { .. } => {
                st.phase = Phase::Disconnected;
                st.comm = None;
                (CmEventKind::Unreachable, -libc::ETIMEDOUT, ConnParam::default(), None)
            }
            AgentEvent::Disconnected { .. } => {
                st.phase = Phase::Disconnected;
                (CmEventKind::Disconnected, 0, ConnParam::default(), None)
            }
            AgentEvent::TimewaitExit { .. } => {
                st.comm = None;
                (CmEventKind::TimewaitExit, 0, ConnParam::default(), None)
            }
            AgentEvent::SidrResponse { rep, .. } => {
                st.comm = None;
                let SidrRep { status, qpn, qkey, ref private_data, .. } = *rep;
                if status != 0 {
                    st.phase = Phase::Disconnected;
                    (CmEventKind::Unreachable, i32::from(status), ConnParam::default(), None)
                } else {
                    st.phase = Phase::Connected;
                    let remote = st.remote.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |r| r.ip());
                    let port = st.ctxs.first().map_or(crate::default_port(), |c| c.local_addr().port());
                    if let (Some(ctx), Some(qp)) = (st.ctxs.first(), st.qp.as_ref()) {
                        if ctx.inner.engine.peer_is_foreign(remote) {
                            qp.set_foreign_peer(true);
                        }
                    }
                    let ud = UdParam {
                        qpn: Qpn::new(qpn & softrdma_proto::MASK_24),
                        qkey: Qkey(qkey),
                        addr: SocketAddr::new(remote, port),
                    };
                    let p = ConnParam { private_data: private_data.clone(), ..ConnParam::default() };
                    (CmEventKind::Established, 0, p, Some(ud))
                }
            }
            AgentEvent::ConnectRequest { .. } | AgentEvent::SidrRequest { .. } => return,
        };
        drop(st);
        self.inner.chan().push(CmEvent { kind, id: self.clone(), listen_id: None, status, param, ud });
    }
}

impl Drop for IdInner {
    fn drop(&mut self) {
        teardown(self.st.get_mut().unwrap_or_else(|p| p.into_inner()));
    }
}

/// Ends what an ID holds: its listens, its connection (a DREQ, or a REJ for a request not
/// answered) and its port.
fn teardown(st: &mut IdState) {
    Teardown::take(st).run();
}

/// What [`teardown`] ends, taken out of the ID's state so that the engine is called with
/// the ID unlocked (the engine hands out events, maybe to this ID).
struct Teardown {
    listening: Option<u64>,
    comm: Option<CommId>,
    ctxs: Vec<Context>,
    reserved: Option<(IpAddr, u16, u16)>,
}

impl Teardown {
    fn take(st: &mut IdState) -> Teardown {
        Teardown {
            listening: st.listening.take(),
            comm: st.comm.take(),
            ctxs: st.ctxs.clone(),
            reserved: st.reserved.take(),
        }
    }

    fn run(self) {
        if let Some(sid) = self.listening {
            for c in &self.ctxs {
                c.inner.engine.cm_unlisten(sid);
            }
        }
        if let (Some(comm), Some(ctx)) = (self.comm, self.ctxs.first()) {
            ctx.inner.engine.cm_destroy(comm);
        }
        if let Some(key) = self.reserved {
            lock(ports()).remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(psn: u32) -> Offer {
        Offer {
            psn: Psn::new(psn),
            mtu: Mtu::Mtu1024,
            responder_resources: 2,
            initiator_depth: 3,
            retry_count: 6,
            rnr_retry_count: 5,
            ack_timeout: 14,
        }
    }

    /// Linux rxe expects an active side to send from the REP's starting PSN (found in
    /// the lab: a REQ's PSN used as the send PSN draws PSN sequence NAKs).
    #[test]
    fn each_side_sends_from_the_peers_starting_psn_and_receives_from_its_own() {
        let peer = SocketAddr::from(([10, 0, 0, 2], 4791));
        let rep = Rep {
            local_comm_id: 1,
            remote_comm_id: 2,
            local_qkey: 0,
            local_qpn: 0x22,
            local_eecn: 0,
            starting_psn: 0xBBBB,
            ece_vendor_id: 0,
            responder_resources: 4,
            initiator_depth: 1,
            target_ack_delay: 0,
            failover_accepted: 0,
            e2e_flow_control: false,
            rnr_retry_count: 3,
            srq: false,
            local_ca_guid: 0,
            private_data: Vec::new(),
        };
        let [rtr, rts] = active_attrs(&offer(0xAAAA), &rep, peer);
        assert_eq!((rtr.rq_psn, rts.sq_psn), (Some(Psn::new(0xAAAA)), Some(Psn::new(0xBBBB))));
        assert_eq!((rtr.dest_qpn, rts.rnr_retry, rts.retry_cnt), (Some(Qpn::new(0x22)), Some(3), Some(6)));
        assert_eq!((rtr.max_dest_rd_atomic, rts.max_rd_atomic), (Some(1), Some(4)));

        let mut req = Req {
            local_comm_id: 1,
            ece_vendor_id: 0,
            service_id: 0,
            local_ca_guid: 0,
            local_qkey: 0,
            local_qpn: 0x33,
            responder_resources: 2,
            initiator_depth: 2,
            remote_cm_response_timeout: 0,
            transport_type: 0,
            e2e_flow_control: false,
            starting_psn: 0xCCCC,
            local_cm_response_timeout: 0,
            retry_count: 4,
            pkey: 0xFFFF,
            path_mtu: 3,
            rdc_exists: false,
            rnr_retry_count: 2,
            max_cm_retries: 0,
            srq: false,
            extended_transport_type: 0,
            primary_path: CmPath::default(),
            alternate_path: None,
            private_data: Vec::new(),
        };
        req.primary_path.local_ack_timeout = 15;
        let [rtr, rts] = passive_attrs(&offer(0xDDDD), &req, peer);
        assert_eq!((rtr.rq_psn, rts.sq_psn), (Some(Psn::new(0xDDDD)), Some(Psn::new(0xCCCC))));
        assert_eq!((rts.retry_cnt, rts.rnr_retry, rts.timeout), (Some(4), Some(2), Some(14)));
        assert_eq!((rtr.max_dest_rd_atomic, rts.max_rd_atomic), (Some(2), Some(2)));
        assert_eq!(
            rtr.access_flags,
            Some(Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC)
        );
    }
}
