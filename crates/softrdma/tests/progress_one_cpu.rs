//! A device whose threads may use one CPU only (`taskset -c 0`, a container given one CPU)
//! never has its progress thread spin after an arrival: the spin would take the only CPU
//! from the threads it waits for. The count is a device's own, made by the thread that
//! opens it: a device opened afterwards from a thread with every CPU spins again. A test
//! binary of its own: it changes its own thread's affinity.

use softrdma::Access;

mod two_sides;
use two_sides::{pair, read_8, Side};

/// 200 READs from `client` to `target`'s region; the spins of `target`'s progress thread
/// meanwhile (on the target only that thread works, and with a CPU to spare it spins after
/// each request: tests/progress_crowded.rs counts 150 or more in 200).
fn spins_over_200_reads(client: &Side, target: &Side) -> u64 {
    let remote = target.mr.remote();
    let before = target.ctx.io_stats().spins;
    for k in 0..200 {
        read_8(client, &remote, k);
    }
    target.ctx.io_stats().spins - before
}

#[test]
fn a_device_held_to_one_cpu_never_spins() {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // This thread's mask, then its current CPU alone; the devices' threads, spawned from
    // it, inherit the mask.
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity and sched_setaffinity
    // read or write only the set passed, of the size passed; CPU_SET checks its bound;
    // sched_getcpu has no preconditions.
    let all = unsafe {
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(0, size, &mut all), 0);
        let cpu = usize::try_from(libc::sched_getcpu()).unwrap_or(0);
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        assert_eq!(libc::sched_setaffinity(0, size, &one), 0);
        all
    };
    assert_eq!(std::thread::available_parallelism().map(|n| n.get()).ok(), Some(1));
    let (client, target) = pair(66, 67, Access::REMOTE_READ);
    let spins = spins_over_200_reads(&client, &target);
    assert_eq!(spins, 0, "the target's progress thread spun {spins} times over 200 READs on one CPU");

    // Every CPU again: a device opened now counts its own.
    // SAFETY: `all` is the mask sched_getaffinity filled above.
    assert_eq!(unsafe { libc::sched_setaffinity(0, size, &all) }, 0);
    if std::thread::available_parallelism().map_or(0, |n| n.get()) < 2 {
        eprintln!("one CPU only: the second half is skipped");
        return;
    }
    let (client, target) = pair(68, 69, Access::REMOTE_READ);
    let spins = spins_over_200_reads(&client, &target);
    eprintln!("spins over 200 READs with every CPU: {spins}");
    assert!(spins > 0, "a device opened with every CPU never spun over 200 READs");
}
