//! A short soak in CI: mixed RC traffic between two processes through an impaired relay
//! (the 10-minute run is `softrdma soak --duration 10m`); and each of soak's checks shown to
//! fire, with soak's test-only fault switch (`SOFTRDMA_SOAK_FAULT`) making soak itself
//! misbehave once as a transport bug would.

use std::process::Output;
use std::time::{Duration, Instant};

mod common;
use common::{group_members, softrdma, text, Proc};

/// How long one soak may run, its own `--duration` included.
const LIMIT: Duration = Duration::from_secs(120);

/// `ops=N data-errors=E status-errors=S ...`: (N, E, S).
fn summary(o: &Output) -> (u64, u64, u64) {
    let all = text(o);
    let last = all.lines().rev().find(|l| l.starts_with("ops=")).unwrap_or_else(|| panic!("{all}"));
    let field = |name: &str| -> u64 {
        last.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {last}"))
    };
    (field("ops"), field("data-errors"), field("status-errors"))
}

#[test]
fn short_soak_through_the_relay_has_no_errors() {
    let out = Proc::start(
        softrdma(["soak", "--duration", "8s", "--loss", "5", "--dup", "1", "--reorder", "5"]).args([
            "--corrupt",
            "0.5",
            "--max-size",
            "262144",
            "--seed",
            "3",
        ]),
        LIMIT,
    )
    .wait();
    let text = text(&out);
    assert!(out.status.success(), "{text}");
    let last = text.lines().rev().find(|l| l.starts_with("ops=")).unwrap_or_else(|| panic!("{text}"));
    assert!(last.contains("data-errors=0 status-errors=0"), "{last}");
    let ops: u64 = last.split_whitespace().next().unwrap().trim_start_matches("ops=").parse().unwrap();
    assert!(ops > 50, "{last}");
    let relay = text.lines().find(|l| l.starts_with("relay:")).unwrap();
    assert!(
        !relay.contains(" lost=0 ") && !relay.contains(" corrupted=0 "),
        "the relay did its damage: {relay}"
    );
}

/// One second of soak, small messages, no impairment; with `fault` if given.
fn soak(fault: Option<&str>) -> Output {
    let mut cmd = softrdma(["soak", "--duration", "1s", "--loss", "0", "--dup", "0", "--reorder", "0"]);
    cmd.args(["--corrupt", "0", "--max-size", "4096", "--seed", "5"]);
    cmd.env_remove("SOFTRDMA_SOAK_FAULT");
    if let Some(f) = fault {
        cmd.env("SOFTRDMA_SOAK_FAULT", f);
    }
    Proc::start(&mut cmd, LIMIT).wait()
}

#[test]
fn the_fault_free_run_the_faults_are_measured_against_has_no_errors() {
    let out = soak(None);
    let (ops, data, status) = summary(&out);
    assert_eq!((data, status), (0, 0), "{}", text(&out));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(ops > 100, "{}", text(&out));
    assert!(!text(&out).contains("test fault"), "{}", text(&out));
}

/// Runs soak with `fault`: it must be injected, reported as `data`/`status` errors (at
/// least one where true), by the checks whose messages `said` lists, and exit 1.
fn assert_reported(fault: &str, data: bool, status: bool, said: &[&str]) {
    let out = soak(Some(fault));
    let all = text(&out);
    assert!(all.contains("soak: test fault "), "{fault} was never injected: {all}");
    let (_, d, s) = summary(&out);
    assert!(d > 0 || !data, "{fault}: no data error: {all}");
    assert!(s > 0 || !status, "{fault}: no status error: {all}");
    for msg in said {
        assert!(all.contains(msg), "{fault}: {msg:?} not reported: {all}");
    }
    assert_eq!(out.status.code(), Some(1), "{fault}: {all}");
}

#[test]
fn a_corrupted_send_is_a_data_error() {
    assert_reported("corrupt-send", true, false, &["(Send, ", ") arrived wrong"]);
}

#[test]
fn a_corrupted_write_with_imm_is_a_data_error() {
    assert_reported("corrupt-write", true, false, &["(Write, ", ") arrived wrong"]);
}

#[test]
fn a_lost_receive_completion_is_a_status_error() {
    // Seen both in the order of arrivals and in the count at the end.
    assert_reported("lose-recv", false, true, &["was next", "messages completed, the passive side received"]);
}

#[test]
fn a_doubled_receive_completion_is_a_status_error() {
    assert_reported("dup-recv", false, true, &["was next", "messages completed, the passive side received"]);
}

#[test]
fn corrupted_read_data_is_a_data_error() {
    assert_reported("corrupt-read", true, false, &["(Read, ", ") returned wrong data"]);
}

#[test]
fn a_wrong_fetched_value_is_a_data_error() {
    assert_reported("wrong-fetch", true, false, &["bytes) returned wrong data"]);
}

#[test]
fn a_fetch_add_applied_twice_is_a_data_error_and_the_counter_shows_it() {
    assert_reported("fetch-add-twice", true, false, &["the counter holds "]);
}

#[test]
fn a_lost_completion_is_a_status_error() {
    assert_reported("lose-completion", false, true, &["has no completion, a later one has"]);
}

#[test]
fn a_doubled_completion_is_a_status_error() {
    assert_reported("dup-completion", false, true, &["of no operation in flight"]);
}

#[test]
fn an_unknown_fault_is_refused() {
    let out = soak(Some("no-such-fault"));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("SOFTRDMA_SOAK_FAULT=no-such-fault"), "{}", text(&out));
}

#[test]
fn a_soak_past_its_deadline_is_killed_with_its_passive_side() {
    // The test helper's own guarantee, on a process that starts another: soak's passive
    // side runs in soak's process group, and goes with it.
    let p = Proc::start(
        &mut softrdma(["soak", "--duration", "1h", "--max-size", "4096"]),
        Duration::from_secs(3),
    );
    let group = p.id();
    let seen = Instant::now();
    while group_members(group).len() < 2 {
        assert!(seen.elapsed() < Duration::from_secs(3), "soak started no passive side");
        std::thread::sleep(Duration::from_millis(10));
    }
    let err = p.end().expect_err("a one-hour soak ended within 3 s");
    assert!(err.contains("still running at its deadline"), "{err}");
    // SIGKILL is delivered, not yet acted on, when kill(2) returns: the group is gone soon
    // after, and stays gone.
    let killed = Instant::now();
    while !group_members(group).is_empty() {
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "soak's group outlived it: {:?}",
            group_members(group)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_child_past_its_deadline_is_killed_with_all_it_started() {
    // What the helper kills is the group, not just the child: a background `sleep` outlives
    // its shell otherwise (soak's passive side, above, would end by itself when its stdin
    // closes, so it cannot show this).
    let p = Proc::start(
        std::process::Command::new("sh").args(["-c", "sleep 3600 & sleep 3600"]),
        Duration::from_secs(1),
    );
    let group = p.id();
    let seen = Instant::now();
    while group_members(group).len() < 3 {
        assert!(seen.elapsed() < Duration::from_secs(3), "{:?}", group_members(group));
        std::thread::sleep(Duration::from_millis(10));
    }
    let err = p.end().expect_err("sleep 3600 ended within 1 s");
    assert!(err.contains("still running at its deadline"), "{err}");
    let killed = Instant::now();
    while !group_members(group).is_empty() {
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "the group outlived its leader: {:?}",
            group_members(group)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
