//! Packets that travel together: a pong carries its ping's ACK in one GSO train, the posts
//! of a burst leave together (the doorbell that waits for company), and none is left
//! behind. A process of its own (cargo runs test binaries one at a time): both depend on
//! timing that other tests' threads would disturb.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use softrdma::{
    Access, AhAttr, CompletionQueue, ConnectOptions, Context, MemoryRegion, ProtectionDomain, Qkey,
    QpBuilder, QueuePair, RecvWr, SendFlags, SendOp, SendWr, UdDest, WcOpcode, WcStatus,
};

mod two_sides;
use two_sides::{pair, pair_of, signaled, wait, Side};

/// The tests here run one at a time: each depends on timing that another's busy threads
/// would disturb.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// One end of the UD tests: a device on 127.0.0.`last`, a CQ of `cqe` entries and a
/// region of `len` bytes granting `access`.
struct UdEnd {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    mr: MemoryRegion,
}

impl UdEnd {
    fn new(last: u8, cqe: usize, len: usize, access: Access) -> UdEnd {
        let ctx = two_sides::ctx(last);
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(cqe, None).unwrap();
        let mr = pd.register(len, access).unwrap();
        UdEnd { ctx, pd, cq, mr }
    }

    /// A UD QP with `qkey` on the end's CQ, ready to send.
    fn qp(&self, qkey: Qkey) -> QueuePair {
        self.pd.prepare_qp(&QpBuilder::ud(qkey), &self.cq, &self.cq).unwrap().ready().unwrap()
    }

    /// The destination of a send from this end to `qp` at `peer`.
    fn to(&self, peer: &UdEnd, qp: &QueuePair, qkey: Qkey) -> UdDest {
        self.pd.create_ah(&AhAttr::to_socket(peer.ctx.local_addr())).unwrap().dest(qp.qpn(), qkey)
    }
}

/// Posts `n` SENDs of `len` bytes from `a` to `b`, one call each, back to back, from a
/// thread that busy-polls `a`'s CQ (before the burst and, with `then_poll`, every eighth
/// post, as perftest polls when its send queue fills); returns `a`'s send system calls
/// meanwhile.
fn post_a_burst(a: &Side, b: &Side, n: u64, len: usize, then_poll: bool) -> u64 {
    for k in 0..n {
        b.qp.post_recv(RecvWr { wr_id: k, sg_list: softrdma::sgl![b.mr.sge(0, len.max(64)).unwrap()] })
            .unwrap();
    }
    // Busy-poll long enough for the progress thread to look (it sleeps up to 20 ms) and
    // see a poller at work: the state in which posts wait for company.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(25) {
        assert!(a.cq.poll_one().is_none());
    }
    let before = a.ctx.io_stats().send_calls;
    let unsignaled = SendFlags::default();
    for k in 0..n {
        let flags = if k + 1 == n { signaled() } else { unsignaled };
        let sg_list = softrdma::sgl![a.mr.sge(64, len).unwrap()];
        a.qp.post_send(SendWr { wr_id: k, op: SendOp::Send, sg_list, flags, ud: None }).unwrap();
        if then_poll && k % 8 == 7 && k + 1 < n {
            assert!(a.cq.poll_one().is_none(), "only the last WR is signaled");
        }
    }
    if then_poll {
        assert_eq!(wait(&a.cq).wr_id, n - 1);
    }
    let calls = a.ctx.io_stats().send_calls - before;
    for k in 0..n {
        let wc = wait(&b.cq);
        assert_eq!((wc.wr_id, wc.status, wc.byte_len as usize), (k, WcStatus::Success, len));
    }
    calls
}

#[test]
fn a_burst_of_single_posts_leaves_in_few_system_calls() {
    let _serial = serial();
    // One WR per call, as perftest posts: the posts of a burst wait for company, up to 32,
    // and leave together at the next poll; every message arrives, in order. Sent one by
    // one they take 64 calls; here, polled every eighth post, about 9. Three tries: a burst
    // that the scheduler interrupts is cut where it was interrupted.
    let (a, b) = pair(28, 29, Access::NONE);
    let tries: Vec<u64> = (0..3).map(|_| post_a_burst(&a, &b, 64, 8, true)).collect();
    eprintln!("send calls for 64 posts: {tries:?}");
    assert!(tries.iter().any(|&c| c <= 32), "send calls for 64 posts: {tries:?}");
}

#[test]
fn a_burst_of_four_packet_posts_waits_for_company_too() {
    let _serial = serial();
    // 16 KiB SENDs on UC, four packets each at MTU 4096: each went in a system call of its
    // own, which held a UC stream (no ACKs to gather its packets) to 3.1 GB/s. Now they wait
    // for company as one-packet posts do: 64 posts polled every eighth leave in 36 to 40
    // calls (the post after each poll, which took the poller past the burst's 4 µs, goes
    // alone), 64 one by one.
    let (a, b) = pair_of(38, 39, &QpBuilder::uc());
    let tries: Vec<u64> = (0..3).map(|_| post_a_burst(&a, &b, 64, 16 * 1024, true)).collect();
    eprintln!("send calls for 64 posts of 16 KiB: {tries:?}");
    assert!(tries.iter().any(|&c| c <= 50), "send calls for 64 posts of 16 KiB: {tries:?}");
}

#[test]
fn a_stream_whose_polls_find_completions_leaves_in_few_system_calls() {
    let _serial = serial();
    // perftest's send_bw over UD: one WR per call, every 16th signaled, at most 128
    // outstanding, and one poll whenever the send queue is full. A UD send completes when it
    // leaves, so nearly every poll finds a completion and runs no pass of its own; the
    // posts must still wait for company once the stream has gone on a while (before, every
    // one went alone: 512 calls for 512 posts). Every datagram arrives, in order.
    let qkey = Qkey(0x1111_2222);
    let (a, b) =
        (UdEnd::new(34, 256, 64, Access::NONE), UdEnd::new(35, 1024, 64 * 1024, Access::LOCAL_WRITE));
    let (ca, cqa, mra, cqb, mrb) = (&a.ctx, &a.cq, &a.mr, &b.cq, &b.mr);
    let qpa = a.qp(qkey);
    // The stream that warms up goes to a QP with no receives posted, which drops it; the
    // one measured to another.
    let (sink, qpb) = (b.qp(qkey), b.qp(qkey));
    let (to_sink, to_qpb) = (a.to(&b, &sink, qkey), a.to(&b, &qpb, qkey));
    let (every, depth) = (16u64, 128u64);
    // Sends `n` (a multiple of `every`) to `to`; returns the send calls they took.
    let stream = |to, n: u64| {
        let before = ca.io_stats().send_calls;
        let (mut sent, mut done) = (0, 0);
        let start = Instant::now();
        while done < n {
            while sent < n && sent - done < depth {
                let flags = if sent % every == every - 1 { signaled() } else { SendFlags::default() };
                let sg_list = softrdma::sgl![mra.sge(0, 8).unwrap()];
                qpa.post_send(SendWr { wr_id: sent, op: SendOp::Send, sg_list, flags, ud: Some(to) })
                    .unwrap();
                sent += 1;
            }
            // One poll for up to 16 (perftest's batch), then back to posting.
            let mut wcs = [softrdma::EMPTY_WC; 16];
            let got = cqa.poll(&mut wcs);
            for wc in &wcs[..got] {
                assert_eq!(wc.status, WcStatus::Success);
                done += every;
            }
            assert!(start.elapsed() < Duration::from_secs(20), "{done} of {n} sends completed");
        }
        ca.io_stats().send_calls - before
    };
    let n = 512;
    let mut tries = Vec::new();
    for _ in 0..3 {
        for k in 0..n {
            qpb.post_recv(RecvWr {
                wr_id: k,
                sg_list: softrdma::sgl![mrb.sge(k as usize * 64, 64).unwrap()],
            })
            .unwrap();
        }
        // No empty polls before it: the stream alone must bring the progress thread to nap
        // for a busy poller (it looks at least every 20 ms, and an idle device's is woken by
        // the polls), the state in which posts wait.
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(50) {
            stream(to_sink, 256);
        }
        tries.push(stream(to_qpb, n));
        for k in 0..n {
            let wc = wait(cqb);
            assert_eq!((wc.wr_id, wc.status, wc.byte_len, wc.qp_num), (k, WcStatus::Success, 48, qpb.qpn()));
        }
    }
    eprintln!("send calls for {n} posts: {tries:?}");
    assert!(tries.iter().any(|&c| c <= n / 4), "send calls for {n} posts: {tries:?}");
}

#[test]
fn a_poller_whose_polls_always_find_completions_still_receives() {
    let _serial = serial();
    // A UD QP posts a signaled send and polls its CQ for one completion, again and again,
    // one completion always queued ahead: every poll finds one and runs no pass of its
    // own. Datagrams sent to it must
    // still be received: the progress thread, which naps for such a poller, runs a pass
    // for it at the end of each nap. A liveness test: it fails only if the datagrams are
    // never received (the loop's bound is 10 s; no timing asserted).
    let qkey = Qkey(0x3333_4444);
    let (a, b) = (UdEnd::new(36, 256, 64 * 64, Access::LOCAL_WRITE), UdEnd::new(37, 256, 64, Access::NONE));
    let (cqa, mra, cqb, mrb) = (&a.cq, &a.mr, &b.cq, &b.mr);
    let (qpa, qpb, sink) = (a.qp(qkey), b.qp(qkey), b.qp(qkey));
    let n = 16u64;
    for k in 0..n {
        qpa.post_recv(RecvWr {
            wr_id: 1000 + k,
            sg_list: softrdma::sgl![mra.sge(k as usize * 64, 64).unwrap()],
        })
        .unwrap();
    }
    let (to_sink, to_a) = (a.to(&b, &sink, qkey), b.to(&a, &qpa, qkey));
    // One completion stays queued ahead of each poll: a send posted before the loop, whose
    // completion each poll of one leaves in place of the one it takes.
    let sg_list = softrdma::sgl![mra.sge(0, 8).unwrap()];
    qpa.post_send(SendWr {
        wr_id: u64::MAX,
        op: SendOp::Send,
        sg_list,
        flags: signaled(),
        ud: Some(to_sink),
    })
    .unwrap();
    let start = Instant::now();
    let (mut received, mut sent_b, mut id) = (0, 0, 0u64);
    while received < n {
        assert!(start.elapsed() < Duration::from_secs(10), "{received} of {n} datagrams received");
        // The other side sends one datagram every few milliseconds (after the first 50,
        // in which the progress thread comes to nap for the poller).
        if start.elapsed() > Duration::from_millis(50 + 5 * sent_b) && sent_b < n {
            let sg_list = softrdma::sgl![mrb.sge(0, 8).unwrap()];
            qpb.post_send(SendWr {
                wr_id: sent_b,
                op: SendOp::Send,
                sg_list,
                flags: signaled(),
                ud: Some(to_a),
            })
            .unwrap();
            assert_eq!(wait(cqb).status, WcStatus::Success);
            sent_b += 1;
        }
        let sg_list = softrdma::sgl![mra.sge(0, 8).unwrap()];
        qpa.post_send(SendWr { wr_id: id, op: SendOp::Send, sg_list, flags: signaled(), ud: Some(to_sink) })
            .unwrap();
        id += 1;
        let mut wcs = [softrdma::EMPTY_WC; 1];
        let got = cqa.poll(&mut wcs);
        for wc in &wcs[..got] {
            assert_eq!(wc.status, WcStatus::Success);
            if wc.opcode == WcOpcode::Recv {
                assert_eq!(wc.wr_id, 1000 + received);
                received += 1;
            }
        }
    }
}

#[test]
fn a_burst_posted_before_the_poller_leaves_is_still_sent() {
    let _serial = serial();
    // The posting thread never polls again after its burst: the progress thread finds the
    // poller gone and sends what it left (no timing asserted; `wait` bounds it at 20 s).
    let (a, b) = pair(30, 31, Access::NONE);
    post_a_burst(&a, &b, 16, 8, false);
}

#[test]
fn a_pong_carries_its_pings_ack_in_one_datagram() {
    let _serial = serial();
    // A ping-pong of 64-byte SENDs: each side's QP talks back, so the ACK of a ping waits
    // for the pong and leaves in its datagram (a bundle, `softrdma_proto::wire::bundle`),
    // which the other side splits into the two packets.
    let (a, b) = pair(22, 23, Access::NONE);
    let rounds = 200;
    for k in 0..rounds {
        b.qp.post_recv(RecvWr { wr_id: k, sg_list: softrdma::sgl![b.mr.sge(0, 64).unwrap()] }).unwrap();
        a.qp.post_recv(RecvWr { wr_id: k, sg_list: softrdma::sgl![a.mr.sge(64, 64).unwrap()] }).unwrap();
        let send = |s: &Side| {
            s.qp.post_send(SendWr {
                wr_id: k,
                op: SendOp::Send,
                sg_list: softrdma::sgl![s.mr.sge(128, 64).unwrap()],
                flags: signaled(),
                ud: None,
            })
            .unwrap()
        };
        send(&a);
        let mut got = 0;
        while got < 2 {
            let wc = wait(&b.cq);
            assert_eq!((wc.wr_id, wc.status), (k, WcStatus::Success));
            if wc.opcode == WcOpcode::Recv {
                send(&b);
            }
            got += 1;
        }
        for _ in 0..2 {
            let wc = wait(&a.cq);
            assert_eq!((wc.wr_id, wc.status), (k, WcStatus::Success));
        }
    }
    let (ea, eb) = (a.ctx.endpoint_stats(), b.ctx.endpoint_stats());
    // Not every ACK makes it (one whose pong comes later than the ACK delay goes alone:
    // a debug build on a busy machine misses it often), but many do; without bundles the
    // count is 0. Each bundle is one datagram, and its two packets were both handled:
    // every message and every ACK arrived (the completions above), with fewer datagrams
    // than packets.
    assert!(ea.bundles >= rounds / 8, "{ea:?}");
    let ib = b.ctx.io_stats();
    assert!(
        ib.packets_sent < 2 * rounds,
        "b sent {} datagrams for {rounds} pongs and their ACKs",
        ib.packets_sent
    );
    assert_eq!((ea.icrc_errors, ea.malformed, eb.icrc_errors, eb.malformed), (0, 0, 0, 0));
}

#[test]
fn arming_a_cq_sends_what_a_burst_left_behind() {
    let _serial = serial();
    // A program that polled, posts a burst and then arms its CQ to wait for the event:
    // the arming itself sends what the burst left for the next poll (else it would wait
    // for the progress thread's next look, up to a millisecond).
    let (ca, cb) = (
        Context::open_port(IpAddr::from([127, 0, 0, 32]), 0).unwrap(),
        Context::open_port(IpAddr::from([127, 0, 0, 33]), 0).unwrap(),
    );
    let ch = ca.create_channel().unwrap();
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (cqa, cqb) = (ca.create_cq(64, Some(&ch)).unwrap(), cb.create_cq(256, None).unwrap());
    let (qa, qb) = (
        pa.prepare_qp(&QpBuilder::rc(), &cqa, &cqa).unwrap(),
        pb.prepare_qp(&QpBuilder::rc(), &cqb, &cqb).unwrap(),
    );
    let (mra, mrb) = (pa.register(64, Access::NONE).unwrap(), pb.register(64, Access::LOCAL_WRITE).unwrap());
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    let qa = qa.handshake(&eb, &ConnectOptions::default()).unwrap();
    let qb = qb.handshake(&ea, &ConnectOptions::default()).unwrap();
    let mut id = 0;
    // Tries until one burst's first post goes at once and the others wait. The others wait
    // only while the poller was seen within POLLER_GONE (100 µs), and the first post's send
    // can take longer than that on a VM (it wakes the peer's thread: 70–250 µs measured,
    // debug build and release alike), so that most tries find nothing to check.
    const TRIES: u64 = 2000;
    for attempt in 0..TRIES {
        // Busy-poll long enough for the progress thread to see it (it looks at least
        // every 20 ms, and an idle device's is woken by the polls) and nap, the state in
        // which posts may wait; after the first try it naps so already.
        let poll = Duration::from_millis(if attempt == 0 { 25 } else { 2 });
        let until = Instant::now() + poll;
        while Instant::now() < until {
            assert!(cqa.poll_one().is_none());
        }
        for _ in 0..4 {
            qb.post_recv(RecvWr { wr_id: id, sg_list: softrdma::sgl![mrb.sge(0, 8).unwrap()] }).unwrap();
            id += 1;
        }
        // One poll more right before the burst: a poller seen within POLLER_GONE (100 µs)
        // is what lets posts wait, and a debug build's receive posts above can take that.
        assert!(cqa.poll_one().is_none());
        // Made before the burst, so that the posts follow one another closely even in a
        // debug build (a post waits for company only within POST_BURST, 4 µs, of the last).
        let wrs: Vec<SendWr> = (0..4)
            .map(|k| {
                let flags = if k == 3 { signaled() } else { SendFlags::default() };
                let sg_list = softrdma::sgl![mra.sge(0, 8).unwrap()];
                SendWr { wr_id: id + k, op: SendOp::Send, sg_list, flags, ud: None }
            })
            .collect();
        let c0 = ca.io_stats().send_calls;
        for wr in wrs {
            qa.post_send(wr).unwrap();
        }
        let c1 = ca.io_stats().send_calls;
        cqa.req_notify(false).unwrap();
        let c2 = ca.io_stats().send_calls;
        for _ in 0..4 {
            assert_eq!(wait(&cqb).status, WcStatus::Success);
        }
        // The signaled completion. A burst that did not wait (a loaded machine) may have
        // been answered before the arming, and then no event is due (an armed CQ tells
        // of completions that come after): it is in the CQ already. One that comes later
        // raises the event.
        let wc = match cqa.poll_one() {
            Some(wc) => {
                // Came after the arming all the same: its event is signalled already.
                if ch.get_event_timeout(Duration::from_millis(10)).unwrap().is_some() {
                    ch.ack_events(1);
                }
                wc
            }
            None => {
                let cq =
                    ch.get_event_timeout(Duration::from_secs(20)).unwrap().expect("the completion's event");
                ch.ack_events(1);
                cq.poll_one().expect("the completion the event told of")
            }
        };
        assert_eq!(wc.wr_id, id + 3);
        id += 4;
        if c1 - c0 == 1 {
            // The first post went at once and the other three waited for company (nothing
            // sent them since): the arming sent them.
            assert!(c2 > c1, "send calls: {c0} before the burst, {c1} after it, {c2} after arming");
            return;
        }
    }
    panic!("no burst waited for company in {TRIES} tries");
}

#[test]
fn a_stream_of_writes_leaves_in_trains_that_span_its_messages() {
    let _serial = serial();
    // 16 KiB WRITEs of four full packets each. A WRITE's first packet carries a RETH that
    // its other packets lack; towards a softrdma peer they carry filler instead
    // (`softrdma_proto::wire::fill`), so that every packet has the same length and a GSO
    // train runs on from one message into the next. Unfilled, each message would be two
    // trains of two packets.
    let (a, b) = pair(24, 25, Access::REMOTE_WRITE);
    let (rkey, base) = (b.mr.rkey(), b.mr.addr());
    let write = |k: u64, at: u64, flags: SendFlags| SendWr {
        wr_id: k,
        op: SendOp::Write { remote_addr: base + at, rkey },
        sg_list: softrdma::sgl![a.mr.sge(at as usize, 16384).unwrap()],
        flags,
        ud: None,
    };
    // One WRITE first: the peer's ACK says that it takes filler off.
    a.qp.post_send(write(0, 0, signaled())).unwrap();
    assert_eq!(wait(&a.cq).status, WcStatus::Success);
    let mut pattern = vec![0u8; 1 << 20];
    for (i, v) in pattern.iter_mut().enumerate() {
        *v = (i * 31 / 7) as u8;
    }
    a.mr.write(0, &pattern).unwrap();
    let before = a.ctx.io_stats();
    for round in 0..4u64 {
        // Sixteen WRITEs in one post, the last signaled: sixty-four packets in one flush.
        let wrs: Vec<_> = (0..16u64)
            .map(|k| {
                let flags = if k == 15 { signaled() } else { SendFlags::default() };
                write(round * 16 + k, (round * 16 + k) * 16384, flags)
            })
            .collect();
        a.qp.post_send_many(wrs).unwrap();
        assert_eq!(wait(&a.cq).status, WcStatus::Success);
    }
    let after = a.ctx.io_stats();
    let (packets, trains) = (after.packets_sent - before.packets_sent, after.gso_trains - before.gso_trains);
    // Fewer trains than messages (a resend would only add packets).
    assert!(packets >= 64 * 4, "{packets} packets");
    assert!(trains > 0 && trains < 64, "{packets} packets in {trains} trains for 64 messages");
    let mut landed = vec![0u8; 1 << 20];
    b.mr.read(0, &mut landed).unwrap();
    assert!(landed == pattern, "the WRITEs landed byte for byte");
    let eb = b.ctx.endpoint_stats();
    assert_eq!((eb.icrc_errors, eb.malformed), (0, 0));
}

#[test]
fn a_burst_beside_a_spinning_progress_thread_is_always_sent() {
    let _serial = serial();
    // A program that posts in long runs and polls only between them (perftest's send loop)
    // may never poll often enough to make the progress thread step aside: on a machine
    // with cores to spare that thread spins on the link while ACKs flow, and posts used to
    // wait for company only beside a poller, so each went in a system call of its own, for
    // good: `ib_send_bw -s 2` on a 16-core machine ran at 0.18–0.43 M/s in three runs of
    // four, one packet per call, and at 1.25–2.19 M/s, 10 to 19 packets a call, with posts
    // waiting beside a spinning thread too (bench/NOTES.md). Here: a's progress thread has
    // just received b's SEND, so it spins, and a's thread, which never polls, posts 32
    // one-packet SENDs back to back. What is asserted is that a burst left beside a spin is
    // always sent: every message arrives, in order, and every completion comes. Whether the
    // spin and the burst meet is the scheduler's call on a two-vCPU machine, whose threads
    // wake up to 100 µs late: the send calls are printed, not asserted.
    let (a, b) = pair(48, 49, Access::NONE);
    let n = 32u64;
    let mut tries = Vec::new();
    for t in 0..10u64 {
        a.qp.post_recv(RecvWr { wr_id: t, sg_list: softrdma::sgl![a.mr.sge(0, 64).unwrap()] }).unwrap();
        for k in 0..n {
            b.qp.post_recv(RecvWr { wr_id: k, sg_list: softrdma::sgl![b.mr.sge(0, 64).unwrap()] }).unwrap();
        }
        // A calm moment, so that the progress threads' look at the machine's load finds a
        // core free for a spin (see `tests/progress_crowded.rs`); then b's SEND, which a's
        // progress thread receives, and spins after; meanwhile this thread polls nothing
        // of a's (a poller would make that thread step aside instead).
        std::thread::sleep(Duration::from_millis(15));
        let received = a.ctx.io_stats().packets_received;
        let sg_list = softrdma::sgl![b.mr.sge(64, 8).unwrap()];
        b.qp.post_send(SendWr { wr_id: 100, op: SendOp::Send, sg_list, flags: signaled(), ud: None })
            .unwrap();
        // Until a's progress thread has received it (its counters are atomics: reading them
        // polls nothing).
        let since = Instant::now();
        while a.ctx.io_stats().packets_received == received {
            assert!(since.elapsed() < Duration::from_secs(5), "b's SEND never reached a");
            std::hint::spin_loop();
        }
        let before = a.ctx.io_stats().send_calls;
        for k in 0..n {
            let flags = if k + 1 == n { signaled() } else { SendFlags::default() };
            let sg_list = softrdma::sgl![a.mr.sge(64, 8).unwrap()];
            a.qp.post_send(SendWr { wr_id: k, op: SendOp::Send, sg_list, flags, ud: None }).unwrap();
        }
        // b's CQ: its SEND's completion, somewhere, and the 32 receives in order.
        let got: Vec<u64> = (0..=n).map(|_| wait(&b.cq).wr_id).collect();
        assert_eq!(got.iter().filter(|&&w| w == 100).count(), 1, "{got:?}");
        assert_eq!(got.into_iter().filter(|&w| w != 100).collect::<Vec<_>>(), (0..n).collect::<Vec<_>>());
        tries.push(a.ctx.io_stats().send_calls - before);
    }
    // a's completions, polled only now: each try's RECV of b's SEND, and its burst's last.
    let mut ids: Vec<u64> = (0..2 * tries.len()).map(|_| wait(&a.cq).wr_id).collect();
    ids.sort();
    let mut want: Vec<u64> = (0..tries.len() as u64).chain(std::iter::repeat_n(n - 1, tries.len())).collect();
    want.sort();
    assert_eq!(ids, want);
    eprintln!(
        "send calls for {n} posts beside a spinning progress thread: {tries:?}; {:?}",
        a.ctx.io_stats()
    );
}
