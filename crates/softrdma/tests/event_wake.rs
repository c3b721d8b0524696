//! Event mode's hand-back of the link (`softrdma::EventWake`): a thread blocked on a
//! completion channel watches the device's socket itself, and when it leaves with its
//! event the link goes back to the progress thread. The lean hand-back wakes one thread
//! per message; the warm one wakes the progress thread too. A test binary of its own, its
//! tests one at a time, so that no other test's threads compete with the ping-pongs.

use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use softrdma::{
    Access, AhAttr, CompletionChannel, CompletionQueue, ConnectOptions, Context, EventWake, MemoryRegion,
    Qkey, QpBuilder, QueuePair, RecvWr, SendFlags, SendOp, SendWr, UdDest, WcStatus,
};

/// One end of an event-mode pair: receives complete on a CQ with a channel, sends on a
/// CQ that is polled.
struct End {
    ctx: Context,
    ch: CompletionChannel,
    rcq: CompletionQueue,
    scq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    /// The peer, for a UD QP.
    to: Option<UdDest>,
}

/// Taken by each test: one at a time.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Receives each end keeps posted.
const RECVS: u64 = 64;

const QKEY: Qkey = Qkey(0x5151);

/// Two devices whose QPs (RC, or UD with `ud`) are each other's peers.
fn pair(a: u8, b: u8, wake: EventWake, ud: bool) -> (End, End) {
    let mut prepared = Vec::new();
    for last in [a, b] {
        let ctx = Context::open_port(IpAddr::from([127, 0, 0, last]), 0).unwrap();
        ctx.set_event_wake(wake);
        assert_eq!(ctx.event_wake(), wake);
        let ch = ctx.create_channel().unwrap();
        let pd = ctx.alloc_pd();
        let rcq = ctx.create_cq(256, Some(&ch)).unwrap();
        let scq = ctx.create_cq(256, None).unwrap();
        let builder = if ud { QpBuilder::ud(QKEY) } else { QpBuilder::rc() };
        let p = pd.prepare_qp(&builder, &scq, &rcq).unwrap();
        // A UD receive takes the 40-byte GRH in front of the message.
        let mr = pd.register(128, Access::LOCAL_WRITE).unwrap();
        prepared.push((ctx, ch, rcq, scq, p, mr, pd));
    }
    let peers = [
        (prepared[1].4.endpoint(), prepared[1].0.local_addr()),
        (prepared[0].4.endpoint(), prepared[0].0.local_addr()),
    ];
    let ends: Vec<_> = peers
        .into_iter()
        .zip(prepared)
        .map(|((remote, remote_addr), (ctx, ch, rcq, scq, p, mr, pd))| {
            let (qp, to) = if ud {
                let ah = pd.create_ah(&AhAttr::to_socket(remote_addr)).unwrap();
                (p.ready().unwrap(), Some(ah.dest(softrdma::Qpn::new(remote.qpn), QKEY)))
            } else {
                (p.handshake(&remote, &ConnectOptions::default()).unwrap(), None)
            };
            for id in 0..RECVS {
                recv(&qp, &mr, id);
            }
            End { ctx, ch, rcq, scq, qp, mr, to }
        })
        .collect();
    let mut ends = ends.into_iter();
    (ends.next().unwrap(), ends.next().unwrap())
}

fn recv(qp: &QueuePair, mr: &MemoryRegion, id: u64) {
    qp.post_recv(RecvWr { wr_id: id, sg_list: softrdma::sgl![mr.sge(0, 128).unwrap()] }).unwrap();
}

impl End {
    fn send(&self, id: u64) {
        let sg_list = softrdma::sgl![self.mr.sge(0, 8).unwrap()];
        let flags = SendFlags { signaled: true, ..Default::default() };
        self.qp.post_send(SendWr { wr_id: id, op: SendOp::Send, sg_list, flags, ud: self.to }).unwrap();
    }

    /// Waits on the channel, as an event-mode program does, for the next message, and
    /// posts its receive again; takes the send completions that came meanwhile.
    fn take_message(&self) {
        loop {
            if let Some(wc) = self.rcq.poll_one() {
                assert_eq!(wc.status, WcStatus::Success);
                recv(&self.qp, &self.mr, wc.wr_id);
                break;
            }
            self.rcq.req_notify(false).unwrap();
            // A completion delivered before the CQ was armed brings no event.
            if let Some(wc) = self.rcq.poll_one() {
                assert_eq!(wc.status, WcStatus::Success);
                recv(&self.qp, &self.mr, wc.wr_id);
                break;
            }
            let cq =
                self.ch.get_event_timeout(Duration::from_secs(20)).unwrap().expect("a message within 20 s");
            assert_eq!(cq.id(), self.rcq.id());
            self.ch.ack_events(1);
        }
        while let Some(wc) = self.scq.poll_one() {
            assert_eq!(wc.status, WcStatus::Success);
        }
    }
}

/// `n` round trips, each end's thread blocked on its channel between messages; returns
/// the hand-back wake-ups of both devices over them, and the mean round trip.
fn event_pingpong(a: &End, b: &End, n: u64) -> (u64, Duration) {
    let wakes = |e: &End| e.ctx.io_stats().handback_wakes;
    let before = wakes(a) + wakes(b);
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..n {
                b.take_message();
                b.send(i);
            }
        });
        for i in 0..n {
            a.send(i);
            a.take_message();
        }
    });
    (wakes(a) + wakes(b) - before, start.elapsed() / n as u32)
}

#[test]
fn a_lean_hand_back_wakes_one_thread_per_message_and_a_warm_one_two() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    const N: u64 = 2000;
    let (a, b) = pair(50, 51, EventWake::Lean, false);
    let (lean, lean_rtt) = event_pingpong(&a, &b, N);
    let (c, d) = pair(52, 53, EventWake::Warm, false);
    let (warm, warm_rtt) = event_pingpong(&c, &d, N);
    eprintln!(
        "hand-back wake-ups over {N} round trips: lean {lean} (mean round trip {lean_rtt:?}), \
         warm {warm} ({warm_rtt:?})"
    );
    // Warm: most of the 2N waits that ended woke their device's progress thread on the
    // way out (those that found it awake did not).
    assert!(
        warm > N / 2,
        "a warm hand-back wakes the progress thread per message: {warm} for {N} round trips"
    );
    // Lean: while messages keep coming (each device's waits end less than 500 us apart),
    // departures wake no one. (Round trips that take longer now and then, on a loaded
    // machine, wake it once each: hence the margin.)
    assert!(lean * 2 < warm, "a lean hand-back woke the progress thread {lean} times over {N} round trips");
}

#[test]
fn polls_after_an_event_do_not_ask_the_socket_for_nothing() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    const N: u64 = 2000;
    let (a, b) = pair(58, 59, EventWake::Lean, false);
    let empty = || a.ctx.io_stats().empty_recvs + b.ctx.io_stats().empty_recvs;
    let before = empty();
    event_pingpong(&a, &b, N);
    let asked = empty() - before;
    eprintln!("receives that found nothing over {N} round trips: {asked}");
    // Each message: the watcher's pass receives it; the polls after the event (the
    // completion, the send completions, the CQ armed and polled again) find nothing on the
    // socket, and need not ask (two or three a message before: 9,010 over the 4,000
    // messages). A wait ended by the channel rather than the socket (its completion
    // delivered by the progress thread) leaves its polls to ask: hence the margin.
    assert!(asked < N / 4, "{asked} receives found nothing over {N} round trips");
    // Past the quiet polls, a thread that keeps polling drives the link again: a
    // busy-polled ping-pong's polls ask the socket, and find it empty most times (about
    // 27 times a round trip here, where a message is received once each way).
    let before = empty();
    busy_pingpong(&a, &b, N / 4);
    let busy = empty() - before;
    eprintln!("receives that found nothing over {} busy-polled round trips: {busy}", N / 4);
    assert!(busy >= N, "busy polls asked the socket {busy} times in vain over {} round trips", N / 4);
}

/// `n` round trips, each end busy-polling its CQs, no channel involved.
fn busy_pingpong(a: &End, b: &End, n: u64) {
    let take = |e: &End| {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(wc) = e.rcq.poll_one() {
                assert_eq!(wc.status, WcStatus::Success);
                recv(&e.qp, &e.mr, wc.wr_id);
                break;
            }
            assert!(Instant::now() < until, "no message within 20 s");
        }
        while let Some(wc) = e.scq.poll_one() {
            assert_eq!(wc.status, WcStatus::Success);
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..n {
                take(b);
                b.send(i);
            }
        });
        for i in 0..n {
            a.send(i);
            take(a);
        }
    });
}

#[test]
fn a_waiting_thread_takes_its_messages_itself() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    const N: u64 = 4000;
    // RC: each message arms a delayed ACK (which its answer makes moot), and the progress
    // thread, woken for that deadline, runs a pass while the thread waits.
    let (a, b) = pair(60, 61, EventWake::Lean, false);
    let signals = || a.ch.fd_signals() + b.ch.fd_signals();
    let before = signals();
    event_pingpong(&a, &b, N);
    let handed = signals() - before;
    eprintln!("events handed over through the channel's descriptor, over {N} round trips: {handed}");
    // The progress thread's passes leave the link to a thread watching it: a pass that
    // received would take the packet the watcher woke for and hand its event over the
    // descriptor, a second wake-up (101-471 over 2,000 round trips before, in nine runs;
    // 2-46 since). A message that comes while the thread is away between two waits is the
    // progress thread's to take: hence the margin.
    assert!(handed < N / 25, "{handed} of {N} round trips' events were handed over");
    // A thread that waits passively (on the channel alone) gets every event handed over.
    let before = b.ch.fd_signals();
    for round in 0..3 {
        while b.ch.try_get_event().is_some() {
            b.ch.ack_events(1);
        }
        b.rcq.req_notify(false).unwrap();
        a.send(N + round);
        let cq = b.ch.get_event_passive(Duration::from_secs(20)).unwrap().expect("a message within 20 s");
        b.ch.ack_events(1);
        let wc = cq.poll_one().expect("the message's completion");
        assert_eq!(wc.status, WcStatus::Success);
        recv(&b.qp, &b.mr, wc.wr_id);
        while let Some(wc) = a.scq.poll_one() {
            assert_eq!(wc.status, WcStatus::Success);
        }
    }
    assert_eq!(b.ch.fd_signals() - before, 3, "each passive wait's event came through the descriptor");
}

/// After an event-mode ping-pong the waiting thread of `b` goes away for good: at once
/// (the lean hand-back's progress thread naps in short steps then), or after one more
/// wait that outlasts the steps (`wait_more`: the thread naps long, and the watcher wakes
/// it as it leaves). Either way the next message to `b` must still be received promptly,
/// by its progress thread. UD, so that no protocol timer (a retransmission's, a delayed
/// ACK's) wakes the progress thread anyway. Returns the median time to delivery.
fn delivery_after_the_watcher_left(first: u8, wait_more: bool) -> Duration {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let (a, b) = pair(first, first + 1, EventWake::Lean, true);
    let mut took = Vec::new();
    for round in 0..10 {
        event_pingpong(&a, &b, 100);
        // An event left from the ping-pong, for a completion polled already, goes first.
        while b.ch.try_get_event().is_some() {
            b.ch.ack_events(1);
        }
        if wait_more {
            b.rcq.req_notify(false).unwrap();
            assert!(b.ch.get_event_timeout(Duration::from_millis(3)).unwrap().is_none());
        }
        // b's thread has left. Armed, its CQ makes the channel's descriptor readable when
        // the next message is delivered, which only b's progress thread can do now (this
        // thread looks with poll(2), not through the device).
        b.rcq.req_notify(false).unwrap();
        let readable = |ms| {
            let mut pfd = libc::pollfd { fd: b.ch.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, ms) == 1 }
        };
        assert!(!readable(0), "no event before the message");
        let start = Instant::now();
        a.send(1000 + round);
        assert!(readable(20_000), "the message was never received: the link was not handed back");
        took.push(start.elapsed());
        let cq = b.ch.try_get_event().expect("an event behind the readable descriptor");
        b.ch.ack_events(1);
        assert_eq!(cq.id(), b.rcq.id());
        let wc = b.rcq.poll_one().expect("the message was delivered");
        assert_eq!(wc.status, WcStatus::Success);
        recv(&b.qp, &b.mr, wc.wr_id);
        while a.scq.poll_one().is_some() {}
    }
    took.sort();
    eprintln!("delivered after the watcher left (wait_more {wait_more}): {took:?}");
    took[took.len() / 2]
}

// Without the hand-back, the progress thread would sleep until its longest nap ends
// (20 ms).

#[test]
fn a_watcher_that_leaves_for_good_hands_the_link_back_within_a_step() {
    let median = delivery_after_the_watcher_left(54, false);
    assert!(median < Duration::from_millis(5), "the link stayed unwatched for {median:?} (median of 10)");
}

#[test]
fn a_watcher_that_leaves_after_a_long_wait_wakes_the_progress_thread() {
    let median = delivery_after_the_watcher_left(56, true);
    assert!(median < Duration::from_millis(5), "the link stayed unwatched for {median:?} (median of 10)");
}

#[test]
fn a_delayed_ack_that_an_event_mode_threads_pass_arms_still_leaves_in_time() {
    // b's thread, waiting on its channel, receives a's SEND itself. b's QP talks back (it
    // sent to a just before), so its ACK waits up to 100 us for b's next request; b sends
    // none and waits again. The ACK is then the progress thread's to send, and the pass
    // that armed its timer must have told it.
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let (a, b) = pair(58, 59, EventWake::Lean, false);
    let mut took = Vec::new();
    for round in 0..20 {
        b.send(round);
        a.take_message();
        std::thread::scope(|s| {
            s.spawn(|| {
                b.take_message();
                // Waits on, watching the link, with nothing more coming.
                b.rcq.req_notify(false).unwrap();
                let _ = b.ch.get_event_timeout(Duration::from_millis(30)).unwrap();
            });
            // (b's thread is waiting by then; b sent less than 1 ms ago.)
            std::thread::sleep(Duration::from_micros(200));
            let start = Instant::now();
            a.send(100 + round);
            let wc = loop {
                if let Some(wc) = a.scq.poll_one() {
                    break wc;
                }
                assert!(start.elapsed() < Duration::from_secs(20), "never acknowledged");
            };
            assert_eq!((wc.wr_id, wc.status), (100 + round, WcStatus::Success));
            took.push(start.elapsed());
        });
        while a.scq.poll_one().is_some() {}
    }
    took.sort();
    eprintln!("SENDs acknowledged after {took:?}");
    let median = took[took.len() / 2];
    assert!(median < Duration::from_millis(5), "the delayed ACK left after {median:?} (median of 20)");
}
