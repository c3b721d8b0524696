//! The out-of-band exchange against hostile clients, with real processes and sockets: a
//! `pingpong` or `perf` server drops a client that sends garbage, too long a line or
//! nothing at all, says so on stderr, and then serves a real client.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

mod common;
use common::{output, softrdma, text, Proc};

static NEXT: AtomicU16 = AtomicU16::new(0);
/// How long any one process may run.
const LIMIT: Duration = Duration::from_secs(40);

/// A TCP port and a UDP port for one test.
fn ports() -> (String, String) {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let base = 45_000 + (std::process::id() % 5_000) as u16 + n * 2;
    (base.to_string(), (base + 1).to_string())
}

fn spawn(args: &[&str], udp: &str) -> Proc {
    Proc::start(softrdma(args).env("SOFTRDMA_PORT", udp), LIMIT)
}

/// Connects to the server, retrying while it is not listening yet.
fn connect(addr: &str, port: &str) -> TcpStream {
    let start = Instant::now();
    loop {
        match TcpStream::connect((addr, port.parse::<u16>().unwrap())) {
            Ok(s) => return s,
            Err(e) if start.elapsed() > Duration::from_secs(10) => panic!("{addr}:{port}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Sends `bytes` (the server may hang up before it took them all), then waits until the
/// server closes the connection: it has dropped this client.
fn send_and_see_dropped(s: &mut TcpStream, bytes: &[u8]) {
    let _ = s.write_all(bytes);
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut sink = [0u8; 4096];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("the server kept a hostile client for 20 s")
            }
            // Reset: the server closed with our bytes unread.
            Err(_) => return,
        }
    }
}

/// Garbage, a line too long, then a client that says nothing; then `client` must be
/// served. Returns the server's stderr.
fn hostile_clients_then_a_real_one(
    server: Proc,
    addr: &str,
    tcp: &str,
    garbage: &[u8],
    client: &[&str],
    udp: &str,
) -> String {
    send_and_see_dropped(&mut connect(addr, tcp), garbage);
    // A megabyte with no newline: more than any line or message may be.
    send_and_see_dropped(&mut connect(addr, tcp), &vec![b'x'; 1 << 20]);
    // Connected and silent: the server must time it out. The real client queues behind it.
    let mut idle = connect(addr, tcp);
    let real = output(softrdma(client).env("SOFTRDMA_PORT", udp), LIMIT);
    let server = server.wait();
    send_and_see_dropped(&mut idle, b"");
    let _ = idle.shutdown(Shutdown::Both);
    assert!(real.status.success(), "client: {}\nserver: {}", text(&real), text(&server));
    assert!(server.status.success(), "server: {}", text(&server));
    let err = String::from_utf8_lossy(&server.stderr).to_string();
    assert_eq!(err.matches("dropped client 127.0.0.1:").count(), 3, "{err}");
    assert_eq!(err.matches("waiting for the next client").count(), 3, "{err}");
    assert!(err.contains("no answer within 5 s"), "the idle client: {err}");
    err
}

#[test]
fn pingpong_server_drops_garbage_long_lines_and_silence_then_serves() {
    let (tcp, udp) = ports();
    let server = spawn(&["pingpong", "--bind", "127.0.0.1", "-p", &tcp, "-n", "20"], &udp);
    let client = ["pingpong", "--bind", "127.0.3.3", "-p", &tcp, "-n", "20", "127.0.0.1"];
    let err = hostile_clients_then_a_real_one(server, "127.0.0.1", &tcp, b"{not json}\n", &client, &udp);
    assert!(err.contains("bad endpoint from peer: "), "{err}");
    assert!(err.contains("line longer than 65536 bytes"), "{err}");
}

#[test]
fn perf_server_drops_garbage_long_messages_and_silence_then_serves() {
    let (tcp, udp) = ports();
    let server = spawn(&["perf", "write_bw", "-d", "127.0.0.1", "-p", &tcp, "-n", "50"], &udp);
    let client = ["perf", "write_bw", "-d", "127.0.3.5", "-p", &tcp, "-n", "50", "127.0.0.1"];
    let err =
        hostile_clients_then_a_real_one(server, "127.0.0.1", &tcp, b"GET / HTTP/1.1\r\n\r\n", &client, &udp);
    assert_eq!(err.matches("not a perftest-compatible benchmark").count(), 2, "{err}");
}

#[test]
fn servers_listen_only_on_the_address_asked_for() {
    let (tcp, udp) = ports();
    let server = spawn(&["pingpong", "--bind", "127.0.3.7", "-p", &tcp, "-n", "5"], &udp);
    // Listening there, not on 127.0.0.1.
    let mut s = connect("127.0.3.7", &tcp);
    assert!(TcpStream::connect(("127.0.0.1", tcp.parse::<u16>().unwrap())).is_err());
    send_and_see_dropped(&mut s, b"\n");
    drop(server);
}

#[test]
fn a_failing_work_request_is_named_by_what_it_did() {
    // The server's receives hold 100 bytes; the client's first message has 200: the
    // server's receive fails, and so does the client's send.
    let (tcp, udp) = ports();
    let server = spawn(&["pingpong", "--bind", "127.0.3.9", "-p", &tcp, "-s", "100", "-n", "5"], &udp);
    let client = output(
        softrdma(["pingpong", "--bind", "127.0.3.10", "-p", &tcp, "-s", "200", "-n", "5", "127.0.3.9"])
            .env("SOFTRDMA_PORT", &udp),
        LIMIT,
    );
    let server = server.wait();
    let (c, s) = (String::from_utf8_lossy(&client.stderr), String::from_utf8_lossy(&server.stderr));
    assert!(!client.status.success() && !server.status.success(), "{c}\n{s}");
    assert!(c.contains("send of message 0 failed"), "{c}");
    assert!(s.contains("receive into slot 0 failed"), "{s}");
    assert!(!c.contains(&u64::MAX.to_string()), "{c}");
}
