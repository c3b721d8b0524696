//! An idle device's progress thread sleeps a second at a time, not 20 ms, and a timer
//! armed while it sleeps still wakes it, as does a datagram the in-memory network delays.
//! A test binary of its own, its tests one at a time, so that no other test's devices are
//! in the process.

use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use softrdma::proto::sim::Impairments;
use softrdma::{
    Access, AhAttr, ConnectOptions, Context, MemoryNetwork, Qkey, QpBuilder, RecvWr, SendFlags, SendOp,
    SendWr, WcStatus,
};

/// Taken by each test: one at a time.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

mod threads;
use threads::{cpu_ticks, open_with_thread, sleeps};

/// Waits until the progress thread `tid` naps long: a 200 ms window in which it slept at
/// most once (up to 10 s; a loaded machine makes its naps of 20 ms slow to add up).
fn settle_idle(tid: u32) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let before = sleeps(tid);
        std::thread::sleep(Duration::from_millis(200));
        if sleeps(tid) - before <= 1 {
            return;
        }
        assert!(Instant::now() < until, "the idle device's progress thread kept waking");
    }
}

/// Returns as the progress thread `tid` begins a sleep: its sleeps just went up by one.
fn as_it_falls_asleep(tid: u32) {
    let before = sleeps(tid);
    let until = Instant::now() + Duration::from_secs(5);
    while sleeps(tid) == before {
        assert!(Instant::now() < until, "the progress thread never slept again");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn an_idle_device_wakes_about_once_a_second_and_a_timer_armed_meanwhile_still_fires() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let (a, progress) =
        open_with_thread(|| Context::open_sharded(IpAddr::from([127, 0, 0, 48]), 0, 1).unwrap());
    let b = Context::open_sharded(IpAddr::from([127, 0, 0, 49]), 0, 1).unwrap();
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
    settle_idle(progress);
    let before = sleeps(progress);
    let cpu_before = cpu_ticks(progress);
    std::thread::sleep(Duration::from_secs(2));
    let idle = sleeps(progress) - before;
    let cpu = cpu_ticks(progress) - cpu_before;
    eprintln!("the idle device's progress thread slept {idle} times in 2 s, using {cpu} clock ticks");
    assert!(idle <= 6, "an idle device's progress thread woke {idle} times in 2 s (100 at 20 ms naps)");
    // Nor does it stay awake: a thread that loops without sleeping (a wake-up signal it
    // never clears, say) wakes no more often, but uses a whole core.
    // SAFETY: sysconf only reads system configuration.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(100);
    assert!(
        cpu * 10 < 2 * hz,
        "an idle device's progress thread used {cpu} ticks of CPU in 2 s ({hz} a second)"
    );

    // The peer goes away; a SEND to it arms a retransmission timer while the progress
    // thread sleeps its second. No thread of the program polls: only the progress
    // thread runs the timer, and the failure shows on the channel's descriptor.
    drop((qb, cqb, pb, b));
    cqa.req_notify(false).unwrap();
    as_it_falls_asleep(progress);
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
    // would take its second.
    assert!(took < Duration::from_millis(300), "the retransmission timer waited {took:?}");

    // The post's wake-up and the timer spent, the device is idle again, and its thread
    // sleeps again: one that kept an old wake-up signal uncleared would loop on it.
    let cpu_before = cpu_ticks(progress);
    std::thread::sleep(Duration::from_secs(1));
    let cpu = cpu_ticks(progress) - cpu_before;
    assert!(
        cpu * 10 < hz,
        "the progress thread used {cpu} ticks of CPU in its next idle second ({hz} a second)"
    );
}

#[test]
fn a_datagram_the_network_delays_is_delivered_after_its_delay_though_both_devices_idle() {
    // The in-memory network holds a delayed datagram until a device next receives or
    // sends; a UD send arms no protocol timer. The sender's progress thread must still
    // wake when the datagram is due, rather than at the end of its second.
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let net =
        MemoryNetwork::new(5, Impairments { delay: Duration::from_millis(2), ..Impairments::default() });
    let (a, pa_thread) =
        open_with_thread(|| Context::open_in(&net, "10.0.0.1:4791".parse().unwrap()).unwrap());
    let (b, pb_thread) =
        open_with_thread(|| Context::open_in(&net, "10.0.0.2:4791".parse().unwrap()).unwrap());
    let qkey = Qkey(0x77);
    let ch = b.create_channel().unwrap();
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let cqa = a.create_cq(8, None).unwrap();
    let cqb = b.create_cq(8, Some(&ch)).unwrap();
    let qa = pa.prepare_qp(&QpBuilder::ud(qkey), &cqa, &cqa).unwrap().ready().unwrap();
    let qb = pb.prepare_qp(&QpBuilder::ud(qkey), &cqb, &cqb).unwrap().ready().unwrap();
    let (mra, mrb) =
        (pa.register(8, Access::LOCAL_WRITE).unwrap(), pb.register(64, Access::LOCAL_WRITE).unwrap());
    qb.post_recv(RecvWr { wr_id: 9, sg_list: softrdma::sgl![mrb.sge(0, 64).unwrap()] }).unwrap();
    let to = pa.create_ah(&AhAttr::to_socket(b.local_addr())).unwrap().dest(qb.qpn(), qkey);
    settle_idle(pa_thread);
    settle_idle(pb_thread);
    cqb.req_notify(false).unwrap();
    as_it_falls_asleep(pa_thread);
    let start = Instant::now();
    qa.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sg_list: softrdma::sgl![mra.sge(0, 8).unwrap()],
        flags: SendFlags::default(),
        ud: Some(to),
    })
    .unwrap();
    let mut pfd = libc::pollfd { fd: ch.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 20_000) }, 1, "the datagram never arrived");
    let took = start.elapsed();
    eprintln!("a datagram delayed 2 ms arrived after {took:?}");
    assert_eq!(cqb.poll_one().map(|wc| (wc.wr_id, wc.status)), Some((9, WcStatus::Success)));
    assert!(took < Duration::from_millis(300), "the delayed datagram waited {took:?}");
}
