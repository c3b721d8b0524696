//! `softrdma ipoib` between two network namespaces joined by a veth pair that carries
//! only softrdma's UDP: the overlay subnet is reachable through the TUN interfaces alone,
//! and iperf3 runs across it in datagram and connected mode. Needs root (namespaces, TUN)
//! and iperf3: skipped with a message without them, except under CI, where both are there.

mod common;

use std::time::Duration;

use common::netns::{may_run, netns, ok, Lab};
use common::{output, text, Proc, BIN};

const LIMIT: Duration = Duration::from_secs(60);

fn can_run() -> bool {
    // What CI installs or is (root, iproute2, iperf3) must be there under CI; what only
    // the machine decides (a TUN device, the right to make namespaces) is a skip.
    if !may_run("the IPoIB test", &[("iperf3", "--version"), ("ip", "-V")]) {
        return false;
    }
    let tun = std::path::Path::new("/dev/net/tun").exists();
    if !tun {
        eprintln!("skipped: this machine gives no /dev/net/tun");
    }
    tun
}

/// iperf3 from A to B across the overlay; returns (Gbit/s, both ipoib counter lines).
fn iperf_over_ipoib(mode: &str, tag: &str) -> (f64, String) {
    let lab = Lab::new(tag);
    // Before: nothing routes the overlay subnet.
    let before = output(&mut netns(&lab.a, &["ip", "route", "get", "10.99.0.2"]), LIMIT);
    assert!(!before.status.success(), "the overlay must be unreachable without ipoib: {}", text(&before));
    let ipoib = |ns: &str, under: &str, over: &str| {
        let mut p = Proc::start_piped(
            &mut netns(ns, &[BIN, "ipoib", "--bind", under, "--ip", over, "--mode", mode]),
            LIMIT,
        );
        let first = p.line();
        assert!(first.starts_with("ib0: "), "{first}");
        p
    };
    let pa = ipoib(&lab.a, "10.201.0.1", "10.99.0.1/24");
    let pb = ipoib(&lab.b, "10.201.0.2", "10.99.0.2/24");
    let want_mtu = if mode == "connected" { "65520" } else { "1020" };
    assert!(ok(&mut netns(&lab.a, &["ip", "link", "show", "ib0"])).contains(&format!("mtu {want_mtu}")));
    let server = Proc::start_piped(&mut netns(&lab.b, &["iperf3", "-s", "-1", "-B", "10.99.0.2"]), LIMIT);
    std::thread::sleep(Duration::from_millis(300));
    let client = ok(&mut netns(&lab.a, &["iperf3", "-c", "10.99.0.2", "-t", "2", "-J"]));
    let _ = server.stop();
    let json: serde_json::Value = serde_json::from_str(&client).expect("iperf3's JSON");
    let bps = json["end"]["sum_received"]["bits_per_second"].as_f64().expect("a received rate");
    // Stop both interfaces and take their counters.
    let mut lines = String::new();
    for p in [pa, pb] {
        p.signal(libc::SIGINT);
        let o = p.wait();
        assert!(o.status.success(), "{}", text(&o));
        lines.push_str(&text(&o));
    }
    (bps / 1e9, lines)
}

/// (tx, rx) packets from an ipoib counter line.
fn counts(line: &str) -> (u64, u64) {
    let n = |after: &str| -> u64 {
        line.split(after)
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|w| w.parse().ok())
            .unwrap()
    };
    (n("tx "), n("rx "))
}

#[test]
fn iperf3_runs_across_ipoib_in_datagram_and_connected_mode() {
    if !can_run() {
        return;
    }
    for (mode, tag) in [("datagram", "d"), ("connected", "c")] {
        let (gbps, counters) = iperf_over_ipoib(mode, tag);
        assert!(gbps > 0.01, "{mode}: {gbps} Gbit/s\n{counters}");
        let lines: Vec<&str> = counters.lines().filter(|l| l.contains(" tx ")).collect();
        assert_eq!(lines.len(), 2, "{counters}");
        let ((atx, arx), (btx, brx)) = (counts(lines[0]), counts(lines[1]));
        // The test's traffic crossed softrdma: A sent B's data, B received it, and ARP
        // found the neighbour first.
        assert!(atx > 1000 && brx > 1000 && btx > 10 && arx > 10, "{mode}: {counters}");
        assert!(lines[0].contains("arp 1 requests") || lines[1].contains("arp 1 requests"), "{counters}");
        if mode == "connected" {
            assert!(lines.iter().all(|l| l.contains("connections 1")), "one RC connection each: {counters}");
        }
        eprintln!("{mode}: {gbps:.2} Gbit/s; {counters}");
    }
}
