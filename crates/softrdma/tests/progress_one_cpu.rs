//! A process held to one CPU (`taskset -c 0`, a container given one CPU) never has its
//! progress thread spin after an arrival: the spin would take the only CPU from the
//! threads it waits for. A test binary of its own: it restricts its own affinity before
//! its devices open, and the engine counts the CPUs it may use once per process.

use softrdma::Access;

mod two_sides;
use two_sides::{pair, read_8};

#[test]
fn a_process_held_to_one_cpu_never_spins() {
    // This thread's CPU only; the devices' threads, spawned from it, inherit the mask.
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity read and
    // write only the set passed, and sched_getcpu has no preconditions.
    unsafe {
        let cpu = usize::try_from(libc::sched_getcpu()).unwrap_or(0);
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0);
    }
    assert_eq!(std::thread::available_parallelism().map(|n| n.get()).ok(), Some(1));
    let (client, target) = pair(66, 67, Access::REMOTE_READ);
    let remote = target.mr.remote();
    // READs: on the target only its progress thread works, and on a CPU to spare it would
    // spin after each (tests/progress_crowded.rs: 150 or more spins in 200).
    for k in 0..200 {
        read_8(&client, &remote, k);
    }
    let spins = target.ctx.io_stats().spins;
    assert_eq!(spins, 0, "the target's progress thread spun {spins} times over 200 READs on one CPU");
}
