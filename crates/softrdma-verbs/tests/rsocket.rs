//! rsockets called directly through their C entry points, in one process over two
//! loopback devices: a stream carries every byte in order through flow control and ends
//! with end of stream; non-blocking connect, receive and `rpoll` behave as sockets do;
//! `riomap`/`riowrite` place bytes in the peer's mapped buffer; misuse and refusal are
//! errnos.

use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

use softrdma_verbs::rdmacm::rsocket::*;

mod common;
use common::{errno, sockaddr};

const LEN: libc::socklen_t = size_of::<libc::sockaddr_in>() as libc::socklen_t;

/// A listening rsocket on `addr`.
unsafe fn listener(addr: &str) -> c_int {
    let l = unsafe { rsocket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    assert!(l >= 0);
    let sa = sockaddr(addr);
    assert_eq!(unsafe { rbind(l, (&raw const sa).cast(), LEN) }, 0, "rbind: {}", errno());
    assert_eq!(unsafe { rlisten(l, 4) }, 0);
    l
}

/// A blocking rsocket connected from `from` to `to`.
unsafe fn connect(from: &str, to: &str) -> c_int {
    let s = unsafe { rsocket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    let src = sockaddr(from);
    assert_eq!(unsafe { rbind(s, (&raw const src).cast(), LEN) }, 0);
    let dst = sockaddr(to);
    assert_eq!(unsafe { rconnect(s, (&raw const dst).cast(), LEN) }, 0, "rconnect: {}", errno());
    s
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

#[test]
fn a_stream_carries_every_byte_in_order_through_flow_control_and_ends() {
    // SAFETY: the rsocket API used as a program uses it.
    unsafe {
        let l = listener("127.0.9.2:7601");
        // 3 MiB, more than the receive window (32 x 64 KiB), written in odd sizes while
        // the server does not read for a while: the sender must wait for credits.
        const TOTAL: usize = 3 << 20;
        let client = std::thread::spawn(|| {
            let s = connect("127.0.9.3:0", "127.0.9.2:7601");
            let data: Vec<u8> = (0..TOTAL).map(pattern).collect();
            let mut at = 0;
            for size in [1usize, 7, 100, 65_536, 65_537, 200_000, 1 << 20].iter().cycle() {
                if at == TOTAL {
                    break;
                }
                let n = (*size).min(TOTAL - at);
                let r = rsend(s, data[at..].as_ptr().cast(), n, 0);
                assert_eq!(r, n as isize, "a blocking rsend takes everything: {}", errno());
                at += n;
            }
            assert_eq!(rshutdown(s, libc::SHUT_WR), 0);
            // The server answers after reading everything.
            let mut reply = [0u8; 5];
            assert_eq!(rrecv(s, reply.as_mut_ptr().cast(), 5, libc::MSG_WAITALL), 5);
            assert_eq!(&reply, b"thank");
            assert_eq!(rrecv(s, reply.as_mut_ptr().cast(), 5, 0), 0, "end of stream after the reply");
            assert_eq!(rclose(s), 0);
        });
        let mut peer: libc::sockaddr_in = std::mem::zeroed();
        let mut plen = LEN;
        let s = raccept(l, (&raw mut peer).cast(), &mut plen);
        assert!(s >= 0, "raccept: {}", errno());
        assert_eq!(peer.sin_addr.s_addr, u32::from_ne_bytes([127, 0, 9, 3]));
        std::thread::sleep(Duration::from_millis(300));
        let mut got = Vec::with_capacity(TOTAL);
        let mut buf = vec![0u8; 100_000];
        let mut k = 0usize;
        loop {
            let want = [3usize, 4096, 100_000, 65_536][k % 4];
            k += 1;
            // Bounded: data or the end of stream comes within 10 s, or the test fails.
            let mut p = [libc::pollfd { fd: s, events: libc::POLLIN, revents: 0 }];
            assert_eq!(rpoll(p.as_mut_ptr(), 1, 10_000), 1, "data or end of stream within 10 s");
            let n = rrecv(s, buf.as_mut_ptr().cast(), want, 0);
            assert!(n >= 0, "rrecv: {}", errno());
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n as usize]);
        }
        assert_eq!(got.len(), TOTAL, "every byte, then end of stream");
        assert!(got.iter().enumerate().all(|(i, &b)| b == pattern(i)), "in order, unchanged");
        assert_eq!(rsend(s, b"thank".as_ptr().cast(), 5, 0), 5);
        assert_eq!(rclose(s), 0);
        client.join().unwrap();
        assert_eq!(rclose(l), 0);
    }
}

#[test]
fn non_blocking_calls_and_rpoll_behave_as_sockets_do() {
    // SAFETY: as above.
    unsafe {
        let l = listener("127.0.9.2:7602");
        let mut fds = [libc::pollfd { fd: l, events: libc::POLLIN, revents: 0 }];
        assert_eq!(rpoll(fds.as_mut_ptr(), 1, 50), 0, "no request yet: rpoll times out");
        let c = rsocket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert_eq!(rfcntl(c, libc::F_SETFL, libc::O_NONBLOCK), 0);
        assert_eq!(rfcntl(c, libc::F_GETFL, 0) & libc::O_NONBLOCK, libc::O_NONBLOCK);
        let src = sockaddr("127.0.9.3:0");
        assert_eq!(rbind(c, (&raw const src).cast(), LEN), 0);
        let dst = sockaddr("127.0.9.2:7602");
        assert_eq!(rconnect(c, (&raw const dst).cast(), LEN), -1);
        assert_eq!(errno(), libc::EINPROGRESS);
        assert_eq!(rpoll(fds.as_mut_ptr(), 1, 5000), 1, "the request makes the listener readable");
        assert_eq!(fds[0].revents & libc::POLLIN, libc::POLLIN);
        let s = raccept(l, std::ptr::null_mut(), std::ptr::null_mut());
        assert!(s >= 0);
        let mut cfd = [libc::pollfd { fd: c, events: libc::POLLOUT, revents: 0 }];
        assert_eq!(rpoll(cfd.as_mut_ptr(), 1, 5000), 1, "connected: writable");
        let (mut err, mut len) = (-1 as c_int, size_of::<c_int>() as libc::socklen_t);
        assert_eq!(rgetsockopt(c, libc::SOL_SOCKET, libc::SO_ERROR, (&raw mut err).cast(), &mut len), 0);
        assert_eq!(err, 0);
        let mut b = [0u8; 16];
        assert_eq!(rrecv(c, b.as_mut_ptr().cast(), 16, 0), -1);
        assert_eq!(errno(), libc::EAGAIN, "nothing to read on a non-blocking rsocket");
        assert_eq!(rrecv(s, b.as_mut_ptr().cast(), 16, libc::MSG_DONTWAIT), -1);
        assert_eq!(errno(), libc::EAGAIN);
        // rpoll over an rsocket and a kernel descriptor together.
        let mut pipe = [0 as c_int; 2];
        assert_eq!(libc::pipe(pipe.as_mut_ptr()), 0);
        let mut both = [
            libc::pollfd { fd: s, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: pipe[0], events: libc::POLLIN, revents: 0 },
        ];
        assert_eq!(rpoll(both.as_mut_ptr(), 2, 30), 0);
        assert_eq!(rsend(c, b"hello".as_ptr().cast(), 5, 0), 5);
        let t0 = Instant::now();
        assert_eq!(rpoll(both.as_mut_ptr(), 2, 5000), 1);
        assert!(t0.elapsed() < Duration::from_secs(4), "woken by the data, not the timeout");
        assert_eq!((both[0].revents, both[1].revents), (libc::POLLIN, 0));
        assert_eq!(libc::write(pipe[1], b"x".as_ptr().cast(), 1), 1);
        assert_eq!(rpoll(both.as_mut_ptr(), 2, 0), 2);
        let mut peek = [0u8; 5];
        assert_eq!(rrecv(s, peek.as_mut_ptr().cast(), 5, libc::MSG_PEEK), 5);
        assert_eq!(rread(s, b.as_mut_ptr().cast(), 16), 5, "the peeked bytes are still there");
        assert_eq!((&peek, &b[..5]), (b"hello", &b"hello"[..]));
        libc::close(pipe[0]);
        libc::close(pipe[1]);
        // The peer's close: readable, end of stream.
        assert_eq!(rclose(c), 0);
        let mut fds = [libc::pollfd { fd: s, events: libc::POLLIN, revents: 0 }];
        assert_eq!(rpoll(fds.as_mut_ptr(), 1, 5000), 1);
        assert_eq!(rrecv(s, b.as_mut_ptr().cast(), 16, 0), 0);
        assert_eq!(rclose(s), 0);
        assert_eq!(rclose(l), 0);
    }
}

#[test]
fn riowrite_places_bytes_in_the_peers_mapped_buffer() {
    // SAFETY: as above; the mapped buffer outlives its mapping.
    unsafe {
        let l = listener("127.0.9.2:7603");
        let client = std::thread::spawn(|| {
            let s = connect("127.0.9.3:0", "127.0.9.2:7603");
            let data: Vec<u8> = (0..200_000).map(pattern).collect();
            // Wait for the server's mapping, then write at offset 1000.
            let mut go = [0u8; 1];
            assert_eq!(rrecv(s, go.as_mut_ptr().cast(), 1, 0), 1);
            let n = riowrite(s, data.as_ptr().cast(), data.len(), 1000, 0);
            assert_eq!(n, data.len(), "riowrite: {}", errno());
            assert_eq!(rsend(s, b"d".as_ptr().cast(), 1, 0), 1);
            assert_eq!(rrecv(s, go.as_mut_ptr().cast(), 1, 0), 0);
            rclose(s);
        });
        let s = raccept(l, std::ptr::null_mut(), std::ptr::null_mut());
        let mut mapped = vec![0u8; 300_000];
        let off = riomap(s, mapped.as_mut_ptr().cast::<c_void>(), mapped.len(), libc::PROT_WRITE, 0, 0);
        assert_eq!(off, 0);
        assert_eq!(rsend(s, b"g".as_ptr().cast(), 1, 0), 1);
        let mut done = [0u8; 1];
        assert_eq!(rrecv(s, done.as_mut_ptr().cast(), 1, 0), 1, "the peer's SEND follows its writes");
        assert!(mapped[..1000].iter().all(|&b| b == 0), "nothing before the offset");
        assert!((0..200_000).all(|i| mapped[1000 + i] == pattern(i)), "every byte at its place");
        assert!(mapped[201_000..].iter().all(|&b| b == 0), "nothing after");
        assert_eq!(riounmap(s, mapped.as_mut_ptr().cast(), mapped.len()), 0);
        rclose(s);
        client.join().unwrap();
        rclose(l);
    }
}

#[test]
fn refusal_and_misuse_are_errnos() {
    // SAFETY: deliberate misuse of the API's arguments.
    unsafe {
        assert_eq!(rsocket(libc::AF_UNIX, libc::SOCK_STREAM, 0), -1);
        assert_eq!(errno(), libc::EAFNOSUPPORT);
        assert_eq!(rsocket(libc::AF_INET, libc::SOCK_DGRAM, 0), -1);
        assert_eq!(errno(), libc::ENOTSUP);
        let mut b = [0u8; 4];
        assert_eq!(rsend(12345, b.as_ptr().cast(), 4, 0), -1);
        assert_eq!(errno(), libc::EBADF);
        let s = rsocket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert_eq!(rrecv(s, b.as_mut_ptr().cast(), 4, 0), -1);
        assert_eq!(errno(), libc::ENOTCONN);
        assert_eq!(rsetsockopt(s, 999, 1, b.as_ptr().cast(), 4), -1);
        assert_eq!(errno(), libc::ENOPROTOOPT);
        // Nobody listens on this port: refused (REJ), not a hang.
        let src = sockaddr("127.0.9.3:0");
        assert_eq!(rbind(s, (&raw const src).cast(), LEN), 0);
        let dst = sockaddr("127.0.9.2:7699");
        let l = listener("127.0.9.2:7698"); // the device is up, the port is not served
        assert_eq!(rconnect(s, (&raw const dst).cast(), LEN), -1);
        assert_eq!(errno(), libc::ECONNREFUSED);
        assert_eq!(rclose(s), 0);
        assert_eq!(rclose(s), -1);
        assert_eq!(errno(), libc::EBADF);
        rclose(l);
    }
}
