//! `rdma_getaddrinfo` / `rdma_freeaddrinfo`: the system resolver's first answer as
//! rdma_cm's `struct rdma_addrinfo`, with the QP type and port space filled in.

use std::ffi::{c_char, c_int};
use std::ptr;

use crate::abi::*;
use crate::set_errno;

/// One answer and the storage it points into.
#[repr(C)]
struct Info {
    ibv: rdma_addrinfo,
    src: sockaddr_storage,
    dst: sockaddr_storage,
}

#[no_mangle]
pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
        set_errno(libc::EINVAL);
        return -1;
    }
    if crate::device::devices().is_empty() {
        set_errno(libc::ENODEV);
        return -1;
    }
    // SAFETY: the caller's hints, if any.
    let h = unsafe { hints.as_ref() };
    let flags = h.map_or(0, |h| h.ai_flags);
    let qp_type = h.map_or(0, |h| h.ai_qp_type);
    let port_space = h.map_or(0, |h| h.ai_port_space);
    let mut info = Box::new(Info {
        // SAFETY: plain data and null pointers.
        ibv: unsafe { std::mem::zeroed() },
        src: sockaddr_storage::default(),
        dst: sockaddr_storage::default(),
    });
    if node.is_null() && service.is_null() {
        // Only the hints: copied, with their destination.
        let h = h.expect("checked above");
        info.ibv.ai_flags = flags;
        info.ibv.ai_family = h.ai_family;
        info.ibv.ai_qp_type = qp_type;
        info.ibv.ai_port_space = port_space;
        // SAFETY: the hints' destination address, if any.
        if let Some(d) = unsafe { super::read_sockaddr(h.ai_dst_addr) } {
            super::write_sockaddr(&mut info.dst, d);
            info.ibv.ai_dst_len = sockaddr_len(d);
        }
    } else {
        // SAFETY: plain data.
        let mut ai: libc::addrinfo = unsafe { std::mem::zeroed() };
        if flags & RAI_PASSIVE != 0 {
            ai.ai_flags |= libc::AI_PASSIVE;
        }
        if flags & RAI_NUMERICHOST != 0 {
            ai.ai_flags |= libc::AI_NUMERICHOST;
        }
        ai.ai_family = h.map_or(libc::AF_UNSPEC, |h| h.ai_family);
        ai.ai_socktype = if qp_type == IBV_QPT_UD { libc::SOCK_DGRAM } else { libc::SOCK_STREAM };
        ai.ai_protocol = match port_space {
            RDMA_PS_UDP | RDMA_PS_IPOIB => libc::IPPROTO_UDP,
            RDMA_PS_TCP => libc::IPPROTO_TCP,
            _ => 0,
        };
        if ai.ai_protocol == libc::IPPROTO_UDP {
            ai.ai_socktype = libc::SOCK_DGRAM;
        }
        let mut out: *mut libc::addrinfo = ptr::null_mut();
        // SAFETY: the caller's strings and our hints.
        let r = unsafe { libc::getaddrinfo(node, service, &ai, &mut out) };
        if r != 0 {
            return r;
        }
        // SAFETY: getaddrinfo succeeded: out is a list of at least one answer.
        let first = unsafe { &*out };
        // SAFETY: the answer's address.
        let addr = unsafe { super::read_sockaddr(first.ai_addr) };
        let (socktype, protocol, family) = (first.ai_socktype, first.ai_protocol, first.ai_family);
        // SAFETY: from getaddrinfo.
        unsafe { libc::freeaddrinfo(out) };
        let Some(addr) = addr else {
            return libc::EAI_FAMILY;
        };
        info.ibv.ai_family = family;
        info.ibv.ai_qp_type = if qp_type != 0 {
            qp_type
        } else if socktype == libc::SOCK_DGRAM {
            IBV_QPT_UD
        } else {
            IBV_QPT_RC
        };
        info.ibv.ai_port_space = if port_space != 0 {
            port_space
        } else if protocol == libc::IPPROTO_UDP {
            RDMA_PS_UDP
        } else {
            RDMA_PS_TCP
        };
        if flags & RAI_PASSIVE != 0 {
            info.ibv.ai_flags = RAI_PASSIVE;
            super::write_sockaddr(&mut info.src, addr);
            info.ibv.ai_src_len = sockaddr_len(addr);
        } else {
            super::write_sockaddr(&mut info.dst, addr);
            info.ibv.ai_dst_len = sockaddr_len(addr);
        }
    }
    // The hints' source address, for an answer without one (how rdma_cm's examples bind
    // the active side).
    if info.ibv.ai_src_len == 0 {
        // SAFETY: the hints' source address, if any.
        if let Some(s) = h.and_then(|h| unsafe { super::read_sockaddr(h.ai_src_addr) }) {
            super::write_sockaddr(&mut info.src, s);
            info.ibv.ai_src_len = sockaddr_len(s);
        }
    }
    let p = Box::into_raw(info);
    // SAFETY: just made; the pointers refer to its own fields.
    unsafe {
        if (*p).ibv.ai_src_len != 0 {
            (*p).ibv.ai_src_addr = (&raw mut (*p).src).cast();
        }
        if (*p).ibv.ai_dst_len != 0 {
            (*p).ibv.ai_dst_addr = (&raw mut (*p).dst).cast();
        }
        *res = p.cast();
    }
    0
}

fn sockaddr_len(a: std::net::SocketAddr) -> libc::socklen_t {
    (if a.is_ipv4() {
        std::mem::size_of::<libc::sockaddr_in>()
    } else {
        std::mem::size_of::<libc::sockaddr_in6>()
    }) as libc::socklen_t
}

#[no_mangle]
pub unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut p = res;
    while !p.is_null() {
        // SAFETY: answers from rdma_getaddrinfo, freed once.
        let info = unsafe { Box::from_raw(p.cast::<Info>()) };
        p = info.ibv.ai_next;
    }
}
