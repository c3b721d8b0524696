//! The few system calls the runtime needs beyond `std`: batched datagram I/O
//! (`sendmmsg`, `recvmmsg`), an eventfd for wake-ups and completion channels, `ppoll` with
//! nanosecond timeouts, and interface enumeration. Every `unsafe` block says why it is
//! sound; nothing here is public.

pub(crate) mod interfaces;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// An eventfd: a counter a thread can wait on with `poll`.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    pub(crate) fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new fd we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh, valid descriptor nobody else owns.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds one to the counter, waking pollers.
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our own fd. A full counter (EAGAIN)
        // still leaves it readable, which is all a waiter needs.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reads and clears the counter; 0 if it was not signalled.
    pub(crate) fn drain(&self) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our own non-blocking fd.
        let n = unsafe { libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if n == 8 {
            v
        } else {
            0
        }
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Waits until one of `fds` is readable or `timeout` passes (`None`: forever). Returns
/// which fds are readable.
pub(crate) fn wait_readable<const N: usize>(
    fds: [RawFd; N],
    timeout: Option<Duration>,
) -> io::Result<[bool; N]> {
    let mut pfds = fds.map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: pfds is a valid array of N pollfds for the duration of the call; tsp is null
    // or points to a live timespec; the signal mask pointer is null (keep the current one).
    let r = unsafe { libc::ppoll(pfds.as_mut_ptr(), N as libc::nfds_t, tsp, std::ptr::null()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok([false; N]);
        }
        return Err(e);
    }
    Ok(pfds.map(|p| p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0))
}

/// A socket address in the form the kernel takes.
pub(crate) struct RawAddr {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl RawAddr {
    pub(crate) fn new(addr: SocketAddr) -> RawAddr {
        // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let len = match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
                unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
                std::mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: as above, for sockaddr_in6.
                unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
                std::mem::size_of::<libc::sockaddr_in6>()
            }
        };
        RawAddr { storage, len: len as libc::socklen_t }
    }
}

/// Reads a socket address the kernel filled in.
fn from_storage(s: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match s.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin: &libc::sockaddr_in = unsafe { &*(s as *const libc::sockaddr_storage).cast() };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6: &libc::sockaddr_in6 = unsafe { &*(s as *const libc::sockaddr_storage).cast() };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// One datagram to send — or, with `gso`, several of `gso` bytes each (the last may be
/// shorter) that the kernel splits (UDP generic segmentation offload).
pub(crate) struct OutMsg {
    pub(crate) dst: RawAddr,
    pub(crate) iov: Vec<libc::iovec>,
    pub(crate) gso: Option<u16>,
    control: [u64; 4],
}

// SAFETY: the iovecs are plain addresses, dereferenced only by the kernel during a send
// made under the engine lock; holding them across threads is harmless.
unsafe impl Send for OutMsg {}

impl std::fmt::Debug for OutMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutMsg").field("pieces", &self.iov.len()).field("gso", &self.gso).finish()
    }
}

impl OutMsg {
    pub(crate) fn new(dst: SocketAddr) -> OutMsg {
        OutMsg { dst: RawAddr::new(dst), iov: Vec::with_capacity(8), gso: None, control: [0; 4] }
    }
}

/// `SOL_UDP` option and control message: GSO segment size.
const UDP_SEGMENT: libc::c_int = 103;
/// `SOL_UDP` option and control message: GRO on receive.
const UDP_GRO: libc::c_int = 104;

/// What a batch send did.
pub(crate) struct Sent {
    /// Messages the kernel took.
    pub(crate) sent: usize,
    /// A GSO message was refused: the caller should stop using GSO.
    pub(crate) gso_refused: bool,
}

/// Sends `msgs` with as few `sendmmsg` calls as possible. A datagram the kernel refuses
/// (full buffer, unreachable) is dropped, as a lossy network would, and the transport
/// retransmits it.
///
/// # Safety
///
/// Every iovec must point to memory that is readable for its length during the call.
pub(crate) unsafe fn send_batch(fd: RawFd, msgs: &mut [OutMsg]) -> Sent {
    let mut hdrs: Vec<libc::mmsghdr> = msgs
        .iter_mut()
        .map(|m| {
            // SAFETY: msghdr is plain old data; all-zero is valid before we fill it in.
            let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
            h.msg_name = (&mut m.dst.storage as *mut libc::sockaddr_storage).cast();
            h.msg_namelen = m.dst.len;
            h.msg_iov = m.iov.as_mut_ptr();
            h.msg_iovlen = m.iov.len() as _;
            if let Some(size) = m.gso {
                let space = std::mem::size_of_val(&m.control);
                h.msg_control = m.control.as_mut_ptr().cast();
                h.msg_controllen = space as _;
                // SAFETY: the control buffer is 32 aligned bytes, room for one cmsghdr with
                // a u16; CMSG_FIRSTHDR returns a pointer inside it.
                unsafe {
                    let c = libc::CMSG_FIRSTHDR(&h);
                    (*c).cmsg_level = libc::SOL_UDP;
                    (*c).cmsg_type = UDP_SEGMENT;
                    (*c).cmsg_len = libc::CMSG_LEN(2) as _;
                    std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), size);
                    h.msg_controllen = libc::CMSG_SPACE(2) as _;
                }
            }
            libc::mmsghdr { msg_hdr: h, msg_len: 0 }
        })
        .collect();
    let mut out = Sent { sent: 0, gso_refused: false };
    let mut at = 0;
    while at < hdrs.len() {
        // SAFETY: hdrs[at..] are valid mmsghdrs whose names, controls and iovecs point into
        // `msgs` and the caller's live memory.
        let n = unsafe {
            libc::sendmmsg(fd, hdrs[at..].as_mut_ptr(), (hdrs.len() - at) as libc::c_uint, libc::MSG_DONTWAIT)
        };
        if n <= 0 {
            let e = io::Error::last_os_error().raw_os_error();
            if msgs[at].gso.is_some() && matches!(e, Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT)) {
                out.gso_refused = true;
            }
            // Skip the datagram the kernel refused and go on with the rest.
            at += 1;
            continue;
        }
        out.sent += n as usize;
        at += n as usize;
    }
    out
}

/// Turns on UDP GRO for a socket; false if the kernel has none.
pub(crate) fn enable_gro(fd: RawFd) -> bool {
    let one: libc::c_int = 1;
    // SAFETY: passes a pointer to a live c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_UDP,
            UDP_GRO,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

/// A batch of receive buffers for `recvmmsg`, each large enough for a GRO train. The
/// message headers are built once and point into the batch's own heap buffers, which never
/// move; each call only resets the lengths the kernel overwrote.
pub(crate) struct RecvBatch {
    bufs: Vec<u8>,
    slot: usize,
    addrs: Vec<libc::sockaddr_storage>,
    controls: Vec<[u64; 8]>,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<libc::mmsghdr>,
    lens: Vec<usize>,
    segs: Vec<usize>,
    count: usize,
}

// SAFETY: the raw pointers in `iovs` and `hdrs` point only into this batch's own heap
// buffers; the batch is used by one thread at a time (under the engine lock).
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    pub(crate) fn new(n: usize, slot: usize) -> RecvBatch {
        let mut b = RecvBatch {
            bufs: vec![0; n * slot],
            slot,
            // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
            addrs: vec![unsafe { std::mem::zeroed() }; n],
            controls: vec![[0; 8]; n],
            iovs: Vec::with_capacity(n),
            hdrs: Vec::with_capacity(n),
            lens: vec![0; n],
            segs: vec![0; n],
            count: 0,
        };
        for i in 0..n {
            let base = b.bufs[i * slot..].as_mut_ptr();
            b.iovs.push(libc::iovec { iov_base: base.cast(), iov_len: slot });
        }
        for i in 0..n {
            // SAFETY: msghdr is plain old data; all-zero is valid before we fill it in.
            let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
            h.msg_name = (&mut b.addrs[i] as *mut libc::sockaddr_storage).cast();
            h.msg_iov = &mut b.iovs[i];
            h.msg_iovlen = 1;
            h.msg_control = b.controls[i].as_mut_ptr().cast();
            b.hdrs.push(libc::mmsghdr { msg_hdr: h, msg_len: 0 });
        }
        b
    }

    /// Receives up to a batch of datagrams without blocking; returns how many.
    pub(crate) fn recv(&mut self, fd: RawFd) -> usize {
        for h in &mut self.hdrs {
            h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_hdr.msg_controllen = std::mem::size_of::<[u64; 8]>() as _;
            h.msg_hdr.msg_flags = 0;
        }
        let n = self.hdrs.len();
        // SAFETY: every header points to a distinct live buffer, address slot, control
        // buffer and iovec of this batch, which outlive the call.
        let r = unsafe {
            libc::recvmmsg(
                fd,
                self.hdrs.as_mut_ptr(),
                n as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        self.count = if r > 0 { r as usize } else { 0 };
        for i in 0..self.count {
            let h = &self.hdrs[i];
            // A truncated datagram is longer than anything we accept; mark it empty so that
            // it is counted as malformed.
            let truncated = h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
            self.lens[i] = if truncated { 0 } else { h.msg_len as usize };
            self.segs[i] = gro_size(&h.msg_hdr).unwrap_or(self.lens[i]);
        }
        self.count
    }

    /// Datagram `i` of the last `recv`: its source and its segments (one, or the pieces of
    /// a GRO train).
    pub(crate) fn get(&self, i: usize) -> Option<(SocketAddr, std::slice::Chunks<'_, u8>)> {
        if i >= self.count {
            return None;
        }
        let src = from_storage(&self.addrs[i])?;
        let data = &self.bufs[i * self.slot..i * self.slot + self.lens[i]];
        Some((src, data.chunks(self.segs[i].max(1))))
    }
}

/// The segment size of a GRO train, from its control message.
fn gro_size(h: &libc::msghdr) -> Option<usize> {
    // SAFETY: the kernel filled msg_control/msg_controllen; the CMSG macros walk within it.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                return (v > 0).then_some(v as usize);
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    None
}

/// The IPv4-mapped form of an address, for comparing GIDs.
pub(crate) fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => addr,
        },
        v4 => v4,
    }
}
