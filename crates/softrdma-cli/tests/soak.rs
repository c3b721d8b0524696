//! A short soak in CI: mixed RC traffic between two processes through an impaired relay
//! (the 10-minute run is `softrdma soak --duration 10m`).

use std::process::Command;

#[test]
fn short_soak_through_the_relay_has_no_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(["soak", "--duration", "8s", "--loss", "5", "--dup", "1", "--reorder", "5", "--corrupt", "0.5"])
        .args(["--max-size", "262144", "--seed", "3"])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
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
