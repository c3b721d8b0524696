//! `softrdma res` shows the QPs of running softrdma processes: a `perf --local` run's two
//! processes each have an RC QP in RTS, connected to the other's.

mod common;

use std::time::{Duration, Instant};

use common::{output, softrdma, Proc};

/// The parent of `pid`, from /proc.
fn ppid(pid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.split_whitespace().nth(1)?.parse().ok()
}

#[test]
fn res_shows_the_qps_of_two_running_perf_processes() {
    let mut cmd = softrdma(["perf", "write_bw", "--local", "-D", "4", "-s", "4096"]);
    cmd.env_remove("SOFTRDMA_PORT");
    let run = Proc::start_piped(&mut cmd, Duration::from_secs(60));
    let client = u64::from(run.id());
    let t = Instant::now();
    let (a, b) = loop {
        assert!(t.elapsed() < Duration::from_secs(15), "the run's processes never showed two connected QPs");
        let out = output(&mut softrdma(["res", "-j"]), Duration::from_secs(20));
        assert!(out.status.success(), "{}", common::text(&out));
        let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ours: Vec<&serde_json::Value> = all
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| {
                let pid = p["pid"].as_u64().unwrap();
                pid == client || ppid(pid) == Some(client)
            })
            .collect();
        let rts = |p: &serde_json::Value| -> Option<(u64, u64)> {
            let q = &p["devices"][0]["qps"][0];
            (q["type"] == "RC" && q["state"] == "RTS")
                .then(|| (q["qpn"].as_u64().unwrap(), q["dest_qpn"].as_u64().unwrap()))
        };
        if let [x, y] = ours[..] {
            if let (Some(a), Some(b)) = (rts(x), rts(y)) {
                break (a, b);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!((a.0, a.1), (b.1, b.0), "each QP is connected to the other's");
    // And the CQ its completions go to is listed with its size.
    let all: serde_json::Value = serde_json::from_slice(
        &output(&mut softrdma(["res", "-j", "--pid", &client.to_string()]), Duration::from_secs(20)).stdout,
    )
    .unwrap();
    let dev = &all[0]["devices"][0];
    let cq = dev["qps"][0]["send_cq"].as_u64().expect("the QP's send CQ");
    assert!(
        dev["cqs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["id"].as_u64() == Some(cq) && c["size"].as_u64() > Some(0)),
        "{dev}"
    );
    // The device's system calls: a stream under way has sent, a packet or more per call.
    let (calls, sent) = (dev["send_calls"].as_u64().unwrap(), dev["packets_sent"].as_u64().unwrap());
    assert!(calls > 0 && sent >= calls && dev["recv_calls"].as_u64() > Some(0), "{dev}");
    // The table names them too.
    let table = common::text(&output(&mut softrdma(["res"]), Duration::from_secs(20)));
    assert!(table.contains(&format!("qp {:#08x} RC RTS", a.0)), "{table}");
    let out = run.end().unwrap();
    assert!(out.status.success(), "{}", common::text(&out));
}

/// The `acks_bundled` of the client's QP in a running `perf send_lat --local` (the process
/// `client` or its child), once it has sent `min_sent` packets.
fn acks_bundled_of(client: u64, min_sent: u64) -> u64 {
    let t = Instant::now();
    loop {
        assert!(t.elapsed() < Duration::from_secs(30), "the ping-pong never got going");
        let out = output(&mut softrdma(["res", "-j"]), Duration::from_secs(20));
        let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let qp = all.as_array().into_iter().flatten().find_map(|p| {
            let pid = p["pid"].as_u64()?;
            let q = &p["devices"][0]["qps"][0];
            (pid == client && q["state"] == "RTS" && q["packets_sent"].as_u64()? >= min_sent).then_some(q)
        });
        if let Some(q) = qp {
            return q["acks_bundled"].as_u64().expect("acks_bundled");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_ping_pong_bundles_its_acks_unless_told_not_to() {
    // The ACK of each ping rides in the pong's datagram between softrdma processes
    // (`res` counts them per QP); `SOFTRDMA_BUNDLE=0` sends them alone, and the ping-pong
    // runs the same.
    for (env, bundles) in [(None, true), (Some("0"), false)] {
        let mut cmd = softrdma(["perf", "send_lat", "--local", "-n", "100000"]);
        cmd.env_remove("SOFTRDMA_PORT");
        if let Some(v) = env {
            cmd.env("SOFTRDMA_BUNDLE", v);
        }
        let run = Proc::start_piped(&mut cmd, Duration::from_secs(90));
        let n = acks_bundled_of(u64::from(run.id()), 2_000);
        assert_eq!(n > 0, bundles, "SOFTRDMA_BUNDLE={env:?}: {n} ACKs bundled");
        let out = run.end().unwrap();
        assert!(out.status.success(), "{}", common::text(&out));
    }
}
