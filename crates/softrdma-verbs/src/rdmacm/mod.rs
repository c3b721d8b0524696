//! rdma-core's librdmacm ABI (version nodes RDMACM_1.0 to 1.3) over `softrdma::cm`: event
//! channels, CM IDs, the connection calls and their events, QPs created on IDs, the
//! synchronous IDs of `rdma_create_ep`, and `rdma_getaddrinfo` ([`addrinfo`]).
//!
//! The functions live in `libibverbs.so.1` itself, which also defines librdmacm's version
//! nodes; `librdmacm.so.1` is a symbolic link to it. The dynamic loader maps one file
//! once, whichever name a program asks for, so the CM's devices, PDs and QPs are the very
//! objects the program's verbs calls see.
//!
//! As in rdma-core:
//! - each C object is a Rust structure whose first field is the C structure programs read
//!   (`rdma_cm_id` is read directly by `rdma_verbs.h`'s inline functions);
//! - an ID created without a channel is synchronous: it gets a private channel, and each
//!   call that completes with an event waits for it, keeping it in `id->event`;
//! - the devices the CM opens stay open, each with one default PD, for the life of the
//!   process; `rdma_create_qp` makes a separate send and receive CQ, each with its own
//!   completion channel and the ID as its context, when the caller gives none;
//! - events own their private data until `rdma_ack_cm_event`; an ID destroyed with events
//!   still unacknowledged is freed at the last acknowledgement instead of waiting.
//!
//! - multicast: `rdma_join_multicast` attaches the ID's QP and reports MULTICAST_JOIN,
//!   whose private data is the join's context (as librdmacm's); a send-only join
//!   (`rdma_join_multicast_ex`, flags 1) is a full join.
//!
//! Not provided: `RDMA_OPTION_IB_PATH`,
//! rsockets (the `r*` calls exist, since programs import them, and fail with ENOSYS;
//! `rpoll` and `rselect` pass through to `poll` and `select`). `RDMA_OPTION_ID_TOS` and
//! `RDMA_OPTION_ID_ACK_TIMEOUT` are accepted and recorded; the connection manager does
//! not yet apply them.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_void};
use std::net::{IpAddr, SocketAddr};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use softrdma::cm::{CmEvent, CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use softrdma::{gid_of, Context, QpType};

use crate::abi::*;
use crate::{guard, nonblocking, set_errno, Ctx};

pub mod addrinfo;
pub mod rsocket;
pub mod stubs;

// ---- Shared state -----------------------------------------------------------------------

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The C IDs by their runtime ID ([`CmId::key`]), for the events that name them; also the
/// lock under which the C structures of IDs and events are written.
fn ids() -> &'static Mutex<HashMap<usize, usize>> {
    static IDS: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
    IDS.get_or_init(Default::default)
}

/// The IDs and event channels handed out and not destroyed, by address. A call that names
/// one not here (destroyed already, or never ours) fails with EINVAL instead of reading
/// freed memory: Debian's perftest (4.5-0.17) retries a rejected rdma_cm connection
/// through IDs its clean-up destroyed, read from an array it freed; rdma-core's calls then
/// fail on the closed descriptor, and ours must not crash either. (An address reused by a
/// new ID is that ID's: no library can tell the two apart.)
struct Live {
    ids: HashSet<usize>,
    chans: HashSet<usize>,
}

fn live() -> &'static Mutex<Live> {
    static LIVE: OnceLock<Mutex<Live>> = OnceLock::new();
    LIVE.get_or_init(|| Mutex::new(Live { ids: HashSet::new(), chans: HashSet::new() }))
}

/// The ID `id` names, if it is live.
pub(crate) fn live_id<'a>(id: *mut rdma_cm_id) -> Option<&'a mut Id> {
    if id.is_null() || !lock(live()).ids.contains(&(id as usize)) {
        return None;
    }
    // SAFETY: an ID of ours, not destroyed.
    Some(unsafe { id_of(id) })
}

/// The channel `ch` names, if it is live.
fn live_chan<'a>(ch: *mut rdma_event_channel) -> Option<&'a Chan> {
    if ch.is_null() || !lock(live()).chans.contains(&(ch as usize)) {
        return None;
    }
    // SAFETY: a channel of ours, not destroyed.
    Some(unsafe { chan_of(ch) })
}

/// A device the CM opened: its `ibv_context` and default PD, kept for the process's life.
#[derive(Clone, Copy)]
struct Verbs {
    ctx: usize,
    pd: usize,
}

/// The `ibv_context` (and default PD) of a runtime context the CM uses, made on first use.
fn verbs_of(rt: &Context) -> Option<Verbs> {
    static VERBS: OnceLock<Mutex<HashMap<SocketAddr, Verbs>>> = OnceLock::new();
    let mut table = lock(VERBS.get_or_init(Default::default));
    if let Some(v) = table.get(&rt.local_addr()) {
        return Some(*v);
    }
    let dev = crate::device::devices().iter().find(|d| d.desc.name == rt.device().name)?;
    let device = ptr::from_ref(&dev.ibv).cast_mut();
    let foreign = std::env::var(crate::FOREIGN_ENV).is_ok_and(|v| v != "0" && !v.is_empty());
    let ctx = Ctx::open(device, rt.clone(), foreign);
    // SAFETY: a context just opened.
    let pd = unsafe { crate::verbs::ibv_alloc_pd(ctx) };
    let v = Verbs { ctx: ctx as usize, pd: pd as usize };
    table.insert(rt.local_addr(), v);
    Some(v)
}

// ---- Event channels -----------------------------------------------------------------

/// `struct rdma_event_channel` and the runtime channel behind it; `fd` is the runtime's
/// eventfd, readable while an event waits.
#[repr(C)]
struct Chan {
    ibv: rdma_event_channel,
    rt: EventChannel,
}

fn new_chan() -> Option<*mut rdma_event_channel> {
    let rt = EventChannel::new().ok()?;
    let c = Box::new(Chan { ibv: rdma_event_channel { fd: rt.fd() }, rt });
    let ch = Box::into_raw(c).cast();
    lock(live()).chans.insert(ch as usize);
    Some(ch)
}

/// # Safety
/// `ch` came from [`new_chan`] and was not freed.
unsafe fn chan_of<'a>(ch: *mut rdma_event_channel) -> &'a Chan {
    // SAFETY: by the contract.
    unsafe { &*ch.cast::<Chan>() }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    if crate::device::devices().is_empty() {
        set_errno(libc::ENODEV);
        return ptr::null_mut();
    }
    new_chan().unwrap_or_else(|| {
        set_errno(libc::EMFILE);
        ptr::null_mut()
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_event_channel(channel: *mut rdma_event_channel) {
    // A channel destroyed already (or never ours) is left alone.
    if !channel.is_null() && lock(live()).chans.remove(&(channel as usize)) {
        // SAFETY: a channel from rdma_create_event_channel, live until now; its IDs are
        // gone (the caller's duty, as with rdma-core).
        drop(unsafe { Box::from_raw(channel.cast::<Chan>()) });
    }
}

// ---- IDs ----------------------------------------------------------------------------

/// `struct rdma_cm_id` and what the library keeps beside it.
#[repr(C)]
pub(crate) struct Id {
    ibv: rdma_cm_id,
    rt: Option<CmId>,
    /// Synchronous: `ibv.channel` is this ID's own.
    sync: bool,
    /// `rdma_create_ep` on a listener: the QP each request gets.
    qp_init: Option<ibv_qp_init_attr>,
    /// Events handed out and charged to this ID, not yet acknowledged.
    unacked: AtomicUsize,
    destroyed: bool,
    path: ibv_sa_path_rec,
    /// Options recorded by `rdma_set_option`.
    tos: Option<u8>,
    ack_timeout: Option<u8>,
    /// The multicast groups joined, each with the context `rdma_join_multicast` was given
    /// (JOIN events carry it as their private data, as librdmacm's do).
    mcast: Vec<(IpAddr, *mut c_void)>,
}

/// # Safety
/// `id` came from this module and was not freed.
unsafe fn id_of<'a>(id: *mut rdma_cm_id) -> &'a mut Id {
    // SAFETY: by the contract.
    unsafe { &mut *id.cast::<Id>() }
}

fn rt_of(id: &Id) -> Result<&CmId, c_int> {
    id.rt.as_ref().ok_or(libc::EINVAL)
}

fn port_space(ps: c_int) -> Option<PortSpace> {
    Some(match ps {
        RDMA_PS_TCP => PortSpace::Tcp,
        RDMA_PS_UDP => PortSpace::Udp,
        RDMA_PS_IB => PortSpace::Ib,
        RDMA_PS_IPOIB => PortSpace::Ipoib,
        _ => return None,
    })
}

fn ps_num(ps: PortSpace) -> c_int {
    match ps {
        PortSpace::Tcp => RDMA_PS_TCP,
        PortSpace::Udp => RDMA_PS_UDP,
        PortSpace::Ib => RDMA_PS_IB,
        PortSpace::Ipoib => RDMA_PS_IPOIB,
    }
}

fn qpt_num(t: QpType) -> c_int {
    match t {
        QpType::Ud => IBV_QPT_UD,
        QpType::Uc => IBV_QPT_UC,
        _ => IBV_QPT_RC,
    }
}

/// Allocates the C ID for `rt` and registers it.
fn new_id(rt: CmId, channel: *mut rdma_event_channel, context: *mut c_void, sync: bool) -> *mut Id {
    // SAFETY: plain data and null pointers.
    let mut ibv: rdma_cm_id = unsafe { std::mem::zeroed() };
    ibv.channel = channel;
    ibv.context = context;
    ibv.ps = ps_num(rt.port_space());
    ibv.qp_type = qpt_num(rt.qp_type());
    let key = rt.key();
    let id = Box::into_raw(Box::new(Id {
        ibv,
        rt: Some(rt),
        sync,
        qp_init: None,
        unacked: AtomicUsize::new(0),
        destroyed: false,
        path: ibv_sa_path_rec::default(),
        tos: None,
        ack_timeout: None,
        mcast: Vec::new(),
    }));
    lock(ids()).insert(key, id as usize);
    lock(live()).ids.insert(id as usize);
    id
}

/// Writes `addr` as a `sockaddr_in`/`sockaddr_in6` into `out`.
pub(crate) fn write_sockaddr(out: &mut sockaddr_storage, addr: SocketAddr) {
    let sa = socket2::SockAddr::from(addr);
    let n = (sa.len() as usize).min(out.bytes.len());
    // SAFETY: `as_ptr` points to the `len()` bytes of the encoded address.
    let bytes = unsafe { std::slice::from_raw_parts(sa.as_ptr().cast::<u8>(), n) };
    out.bytes = [0; 128];
    out.bytes[..n].copy_from_slice(bytes);
}

/// Reads a `sockaddr_in`/`sockaddr_in6`; `None` for another family or a null pointer.
///
/// # Safety
/// `sa` is null or points to a socket address of its family's size.
pub(crate) unsafe fn read_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: by the contract, sa_family is readable.
    match c_int::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a sockaddr_in6.
            let sin6 = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
        }
        _ => None,
    }
}

/// Brings the ID's device, PD and addresses up to date with the runtime's.
fn refresh(id: &mut Id) {
    let Some(rt) = id.rt.as_ref() else { return };
    if id.ibv.verbs.is_null() {
        let bound = rt.local_addr().is_some_and(|l| !l.ip().is_unspecified());
        if let (true, Some(ctx)) = (bound, rt.context()) {
            if let Some(v) = verbs_of(&ctx) {
                id.ibv.verbs = v.ctx as *mut ibv_context;
                if id.ibv.pd.is_null() {
                    id.ibv.pd = v.pd as *mut ibv_pd;
                }
                id.ibv.port_num = 1;
            }
        }
    }
    if let Some(l) = rt.local_addr() {
        write_sockaddr(&mut id.ibv.route.addr.src_addr, l);
        id.ibv.route.addr.ibaddr.sgid.raw = gid_of(l.ip());
        id.path.sgid.raw = gid_of(l.ip());
    }
    if let Some(r) = rt.peer_addr() {
        write_sockaddr(&mut id.ibv.route.addr.dst_addr, r);
        id.ibv.route.addr.ibaddr.dgid.raw = gid_of(r.ip());
        id.path.dgid.raw = gid_of(r.ip());
    }
    id.ibv.route.addr.ibaddr.pkey = 0xFFFF_u16.to_be();
}

/// The result of a call: 0, or -1 with errno.
fn ret(r: Result<(), c_int>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

fn errno(e: softrdma::Error) -> c_int {
    e.errno()
}

/// Runs `f` on a live ID, turning a panic into EINVAL.
fn with_id(id: *mut rdma_cm_id, f: impl FnOnce(&mut Id) -> Result<(), c_int>) -> c_int {
    let Some(id) = live_id(id) else { return ret(Err(libc::EINVAL)) };
    ret(guard(Err(libc::EINVAL), || f(id)))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: c_int,
) -> c_int {
    ret(guard(Err(libc::EINVAL), || {
        let Some(ps) = port_space(ps) else { return Err(libc::EPROTONOSUPPORT) };
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        let (ch, sync) =
            if channel.is_null() { (new_chan().ok_or(libc::EMFILE)?, true) } else { (channel, false) };
        let rt = CmId::new(&live_chan(ch).ok_or(libc::EINVAL)?.rt, ps);
        let new = new_id(rt, ch, context, sync);
        // SAFETY: the caller's out pointer.
        unsafe { *id = new.cast() };
        Ok(())
    }))
}

/// Acknowledges and clears a synchronous ID's kept event.
fn drop_kept_event(id: &mut Id) {
    let ev = std::mem::replace(&mut id.ibv.event, ptr::null_mut());
    if !ev.is_null() {
        // SAFETY: an event of ours, not yet acknowledged.
        unsafe { rdma_ack_cm_event(ev) };
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    with_id(id, |i| {
        lock(live()).ids.remove(&(id as usize));
        drop_kept_event(i);
        let rt = i.rt.take().ok_or(libc::EINVAL)?;
        lock(ids()).remove(&rt.key());
        // Events of this ID still queued go with a channel dropped at once, so that the
        // runtime ID goes now (a connected one sends its DREQ).
        if let Ok(sink) = EventChannel::new() {
            rt.migrate(&sink);
        }
        rt.destroy();
        drop(rt);
        if i.sync && !i.ibv.channel.is_null() {
            // SAFETY: the ID's own channel.
            unsafe { rdma_destroy_event_channel(std::mem::replace(&mut i.ibv.channel, ptr::null_mut())) };
        }
        let _g = lock(ids());
        i.destroyed = true;
        if i.unacked.load(Ordering::Acquire) == 0 {
            // SAFETY: nothing refers to the ID any more.
            drop(unsafe { Box::from_raw(ptr::from_mut(i)) });
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    with_id(id, |i| {
        // SAFETY: the caller's address.
        let at = unsafe { read_sockaddr(addr) }.ok_or(libc::EAFNOSUPPORT)?;
        rt_of(i)?.bind_addr(at).map_err(errno)?;
        refresh(i);
        Ok(())
    })
}

/// Synchronous IDs: waits for the ID's next event and keeps it in `id->event`; a failure
/// status becomes the errno (`ECONNREFUSED` for REJECTED).
fn complete(i: &mut Id) -> Result<(), c_int> {
    if !i.sync {
        return Ok(());
    }
    drop_kept_event(i);
    let mut ev: *mut rdma_cm_event = ptr::null_mut();
    // SAFETY: the ID's own channel.
    if unsafe { rdma_get_cm_event(i.ibv.channel, &mut ev) } != 0 {
        // SAFETY: errno of this thread.
        return Err(unsafe { *libc::__errno_location() });
    }
    i.ibv.event = ev;
    // SAFETY: just delivered.
    let (kind, status) = unsafe { ((*ev).event, (*ev).status) };
    if status != 0 {
        return Err(if kind == CmEventKind::Rejected as c_int {
            libc::ECONNREFUSED
        } else if status < 0 {
            -status
        } else {
            status
        });
    }
    Ok(())
}

fn ms(timeout_ms: c_int) -> Duration {
    Duration::from_millis(timeout_ms.max(0) as u64)
}

#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src_addr: *mut libc::sockaddr,
    dst_addr: *mut libc::sockaddr,
    timeout_ms: c_int,
) -> c_int {
    with_id(id, |i| {
        // SAFETY: the caller's addresses.
        let (src, dst) = unsafe { (read_sockaddr(src_addr), read_sockaddr(dst_addr)) };
        let dst = dst.ok_or(libc::EINVAL)?;
        rt_of(i)?.resolve_addr(src.map(|s| s.ip()), dst, ms(timeout_ms)).map_err(errno)?;
        refresh(i);
        complete(i)
    })
}

/// Joins the group `addr` names (`rdma_join_multicast`): the ID's QP, if it has one, is
/// attached; MULTICAST_JOIN follows with the group's address handle attributes, QP
/// 0xFFFFFF and Q_Key 0x01234567, and `context` as its private data.
#[no_mangle]
pub unsafe extern "C" fn rdma_join_multicast(
    id: *mut rdma_cm_id,
    addr: *mut libc::sockaddr,
    context: *mut c_void,
) -> c_int {
    with_id(id, |i| {
        // SAFETY: the caller's address.
        let group = unsafe { read_sockaddr(addr) }.ok_or(libc::EINVAL)?.ip();
        if !group.is_multicast() {
            return Err(libc::EINVAL);
        }
        if rt_of(i)?.multicast_groups().contains(&group) {
            return Err(libc::EADDRINUSE);
        }
        // The context stays with the group (a later join replaces it), so that an event
        // read after the program left the group still carries it.
        i.mcast.retain(|(g, _)| *g != group);
        i.mcast.push((group, context));
        if let Err(e) = rt_of(i)?.join_multicast(group) {
            i.mcast.retain(|(g, _)| *g != group);
            return Err(errno(e));
        }
        let done = complete(i);
        if done.is_err() {
            let _ = rt_of(i)?.leave_multicast(group);
        }
        done
    })
}

/// `struct rdma_cm_join_mc_attr_ex`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct rdma_cm_join_mc_attr_ex {
    comp_mask: u32,
    join_flags: u32,
    addr: *mut libc::sockaddr,
}

/// `rdma_join_multicast_ex`: a full member join (flags 0), or a send-only one (flags 1),
/// which softrdma treats as a full join (the QP receives too).
#[no_mangle]
pub unsafe extern "C" fn rdma_join_multicast_ex(
    id: *mut rdma_cm_id,
    attr: *mut rdma_cm_join_mc_attr_ex,
    context: *mut c_void,
) -> c_int {
    if attr.is_null() {
        return ret(Err(libc::EINVAL));
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { ptr::read_unaligned(attr) };
    // comp_mask bit 0: addr; bit 1: join_flags.
    if a.comp_mask & !3 != 0 || a.comp_mask & 1 == 0 || (a.comp_mask & 2 != 0 && a.join_flags > 1) {
        return ret(Err(libc::EINVAL));
    }
    // SAFETY: forwarded.
    unsafe { rdma_join_multicast(id, a.addr, context) }
}

/// Leaves a group (`rdma_leave_multicast`): the ID's QP is detached.
#[no_mangle]
pub unsafe extern "C" fn rdma_leave_multicast(id: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    with_id(id, |i| {
        // SAFETY: the caller's address.
        let group = unsafe { read_sockaddr(addr) }.ok_or(libc::EINVAL)?.ip();
        if !i.mcast.iter().any(|(g, _)| *g == group) {
            return Err(libc::EADDRNOTAVAIL);
        }
        let rt = rt_of(i)?;
        // A join that ended in MULTICAST_ERROR left nothing to leave: that is no error.
        if rt.multicast_groups().contains(&group) {
            rt.leave_multicast(group).map_err(errno)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_route(id: *mut rdma_cm_id, timeout_ms: c_int) -> c_int {
    with_id(id, |i| {
        rt_of(i)?.resolve_route(ms(timeout_ms)).map_err(errno)?;
        complete(i)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    with_id(id, |i| {
        let backlog = if backlog <= 0 { 1024 } else { backlog as usize };
        rt_of(i)?.listen(backlog).map_err(errno)?;
        refresh(i);
        Ok(())
    })
}

/// The device's limit for reads and atomics in flight: what 0xFF (and a NULL
/// `conn_param`) asks for.
fn max_rd_atom(i: &Id) -> u8 {
    i.rt.as_ref().and_then(|r| r.context()).map_or(1, |c| c.device().attr().max_qp_rd_atom.min(255) as u8)
}

/// A C `rdma_conn_param` as the runtime's, with rdma_cm's defaults for NULL.
///
/// # Safety
/// `p` is null or points to a `rdma_conn_param` whose private data is readable.
unsafe fn to_conn_param(i: &Id, p: *const rdma_conn_param) -> ConnParam {
    let max = max_rd_atom(i);
    if p.is_null() {
        return ConnParam { responder_resources: max, initiator_depth: max, ..ConnParam::default() };
    }
    // SAFETY: by the contract.
    let p = unsafe { &*p };
    let depth = |d: u8| if d == RDMA_MAX_DEPTH { max } else { d.min(max) };
    let private_data = if p.private_data.is_null() || p.private_data_len == 0 {
        Vec::new()
    } else {
        // SAFETY: private_data_len readable bytes, by the contract.
        unsafe { std::slice::from_raw_parts(p.private_data.cast::<u8>(), p.private_data_len.into()) }.to_vec()
    };
    ConnParam {
        private_data,
        responder_resources: depth(p.responder_resources),
        initiator_depth: depth(p.initiator_depth),
        flow_control: p.flow_control != 0,
        retry_count: p.retry_count.min(7),
        rnr_retry_count: p.rnr_retry_count.min(7),
        srq: p.srq != 0,
        qp_num: p.qp_num & 0xFF_FFFF,
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_connect(id: *mut rdma_cm_id, conn_param: *mut rdma_conn_param) -> c_int {
    with_id(id, |i| {
        if conn_param.is_null() && i.ibv.qp.is_null() && i.ibv.qp_type != IBV_QPT_UD {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller's parameters.
        let p = unsafe { to_conn_param(i, conn_param) };
        rt_of(i)?.connect(&p).map_err(errno)?;
        complete(i)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_accept(id: *mut rdma_cm_id, conn_param: *mut rdma_conn_param) -> c_int {
    with_id(id, |i| {
        if conn_param.is_null() && i.ibv.qp.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller's parameters.
        let p = unsafe { to_conn_param(i, conn_param) };
        rt_of(i)?.accept(&p).map_err(errno)?;
        if i.ibv.qp_type == IBV_QPT_UD {
            // No ESTABLISHED follows a SIDR reply; the kept request is done with.
            drop_kept_event(i);
            return Ok(());
        }
        complete(i)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_reject(id: *mut rdma_cm_id, private_data: *const c_void, len: u8) -> c_int {
    with_id(id, |i| {
        let data = if private_data.is_null() || len == 0 {
            &[][..]
        } else {
            // SAFETY: len readable bytes, the caller's.
            unsafe { std::slice::from_raw_parts(private_data.cast::<u8>(), len.into()) }
        };
        rt_of(i)?.reject(data).map_err(errno)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_establish(id: *mut rdma_cm_id) -> c_int {
    with_id(id, |i| {
        if !i.ibv.qp.is_null() {
            return Err(libc::EINVAL);
        }
        rt_of(i)?.establish().map_err(errno)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_notify(id: *mut rdma_cm_id, _event: c_int) -> c_int {
    // The runtime takes the connection as established on the first packet already.
    with_id(id, |i| rt_of(i).map(|_| ()))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    with_id(id, |i| {
        rt_of(i)?.disconnect().map_err(errno)?;
        complete(i)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_migrate_id(id: *mut rdma_cm_id, channel: *mut rdma_event_channel) -> c_int {
    with_id(id, |i| {
        let rt = rt_of(i)?.clone();
        let (ch, sync) = if channel.is_null() {
            if i.sync {
                return Err(libc::EINVAL);
            }
            (new_chan().ok_or(libc::EMFILE)?, true)
        } else {
            (channel, false)
        };
        rt.migrate(&live_chan(ch).ok_or(libc::EINVAL)?.rt);
        if i.sync {
            drop_kept_event(i);
            // SAFETY: the ID's own channel, now empty of its events.
            unsafe { rdma_destroy_event_channel(i.ibv.channel) };
        }
        i.ibv.channel = ch;
        i.sync = sync;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    with_id(id, |i| {
        if optval.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: optlen readable bytes, checked per option below.
        let byte = || unsafe { *optval.cast::<u8>() };
        match (level, optname) {
            (RDMA_OPTION_ID, RDMA_OPTION_ID_TOS) if optlen == 1 => i.tos = Some(byte()),
            (RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT) if optlen == 1 => i.ack_timeout = Some(byte()),
            (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR | RDMA_OPTION_ID_AFONLY) if optlen == 4 => {
                // Ports are reserved per process and released with their ID: nothing to
                // reuse, and IPv6 IDs take IPv6 addresses only.
            }
            (RDMA_OPTION_ID, RDMA_OPTION_ID_TOS..=RDMA_OPTION_ID_ACK_TIMEOUT) => return Err(libc::EINVAL),
            _ => return Err(libc::ENOSYS),
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    let Some(i) = live_id(id) else { return 0 };
    i.rt.as_ref().and_then(|r| r.local_addr()).map_or(0, |a| a.port().to_be())
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    let Some(i) = live_id(id) else { return 0 };
    i.rt.as_ref().and_then(|r| r.peer_addr()).map_or(0, |a| a.port().to_be())
}

// ---- Events -------------------------------------------------------------------------

/// `struct rdma_cm_event` with the private data it points into, and the ID it is charged
/// to (the listener, for CONNECT_REQUEST).
#[repr(C)]
struct Ev {
    ibv: rdma_cm_event,
    data: [u8; 256],
    charged: *mut Id,
}

fn ah_attr_of(peer: IpAddr, sgid_index: u8) -> ibv_ah_attr {
    let grh = ibv_global_route {
        dgid: ibv_gid { raw: gid_of(peer) },
        sgid_index,
        hop_limit: 64,
        ..Default::default()
    };
    ibv_ah_attr { grh, is_global: 1, port_num: 1, ..Default::default() }
}

/// Turns a runtime event into a C one; `None` if its ID is gone.
fn convert(ev: CmEvent) -> Option<*mut rdma_cm_event> {
    let table = lock(ids());
    let listener = ev.listen_id.as_ref().and_then(|l| table.get(&l.key()).copied()).map(|p| p as *mut Id);
    let known = table.get(&ev.id.key()).copied().map(|p| p as *mut Id);
    drop(table);
    let id: *mut Id = match (ev.kind, known, listener) {
        (_, Some(id), _) => id,
        (CmEventKind::ConnectRequest, None, Some(l)) => {
            // SAFETY: a live listener (registered).
            let l = unsafe { &mut *l };
            let new = new_id(ev.id.clone(), l.ibv.channel, l.ibv.context, false);
            // SAFETY: just made.
            let n = unsafe { &mut *new };
            if l.sync {
                // A synchronous listener's connections are synchronous too.
                if let Some(ch) = new_chan() {
                    // SAFETY: a channel of ours.
                    ev.id.migrate(&unsafe { chan_of(ch) }.rt);
                    n.ibv.channel = ch;
                    n.sync = true;
                }
            }
            new
        }
        _ => return None,
    };
    // SAFETY: a live ID (registered, or just made).
    let i = unsafe { &mut *id };
    refresh(i);
    if matches!(ev.kind, CmEventKind::RouteResolved | CmEventKind::ConnectRequest) {
        i.ibv.route.path_rec = &raw mut i.path;
        i.ibv.route.num_paths = 1;
    }
    let charged = if ev.kind == CmEventKind::ConnectRequest { listener.unwrap_or(id) } else { id };
    // SAFETY: plain data and null pointers.
    let mut c: rdma_cm_event = unsafe { std::mem::zeroed() };
    c.id = id.cast();
    c.listen_id = if ev.kind == CmEventKind::ConnectRequest {
        listener.map_or(ptr::null_mut(), |l| l.cast())
    } else {
        ptr::null_mut()
    };
    c.event = ev.kind as c_int;
    c.status = ev.status;
    let mut boxed = Box::new(Ev { ibv: c, data: [0; 256], charged });
    let n = ev.param.private_data.len().min(255);
    boxed.data[..n].copy_from_slice(&ev.param.private_data[..n]);
    let data_ptr = if n == 0 { ptr::null() } else { boxed.data.as_ptr().cast::<c_void>() };
    let sgid_index = ev.id.context().map_or(0, |c| c.device().gid_index as u8);
    // A multicast event's private data is the context given to rdma_join_multicast.
    let data_ptr = match (ev.kind, ev.ud) {
        (CmEventKind::MulticastJoin | CmEventKind::MulticastError, Some(ud)) => {
            i.mcast.iter().find(|(g, _)| *g == ud.addr.ip()).map_or(ptr::null(), |(_, c)| c.cast_const())
        }
        _ => data_ptr,
    };
    boxed.ibv.param = match ev.ud {
        Some(ud) => rdma_event_param {
            ud: rdma_ud_param {
                private_data: data_ptr,
                private_data_len: n as u8,
                ah_attr: ah_attr_of(ud.addr.ip(), sgid_index),
                qp_num: ud.qpn.get(),
                qkey: ud.qkey.0,
            },
        },
        None => rdma_event_param {
            conn: rdma_conn_param {
                private_data: data_ptr,
                private_data_len: n as u8,
                responder_resources: ev.param.responder_resources,
                initiator_depth: ev.param.initiator_depth,
                flow_control: ev.param.flow_control.into(),
                retry_count: ev.param.retry_count,
                rnr_retry_count: ev.param.rnr_retry_count,
                srq: ev.param.srq.into(),
                qp_num: ev.param.qp_num,
            },
        },
    };
    // SAFETY: the charged ID is live.
    unsafe { &*charged }.unacked.fetch_add(1, Ordering::AcqRel);
    Some(Box::into_raw(boxed).cast())
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    if channel.is_null() || event.is_null() {
        return ret(Err(libc::EINVAL));
    }
    let Some(ch) = live_chan(channel) else { return ret(Err(libc::EINVAL)) };
    let nonblock = nonblocking(ch.ibv.fd);
    // The runtime channel is shared, and this call keeps its own handle while it waits: a
    // program may destroy the channel while one of its threads still waits on it (rping's
    // event thread does, as the program ends), and that thread must not wake into freed
    // memory when its wait times out.
    let rt = ch.rt.clone();
    ret(guard(Err(libc::EINVAL), || loop {
        let ev = if nonblock {
            rt.try_get_event().ok_or(libc::EAGAIN)?
        } else {
            match rt.get_event_timeout(Duration::from_secs(1)) {
                Some(ev) => ev,
                None => continue,
            }
        };
        if let Some(c) = convert(ev) {
            // SAFETY: the caller's out pointer.
            unsafe { *event = c };
            return Ok(());
        }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    if event.is_null() {
        return ret(Err(libc::EINVAL));
    }
    // SAFETY: an event from rdma_get_cm_event, acknowledged once.
    let ev = unsafe { Box::from_raw(event.cast::<Ev>()) };
    let _g = lock(ids());
    // SAFETY: the charged ID lives until its last event is acknowledged.
    let charged = unsafe { &mut *ev.charged };
    if charged.unacked.fetch_sub(1, Ordering::AcqRel) == 1 && charged.destroyed {
        // SAFETY: destroyed, and this was its last event.
        drop(unsafe { Box::from_raw(ev.charged) });
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn rdma_event_str(event: c_int) -> *const c_char {
    const NAMES: [&std::ffi::CStr; 16] = [
        c"RDMA_CM_EVENT_ADDR_RESOLVED",
        c"RDMA_CM_EVENT_ADDR_ERROR",
        c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        c"RDMA_CM_EVENT_ROUTE_ERROR",
        c"RDMA_CM_EVENT_CONNECT_REQUEST",
        c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        c"RDMA_CM_EVENT_CONNECT_ERROR",
        c"RDMA_CM_EVENT_UNREACHABLE",
        c"RDMA_CM_EVENT_REJECTED",
        c"RDMA_CM_EVENT_ESTABLISHED",
        c"RDMA_CM_EVENT_DISCONNECTED",
        c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        c"RDMA_CM_EVENT_MULTICAST_JOIN",
        c"RDMA_CM_EVENT_MULTICAST_ERROR",
        c"RDMA_CM_EVENT_ADDR_CHANGE",
        c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
    ];
    usize::try_from(event).ok().and_then(|e| NAMES.get(e)).map_or(c"UNKNOWN EVENT".as_ptr(), |s| s.as_ptr())
}

// ---- QPs ----------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    if qp_init_attr.is_null() {
        return ret(Err(libc::EINVAL));
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &mut *qp_init_attr };
    // SAFETY: plain data and null pointers.
    let mut ex: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    ex.qp_context = a.qp_context;
    ex.send_cq = a.send_cq;
    ex.recv_cq = a.recv_cq;
    ex.srq = a.srq;
    ex.cap = a.cap;
    ex.qp_type = a.qp_type;
    ex.sq_sig_all = a.sq_sig_all;
    ex.comp_mask = IBV_QP_INIT_ATTR_PD;
    ex.pd = pd;
    // SAFETY: forwarded.
    let r = unsafe { rdma_create_qp_ex(id, &mut ex) };
    if r == 0 {
        a.send_cq = ex.send_cq;
        a.recv_cq = ex.recv_cq;
        a.srq = ex.srq;
        a.cap = ex.cap;
    }
    r
}

/// A CQ of the ID's (context: the ID) with its own completion channel.
///
/// # Safety
/// `verbs` is a live context.
unsafe fn id_cq(
    verbs: *mut ibv_context,
    id: *mut Id,
    depth: u32,
) -> Result<(*mut ibv_comp_channel, *mut ibv_cq), c_int> {
    // SAFETY: by the contract.
    let ch = unsafe { crate::cq::ibv_create_comp_channel(verbs) };
    if ch.is_null() {
        return Err(libc::ENOMEM);
    }
    // SAFETY: as above.
    let cq = unsafe { crate::cq::ibv_create_cq(verbs, depth.max(1) as c_int, id.cast(), ch, 0) };
    if cq.is_null() {
        // SAFETY: just made, unused.
        unsafe { crate::cq::ibv_destroy_comp_channel(ch) };
        return Err(libc::ENOMEM);
    }
    Ok((ch, cq))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp_ex(id: *mut rdma_cm_id, attr: *mut ibv_qp_init_attr_ex) -> c_int {
    with_id(id, |i| {
        if attr.is_null() || !i.ibv.qp.is_null() || i.ibv.verbs.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller's attributes.
        let a = unsafe { &mut *attr };
        if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
            a.pd = i.ibv.pd;
            a.comp_mask |= IBV_QP_INIT_ATTR_PD;
        }
        // SAFETY: a live PD.
        if a.pd.is_null() || unsafe { (*a.pd).context } != i.ibv.verbs {
            return Err(libc::EINVAL);
        }
        let me: *mut Id = ptr::from_mut(i);
        let mut made: Vec<(*mut ibv_comp_channel, *mut ibv_cq)> = Vec::new();
        let undo = |made: &mut Vec<(*mut ibv_comp_channel, *mut ibv_cq)>| {
            for (ch, cq) in made.drain(..) {
                // SAFETY: made here, unused.
                unsafe {
                    crate::cq::ibv_destroy_cq(cq);
                    crate::cq::ibv_destroy_comp_channel(ch);
                }
            }
        };
        if a.recv_cq.is_null() && i.ibv.recv_cq.is_null() && a.cap.max_recv_wr > 0 {
            // SAFETY: the ID's live context.
            let (ch, cq) = unsafe { id_cq(i.ibv.verbs, me, a.cap.max_recv_wr) }?;
            made.push((ch, cq));
            (i.ibv.recv_cq_channel, i.ibv.recv_cq) = (ch, cq);
        }
        if a.send_cq.is_null() && i.ibv.send_cq.is_null() && a.cap.max_send_wr > 0 {
            // SAFETY: as above.
            match unsafe { id_cq(i.ibv.verbs, me, a.cap.max_send_wr) } {
                Ok((ch, cq)) => {
                    made.push((ch, cq));
                    (i.ibv.send_cq_channel, i.ibv.send_cq) = (ch, cq);
                }
                Err(e) => {
                    undo(&mut made);
                    (i.ibv.recv_cq_channel, i.ibv.recv_cq) = (ptr::null_mut(), ptr::null_mut());
                    return Err(e);
                }
            }
        }
        if a.send_cq.is_null() {
            a.send_cq = i.ibv.send_cq;
        }
        if a.recv_cq.is_null() {
            a.recv_cq = i.ibv.recv_cq;
        }
        if a.srq.is_null() {
            a.srq = i.ibv.srq;
        }
        // SAFETY: forwarded to the verbs layer.
        let qp = unsafe { crate::verbs::create_qp_ex(i.ibv.verbs, attr) };
        let attached = if qp.is_null() {
            // SAFETY: errno of this thread.
            Err(unsafe { *libc::__errno_location() })
        } else {
            // SAFETY: a QP just made by the verbs layer.
            let q = unsafe { crate::verbs::qp_of(qp) };
            rt_of(i)?.attach_qp(q.rt.clone()).map_err(errno)
        };
        if let Err(e) = attached {
            if !qp.is_null() {
                // SAFETY: made above, unused.
                unsafe { crate::verbs::ibv_destroy_qp(qp) };
            }
            for (ch, cq) in &made {
                for (fch, fcq) in [
                    (&mut i.ibv.recv_cq_channel, &mut i.ibv.recv_cq),
                    (&mut i.ibv.send_cq_channel, &mut i.ibv.send_cq),
                ] {
                    if *fcq == *cq {
                        (*fch, *fcq) = (ptr::null_mut(), ptr::null_mut());
                    }
                }
                let _ = ch;
            }
            undo(&mut made);
            return Err(e);
        }
        i.ibv.qp = qp;
        i.ibv.pd = a.pd;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    with_id(id, |i| {
        if let Some(rt) = &i.rt {
            rt.destroy_qp();
        }
        let qp = std::mem::replace(&mut i.ibv.qp, ptr::null_mut());
        if !qp.is_null() {
            // SAFETY: the ID's QP.
            unsafe { crate::verbs::ibv_destroy_qp(qp) };
        }
        // As rdma-core: the CQs and channels stored in the ID go too.
        let (rcq, scq) = (std::mem::take(&mut i.ibv.recv_cq), std::mem::take(&mut i.ibv.send_cq));
        // SAFETY: the ID's CQs and channels, unused now that the QP is gone.
        unsafe {
            if !rcq.is_null() {
                crate::cq::ibv_destroy_cq(rcq);
            }
            if !scq.is_null() && scq != rcq {
                crate::cq::ibv_destroy_cq(scq);
            }
            for ch in [std::mem::take(&mut i.ibv.recv_cq_channel), std::mem::take(&mut i.ibv.send_cq_channel)]
            {
                if !ch.is_null() {
                    crate::cq::ibv_destroy_comp_channel(ch);
                }
            }
        }
        Ok(())
    });
}

#[no_mangle]
pub unsafe extern "C" fn rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    qp_attr: *mut ibv_qp_attr,
    mask: *mut c_int,
) -> c_int {
    with_id(id, |i| {
        if qp_attr.is_null() || mask.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller's attributes.
        let a = unsafe { &mut *qp_attr };
        if a.qp_state != IBV_QPS_INIT {
            // RTR and RTS come from the runtime, which moves the ID's QP itself.
            return Err(libc::ENOSYS);
        }
        a.pkey_index = 0;
        a.port_num = 1;
        let mut m = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
        if i.ibv.qp_type == IBV_QPT_UD {
            a.qkey = softrdma::cm::UDP_QKEY.0;
            m |= IBV_QP_QKEY;
        } else {
            a.qp_access_flags = 0;
            m |= IBV_QP_ACCESS_FLAGS;
        }
        // SAFETY: the caller's out pointer.
        unsafe { *mask = m };
        Ok(())
    })
}

const IBV_QPS_INIT: c_int = 1;
const IBV_QP_STATE: c_int = 1;
const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
const IBV_QP_PORT: c_int = 1 << 5;
const IBV_QP_QKEY: c_int = 1 << 6;

// ---- Devices ------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn rdma_get_devices(num_devices: *mut c_int) -> *mut *mut ibv_context {
    let list: Vec<*mut ibv_context> = crate::device::devices()
        .iter()
        .filter_map(|d| Context::open_device(d.desc.clone(), softrdma::default_port()).ok())
        .filter_map(|c| verbs_of(&c))
        .map(|v| v.ctx as *mut ibv_context)
        .collect();
    if !num_devices.is_null() {
        // SAFETY: the caller's out pointer.
        unsafe { *num_devices = list.len() as c_int };
    }
    // SAFETY: room for the list and its NULL.
    let out = unsafe { libc::calloc(list.len() + 1, std::mem::size_of::<*mut ibv_context>()) }
        .cast::<*mut ibv_context>();
    if out.is_null() {
        set_errno(libc::ENOMEM);
        return out;
    }
    for (k, c) in list.into_iter().enumerate() {
        // SAFETY: within the allocation.
        unsafe { *out.add(k) = c };
    }
    out
}

#[no_mangle]
pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: a list from rdma_get_devices; the contexts stay open.
    unsafe { libc::free(list.cast()) };
}

// ---- The endpoint calls (`rdma_create_ep`, `rdma_get_request`) ------------------------

#[no_mangle]
pub unsafe extern "C" fn rdma_create_ep(
    id: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    if id.is_null() || res.is_null() {
        return ret(Err(libc::EINVAL));
    }
    // SAFETY: the caller's address information.
    let r = unsafe { &*res };
    let mut new: *mut rdma_cm_id = ptr::null_mut();
    // SAFETY: a synchronous ID.
    if unsafe { rdma_create_id(ptr::null_mut(), &mut new, ptr::null_mut(), r.ai_port_space) } != 0 {
        return -1;
    }
    let fail = |new: *mut rdma_cm_id| {
        // SAFETY: errno of this thread, kept across the cleanup.
        let e = unsafe { *libc::__errno_location() };
        // SAFETY: the ID made above.
        unsafe { rdma_destroy_ep(new) };
        set_errno(e);
        -1
    };
    // SAFETY: made above.
    let i = unsafe { id_of(new) };
    if r.ai_flags & RAI_PASSIVE != 0 {
        // SAFETY: the caller's address.
        if unsafe { rdma_bind_addr(new, r.ai_src_addr) } != 0 {
            return fail(new);
        }
        if !pd.is_null() {
            i.ibv.pd = pd;
        }
        if !qp_init_attr.is_null() {
            // SAFETY: the caller's attributes, copied.
            let mut init = unsafe { ptr::read(qp_init_attr) };
            init.qp_type = r.ai_qp_type;
            i.qp_init = Some(init);
        }
    } else {
        // SAFETY: the caller's addresses.
        if unsafe { rdma_resolve_addr(new, r.ai_src_addr, r.ai_dst_addr, 2000) } != 0
            || unsafe { rdma_resolve_route(new, 2000) } != 0
        {
            return fail(new);
        }
        if !qp_init_attr.is_null() {
            // SAFETY: the caller's attributes (rdma-core writes the QP type into them).
            unsafe { (*qp_init_attr).qp_type = r.ai_qp_type };
            // SAFETY: as above.
            if unsafe { rdma_create_qp(new, pd, qp_init_attr) } != 0 {
                return fail(new);
            }
        }
    }
    // SAFETY: the caller's out pointer.
    unsafe { *id = new };
    0
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_ep(id: *mut rdma_cm_id) {
    let Some(i) = live_id(id) else { return };
    if !i.ibv.qp.is_null() {
        // SAFETY: its QP.
        unsafe { rdma_destroy_qp(id) };
    }
    if !i.ibv.srq.is_null() {
        // SAFETY: its SRQ.
        unsafe { rdma_destroy_srq(id) };
    }
    // SAFETY: the ID.
    unsafe { rdma_destroy_id(id) };
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_request(listen: *mut rdma_cm_id, id: *mut *mut rdma_cm_id) -> c_int {
    with_id(listen, |l| {
        if !l.sync || id.is_null() {
            return Err(libc::EINVAL);
        }
        drop_kept_event(l);
        let mut ev: *mut rdma_cm_event = ptr::null_mut();
        // SAFETY: the listener's own channel.
        if unsafe { rdma_get_cm_event(l.ibv.channel, &mut ev) } != 0 {
            // SAFETY: errno of this thread.
            return Err(unsafe { *libc::__errno_location() });
        }
        // SAFETY: just delivered.
        let e = unsafe { &*ev };
        if e.status != 0 || e.event != CmEventKind::ConnectRequest as c_int {
            l.ibv.event = ev;
            return Err(if e.event == CmEventKind::Rejected as c_int {
                libc::ECONNREFUSED
            } else if e.status < 0 {
                -e.status
            } else {
                libc::EINVAL
            });
        }
        let new = e.id;
        if let Some(init) = &l.qp_init {
            // SAFETY: plain data, copied.
            let mut init = unsafe { ptr::read(init) };
            let pd = if l.ibv.pd.is_null() || unsafe { (*l.ibv.pd).context } != unsafe { (*new).verbs } {
                ptr::null_mut()
            } else {
                l.ibv.pd
            };
            // SAFETY: the new ID and a copy of the template.
            if unsafe { rdma_create_qp(new, pd, &mut init) } != 0 {
                // SAFETY: errno of this thread.
                let err = unsafe { *libc::__errno_location() };
                // SAFETY: refuse it at once rather than let the peer time out.
                unsafe {
                    rdma_reject(new, ptr::null(), 0);
                    rdma_ack_cm_event(ev);
                    rdma_destroy_id(new);
                }
                return Err(err);
            }
        }
        // SAFETY: the new ID keeps the request until accept or destroy acknowledges it.
        unsafe { (*new).event = ev };
        // SAFETY: the caller's out pointer.
        unsafe { *id = new };
        Ok(())
    })
}

// ---- SRQs ---------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn rdma_create_srq(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> c_int {
    with_id(id, |i| {
        let pd = if pd.is_null() { i.ibv.pd } else { pd };
        if pd.is_null() || attr.is_null() || !i.ibv.srq.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: a live PD and the caller's attributes.
        let srq = unsafe { crate::verbs::ibv_create_srq(pd, attr) };
        if srq.is_null() {
            // SAFETY: errno of this thread.
            return Err(unsafe { *libc::__errno_location() });
        }
        i.ibv.srq = srq;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_srq(id: *mut rdma_cm_id) {
    with_id(id, |i| {
        let srq = std::mem::replace(&mut i.ibv.srq, ptr::null_mut());
        if !srq.is_null() {
            // SAFETY: the ID's SRQ.
            unsafe { crate::verbs::ibv_destroy_srq(srq) };
        }
        Ok(())
    });
}
