//! Two devices in one process, on 127.0.0.2 and 127.0.0.3, over real UDP sockets.

use std::future::Future;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use softrdma::{
    Access, ConnectOptions, Context, QpBuilder, RecvWr, SendFlags, SendOp, SendWr, WcOpcode, WcStatus,
};

mod two_sides;
use two_sides::{ctx, pair, signaled, wait};

#[test]
fn send_recv_many_sizes() {
    let (a, b) = pair(2, 3, Access::NONE);
    for (i, len) in [0usize, 1, 1023, 1024, 1025, 4096, 100_000].into_iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|k| (k * 31 + i) as u8).collect();
        a.mr.write(0, &data).unwrap();
        b.qp.post_recv(RecvWr { wr_id: i as u64, sg_list: softrdma::sgl![b.mr.sge(0, 200_000).unwrap()] })
            .unwrap();
        a.qp.post_send(SendWr {
            wr_id: 100 + i as u64,
            op: SendOp::SendWithImm(i as u32),
            sg_list: softrdma::sgl![a.mr.sge(0, len).unwrap()],
            flags: signaled(),
            ud: None,
        })
        .unwrap();
        let s = wait(&a.cq);
        let r = wait(&b.cq);
        assert_eq!((s.wr_id, s.status), (100 + i as u64, WcStatus::Success));
        assert_eq!(
            (r.wr_id, r.status, r.byte_len as usize, r.imm_data),
            (i as u64, WcStatus::Success, len, Some(i as u32))
        );
        let mut got = vec![0u8; len];
        b.mr.read(0, &mut got).unwrap();
        assert_eq!(got, data, "{len} bytes");
    }
}

#[test]
fn one_sided_operations_need_nothing_from_the_passive_side() {
    let (a, b) = pair(4, 5, Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC);
    // From here on, `b` makes no verbs call: its progress thread does the work.
    let remote = b.mr.remote();
    let data: Vec<u8> = (0..300_000).map(|k| (k % 253) as u8).collect();
    a.mr.write(0, &data[..200_000]).unwrap();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write { remote_addr: remote.addr + 1000, rkey: softrdma::Rkey(remote.rkey) },
        sg_list: softrdma::sgl![a.mr.sge(0, 200_000).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    assert_eq!(wait(&a.cq).status, WcStatus::Success);
    a.qp.post_send(SendWr {
        wr_id: 2,
        op: SendOp::Read { remote_addr: remote.addr + 1000, rkey: softrdma::Rkey(remote.rkey) },
        sg_list: softrdma::sgl![a.mr.sge(500_000, 200_000).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    let wc = wait(&a.cq);
    assert_eq!((wc.status, wc.opcode, wc.byte_len), (WcStatus::Success, WcOpcode::RdmaRead, 200_000));
    let mut back = vec![0u8; 200_000];
    a.mr.read(500_000, &mut back).unwrap();
    assert_eq!(back, data[..200_000]);
    for k in 0..10u64 {
        a.qp.post_send(SendWr {
            wr_id: 10 + k,
            op: SendOp::FetchAdd { remote_addr: remote.addr + 8, rkey: softrdma::Rkey(remote.rkey), add: 5 },
            sg_list: softrdma::sgl![a.mr.sge(800_000 + 8 * k as usize, 8).unwrap()],
            flags: signaled(),
            ud: None,
        })
        .unwrap();
    }
    for _ in 0..10 {
        assert_eq!(wait(&a.cq).status, WcStatus::Success);
    }
    let mut word = [0u8; 8];
    b.mr.read(8, &mut word).unwrap();
    assert_eq!(u64::from_ne_bytes(word), 50);
    let mut got = vec![0u8; 200_000];
    b.mr.read(1000, &mut got).unwrap();
    assert_eq!(got, data[..200_000]);
    drop(b.ctx);
}

#[test]
fn bad_rkey_is_an_error_completion_not_a_crash() {
    let (a, b) = pair(6, 7, Access::REMOTE_WRITE);
    let remote = b.mr.remote();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write { remote_addr: remote.addr, rkey: softrdma::Rkey(remote.rkey ^ 1) },
        sg_list: softrdma::sgl![a.mr.sge(0, 64).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    assert_eq!(wait(&a.cq).status, WcStatus::RemAccessErr);
}

#[test]
fn address_in_use_is_a_clear_error() {
    let c = ctx(8);
    let port = c.local_addr().port();
    // The same address and port in this process is shared, not an error...
    let again = Context::open_port(IpAddr::from([127, 0, 0, 8]), port).unwrap();
    assert_eq!(again.local_addr(), c.local_addr());
    // ...but a socket of someone else on it is.
    let other = std::net::UdpSocket::bind("127.0.0.9:0").unwrap();
    let port = other.local_addr().unwrap().port();
    let err = Context::open_port(IpAddr::from([127, 0, 0, 9]), port).unwrap_err();
    assert!(matches!(err, softrdma::Error::AddressInUse { .. }));
    assert!(err.to_string().contains("127.0.0.2"), "the message says how to choose another address: {err}");
}

#[test]
fn reopening_while_another_thread_closes_waits_for_the_close() {
    // Two threads open and drop the same address and port over and over, as two tests
    // of one program do: when one drops the last handle, its socket closes a moment
    // later (the progress thread is joined first), and the other's open must wait for
    // that rather than fail with "already in use".
    let addr = IpAddr::from([127, 0, 0, 10]);
    let port = Context::open_port(addr, 0).unwrap().local_addr().port();
    let churn = move || {
        for i in 0..300 {
            let c = Context::open_port(addr, port).unwrap_or_else(|e| panic!("open {i}: {e}"));
            let _pd = c.alloc_pd();
        }
    };
    // A third thread opens and closes another address meanwhile: its opens tidy the table
    // of this process's contexts, which must not forget a context still closing.
    let other_addr = IpAddr::from([127, 0, 0, 11]);
    let other = move || {
        for _ in 0..600 {
            let _ = Context::open_port(other_addr, 0).unwrap();
        }
    };
    let t = std::thread::spawn(churn);
    let o = std::thread::spawn(other);
    churn();
    t.join().unwrap();
    o.join().unwrap();
    // Once the context is closed, a port taken by someone else is still an error, soon.
    let other = std::net::UdpSocket::bind((addr, port)).unwrap();
    let t0 = std::time::Instant::now();
    let err = Context::open_port(addr, port).unwrap_err();
    assert!(matches!(err, softrdma::Error::AddressInUse { .. }), "{err}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(3), "{:?}", t0.elapsed());
    drop(other);
}

/// A minimal executor: runs a future on this thread, parking until it is woken.
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        assert!(Instant::now() < deadline, "future never completed");
        std::thread::park_timeout(Duration::from_millis(100));
    }
}

#[test]
fn awaitable_completions_and_cancellation() {
    let (a, b) = pair(10, 11, Access::NONE);
    // A future polled once (so its waker is registered) and then dropped loses nothing.
    {
        let mut early = std::pin::pin!(b.cq.next());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(early.as_mut().poll(&mut cx).is_pending());
    }
    b.qp.post_recv(RecvWr { wr_id: 5, sg_list: softrdma::sgl![b.mr.sge(0, 100).unwrap()] }).unwrap();
    a.mr.write(0, b"hello, async").unwrap();
    a.qp.post_send(SendWr {
        wr_id: 6,
        op: SendOp::Send,
        sg_list: softrdma::sgl![a.mr.sge(0, 12).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    let r = block_on(b.cq.next());
    assert_eq!((r.wr_id, r.status, r.byte_len), (5, WcStatus::Success, 12));
    let s = block_on(a.cq.next());
    assert_eq!((s.wr_id, s.status), (6, WcStatus::Success));
    let mut got = [0u8; 12];
    b.mr.read(0, &mut got).unwrap();
    assert_eq!(&got, b"hello, async");
}

#[test]
fn event_mode_wakes_on_the_completion_channel() {
    let (ca, cb) = (ctx(12), ctx(13));
    let ch = cb.create_channel().unwrap();
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let cqa = ca.create_cq(8, None).unwrap();
    let cqb = cb.create_cq(8, Some(&ch)).unwrap();
    let qa = pa.prepare_qp(&QpBuilder::rc(), &cqa, &cqa).unwrap();
    let qb = pb.prepare_qp(&QpBuilder::rc(), &cqb, &cqb).unwrap();
    let mrb = pb.register(64, Access::LOCAL_WRITE).unwrap();
    qb.post_recv(RecvWr { wr_id: 1, sg_list: softrdma::sgl![mrb.sge(0, 64).unwrap()] }).unwrap();
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    let qa = qa.handshake(&eb, &ConnectOptions::default()).unwrap();
    let _qb = qb.handshake(&ea, &ConnectOptions::default()).unwrap();
    cqb.req_notify(false).unwrap();
    assert!(ch.try_get_event().is_none());
    let mra = pa.register(8, Access::NONE).unwrap();
    qa.post_send(SendWr {
        wr_id: 2,
        op: SendOp::Send,
        sg_list: softrdma::sgl![mra.sge(0, 8).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    // Blocks in poll(2) on the channel's fd until the progress thread delivers.
    let cq = ch.get_event().unwrap();
    assert_eq!(cq.id(), cqb.id());
    assert_eq!(ch.unacked_events(), 1, "an event returned and not acknowledged");
    ch.ack_events(1);
    assert_eq!(ch.unacked_events(), 0, "the event acknowledged");
    assert_eq!(cqb.poll_one().map(|w| w.wr_id), Some(1));
    // Disarmed after one event: more completions bring no event without another
    // req_notify; after one, the next does. Two SENDs, and the sender's completion of the
    // second proves the first's receive completion was delivered (the receiver handled the
    // second SEND after delivering the first), without polling it (which would hide an event).
    let send = |id| send8(&qa, &mra, id);
    for id in [3, 4, 41] {
        qb_recv(&_qb, &mrb, id);
    }
    assert_eq!(wait(&cqa).wr_id, 2);
    send(5);
    assert_eq!(wait(&cqa).wr_id, 5);
    send(55);
    assert_eq!(wait(&cqa).wr_id, 55);
    assert!(ch.try_get_event().is_none(), "an event without req_notify");
    assert_eq!(wait(&cqb).wr_id, 3);
    assert_eq!(wait(&cqb).wr_id, 4);
    cqb.req_notify(false).unwrap();
    send(6);
    let cq = ch.get_event_timeout(Duration::from_secs(20)).unwrap().expect("an event after req_notify");
    assert_eq!(cq.id(), cqb.id());
    ch.ack_events(1);
    assert_eq!(cqb.poll_one().map(|w| w.wr_id), Some(41));
}

/// A signaled 8-byte SEND from the start of `mr`.
fn send8(qp: &softrdma::QueuePair, mr: &softrdma::MemoryRegion, id: u64) {
    let sg_list = softrdma::sgl![mr.sge(0, 8).unwrap()];
    qp.post_send(SendWr { wr_id: id, op: SendOp::Send, sg_list, flags: signaled(), ud: None }).unwrap();
}

/// An RC pair between `pa` and `pb`, each QP completing on its CQ (`b` builds `pb`'s QP:
/// with an SRQ, say), connected.
fn connect_rc(
    (pa, cqa): (&softrdma::ProtectionDomain, &softrdma::CompletionQueue),
    (pb, cqb): (&softrdma::ProtectionDomain, &softrdma::CompletionQueue),
    b: &QpBuilder,
) -> (softrdma::QueuePair, softrdma::QueuePair) {
    let qa = pa.prepare_qp(&QpBuilder::rc(), cqa, cqa).unwrap();
    let qb = pb.prepare_qp(b, cqb, cqb).unwrap();
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    (
        qa.handshake(&eb, &ConnectOptions::default()).unwrap(),
        qb.handshake(&ea, &ConnectOptions::default()).unwrap(),
    )
}

/// The CQ named by the device's next `CqError` event, other events skipped; fails after 20 s.
fn next_cq_error(ctx: &Context) -> u32 {
    let start = Instant::now();
    loop {
        match ctx.poll_async_event() {
            Some(softrdma::AsyncEvent::CqError { cq }) => return cq,
            Some(_) => {}
            None => {
                assert!(start.elapsed() < Duration::from_secs(20), "no CQ error event");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

fn qb_recv(qp: &softrdma::QueuePair, mr: &softrdma::MemoryRegion, id: u64) {
    qp.post_recv(RecvWr { wr_id: id, sg_list: softrdma::sgl![mr.sge(0, 64).unwrap()] }).unwrap();
}

#[test]
fn a_solicited_only_cq_fires_for_the_solicited_message_of_a_burst_and_not_before() {
    let (ca, cb) = (ctx(26), ctx(27));
    let ch = cb.create_channel().unwrap();
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let cqa = ca.create_cq(16, None).unwrap();
    let cqb = cb.create_cq(16, Some(&ch)).unwrap();
    let (qa, qb) = connect_rc((&pa, &cqa), (&pb, &cqb), &QpBuilder::rc());
    let mrb = pb.register(64, Access::LOCAL_WRITE).unwrap();
    for id in 1..=6 {
        qb_recv(&qb, &mrb, id);
    }
    let mra = pa.register(8, Access::NONE).unwrap();
    let wr = |id, solicited| SendWr {
        wr_id: id,
        op: SendOp::Send,
        sg_list: softrdma::sgl![mra.sge(0, 8).unwrap()],
        flags: SendFlags { signaled: true, solicited, ..Default::default() },
        ud: None,
    };
    cqb.req_notify(true).unwrap();
    // Two unsolicited SENDs, one at a time: the second's completion at the sender proves
    // the first was received and delivered (the receiver handled the second later).
    for id in [1, 2] {
        qa.post_send(wr(id, false)).unwrap();
        assert_eq!(wait(&cqa).wr_id, id);
    }
    assert!(ch.try_get_event().is_none(), "a solicited-only CQ fired for an unsolicited completion");
    // A burst posted in one call leaves in one train and is delivered in one pass: the
    // solicited message, neither its first nor its last, fires the event.
    assert_eq!(qa.post_send_many([3, 4, 5, 6].map(|id| wr(id, id == 5))).ok(), Some(4));
    let cq = ch.get_event_timeout(Duration::from_secs(20)).unwrap().expect("an event for the solicited SEND");
    assert_eq!(cq.id(), cqb.id());
    ch.ack_events(1);
    let got: Vec<u64> = (0..6).map(|_| wait(&cqb)).map(|w| w.wr_id).collect();
    assert_eq!(got, [1, 2, 3, 4, 5, 6]);
}

#[test]
fn a_timestamped_cq_stamps_each_completion_when_it_is_delivered() {
    let (ca, cb) = (ctx(28), ctx(29));
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let cqa = ca.create_cq(16, None).unwrap();
    let cqb = cb.create_cq_with(16, None, softrdma::CqOptions::timestamped()).unwrap();
    assert!(cqb.has_timestamps() && !cqa.has_timestamps());
    let (qa, qb) = connect_rc((&pa, &cqa), (&pb, &cqb), &QpBuilder::rc());
    let mrb = pb.register(64, Access::LOCAL_WRITE).unwrap();
    let mra = pa.register(8, Access::NONE).unwrap();
    let mut stamps = Vec::new();
    for id in 1..=3 {
        qb_recv(&qb, &mrb, id);
        let before = softrdma::completion_clock_ns();
        send8(&qa, &mra, id);
        assert_eq!(wait(&cqa).wr_id, id);
        // Polled only through `poll_timestamped`, which must drive the engine itself.
        let (mut wc, mut ts) = ([softrdma::EMPTY_WC; 4], [0u64; 4]);
        let deadline = Instant::now() + Duration::from_secs(20);
        let n = loop {
            match cqb.poll_timestamped(&mut wc, &mut ts) {
                0 if Instant::now() < deadline => continue,
                n => break n,
            }
        };
        let after = softrdma::completion_clock_ns();
        assert_eq!((n, wc[0].wr_id), (1, id));
        assert!((before..=after).contains(&ts[0]), "stamp {} outside {before}..={after}", ts[0]);
        stamps.push(ts[0]);
    }
    assert!(stamps.windows(2).all(|w| w[0] < w[1]), "{stamps:?}");
    // A CQ without timestamps reports zero for each completion.
    qb_recv(&qb, &mrb, 9);
    send8(&qa, &mra, 9);
    let (mut wc, mut ts) = ([softrdma::EMPTY_WC; 1], [7u64; 1]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while cqa.poll_timestamped(&mut wc, &mut ts) == 0 && Instant::now() < deadline {}
    assert_eq!((wc[0].wr_id, wc[0].opcode, ts[0]), (9, WcOpcode::Send, 0));
}

#[test]
fn an_event_whose_completions_were_polled_is_skipped_and_the_cq_stays_armed() {
    let (ca, cb) = (ctx(14), ctx(15));
    let ch = cb.create_channel().unwrap();
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let cqa = ca.create_cq(8, None).unwrap();
    let cqb = cb.create_cq(8, Some(&ch)).unwrap();
    let qa = pa.prepare_qp(&QpBuilder::rc(), &cqa, &cqa).unwrap();
    let qb = pb.prepare_qp(&QpBuilder::rc(), &cqb, &cqb).unwrap();
    let mrb = pb.register(64, Access::LOCAL_WRITE).unwrap();
    for id in [1, 2] {
        qb.post_recv(RecvWr { wr_id: id, sg_list: softrdma::sgl![mrb.sge(0, 64).unwrap()] }).unwrap();
    }
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    let qa = qa.handshake(&eb, &ConnectOptions::default()).unwrap();
    let _qb = qb.handshake(&ea, &ConnectOptions::default()).unwrap();
    let mra = pa.register(8, Access::NONE).unwrap();
    let send = |id| send8(&qa, &mra, id);
    // Arm, then poll the completion that fires the event before reading the event.
    cqb.req_notify(false).unwrap();
    send(10);
    assert_eq!(wait(&cqb).wr_id, 1);
    // The event is there (the fd says so) but leads to nothing: it is not returned.
    assert!(ch.try_get_event().is_none(), "an event for an already polled completion");
    // The CQ is still armed, as the program left it: the next completion fires.
    send(11);
    let cq = ch.get_event_timeout(Duration::from_secs(20)).unwrap().expect("event after re-arming");
    assert_eq!(cq.id(), cqb.id());
    assert_eq!(cqb.poll_one().map(|w| w.wr_id), Some(2));
}

#[test]
fn devices_are_listed_and_loopback_addresses_open() {
    let devs = softrdma::devices().unwrap();
    let lo = devs.iter().find(|d| d.addr == IpAddr::from([127, 0, 0, 1])).expect("loopback device");
    assert_eq!(lo.name, "srdma_lo");
    assert!(lo.up);
    assert_eq!(softrdma::addr_of_gid(lo.gid()), lo.addr);
    assert_eq!(lo.gid()[10..12], [0xFF, 0xFF]);
    // One device per interface: lo's addresses are GIDs of srdma_lo, not devices.
    assert_eq!(devs.iter().filter(|d| d.netdev == "lo").count(), 1);
    assert_eq!(lo.gids[0].addr, lo.addr);
    assert!(lo.gids.iter().all(|g| softrdma::addr_of_gid(g.gid) == g.addr));
    assert_eq!(lo.port_attr().gid_tbl_len as usize, lo.gids.len());
    // An address lo routes but does not list joins its GID table, and is what opens.
    let d = softrdma::find_device("127.0.0.77").unwrap();
    assert_eq!((d.name.as_str(), d.netdev.as_str()), ("srdma_lo", "lo"));
    assert_eq!(d.gids[d.gid_index as usize].addr, IpAddr::from([127, 0, 0, 77]));
    assert_eq!(d.addr, IpAddr::from([127, 0, 0, 77]));
    let ctx = Context::open_port(IpAddr::from([127, 0, 0, 77]), 0).unwrap();
    assert_eq!(ctx.local_addr().ip(), IpAddr::from([127, 0, 0, 77]));
    assert_eq!(ctx.query_gid(d.gid_index), Some(softrdma::gid_of(d.addr)));
    // By name and GID index.
    let v4 = Context::open_gid("srdma_lo", 0, 0).unwrap();
    assert_eq!(v4.local_addr().ip(), IpAddr::from([127, 0, 0, 1]));
    assert!(Context::open_gid("srdma_lo", 999, 0).is_err());
    assert!(matches!(softrdma::find_device("198.51.100.7"), Err(softrdma::Error::NoSuchDevice(_))));
    assert!(matches!(softrdma::find_device("srdma_nope"), Err(softrdma::Error::UnknownDevice(_))));
}

#[test]
fn raw_registration_and_cq_overrun() {
    let (a, b) = pair(14, 15, Access::REMOTE_WRITE);
    // A caller-owned buffer registered with register_raw receives an RDMA WRITE.
    let mut backing = vec![0u64; 512].into_boxed_slice();
    let ptr = backing.as_mut_ptr() as *mut u8;
    let pd = b.qp.pd().clone();
    // SAFETY: `backing` outlives `raw` and is only touched through `ptr` while registered.
    let raw = unsafe { pd.register_raw(ptr, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE) }.unwrap();
    assert_eq!(raw.addr(), ptr as u64);
    a.mr.write(0, &[0xAB; 4096]).unwrap();
    let rkey = raw.rkey();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write { remote_addr: raw.addr() + 100, rkey },
        sg_list: softrdma::sgl![a.mr.sge(0, 3000).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    assert_eq!(wait(&a.cq).status, WcStatus::Success);
    let mut got = vec![0u8; 4096];
    raw.read(0, &mut got).unwrap();
    assert!(
        got[..100].iter().all(|&x| x == 0)
            && got[100..3100].iter().all(|&x| x == 0xAB)
            && got[3100..].iter().all(|&x| x == 0)
    );
    drop(raw);
    drop(backing);

    // A CQ of 2 entries receiving 5 completions: an async error, nothing lost.
    let (ca, cb) = (ctx(16), ctx(17));
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let cqa = ca.create_cq(64, None).unwrap();
    let small = cb.create_cq(2, None).unwrap();
    let mr = pb.register(64, Access::LOCAL_WRITE).unwrap();
    let (qa, qb) = connect_rc((&pa, &cqa), (&pb, &small), &QpBuilder::rc());
    for i in 0..5 {
        qb_recv(&qb, &mr, i);
    }
    let src = pa.register(8, Access::NONE).unwrap();
    for i in 0..5 {
        qa.post_send(SendWr {
            wr_id: i,
            op: SendOp::Send,
            sg_list: softrdma::sgl![src.sge(0, 8).unwrap()],
            flags: SendFlags::default(),
            ud: None,
        })
        .unwrap();
    }
    assert_eq!(next_cq_error(&cb), small.id());
    assert_eq!(qb.state(), softrdma::QpState::Error);
    // Every receive posted completes exactly once, in order: those that got their SEND
    // with success (at least the three that overran the CQ), the rest flushed.
    let mut all = vec![softrdma::EMPTY_WC; 16];
    let n = small.poll(&mut all);
    assert_eq!(n, 5, "completions past the CQ's size are kept, not dropped: {:?}", &all[..n]);
    assert_eq!(all[..5].iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    let ok = all[..5].iter().take_while(|w| w.status == WcStatus::Success).count();
    assert!(ok >= 3, "{:?}", &all[..5]);
    assert!(all[ok..5].iter().all(|w| w.status == WcStatus::WrFlushErr), "{:?}", &all[..5]);
    // A QP without an SRQ has no last WQE to report.
    while let Some(ev) = cb.poll_async_event() {
        assert!(
            !matches!(ev, softrdma::AsyncEvent::QpLastWqeReached { .. }),
            "{ev:?} for a QP without an SRQ"
        );
    }
}

#[test]
fn a_send_cq_overrun_raises_its_error_and_keeps_every_completion() {
    let (ca, cb) = (ctx(32), ctx(33));
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let small = ca.create_cq(2, None).unwrap();
    let cqb = cb.create_cq(64, None).unwrap();
    let (qa, qb) = connect_rc((&pa, &small), (&pb, &cqb), &QpBuilder::rc());
    let mr = pb.register(64, Access::LOCAL_WRITE).unwrap();
    for i in 0..5 {
        qb_recv(&qb, &mr, i);
    }
    let src = pa.register(8, Access::NONE).unwrap();
    for i in 0..5 {
        send8(&qa, &src, i);
    }
    assert_eq!(next_cq_error(&ca), small.id());
    assert_eq!(qa.state(), softrdma::QpState::Error);
    let mut all = vec![softrdma::EMPTY_WC; 16];
    let n = small.poll(&mut all);
    assert_eq!(all[..n].iter().map(|w| w.wr_id).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
}

#[test]
fn a_cq_overrun_fails_a_qp_on_an_srq_with_its_last_wqe_event() {
    let (ca, cb) = (ctx(30), ctx(31));
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let cqa = ca.create_cq(64, None).unwrap();
    let small = cb.create_cq(2, None).unwrap();
    let srq = pb.create_srq(16, 1).unwrap();
    let mr = pb.register(64, Access::LOCAL_WRITE).unwrap();
    for i in 0..8 {
        srq.post_recv(RecvWr { wr_id: i, sg_list: softrdma::sgl![mr.sge(0, 64).unwrap()] }).unwrap();
    }
    let (qa, qb) = connect_rc((&pa, &cqa), (&pb, &small), &QpBuilder::rc().srq(&srq));
    let src = pa.register(8, Access::NONE).unwrap();
    for i in 0..5 {
        let sg_list = softrdma::sgl![src.sge(0, 8).unwrap()];
        qa.post_send(SendWr { wr_id: i, op: SendOp::Send, sg_list, flags: SendFlags::default(), ud: None })
            .unwrap();
    }
    // The CQ's error first, then the QP's last WQE (IBTA 11.6.3.1: a QP on an SRQ that
    // enters the error state reports it), each once.
    let mut events = Vec::new();
    let start = Instant::now();
    while !events.iter().any(|e| matches!(e, softrdma::AsyncEvent::QpLastWqeReached { .. })) {
        match cb.poll_async_event() {
            Some(ev) => events.push(ev),
            None => {
                assert!(start.elapsed() < Duration::from_secs(20), "events so far: {events:?}");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    std::thread::sleep(Duration::from_millis(50));
    events.extend(std::iter::from_fn(|| cb.poll_async_event()));
    // The device's own event from when it opened is not the QP's.
    events.retain(|e| *e != softrdma::AsyncEvent::PortActive);
    assert_eq!(
        events,
        [
            softrdma::AsyncEvent::CqError { cq: small.id() },
            softrdma::AsyncEvent::QpLastWqeReached { qpn: qb.qpn().get() }
        ]
    );
    assert_eq!(qb.state(), softrdma::QpState::Error);
}

#[test]
fn shared_receive_queue_across_two_qps() {
    let (ca, cb) = (ctx(18), ctx(19));
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (cqa, cqb) = (ca.create_cq(64, None).unwrap(), cb.create_cq(64, None).unwrap());
    let srq = pb.create_srq(16, 1).unwrap();
    let mr = pb.register(16 * 256, Access::LOCAL_WRITE).unwrap();
    for i in 0..4 {
        srq.post_recv(RecvWr { wr_id: i, sg_list: softrdma::sgl![mr.sge(256 * i as usize, 256).unwrap()] })
            .unwrap();
    }
    let src = pa.register(256, Access::NONE).unwrap();
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..2 {
        let qa = pa.prepare_qp(&QpBuilder::rc(), &cqa, &cqa).unwrap();
        let qb = pb.prepare_qp(&QpBuilder::rc().srq(&srq), &cqb, &cqb).unwrap();
        assert!(
            qb.post_recv(RecvWr { wr_id: 9, sg_list: softrdma::sgl![] }).is_err(),
            "a QP with an SRQ takes no receives"
        );
        let (ea, eb) = (qa.endpoint(), qb.endpoint());
        senders.push(qa.handshake(&eb, &ConnectOptions::default()).unwrap());
        receivers.push(qb.handshake(&ea, &ConnectOptions::default()).unwrap());
    }
    for (k, q) in senders.iter().enumerate() {
        for j in 0..2 {
            q.post_send(SendWr {
                wr_id: (10 * k + j) as u64,
                op: SendOp::SendWithImm(k as u32),
                sg_list: softrdma::sgl![src.sge(0, 100).unwrap()],
                flags: SendFlags::default(),
                ud: None,
            })
            .unwrap();
        }
    }
    let mut by_qp = [0, 0];
    for _ in 0..4 {
        let wc = wait(&cqb);
        assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 100));
        let k = wc.imm_data.unwrap() as usize;
        assert_eq!(wc.qp_num, receivers[k].qpn());
        by_qp[k] += 1;
    }
    assert_eq!(by_qp, [2, 2]);
    assert!(srq.is_empty());
}

#[test]
fn long_messages_travel_as_gso_and_gro_trains() {
    let (a, b) = pair(20, 21, Access::REMOTE_WRITE);
    let remote = b.mr.remote();
    let data: Vec<u8> = (0..1_000_000).map(|k| (k * 3 % 256) as u8).collect();
    a.mr.write(0, &data).unwrap();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write { remote_addr: remote.addr, rkey: softrdma::Rkey(remote.rkey) },
        sg_list: softrdma::sgl![a.mr.sge(0, 1_000_000).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    assert_eq!(wait(&a.cq).status, WcStatus::Success);
    let mut got = vec![0u8; 1_000_000];
    b.mr.read(0, &mut got).unwrap();
    assert_eq!(got, data);
    let (sa, sb) = (a.ctx.io_stats(), b.ctx.io_stats());
    assert!(sa.gso_trains > 0, "{sa:?}");
    assert!(sb.gro_trains > 0, "{sb:?}");
    assert!(sa.packets_sent >= 245 && sb.packets_received >= 245, "{sa:?} {sb:?}");
}

/// Whether `fd` is readable now.
fn readable(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) == 1 }
}

#[test]
fn the_channel_fd_is_readable_while_an_event_waits() {
    // Two CQs on one channel, each fired by a SEND to its own QP. The thread waiting on the
    // channel processes the arrivals itself and so delivers the events to itself, without
    // signalling the channel's eventfd; when it takes one of two, the fd must still say
    // that the other waits (a C program polls it before `ibv_get_cq_event`).
    use std::os::fd::AsRawFd;
    let (ca, cb) = (ctx(24), ctx(25));
    let ch = cb.create_channel().unwrap();
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let cqa = ca.create_cq(64, None).unwrap();
    let cqs = [cb.create_cq(64, Some(&ch)).unwrap(), cb.create_cq(64, Some(&ch)).unwrap()];
    let mra = pa.register(8, Access::NONE).unwrap();
    let mrb = pb.register(64, Access::LOCAL_WRITE).unwrap();
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for cq in &cqs {
        let qa = pa.prepare_qp(&QpBuilder::rc(), &cqa, &cqa).unwrap();
        let qb = pb.prepare_qp(&QpBuilder::rc(), cq, cq).unwrap();
        let (ea, eb) = (qa.endpoint(), qb.endpoint());
        senders.push(qa.handshake(&eb, &ConnectOptions::default()).unwrap());
        receivers.push(qb.handshake(&ea, &ConnectOptions::default()).unwrap());
    }
    let fd = ch.as_raw_fd();
    let mut both_at_once = 0;
    for round in 0..20u64 {
        for (q, cq) in receivers.iter().zip(&cqs) {
            qb_recv(q, &mrb, round);
            cq.req_notify(false).unwrap();
        }
        std::thread::scope(|s| {
            let waiter =
                s.spawn(|| ch.get_event_timeout(Duration::from_secs(20)).unwrap().expect("an event"));
            std::thread::sleep(Duration::from_millis(20));
            for q in &senders {
                send8(q, &mra, round);
            }
            let first = waiter.join().unwrap();
            // The second event may be arriving right now (the progress thread delivering
            // it): give the fd time to say so. An event the waiter queued without making
            // the fd readable (the fault this test guards) leaves it unreadable for good.
            let until = Instant::now() + Duration::from_millis(500);
            while !readable(fd) && Instant::now() < until {
                std::thread::yield_now();
            }
            let fd_says = readable(fd);
            let second = match ch.try_get_event() {
                Some(cq) => {
                    assert!(fd_says, "an event waited behind an fd that was not readable");
                    both_at_once += 1;
                    cq
                }
                None => {
                    // The second arrived after the waiter returned: its event comes the
                    // usual way, through the fd.
                    let until = Instant::now() + Duration::from_secs(20);
                    while !readable(fd) {
                        assert!(Instant::now() < until, "no second event");
                        std::thread::yield_now();
                    }
                    ch.try_get_event().expect("an event behind a readable fd")
                }
            };
            assert_ne!(first.id(), second.id());
            assert!(!readable(fd), "readable with no event waiting");
            ch.ack_events(2);
        });
        for cq in &cqs {
            assert_eq!(wait(cq).wr_id, round);
        }
        for _ in 0..2 {
            assert_eq!(wait(&cqa).wr_id, round);
        }
    }
    eprintln!("both events delivered in one pass: {both_at_once} of 20");
    // A thread that waited on the channel (delivering to itself) and later delivers an
    // event from an ordinary poll signals the fd as any thread does.
    qb_recv(&receivers[0], &mrb, 100);
    cqs[0].req_notify(false).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(20));
            send8(&senders[0], &mra, 100);
        });
        assert_eq!(ch.get_event_timeout(Duration::from_secs(20)).unwrap().map(|c| c.id()), Some(cqs[0].id()));
    });
    assert_eq!(wait(&cqs[0]).wr_id, 100);
    qb_recv(&receivers[0], &mrb, 101);
    cqs[0].req_notify(false).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(20));
            send8(&senders[0], &mra, 101);
        });
        let mut one = [softrdma::EMPTY_WC];
        let until = Instant::now() + Duration::from_secs(20);
        while cqs[0].poll(&mut one) == 0 {
            assert!(Instant::now() < until, "no completion");
        }
        assert_eq!(one[0].wr_id, 101);
    });
    assert!(readable(fd), "an event delivered by an ordinary poll left the fd unreadable");
    assert!(ch.try_get_event().is_none(), "its completion was polled already");
}

/// A device on 127.0.0.`last` with a CQ, a 64-byte region and an RC QP to connect.
fn one_qp(
    last: u8,
) -> (softrdma::Context, softrdma::CompletionQueue, softrdma::MemoryRegion, softrdma::PreparedQp) {
    let c = ctx(last);
    let pd = c.alloc_pd();
    let cq = c.create_cq(8, None).unwrap();
    let mr = pd.register(64, Access::LOCAL_WRITE).unwrap();
    let p = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
    (c, cq, mr, p)
}

/// The child process of `a_process_that_exits_at_once_still_acknowledges_its_last_message`.
fn exit_child(parent: &str) {
    use std::io::{BufRead, Write};
    let peer: softrdma::EndpointInfo = serde_json::from_str(parent).unwrap();
    let (_c, cq, mr, p) = one_qp(27);
    let me = p.endpoint();
    let qp = p.handshake(&peer, &ConnectOptions::default()).unwrap();
    println!("INFO {}", serde_json::to_string(&me).unwrap());
    std::io::stdout().flush().unwrap();
    let mut go = String::new();
    std::io::stdin().lock().read_line(&mut go).unwrap();
    // Busy-poll a while first, as a latency-bound program does: the device's progress
    // thread then leaves the link and the timers to this thread (see `Engine::run`), so
    // nothing but the exit itself can send the ACK held below.
    let until = Instant::now() + Duration::from_millis(20);
    while Instant::now() < until {
        assert!(cq.poll_one().is_none());
    }
    qb_recv(&qp, &mr, 1);
    send8(&qp, &mr, 2);
    // The pong: its ACK waits for company (this QP just sent the ping), and the process
    // exits at once, closing nothing.
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < until, "no pong");
        if let Some(wc) = cq.poll_one() {
            if wc.wr_id == 1 {
                assert_eq!(wc.status, WcStatus::Success);
                std::process::exit(0);
            }
        }
    }
}

#[test]
fn a_process_that_exits_at_once_still_acknowledges_its_last_message() {
    use std::io::{BufRead, BufReader, Write};
    if let Ok(parent) = std::env::var("SOFTRDMA_TEST_EXIT_CHILD") {
        exit_child(&parent);
        return;
    }
    let (_c, cq, mr, p) = one_qp(26);
    let me = p.endpoint();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_process_that_exits_at_once_still_acknowledges_its_last_message", "--nocapture"])
        .env("SOFTRDMA_TEST_EXIT_CHILD", serde_json::to_string(&me).unwrap())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let info =
        lines.find_map(|l| l.ok()?.strip_prefix("INFO ").map(str::to_owned)).expect("the child's endpoint");
    let peer: softrdma::EndpointInfo = serde_json::from_str(&info).unwrap();
    // A missing ACK fails the pong after five ACK timeouts of 67 ms (the child is gone,
    // no resend draws an answer); long enough that a busy machine's scheduling does not.
    let opts = ConnectOptions { timeout: 14, retry_cnt: 4, ..ConnectOptions::default() };
    let qp = p.handshake(&peer, &opts).unwrap();
    qb_recv(&qp, &mr, 1);
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert_eq!(wait(&cq).wr_id, 1, "the ping");
    send8(&qp, &mr, 2);
    let wc = wait(&cq);
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success), "the pong's ACK never came");
    let until = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("the child did not exit");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(status.success());
}

/// Receives one datagram on `s` (with `IP_RECVTOS` on) and returns the IP TOS byte it
/// arrived with.
fn recv_tos(s: &std::net::UdpSocket) -> u8 {
    catch(s).expect("a datagram").tos
}

/// A plain socket on 127.0.0.4 that reports each datagram's TOS byte (`IP_RECVTOS`), whose
/// receives give up after `timeout`.
fn tos_sink(timeout: Duration) -> std::net::UdpSocket {
    use std::os::fd::AsRawFd;
    let sink = std::net::UdpSocket::bind("127.0.0.4:0").unwrap();
    sink.set_read_timeout(Some(timeout)).unwrap();
    let on: libc::c_int = 1;
    // SAFETY: a pointer to a live c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            sink.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_RECVTOS,
            (&on as *const libc::c_int).cast(),
            4,
        )
    };
    assert_eq!(r, 0);
    sink
}

#[test]
fn datagrams_leave_with_the_tos_byte_their_address_vector_asks_for() {
    // A device's socket sends ECN-capable datagrams (ECT(0)), the bulk of its traffic, by
    // default, and any other TOS byte by asking for it datagram by datagram: a UD send
    // takes its address vector's traffic class as it is.
    let sink = tos_sink(Duration::from_secs(10));
    let c = ctx(5);
    let pd = c.alloc_pd();
    let cq = c.create_cq(16, None).unwrap();
    let mr = pd.register(64, Access::LOCAL_WRITE).unwrap();
    let qkey = softrdma::Qkey(0x1111);
    let qp = pd.prepare_qp(&QpBuilder::ud(qkey), &cq, &cq).unwrap().ready().unwrap();
    for (i, tos) in [0b10u8, 0, 0x28, 0x2A, 0b10, 0b01].into_iter().enumerate() {
        let attr = softrdma::AhAttr {
            traffic_class: tos,
            ..softrdma::AhAttr::to_socket(sink.local_addr().unwrap())
        };
        let to = pd.create_ah(&attr).unwrap().dest(softrdma::Qpn::new(0x12), qkey);
        qp.post_send(SendWr {
            wr_id: i as u64,
            op: SendOp::Send,
            sg_list: softrdma::sgl![mr.sge(0, 8).unwrap()],
            flags: signaled(),
            ud: Some(to),
        })
        .unwrap();
        assert_eq!(wait(&cq).status, WcStatus::Success);
        assert_eq!(recv_tos(&sink), tos, "send {i}: TOS {tos:#04x}");
    }
}

/// A datagram received with its source address and IP TOS byte.
struct Caught {
    bytes: Vec<u8>,
    src: std::net::SocketAddr,
    tos: u8,
}

/// Receives one datagram on `s` (with `IP_RECVTOS` on), or `None` after its read timeout.
fn catch(s: &std::net::UdpSocket) -> Option<Caught> {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 4096];
    let mut control = [0u64; 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: the header points at live buffers for the call; CMSG_* stay inside `control`;
    // the kernel fills `name` with a sockaddr_in for this IPv4 socket.
    unsafe {
        let mut name: libc::sockaddr_in = std::mem::zeroed();
        let mut h: libc::msghdr = std::mem::zeroed();
        h.msg_name = (&mut name as *mut libc::sockaddr_in).cast();
        h.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as _;
        h.msg_iov = &mut iov;
        h.msg_iovlen = 1;
        h.msg_control = control.as_mut_ptr().cast();
        h.msg_controllen = std::mem::size_of_val(&control) as _;
        let n = libc::recvmsg(s.as_raw_fd(), &mut h, 0);
        if n <= 0 {
            return None;
        }
        let mut tos = None;
        let mut c = libc::CMSG_FIRSTHDR(&h);
        while !c.is_null() {
            if (*c).cmsg_level == libc::IPPROTO_IP && (*c).cmsg_type == libc::IP_TOS {
                tos = Some(*libc::CMSG_DATA(c));
            }
            c = libc::CMSG_NXTHDR(&h, c);
        }
        let ip = std::net::Ipv4Addr::from(u32::from_be(name.sin_addr.s_addr));
        let src = std::net::SocketAddr::from((ip, u16::from_be(name.sin_port)));
        Some(Caught { bytes: buf[..n as usize].to_vec(), src, tos: tos.expect("no IP_TOS control message") })
    }
}

#[test]
fn rc_qps_send_from_udp_source_ports_of_their_own_and_ud_from_the_devices() {
    // RoCEv2's flow entropy (IBTA Annex A17.3.1): RC QPs of a device opened with 8 source
    // ports spread over them, each QP on one for all its packets, each packet's ICRC computed over the port
    // it leaves from, ECN-capable as from the device's socket; UD keeps the device's port,
    // which UD answers are addressed to.
    use softrdma::proto::wire::{icrc, Packet};
    use std::collections::{HashMap, HashSet};
    let sink = tos_sink(Duration::from_millis(500));
    let to = sink.local_addr().unwrap();
    let c = softrdma::Context::open_source_ports(IpAddr::from([127, 0, 0, 6]), 0, 1, 8).unwrap();
    let device = c.local_addr();
    let pd = c.alloc_pd();
    let cq = c.create_cq(64, None).unwrap();
    let mr = pd.register(64, Access::LOCAL_WRITE).unwrap();
    let mut qps = Vec::new();
    for i in 0..8u32 {
        let p = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
        let peer = softrdma::EndpointInfo { addr: to, qpn: 0x100 + i, psn: 0, mtu: 1024, region: None };
        let qp = p.handshake(&peer, &softrdma::ConnectOptions::default()).unwrap();
        send8(&qp, &mr, u64::from(i));
        qps.push(qp);
    }
    let qkey = softrdma::Qkey(0x1111);
    let ud = pd.prepare_qp(&QpBuilder::ud(qkey), &cq, &cq).unwrap().ready().unwrap();
    let dest = pd.create_ah(&softrdma::AhAttr::to_socket(to)).unwrap().dest(softrdma::Qpn::new(0x200), qkey);
    ud.post_send(SendWr {
        wr_id: 99,
        op: SendOp::Send,
        sg_list: softrdma::sgl![mr.sge(0, 8).unwrap()],
        flags: signaled(),
        ud: Some(dest),
    })
    .unwrap();
    // Every request, and the resends the missing ACKs draw, for a moment.
    let mut ports: HashMap<u32, HashSet<u16>> = HashMap::new();
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until || ports.len() < 9 {
        let Some(got) = catch(&sink) else { break };
        let p = Packet::new_checked(&got.bytes[..]).unwrap();
        assert!(icrc::verify(&icrc::Encap::new(got.src, to).unwrap(), &got.bytes), "ICRC over {}", got.src);
        let qpn = p.bth().dest_qp().get();
        assert_eq!(got.src.ip(), device.ip());
        if qpn != 0x200 {
            assert_eq!(got.tos, 0b10, "an RC request is ECN-capable, ECT(0)");
        }
        ports.entry(qpn).or_default().insert(got.src.port());
    }
    assert_eq!(ports.len(), 9, "a datagram from every QP: {ports:?}");
    assert_eq!(ports[&0x200], HashSet::from([device.port()]), "UD from the device's port");
    let rc: HashSet<u16> = (0..8).flat_map(|i| ports[&(0x100 + i)].iter().copied()).collect();
    for (i, qp) in (0..8).zip(&qps) {
        let mine = HashSet::from([qp.source_addr().port()]);
        assert_eq!(ports[&(0x100 + i)], mine, "QP {i} keeps the port it says it sends from");
    }
    assert_eq!(ud.source_addr(), device);
    assert!(!rc.contains(&device.port()), "RC from source ports, not the device's: {rc:?}");
    assert!(rc.len() >= 2, "eight QPs over eight ports share one: {rc:?}");
}
