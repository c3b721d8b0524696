//! The progress thread's spin after an arrival (which keeps a one-sided target's answers
//! quick) stops while the machine has more runnable threads than cores: there it would
//! only share a core with the threads that answer the peer, in time slices of
//! milliseconds. A test binary of its own: it fills every core with spinning threads,
//! which no other test should meet.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use softrdma::Access;

mod two_sides;
use two_sides::{pair, read_8};

#[test]
fn a_crowded_machine_stops_the_progress_threads_spin() {
    if std::thread::available_parallelism().map_or(2, |n| n.get()) < 2 {
        // A process held to one CPU never spins (tests/progress_one_cpu.rs): nothing to stop.
        eprintln!("one CPU only: skipped");
        return;
    }
    let (client, target) = pair(46, 47, Access::REMOTE_READ);
    let remote = target.mr.remote();
    // READs: the client busy-polls each; on the target only its progress thread works.
    let reads = |n: u64| {
        for k in 0..n {
            read_8(&client, &remote, k);
        }
    };
    let spins = || target.ctx.io_stats().spins;

    // A machine with a core to spare (here, the client's polling thread and the target's
    // progress thread, one core each): the target's progress thread spins after
    // arrivals, also after several samples.
    let settle = |reads_for: Duration| {
        let until = Instant::now() + reads_for;
        while Instant::now() < until {
            reads(1);
        }
    };
    settle(Duration::from_millis(100));
    let before = spins();
    reads(200);
    let calm = spins() - before;
    assert!(calm >= 150, "the target's progress thread spun after {calm} of 200 READs on a calm machine");

    // Every core and two more busy: after a few samples (10 ms apart) it spins no more.
    // The machine's online CPUs, as the engine counts them (not this process's share:
    // the engine reads the whole machine's load).
    // SAFETY: sysconf only reads system configuration.
    let cores = usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).unwrap_or(1).max(1);
    let stop = AtomicBool::new(false);
    // Set however the scope's body ends (an assertion that fails included), so that the
    // spinners stop and the scope can return.
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop = Stop(&stop);
        for _ in 0..cores + 2 {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
        }
        settle(Duration::from_millis(100));
        let before = spins();
        reads(200);
        let crowded = spins() - before;
        eprintln!("spins over 200 READs: {calm} calm, {crowded} crowded ({cores} cores)");
        assert!(
            crowded <= 10,
            "the progress thread spun {crowded} times over 200 READs on a crowded machine"
        );
    });
}
