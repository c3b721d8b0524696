//! softrdma's drop-in `libibverbs.so.1`: rdma-core's C ABI (version nodes IBVERBS_1.0 to
//! 1.14 and IBVERBS_PRIVATE_34) over the `softrdma` runtime, so that unmodified programs —
//! `ibv_devinfo`, the `ibv_*_pingpong`s, perftest — run on softrdma with
//! `LD_LIBRARY_PATH` pointing at the built library (`softrdma exec` does it).
//!
//! The crate builds as a static library; `scripts/build-libs.sh` links it into
//! `libibverbs.so.1` with `libibverbs.map` (the version nodes), and into the stub
//! `libmlx5.so.1` and `libefa.so.1` that perftest's binaries need at load time.
//!
//! Each verbs object is a Rust structure whose first field is the C structure programs see
//! (`ibv_pd`, `ibv_cq`, `ibv_qp`, ...), followed by the runtime handle it stands for; the C
//! pointer is the structure's address. The context is the exception: `ibv_context` sits
//! after 320 bytes reserved for `verbs_context`'s members, as rdma-core lays it out.
//! The context is extended (`abi_compat` marks it): of `verbs_context`'s operations
//! `create_qp_ex` (with the `ibv_wr_*` posting API), `create_cq_ex` (with completion
//! timestamps), `query_device_ex` and `query_rt_values` are set; for the others the inline
//! `_ex` helpers fall back to the basic calls or fail with EOPNOTSUPP.
//!
//! Configuration, by environment:
//! - `SOFTRDMA_BIND=ADDR`: the device holding ADDR is listed first and ADDR is its GID 0,
//!   the address the process binds. Two processes on one host need two addresses
//!   (127.0.0.2 and 127.0.0.3), since programs exchange only GIDs and QP numbers.
//! - `SOFTRDMA_PORT`: the UDP port (4791 by default); both peers must use the same one.
//! - `SOFTRDMA_FOREIGN=1`: peers are Linux rxe or RoCE NICs.
//! - `SOFTRDMA_SYSFS=DIR`: where the devices' sysfs-style files are written.

#![allow(clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Mutex;

use softrdma::Context;

pub mod abi;
mod cq;
mod device;
mod extra;
pub mod rdmacm;
mod stubs;
mod verbs;

pub use device::{dev_name, BIND_ENV, FOREIGN_ENV, SYSFS_ENV};

use abi::*;

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: the calling thread's errno location.
    unsafe { *libc::__errno_location() = e };
}

/// Whether the program set O_NONBLOCK on `fd` (a channel's fd or `async_fd`).
pub(crate) fn nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL takes no pointers; -1 on a bad fd (then: blocking).
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Runs `f`, turning a panic into `on_panic` instead of unwinding into C (which would
/// abort the program).
pub(crate) fn guard<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(on_panic)
}

/// A runtime call under [`guard`]: a panic becomes an EINVAL error.
pub(crate) fn guard_rt<T>(f: impl FnOnce() -> softrdma::Result<T>) -> softrdma::Result<T> {
    guard(Err(softrdma::Error::InvalidArgument("a panic inside softrdma")), f)
}

/// The errno value rdma-core returns for a result: 0 on success.
pub(crate) fn errno_of(r: softrdma::Result<()>) -> c_int {
    r.map_or_else(|e| e.errno(), |()| 0)
}

/// C objects by the number the runtime's events name them with (CQ id, QPN).
pub(crate) struct Handles<T> {
    map: Mutex<HashMap<u32, usize>>,
    _of: std::marker::PhantomData<*mut T>,
}

// SAFETY: only addresses are stored, as integers; nothing is dereferenced here.
unsafe impl<T> Send for Handles<T> {}
// SAFETY: as above; the map is behind a mutex.
unsafe impl<T> Sync for Handles<T> {}

impl<T> Default for Handles<T> {
    fn default() -> Self {
        Handles { map: Mutex::new(HashMap::new()), _of: std::marker::PhantomData }
    }
}

impl<T> Handles<T> {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u32, usize>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub(crate) fn insert(&self, n: u32, p: *mut T) {
        self.map().insert(n, p as usize);
    }
    pub(crate) fn remove(&self, n: u32) {
        self.map().remove(&n);
    }
    /// The object numbered `n`, or NULL.
    pub(crate) fn get(&self, n: u32) -> *mut T {
        self.map().get(&n).map_or(std::ptr::null_mut(), |&p| p as *mut T)
    }
}

const VCTX_WORDS: usize = 40;
/// `verbs_context.sz`, 8 bytes before `ibv_context`.
const VCTX_SZ: usize = 39;
/// `verbs_context.create_qp_ex`, 56 bytes before `ibv_context`.
const VCTX_CREATE_QP_EX: usize = 33;
/// `verbs_context.query_device_ex`.
const VCTX_QUERY_DEVICE_EX: usize = 27;
/// `verbs_context.create_cq_ex`.
const VCTX_CREATE_CQ_EX: usize = 25;
/// `verbs_context.query_rt_values`.
const VCTX_QUERY_RT_VALUES: usize = 24;

/// An open device: `ibv_context` and the runtime context behind it.
#[repr(C)]
pub(crate) struct Ctx {
    /// `struct verbs_context`'s members before its `context`: 40 words, of which `sz` and
    /// `create_qp_ex` are set.
    _verbs_context: [u64; VCTX_WORDS],
    pub(crate) ibv: ibv_context,
    pub(crate) rt: Context,
    /// Peers are foreign (`SOFTRDMA_FOREIGN`).
    pub(crate) foreign: bool,
    /// CQs by the runtime's number and QPs by QPN, for the events that name them.
    pub(crate) cqs: Handles<ibv_cq>,
    pub(crate) qps: Handles<ibv_qp>,
}

impl Ctx {
    pub(crate) fn open(device: *mut ibv_device, rt: Context, foreign: bool) -> *mut ibv_context {
        // SAFETY: plain data; null pointers and zero fds are filled below.
        let mut ibv: ibv_context = unsafe { std::mem::zeroed() };
        ibv.device = device;
        ibv.ops.poll_cq = Some(cq::poll_cq);
        ibv.ops.req_notify_cq = Some(cq::req_notify_cq);
        ibv.ops.post_srq_recv = Some(verbs::post_srq_recv);
        ibv.ops.post_send = Some(verbs::post_send);
        ibv.ops.post_recv = Some(verbs::post_recv);
        ibv.cmd_fd = -1;
        // Extended: verbs.h's inline helpers look for operations in `verbs_context`, before
        // `ibv_context`; those left NULL fall back to the basic calls or EOPNOTSUPP.
        ibv.abi_compat = std::ptr::without_provenance_mut(usize::MAX);
        let mut vctx = [0u64; VCTX_WORDS];
        vctx[VCTX_SZ] = (VCTX_WORDS * 8 + std::mem::size_of::<ibv_context>()) as u64;
        vctx[VCTX_CREATE_QP_EX] = verbs::create_qp_ex as *const () as usize as u64;
        vctx[VCTX_CREATE_CQ_EX] = cq::create_cq_ex as *const () as usize as u64;
        vctx[VCTX_QUERY_DEVICE_EX] = device::query_device_ex as *const () as usize as u64;
        vctx[VCTX_QUERY_RT_VALUES] = cq::query_rt_values as *const () as usize as u64;
        ibv.async_fd = rt.async_fd();
        ibv.num_comp_vectors = 1;
        let ctx = Box::new(Ctx {
            _verbs_context: vctx,
            ibv,
            rt,
            foreign,
            cqs: Handles::default(),
            qps: Handles::default(),
        });
        let ctx = Box::into_raw(ctx);
        // SAFETY: just allocated; the field's address is stable for the box's life.
        unsafe { &raw mut (*ctx).ibv }
    }

    /// # Safety
    /// `p` came from [`Ctx::open`] and was not freed.
    pub(crate) unsafe fn from_ibv<'a>(p: *mut ibv_context) -> &'a Ctx {
        // SAFETY: by the contract, p is the `ibv` field of a live Ctx.
        unsafe { &*p.cast::<u8>().sub(std::mem::offset_of!(Ctx, ibv)).cast::<Ctx>() }
    }

    /// # Safety
    /// As [`Ctx::from_ibv`]; nothing may use the context afterwards.
    unsafe fn free(p: *mut ibv_context) {
        // SAFETY: by the contract.
        drop(unsafe { Box::from_raw(p.cast::<u8>().sub(std::mem::offset_of!(Ctx, ibv)).cast::<Ctx>()) });
    }
}
