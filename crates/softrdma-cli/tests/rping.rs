//! `softrdma rping` between two processes over the connection manager: clean, through a
//! lossy relay, and against a port nobody listens on.

use std::process::{Command, Output};
use std::time::Duration;

mod common;
use common::{output, softrdma, text, Proc};

/// How long any one process may run.
const LIMIT: Duration = Duration::from_secs(60);

/// A RoCE port of this test run's own, so that parallel runs do not meet: both sides of a
/// CM exchange use the same port, as RoCE's 4791.
fn roce_port(k: u16) -> String {
    (30_000 + (std::process::id() % 3_000) as u16 * 8 + k).to_string()
}

fn rping(port: &str, args: &[&str]) -> Command {
    let mut c = softrdma(["rping"]);
    c.env("SOFTRDMA_PORT", port).args(args);
    c
}

fn spawn(mut c: Command) -> Proc {
    Proc::start(&mut c, LIMIT)
}

/// Runs a client to its end.
fn run(mut c: Command) -> Output {
    output(&mut c, LIMIT)
}

fn pings(o: &Output, prefix: &str) -> Vec<String> {
    String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with(prefix)).map(str::to_owned).collect()
}

#[test]
fn a_hundred_pings_between_two_processes() {
    let port = roce_port(0);
    let server = spawn(rping(&port, &["-s", "-a", "127.0.9.2", "-C", "100", "-v", "-p", "7201"]));
    std::thread::sleep(Duration::from_millis(300));
    let client = run(rping(
        &port,
        &["-c", "-a", "127.0.9.2", "-I", "127.0.9.3", "-C", "100", "-v", "-V", "-p", "7201"],
    ));
    let server = server.wait();
    assert!(client.status.success(), "client: {}", text(&client));
    assert!(server.status.success(), "server: {}", text(&server));
    let c = pings(&client, "ping data: rdma-ping-");
    let s = pings(&server, "server ping data: rdma-ping-");
    assert_eq!((c.len(), s.len()), (100, 100), "client:\n{}\nserver:\n{}", text(&client), text(&server));
    // rping's text: the iteration, then letters rotating from 'A'.
    assert!(c[0].starts_with("ping data: rdma-ping-0: ABCDEFGHIJ"), "{}", c[0]);
    assert!(c[99].starts_with("ping data: rdma-ping-99: jklmnop"), "{}", c[99]);
    assert_eq!(c[0].len(), "ping data: ".len() + 63, "64-byte buffer, NUL-terminated");
    for (a, b) in c.iter().zip(&s) {
        assert_eq!(a.strip_prefix("ping data: "), b.strip_prefix("server ping data: "));
    }
}

#[test]
fn pings_through_a_relay_that_loses_duplicates_and_reorders() {
    let port = roce_port(1);
    let at = |ip: &str| format!("{ip}:{port}");
    let relay = spawn({
        let mut c = softrdma(["relay", "--a-side", &at("127.0.9.4"), "--b-side", &at("127.0.9.5")]);
        c.args(["--peer-a", &at("127.0.9.6"), "--peer-b", &at("127.0.9.7")]);
        c.args(["--loss", "5", "--dup", "2", "--reorder", "5", "--seed", "4", "--duration", "120"]);
        c
    });
    std::thread::sleep(Duration::from_millis(200));
    let server = spawn(rping(&port, &["-s", "-a", "127.0.9.7", "-C", "100", "-v", "-p", "7202"]));
    std::thread::sleep(Duration::from_millis(300));
    // The client's peer is the relay's side facing it; the CM messages cross the relay too.
    let client = run(rping(
        &port,
        &["-c", "-a", "127.0.9.4", "-I", "127.0.9.6", "-C", "100", "-v", "-V", "-p", "7202"],
    ));
    let server = server.wait();
    // The relay prints its counters on SIGTERM.
    relay.signal(libc::SIGTERM);
    let counters = String::from_utf8(relay.wait().stdout).unwrap();
    assert!(client.status.success(), "client: {}\nrelay: {counters}", text(&client));
    assert!(server.status.success(), "server: {}", text(&server));
    assert_eq!(pings(&client, "ping data: rdma-ping-").len(), 100);
    assert_eq!(pings(&server, "server ping data: rdma-ping-").len(), 100);
    let lost: u64 = counters
        .split_whitespace()
        .find_map(|f| f.strip_prefix("lost="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("relay counters: {counters}"));
    assert!(lost > 0, "the relay lost nothing, so the test proves nothing: {counters}");
}

#[test]
fn a_client_refused_by_the_cm_fails_with_the_reason() {
    let port = roce_port(2);
    // A server listens on another rdma_cm port: the REQ gets REJ "invalid service ID".
    let server = spawn(rping(&port, &["-s", "-a", "127.0.9.8", "-C", "1", "-p", "7203"]));
    std::thread::sleep(Duration::from_millis(300));
    let client = run(rping(&port, &["-c", "-a", "127.0.9.8", "-I", "127.0.9.9", "-C", "1", "-p", "7204"]));
    drop(server);
    assert_eq!(client.status.code(), Some(1), "{}", text(&client));
    assert!(text(&client).contains("RDMA_CM_EVENT_REJECTED (status 8)"), "{}", text(&client));
}

#[test]
fn cmatose_with_twenty_connections_between_two_processes() {
    let port = roce_port(3);
    let cmatose = |args: &[&str]| {
        let mut c = softrdma(["cmatose"]);
        c.env("SOFTRDMA_PORT", &port).args(args);
        c
    };
    let server = spawn(cmatose(&["-b", "127.0.9.10", "-c", "20", "-C", "50", "-S", "1000", "-p", "7205"]));
    std::thread::sleep(Duration::from_millis(300));
    let client = run(cmatose(&[
        "-s",
        "127.0.9.10",
        "-b",
        "127.0.9.11",
        "-c",
        "20",
        "-C",
        "50",
        "-S",
        "1000",
        "-p",
        "7205",
    ]));
    let server = server.wait();
    let (c, s) = (text(&client), text(&server));
    assert!(client.status.success() && server.status.success(), "client:\n{c}\nserver:\n{s}");
    assert!(c.contains("sending replies\ndata transfers complete\ntest complete\nreturn status 0"), "{c}");
    assert!(
        s.contains(
            "receiving data transfers\ndata transfers complete\ncmatose: disconnecting\ndisconnected\n"
        ),
        "{s}"
    );
}

#[test]
fn udaddy_with_five_endpoints_between_two_processes() {
    let port = roce_port(4);
    let udaddy = |args: &[&str]| {
        let mut c = softrdma(["udaddy"]);
        c.env("SOFTRDMA_PORT", &port).args(args);
        c
    };
    let server = spawn(udaddy(&["-b", "127.0.9.12", "-c", "5", "-C", "20", "-p", "7206"]));
    std::thread::sleep(Duration::from_millis(300));
    let client = run(udaddy(&["-s", "127.0.9.12", "-b", "127.0.9.13", "-c", "5", "-C", "20", "-p", "7206"]));
    let server = server.wait();
    let (c, s) = (text(&client), text(&server));
    assert!(client.status.success() && server.status.success(), "client:\n{c}\nserver:\n{s}");
    assert!(
        c.contains("initiating data transfers\nreceiving data transfers\ndata transfers complete\n"),
        "{c}"
    );
    assert!(s.contains("receiving data transfers\nsending replies\ndata transfers complete\n"), "{s}");
}

#[test]
fn connrate_reports_both_sides_and_the_ratio() {
    let port = roce_port(5);
    let connrate = |args: &[&str]| {
        let mut c = softrdma(["connrate"]);
        c.env("SOFTRDMA_PORT", &port).args(args);
        c
    };
    let server = spawn(connrate(&["--listen", "127.0.9.14", "-p", "7208"]));
    std::thread::sleep(Duration::from_millis(300));
    let client =
        run(connrate(&["127.0.9.14", "-b", "127.0.9.15", "-p", "7208", "-n", "30", "--concurrent", "10"]));
    let server = server.wait();
    let (c, s) = (text(&client), text(&server));
    assert!(client.status.success() && server.status.success(), "client:\n{c}\nserver:\n{s}");
    assert!(c.contains("ratio rdma_cm/TCP: sequential "), "{c}");
    assert!(
        s.contains("server: 40 CM connections"),
        "every connection reached ESTABLISHED on the server: {s}"
    );
}
