//! Running the crate's examples as processes from tests: built first, bounded in time,
//! killed if a test fails while they run.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The example's binary, brought up to date once per test process (`cargo test` builds
/// examples too, but not when only one test target is asked for, and a stale binary
/// would be what is tested).
pub fn example(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap();
    if !built.iter().any(|b| b == name) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut c = Command::new(cargo);
        c.args(["build", "-q", "-p", "softrdma", "--example", name]);
        if dir.ends_with("release") {
            c.arg("--release");
        }
        let o = run_bounded(c, Duration::from_secs(900));
        assert!(o.status.success(), "building the example: {}", String::from_utf8_lossy(&o.stderr));
        built.push(name.to_string());
    }
    dir.join("examples").join(name)
}

/// Runs a command with a time limit.
pub fn run_bounded(mut c: Command, limit: Duration) -> Output {
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: kill(2) on the child we spawned.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("{c:?} ran past {limit:?}");
        }
    }
}

/// A process that a failing test does not leave behind.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
