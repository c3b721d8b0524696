//! Symbols that must resolve for programs to load, and that softrdma does not offer.
//!
//! perftest's binaries link `libmlx5.so.1` and `libefa.so.1` directly and bind every import
//! at load time; they call these functions only on a device they recognise as mlx5 or EFA
//! by its vendor part ID, which softrdma's never is. `scripts/build-libs.sh` exports them
//! from the stub libraries (version nodes MLX5_1.x, EFA_1.x), not from `libibverbs.so.1`.
//! UCX's `libuct_ib.so.0` links `libmlx5.so.1` too; it asks `mlx5dv_is_supported` first,
//! which says no, and then opens the device through plain verbs, never calling the rest.
//! The `ibv_copy_*_from_kern` and ECE calls are imported by rdma-core's own librdmacm.

use std::ffi::{c_int, c_void};

use crate::set_errno;

fn null(_args: &[*mut c_void]) -> *mut c_void {
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

macro_rules! null_fns {
    ($($name:ident($($arg:ident),*);)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: *mut c_void),*) -> *mut c_void {
            null(&[$($arg),*])
        }
    )*};
}

null_fns! {
    mlx5dv_open_device(device, attr);
    mlx5dv_create_qp(context, qp_attr, mlx5_qp_attr);
    mlx5dv_qp_ex_from_ibv_qp_ex(qp);
    mlx5dv_create_mkey(attr);
    mlx5dv_dek_create(context, attr);
    mlx5dv_create_cq(context, cq_attr, mlx5_cq_attr);
    mlx5dv_devx_alloc_uar(context, flags);
    mlx5dv_devx_create_event_channel(context, flags);
    mlx5dv_devx_obj_create(context, input, inlen, output, outlen);
    mlx5dv_devx_umem_reg(context, addr, size, access);
    efadv_create_qp_ex(context, attr, efa_attr, inlen);
}

/// The unsupported calls that return an errno value. Arguments beyond the first are
/// not read, so they are not declared (the C calling convention allows it).
macro_rules! unsupported_fns {
    ($($name:ident;)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(_first: *mut c_void) -> c_int {
            libc::EOPNOTSUPP
        }
    )*};
}

unsupported_fns! {
    mlx5dv_devx_general_cmd;
    mlx5dv_destroy_mkey;
    mlx5dv_dek_destroy;
    mlx5dv_crypto_login;
    mlx5dv_devx_obj_destroy;
    mlx5dv_devx_obj_modify;
    mlx5dv_devx_obj_query;
    mlx5dv_devx_qp_modify;
    mlx5dv_devx_qp_query;
    mlx5dv_devx_subscribe_devx_event;
    mlx5dv_devx_umem_dereg;
    mlx5dv_init_obj;
    efadv_query_device;
    ibv_set_ece;
    ibv_query_ece;
}

/// Conversions from the kernel's structures, which a library that talks to no kernel
/// never receives: the destination is left as it is.
#[no_mangle]
pub unsafe extern "C" fn ibv_copy_ah_attr_from_kern(_dst: *mut c_void, _src: *const c_void) {}
#[no_mangle]
pub unsafe extern "C" fn ibv_copy_qp_attr_from_kern(_dst: *mut c_void, _src: *const c_void) {}
#[no_mangle]
pub unsafe extern "C" fn ibv_copy_path_rec_from_kern(_dst: *mut c_void, _src: *const c_void) {}

/// No device of softrdma's is an mlx5 device.
#[no_mangle]
pub unsafe extern "C" fn mlx5dv_is_supported(_device: *mut c_void) -> bool {
    false
}
#[no_mangle]
pub unsafe extern "C" fn mlx5dv_devx_free_uar(_uar: *mut c_void) {}
#[no_mangle]
pub unsafe extern "C" fn mlx5dv_devx_destroy_event_channel(_channel: *mut c_void) {}
/// No event ever arrives: -1 with EOPNOTSUPP, as a read of a closed channel would fail.
#[no_mangle]
pub unsafe extern "C" fn mlx5dv_devx_get_event(
    _channel: *mut c_void,
    _data: *mut c_void,
    _len: usize,
) -> isize {
    set_errno(libc::EOPNOTSUPP);
    -1
}
