//! `softrdma perf` runs every benchmark with `--local` (server and client as two processes
//! on loopback) and prints perftest's table, or JSON.

use std::process::Command;
use std::sync::atomic::{AtomicU16, Ordering};

const BIN: &str = env!("CARGO_BIN_EXE_softrdma");
static NEXT: AtomicU16 = AtomicU16::new(0);

/// Runs one benchmark on its own TCP and UDP ports; returns its stdout.
fn run(args: &[&str]) -> String {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let base = 20_000 + (std::process::id() % 10_000) as u16 + n * 3;
    let out = Command::new(BIN)
        .arg("perf")
        .args(args)
        .args(["--local", "-p", &base.to_string()])
        .env("SOFTRDMA_PORT", (base + 1).to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "perf {args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    text
}

#[test]
fn bandwidth_tests_print_perftests_table() {
    for test in ["write_bw", "send_bw", "read_bw", "atomic_bw"] {
        let out = run(&[test, "-n", "300", "-s", "10000"]);
        assert!(out.contains("BW Test"), "{out}");
        assert!(
            out.contains(
                " #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]"
            ),
            "{out}"
        );
        let size = if test == "atomic_bw" { "8" } else { "10000" };
        let row = out.lines().find(|l| l.trim_start().starts_with(size)).unwrap_or_else(|| panic!("{out}"));
        let cols: Vec<f64> = row.split_whitespace().map(|c| c.parse().unwrap()).collect();
        assert_eq!(cols[1], 300.0, "{row}");
        assert!(cols[3] > 0.0 && cols[4] > 0.0, "{row}");
    }
}

#[test]
fn latency_tests_print_perftests_table() {
    for test in ["send_lat", "write_lat", "read_lat", "atomic_lat"] {
        let out = run(&[test, "-n", "200"]);
        assert!(out.contains("Latency Test"), "{out}");
        assert!(out.contains("t_typical[usec]") && out.contains("99.9% percentile[usec]"), "{out}");
        assert!(out.contains(" local address: LID 0000 QPN "), "{out}");
        let row = out
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some("200"))
            .unwrap_or_else(|| panic!("{out}"));
        let cols: Vec<f64> = row.split_whitespace().map(|c| c.parse().unwrap()).collect();
        assert!(cols[2] > 0.0 && cols[2] <= cols[4] && cols[4] <= cols[3], "min <= typical <= max: {row}");
    }
}

#[test]
fn json_sweeps_ud_and_events() {
    let out = run(&["write_bw", "-a", "-n", "50", "--json"]);
    let rows: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 23, "sizes 2 to 2^23");
    assert!(rows.iter().all(|r| r["bw_average"].as_f64().unwrap() > 0.0));
    let out = run(&["send_bw", "-c", "UD", "-s", "1024", "-n", "200"]);
    assert!(out.contains("Connection type : UD"), "{out}");
    let out = run(&["send_lat", "-e", "-n", "200", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(v["iterations"], 200);
    let out = run(&["write_bw", "-D", "1", "-s", "4096", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert!(v["iterations"].as_u64().unwrap() > 100);
}

#[test]
fn several_queue_pairs_share_the_bandwidth_tests() {
    for test in ["write_bw", "send_bw", "read_bw", "atomic_bw"] {
        let out = run(&[test, "-q", "4", "-n", "300", "-s", "4096", "--json"]);
        let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        assert_eq!(v["iterations"], 300, "{test}: each QP runs -n: {out}");
        assert!(v["bw_average"].as_f64().unwrap() > 0.0, "{out}");
        assert!(v["bw_peak"].as_f64().unwrap() >= v["bw_average"].as_f64().unwrap(), "{out}");
    }
    let out = run(&["send_bw", "-q", "3", "-n", "200"]);
    assert!(out.contains(" Number of qps   : 3"), "{out}");
    assert_eq!(out.matches(" local address: LID 0000 QPN ").count(), 3, "{out}");
    assert_eq!(out.matches(" remote address: LID 0000 QPN ").count(), 3, "{out}");
}

#[test]
fn rdma_cm_mode_connects_through_the_connection_manager() {
    // -R: the exchange over an rdma_cm connection, the QPs connected by the CM (READ and
    // atomics with responder resources), several QPs on one listener.
    for test in ["write_bw", "send_bw", "read_bw", "atomic_bw"] {
        let out = run(&[test, "-R", "-q", "2", "-n", "300", "-s", "4096"]);
        assert!(out.contains(" rdma_cm QPs\t : ON") && out.contains(" Data ex. method : rdma_cm"), "{out}");
        assert_eq!(out.matches(" remote address: LID 0000 QPN ").count(), 2, "{out}");
        let size = if test == "atomic_bw" { "8" } else { "4096" };
        let row = out.lines().find(|l| l.trim_start().starts_with(size)).unwrap_or_else(|| panic!("{out}"));
        let cols: Vec<f64> = row.split_whitespace().map(|c| c.parse().unwrap()).collect();
        assert_eq!(cols[1], 300.0, "{row}");
        assert!(cols[3] > 0.0, "{row}");
    }
    for test in ["send_lat", "write_lat", "read_lat"] {
        let out = run(&[test, "-R", "-n", "200", "--json"]);
        let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        assert_eq!(v["iterations"], 200, "{test}: {out}");
    }
    let out = Command::new(BIN).args(["perf", "send_bw", "-R", "-c", "UD", "--local"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("-R connects RC QPs only"));
}

#[test]
fn ud_send_bw_ends_when_messages_outrun_the_receive_queue() {
    // 3,000 messages against 64 posted receives: UD drops what finds none, and the server
    // must still end when the client's results arrive.
    let out = run(&["send_bw", "-c", "UD", "-s", "512", "-n", "3000", "-r", "64", "-q", "2"]);
    let row = out.lines().find(|l| l.trim_start().starts_with("512 ")).unwrap_or_else(|| panic!("{out}"));
    assert_eq!(row.split_whitespace().nth(1), Some("3000"), "{row}");
}

#[test]
fn bad_queue_pair_counts_are_refused() {
    for (args, want) in [
        (&["write_bw", "-q", "0"][..], "-q takes 1 to 64"),
        (&["write_bw", "-q", "65"][..], "-q takes 1 to 64"),
        (&["send_lat", "-q", "2"][..], "multiple queue pairs are for the bandwidth tests"),
    ] {
        let out = Command::new(BIN).arg("perf").args(args).arg("--local").output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// Relays one TCP connection from `listener` to 127.0.0.2:`to` (where a server with `-d
/// 127.0.0.2` listens); returns the bytes sent (client to server, server to client).
fn counting_proxy(listener: std::net::TcpListener, to: u16) -> std::thread::JoinHandle<(u64, u64)> {
    use std::net::{Shutdown, TcpStream};
    std::thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let server = loop {
            match TcpStream::connect(("127.0.0.2", to)) {
                Ok(s) => break s,
                Err(e) if std::time::Instant::now() > deadline => panic!("server: {e}"),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        };
        let pipe = |mut from: TcpStream, mut to: TcpStream| {
            std::thread::spawn(move || {
                let n = std::io::copy(&mut from, &mut to).unwrap_or(0);
                let _ = to.shutdown(Shutdown::Write);
                n
            })
        };
        let up = pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
        let down = pipe(server, client);
        (up.join().unwrap(), down.join().unwrap())
    })
}

#[test]
fn the_tcp_exchange_has_perftests_shape() {
    // Bytes each way in rxe's perftest runs (testdata/rxe/{write_bw,read_bw,send_bw,
    // send_lat,read_lat,write_lat}_64.pcap, atomic_{lat,bw_fadd}.pcap): both directions
    // carry the same amount, which depends only on the test.
    let cases = [
        ("write_bw", 611),
        ("read_bw", 611),
        ("atomic_bw", 611),
        ("send_bw", 571),
        ("send_lat", 571),
        ("read_lat", 571),
        ("atomic_lat", 571),
        ("write_lat", 458),
    ];
    for (test, bytes) in cases {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let base = 40_000 + (std::process::id() % 10_000) as u16 + n * 3;
        let listener = std::net::TcpListener::bind(("127.0.0.1", base + 2)).unwrap();
        let proxy = counting_proxy(listener, base);
        let udp = (base + 1).to_string();
        let mut server = Command::new(BIN)
            .args(["perf", test, "-d", "127.0.0.2", "-p", &base.to_string(), "-n", "50", "-s", "64"])
            .env("SOFTRDMA_PORT", &udp)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let out = Command::new(BIN)
            .args(["perf", test, "127.0.0.1", "-d", "127.0.0.3", "-p", &(base + 2).to_string()])
            .args(["-n", "50", "-s", "64"])
            .env("SOFTRDMA_PORT", &udp)
            .output()
            .unwrap();
        assert!(out.status.success(), "{test}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(server.wait().unwrap().success(), "{test}: server");
        assert_eq!(proxy.join().unwrap(), (bytes, bytes), "{test}: bytes (client to server, back)");
    }
}

#[test]
fn bandwidth_tests_run_with_fewer_than_100_in_flight() {
    // The client signals every 100th WR, lowered to -t when fewer are in flight: with a
    // depth under 100 it must still see completions.
    for (test, depth) in [("write_bw", "1"), ("send_bw", "10"), ("read_bw", "99")] {
        let out = run(&[test, "-t", depth, "-n", "300", "-s", "1024"]);
        assert!(out.contains(&format!(" CQ Moderation   : {depth}\n")), "{test}: {out}");
        let row =
            out.lines().find(|l| l.trim_start().starts_with("1024 ")).unwrap_or_else(|| panic!("{out}"));
        assert_eq!(row.split_whitespace().nth(1), Some("300"), "{test}: {row}");
    }
}

#[test]
fn an_mtu_perftest_does_not_know_runs_at_the_active_mtu_and_says_so() {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let base = 20_000 + (std::process::id() % 10_000) as u16 + n * 3;
    let out = Command::new(BIN)
        .args(["perf", "write_bw", "-m", "7", "-n", "50", "--local", "-p", &base.to_string()])
        .env("SOFTRDMA_PORT", (base + 1).to_string())
        .output()
        .unwrap();
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}{err}");
    assert!(err.contains("invalid MTU 7") && err.contains("running at the port's active MTU"), "{err}");
    let mtu =
        text.lines().find_map(|l| l.strip_prefix(" Mtu             : ")).unwrap_or_else(|| panic!("{text}"));
    assert!(["256[B]", "512[B]", "1024[B]", "2048[B]", "4096[B]"].contains(&mtu), "{mtu}");
    assert!(err.contains(&format!("active MTU, {}", mtu.trim_end_matches("[B]"))), "{err}\n{mtu}");
    // A valid MTU is the one printed.
    let out = run(&["write_bw", "-m", "512", "-n", "50"]);
    assert!(out.contains(" Mtu             : 512[B]"), "{out}");
}

#[test]
fn local_fails_at_once_with_the_servers_own_error() {
    // The server's device port is taken: the server fails at once, and so must the client
    // (which would otherwise wait for the server's TCP port), with the server's error.
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let base = 20_000 + (std::process::id() % 10_000) as u16 + n * 3;
    let taken = std::net::UdpSocket::bind(("127.0.0.2", base + 1)).unwrap();
    let mut child = Command::new(BIN)
        .args(["perf", "write_bw", "-n", "50", "--local", "-p", &base.to_string()])
        .env("SOFTRDMA_PORT", (base + 1).to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > std::time::Duration::from_secs(10) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("perf --local still waiting 10 s after its server failed");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    drop(taken);
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("server failed: ") && err.contains("in use"), "{err}");
    assert!(!err.contains("cannot reach"), "{err}");
}
