//! `softrdma tutorial`: the four ping-pongs between two processes, the table, and the
//! tutorial's claim that the passive side of RDMA WRITE/READ uses no CPU.

mod common;

use std::time::Duration;

use common::{output, softrdma, text};

/// One row of the table: variant, RTT, then client user/kernel/process %, server
/// user/kernel/process %.
fn rows(out: &str) -> Vec<(String, Vec<f64>)> {
    out.lines()
        .filter(|l| l.contains(" | ") && !l.starts_with("ping-pong"))
        .map(|l| {
            let (name, _) = l.split_at(48);
            let nums = l[48..].split_whitespace().filter(|w| *w != "|").map(|w| w.parse().unwrap()).collect();
            (name.trim().to_string(), nums)
        })
        .collect()
}

#[test]
fn the_tutorial_ranks_four_ping_pongs_and_the_passive_server_uses_no_cpu() {
    let o = output(&mut softrdma(["tutorial", "-n", "3000", "-s", "64"]), Duration::from_secs(120));
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let rows = rows(&out);
    let mut names: Vec<&str> = rows.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "signaled RDMA_WRITE/READ with wait for notify",
            "signaled SEND/RECV with busy polling",
            "signaled SEND/RECV with wait for notify",
            "unsignaled RDMA_WRITE/READ with wait for notify",
        ],
        "{out}"
    );
    let rtts: Vec<f64> = rows.iter().map(|(_, v)| v[0]).collect();
    assert!(rtts.windows(2).all(|w| w[0] <= w[1]), "ranked by RTT: {out}");
    for (name, v) in &rows {
        assert_eq!(v.len(), 7, "{name}: {out}");
        assert!(v[0] > 0.0, "{name}: an RTT");
        let server_thread = v[4] + v[5];
        if name.contains("RDMA_WRITE/READ") {
            // The tutorial's point: the passive side's program does nothing at all; the
            // work is the "NIC's" (here the progress thread, in the process column).
            assert!(
                server_thread < 1.0,
                "{name}: the passive agent's thread used {server_thread}% CPU\n{out}"
            );
            assert!(v[6] > server_thread, "{name}: the process did the NIC's work\n{out}");
        } else {
            assert!(server_thread > 1.0, "{name}: an active agent's thread works ({server_thread}%)\n{out}");
        }
    }
}

#[test]
fn one_ping_pong_runs_against_a_separate_server() {
    let mut server = common::Proc::start_piped(
        &mut softrdma(["tutorial", "--serve", "127.0.38.1:7472"]),
        Duration::from_secs(60),
    );
    assert!(server.line().starts_with("listening"));
    let o = output(
        &mut softrdma([
            "tutorial",
            "--connect",
            "127.0.38.1:7472",
            "--bind",
            "127.0.38.2",
            "--variant",
            "write-read-unsignaled",
            "-n",
            "500",
            "-s",
            "4096",
        ]),
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", text(&o));
    let rows = rows(&text(&o));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].0, "unsignaled RDMA_WRITE/READ with wait for notify");
    let (alive, _) = server.stop();
    assert!(alive, "the server serves on after a client");
    // A variant that does not exist is refused by name.
    let o = output(
        &mut softrdma(["tutorial", "--connect", "127.0.38.1:7472", "--variant", "carrier-pigeon"]),
        Duration::from_secs(10),
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("carrier-pigeon"), "{}", text(&o));
}
