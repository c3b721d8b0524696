//! RC through `softrdma relay` on real sockets: the relay drops, duplicates, reorders and
//! corrupts datagrams (after moving their ICRCs to its own addresses), and a ping-pong
//! through it still completes with every byte checked.

use std::time::Duration;

mod common;
use common::{output, softrdma, text, Proc};

/// How long any one process may run.
const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn rc_pingpong_through_an_impaired_relay() {
    let base = 21_000 + (std::process::id() % 5_000) as u16 * 4;
    let port = |k: u16| (base + k).to_string();
    let (a_side, b_side) = (format!("127.0.8.1:{}", port(0)), format!("127.0.8.2:{}", port(1)));
    let (peer_a, peer_b) = (format!("127.0.8.3:{}", port(2)), format!("127.0.8.4:{}", port(3)));
    let relay = Proc::start(
        softrdma([
            "relay", "--a-side", &a_side, "--b-side", &b_side, "--peer-a", &peer_a, "--peer-b", &peer_b,
        ])
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
        ]),
        LIMIT,
    );
    std::thread::sleep(Duration::from_millis(200));
    let tcp = (base + 2_000).to_string();
    let common = ["pingpong", "-n", "200", "-s", "10000", "-p", &tcp];
    let server = Proc::start(
        softrdma(common).args(["--bind", "127.0.8.3", "--udp-port", &port(2), "--via", &a_side]),
        LIMIT,
    );
    let client = output(
        softrdma(common)
            // The server's exchange listens on its --bind address only.
            .args(["--bind", "127.0.8.4", "--udp-port", &port(3), "--via", &b_side, "127.0.8.3"]),
        LIMIT,
    );
    let server = server.wait();
    // The relay prints its counters on SIGTERM.
    relay.signal(libc::SIGTERM);
    let counters = String::from_utf8(relay.wait().stdout).unwrap();
    assert!(client.status.success(), "client: {}\nrelay: {counters}", text(&client));
    assert!(server.status.success(), "server: {}", text(&server));
    assert!(text(&client).contains("200 iters in"));
    let field = |name: &str| -> u64 {
        counters.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{name}="))?.parse().ok()).unwrap()
    };
    assert!(field("repatched") > 0 && field("repatched") == field("received"), "{counters}");
    assert!(field("lost") > 0 && field("corrupted") > 0 && field("dup") > 0, "{counters}");
}
