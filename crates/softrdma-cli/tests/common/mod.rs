//! Child processes for the CLI's tests, every one bounded.
//!
//! A [`Proc`] is started in a process group of its own (so that what it starts itself —
//! `perf --local`'s server, `soak`'s passive side — is killed with it), its stdout and
//! stderr collected by threads, and everything that waits on it (its end, a line of its
//! stdout, a word on its stderr) gives up at its deadline: the group is killed and the test
//! fails with what the process said. Dropped, it kills the group, so no process outlives a
//! failing test.
//!
//! The process is reaped here with `wait4` (which gives its peak memory), never by
//! `Child`: the group is signalled only while its leader is known not to be reaped, so that
//! a signal never reaches a reused pid.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

pub mod netns;

use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStdin, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The `softrdma` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_softrdma");

/// One output stream of a child, as read so far.
#[derive(Default)]
struct Stream {
    /// The bytes, and whether the stream has ended.
    state: Mutex<(Vec<u8>, bool)>,
    grew: Condvar,
}

impl Stream {
    fn collect(from: impl Read + Send + 'static) -> Arc<Stream> {
        let s = Arc::new(Stream::default());
        let s2 = s.clone();
        std::thread::spawn(move || {
            let mut from = from;
            let mut buf = [0u8; 8192];
            loop {
                let n = from.read(&mut buf).unwrap_or(0);
                let mut st = s2.state.lock().unwrap();
                if n == 0 {
                    st.1 = true;
                } else {
                    st.0.extend_from_slice(&buf[..n]);
                }
                drop(st);
                s2.grew.notify_all();
                if n == 0 {
                    return;
                }
            }
        });
        s
    }

    /// Waits until `done` holds for (bytes, ended) or `deadline` passes; whether it held.
    fn wait_until(&self, deadline: Instant, mut done: impl FnMut(&[u8], bool) -> bool) -> bool {
        let mut st = self.state.lock().unwrap();
        loop {
            if done(&st.0, st.1) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self.grew.wait_timeout(st, deadline - now).unwrap().0;
        }
    }

    fn bytes(&self) -> Vec<u8> {
        self.state.lock().unwrap().0.clone()
    }
}

/// A child process with a deadline. See the module's documentation.
pub struct Proc {
    what: String,
    pid: libc::pid_t,
    /// Kept for its pipes; never waited on through `Child`.
    _child: Child,
    stdin: Option<ChildStdin>,
    out: Arc<Stream>,
    err: Arc<Stream>,
    /// Bytes of stdout already returned by [`Proc::line`].
    consumed: usize,
    deadline: Instant,
    /// Exit status and peak RSS in KiB, once reaped.
    ended: Option<(ExitStatus, i64)>,
}

impl Proc {
    /// Starts `cmd` with stdin closed; it must end within `limit`.
    pub fn start(cmd: &mut Command, limit: Duration) -> Proc {
        Self::spawn(cmd, limit, false)
    }

    /// Starts `cmd` with a pipe on its stdin (see [`Proc::stdin`], [`Proc::close_stdin`]);
    /// the pipe stays open until closed or the process ends.
    pub fn start_piped(cmd: &mut Command, limit: Duration) -> Proc {
        Self::spawn(cmd, limit, true)
    }

    fn spawn(cmd: &mut Command, limit: Duration, stdin: bool) -> Proc {
        let what = format!("{cmd:?}");
        let mut child = cmd
            .process_group(0)
            .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let out = Stream::collect(child.stdout.take().unwrap());
        let err = Stream::collect(child.stderr.take().unwrap());
        Proc {
            what,
            pid: child.id() as libc::pid_t,
            stdin: child.stdin.take(),
            _child: child,
            out,
            err,
            consumed: 0,
            deadline: Instant::now() + limit,
            ended: None,
        }
    }

    /// Its process id, which is also its process group's.
    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    /// The pipe to its stdin (started with [`Proc::start_piped`]).
    pub fn stdin(&mut self) -> &mut ChildStdin {
        self.stdin.as_mut().expect("stdin not piped, or closed")
    }

    /// Takes the pipe to its stdin, e.g. for a writer thread.
    pub fn take_stdin(&mut self) -> ChildStdin {
        self.stdin.take().expect("stdin not piped, or closed")
    }

    /// Closes its stdin: the end of input.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Whether it has exited (without reaping it).
    fn exited(&self) -> bool {
        if self.ended.is_some() {
            return true;
        }
        // SAFETY: an all-zero siginfo is valid; waitid fills it for our own child, which
        // WNOWAIT leaves unreaped.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waits for our own, unreaped child, with a valid pointer.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                self.pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        assert_eq!(r, 0, "waitid: {}", std::io::Error::last_os_error());
        // SAFETY: waitid filled the siginfo (si_pid stays 0 if the child still runs).
        unsafe { info.si_pid() != 0 }
    }

    /// Kills its process group and reaps it (a no-op once reaped).
    fn kill_and_reap(&mut self) {
        if self.ended.is_some() {
            return;
        }
        // SAFETY: the leader is unreaped (at most a zombie), so the group id is still
        // ours: only its group is signalled.
        unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        let mut status = 0;
        // SAFETY: an all-zero rusage is valid; wait4 fills it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: reaps our own child, with valid pointers.
        let r = unsafe { libc::wait4(self.pid, &mut status, 0, &mut usage) };
        assert_eq!(r, self.pid, "wait4: {}", std::io::Error::last_os_error());
        self.ended = Some((ExitStatus::from_raw(status), usage.ru_maxrss));
    }

    /// Sends `sig` to it alone (not its group), if it has not been reaped.
    pub fn signal(&self, sig: libc::c_int) {
        if self.ended.is_none() {
            // SAFETY: our own unreaped child.
            unsafe { libc::kill(self.pid, sig) };
        }
    }

    /// What it said so far, for a failure message.
    pub fn said(&self) -> String {
        format!(
            "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.what,
            String::from_utf8_lossy(&self.out.bytes()),
            String::from_utf8_lossy(&self.err.bytes())
        )
    }

    /// Fails the test: kills the group, and panics with `why` and what it said.
    fn fail(&mut self, why: &str) -> ! {
        self.kill_and_reap();
        self.drain();
        panic!("{why}: {}", self.said());
    }

    /// Waits (briefly) for both streams to end: once the group is dead they close.
    fn drain(&self) {
        let limit = Instant::now() + Duration::from_secs(5);
        self.out.wait_until(limit, |_, end| end);
        self.err.wait_until(limit, |_, end| end);
    }

    /// The next line of its stdout, without the newline. Fails the test if the process
    /// ends first or the deadline passes.
    pub fn line(&mut self) -> String {
        let from = self.consumed;
        let mut line = None;
        let mut closed = false;
        self.out.wait_until(self.deadline, |b, end| {
            if let Some(k) = b[from..].iter().position(|&c| c == b'\n') {
                line = Some(String::from_utf8_lossy(&b[from..from + k]).into_owned());
                return true;
            }
            closed = end;
            end
        });
        match line {
            Some(l) => {
                self.consumed += l.len() + 1;
                l
            }
            None if closed => self.fail("stdout closed before a line"),
            None => self.fail("no line on stdout before the deadline"),
        }
    }

    /// Waits until its stderr contains `needle`. Fails the test if the process ends first
    /// or the deadline passes.
    pub fn wait_for_stderr(&mut self, needle: &str) {
        let mut closed = false;
        let seen = self.err.wait_until(self.deadline, |b, end| {
            closed = end;
            String::from_utf8_lossy(b).contains(needle) || end
        });
        if !seen || (closed && !String::from_utf8_lossy(&self.err.bytes()).contains(needle)) {
            self.fail(&format!("{needle:?} not on stderr"));
        }
    }

    /// Waits for its end: its status, stdout and stderr; `Err` with what it said if the
    /// deadline passed (the group killed).
    pub fn end(mut self) -> Result<Output, String> {
        self.end_rss().map(|(o, _)| o)
    }

    /// As [`Proc::end`], with its peak RSS in KiB.
    pub fn end_rss(&mut self) -> Result<(Output, i64), String> {
        while !self.exited() {
            if Instant::now() >= self.deadline {
                self.kill_and_reap();
                self.drain();
                return Err(format!("still running at its deadline, killed: {}", self.said()));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // What it left behind in its group goes with it.
        self.kill_and_reap();
        self.drain();
        let (status, rss) = self.ended.unwrap();
        Ok((Output { status, stdout: self.out.bytes(), stderr: self.err.bytes() }, rss))
    }

    /// Waits for its end; fails the test if the deadline passes.
    pub fn wait(self) -> Output {
        self.end().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Ends a process expected to be still running: whether it was, and what it said.
    pub fn stop(mut self) -> (bool, Output) {
        let running = !self.exited();
        self.kill_and_reap();
        self.drain();
        let status = self.ended.unwrap().0;
        (running, Output { status, stdout: self.out.bytes(), stderr: self.err.bytes() })
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill_and_reap();
    }
}

/// Runs `cmd` to its end, stdin closed; fails the test if it runs past `limit`.
pub fn output(cmd: &mut Command, limit: Duration) -> Output {
    Proc::start(cmd, limit).wait()
}

/// A `softrdma` command.
pub fn softrdma<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = Command::new(BIN);
    c.args(args);
    c
}

/// The live processes (zombies are not) in process group `pgid`, from /proc.
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| {
        let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        let rest = &stat[stat.rfind(')')? + 1..];
        let mut f = rest.split_whitespace();
        let state = f.next()?;
        let pgrp: u32 = f.nth(1)?.parse().ok()?;
        (pgrp == pgid && state != "Z").then_some(pid)
    })
    .collect()
}

/// stdout then stderr, as text.
pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}
