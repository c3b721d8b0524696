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
pub(crate) struct EventFd {
    fd: OwnedFd,
    /// Created without O_NONBLOCK (an fd handed to programs, which set the flag
    /// themselves when they want it), so `drain` checks readiness before reading.
    exposed: bool,
}

impl EventFd {
    /// A non-blocking eventfd, for the runtime's own wake-ups.
    pub(crate) fn new() -> io::Result<EventFd> {
        Self::create(libc::EFD_NONBLOCK, false)
    }

    /// An eventfd a program sees (a completion channel's fd, `ibv_context.async_fd`):
    /// blocking as rdma-core's are, so that `fcntl(O_NONBLOCK)` by the program is its own
    /// choice, which `ibv_get_cq_event` then honours.
    pub(crate) fn exposed() -> io::Result<EventFd> {
        Self::create(0, true)
    }

    fn create(flags: libc::c_int, exposed: bool) -> io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new fd we own.
        let fd = unsafe { libc::eventfd(0, flags | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh, valid descriptor nobody else owns.
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(fd) }, exposed })
    }

    /// Adds one to the counter, waking pollers.
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our own fd. A full counter (EAGAIN)
        // still leaves it readable, which is all a waiter needs.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reads and clears the counter; 0 if it was not signalled. Never blocks.
    pub(crate) fn drain(&self) -> u64 {
        if self.exposed {
            let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, no wait.
            if unsafe { libc::poll(&mut pfd, 1, 0) } != 1 {
                return 0;
            }
        }
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our own fd, which is non-blocking or
        // readable (callers that drain hold the lock that signals are made under).
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if n == 8 {
            v
        } else {
            0
        }
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Spawns one of the library's own threads (a progress thread, the introspection socket's,
/// a poller's) with every asynchronous signal blocked. The library lives inside other
/// programs: a signal sent to the process goes to any thread that does not block it, and
/// a program that blocks, say, `SIGTERM` in its threads to take it with `sigwait` or a
/// `signalfd` would otherwise see it land on a library thread, where its default action
/// ends the process, or its handler run on a thread it does not know. The mask is set in
/// the spawning thread around the spawn, so the new thread starts with it and no signal
/// can reach it first. The signals a fault raises (`SIGSEGV`, `SIGBUS`, `SIGFPE`,
/// `SIGILL`, `SIGTRAP`) stay open: the kernel sends them to the faulting thread whatever
/// its mask.
pub(crate) fn spawn_quiet<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<std::thread::JoinHandle<T>> {
    /// Puts the spawning thread's mask back however the spawn ends (a panic included).
    struct Restore(libc::sigset_t);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: sets the calling thread's mask to the one it had.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
        }
    }
    // SAFETY: sigset operations on local sets; pthread_sigmask changes only the calling
    // thread's mask, which `Restore` puts back.
    let _restore = unsafe {
        let mut block: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut block);
        for fault in [libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL, libc::SIGTRAP] {
            libc::sigdelset(&mut block, fault);
        }
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, &block, &mut old);
        Restore(old)
    };
    std::thread::Builder::new().name(name).spawn(f)
}

/// Waits until one of `fds` is readable or `timeout` passes (`None`: forever). Returns
/// which fds are readable.
pub(crate) fn wait_readable<const N: usize>(
    fds: [RawFd; N],
    timeout: Option<Duration>,
) -> io::Result<[bool; N]> {
    let ready = wait_readable_any(&fds, timeout)?;
    Ok(std::array::from_fn(|i| ready & (1 << i) != 0))
}

/// Waits until one of up to 64 `fds` is readable or `timeout` passes (`None`: forever).
/// Returns a bit mask of the readable ones.
pub(crate) fn wait_readable_any(fds: &[RawFd], timeout: Option<Duration>) -> io::Result<u64> {
    // On the stack: a thread that sleeps per message allocates nothing for it.
    let mut all = [libc::pollfd { fd: -1, events: 0, revents: 0 }; 64];
    let n = fds.len().min(64);
    for (p, &fd) in all.iter_mut().zip(fds) {
        *p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    }
    let pfds = &mut all[..n];
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: pfds is a valid array of pollfds for the duration of the call; tsp is null or
    // points to a live timespec; the signal mask pointer is null (keep the current one).
    let r = unsafe { libc::ppoll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, tsp, std::ptr::null()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    let mut mask = 0u64;
    for (i, p) in pfds.iter().enumerate() {
        if p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0 {
            mask |= 1 << i;
        }
    }
    Ok(mask)
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

/// An empty iovec vector kept for its capacity (see [`OutMsg::into_iov`]).
pub(crate) struct EmptyIovs(Vec<libc::iovec>);

impl EmptyIovs {
    /// A new one, room for `n` pieces.
    pub(crate) fn with_capacity(n: usize) -> EmptyIovs {
        EmptyIovs(Vec::with_capacity(n))
    }
}

// SAFETY: the vector is empty: it holds no pointer.
unsafe impl Send for EmptyIovs {}

impl std::fmt::Debug for EmptyIovs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EmptyIovs({})", self.0.capacity())
    }
}

/// One datagram to send — or, with `gso`, several of `gso` bytes each (the last may be
/// shorter) that the kernel splits (UDP generic segmentation offload).
pub(crate) struct OutMsg {
    pub(crate) dst: socket2::SockAddr,
    /// The destination, as given.
    pub(crate) to: SocketAddr,
    /// The local address to send from (it picks the socket).
    pub(crate) src: SocketAddr,
    /// The IP TOS byte (DSCP and ECN).
    pub(crate) tos: u8,
    pub(crate) iov: Vec<libc::iovec>,
    pub(crate) gso: Option<u16>,
    control: [u64; 8],
}

// SAFETY: the iovecs are plain addresses, dereferenced only by the kernel during a send
// made under the engine lock; holding them across threads is harmless.
unsafe impl Send for OutMsg {}

impl OutMsg {
    /// The datagram's bytes (a GSO train's, back to back), gathered from its iovecs.
    ///
    /// # Safety
    ///
    /// Every iovec must point to memory readable for its length, as for a send.
    pub(crate) unsafe fn gather(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.iov.iter().map(|v| v.iov_len).sum());
        for v in &self.iov {
            if v.iov_len > 0 {
                // SAFETY: the caller's contract.
                out.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len)
                });
            }
        }
        out
    }
}

impl std::fmt::Debug for OutMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutMsg").field("pieces", &self.iov.len()).field("gso", &self.gso).finish()
    }
}

impl OutMsg {
    /// A message with no pieces yet, whose iovecs go into `iov` (emptied: a vector kept
    /// from an earlier message, for its capacity).
    pub(crate) fn with_iov(src: SocketAddr, dst: SocketAddr, tos: u8, iov: EmptyIovs) -> OutMsg {
        let iov = iov.0;
        OutMsg { dst: socket2::SockAddr::from(dst), to: dst, src, tos, iov, gso: None, control: [0; 8] }
    }

    /// Appends `len` bytes at `ptr`, extending the last iovec when they follow it in
    /// memory (packets built end to end: a GSO train becomes one iovec, which the kernel
    /// copies in one go).
    pub(crate) fn push_iov(&mut self, ptr: *mut u8, len: usize) {
        if let Some(last) = self.iov.last_mut() {
            if last.iov_base.cast::<u8>().wrapping_add(last.iov_len) == ptr {
                last.iov_len += len;
                return;
            }
        }
        self.iov.push(libc::iovec { iov_base: ptr.cast(), iov_len: len });
    }

    /// Gives back the message's iovec vector, emptied, for [`Self::with_iov`].
    pub(crate) fn into_iov(self) -> EmptyIovs {
        let mut iov = self.iov;
        iov.clear();
        EmptyIovs(iov)
    }
}

/// `SOL_UDP` option and control message: GSO segment size.
const UDP_SEGMENT: libc::c_int = 103;
/// `SOL_UDP` option and control message: GRO on receive.
const UDP_GRO: libc::c_int = 104;

/// What a batch send did.
#[derive(Default)]
pub(crate) struct Sent {
    /// Messages the kernel took.
    pub(crate) sent: usize,
    /// A GSO message was refused: the caller should stop using GSO.
    pub(crate) gso_refused: bool,
    /// Datagrams refused as larger than the path allows (`EMSGSIZE`: the QP's path MTU is
    /// above what the link carries).
    pub(crate) too_big: usize,
}

/// Sends `msgs` with as few `sendmmsg` calls as possible. A datagram the kernel refuses
/// (full buffer, unreachable) is dropped, as a lossy network would, and the transport
/// retransmits it.
///
/// # Safety
///
/// Every iovec must point to memory that is readable for its length during the call.
///
/// `default_tos` is the socket's own TOS byte: a message with another one carries it in
/// a control message (which costs the kernel a parse per send; most of a device's traffic
/// is ECN-capable, [`ECT0`], which device sockets take as their default).
pub(crate) unsafe fn send_batch(fd: RawFd, msgs: &mut [OutMsg], default_tos: u8) -> Sent {
    thread_local! {
        /// The message headers of the last batch this thread sent, kept for their
        /// capacity: a send allocates nothing.
        static HDRS: std::cell::RefCell<Vec<libc::mmsghdr>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    // SAFETY (all three calls): the caller's contract, passed on.
    let kept = HDRS.try_with(|h| match h.try_borrow_mut() {
        Ok(mut hdrs) => Some(unsafe { send_batch_in(fd, msgs, default_tos, &mut hdrs) }),
        Err(_) => None,
    });
    match kept {
        Ok(Some(sent)) => sent,
        // A reentrant call (none is made), or a thread whose locals are gone already (a
        // process exiting sends its held ACKs from an `atexit` handler, which glibc runs
        // after the exiting thread's destructors): headers of its own.
        _ => unsafe { send_batch_in(fd, msgs, default_tos, &mut Vec::new()) },
    }
}

/// [`send_batch`] with its headers built in `hdrs`.
///
/// # Safety
///
/// As for [`send_batch`].
unsafe fn send_batch_in(
    fd: RawFd,
    msgs: &mut [OutMsg],
    default_tos: u8,
    hdrs: &mut Vec<libc::mmsghdr>,
) -> Sent {
    hdrs.clear();
    hdrs.extend(msgs.iter_mut().map(|m| {
        // SAFETY: msghdr is plain old data; all-zero is valid before we fill it in.
        let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
        // The kernel only reads the name of a message it sends.
        h.msg_name = m.dst.as_ptr().cast_mut().cast();
        h.msg_namelen = m.dst.len();
        h.msg_iov = m.iov.as_mut_ptr();
        h.msg_iovlen = m.iov.len() as _;
        if m.gso.is_some() || m.tos != default_tos {
            h.msg_control = m.control.as_mut_ptr().cast();
            h.msg_controllen = std::mem::size_of_val(&m.control) as _;
            let mut used = 0;
            // SAFETY: the control buffer is 64 aligned bytes, room for two cmsghdrs with
            // an int each (24 bytes each); CMSG_FIRSTHDR/CMSG_NXTHDR return pointers
            // inside it while msg_controllen covers the whole buffer.
            unsafe {
                let mut c = libc::CMSG_FIRSTHDR(&h);
                if let Some(size) = m.gso {
                    (*c).cmsg_level = libc::SOL_UDP;
                    (*c).cmsg_type = UDP_SEGMENT;
                    (*c).cmsg_len = libc::CMSG_LEN(2) as _;
                    std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), size);
                    used += libc::CMSG_SPACE(2) as usize;
                    c = libc::CMSG_NXTHDR(&h, c);
                }
                if m.tos != default_tos && !c.is_null() {
                    let (level, ty) = if m.to.is_ipv4() {
                        (libc::IPPROTO_IP, libc::IP_TOS)
                    } else {
                        (libc::IPPROTO_IPV6, libc::IPV6_TCLASS)
                    };
                    (*c).cmsg_level = level;
                    (*c).cmsg_type = ty;
                    (*c).cmsg_len = libc::CMSG_LEN(4) as _;
                    std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>(), m.tos.into());
                    used += libc::CMSG_SPACE(4) as usize;
                }
            }
            h.msg_controllen = used as _;
        }
        libc::mmsghdr { msg_hdr: h, msg_len: 0 }
    }));
    let mut out = Sent::default();
    stage!(Sending);
    let mut at = 0;
    while at < hdrs.len() {
        // SAFETY: hdrs[at..] are valid mmsghdrs whose names, controls and iovecs point into
        // `msgs` and the caller's live memory.
        // (The system call itself, as for recvmmsg.)
        let n = unsafe {
            libc::syscall(
                libc::SYS_sendmmsg,
                fd,
                hdrs[at..].as_mut_ptr(),
                (hdrs.len() - at) as libc::c_uint,
                libc::MSG_DONTWAIT,
            )
        } as libc::c_int;
        if n <= 0 {
            let e = io::Error::last_os_error().raw_os_error();
            if msgs[at].gso.is_some() && matches!(e, Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT)) {
                out.gso_refused = true;
            }
            if e == Some(libc::EMSGSIZE) {
                out.too_big += 1;
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

/// ECN-capable transport, codepoint 0: the IP TOS byte of most of a device's datagrams.
pub(crate) const ECT0: u8 = 0b10;

/// Turns on UDP GRO for a socket; false if the kernel has none.
pub(crate) fn enable_gro(fd: RawFd) -> bool {
    setsockopt_int(fd, libc::SOL_UDP, UDP_GRO, 1)
}

/// A batch of receive buffers for `recvmmsg`, each large enough for a GRO train. The
/// message headers are built once and point into the batch's own heap buffers, which never
/// move; each call only resets the lengths the kernel overwrote.
pub(crate) struct RecvBatch {
    bufs: Vec<u8>,
    slot: usize,
    addrs: Vec<libc::sockaddr_storage>,
    controls: Vec<[u64; 16]>,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<libc::mmsghdr>,
    lens: Vec<usize>,
    segs: Vec<usize>,
    meta: Vec<Ancillary>,
    count: usize,
    /// Headers the last call may have written (the kernel updates each received one's
    /// lengths and flags): reset before the next, the rest are as set up.
    dirty: usize,
    /// How many datagrams the next call asks for, and whether the last call that received
    /// any filled what it asked. `recvmmsg` goes on to the next header after each datagram
    /// until one finds the queue empty, and that last try (a header copied in, its iovec
    /// imported, the queue locked) is paid on every call that does not fill the batch: on
    /// a ping-pong's every message, between its arrival and its processing. So a call asks
    /// for as many as the last one got, and twice that after two full calls in a row (no
    /// empty call between them: a stream that keeps the queue filled).
    want: usize,
    was_full: bool,
}

/// What the control messages of a received datagram said.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Ancillary {
    /// GRO segment size.
    pub(crate) gro: Option<usize>,
    /// The IP header's destination address (`IP_PKTINFO`, `IPV6_PKTINFO`).
    pub(crate) dst: Option<IpAddr>,
    /// The IP TOS byte or IPv6 traffic class (`IP_RECVTOS`, `IPV6_RECVTCLASS`).
    pub(crate) tos: u8,
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
            controls: vec![[0; 16]; n],
            iovs: Vec::with_capacity(n),
            hdrs: Vec::with_capacity(n),
            lens: vec![0; n],
            segs: vec![0; n],
            meta: vec![Ancillary::default(); n],
            count: 0,
            dirty: n,
            want: 1,
            was_full: false,
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
        for h in &mut self.hdrs[..self.dirty] {
            h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_hdr.msg_controllen = std::mem::size_of::<[u64; 16]>() as _;
            h.msg_hdr.msg_flags = 0;
        }
        let n = self.want.min(self.hdrs.len());
        // SAFETY: every header points to a distinct live buffer, address slot, control
        // buffer and iovec of this batch, which outlive the call. The system call itself,
        // not glibc's wrapper: a busy poll makes millions that find nothing, and the
        // wrapper's cancellation-point bookkeeping was 4 % of such a thread's time.
        let r = unsafe {
            libc::syscall(
                libc::SYS_recvmmsg,
                fd,
                self.hdrs.as_mut_ptr(),
                n as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut::<libc::timespec>(),
            )
        };
        self.count = if r > 0 { r as usize } else { 0 };
        if r > 0 {
            stage!(Received);
        }
        self.dirty = self.count.max(1);
        if self.count > 0 {
            let full = self.count == n;
            if full && self.was_full {
                self.want = (n * 2).min(self.hdrs.len());
            } else if !full {
                self.want = self.count;
            }
            self.was_full = full;
        } else {
            // The queue ran dry in between: what follows is a new burst.
            self.was_full = false;
        }
        for i in 0..self.count {
            let h = &self.hdrs[i];
            // A truncated datagram is longer than anything we accept; mark it empty so that
            // it is counted as malformed.
            let truncated = h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
            self.lens[i] = if truncated { 0 } else { h.msg_len as usize };
            let anc = ancillary(&h.msg_hdr);
            self.segs[i] = anc.gro.unwrap_or(self.lens[i]);
            self.meta[i] = anc;
        }
        self.count
    }

    /// Datagram `i` of the last `recv`: its source, its control messages and its segments
    /// (one, or the pieces of a GRO train).
    pub(crate) fn get(&self, i: usize) -> Option<(SocketAddr, Ancillary, std::slice::Chunks<'_, u8>)> {
        if i >= self.count {
            return None;
        }
        let src = from_storage(&self.addrs[i])?;
        let data = &self.bufs[i * self.slot..i * self.slot + self.lens[i]];
        Some((src, self.meta[i], data.chunks(self.segs[i].max(1))))
    }
}

/// The GRO segment size, destination address and TOS from a datagram's control messages.
fn ancillary(h: &libc::msghdr) -> Ancillary {
    let mut a = Ancillary::default();
    // SAFETY: the kernel filled msg_control/msg_controllen; the CMSG macros walk within it,
    // and each payload is read unaligned with the size its type says.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            let data = libc::CMSG_DATA(c);
            match ((*c).cmsg_level, (*c).cmsg_type) {
                (libc::SOL_UDP, UDP_GRO) => {
                    let v = std::ptr::read_unaligned(data.cast::<libc::c_int>());
                    a.gro = (v > 0).then_some(v as usize);
                }
                (libc::IPPROTO_IP, libc::IP_PKTINFO) => {
                    let p = std::ptr::read_unaligned(data.cast::<libc::in_pktinfo>());
                    a.dst = Some(IpAddr::V4(Ipv4Addr::from(p.ipi_addr.s_addr.to_ne_bytes())));
                }
                (libc::IPPROTO_IP, libc::IP_TOS) => a.tos = *data,
                (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO) => {
                    let p = std::ptr::read_unaligned(data.cast::<libc::in6_pktinfo>());
                    a.dst = Some(IpAddr::V6(Ipv6Addr::from(p.ipi6_addr.s6_addr)));
                }
                (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => {
                    a.tos = std::ptr::read_unaligned(data.cast::<libc::c_int>()) as u8;
                }
                _ => {}
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    a
}

/// Asks the kernel for each datagram's TOS byte and, with `dst`, its destination address
/// (a socket bound to one unicast address knows it without asking: each control message
/// costs the kernel a copy per datagram).
pub(crate) fn enable_recv_meta(fd: RawFd, ipv6: bool, dst: bool) -> bool {
    let (tos, pktinfo) = if ipv6 {
        ((libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS), (libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO))
    } else {
        ((libc::IPPROTO_IP, libc::IP_RECVTOS), (libc::IPPROTO_IP, libc::IP_PKTINFO))
    };
    setsockopt_int(fd, tos.0, tos.1, 1) && (!dst || setsockopt_int(fd, pktinfo.0, pktinfo.1, 1))
}

/// An epoll set, level-triggered for reading: one descriptor that is readable while any
/// of its members is (the link's multicast sockets, which come and go while threads wait
/// on the link's descriptors).
#[derive(Debug)]
pub(crate) struct Epoll(OwnedFd);

impl Epoll {
    pub(crate) fn new() -> io::Result<Epoll> {
        // SAFETY: epoll_create1 takes flags only.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor this struct now owns.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
        // SAFETY: a live epoll descriptor, a caller's descriptor and a valid event struct.
        if unsafe { libc::epoll_ctl(self.0.as_raw_fd(), op, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub(crate) fn add(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd)
    }

    pub(crate) fn remove(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd)
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// The members readable now (at most 64), without waiting.
    pub(crate) fn ready(&self, out: &mut Vec<RawFd>) {
        out.clear();
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 64];
        // SAFETY: a live epoll descriptor and a buffer of 64 events it may fill.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), evs.as_mut_ptr(), evs.len() as i32, 0) };
        for e in &evs[..n.max(0) as usize] {
            out.push(e.u64 as RawFd);
        }
    }
}

/// The CPU's time-stamp counter (elsewhere, nanoseconds of a monotonic clock): the
/// profiling features' clock, a few cycles to read.
#[cfg(any(feature = "stage-probe", feature = "timeline"))]
pub(crate) fn tsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: RDTSC has no preconditions on x86-64.
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        crate::cq::completion_clock_ns()
    }
}

/// Sets an integer socket option; false if the kernel refused.
pub(crate) fn setsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> bool {
    // SAFETY: passes a pointer to a live c_int and its size to setsockopt.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

/// Attaches to `fd`'s `SO_REUSEPORT` group a classic BPF program that picks, for each
/// datagram, the group's socket numbered by the low bits of the BTH's destination QPN
/// (`shards`, a power of two, sockets in the order they were bound): the software form of
/// a NIC's receive-side scaling. QP1 (the CM's) and the multicast QPN 0xFFFFFF go to
/// socket 0, as does a datagram too short to hold a BTH. The kernel runs the program
/// with the UDP payload at offset 0; attaching a classic program needs no privilege.
/// False if the kernel refused it (datagrams are then spread by the kernel's own hash).
pub(crate) fn attach_qpn_steering(fd: RawFd, shards: u32) -> bool {
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const AND_K: u16 = 0x54; // BPF_ALU | BPF_AND | BPF_K
    const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const RET_A: u16 = 0x16; // BPF_RET | BPF_A
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    let ins = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let mut prog = [
        ins(LD_W_ABS, 0, 0, 4),        // A = BTH bytes 4..8 (reserved, destination QPN)
        ins(AND_K, 0, 0, 0x00ff_ffff), // the QPN
        ins(JEQ_K, 3, 0, 1),           // QP1: to 6
        ins(JEQ_K, 2, 0, 0x00ff_ffff), // multicast: to 6
        ins(AND_K, 0, 0, shards.wrapping_sub(1)), // the shard
        ins(RET_A, 0, 0, 0),
        ins(RET_K, 0, 0, 0),
    ];
    let fprog = libc::sock_fprog { len: prog.len() as u16, filter: prog.as_mut_ptr() };
    // SAFETY: passes a live sock_fprog whose filter points to `prog`, alive through the
    // call (the kernel copies the program).
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    r == 0
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

#[cfg(test)]
mod tests {
    use super::{EmptyIovs, OutMsg, RecvBatch};
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    /// Pieces that follow each other in memory become one iovec, others start a new one,
    /// and the kernel cuts the GSO train at the segment size all the same.
    #[test]
    fn pieces_end_to_end_are_one_iovec_and_still_leave_as_their_datagrams() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_read_timeout(Some(std::time::Duration::from_secs(2))).unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut arena: Vec<u8> = (0..400u32).map(|i| i as u8).collect();
        let mut other = vec![0xeeu8; 100];
        let (src, dst) = (tx.local_addr().unwrap(), rx.local_addr().unwrap());
        let mut m = OutMsg::with_iov(src, dst, 0, EmptyIovs::with_capacity(4));
        let base = arena.as_mut_ptr();
        m.push_iov(base, 60);
        m.push_iov(base.wrapping_add(60), 40);
        m.push_iov(base.wrapping_add(100), 100);
        assert_eq!(m.iov.len(), 1, "three adjacent pieces make one iovec");
        m.push_iov(other.as_mut_ptr(), 100);
        m.push_iov(base.wrapping_add(300), 50);
        assert_eq!(m.iov.len(), 3, "a piece elsewhere starts a new iovec");
        assert_eq!(m.iov.iter().map(|v| v.iov_len).collect::<Vec<_>>(), vec![200, 100, 50]);
        m.gso = Some(100);
        let mut msgs = [m];
        // SAFETY: every iovec points into `arena` or `other`, alive through the call.
        let sent = unsafe { super::send_batch(tx.as_raw_fd(), &mut msgs, 0) };
        assert_eq!(sent.sent, 1);
        let mut want: Vec<Vec<u8>> = arena[..200].chunks(100).map(<[u8]>::to_vec).collect();
        want.push(other.clone());
        want.push(arena[300..350].to_vec());
        for w in want {
            let mut b = [0u8; 512];
            let n = rx.recv(&mut b).unwrap();
            assert_eq!(&b[..n], &w[..]);
        }
    }

    /// The batch asks for one datagram while they come one at a time, grows while the queue
    /// stays full, and loses none on the way.
    #[test]
    fn a_receive_batch_grows_with_a_full_queue_and_loses_nothing() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_nonblocking(true).unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = rx.local_addr().unwrap();
        let mut b = RecvBatch::new(16, 64);
        let mut got = vec![];
        let drain = |b: &mut RecvBatch, got: &mut Vec<u32>| {
            let n = b.recv(rx.as_raw_fd());
            for i in 0..n {
                let (_, _, mut segs) = b.get(i).unwrap();
                got.push(u32::from_le_bytes(segs.next().unwrap().try_into().unwrap()));
            }
            n
        };
        // One at a time (a ping-pong): each call asks for one and gets it.
        for k in 0..3u32 {
            tx.send_to(&k.to_le_bytes(), to).unwrap();
            assert_eq!((drain(&mut b, &mut got), b.want), (1, 1));
            assert_eq!((drain(&mut b, &mut got), b.want), (0, 1));
        }
        // A burst of 40 queued: the calls take 1, 1, then 2, 4, 8, 16 (the batch's size),
        // then what is left.
        for k in 3..43u32 {
            tx.send_to(&k.to_le_bytes(), to).unwrap();
        }
        let mut calls = vec![];
        loop {
            let n = drain(&mut b, &mut got);
            if n == 0 {
                break;
            }
            calls.push(n);
        }
        assert_eq!(calls, [1, 1, 2, 4, 8, 16, 8]);
        assert_eq!(got, (0..43).collect::<Vec<_>>(), "every datagram, in order");
    }
}
