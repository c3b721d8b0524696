//! A device's threads open no file descriptor while traffic flows: the library lives
//! inside other programs, and a thread that opens and closes files in the background
//! churns descriptor numbers under them. A program that closes a descriptor twice (iperf3
//! does, its test stream's socket) would then close the library's file, or whatever took
//! the number in between. A test binary of its own: the check watches every descriptor
//! the process opens.

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use softrdma::Access;

mod two_sides;
use two_sides::{pair, read_8};

/// The lowest free descriptor number: the one the next file any thread opens gets.
fn lowest_free() -> i32 {
    const NULL: &CStr = c"/dev/null";
    // SAFETY: a valid C string; the descriptor is closed at once.
    let fd = unsafe { libc::open(NULL.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    assert!(fd >= 0, "open /dev/null");
    // SAFETY: this function's own descriptor.
    assert_eq!(unsafe { libc::close(fd) }, 0);
    fd
}

/// Whether `fd` is open now.
fn is_open(fd: i32) -> bool {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
}

#[test]
fn the_devices_threads_open_no_descriptor_while_traffic_flows() {
    let (client, target) = pair(60, 61, Access::REMOTE_READ);
    let remote = target.mr.remote();
    let stop = AtomicBool::new(false);
    let mut reads = 0u64;
    let mut hits = 0u32;
    let mut tries = 0u64;
    std::thread::scope(|s| {
        // READs for a second: the client busy-polls each, and on the target its progress
        // thread serves them alone, spinning after each arrival and sampling the machine's
        // load every 10 ms (`spin_has_a_core` in the engine).
        let traffic = s.spawn(|| {
            let until = Instant::now() + Duration::from_secs(1);
            while Instant::now() < until {
                read_8(&client, &remote, reads);
                reads += 1;
            }
            stop.store(true, Ordering::Relaxed);
        });
        // Any descriptor opened meanwhile takes the lowest free number: watch it.
        let trap = lowest_free();
        while !stop.load(Ordering::Relaxed) && !traffic.is_finished() {
            tries += 1;
            hits += u32::from(is_open(trap));
        }
        traffic.join().unwrap();
    });
    eprintln!("{reads} READs; {tries} looks at the lowest free descriptor found another thread's descriptor {hits} times");
    assert!(reads > 100, "only {reads} READs in a second");
    // The target's progress thread served them, spinning after arrivals (and so sampling
    // the machine's load) at least until it found the machine crowded; a process held to
    // one CPU never spins (tests/progress_one_cpu.rs).
    if std::thread::available_parallelism().map_or(2, |n| n.get()) > 1 {
        assert!(target.ctx.io_stats().spins > 0, "the target's progress thread never spun");
    }
    assert_eq!(
        hits, 0,
        "the devices' threads opened descriptors while traffic flowed ({hits} looks saw one)"
    );
}
