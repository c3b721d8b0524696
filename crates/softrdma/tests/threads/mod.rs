//! What the tests of a device's progress thread share: finding that thread among the
//! process's, and counting the times it slept.

#![allow(dead_code)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use softrdma::Context;

/// This process's threads.
pub fn tasks() -> HashSet<u32> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// The voluntary context switches of one of this process's threads: each time it slept.
pub fn sleeps(tid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The CPU time one of this process's threads has used, in clock ticks (user and system).
pub fn cpu_ticks(tid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
    // After the command name's closing parenthesis: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Opens a device with `open` (which must make one shard), and finds its progress
/// thread: the thread its opening started (which names itself once it runs).
pub fn open_with_thread(open: impl FnOnce() -> Context) -> (Context, u32) {
    let before = tasks();
    let ctx = open();
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let named: Vec<u32> = tasks()
            .difference(&before)
            .copied()
            .filter(|t| {
                let comm = std::fs::read_to_string(format!("/proc/self/task/{t}/comm")).unwrap_or_default();
                comm.starts_with("softrdma-") && !comm.starts_with("softrdma-res")
            })
            .collect();
        if let [t] = named[..] {
            return (ctx, t);
        }
        assert!(Instant::now() < until, "the device's progress thread: {named:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
