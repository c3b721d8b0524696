//! A timeline of what each thread of a process did and when (built only with the
//! `timeline` feature; without it, [`timeline!`] compiles to nothing): posts, send and
//! receive calls that moved datagrams, completions polled and receives posted, each with
//! the CPU's time-stamp counter, a thread number and a count. It answers what a profile
//! cannot: in which order two processes' threads did what within one burst, and where
//! they waited for each other.
//!
//! `SOFTRDMA_TIMELINE=T` (seconds of `CLOCK_MONOTONIC`, as `/proc/uptime` nearly gives)
//! turns it on: the process keeps its last [`KEEP`] events in memory, and the first event
//! after `T` writes them to `/tmp/softrdma-timeline-PID.txt`, one line each: nanoseconds of
//! `CLOCK_MONOTONIC`, the event's name, the thread, the count. Two processes given the
//! same `T` write the same stretch of time. `bench/timeline.sh` runs a benchmark with it and
//! reads the files.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Events kept: the last this many before the process writes them.
const KEEP: usize = 1 << 19;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum Event {
    /// `Engine::post_send` entered (count: 0).
    Post = 1,
    /// It returns (count: the WRs posted).
    PostEnd,
    /// A send call is entered (count: its messages).
    Send,
    /// It returned.
    SendEnd,
    /// A receive call returned datagrams, all of them handled (count: packets).
    Recv,
    /// An application's CQ poll took completions (count: how many).
    Polled,
    /// A receive WR was posted.
    PostRecv,
}

const NAMES: [&str; 8] = ["?", "post", "post-end", "send", "send-end", "recv", "polled", "post-recv"];

struct Log {
    /// When to write, in ns of CLOCK_MONOTONIC.
    at: u64,
    /// CLOCK_MONOTONIC and the counter at the first event, to convert.
    epoch: (u64, u64),
    /// Three words an event: counter, event and thread, count.
    words: Box<[AtomicU64]>,
}

static LOG: OnceLock<Option<Log>> = OnceLock::new();
static NEXT: AtomicUsize = AtomicUsize::new(0);
static WRITTEN: AtomicBool = AtomicBool::new(false);

use crate::cq::completion_clock_ns as mono;
use crate::sys::tsc;

fn log() -> Option<&'static Log> {
    LOG.get_or_init(|| {
        let at: f64 = std::env::var("SOFTRDMA_TIMELINE").ok()?.trim().parse().ok()?;
        Some(Log {
            at: (at * 1e9) as u64,
            epoch: (mono(), tsc()),
            words: (0..3 * KEEP).map(|_| AtomicU64::new(0)).collect(),
        })
    })
    .as_ref()
}

/// Records `event` with `count`.
pub(crate) fn record(event: Event, count: u64) {
    let Some(log) = log() else { return };
    if WRITTEN.load(Ordering::Relaxed) {
        return;
    }
    thread_local! {
        // SAFETY (of the call): gettid has no preconditions.
        static TID: u64 = unsafe { libc::gettid() } as u64;
    }
    let tid = TID.with(|t| *t);
    let i = NEXT.fetch_add(1, Ordering::Relaxed);
    let k = 3 * (i % KEEP);
    log.words[k].store(tsc(), Ordering::Relaxed);
    log.words[k + 1].store((event as u64) << 32 | (tid & 0xffff_ffff), Ordering::Relaxed);
    log.words[k + 2].store(count, Ordering::Relaxed);
    if i % 1024 == 0 && mono() > log.at && !WRITTEN.swap(true, Ordering::Relaxed) {
        write(log);
    }
}

fn write(log: &Log) {
    let (m1, c1) = (mono(), tsc());
    let (m0, c0) = log.epoch;
    let per_ns = c1.saturating_sub(c0) as f64 / m1.saturating_sub(m0).max(1) as f64;
    let mut out = String::new();
    for e in log.words.chunks(3) {
        let t = e[0].load(Ordering::Relaxed);
        if t == 0 {
            continue;
        }
        let what = e[1].load(Ordering::Relaxed);
        let name = NAMES.get((what >> 32) as usize).copied().unwrap_or("?");
        let ns = m0 as f64 + (t as f64 - c0 as f64) / per_ns;
        out.push_str(&format!("{ns:.0} {name} {} {}\n", what & 0xffff_ffff, e[2].load(Ordering::Relaxed)));
    }
    let path = format!("/tmp/softrdma-timeline-{}.txt", std::process::id());
    if let Err(e) = std::fs::write(&path, out) {
        eprintln!("softrdma: timeline: {path}: {e}");
    }
}
