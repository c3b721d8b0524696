//! RC through `softrdma relay` on real sockets: the relay drops, duplicates, reorders and
//! corrupts datagrams (after moving their ICRCs to its own addresses), and a ping-pong
//! through it still completes with every byte checked.

use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_softrdma");

#[test]
fn rc_pingpong_through_an_impaired_relay() {
    let base = 21_000 + (std::process::id() % 5_000) as u16 * 4;
    let port = |k: u16| (base + k).to_string();
    let (a_side, b_side) = (format!("127.0.8.1:{}", port(0)), format!("127.0.8.2:{}", port(1)));
    let (peer_a, peer_b) = (format!("127.0.8.3:{}", port(2)), format!("127.0.8.4:{}", port(3)));
    let relay = Command::new(BIN)
        .args(["relay", "--a-side", &a_side, "--b-side", &b_side, "--peer-a", &peer_a, "--peer-b", &peer_b])
        .args([
            "--loss",
            "5",
            "--dup",
            "2",
            "--reorder",
            "5",
            "--corrupt",
            "2",
            "--seed",
            "9",
            "--duration",
            "120",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let tcp = (base + 2_000).to_string();
    let common = ["pingpong", "-n", "200", "-s", "10000", "-p", &tcp];
    let server = Command::new(BIN)
        .args(common)
        .args(["--bind", "127.0.8.3", "--udp-port", &port(2), "--via", &a_side])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let client = Command::new(BIN)
        .args(common)
        // The server's exchange listens on its --bind address only.
        .args(["--bind", "127.0.8.4", "--udp-port", &port(3), "--via", &b_side, "127.0.8.3"])
        .output()
        .unwrap();
    let server = server.wait_with_output().unwrap();
    // SAFETY: signals our own child, which prints its counters on SIGTERM.
    unsafe { libc::kill(relay.id() as i32, libc::SIGTERM) };
    let counters = String::from_utf8(relay.wait_with_output().unwrap().stdout).unwrap();
    let text = |o: &std::process::Output| {
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    };
    assert!(client.status.success(), "client: {}\nrelay: {counters}", text(&client));
    assert!(server.status.success(), "server: {}", text(&server));
    assert!(text(&client).contains("200 iters in"));
    let field = |name: &str| -> u64 {
        counters.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{name}="))?.parse().ok()).unwrap()
    };
    assert!(field("repatched") > 0 && field("repatched") == field("received"), "{counters}");
    assert!(field("lost") > 0 && field("corrupted") > 0 && field("dup") > 0, "{counters}");
}
