//! The library's own threads take no signal sent to the program. A program that blocks a
//! signal in its threads to take it with `sigwait` or a `signalfd` (a server's `SIGTERM`,
//! the `softrdma ipoib` command's) must find it waiting for it, not handled on a progress
//! thread, nor ending the process there by its default action.
//!
//! Without the test harness (`harness = false`): the harness's main thread, which this
//! test cannot make block anything, would take the signal first.

use std::net::IpAddr;
use std::sync::atomic::{AtomicI32, Ordering};

use softrdma::managed::CompletionPoller;
use softrdma::Context;

/// The thread the handler ran on, if it ran.
static HANDLED_ON: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    // SAFETY: gettid is async-signal-safe.
    HANDLED_ON.store(unsafe { libc::gettid() }, Ordering::SeqCst);
}

fn usr1_set() -> libc::sigset_t {
    // SAFETY: sigset operations on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        set
    }
}

/// The name of one of this process's threads.
fn thread_name(tid: i32) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default().trim().to_string()
}

fn main() {
    // SAFETY: installs a handler that only stores an integer.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as usize;
        assert_eq!(libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut()), 0);
    }
    // Devices (two shards each: two progress threads), the introspection socket's thread
    // and a poller's thread, all started while this thread blocks nothing.
    std::env::set_var("SOFTRDMA_SHARDS", "2");
    let a = Context::open_port(IpAddr::from([127, 0, 0, 62]), 0).expect("open a device");
    let b = Context::open_port(IpAddr::from([127, 0, 0, 63]), 0).expect("open a device");
    let poller = CompletionPoller::spawn(&a, 16).expect("a poller");
    // Four progress threads and the poller's, and the introspection socket's where it has
    // one (`SOFTRDMA_RES=off`, or no private runtime directory, leaves it out): five or
    // six, once each has named itself (a thread takes its name when it starts to run).
    let want = 5 + usize::from(
        std::env::var(softrdma::RES_ENV).map_or(true, |v| v != "off" && v != "0")
            && softrdma::res_socket_dir().join(format!("{}.sock", std::process::id())).exists(),
    );
    let library_threads = || -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .map(thread_name)
            .filter(|n| n.starts_with("softrdma-"))
            .collect()
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut library = library_threads();
    while library.len() < want && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(1));
        library = library_threads();
    }
    assert_eq!(library.len(), want, "the library's threads: {library:?}");

    // The program now blocks SIGUSR1 in its one thread and waits for it, as a program that
    // takes its signals with sigwait does; every signal sent must come to that wait.
    let set = usr1_set();
    // SAFETY: changes this thread's mask.
    assert_eq!(unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) }, 0);
    let sends = 200;
    for k in 0..sends {
        // SAFETY: a signal to this process, whose handler is installed above.
        assert_eq!(unsafe { libc::kill(libc::getpid(), libc::SIGUSR1) }, 0);
        let timeout = libc::timespec { tv_sec: 2, tv_nsec: 0 };
        // SAFETY: waits on a valid set with a valid timeout.
        let got = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &timeout) };
        let on = HANDLED_ON.load(Ordering::SeqCst);
        assert_eq!(
            got,
            libc::SIGUSR1,
            "signal {k} of {sends} did not wait for the program: handled on thread {on} ({})",
            thread_name(on)
        );
    }
    assert_eq!(HANDLED_ON.load(Ordering::SeqCst), 0, "the handler ran");
    println!("{sends} signals of {sends} waited for the program; library threads: {library:?}");
    drop((poller, a, b));
}
