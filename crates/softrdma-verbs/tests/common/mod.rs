//! Helpers of the tests that call the C entry points.

use std::ffi::c_int;

/// The calling thread's errno.
pub fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `addr` ("a.b.c.d:port") as a `sockaddr_in`.
pub fn sockaddr(addr: &str) -> libc::sockaddr_in {
    let a: std::net::SocketAddrV4 = addr.parse().unwrap();
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
        sin_zero: [0; 8],
    }
}
