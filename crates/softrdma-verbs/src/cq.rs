//! Completion channels and CQs: `ibv_create_comp_channel`, `ibv_create_cq` and the
//! extended `ibv_create_cq_ex` (`start_poll`/`next_poll`/`end_poll` and the `read_*`
//! accessors, with completion timestamps), `ibv_get_cq_event` (blocking, or EAGAIN when
//! the channel's fd is non-blocking, as UCX sets it), and the data-path operations
//! `poll_cq` and `req_notify_cq` of `context->ops`.

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::Mutex;

use softrdma::{CompletionChannel, CompletionQueue, CqOptions, WcOpcode, WorkCompletion};

use crate::abi::*;
use crate::{nonblocking, set_errno, Ctx};

fn fail<T>(e: c_int) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}

#[repr(C)]
struct Channel {
    ibv: ibv_comp_channel,
    rt: CompletionChannel,
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(context: *mut ibv_context) -> *mut ibv_comp_channel {
    if context.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: a context from ibv_open_device.
    let ctx = unsafe { Ctx::from_ibv(context) };
    match ctx.rt.create_channel() {
        Ok(rt) => {
            use std::os::fd::AsRawFd;
            let ibv = ibv_comp_channel { context, fd: rt.as_raw_fd(), refcnt: 0 };
            Box::into_raw(Box::new(Channel { ibv, rt })).cast()
        }
        Err(e) => fail(e.errno()),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int {
    if channel.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a channel from ibv_create_comp_channel.
    if unsafe { (*channel).refcnt } > 0 {
        return libc::EBUSY;
    }
    // SAFETY: as above; no CQ uses it any more.
    drop(unsafe { Box::from_raw(channel.cast::<Channel>()) });
    0
}

#[repr(C)]
pub(crate) struct Cq {
    ibv: ibv_cq,
    /// Right after `ibv_cq`, so that every CQ is also an `ibv_cq_ex`; `start_poll` and
    /// `next_poll` write `status` and `wr_id` here, where the application reads them.
    ex: UnsafeCell<ibv_cq_ex_tail>,
    pub(crate) rt: CompletionQueue,
    /// The completion `start_poll`/`next_poll` took last, and when it was delivered.
    current: Mutex<(ibv_wc, u64)>,
}

/// # Safety
/// `cq` is a live CQ from [`ibv_create_cq`].
pub(crate) unsafe fn cq_of<'a>(cq: *mut ibv_cq) -> &'a Cq {
    // SAFETY: by the contract.
    unsafe { &*cq.cast::<Cq>() }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    if cqe <= 0 {
        return fail(libc::EINVAL);
    }
    // SAFETY: forwarded from the caller.
    unsafe { new_cq(context, cqe as u32, cq_context, channel, CqOptions::default()) }
}

/// `verbs_context.create_cq_ex`: a CQ polled with `ibv_start_poll` and friends (also usable
/// with `ibv_poll_cq` through `ibv_cq_ex_to_cq`).
pub(crate) unsafe extern "C" fn create_cq_ex(
    context: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq {
    if attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &*attr };
    if a.wc_flags & !SUPPORTED_WC_EX_FLAGS != 0
        || a.comp_mask & !IBV_CQ_INIT_ATTR_MASK_FLAGS != 0
        || (a.comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS != 0
            && a.flags & !IBV_CREATE_CQ_ATTR_SINGLE_THREADED != 0)
    {
        // Parent domains and IGNORE_OVERRUN are not offered; callers fall back on this.
        return fail(libc::EOPNOTSUPP);
    }
    let timestamps = a.wc_flags
        & (IBV_WC_EX_WITH_COMPLETION_TIMESTAMP | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK)
        != 0;
    let opts = if timestamps { CqOptions::timestamped() } else { CqOptions::default() };
    // SAFETY: forwarded from the caller.
    unsafe { new_cq(context, a.cqe, a.cq_context, a.channel, opts) }
}

/// # Safety
/// `context` from `ibv_open_device` (or NULL); `channel` NULL or from
/// `ibv_create_comp_channel` on it.
unsafe fn new_cq(
    context: *mut ibv_context,
    cqe: u32,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    opts: CqOptions,
) -> *mut ibv_cq {
    if context.is_null() || cqe == 0 || cqe as usize > softrdma::MAX_CQE {
        return fail(libc::EINVAL);
    }
    // SAFETY: by the contract.
    let ctx = unsafe { Ctx::from_ibv(context) };
    // SAFETY: as above.
    let ch = (!channel.is_null()).then(|| unsafe { &(*channel.cast::<Channel>()).rt });
    let rt = match ctx.rt.create_cq_with(cqe as usize, ch, opts) {
        Ok(rt) => rt,
        Err(e) => return fail(e.errno()),
    };
    // SAFETY: plain data; the pointers are set here.
    let mut ibv: ibv_cq = unsafe { std::mem::zeroed() };
    ibv.context = context;
    ibv.channel = channel;
    ibv.cq_context = cq_context;
    ibv.handle = rt.id();
    ibv.cqe = rt.capacity() as c_int;
    if !channel.is_null() {
        // SAFETY: a live channel.
        unsafe { (*channel).refcnt += 1 };
    }
    let ex = ibv_cq_ex_tail {
        comp_mask: 0,
        status: 0,
        wr_id: 0,
        start_poll: Some(start_poll),
        next_poll: Some(next_poll),
        end_poll: Some(end_poll),
        read_opcode: Some(read_opcode),
        read_vendor_err: Some(read_vendor_err),
        read_byte_len: Some(read_byte_len),
        read_imm_data: Some(read_imm_data),
        read_qp_num: Some(read_qp_num),
        read_src_qp: Some(read_src_qp),
        read_wc_flags: Some(read_wc_flags),
        read_slid: Some(read_slid),
        read_sl: Some(read_sl),
        read_dlid_path_bits: Some(read_dlid_path_bits),
        read_completion_ts: Some(read_completion_ts),
        read_cvlan: std::ptr::null_mut(),
        read_flow_tag: std::ptr::null_mut(),
        read_tm_info: std::ptr::null_mut(),
        read_completion_wallclock_ns: Some(read_completion_wallclock_ns),
    };
    let id = rt.id();
    let current = Mutex::new((to_ibv_wc(&softrdma::EMPTY_WC), 0));
    let p: *mut ibv_cq = Box::into_raw(Box::new(Cq { ibv, ex: UnsafeCell::new(ex), rt, current })).cast();
    ctx.cqs.insert(id, p);
    p
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a CQ from ibv_create_cq, its QPs destroyed (verbs' rule).
    let c = unsafe { Box::from_raw(cq.cast::<Cq>()) };
    // SAFETY: its context is live.
    unsafe { Ctx::from_ibv(c.ibv.context) }.cqs.remove(c.rt.id());
    if !c.ibv.channel.is_null() {
        // SAFETY: the channel outlives its CQs.
        unsafe { (*c.ibv.channel).refcnt -= 1 };
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    if channel.is_null() || cq.is_null() || cq_context.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: a live channel.
    let ch = unsafe { &*channel.cast::<Channel>() };
    // SAFETY: its context is live.
    let ctx = unsafe { Ctx::from_ibv(ch.ibv.context) };
    let nonblock = nonblocking(ch.ibv.fd);
    // Waits on a handle of its own, as rdma_get_cm_event does: a channel destroyed while
    // this thread waits must not leave it in freed memory.
    let rt = ch.rt.clone();
    loop {
        let got = if nonblock {
            rt.try_get_event().ok_or(libc::EAGAIN)
        } else {
            rt.get_event().map_err(|e| e.errno())
        };
        match got {
            Ok(rt) => {
                let p = ctx.cqs.get(rt.id());
                if p.is_null() {
                    continue; // destroyed since it was armed
                }
                // SAFETY: out-pointers from the caller; p is a live CQ.
                unsafe {
                    *cq = p;
                    *cq_context = (*p).cq_context;
                }
                return 0;
            }
            Err(e) => {
                set_errno(e);
                return -1;
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint) {
    if cq.is_null() {
        return;
    }
    // SAFETY: a live CQ.
    let c = unsafe { &mut *cq.cast::<Cq>() };
    c.ibv.comp_events_completed = c.ibv.comp_events_completed.wrapping_add(nevents);
    if !c.ibv.channel.is_null() {
        // SAFETY: the channel outlives its CQs.
        unsafe { &*c.ibv.channel.cast::<Channel>() }.rt.ack_events(nevents as usize);
    }
}

pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live CQ.
    match unsafe { cq_of(cq) }.rt.req_notify(solicited_only != 0) {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}

fn wc_opcode(op: WcOpcode) -> c_int {
    match op {
        WcOpcode::Send => IBV_WC_SEND,
        WcOpcode::RdmaWrite => IBV_WC_RDMA_WRITE,
        WcOpcode::RdmaRead => IBV_WC_RDMA_READ,
        WcOpcode::CompareSwap => IBV_WC_COMP_SWAP,
        WcOpcode::FetchAdd => IBV_WC_FETCH_ADD,
        WcOpcode::Recv => IBV_WC_RECV,
        WcOpcode::RecvRdmaWithImm => IBV_WC_RECV_RDMA_WITH_IMM,
    }
}

/// For a UD receive, the kind of header in its 40-byte GRH area, in `wc.sl` as RoCE NICs
/// report it (IBTA Annex A17.4.5.1 asks the CQE for the L3 type; ConnectX puts it in the
/// SL bits: 2 for IPv4, 1 for IPv6). UCX reads it to find the destination address it
/// checks, at bytes 36..40 (IPv4) or 24..40 (IPv6). 0 for everything else.
fn roce_l3_type(w: &WorkCompletion) -> u8 {
    match (w.grh, w.src) {
        (true, Some(std::net::SocketAddr::V4(_))) => 2,
        (true, Some(std::net::SocketAddr::V6(a))) if a.ip().to_ipv4_mapped().is_some() => 2,
        (true, Some(std::net::SocketAddr::V6(_))) => 1,
        _ => 0,
    }
}

pub(crate) fn to_ibv_wc(w: &WorkCompletion) -> ibv_wc {
    let mut flags = 0;
    let mut imm = 0;
    if w.grh {
        flags |= IBV_WC_GRH;
    }
    if let Some(v) = w.imm_data {
        flags |= IBV_WC_WITH_IMM;
        imm = v.to_be(); // network order in memory, as the wire carries it
    } else if let Some(r) = w.invalidated_rkey {
        flags |= IBV_WC_WITH_INV;
        imm = r.0;
    }
    ibv_wc {
        wr_id: w.wr_id,
        status: w.status as c_int,
        opcode: wc_opcode(w.opcode),
        vendor_err: 0,
        byte_len: w.byte_len,
        imm_data: imm,
        qp_num: w.qp_num.get(),
        src_qp: w.src_qp.get(),
        wc_flags: flags,
        pkey_index: 0,
        slid: 0,
        sl: roce_l3_type(w),
        dlid_path_bits: 0,
    }
}

/// `ops.poll_cq`: up to `n` completions into `wc`; the number taken, or -1.
pub(crate) unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    if cq.is_null() || n < 0 || (wc.is_null() && n > 0) {
        return -1;
    }
    // SAFETY: a live CQ.
    let c = unsafe { cq_of(cq) };
    let mut buf = [softrdma::EMPTY_WC; 16];
    let mut done = 0usize;
    while done < n as usize {
        let want = (n as usize - done).min(buf.len());
        let got = c.rt.poll(&mut buf[..want]);
        for (k, w) in buf[..got].iter().enumerate() {
            // SAFETY: wc has n entries; done + k < n.
            unsafe { *wc.add(done + k) = to_ibv_wc(w) };
        }
        done += got;
        if got < want {
            break;
        }
    }
    done as c_int
}

// ---- Extended polling: `ibv_start_poll` / `ibv_next_poll` / `ibv_end_poll` -------------

/// Takes the next completion into `current` and the `ibv_cq_ex` fields; 0 or ENOENT.
unsafe fn take_next(cq: *mut ibv_cq) -> c_int {
    // SAFETY: a live CQ (the caller's contract).
    let c = unsafe { cq_of(cq) };
    let mut one = [softrdma::EMPTY_WC];
    let mut ts = [0u64];
    if c.rt.poll_timestamped(&mut one, &mut ts) == 0 {
        return libc::ENOENT;
    }
    let wc = to_ibv_wc(&one[0]);
    // SAFETY: the application polls a CQ from one thread between start and end (verbs'
    // rule for the extended API); `ex` is only written here.
    unsafe {
        let ex = &mut *c.ex.get();
        ex.status = wc.status;
        ex.wr_id = wc.wr_id;
    }
    *c.current.lock().unwrap_or_else(|p| p.into_inner()) = (wc, ts[0]);
    0
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq, attr: *mut ibv_poll_cq_attr) -> c_int {
    // SAFETY: the caller's attributes, if any.
    if cq.is_null() || (!attr.is_null() && unsafe { (*attr).comp_mask } != 0) {
        return libc::EINVAL;
    }
    // SAFETY: a live CQ.
    unsafe { take_next(cq) }
}

unsafe extern "C" fn next_poll(cq: *mut ibv_cq) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live CQ.
    unsafe { take_next(cq) }
}

unsafe extern "C" fn end_poll(_cq: *mut ibv_cq) {}

/// The completion `start_poll`/`next_poll` took last.
unsafe fn current(cq: *mut ibv_cq) -> (ibv_wc, u64) {
    // SAFETY: a live CQ (the caller's contract).
    *unsafe { cq_of(cq) }.current.lock().unwrap_or_else(|p| p.into_inner())
}

macro_rules! reader {
    ($name:ident -> $t:ty, |$wc:ident, $ts:ident| $e:expr) => {
        unsafe extern "C" fn $name(cq: *mut ibv_cq) -> $t {
            if cq.is_null() {
                return Default::default();
            }
            // SAFETY: a live CQ.
            #[allow(unused_variables)]
            let ($wc, $ts) = unsafe { current(cq) };
            $e
        }
    };
}

reader!(read_opcode -> c_int, |wc, ts| wc.opcode);
reader!(read_vendor_err -> u32, |wc, ts| wc.vendor_err);
reader!(read_byte_len -> u32, |wc, ts| wc.byte_len);
reader!(read_imm_data -> u32, |wc, ts| wc.imm_data);
reader!(read_qp_num -> u32, |wc, ts| wc.qp_num);
reader!(read_src_qp -> u32, |wc, ts| wc.src_qp);
reader!(read_wc_flags -> c_uint, |wc, ts| wc.wc_flags);
reader!(read_slid -> u32, |wc, ts| u32::from(wc.slid));
reader!(read_sl -> u8, |wc, ts| wc.sl);
reader!(read_dlid_path_bits -> u8, |wc, ts| wc.dlid_path_bits);
reader!(read_completion_ts -> u64, |wc, ts| ts);
reader!(read_completion_wallclock_ns -> u64, |wc, ts| to_wallclock_ns(ts));

/// A completion time ([`softrdma::completion_clock_ns`]) as nanoseconds since the epoch.
fn to_wallclock_ns(mono: u64) -> u64 {
    if mono == 0 {
        return 0;
    }
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
    let real = (now.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(now.tv_nsec as u64);
    real.saturating_sub(softrdma::completion_clock_ns().saturating_sub(mono))
}

/// `verbs_context.query_rt_values`: the device clock (`IBV_VALUES_MASK_RAW_CLOCK`), the
/// clock completion timestamps count in.
pub(crate) unsafe extern "C" fn query_rt_values(
    _context: *mut ibv_context,
    values: *mut ibv_values_ex,
) -> c_int {
    if values.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller's structure.
    let v = unsafe { &mut *values };
    if v.comp_mask & !IBV_VALUES_MASK_RAW_CLOCK != 0 {
        return libc::EOPNOTSUPP;
    }
    if v.comp_mask & IBV_VALUES_MASK_RAW_CLOCK != 0 {
        let ns = softrdma::completion_clock_ns();
        v.raw_clock =
            libc::timespec { tv_sec: (ns / 1_000_000_000) as _, tv_nsec: (ns % 1_000_000_000) as _ };
    }
    0
}
