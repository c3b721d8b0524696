//! Two network namespaces joined by a veth pair, for tests that need a real kernel path
//! between two endpoints (root only).

use std::process::Command;
use std::time::Duration;

use super::{output, text};

const LIMIT: Duration = Duration::from_secs(60);

/// Runs `cmd`, which must succeed; returns what it printed.
pub fn ok(cmd: &mut Command) -> String {
    let o = output(cmd, LIMIT);
    assert!(o.status.success(), "{cmd:?}: {}", text(&o));
    text(&o)
}

pub fn ip(args: &[&str]) -> String {
    ok(Command::new("ip").args(args))
}

/// `args` run in namespace `ns`.
pub fn netns(ns: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).args(args);
    c
}

/// Whether a namespace test (`what`) may run. Root and `tools` (each with the argument
/// that prints its version) are what CI is or installs: under `CI` their absence fails the
/// test, elsewhere it skips it. A kernel that makes no namespaces is the machine's choice:
/// a skip everywhere. Says why when it says no.
pub fn may_run(what: &str, tools: &[(&str, &str)]) -> bool {
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let found = tools.iter().all(|(t, v)| Command::new(t).arg(v).output().is_ok_and(|o| o.status.success()));
    if !(root && found) {
        let names: Vec<&str> = tools.iter().map(|(t, _)| *t).collect();
        let why = format!("root {root}, {} {found}", names.join(" and "));
        assert!(std::env::var_os("CI").is_none(), "CI must run {what}: {why}");
        eprintln!("skipped: {what} needs {why}");
        return false;
    }
    let probe = format!("srprobe{}", std::process::id());
    let made = Command::new("ip").args(["netns", "add", &probe]).output().is_ok_and(|o| o.status.success());
    let _ = Command::new("ip").args(["netns", "del", &probe]).output();
    if !made {
        eprintln!("skipped: this machine makes no network namespaces");
    }
    made
}

/// Two namespaces and a veth between them (A 10.201.0.1/24, B 10.201.0.2/24), removed
/// when dropped.
pub struct Lab {
    pub a: String,
    pub b: String,
}

impl Lab {
    /// `tag` (a few characters) keeps the names of concurrent labs apart.
    pub fn new(tag: &str) -> Lab {
        let id = std::process::id() % 100_000;
        let (a, b) = (format!("sr{tag}a{id}"), format!("sr{tag}b{id}"));
        let (va, vb) = (format!("v{tag}a{id}"), format!("v{tag}b{id}"));
        let lab = Lab { a: a.clone(), b: b.clone() };
        ip(&["netns", "add", &a]);
        ip(&["netns", "add", &b]);
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        ip(&["link", "set", &va, "netns", &a]);
        ip(&["link", "set", &vb, "netns", &b]);
        for (ns, dev, addr) in [(&a, &va, "10.201.0.1/24"), (&b, &vb, "10.201.0.2/24")] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        lab
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}
