//! Where a message's microseconds go on the thread that handles it (built only with the
//! `stage-probe` feature; without it, [`stage!`] compiles to nothing).
//!
//! Each thread keeps a chain of timestamps (the CPU's time-stamp counter) that starts when
//! a receive call returns datagrams and ends when the next send call enters the kernel:
//! in a ping-pong, the user-space turnaround between the two system calls, which a raw
//! UDP ping-pong does not have. Every [`Stage`] marked in between is charged the time
//! since the previous mark; every 20,000 chains the thread prints the mean of each stage
//! in nanoseconds to stderr, and starts over. `bench/stages.sh` runs a ping-pong with it.

use std::cell::RefCell;
use std::sync::OnceLock;
use std::time::Instant;

use crate::sys::tsc;

/// A point of the path from a receive call to the next send call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub(crate) enum Stage {
    /// A receive call returned datagrams (starts the chain).
    Received,
    /// One datagram reached the engine's callback.
    PacketIn,
    /// The protocol handled that datagram.
    PacketHandled,
    /// The receive calls of a pass are over.
    RecvDone,
    /// The pass ran the timers that were due.
    TimersRun,
    /// The pass's flush found nothing to send and delivered the completions.
    PassDone,
    /// The application took a completion from its CQ.
    Polled,
    /// The application posted its next send (entry of the engine's post).
    PostEntered,
    /// The post holds the engine lock.
    Locked,
    /// The QP took the work request.
    Queued,
    /// A flush began (after the CM's turn).
    FlushBegins,
    /// The protocol built a packet to send.
    PacketBuilt,
    /// The send call is entered (ends the chain).
    Sending,
}

const NAMES: [&str; 13] = [
    "received",
    "packet in",
    "packet handled",
    "recv done",
    "timers run",
    "pass done",
    "polled",
    "post entered",
    "locked",
    "queued",
    "flush begins",
    "packet built",
    "sending",
];
const N: usize = NAMES.len();
const REPORT_EVERY: u64 = 20_000;

struct Chain {
    /// The last mark's timestamp, if a chain is open.
    last: Option<u64>,
    sum: [u64; N],
    count: [u64; N],
    chains: u64,
}

thread_local! {
    static CHAIN: RefCell<Chain> = const { RefCell::new(Chain { last: None, sum: [0; N], count: [0; N], chains: 0 }) };
}

/// The counter and the clock at the first mark of the process: the rate between the two is
/// measured over the whole run, with no pause.
static START: OnceLock<(Instant, u64)> = OnceLock::new();

/// Counter ticks per nanosecond since [`START`].
fn ticks_per_ns(now: u64) -> f64 {
    let (t0, c0) = *START.get_or_init(|| (Instant::now(), tsc()));
    now.saturating_sub(c0) as f64 / t0.elapsed().as_nanos().max(1) as f64
}

/// Charges `stage` the time since the thread's previous mark (see the module docs).
pub(crate) fn mark(stage: Stage) {
    let now = tsc();
    START.get_or_init(|| (Instant::now(), now));
    let _ = CHAIN.try_with(|c| {
        let Ok(mut c) = c.try_borrow_mut() else { return };
        let i = stage as usize;
        match (stage, c.last) {
            (Stage::Received, _) => {
                c.last = Some(now);
                return;
            }
            (_, None) => return,
            (_, Some(last)) => {
                c.sum[i] += now.saturating_sub(last);
                c.count[i] += 1;
                c.last = Some(now);
            }
        }
        if stage == Stage::Sending {
            c.last = None;
            c.chains += 1;
            if c.chains == REPORT_EVERY {
                eprintln!("{}", summary(&c, ticks_per_ns(now)));
                *c = Chain { last: None, sum: [0; N], count: [0; N], chains: 0 };
            }
        }
    });
}

/// The report line of a chain set: each stage's mean in nanoseconds per turnaround, at
/// `rate` counter ticks per nanosecond.
fn summary(c: &Chain, rate: f64) -> String {
    let parts: Vec<String> = (1..N)
        .filter(|&s| c.count[s] > 0)
        .map(|s| format!("{} {:.0}", NAMES[s], c.sum[s] as f64 / rate / c.chains as f64))
        .collect();
    let total: u64 = c.sum.iter().sum();
    format!(
        "stages (ns per turnaround, {} turnarounds): {}; total {:.0}",
        c.chains,
        parts.join(", "),
        total as f64 / rate / c.chains as f64
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_runs_from_a_receive_to_the_next_send_and_reports_every_so_often() {
        mark(Stage::Polled); // no chain open: charged to nothing
        mark(Stage::Received);
        mark(Stage::PacketIn);
        mark(Stage::PacketHandled);
        mark(Stage::Sending);
        mark(Stage::Polled); // after the send: no chain open
        CHAIN.with(|c| {
            let c = c.borrow();
            assert_eq!((c.chains, c.last), (1, None));
            let charged: Vec<usize> = (0..N).filter(|&s| c.count[s] > 0).collect();
            let want = [Stage::PacketIn, Stage::PacketHandled, Stage::Sending].map(|s| s as usize);
            assert_eq!(charged, want);
        });
        // The report comes after REPORT_EVERY chains, and the counts start over.
        for _ in 1..REPORT_EVERY {
            mark(Stage::Received);
            mark(Stage::Sending);
        }
        CHAIN.with(|c| assert_eq!((c.borrow().chains, c.borrow().count), (0, [0; N])));
    }

    #[test]
    fn the_report_gives_each_stage_its_mean_per_turnaround() {
        let mut c = Chain { last: None, sum: [0; N], count: [0; N], chains: 4 };
        c.sum[Stage::PacketIn as usize] = 1_000;
        c.count[Stage::PacketIn as usize] = 4;
        c.sum[Stage::Sending as usize] = 3_000;
        c.count[Stage::Sending as usize] = 4;
        assert_eq!(
            summary(&c, 2.0),
            "stages (ns per turnaround, 4 turnarounds): packet in 125, sending 375; total 500"
        );
    }
}
