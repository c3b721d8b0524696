//! The rest of rdma-core 44's exported calls: string helpers, rate conversions, fork
//! helpers, `ibv_init_ah_from_wc`, `ibv_reg_mr_iova`, `_ibv_query_gid_table`, and the
//! calls softrdma does not offer (object import, dma-buf and re-registration, driver
//! registration, L2 resolution), which fail as rdma-core fails when a provider lacks them.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use crate::abi::*;
use crate::device::_ibv_query_gid_ex;
use crate::set_errno;

#[no_mangle]
pub unsafe extern "C" fn ibv_node_type_str(node_type: c_int) -> *const c_char {
    let s: &CStr = match node_type {
        1 => c"InfiniBand channel adapter",
        2 => c"InfiniBand switch",
        3 => c"InfiniBand router",
        4 => c"iWARP NIC",
        5 => c"usNIC",
        6 => c"usNIC UDP",
        7 => c"unspecified",
        _ => c"unknown",
    };
    s.as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn ibv_port_state_str(state: c_int) -> *const c_char {
    let s: &CStr = match state {
        0 => c"no state change (NOP)",
        1 => c"down",
        2 => c"init",
        3 => c"armed",
        4 => c"active",
        5 => c"active deferred",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `enum ibv_rate` values with their multiple of 2.5 Gb/s and their Mb/s.
const RATES: [(c_int, c_int, c_int); 21] = [
    (2, 1, 2500),
    (5, 4, 10000),
    (3, 8, 20000),
    (6, 12, 30000),
    (7, 2, 5000),
    (8, 16, 40000),
    (9, 24, 60000),
    (10, 32, 80000),
    (11, 48, 120000),
    (12, 6, 14062),
    (13, 22, 56250),
    (14, 45, 112500),
    (15, 67, 168750),
    (16, 10, 25781),
    (17, 40, 103125),
    (18, 80, 206250),
    (19, 120, 309375),
    (20, 20, 53125),
    (21, 80, 200000),
    (22, 160, 400000),
    (23, 240, 600000),
];

#[no_mangle]
pub unsafe extern "C" fn ibv_rate_to_mult(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

#[no_mangle]
pub unsafe extern "C" fn mult_to_ibv_rate(mult: c_int) -> c_int {
    RATES.iter().find(|r| r.1 == mult).map_or(0, |r| r.0)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_rate_to_mbps(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

#[no_mangle]
pub unsafe extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> c_int {
    RATES.iter().find(|r| r.2 == mbps).map_or(0, |r| r.0)
}

/// Nothing is pinned, so no range needs protecting from fork.
#[no_mangle]
pub unsafe extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `IBV_FORK_UNNEEDED`: registered memory is never pinned, so fork is always safe.
#[no_mangle]
pub unsafe extern "C" fn ibv_is_fork_initialized() -> c_int {
    2
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded under the same contract.
    unsafe { crate::verbs::ibv_reg_mr_iova2(pd, addr, length, iova, access as c_uint) }
}

/// The address vector that answers a UD receive: the sender's GID from the GRH (RoCEv2:
/// the IP header in the GRH area's last 20 bytes for IPv4), our GID index 0.
#[no_mangle]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    context: *mut ibv_context,
    port_num: u8,
    wc: *mut ibv_wc,
    grh: *mut u8,
    ah_attr: *mut ibv_ah_attr,
) -> c_int {
    if context.is_null() || wc.is_null() || grh.is_null() || ah_attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller's completion, its 40-byte GRH area and the output.
    let (w, g, out) = unsafe { (&*wc, std::slice::from_raw_parts(grh, 40), &mut *ah_attr) };
    if w.wc_flags & IBV_WC_GRH == 0 {
        return libc::EINVAL;
    }
    let Ok(attr) = softrdma::AhAttr::from_grh(g) else { return libc::EINVAL };
    // SAFETY: plain data.
    *out = unsafe { std::mem::zeroed() };
    out.is_global = 1;
    out.port_num = port_num;
    out.grh.dgid.raw = attr.dgid;
    out.grh.flow_label = attr.flow_label;
    out.grh.hop_limit = 0xFF;
    out.grh.traffic_class = attr.traffic_class;
    out.grh.sgid_index = 0;
    0
}

/// `_ibv_query_gid_table@IBVERBS_1.11`, behind the inline `ibv_query_gid_table`: every
/// GID of port 1, as many as fit; the number written, or a negative errno.
#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    if context.is_null() || (entries.is_null() && max_entries > 0) || flags != 0 {
        return -(libc::EINVAL as isize);
    }
    if entry_size < std::mem::size_of::<ibv_gid_entry>() {
        return -(libc::EINVAL as isize);
    }
    let mut n = 0usize;
    for index in 0.. {
        if n == max_entries {
            break;
        }
        // SAFETY: entries has max_entries slots of entry_size bytes; n < max_entries.
        let slot = unsafe { entries.cast::<u8>().add(n * entry_size).cast::<ibv_gid_entry>() };
        // SAFETY: forwarded; the slot is writable.
        match unsafe { _ibv_query_gid_ex(context, 1, index, slot, 0, entry_size) } {
            0 => n += 1,
            libc::ENODATA => break,
            e => return -(e as isize),
        }
    }
    n as isize
}

macro_rules! null_fns {
    ($($name:ident($($arg:ident: $t:ty),*);)*) => {$(
        #[no_mangle]
        #[allow(unused_variables)]
        pub unsafe extern "C" fn $name($($arg: $t),*) -> *mut c_void {
            set_errno(libc::EOPNOTSUPP);
            std::ptr::null_mut()
        }
    )*};
}

null_fns! {
    ibv_import_device(cmd_fd: c_int);
    ibv_import_pd(context: *mut ibv_context, handle: u32);
    ibv_import_mr(pd: *mut ibv_pd, handle: u32);
    ibv_import_dm(context: *mut ibv_context, handle: u32);
    ibv_reg_dmabuf_mr(pd: *mut ibv_pd, offset: u64, length: usize, iova: u64, fd: c_int, access: c_int);
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_pd(_pd: *mut ibv_pd) {}
#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_mr(_mr: *mut ibv_mr) {}
#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_dm(_dm: *mut c_void) {}

/// Providers are not loaded: softrdma is the only one.
#[no_mangle]
pub unsafe extern "C" fn ibv_register_driver(_name: *const c_char, _init: *mut c_void) {}

/// `IBV_REREG_MR_ERR_INPUT` (-1) with EOPNOTSUPP: re-registration is not offered; the
/// region is unchanged.
#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    _mr: *mut ibv_mr,
    _flags: c_int,
    _pd: *mut ibv_pd,
    _addr: *mut c_void,
    _length: usize,
    _access: c_int,
) -> c_int {
    set_errno(libc::EOPNOTSUPP);
    -1
}

/// Ethernet addresses do not exist under UDP sockets.
#[no_mangle]
pub unsafe extern "C" fn ibv_resolve_eth_l2_from_gid(
    _context: *mut ibv_context,
    _attr: *mut ibv_ah_attr,
    _eth_mac: *mut u8,
    _vid: *mut u16,
) -> c_int {
    libc::EOPNOTSUPP
}

/// Whether the QP writes data in order: `IBV_QUERY_QP_DATA_IN_ORDER_WHOLE_MSG` (1) — a
/// message's bytes land in order, the last byte last.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp_data_in_order(_qp: *mut ibv_qp, _op: c_int, _flags: u32) -> c_int {
    1
}
