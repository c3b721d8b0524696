//! librdmacm's calls that softrdma does not provide yet, present because programs linked
//! with immediate binding import them: ECE. Each fails with a clear errno.

use std::ffi::{c_int, c_void};

use crate::abi::*;
use crate::set_errno;

fn unsupported(what: &str) -> c_int {
    eprintln!("softrdma: {what} is not supported yet");
    set_errno(libc::ENOSYS);
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
    let Some(i) = super::live_id(id) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    // SAFETY: the caller's pointer, if not null.
    if ece.is_null() || !i.ibv.qp.is_null() || unsafe { (*ece).vendor_id == 0 || (*ece).comp_mask != 0 } {
        set_errno(libc::EINVAL);
        return -1;
    }
    // softrdma negotiates no vendor options: nothing to carry.
    0
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_remote_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    if super::live_id(id).is_none() || ece.is_null() {
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
