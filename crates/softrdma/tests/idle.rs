//! An idle device's progress thread sleeps a second at a time, not 20 ms, and a timer
//! armed while it sleeps still wakes it. A test binary of its own, so that no other
//! test's devices are in the process.

use std::collections::HashSet;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use softrdma::{Access, ConnectOptions, Context, QpBuilder, SendFlags, SendOp, SendWr, WcStatus};

fn tasks() -> HashSet<u32> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// The voluntary context switches of one of this process's threads: each time it slept.
fn sleeps(tid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Opens a device on 127.0.0.`last`, and finds its progress thread: the thread its
/// opening started (which names itself once it runs).
fn open_with_thread(last: u8) -> (Context, u32) {
    let before = tasks();
    let ctx = Context::open_port(IpAddr::from([127, 0, 0, last]), 0).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let named: Vec<u32> = tasks()
            .difference(&before)
            .copied()
            .filter(|t| {
                let comm = std::fs::read_to_string(format!("/proc/self/task/{t}/comm")).unwrap_or_default();
                comm.starts_with("softrdma-") && !comm.starts_with("softrdma-res")
            })
            .collect();
        if let [t] = named[..] {
            return (ctx, t);
        }
        assert!(Instant::now() < until, "the device's progress thread: {named:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn an_idle_device_wakes_about_once_a_second_and_a_timer_armed_meanwhile_still_fires() {
    let (a, progress) = open_with_thread(48);
    let b = Context::open_port(IpAddr::from([127, 0, 0, 49]), 0).unwrap();
    let ch = a.create_channel().unwrap();
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let cqa = a.create_cq(8, Some(&ch)).unwrap();
    let cqb = b.create_cq(8, None).unwrap();
    let qa = pa.prepare_qp(&QpBuilder::rc(), &cqa, &cqa).unwrap();
    let qb = pb.prepare_qp(&QpBuilder::rc(), &cqb, &cqb).unwrap();
    // A short ACK timeout (4.096 us x 2^10, 4 ms) and one retry: a send to a peer that is
    // gone fails within a few timeouts, if its timers run.
    let opts = ConnectOptions { timeout: 10, retry_cnt: 1, ..ConnectOptions::default() };
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    let qa = qa.handshake(&eb, &opts).unwrap();
    let qb = qb.handshake(&ea, &opts).unwrap();
    let mr = pa.register(8, Access::LOCAL_WRITE).unwrap();

    // Idle: no timer, nothing arriving. After a second of 20 ms naps the thread sleeps a
    // second at a time.
    std::thread::sleep(Duration::from_millis(1500));
    let before = sleeps(progress);
    std::thread::sleep(Duration::from_secs(2));
    let idle = sleeps(progress) - before;
    eprintln!("the idle device's progress thread slept {idle} times in 2 s");
    assert!(idle <= 6, "an idle device's progress thread woke {idle} times in 2 s (100 at 20 ms naps)");

    // The peer goes away; a SEND to it arms a retransmission timer while the progress
    // thread sleeps its second. No thread of the program polls: only the progress
    // thread runs the timer, and the failure shows on the channel's descriptor.
    drop((qb, cqb, pb, b));
    cqa.req_notify(false).unwrap();
    let start = Instant::now();
    qa.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sg_list: softrdma::sgl![mr.sge(0, 8).unwrap()],
        flags: SendFlags { signaled: true, ..Default::default() },
        ud: None,
    })
    .unwrap();
    let mut pfd = libc::pollfd { fd: ch.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 20_000) }, 1, "the SEND to a gone peer never failed");
    let took = start.elapsed();
    let wc = cqa.poll_one().expect("the SEND's completion");
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RetryExcErr));
    eprintln!("a SEND to a gone peer failed after {took:?}");
    // Two timeouts of 4 ms, backed off; a progress thread that slept on through them
    // would take up to its second.
    assert!(took < Duration::from_millis(400), "the retransmission timer waited {took:?}");
}
