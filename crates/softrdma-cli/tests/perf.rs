//! `softrdma perf` runs every benchmark with `--local` (server and client as two processes
//! on loopback) and prints perftest's table, or JSON.

use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

mod common;
use common::{output, softrdma, text, Proc};

/// How long any one process may run.
const LIMIT: Duration = Duration::from_secs(60);
static NEXT: AtomicU16 = AtomicU16::new(0);

/// Runs one benchmark on its own TCP and UDP ports; returns its stdout.
fn run(args: &[&str]) -> String {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let base = 20_000 + (std::process::id() % 10_000) as u16 + n * 3;
    let out = output(
        softrdma(["perf"])
            .args(args)
            .args(["--local", "-p", &base.to_string()])
            .env("SOFTRDMA_PORT", (base + 1).to_string()),
        LIMIT,
    );
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
    // Timed, with several QPs: the deadline finds some QP's window full, and its closing
    // signaled WR takes it one past the depth (a subtraction that underflowed once).
    let out = run(&["write_bw", "-q", "4", "-D", "1", "-s", "65536", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert!(v["iterations"].as_u64().unwrap() > 0, "{out}");
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
    let out = output(&mut softrdma(["perf", "send_bw", "-R", "-c", "UD", "--local"]), LIMIT);
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
        let out = output(softrdma(["perf"]).args(args).arg("--local"), LIMIT);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// Relays one TCP connection from `listener` to 127.0.0.2:`to` (where a server with `-d
/// 127.0.0.2` listens); returns the bytes sent (client to server, server to client).
fn counting_proxy(listener: std::net::TcpListener, to: u16) -> std::thread::JoinHandle<(Vec<u8>, Vec<u8>)> {
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
                use std::io::{Read, Write};
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    seen.extend_from_slice(&buf[..n]);
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(Shutdown::Write);
                seen
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
        let server = Proc::start(
            softrdma(["perf", test, "-d", "127.0.0.2", "-p", &base.to_string(), "-n", "50", "-s", "64"])
                .env("SOFTRDMA_PORT", &udp),
            LIMIT,
        );
        let out = output(
            softrdma(["perf", test, "127.0.0.1", "-d", "127.0.0.3", "-p", &(base + 2).to_string()])
                .args(["-n", "50", "-s", "64"])
                .env("SOFTRDMA_PORT", &udp),
            LIMIT,
        );
        assert!(out.status.success(), "{test}: {}", String::from_utf8_lossy(&out.stderr));
        let server = server.wait();
        assert!(server.status.success(), "{test}: server: {}", text(&server));
        let (up, down) = proxy.join().unwrap();
        assert_eq!((up.len(), down.len()), (bytes, bytes), "{test}: bytes (client to server, back)");
    }
}

/// The five fields of perftest's BW report in what a client sent: big-endian `u64`s just
/// before the goodbye (a 108-byte key message and "done\0"), after the report's own
/// barrier (another key message).
fn report_fields(up: &[u8]) -> [u64; 5] {
    assert!(up.ends_with(b"done\0"), "{up:?}");
    let goodbye = up.len() - 5 - 108;
    let fields = goodbye - 40;
    let barrier = fields - 108;
    for at in [goodbye, barrier] {
        assert!(up[at..].starts_with(b"0000:0001:"), "a key message at {at}: {up:?}");
    }
    let mut f = [0u64; 5];
    for (k, v) in f.iter_mut().enumerate() {
        *v = u64::from_be_bytes(up[fields + 8 * k..fields + 8 * k + 8].try_into().unwrap());
    }
    f
}

#[test]
fn the_bw_report_carries_perftests_fields() {
    // What a real client sends as its report, read off the wire, decoded as perftest's
    // server decodes it: size and iterations, then peak and average in MiB/s and the
    // message rate in Mpps as doubles. rxe's ib_write_bw sent [64, 100, 0.1254..,
    // 0.1246.., 0.002041..] for 100 x 64 bytes (testdata/rxe/write_bw_64.pcap, frames
    // 226-234): its average and rate agree as MiB/s and Mpps do, which pins the units.
    // (send_bw sends no report: its server measures for itself.)
    let rxe = [0x40, 0x64, 0x3fc0_1117_9dd8_3cfc, 0x3fbf_e55b_80f1_519f, 0x3f60_b8ff_b930_e8d9];
    for (test, size) in [("write_bw", 64u64), ("read_bw", 4096), ("atomic_bw", 8)] {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let base = 40_000 + (std::process::id() % 10_000) as u16 + n * 3;
        let listener = std::net::TcpListener::bind(("127.0.0.1", base + 2)).unwrap();
        let proxy = counting_proxy(listener, base);
        let udp = (base + 1).to_string();
        let s = size.to_string();
        let server = Proc::start(
            softrdma(["perf", test, "-d", "127.0.0.2", "-p", &base.to_string(), "-n", "100", "-s", &s])
                .env("SOFTRDMA_PORT", &udp),
            LIMIT,
        );
        let client = output(
            softrdma(["perf", test, "127.0.0.1", "-d", "127.0.0.3", "-p", &(base + 2).to_string()])
                .args(["-n", "100", "-s", &s])
                .env("SOFTRDMA_PORT", &udp),
            LIMIT,
        );
        let server = server.wait();
        assert!(client.status.success() && server.status.success(), "{}\n{}", text(&client), text(&server));
        let (up, _) = proxy.join().unwrap();
        let mine = report_fields(&up);
        for (name, f) in [("rxe", rxe), (test, mine)] {
            let want = if name == "rxe" { 64 } else { size };
            assert_eq!((f[0], f[1]), (want, 100), "{name}: size and iterations");
            let (peak, avg, rate) = (f64::from_bits(f[2]), f64::from_bits(f[3]), f64::from_bits(f[4]));
            assert!(avg > 0.0 && peak >= avg, "{name}: peak {peak} average {avg}");
            let from_rate = rate * 1e6 * want as f64 / 1_048_576.0;
            assert!((from_rate - avg).abs() / avg < 0.01, "{name}: {from_rate} vs {avg}");
        }
        // Both sides print the client's numbers, as sent.
        let (peak, avg, rate) = (f64::from_bits(mine[2]), f64::from_bits(mine[3]), f64::from_bits(mine[4]));
        let want = format!(
            " {:<10} {:<10}       {:<10.2}         {:<10.2}        {:.6}",
            size, 100, peak, avg, rate
        );
        for (side, o) in [("client", &client), ("server", &server)] {
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.lines().any(|l| l == want), "{test} {side}: want {want:?} in\n{out}");
        }
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
    let out = output(
        softrdma(["perf", "write_bw", "-m", "7", "-n", "50", "--local", "-p", &base.to_string()])
            .env("SOFTRDMA_PORT", (base + 1).to_string()),
        LIMIT,
    );
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
    let child = Proc::start(
        softrdma(["perf", "write_bw", "-n", "50", "--local", "-p", &base.to_string()])
            .env("SOFTRDMA_PORT", (base + 1).to_string()),
        Duration::from_secs(10),
    );
    let out = child
        .end()
        .unwrap_or_else(|e| panic!("perf --local still waiting 10 s after its server failed: {e}"));
    drop(taken);
    let (status, err) = (out.status, String::from_utf8_lossy(&out.stderr));
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("server failed: ") && err.contains("in use"), "{err}");
    assert!(!err.contains("cannot reach"), "{err}");
}

/// `-Q` sets the CQ moderation perftest prints (and the client signals by), `-u` the QPs'
/// ACK timeout; both reach the server `--local` starts.
#[test]
fn cq_moderation_and_qp_timeout_are_perftests() {
    let out = run(&["write_bw", "-n", "500", "-s", "4096", "-Q", "7", "-u", "16"]);
    assert!(out.contains(" CQ Moderation   : 7"), "{out}");
    assert!(out.lines().any(|l| l.trim_start().starts_with("4096 ")), "{out}");
}

/// Two `--local` runs at once, with no -p and no SOFTRDMA_PORT, pick ports of their own;
/// `-d ADDR` puts the server on ADDR and the client on the next address.
#[test]
fn local_runs_pick_free_ports_and_honour_d() {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let srv = format!("127.0.9.{}", 10 + 2 * n);
    let cli = format!("127.0.9.{}", 11 + 2 * n);
    let start = |extra: &[&str]| {
        let mut cmd = softrdma(["perf", "write_bw", "--local", "-n", "300", "-s", "4096"]);
        cmd.args(extra).env_remove("SOFTRDMA_PORT");
        common::Proc::start_piped(&mut cmd, LIMIT)
    };
    let (a, b) = (start(&[]), start(&["-d", &srv]));
    for (name, p) in [("default", a), ("-d", b)] {
        let out = p.end().unwrap_or_else(|e| panic!("{name}: {e}"));
        let text = common::text(&out);
        assert!(out.status.success(), "{name}: {text}");
        if name == "-d" {
            let gid = |ip: &str| {
                let o: Vec<String> =
                    ip.split('.').map(|x| format!("{:02}", x.parse::<u8>().unwrap())).collect();
                format!("255:255:{}", o.join(":"))
            };
            assert!(text.contains(&gid(&cli)) && text.contains(&gid(&srv)), "{text}");
        }
    }
}
