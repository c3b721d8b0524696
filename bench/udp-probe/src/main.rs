//! Raw UDP baselines, the ceiling any RDMA-over-UDP stack on this host lives under.
//!
//! Each mode runs a sender and a receiver thread on loopback in one process:
//!
//! - `pingpong N SIZE`: SIZE-byte datagram ping-pong, N round trips; prints the median
//!   one-way latency in µs (half the round trip). Both sides busy-poll non-blocking
//!   sockets, as softrdma's busy-poll mode does, so the two compare like for like;
//! - `pingpong-mmsg N SIZE [WITHOUT]`: the busy-polled ping-pong with softrdma's system
//!   calls (`sendmmsg` of one iovec to a destination; `recvmmsg` with `IP_RECVTOS` and GRO
//!   on, offered as many buffers as the last call found): what the shape of those calls
//!   costs, before any user-space work. WITHOUT takes options away to price each, a
//!   comma-separated list of `gro`, `recvtos`, `name` (connected sockets), `mmsg` (plain
//!   `send` and `recv`);
//! - `pingpong-wait N SIZE`: the same with blocking sockets: each side sleeps in `recv`
//!   until the datagram comes, the floor of any event-driven ping-pong;
//! - `pingpong-procs N SIZE`, `pingpong-wait-procs N SIZE`: `pingpong` and `pingpong-wait`
//!   with the two sides in two processes, as `softrdma perf --local` runs its own (a copy
//!   of this program, started with the hidden mode `echo`, answers);
//! - `bw SECONDS SEGMENT`: sends of up to 64 KiB (and at most 64 segments, the kernel's
//!   limit) cut into SEGMENT-byte datagrams by UDP GSO, received with GRO; prints MiB/s of
//!   datagram payload delivered;
//! - `bw-zerocopy SECONDS SEGMENT`: `bw` with `MSG_ZEROCOPY` sends (`SO_ZEROCOPY`), the
//!   completions reaped from the error queue; also prints the share of sends the kernel
//!   reported it copied after all (`SO_EE_CODE_ZEROCOPY_COPIED`: every one delivered to a
//!   local socket, as on loopback or a veth);
//! - `rate-gso SECONDS SIZE`: the same with SIZE-byte datagrams, counted: millions of
//!   datagrams per second, batched as softrdma batches a stream of small messages (GSO
//!   trains out, GRO trains in), the fair message-rate baseline;
//! - `rate SECONDS SIZE`: SIZE-byte datagrams, one message each, with sendmmsg and
//!   recvmmsg in batches of 64; prints millions of datagrams per second delivered;
//! - `rate-uring SECONDS SIZE`: the same batches through io_uring instead: 64 SENDMSG
//!   entries per `io_uring_enter`, and 64 RECVMSG entries kept posted on the receiver
//!   (one system call per batch either way: what io_uring could save softrdma is the
//!   system calls, not the per-datagram work in the kernel).
//!
//! Output is one line `name value unit`, for `bench/compare.sh`.

use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn pair() -> (UdpSocket, UdpSocket) {
    let a = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let b = UdpSocket::bind("127.0.0.1:0").expect("bind");
    a.connect(b.local_addr().unwrap()).unwrap();
    b.connect(a.local_addr().unwrap()).unwrap();
    for s in [&a, &b] {
        set(s, libc::SOL_SOCKET, libc::SO_RCVBUF, 8 << 20);
        set(s, libc::SOL_SOCKET, libc::SO_SNDBUF, 8 << 20);
    }
    (a, b)
}

fn set(s: &UdpSocket, level: libc::c_int, name: libc::c_int, v: libc::c_int) {
    // SAFETY: a pointer to a live c_int and its size, on our own socket.
    unsafe {
        libc::setsockopt(s.as_raw_fd(), level, name, (&v as *const libc::c_int).cast(), 4);
    }
}

fn pingpong(n: usize, size: usize, block: bool) {
    let (a, b) = pair();
    for s in [&a, &b] {
        s.set_nonblocking(!block).unwrap();
        // A blocking side waits 10 s at most (then `recv_or_spin` fails).
        s.set_read_timeout(block.then_some(Duration::from_secs(10))).unwrap();
    }
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        for _ in 0..n {
            let k = recv_or_spin(&b, &mut buf, block);
            b.send(&buf[..k]).unwrap();
        }
    });
    let msg = vec![7u8; size];
    let mut buf = vec![0u8; 65536];
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        a.send(&msg).unwrap();
        recv_or_spin(&a, &mut buf, block);
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    echo.join().unwrap();
    report(if block { "udp_pingpong_blocking_oneway" } else { "udp_pingpong_oneway" }, lat);
}

/// [`pingpong`] between two processes, as `softrdma perf --local` runs its two sides:
/// this one, and a copy of this program started with the hidden mode `echo` that answers
/// every datagram. A process's threads start beside each other, two processes' apart (the
/// kernel spreads a new process to an idle CPU), and on a VM whose idle vCPUs halt a
/// wake-up across vCPUs costs tens of microseconds: with sleeping sides, this is the
/// placement softrdma's event mode is measured in.
fn pingpong_procs(n: usize, size: usize, block: bool) {
    /// The echo process, killed if this one ends before it (an error, a panic).
    struct Echo(std::process::Child);
    impl Drop for Echo {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let a = UdpSocket::bind("127.0.0.1:0").expect("bind");
    set(&a, libc::SOL_SOCKET, libc::SO_RCVBUF, 8 << 20);
    let exe = std::env::current_exe().expect("this program's path");
    let mut child = Echo(
        std::process::Command::new(exe)
            .args([
                "echo",
                &a.local_addr().unwrap().to_string(),
                &n.to_string(),
                if block { "1" } else { "0" },
            ])
            .spawn()
            .expect("start the echo process"),
    );
    // The echo side's first datagram names its address.
    let mut buf = vec![0u8; 65536];
    a.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (_, peer) = a.recv_from(&mut buf).expect("the echo process's hello within 10 s");
    a.connect(peer).unwrap();
    a.set_nonblocking(!block).unwrap();
    let msg = vec![7u8; size];
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        a.send(&msg).unwrap();
        recv_or_spin(&a, &mut buf, block);
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    assert!(child.0.wait().expect("the echo process").success(), "the echo process failed");
    report(if block { "udp_pingpong_procs_blocking_oneway" } else { "udp_pingpong_procs_oneway" }, lat);
}

/// A datagram from `s`: spinning while it has none if it does not `block`, failing on
/// any other error (the peer gone: `ECONNREFUSED`; a blocking socket's 10 s timeout).
fn recv_or_spin(s: &UdpSocket, buf: &mut [u8], block: bool) -> usize {
    loop {
        match s.recv(buf) {
            Ok(k) => return k,
            Err(e) if !block && e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => panic!("receive: {e}"),
        }
    }
}

/// The other side of [`pingpong_procs`]: says hello to `to`, then answers `n` datagrams.
/// It dies with its parent.
fn echo(to: &str, n: usize, block: bool) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and touches no memory.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let b = UdpSocket::bind("127.0.0.1:0").expect("bind");
    set(&b, libc::SOL_SOCKET, libc::SO_RCVBUF, 8 << 20);
    b.connect(to).expect("the ping side's address");
    b.send(&[0u8; 1]).unwrap();
    if block {
        b.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    }
    b.set_nonblocking(!block).unwrap();
    let mut buf = vec![0u8; 65536];
    for _ in 0..n {
        let k = recv_or_spin(&b, &mut buf, block);
        b.send(&buf[..k]).unwrap();
    }
}

/// [`pingpong`] with softrdma's system calls as a ping-pong makes them: unconnected
/// sockets bound to one address, each datagram a `sendmmsg` of one message with a
/// destination name and one iovec (a packet built whole), received by `recvmmsg` with
/// `IP_RECVTOS` and GRO on, into a batch of 64 KiB buffers of which softrdma asks for as
/// many as the last call found (one, in a ping-pong). Against [`pingpong`], what the
/// shape of those calls costs in the kernel, before any work of softrdma's own.
///
/// `without` takes options away one at a time, to price each: `gro`, `recvtos`, `name`
/// (connected sockets, no destination in the call), `mmsg` (plain `send` and `recv`).
fn pingpong_mmsg(n: usize, size: usize, without: &str) {
    let off = |what: &str| without.split(',').any(|w| w == what);
    let (gro, recvtos, name, mmsg) = (!off("gro"), !off("recvtos"), !off("name"), !off("mmsg"));
    if let Some(w) =
        without.split(',').find(|w| !w.is_empty() && !["gro", "recvtos", "name", "mmsg"].contains(w))
    {
        eprintln!("udp-probe: unknown option to take away: {w} (gro, recvtos, name, mmsg)");
        std::process::exit(2);
    }
    let a = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let b = UdpSocket::bind("127.0.0.1:0").expect("bind");
    for s in [&a, &b] {
        s.set_nonblocking(true).unwrap();
        set(s, libc::SOL_SOCKET, libc::SO_RCVBUF, 8 << 20);
        if recvtos {
            set(s, libc::IPPROTO_IP, libc::IP_RECVTOS, 1);
        }
        if gro {
            set(s, libc::SOL_UDP, 104, 1); // UDP_GRO
        }
    }
    let (pa, pb) = (a.local_addr().unwrap(), b.local_addr().unwrap());
    if !name {
        a.connect(pb).unwrap();
        b.connect(pa).unwrap();
    }
    fn sockaddr(addr: std::net::SocketAddr) -> libc::sockaddr_in {
        let std::net::SocketAddr::V4(v4) = addr else { unreachable!("bound to 127.0.0.1") };
        // SAFETY: plain old data.
        let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        sa.sin_family = libc::AF_INET as _;
        sa.sin_port = v4.port().to_be();
        sa.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
        sa
    }
    // One datagram to `to` (None: the connected peer), shaped as softrdma's.
    fn send(fd: i32, to: Option<&libc::sockaddr_in>, packet: &[u8], mmsg: bool) {
        // SAFETY: the header points at a live iovec and name during the call.
        unsafe {
            if !mmsg {
                let (name, len) = match to {
                    Some(to) => {
                        ((to as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>())
                    }
                    None => (std::ptr::null(), 0),
                };
                libc::sendto(fd, packet.as_ptr().cast(), packet.len(), libc::MSG_DONTWAIT, name, len as _);
                return;
            }
            let mut iov = libc::iovec { iov_base: packet.as_ptr().cast_mut().cast(), iov_len: packet.len() };
            let mut h: libc::mmsghdr = std::mem::zeroed();
            if let Some(to) = to {
                h.msg_hdr.msg_name = (to as *const libc::sockaddr_in).cast_mut().cast();
                h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as _;
            }
            h.msg_hdr.msg_iov = &mut iov;
            h.msg_hdr.msg_iovlen = 1;
            libc::sendmmsg(fd, &mut h, 1, libc::MSG_DONTWAIT);
        }
    }
    // Receive buffers, headers and control space for a batch, built once.
    struct Batch {
        bufs: Vec<Vec<u8>>,
        iovs: Vec<libc::iovec>,
        names: Vec<libc::sockaddr_in6>,
        controls: Vec<[u64; 16]>,
        hdrs: Vec<libc::mmsghdr>,
        /// Buffers to offer the next call: as many as the last one found.
        want: usize,
    }
    impl Batch {
        fn new() -> Box<Batch> {
            const N: usize = 32;
            // SAFETY (zeroed): plain old data.
            let mut b = Box::new(Batch {
                bufs: vec![vec![0u8; 65536]; N],
                iovs: Vec::new(),
                names: vec![unsafe { std::mem::zeroed() }; N],
                controls: vec![[0u64; 16]; N],
                hdrs: Vec::new(),
                want: 1,
            });
            b.iovs = iovecs(&mut b.bufs);
            b.hdrs = (0..N)
                .map(|_| libc::mmsghdr { msg_hdr: unsafe { std::mem::zeroed() }, msg_len: 0 })
                .collect();
            b
        }
        fn recv(&mut self, fd: i32, mmsg: bool) -> isize {
            if !mmsg {
                // SAFETY: the first buffer of this batch, live and of its length.
                return unsafe {
                    libc::recv(fd, self.bufs[0].as_mut_ptr().cast(), self.bufs[0].len(), libc::MSG_DONTWAIT)
                };
            }
            for (i, h) in self.hdrs.iter_mut().enumerate().take(self.want) {
                h.msg_hdr.msg_name = (&mut self.names[i] as *mut libc::sockaddr_in6).cast();
                h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in6>() as _;
                h.msg_hdr.msg_iov = &mut self.iovs[i];
                h.msg_hdr.msg_iovlen = 1;
                h.msg_hdr.msg_control = self.controls[i].as_mut_ptr().cast();
                h.msg_hdr.msg_controllen = 128;
            }
            // SAFETY: the headers point at this batch's live buffers.
            let got = unsafe {
                libc::syscall(
                    libc::SYS_recvmmsg,
                    fd,
                    self.hdrs.as_mut_ptr(),
                    self.want as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut::<libc::timespec>(),
                ) as isize
            };
            if got > 0 {
                self.want = (got as usize).clamp(1, self.hdrs.len());
            }
            got
        }
        fn spin(&mut self, fd: i32, mmsg: bool) {
            while self.recv(fd, mmsg) <= 0 {
                std::hint::spin_loop();
            }
        }
    }
    // BTH, payload and ICRC in one buffer, as softrdma sends them.
    let packet = vec![7u8; 12 + size + 4];
    let (fa, fb) = (a.as_raw_fd(), b.as_raw_fd());
    let (to_a, to_b) = (sockaddr(pa), sockaddr(pb));
    let echo = std::thread::spawn({
        let packet = packet.clone();
        move || {
            let _keep = b;
            let mut batch = Batch::new();
            for _ in 0..n {
                batch.spin(fb, mmsg);
                send(fb, name.then_some(&to_a), &packet, mmsg);
            }
        }
    });
    let mut batch = Batch::new();
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        send(fa, name.then_some(&to_b), &packet, mmsg);
        batch.spin(fa, mmsg);
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    echo.join().unwrap();
    report("udp_pingpong_mmsg_oneway", lat);
}

fn report(name: &str, mut lat: Vec<f64>) {
    lat.sort_by(f64::total_cmp);
    let q = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!("{name} {:.2} usec p99 {:.2} p99_9 {:.2}", q(0.5), q(0.99), q(0.999));
}

fn bw(secs: f64, seg: usize) {
    let (bytes, elapsed) = gso_stream(secs, seg, None);
    println!("udp_gso_gro_bw {:.1} MiB/sec", bytes as f64 / elapsed / (1 << 20) as f64);
}

fn bw_zerocopy(secs: f64, seg: usize) {
    let mut zc = ZeroCopy::default();
    let (bytes, elapsed) = gso_stream(secs, seg, Some(&mut zc));
    println!(
        "udp_gso_gro_zerocopy_bw {:.1} MiB/sec sends {} completed {} copied {}",
        bytes as f64 / elapsed / (1 << 20) as f64,
        zc.sends,
        zc.completed,
        zc.copied
    );
}

/// `<linux/errqueue.h>`: a zero-copy completion, and its flag for "copied after all".
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;

/// `MSG_ZEROCOPY` bookkeeping: sends made, and of their completions how many the kernel
/// says it copied anyway.
#[derive(Default)]
struct ZeroCopy {
    sends: u64,
    completed: u64,
    copied: u64,
}

impl ZeroCopy {
    /// Reads every completion waiting on `fd`'s error queue.
    fn reap(&mut self, fd: i32) {
        loop {
            let mut control = [0u64; 16];
            // SAFETY: msghdr is plain old data; the control buffer is a live local.
            let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
            h.msg_control = control.as_mut_ptr().cast();
            h.msg_controllen = std::mem::size_of_val(&control) as _;
            // SAFETY: a valid msghdr for a non-blocking read of the socket's error queue.
            if unsafe { libc::recvmsg(fd, &mut h, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) } < 0 {
                return;
            }
            // SAFETY: the kernel filled `control` with `msg_controllen` bytes of cmsgs; an
            // IP_RECVERR one carries a sock_extended_err.
            unsafe {
                let mut c = libc::CMSG_FIRSTHDR(&h);
                while !c.is_null() {
                    if (*c).cmsg_level == libc::SOL_IP && (*c).cmsg_type == libc::IP_RECVERR {
                        let e =
                            std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::sock_extended_err>());
                        if e.ee_origin == SO_EE_ORIGIN_ZEROCOPY {
                            // ee_info..=ee_data: the range of sends this completes.
                            let n = u64::from(e.ee_data.wrapping_sub(e.ee_info)) + 1;
                            self.completed += n;
                            if e.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0 {
                                self.copied += n;
                            }
                        }
                    }
                    c = libc::CMSG_NXTHDR(&h, c);
                }
            }
        }
    }
}

fn rate_gso(secs: f64, size: usize) {
    let (bytes, elapsed) = gso_stream(secs, size, None);
    println!("udp_gso_packet_rate {:.3} Mpps", (bytes / size as u64) as f64 / elapsed / 1e6);
}

/// Streams GSO trains of `seg`-byte datagrams for `secs`; returns the payload bytes the
/// receiver got (through GRO) and the time taken. With `zc`, sends with `MSG_ZEROCOPY`
/// (the buffer never changes, so a completion only frees its accounting).
fn gso_stream(secs: f64, seg: usize, mut zc: Option<&mut ZeroCopy>) -> (u64, f64) {
    let (a, b) = pair();
    if zc.is_some() {
        set(&a, libc::SOL_SOCKET, libc::SO_ZEROCOPY, 1);
    }
    set(&b, libc::SOL_UDP, 104 /* UDP_GRO */, 1);
    let stop = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let (s2, b2) = (stop.clone(), bytes.clone());
    b.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let rx = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        while !s2.load(Ordering::Relaxed) {
            if let Ok(k) = b.recv(&mut buf) {
                b2.fetch_add(k as u64, Ordering::Relaxed);
            }
        }
    });
    let chunk = vec![1u8; (65000 / seg).clamp(1, 64) * seg];
    let start = Instant::now();
    let fd = a.as_raw_fd();
    while start.elapsed().as_secs_f64() < secs {
        let mut iov = libc::iovec { iov_base: chunk.as_ptr() as *mut libc::c_void, iov_len: chunk.len() };
        let mut control = [0u64; 4];
        // SAFETY: msghdr is plain old data; we fill it with pointers to live locals.
        let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
        h.msg_iov = &mut iov;
        h.msg_iovlen = 1;
        h.msg_control = control.as_mut_ptr().cast();
        h.msg_controllen = std::mem::size_of_val(&control) as _;
        // SAFETY: the control buffer holds one cmsghdr with a u16; the socket is ours.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&h);
            (*c).cmsg_level = libc::SOL_UDP;
            (*c).cmsg_type = 103; // UDP_SEGMENT
            (*c).cmsg_len = libc::CMSG_LEN(2) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg as u16);
            h.msg_controllen = libc::CMSG_SPACE(2) as _;
            match zc.as_deref_mut() {
                None => {
                    libc::sendmsg(fd, &h, 0);
                }
                Some(z) => {
                    // ENOBUFS: too many completions unread (the socket's option memory).
                    if libc::sendmsg(fd, &h, libc::MSG_ZEROCOPY) >= 0 {
                        z.sends += 1;
                    }
                    if z.sends - z.completed >= 32 || z.sends % 8 == 0 {
                        z.reap(fd);
                    }
                }
            }
        }
    }
    if let Some(z) = zc {
        let until = Instant::now() + Duration::from_millis(200);
        while z.completed < z.sends && Instant::now() < until {
            z.reap(fd);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::Relaxed);
    rx.join().unwrap();
    (bytes.load(Ordering::Relaxed), elapsed)
}

const BATCH: usize = 64;

fn mmsg(fd: i32, bufs: &mut [Vec<u8>], send: bool) -> isize {
    let mut iovs = iovecs(bufs);
    let mut hdrs: Vec<libc::mmsghdr> =
        iovs.iter_mut().map(|iov| libc::mmsghdr { msg_hdr: msghdr_for(iov), msg_len: 0 }).collect();
    // SAFETY: headers point at live iovecs and buffers for the duration of the call.
    unsafe {
        if send {
            libc::sendmmsg(fd, hdrs.as_mut_ptr(), hdrs.len() as u32, 0) as isize
        } else {
            libc::recvmmsg(fd, hdrs.as_mut_ptr(), hdrs.len() as u32, libc::MSG_DONTWAIT, std::ptr::null_mut())
                as isize
        }
    }
}

fn rate(secs: f64, size: usize) {
    let (a, b) = pair();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let (s2, c2) = (stop.clone(), count.clone());
    let rx = std::thread::spawn(move || {
        let mut bufs = vec![vec![0u8; 2048]; BATCH];
        while !s2.load(Ordering::Relaxed) {
            let n = mmsg(b.as_raw_fd(), &mut bufs, false);
            if n > 0 {
                c2.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
    });
    let mut bufs = vec![vec![3u8; size]; BATCH];
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        mmsg(a.as_raw_fd(), &mut bufs, true);
    }
    let elapsed = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::Relaxed);
    rx.join().unwrap();
    println!("udp_packet_rate {:.3} Mpps", count.load(Ordering::Relaxed) as f64 / elapsed / 1e6);
}

/// One iovec over each buffer.
fn iovecs(bufs: &mut [Vec<u8>]) -> Vec<libc::iovec> {
    bufs.iter_mut().map(|b| libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: b.len() }).collect()
}

/// A msghdr over the one iovec `iov`.
fn msghdr_for(iov: &mut libc::iovec) -> libc::msghdr {
    // SAFETY: msghdr is plain old data; all-zero is valid before we fill it in.
    let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
    h.msg_iov = iov;
    h.msg_iovlen = 1;
    h
}

fn rate_uring(secs: f64, size: usize) {
    use io_uring::{opcode, types, IoUring};
    let (a, b) = pair();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let (s2, c2) = (stop.clone(), count.clone());
    let rx = std::thread::spawn(move || {
        let mut ring = IoUring::new(2 * BATCH as u32).expect("io_uring");
        let mut bufs = vec![vec![0u8; 2048]; BATCH];
        let mut iovs = iovecs(&mut bufs);
        let mut hdrs: Vec<libc::msghdr> = iovs.iter_mut().map(msghdr_for).collect();
        let fd = types::Fd(b.as_raw_fd());
        let post = |ring: &mut IoUring, hdrs: &mut [libc::msghdr], k: usize| {
            let e = opcode::RecvMsg::new(fd, &mut hdrs[k]).build().user_data(k as u64);
            // SAFETY: the header, its iovec and buffer live until the ring is dropped,
            // after the last completion is taken or the thread ends.
            unsafe { ring.submission().push(&e).expect("room in the ring") };
        };
        for k in 0..BATCH {
            post(&mut ring, &mut hdrs, k);
        }
        while !s2.load(Ordering::Relaxed) {
            ring.submit_and_wait(1).expect("io_uring_enter");
            let done: Vec<(usize, i32)> =
                ring.completion().map(|c| (c.user_data() as usize, c.result())).collect();
            let got = done.iter().filter(|(_, r)| *r > 0).count();
            c2.fetch_add(got as u64, Ordering::Relaxed);
            for (k, _) in done {
                post(&mut ring, &mut hdrs, k);
            }
        }
        drop(ring);
        drop(bufs);
    });
    let mut ring = IoUring::new(2 * BATCH as u32).expect("io_uring");
    let mut bufs = vec![vec![3u8; size]; BATCH];
    let mut iovs = iovecs(&mut bufs);
    let hdrs: Vec<libc::msghdr> = iovs.iter_mut().map(msghdr_for).collect();
    let fd = types::Fd(a.as_raw_fd());
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        for (k, h) in hdrs.iter().enumerate() {
            let e = opcode::SendMsg::new(fd, h).build().user_data(k as u64);
            // SAFETY: the headers and buffers outlive the batch, which is waited for below.
            unsafe { ring.submission().push(&e).expect("room in the ring") };
        }
        ring.submit_and_wait(BATCH).expect("io_uring_enter");
        ring.completion().for_each(drop);
    }
    let elapsed = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::Relaxed);
    // Wake the receiver, which may be waiting in the ring, until it sees the flag.
    while !rx.is_finished() {
        let _ = a.send(&[0u8; 1]);
        std::thread::sleep(Duration::from_millis(1));
    }
    rx.join().unwrap();
    println!("udp_packet_rate_uring {:.3} Mpps", count.load(Ordering::Relaxed) as f64 / elapsed / 1e6);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: f64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    match args.first().map(String::as_str) {
        Some("pingpong") => pingpong(num(1, 20000.0) as usize, num(2, 8.0) as usize, false),
        Some("pingpong-mmsg") => pingpong_mmsg(
            num(1, 20000.0) as usize,
            num(2, 8.0) as usize,
            args.get(3).map_or("", String::as_str),
        ),
        Some("pingpong-wait") => pingpong(num(1, 20000.0) as usize, num(2, 8.0) as usize, true),
        Some("pingpong-procs") => pingpong_procs(num(1, 20000.0) as usize, num(2, 8.0) as usize, false),
        Some("pingpong-wait-procs") => pingpong_procs(num(1, 20000.0) as usize, num(2, 8.0) as usize, true),
        Some("echo") => {
            echo(args.get(1).map_or("", String::as_str), num(2, 0.0) as usize, num(3, 0.0) != 0.0)
        }
        Some("bw") => bw(num(1, 3.0), num(2, 4096.0) as usize),
        Some("bw-zerocopy") => bw_zerocopy(num(1, 3.0), num(2, 4096.0) as usize),
        Some("rate") => rate(num(1, 3.0), num(2, 20.0) as usize),
        Some("rate-gso") => rate_gso(num(1, 3.0), num(2, 20.0) as usize),
        Some("rate-uring") => rate_uring(num(1, 3.0), num(2, 20.0) as usize),
        _ => {
            eprintln!(
                "usage: udp-probe pingpong [N] [SIZE] | pingpong-mmsg [N] [SIZE] [WITHOUT] | pingpong-wait [N] [SIZE] | pingpong-procs [N] [SIZE] | pingpong-wait-procs [N] [SIZE] | bw [SECONDS] [SEGMENT] | bw-zerocopy [SECONDS] [SEGMENT] | rate [SECONDS] [SIZE] \
                 | rate-gso [SECONDS] [SIZE] | rate-uring [SECONDS] [SIZE]"
            );
            std::process::exit(2);
        }
    }
}
