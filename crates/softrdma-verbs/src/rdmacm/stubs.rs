//! librdmacm's calls that softrdma does not provide yet, present because programs linked
//! with immediate binding import them: multicast (until multicast lands), ECE, and
//! rsockets. Each fails with a clear errno; `rpoll` and `rselect` pass through to `poll`
//! and `select`, which is exact while no rsocket exists.

use std::ffi::{c_int, c_void};

use crate::abi::*;
use crate::set_errno;

fn unsupported(what: &str) -> c_int {
    eprintln!("softrdma: {what} is not supported yet");
    set_errno(libc::ENOSYS);
    -1
}

#[no_mangle]
pub unsafe extern "C" fn rdma_join_multicast(
    _id: *mut rdma_cm_id,
    _addr: *mut libc::sockaddr,
    _context: *mut c_void,
) -> c_int {
    unsupported("rdma_join_multicast (multicast)")
}

#[no_mangle]
pub unsafe extern "C" fn rdma_join_multicast_ex(
    _id: *mut rdma_cm_id,
    _attr: *mut c_void,
    _context: *mut c_void,
) -> c_int {
    unsupported("rdma_join_multicast_ex (multicast)")
}

#[no_mangle]
pub unsafe extern "C" fn rdma_leave_multicast(_id: *mut rdma_cm_id, _addr: *mut libc::sockaddr) -> c_int {
    set_errno(libc::EADDRNOTAVAIL);
    -1
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_srq_ex(_id: *mut rdma_cm_id, _attr: *mut c_void) -> c_int {
    unsupported("rdma_create_srq_ex")
}

/// `struct ibv_ece`: vendor_id, options, comp_mask.
#[repr(C)]
#[derive(Debug)]
pub struct ibv_ece {
    pub vendor_id: u32,
    pub options: u32,
    pub comp_mask: u32,
}

#[no_mangle]
pub unsafe extern "C" fn rdma_set_local_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    // SAFETY: the caller's pointers, if not null.
    if id.is_null()
        || ece.is_null()
        || unsafe { !(*id).qp.is_null() || (*ece).vendor_id == 0 || (*ece).comp_mask != 0 }
    {
        set_errno(libc::EINVAL);
        return -1;
    }
    // softrdma negotiates no vendor options: nothing to carry.
    0
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_remote_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    if id.is_null() || ece.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller's out pointer. No peer option is ever received.
    unsafe { ece.write(ibv_ece { vendor_id: 0, options: 0, comp_mask: 0 }) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn rdma_reject_ece(id: *mut rdma_cm_id, private_data: *const c_void, len: u8) -> c_int {
    // SAFETY: forwarded.
    unsafe { super::rdma_reject(id, private_data, len) }
}

// ---- rsockets ---------------------------------------------------------------------------

macro_rules! no_rsocket {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $val:expr;)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            $(let _ = $arg;)*
            set_errno(libc::ENOSYS);
            $val
        }
    )*};
}

no_rsocket! {
    rsocket(domain: c_int, ty: c_int, protocol: c_int) -> c_int = {
        eprintln!("softrdma: rsockets are not supported yet");
        -1
    };
    rbind(s: c_int, addr: *const libc::sockaddr, len: libc::socklen_t) -> c_int = -1;
    rlisten(s: c_int, backlog: c_int) -> c_int = -1;
    raccept(s: c_int, addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> c_int = -1;
    rconnect(s: c_int, addr: *const libc::sockaddr, len: libc::socklen_t) -> c_int = -1;
    rshutdown(s: c_int, how: c_int) -> c_int = -1;
    rclose(s: c_int) -> c_int = -1;
    rrecv(s: c_int, buf: *mut c_void, len: usize, flags: c_int) -> isize = -1;
    rrecvfrom(s: c_int, buf: *mut c_void, len: usize, flags: c_int, src: *mut libc::sockaddr, srclen: *mut libc::socklen_t) -> isize = -1;
    rrecvmsg(s: c_int, msg: *mut libc::msghdr, flags: c_int) -> isize = -1;
    rsend(s: c_int, buf: *const c_void, len: usize, flags: c_int) -> isize = -1;
    rsendto(s: c_int, buf: *const c_void, len: usize, flags: c_int, dst: *const libc::sockaddr, dstlen: libc::socklen_t) -> isize = -1;
    rsendmsg(s: c_int, msg: *const libc::msghdr, flags: c_int) -> isize = -1;
    rread(s: c_int, buf: *mut c_void, count: usize) -> isize = -1;
    rreadv(s: c_int, iov: *const libc::iovec, iovcnt: c_int) -> isize = -1;
    rwrite(s: c_int, buf: *const c_void, count: usize) -> isize = -1;
    rwritev(s: c_int, iov: *const libc::iovec, iovcnt: c_int) -> isize = -1;
    rgetpeername(s: c_int, addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> c_int = -1;
    rgetsockname(s: c_int, addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> c_int = -1;
    rsetsockopt(s: c_int, level: c_int, name: c_int, val: *const c_void, len: libc::socklen_t) -> c_int = -1;
    rgetsockopt(s: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut libc::socklen_t) -> c_int = -1;
    riomap(s: c_int, buf: *mut c_void, len: usize, prot: c_int, flags: c_int, offset: libc::off_t) -> libc::off_t = -1;
    riounmap(s: c_int, buf: *mut c_void, len: usize) -> c_int = -1;
    riowrite(s: c_int, buf: *const c_void, count: usize, offset: libc::off_t, flags: c_int) -> usize = usize::MAX;
}

#[no_mangle]
pub unsafe extern "C" fn rfcntl(_s: c_int, _cmd: c_int, _arg: c_int) -> c_int {
    set_errno(libc::ENOSYS);
    -1
}

#[no_mangle]
pub unsafe extern "C" fn rpoll(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int) -> c_int {
    // SAFETY: forwarded unchanged.
    unsafe { libc::poll(fds, nfds, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn rselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    // SAFETY: forwarded unchanged.
    unsafe { libc::select(nfds, readfds, writefds, exceptfds, timeout) }
}
