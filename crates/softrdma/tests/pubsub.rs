//! The publish/subscribe example as processes: a publisher and three subscribers (one for
//! the whole run, one joining late, one leaving early), each checked for what it saw.

use std::process::Command;
use std::time::Duration;

mod examples_support;

#[test]
fn a_publisher_and_three_subscribers_joining_and_leaving_at_different_times() {
    let o = examples_support::run_bounded(
        Command::new(examples_support::example("pubsub")),
        Duration::from_secs(120),
    );
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let reports: Vec<serde_json::Value> =
        out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    let find =
        |name: &str| reports.iter().find(|r| r["name"] == name).unwrap_or_else(|| panic!("{name}: {out}"));
    let publisher = reports.iter().find(|r| r["role"] == "publisher").expect("the publisher's report");
    assert_eq!(publisher["updates"], 300);

    // The whole run: every update, in order, and the publisher's repository.
    let a = find("A (whole run)");
    assert_eq!(
        (a["first"].as_u64(), a["last"].as_u64(), a["received"].as_u64()),
        (Some(1), Some(300), Some(300))
    );
    assert_eq!(a["gaps"], 0);
    assert_eq!(a["checksum"], publisher["checksum"]);

    // Joined a third of the way in: nothing from before, everything after, to the end.
    let b = find("B (joins late)");
    let first = b["first"].as_u64().unwrap();
    assert!(first > 1 && first < 300, "B joined late: {b}");
    assert_eq!((b["last"].as_u64(), b["gaps"].as_u64()), (Some(300), Some(0)));
    assert_eq!(b["received"].as_u64(), Some(300 - first + 1));

    // Left after 100: exactly the first 100, and it said so.
    let c = find("C (leaves early)");
    assert_eq!(
        (c["first"].as_u64(), c["last"].as_u64(), c["received"].as_u64()),
        (Some(1), Some(100), Some(100))
    );
    assert_eq!(c["left_early"], true);
}
