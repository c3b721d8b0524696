//! The verbs objects (PD, MR, completion channel, CQ, QP, SRQ, AH) and the data path
//! programs reach through `context->ops`: `post_send`, `post_recv`, `post_srq_recv`,
//! `poll_cq`, `req_notify_cq`.
//!
//! Errors follow rdma-core: calls that return `int` return an errno value (0 on
//! success); calls that return a pointer return NULL and set `errno`; a post that fails
//! stores the failing work request in `*bad_wr`.

use std::ffi::{c_int, c_uint, c_void};
use std::net::SocketAddr;
use std::ptr;
use std::sync::{Arc, Mutex};

use softrdma::proto::qp::ModifyError;
use softrdma::{
    addr_of_gid, Access, AddressHandle, AhAttr, MemoryRegion, Mtu, ProtectionDomain, Psn, Qkey, QpAttr,
    QpAttrMask, QpBuilder, QpCaps, QpState, QpType, Qpn, QueuePair, RecvWr, Rkey, SendFlags, SendOp, SendWr,
    Sge, SharedReceiveQueue, WorkCompletion,
};

use crate::abi::*;
use crate::cq::cq_of;
use crate::{errno_of, guard_rt, set_errno, Ctx};

/// Access bits rdma-core lets a provider ignore (`IBV_ACCESS_OPTIONAL_RANGE`).
const ACCESS_OPTIONAL_RANGE: u32 = ((1 << 29) - 1) & !((1 << 20) - 1);

fn fail<T>(e: c_int) -> *mut T {
    set_errno(e);
    ptr::null_mut()
}

// ---- Protection domains --------------------------------------------------------------

#[repr(C)]
pub(crate) struct Pd {
    ibv: ibv_pd,
    rt: ProtectionDomain,
}

#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    if context.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: a context from ibv_open_device.
    let ctx = unsafe { Ctx::from_ibv(context) };
    let rt = ctx.rt.alloc_pd();
    let pd = Box::new(Pd { ibv: ibv_pd { context, handle: 0 }, rt });
    Box::into_raw(pd).cast()
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    if pd.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a PD from ibv_alloc_pd; the runtime keeps what its objects still use alive.
    drop(unsafe { Box::from_raw(pd.cast::<Pd>()) });
    0
}

/// # Safety
/// `pd` is a live PD from [`ibv_alloc_pd`].
unsafe fn pd_of<'a>(pd: *mut ibv_pd) -> &'a Pd {
    // SAFETY: by the contract.
    unsafe { &*pd.cast::<Pd>() }
}

// ---- Memory regions ------------------------------------------------------------------

#[repr(C)]
struct Mr {
    ibv: ibv_mr,
    _rt: MemoryRegion,
}

/// Registers the application's own memory: RDMA WRITEs and atomics from peers land in it
/// directly, the last byte of each packet last.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded under the same contract.
    unsafe { ibv_reg_mr_iova2(pd, addr, length, addr as u64, access as c_uint) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    if pd.is_null() || (addr.is_null() && length != 0) {
        return fail(libc::EINVAL);
    }
    if iova != addr as u64 {
        // Regions are addressed by their virtual address; a different IOVA is not offered.
        return fail(libc::EOPNOTSUPP);
    }
    // SAFETY: a live PD.
    let p = unsafe { pd_of(pd) };
    let access = Access::from_bits(access & !ACCESS_OPTIONAL_RANGE);
    // SAFETY: verbs' contract: the range stays valid while registered (until ibv_dereg_mr).
    match guard_rt(|| unsafe { p.rt.register_raw(addr.cast(), length, access) }) {
        Ok(rt) => {
            let ibv = ibv_mr {
                context: p.ibv.context,
                pd,
                addr,
                length,
                handle: rt.lkey().0,
                lkey: rt.lkey().0,
                rkey: rt.rkey().0,
            };
            Box::into_raw(Box::new(Mr { ibv, _rt: rt })).cast()
        }
        Err(e) => fail(e.errno()),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    if mr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: an MR from ibv_reg_mr; dropping it leaves the registry before returning.
    drop(unsafe { Box::from_raw(mr.cast::<Mr>()) });
    0
}

// ---- QPs -----------------------------------------------------------------------------

#[repr(C)]
pub(crate) struct Qp {
    ibv: ibv_qp,
    /// Right after `ibv_qp`, so that the pointer is also an `ibv_qp_ex`.
    ex: ibv_qp_ex_tail,
    /// Shared with the CM ID that moves it, for QPs of `rdma_create_qp`.
    pub(crate) rt: Arc<QueuePair>,
    /// Work requests built by `ibv_wr_*` since `ibv_wr_start`, each with its inline data
    /// if it has some; `None` once one was malformed (`ibv_wr_complete` then fails with
    /// EINVAL).
    pending: Mutex<Option<Vec<PendingWr>>>,
    /// Where inline data is staged for the runtime (`None` without `max_inline_data`).
    bounce: Mutex<Option<Bounce>>,
}

/// A work request of the `ibv_wr_*` API, with its inline data if it has some.
type PendingWr = (SendWr, Option<Vec<u8>>);

/// A registered buffer of `max_inline_data` bytes. `IBV_SEND_INLINE` data may sit in
/// memory the program never registered (UCX's active messages do), while the runtime
/// gathers inline data through an lkey: the library copies it here first, under the
/// lock, and the runtime copies it again when the request is posted, so the buffer is
/// free as soon as the post returns.
struct Bounce {
    /// Declared first: deregistered before the buffer is freed.
    mr: MemoryRegion,
    buf: Box<[u8]>,
}

impl Bounce {
    fn new(pd: &ProtectionDomain, len: u32) -> softrdma::Result<Option<Bounce>> {
        if len == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; len as usize].into_boxed_slice();
        // SAFETY: the buffer lives as long as the registration (field order) and is
        // written only under the QP's bounce lock, between posts.
        let mr = unsafe { pd.register_raw(buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE)? };
        Ok(Some(Bounce { mr, buf }))
    }
}

/// Posts `wr` with the bytes its SGEs name as its payload, copied at once
/// (`IBV_SEND_INLINE`); an errno.
///
/// # Safety
/// The SGEs of `wr` name readable memory (verbs' contract for inline data).
unsafe fn post_inline(q: &Qp, mut wr: SendWr) -> c_int {
    let mut bounce = q.bounce.lock().unwrap_or_else(|e| e.into_inner());
    let total: usize = wr.sg_list.iter().map(|s| s.length as usize).sum();
    let Some(b) = bounce.as_mut().filter(|b| total <= b.buf.len()) else { return libc::EINVAL };
    let mut at = 0;
    for s in &wr.sg_list {
        // SAFETY: by the contract.
        let d = unsafe { raw_bytes(s.addr, s.length as usize) };
        b.buf[at..at + d.len()].copy_from_slice(d);
        at += d.len();
    }
    // The list, emptied, carries the one bounce SGE (inline: nothing allocated per post).
    wr.sg_list.clear();
    wr.sg_list.push(Sge { addr: b.buf.as_ptr() as u64, length: total as u32, lkey: b.mr.lkey() });
    wr.flags.inline = true;
    errno_of(guard_rt(|| q.rt.post_send(wr)))
}

/// Whether the operation carries data the requester sends (inline applies to it).
fn sends_data(op: &SendOp) -> bool {
    !matches!(op, SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
}

/// # Safety
/// `qp` is a live QP from [`ibv_create_qp`].
pub(crate) unsafe fn qp_of<'a>(qp: *mut ibv_qp) -> &'a Qp {
    // SAFETY: by the contract.
    unsafe { &*qp.cast::<Qp>() }
}

impl Qp {
    /// The inline limit the QP was created with.
    fn ibv_cap_inline(&self) -> u32 {
        self.bounce.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |b| b.buf.len() as u32)
    }
}

fn qp_type(t: c_int) -> Option<QpType> {
    match t {
        IBV_QPT_RC => Some(QpType::Rc),
        IBV_QPT_UC => Some(QpType::Uc),
        IBV_QPT_UD => Some(QpType::Ud),
        _ => None,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    if pd.is_null() || attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: a live PD and the caller's attributes.
    let (p, a) = unsafe { (pd_of(pd), &mut *attr) };
    if a.send_cq.is_null() || a.recv_cq.is_null() {
        return fail(libc::EINVAL);
    }
    let Some(ty) = qp_type(a.qp_type) else { return fail(libc::EOPNOTSUPP) };
    let caps = QpCaps {
        max_send_wr: a.cap.max_send_wr.max(1),
        max_recv_wr: a.cap.max_recv_wr.max(1),
        max_send_sge: a.cap.max_send_sge.max(1),
        max_recv_sge: a.cap.max_recv_sge.max(1),
        max_inline_data: a.cap.max_inline_data,
    };
    let mut b = match ty {
        QpType::Rc => QpBuilder::rc(),
        QpType::Uc => QpBuilder::uc(),
        QpType::Ud => QpBuilder::ud(Qkey(0)),
    }
    .caps(caps)
    .sq_sig_all(a.sq_sig_all != 0);
    if !a.srq.is_null() {
        // SAFETY: a live SRQ.
        b = b.srq(&unsafe { &*a.srq.cast::<Srq>() }.rt);
    }
    // SAFETY: live CQs.
    let (scq, rcq) = unsafe { (cq_of(a.send_cq), cq_of(a.recv_cq)) };
    let rt = match guard_rt(|| p.rt.create_qp(&b, &scq.rt, &rcq.rt)) {
        Ok(q) => q,
        Err(e) => return fail(e.errno()),
    };
    // SAFETY: its context is live.
    let ctx = unsafe { Ctx::from_ibv(p.ibv.context) };
    rt.set_foreign_peer(ctx.foreign);
    a.cap = ibv_qp_cap {
        max_send_wr: caps.max_send_wr,
        max_recv_wr: caps.max_recv_wr,
        max_send_sge: caps.max_send_sge,
        max_recv_sge: caps.max_recv_sge,
        max_inline_data: caps.max_inline_data,
    };
    // SAFETY: plain data; pointers set below.
    let mut ibv: ibv_qp = unsafe { std::mem::zeroed() };
    ibv.context = p.ibv.context;
    ibv.qp_context = a.qp_context;
    ibv.pd = pd;
    ibv.send_cq = a.send_cq;
    ibv.recv_cq = a.recv_cq;
    ibv.srq = a.srq;
    ibv.qp_num = rt.qpn().get();
    ibv.handle = ibv.qp_num;
    ibv.state = 0;
    ibv.qp_type = a.qp_type;
    let qpn = ibv.qp_num;
    // SAFETY: plain data and null function pointers, set by ibv_create_qp_ex if asked for.
    let ex: ibv_qp_ex_tail = unsafe { std::mem::zeroed() };
    let pending = Mutex::new(Some(Vec::new()));
    let bounce = match Bounce::new(&p.rt, caps.max_inline_data) {
        Ok(b) => Mutex::new(b),
        Err(e) => return fail(e.errno()),
    };
    let q: *mut ibv_qp = Box::into_raw(Box::new(Qp { ibv, ex, rt: Arc::new(rt), pending, bounce })).cast();
    ctx.qps.insert(qpn, q);
    q
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a QP from ibv_create_qp.
    let q = unsafe { Box::from_raw(qp.cast::<Qp>()) };
    // SAFETY: its context is live.
    unsafe { Ctx::from_ibv(q.ibv.context) }.qps.remove(q.ibv.qp_num);
    drop(q); // flushes and destroys
    0
}

fn qp_state(s: c_int) -> Option<QpState> {
    Some(match s {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        6 => QpState::Error,
        _ => return None,
    })
}

fn state_num(s: QpState) -> c_int {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Sqd => 4,
        QpState::Sqe => 5,
        QpState::Error => 6,
    }
}

/// `ibv_modify_qp`: the attributes `mask` names, through the runtime's modify table.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    if qp.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live QP and the caller's attributes.
    let (q, a) = unsafe { (&mut *qp.cast::<Qp>(), &*attr) };
    let mask = QpAttrMask(mask as u32);
    let Some(full) = rt_attr(a, mask) else { return libc::EINVAL };
    match guard_rt(|| q.rt.modify_masked(&full, mask)) {
        Ok(()) => {
            if mask.contains(QpAttrMask::STATE) {
                q.ibv.state = a.qp_state;
            }
            0
        }
        Err(softrdma::Error::Modify(ModifyError::Unsupported(_))) => libc::EOPNOTSUPP,
        Err(e) => e.errno(),
    }
}

/// The runtime's attributes from the C ones, every field the mask may name filled in;
/// `None` if a named value is out of range.
fn rt_attr(a: &ibv_qp_attr, mask: QpAttrMask) -> Option<QpAttr> {
    let has = |bit| mask.contains(bit);
    let remote = if has(QpAttrMask::AV) {
        if a.ah_attr.is_global == 0 {
            // RoCE addresses by GID; a LID-only address vector names nobody.
            return None;
        }
        Some(SocketAddr::new(addr_of_gid(a.ah_attr.grh.dgid.raw), softrdma::default_port()))
    } else {
        None
    };
    Some(QpAttr {
        state: if has(QpAttrMask::STATE) { Some(qp_state(a.qp_state)?) } else { None },
        pkey_index: Some(a.pkey_index),
        port: Some(a.port_num),
        access_flags: Some(Access::from_bits(a.qp_access_flags)),
        qkey: Some(Qkey(a.qkey)),
        path_mtu: if has(QpAttrMask::PATH_MTU) { Some(Mtu::from_enum(a.path_mtu as u8)?) } else { None },
        remote,
        traffic_class: Some(a.ah_attr.grh.traffic_class),
        dest_qpn: Some(Qpn::new(a.dest_qp_num & 0xFF_FFFF)),
        rq_psn: Some(Psn::new(a.rq_psn & 0xFF_FFFF)),
        sq_psn: Some(Psn::new(a.sq_psn & 0xFF_FFFF)),
        max_rd_atomic: Some(a.max_rd_atomic),
        max_dest_rd_atomic: Some(a.max_dest_rd_atomic),
        min_rnr_timer: Some(a.min_rnr_timer),
        timeout: Some(a.timeout),
        retry_cnt: Some(a.retry_cnt),
        rnr_retry: Some(a.rnr_retry),
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    if qp.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live QP.
    let q = unsafe { qp_of(qp) };
    let (a, init) = match q.rt.query() {
        Ok(v) => v,
        Err(e) => return e.errno(),
    };
    let mut o = ibv_qp_attr::default();
    o.qp_state = a.state.map_or(0, state_num);
    o.cur_qp_state = o.qp_state;
    o.path_mtu = a.path_mtu.map_or(0, |m| m as c_int);
    o.qkey = a.qkey.map_or(0, |k| k.0);
    o.rq_psn = a.rq_psn.map_or(0, |p| p.get());
    o.sq_psn = a.sq_psn.map_or(0, |p| p.get());
    o.dest_qp_num = a.dest_qpn.map_or(0, |n| n.get());
    o.qp_access_flags = a.access_flags.map_or(0, |f| f.bits());
    o.cap = ibv_qp_cap {
        max_send_wr: init.caps.max_send_wr,
        max_recv_wr: init.caps.max_recv_wr,
        max_send_sge: init.caps.max_send_sge,
        max_recv_sge: init.caps.max_recv_sge,
        max_inline_data: init.caps.max_inline_data,
    };
    if let Some(r) = a.remote {
        o.ah_attr.is_global = 1;
        o.ah_attr.grh.dgid = ibv_gid { raw: softrdma::gid_of(r.ip()) };
        o.ah_attr.grh.hop_limit = 64;
        o.ah_attr.grh.traffic_class = a.traffic_class.unwrap_or(0);
        o.ah_attr.port_num = 1;
    }
    o.pkey_index = a.pkey_index.unwrap_or(0);
    o.max_rd_atomic = a.max_rd_atomic.unwrap_or(0);
    o.max_dest_rd_atomic = a.max_dest_rd_atomic.unwrap_or(0);
    o.min_rnr_timer = a.min_rnr_timer.unwrap_or(0);
    o.port_num = a.port.unwrap_or(1);
    o.timeout = a.timeout.unwrap_or(0);
    o.retry_cnt = a.retry_cnt.unwrap_or(0);
    o.rnr_retry = a.rnr_retry.unwrap_or(0);
    // SAFETY: the caller's out-structures.
    unsafe {
        *attr = o;
        if !init_attr.is_null() {
            let i = &mut *init_attr;
            i.qp_context = q.ibv.qp_context;
            i.send_cq = q.ibv.send_cq;
            i.recv_cq = q.ibv.recv_cq;
            i.srq = q.ibv.srq;
            i.cap = o.cap;
            i.qp_type = q.ibv.qp_type;
            i.sq_sig_all = c_int::from(init.sq_sig_all);
        }
    }
    0
}

/// The scatter/gather list of a C work request.
///
/// # Safety
/// `sg` points to `n` entries (or `n` is 0).
unsafe fn sges(sg: *const ibv_sge, n: c_int) -> Option<softrdma::SgList> {
    if n < 0 || (n > 0 && sg.is_null()) {
        return None;
    }
    // SAFETY: by the contract.
    let list = if n == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(sg, n as usize) } };
    Some(list.iter().map(|s| Sge { addr: s.addr, length: s.length, lkey: softrdma::Lkey(s.lkey) }).collect())
}

/// `ibv_send_flags` as the runtime names them.
fn send_flags(f: c_uint) -> SendFlags {
    SendFlags {
        signaled: f & IBV_SEND_SIGNALED != 0,
        solicited: f & IBV_SEND_SOLICITED != 0,
        fence: f & IBV_SEND_FENCE != 0,
        inline: f & IBV_SEND_INLINE != 0,
    }
}

/// The runtime's work request for a C one; `None` for an opcode or shape softrdma refuses.
///
/// # Safety
/// `w` is a valid work request whose `sg_list` and (for UD) `ah` are valid.
unsafe fn send_wr(w: &ibv_send_wr, ud: bool) -> Option<SendWr> {
    // SAFETY: the union's member is chosen by opcode and QP type, as verbs defines.
    let (rdma, atomic, udw) = unsafe { (w.wr.rdma, w.wr.atomic, w.wr.ud) };
    let op = match w.opcode {
        IBV_WR_SEND => SendOp::Send,
        IBV_WR_SEND_WITH_IMM => SendOp::SendWithImm(u32::from_be(w.imm_data)),
        IBV_WR_SEND_WITH_INV => SendOp::SendWithInv(Rkey(w.imm_data)),
        IBV_WR_RDMA_WRITE => SendOp::Write { remote_addr: rdma.remote_addr, rkey: Rkey(rdma.rkey) },
        IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::WriteWithImm {
            remote_addr: rdma.remote_addr,
            rkey: Rkey(rdma.rkey),
            imm: u32::from_be(w.imm_data),
        },
        IBV_WR_RDMA_READ => SendOp::Read { remote_addr: rdma.remote_addr, rkey: Rkey(rdma.rkey) },
        IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CompareSwap {
            remote_addr: atomic.remote_addr,
            rkey: Rkey(atomic.rkey),
            compare: atomic.compare_add,
            swap: atomic.swap,
        },
        IBV_WR_ATOMIC_FETCH_AND_ADD => SendOp::FetchAdd {
            remote_addr: atomic.remote_addr,
            rkey: Rkey(atomic.rkey),
            add: atomic.compare_add,
        },
        _ => return None,
    };
    let flags = send_flags(w.send_flags);
    let ud = if ud {
        if udw.ah.is_null() {
            return None;
        }
        // SAFETY: a live AH.
        let ah: &AddressHandle = unsafe { &(*udw.ah.cast::<Ah>()).rt };
        Some(ah.dest(Qpn::new(udw.remote_qpn & 0xFF_FFFF), Qkey(udw.remote_qkey)))
    } else {
        None
    };
    // SAFETY: by the contract.
    let sg_list = unsafe { sges(w.sg_list, w.num_sge) }?;
    Some(SendWr { wr_id: w.wr_id, op, sg_list, flags, ud })
}

/// Posts a C linked list of work requests one by one with `post_one` (an errno value, 0
/// on success); on the first failure stores that request in `*bad_wr` and returns the error.
///
/// # Safety
/// `head` is a valid linked list (`next` gives each request's successor); `bad_wr` is
/// NULL or writable.
unsafe fn post_list<W>(
    head: *mut W,
    bad_wr: *mut *mut W,
    next: impl Fn(&W) -> *mut W,
    mut post_one: impl FnMut(&W) -> c_int,
) -> c_int {
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: by the contract.
        let w = unsafe { &*cur };
        let r = post_one(w);
        if r != 0 {
            if !bad_wr.is_null() {
                // SAFETY: by the contract.
                unsafe { *bad_wr = cur };
            }
            return r;
        }
        cur = next(w);
    }
    0
}

/// `ops.post_send`.
pub(crate) unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live QP.
    let q = unsafe { qp_of(qp) };
    let ud = q.ibv.qp_type == IBV_QPT_UD;
    // Posts one request, converted (None: malformed).
    let one = |sw: Option<SendWr>| match sw {
        None => libc::EINVAL,
        Some(sw) if sw.flags.inline && sends_data(&sw.op) => {
            // The SGEs' lkeys do not matter for inline data (verbs' rule).
            let limit = q.ibv_cap_inline();
            if sw.sg_list.iter().map(|s| u64::from(s.length)).sum::<u64>() > u64::from(limit) {
                return libc::EINVAL;
            }
            // SAFETY: the program's SGEs name readable memory (verbs' contract), and the
            // total was bounded above.
            unsafe { post_inline(q, sw) }
        }
        Some(sw) => errno_of(guard_rt(|| q.rt.post_send(sw))),
    };
    // SAFETY (every `send_wr` below): each request comes from the caller's valid list,
    // sg_list and AH included.
    let one_by_one = || unsafe { post_list(wr, bad_wr, |w| w.next, |w| one(send_wr(w, ud))) };
    // SAFETY: as above.
    if wr.is_null() || unsafe { (*wr).next.is_null() } {
        return one_by_one();
    }
    // A list: its WRs go to the engine in runs (one call, one pass, their packets in as
    // few system calls as the doorbell allows), in the thread's reused buffers. An inline
    // WR or a malformed one ends a run.
    let batched = POSTS.try_with(|cell| {
        let Ok(mut bufs) = cell.try_borrow_mut() else {
            // Re-entered: one by one.
            return one_by_one();
        };
        let (run, from) = &mut *bufs;
        run.clear();
        from.clear();
        let fail = |at: *mut ibv_send_wr, e: c_int| {
            if !bad_wr.is_null() {
                // SAFETY: by the contract, `bad_wr` is NULL or writable.
                unsafe { *bad_wr = at };
            }
            e
        };
        let flush = |run: &mut Vec<SendWr>, from: &mut Vec<*mut ibv_send_wr>| -> c_int {
            if run.is_empty() {
                return 0;
            }
            // A panic inside softrdma (a bug) names the run's first WR, though some of the
            // run may have been posted.
            let on_panic = Err((0, softrdma::Error::InvalidArgument("a panic inside softrdma")));
            let r = crate::guard(on_panic, || q.rt.post_send_many(run.drain(..)));
            let r = match r {
                Ok(_) => 0,
                Err((n, e)) => fail(from[n.min(from.len() - 1)], e.errno()),
            };
            from.clear();
            r
        };
        let mut cur = wr;
        while !cur.is_null() {
            // SAFETY: by the contract.
            let w = unsafe { &*cur };
            // SAFETY: as above.
            match unsafe { send_wr(w, ud) } {
                Some(sw) if !(sw.flags.inline && sends_data(&sw.op)) => {
                    run.push(sw);
                    from.push(cur);
                    if run.len() == POST_RUN {
                        let r = flush(run, from);
                        if r != 0 {
                            return r;
                        }
                    }
                }
                other => {
                    let r = flush(run, from);
                    if r != 0 {
                        return r;
                    }
                    let r = one(other);
                    if r != 0 {
                        return fail(cur, r);
                    }
                }
            }
            cur = w.next;
        }
        flush(run, from)
    });
    // The thread's buffers are gone (a post from a destructor at thread exit): one by one.
    batched.unwrap_or_else(|_| one_by_one())
}

/// The most WRs of a list posted in one engine call.
const POST_RUN: usize = 64;

thread_local! {
    /// A list's run of send WRs and the C requests they came from, reused from post to
    /// post (no allocation once they have grown).
    static POSTS: std::cell::RefCell<(Vec<SendWr>, Vec<*mut ibv_send_wr>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Posts a C receive list through `post`.
///
/// # Safety
/// `wr` is a valid linked list of receive work requests; `bad_wr` is NULL or writable.
unsafe fn post_recv_list(
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
    post: impl Fn(RecvWr) -> softrdma::Result<()>,
) -> c_int {
    // SAFETY: by the contract.
    unsafe {
        post_list(
            wr,
            bad_wr,
            |w| w.next,
            |w| match sges(w.sg_list, w.num_sge) {
                None => libc::EINVAL,
                Some(sg_list) => errno_of(guard_rt(|| post(RecvWr { wr_id: w.wr_id, sg_list }))),
            },
        )
    }
}

/// `ops.post_recv`.
pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live QP.
    let q = unsafe { qp_of(qp) };
    // SAFETY: the caller's list.
    unsafe { post_recv_list(wr, bad_wr, |w| q.rt.post_recv(w)) }
}

// ---- Shared receive queues -----------------------------------------------------------

#[repr(C)]
pub(crate) struct Srq {
    ibv: ibv_srq,
    rt: SharedReceiveQueue,
    attr: ibv_srq_attr,
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(pd: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    if pd.is_null() || attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: a live PD and the caller's attributes.
    let (p, a) = unsafe { (pd_of(pd), &mut *attr) };
    let max_sge = a.attr.max_sge.max(1);
    match p.rt.create_srq(a.attr.max_wr, max_sge) {
        Ok(rt) => {
            // SAFETY: plain data; pointers set below.
            let mut ibv: ibv_srq = unsafe { std::mem::zeroed() };
            ibv.context = p.ibv.context;
            ibv.srq_context = a.srq_context;
            ibv.pd = pd;
            a.attr.max_sge = max_sge;
            let attr = a.attr;
            Box::into_raw(Box::new(Srq { ibv, rt, attr })).cast()
        }
        Err(e) => fail(e.errno()),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    if srq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: an SRQ from ibv_create_srq whose QPs are destroyed.
    drop(unsafe { Box::from_raw(srq.cast::<Srq>()) });
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    if srq.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live SRQ; the caller's out-structure.
    unsafe { *attr = (*srq.cast::<Srq>()).attr };
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(srq: *mut ibv_srq, _attr: *mut ibv_srq_attr, _mask: c_int) -> c_int {
    if srq.is_null() {
        return libc::EINVAL;
    }
    // Resizing and the limit event are not offered.
    libc::EOPNOTSUPP
}

/// `ops.post_srq_recv`.
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    if srq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live SRQ.
    let s = unsafe { &*srq.cast::<Srq>() };
    // SAFETY: the caller's list.
    unsafe { post_recv_list(wr, bad_wr, |w| s.rt.post_recv(w)) }
}

// ---- Address handles -----------------------------------------------------------------

#[repr(C)]
pub(crate) struct Ah {
    ibv: ibv_ah,
    rt: AddressHandle,
}

fn new_ah(pd: *mut ibv_pd, p: &Pd, r: softrdma::Result<AddressHandle>) -> *mut ibv_ah {
    match r {
        Ok(rt) => {
            let ibv = ibv_ah { context: p.ibv.context, pd, handle: 0 };
            Box::into_raw(Box::new(Ah { ibv, rt })).cast()
        }
        Err(e) => fail(e.errno()),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    if pd.is_null() || attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: a live PD and the caller's attributes.
    let (p, a) = unsafe { (pd_of(pd), &*attr) };
    if a.is_global == 0 {
        return fail(libc::EINVAL); // RoCE needs a GRH
    }
    let attr = AhAttr {
        dgid: a.grh.dgid.raw,
        sgid_index: Some(a.grh.sgid_index),
        // 20 bits on the wire; UCX passes 0xffffffff, which hardware providers truncate.
        flow_label: a.grh.flow_label & 0xF_FFFF,
        hop_limit: a.grh.hop_limit,
        traffic_class: a.grh.traffic_class,
        port_num: a.port_num,
        udp_port: None,
    };
    new_ah(pd, p, p.rt.create_ah(&attr))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut u8,
    _port: u8,
) -> *mut ibv_ah {
    if pd.is_null() || wc.is_null() || grh.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: a live PD, the caller's completion and its 40-byte GRH area.
    let (p, w, g) = unsafe { (pd_of(pd), &*wc, std::slice::from_raw_parts(grh, 40)) };
    if w.wc_flags & IBV_WC_GRH == 0 {
        return fail(libc::EINVAL);
    }
    let rt_wc = WorkCompletion {
        grh: true,
        src: None,
        qp_num: Qpn::new(w.qp_num & 0xFF_FFFF),
        src_qp: Qpn::new(w.src_qp & 0xFF_FFFF),
        ..softrdma::EMPTY_WC
    };
    new_ah(pd, p, p.rt.create_ah_from_wc(&rt_wc, Some(g)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    if ah.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: an AH from ibv_create_ah; posted sends hold their own copy of the address.
    drop(unsafe { Box::from_raw(ah.cast::<Ah>()) });
    0
}

// ---- Not offered ---------------------------------------------------------------------

/// Attaches a UD QP to the multicast group of an MGID (`::ffff:a.b.c.d` for an IPv4
/// group, as RoCE v2 maps it; the LID is ignored, RoCE has none).
#[no_mangle]
pub unsafe extern "C" fn ibv_attach_mcast(qp: *mut ibv_qp, gid: *const [u8; 16], _lid: u16) -> c_int {
    if qp.is_null() || gid.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller's GID, 16 bytes.
    let Some(group) = softrdma::mcast::group_of_mgid(unsafe { ptr::read_unaligned(gid) }) else {
        return libc::EINVAL;
    };
    // SAFETY: a live QP.
    let q = unsafe { qp_of(qp) };
    errno_of(guard_rt(|| q.rt.attach_mcast(group).map(|_| ())))
}

/// Detaches a QP from the group of an MGID.
#[no_mangle]
pub unsafe extern "C" fn ibv_detach_mcast(qp: *mut ibv_qp, gid: *const [u8; 16], _lid: u16) -> c_int {
    if qp.is_null() || gid.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller's GID, 16 bytes.
    let Some(group) = softrdma::mcast::group_of_mgid(unsafe { ptr::read_unaligned(gid) }) else {
        return libc::EINVAL;
    };
    // SAFETY: a live QP.
    let q = unsafe { qp_of(qp) };
    errno_of(guard_rt(|| q.rt.detach_mcast(group)))
}

/// The `ibv_qp_ex` of a QP created by `ibv_create_qp_ex` with send operations; NULL
/// (EOPNOTSUPP) for others, which programs check.
#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp {
    // SAFETY: a live QP.
    if qp.is_null() || unsafe { qp_of(qp) }.ex.wr_start.is_none() {
        return fail(libc::EOPNOTSUPP);
    }
    qp
}

// ---- Extended QPs: `ibv_create_qp_ex` and the `ibv_wr_*` API ---------------------------

/// `verbs_context.create_qp_ex`.
pub(crate) unsafe extern "C" fn create_qp_ex(
    context: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    if context.is_null() || attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &mut *attr };
    let known = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    if a.comp_mask & !known != 0 || a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 {
        return fail(libc::EOPNOTSUPP);
    }
    let mut init = ibv_qp_init_attr {
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
    };
    // SAFETY: forwarded.
    let qp = unsafe { ibv_create_qp(a.pd, &mut init) };
    if qp.is_null() {
        return qp;
    }
    a.cap = init.cap;
    if a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
        // SAFETY: just created.
        let ex = unsafe { &mut (*qp.cast::<Qp>()).ex };
        ex.wr_start = Some(wr_start);
        ex.wr_complete = Some(wr_complete);
        ex.wr_abort = Some(wr_abort);
        ex.wr_send = Some(wr_send);
        ex.wr_send_imm = Some(wr_send_imm);
        ex.wr_rdma_write = Some(wr_rdma_write);
        ex.wr_rdma_write_imm = Some(wr_rdma_write_imm);
        ex.wr_rdma_read = Some(wr_rdma_read);
        ex.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
        ex.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
        ex.wr_set_sge = Some(wr_set_sge);
        ex.wr_set_sge_list = Some(wr_set_sge_list);
        ex.wr_set_ud_addr = Some(wr_set_ud_addr);
        ex.wr_set_inline_data = Some(wr_set_inline_data);
        ex.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    }
    qp
}

/// Runs `f` on the QP's pending list (nothing if an earlier call spoiled it).
///
/// # Safety
/// `qp` is a live QP.
unsafe fn with_pending(qp: *mut ibv_qp, f: impl FnOnce(&Qp, &mut Vec<PendingWr>) -> Option<()>) {
    // SAFETY: by the contract.
    let q = unsafe { qp_of(qp) };
    let mut p = q.pending.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(list) = p.as_mut() {
        if f(q, list).is_none() {
            *p = None;
        }
    }
}

/// A new work request of the operation, with the QP's `wr_id` and `wr_flags`.
unsafe fn wr_new(qp: *mut ibv_qp, op: SendOp) {
    // SAFETY: forwarded.
    unsafe {
        with_pending(qp, |q, list| {
            let flags = send_flags(q.ex.wr_flags);
            list.push((
                SendWr { wr_id: q.ex.wr_id, op, sg_list: softrdma::SgList::new(), flags, ud: None },
                None,
            ));
            Some(())
        })
    }
}

unsafe extern "C" fn wr_start(qp: *mut ibv_qp) {
    // SAFETY: a live QP.
    *unsafe { qp_of(qp) }.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
}

unsafe extern "C" fn wr_abort(qp: *mut ibv_qp) {
    // SAFETY: forwarded.
    unsafe { wr_start(qp) };
}

unsafe extern "C" fn wr_complete(qp: *mut ibv_qp) -> c_int {
    // SAFETY: a live QP.
    let q = unsafe { qp_of(qp) };
    let taken = q.pending.lock().unwrap_or_else(|e| e.into_inner()).replace(Vec::new());
    let Some(list) = taken else { return libc::EINVAL };
    for (w, data) in list {
        let r = match data {
            Some(d) => {
                let mut w = w;
                w.sg_list.clear();
                w.sg_list.push(Sge {
                    addr: d.as_ptr() as u64,
                    length: d.len() as u32,
                    lkey: softrdma::Lkey(0),
                });
                // SAFETY: the one SGE names `d`, alive through the call.
                unsafe { post_inline(q, w) }
            }
            None => errno_of(guard_rt(|| q.rt.post_send(w))),
        };
        if r != 0 {
            return r;
        }
    }
    0
}

unsafe extern "C" fn wr_send(qp: *mut ibv_qp) {
    // SAFETY: forwarded.
    unsafe { wr_new(qp, SendOp::Send) }
}
unsafe extern "C" fn wr_send_imm(qp: *mut ibv_qp, imm: u32) {
    // SAFETY: forwarded.
    unsafe { wr_new(qp, SendOp::SendWithImm(u32::from_be(imm))) }
}
unsafe extern "C" fn wr_rdma_write(qp: *mut ibv_qp, rkey: u32, remote_addr: u64) {
    // SAFETY: forwarded.
    unsafe { wr_new(qp, SendOp::Write { remote_addr, rkey: Rkey(rkey) }) }
}
unsafe extern "C" fn wr_rdma_write_imm(qp: *mut ibv_qp, rkey: u32, remote_addr: u64, imm: u32) {
    // SAFETY: forwarded.
    unsafe { wr_new(qp, SendOp::WriteWithImm { remote_addr, rkey: Rkey(rkey), imm: u32::from_be(imm) }) }
}
unsafe extern "C" fn wr_rdma_read(qp: *mut ibv_qp, rkey: u32, remote_addr: u64) {
    // SAFETY: forwarded.
    unsafe { wr_new(qp, SendOp::Read { remote_addr, rkey: Rkey(rkey) }) }
}
unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut ibv_qp,
    rkey: u32,
    remote_addr: u64,
    compare: u64,
    swap: u64,
) {
    // SAFETY: forwarded.
    unsafe { wr_new(qp, SendOp::CompareSwap { remote_addr, rkey: Rkey(rkey), compare, swap }) }
}
unsafe extern "C" fn wr_atomic_fetch_add(qp: *mut ibv_qp, rkey: u32, remote_addr: u64, add: u64) {
    // SAFETY: forwarded.
    unsafe { wr_new(qp, SendOp::FetchAdd { remote_addr, rkey: Rkey(rkey), add }) }
}

unsafe extern "C" fn wr_set_sge(qp: *mut ibv_qp, lkey: u32, addr: u64, length: u32) {
    // SAFETY: forwarded.
    unsafe {
        with_pending(qp, |_, list| {
            list.last_mut()?.0.sg_list = softrdma::sgl![Sge { addr, length, lkey: softrdma::Lkey(lkey) }];
            Some(())
        })
    }
}

unsafe extern "C" fn wr_set_sge_list(qp: *mut ibv_qp, n: usize, sg: *const ibv_sge) {
    // SAFETY: the caller's list of n entries.
    let list = unsafe { sges(sg, c_int::try_from(n).unwrap_or(-1)) };
    // SAFETY: forwarded.
    unsafe {
        with_pending(qp, |_, pending| {
            pending.last_mut()?.0.sg_list = list?;
            Some(())
        })
    }
}

unsafe extern "C" fn wr_set_ud_addr(qp: *mut ibv_qp, ah: *mut ibv_ah, remote_qpn: u32, remote_qkey: u32) {
    // SAFETY: forwarded; a live AH or NULL.
    unsafe {
        with_pending(qp, |_, list| {
            let ah: &AddressHandle = &ah.cast::<Ah>().as_ref()?.rt;
            list.last_mut()?.0.ud = Some(ah.dest(Qpn::new(remote_qpn & 0xFF_FFFF), Qkey(remote_qkey)));
            Some(())
        })
    }
}

/// The request's payload, copied now (from memory that need not be registered).
unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp, addr: *mut c_void, len: usize) {
    let one = ibv_data_buf { addr, length: len };
    // SAFETY: forwarded; one buffer.
    unsafe { wr_set_inline_data_list(qp, 1, &one) }
}

unsafe extern "C" fn wr_set_inline_data_list(qp: *mut ibv_qp, n: usize, bufs: *const ibv_data_buf) {
    // SAFETY: forwarded.
    unsafe {
        with_pending(qp, |q, list| {
            let bufs = if n == 0 { &[][..] } else { std::slice::from_raw_parts(bufs.as_ref()?, n) };
            if bufs.iter().map(|b| b.length as u64).sum::<u64>() > u64::from(q.ibv_cap_inline()) {
                return None;
            }
            let mut data = Vec::new();
            for b in bufs {
                // SAFETY: the program's buffers (verbs' contract), bounded above.
                data.extend_from_slice(raw_bytes(b.addr as u64, b.length));
            }
            let last = list.last_mut()?;
            if !sends_data(&last.0.op) {
                return None;
            }
            last.1 = Some(data);
            Some(())
        })
    }
}

/// `len` bytes at `addr` (empty for a zero length, whatever the address).
///
/// # Safety
/// Unless `len` is 0, `addr` points to `len` readable bytes.
unsafe fn raw_bytes<'a>(addr: u64, len: usize) -> &'a [u8] {
    if len == 0 || addr == 0 {
        return &[];
    }
    // SAFETY: by the contract.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(_cq: *mut ibv_cq, _cqe: c_int) -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub unsafe extern "C" fn ibv_wc_status_str(status: c_int) -> *const std::ffi::c_char {
    let s: &std::ffi::CStr = match status {
        0 => c"success",
        1 => c"local length error",
        2 => c"local QP operation error",
        3 => c"local EE context operation error",
        4 => c"local protection error",
        5 => c"Work Request Flushed Error",
        6 => c"memory management operation error",
        7 => c"bad response error",
        8 => c"local access error",
        9 => c"remote invalid request error",
        10 => c"remote access error",
        11 => c"remote operation error",
        12 => c"transport retry counter exceeded",
        13 => c"RNR retry counter exceeded",
        14 => c"local RDD violation error",
        15 => c"remote invalid RD request",
        16 => c"aborted error",
        17 => c"invalid EE context number",
        18 => c"invalid EE context state",
        19 => c"fatal error",
        20 => c"response timeout error",
        21 => c"general error",
        22 => c"TM error",
        23 => c"TM Rendezvous Request Error",
        _ => c"unknown",
    };
    s.as_ptr()
}
