//! Sharded devices over real sockets: several engines on one address and port, each with
//! its socket in one `SO_REUSEPORT` group, the kernel steering each datagram to the shard
//! its destination QPN names. Every operation lands on every shard, strays are handed
//! over when the kernel does not steer, and the CM, memory registrations and asynchronous
//! events reach QPs whatever their shard.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use softrdma::cm::{CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use softrdma::{
    Access, AsyncEvent, CompletionQueue, ConnectOptions, Context, MemoryRegion, QpBuilder, QpState,
    QueuePair, RecvWr, Rkey, SendFlags, SendOp, SendWr, WcStatus,
};

const SHARDS: usize = 4;
const WAIT: Duration = Duration::from_secs(20);

fn ip(a: u8, b: u8) -> IpAddr {
    IpAddr::from([127, 0, a, b])
}

fn all_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

fn signaled() -> SendFlags {
    SendFlags { signaled: true, ..Default::default() }
}

/// `n` connected RC QP pairs between `a` and `b`, on one CQ and one region per side.
struct Pairs {
    cqs: [CompletionQueue; 2],
    mrs: [MemoryRegion; 2],
    qps: Vec<[QueuePair; 2]>,
}

fn pairs(a: &Context, b: &Context, n: usize) -> Pairs {
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let cqs = [a.create_cq(1024, None).unwrap(), b.create_cq(1024, None).unwrap()];
    let mrs = [pa.register(1 << 20, all_access()).unwrap(), pb.register(1 << 20, all_access()).unwrap()];
    let mut qps = Vec::new();
    for _ in 0..n {
        let b_rc = QpBuilder::rc().access(all_access());
        let x = pa.prepare_qp(&b_rc, &cqs[0], &cqs[0]).unwrap();
        let y = pb.prepare_qp(&b_rc, &cqs[1], &cqs[1]).unwrap();
        let (ex, ey) = (x.endpoint(), y.endpoint());
        let o = ConnectOptions::default();
        qps.push([x.handshake(&ey, &o).unwrap(), y.handshake(&ex, &o).unwrap()]);
    }
    Pairs { cqs, mrs, qps }
}

fn wait(cq: &CompletionQueue) -> softrdma::WorkCompletion {
    cq.wait_one_timeout(WAIT).expect("a completion")
}

/// On every pair, in its own slice of both regions: a SEND of 3,000 bytes, a WRITE of 20,000,
/// a READ of them back and a FetchAdd; checks every byte and value.
fn exercise(p: &Pairs) {
    let [ca, cb] = &p.cqs;
    let [ma, mb] = &p.mrs;
    let slice = (1 << 20) / p.qps.len();
    for (k, [x, y]) in p.qps.iter().enumerate() {
        let at = k * slice;
        let data: Vec<u8> = (0..20_000).map(|i| (i * 7 + k * 13) as u8).collect();
        ma.write(at, &data).unwrap();
        // SEND a -> b.
        y.post_recv(RecvWr { wr_id: k as u64, sg_list: softrdma::sgl![mb.sge(at, 3000).unwrap()] }).unwrap();
        let sg_list = softrdma::sgl![ma.sge(at, 3000).unwrap()];
        x.post_send(SendWr { wr_id: 1, op: SendOp::Send, sg_list, flags: signaled(), ud: None }).unwrap();
        assert_eq!(wait(ca).status, WcStatus::Success);
        let wc = wait(cb);
        assert_eq!(
            (wc.status, wc.wr_id, wc.byte_len, wc.qp_num),
            (WcStatus::Success, k as u64, 3000, y.qpn())
        );
        // WRITE a -> b, then READ it back into a's region past it.
        let remote = mb.remote();
        let op = SendOp::Write { remote_addr: remote.addr + (at + 4096) as u64, rkey: Rkey(remote.rkey) };
        let sg_list = softrdma::sgl![ma.sge(at, 20_000).unwrap()];
        x.post_send(SendWr { wr_id: 2, op, sg_list, flags: signaled(), ud: None }).unwrap();
        assert_eq!(wait(ca).status, WcStatus::Success);
        let op = SendOp::Read { remote_addr: remote.addr + (at + 4096) as u64, rkey: Rkey(remote.rkey) };
        let sg_list = softrdma::sgl![ma.sge(at + 40_000, 20_000).unwrap()];
        x.post_send(SendWr { wr_id: 3, op, sg_list, flags: signaled(), ud: None }).unwrap();
        assert_eq!(wait(ca).status, WcStatus::Success);
        let mut back = vec![0; 20_000];
        ma.read(at + 40_000, &mut back).unwrap();
        assert!(back == data, "pair {k}: the READ brings back what the WRITE put");
        let mut sent = vec![0; 3000];
        mb.read(at, &mut sent).unwrap();
        assert!(sent[..] == data[..3000], "pair {k}: the SEND's bytes");
        // FetchAdd b -> a on a counter in a's slice.
        let ra = ma.remote();
        let op =
            SendOp::FetchAdd { remote_addr: ra.addr + (at + 64_000) as u64, rkey: Rkey(ra.rkey), add: 5 };
        let sg_list = softrdma::sgl![mb.sge(at + 64_008, 8).unwrap()];
        y.post_send(SendWr { wr_id: 4, op, sg_list, flags: signaled(), ud: None }).unwrap();
        assert_eq!(wait(cb).status, WcStatus::Success);
        let mut v = [0u8; 8];
        ma.read(at + 64_000, &mut v).unwrap();
        assert_eq!(u64::from_ne_bytes(v), 5);
    }
}

/// Each shard of `ctx` received some packets.
fn every_shard_received(ctx: &Context) -> bool {
    ctx.shard_io_stats().iter().all(|s| s.packets_received > 0)
}

#[test]
fn qps_spread_over_the_shards_and_every_operation_lands() {
    let a = Context::open_sharded(ip(7, 2), 0, SHARDS).unwrap();
    let b = Context::open_sharded(ip(7, 3), 0, SHARDS).unwrap();
    assert_eq!(a.shard_io_stats().len(), SHARDS);
    let p = pairs(&a, &b, 2 * SHARDS);
    let mut low_bits: Vec<u32> = p.qps.iter().map(|[x, _]| x.qpn().get() % SHARDS as u32).collect();
    low_bits.sort_unstable();
    low_bits.dedup();
    assert_eq!(low_bits, (0..SHARDS as u32).collect::<Vec<_>>(), "QPs in turn over the shards");
    // Each shard sends from a UDP source port of its own (RoCEv2's flow entropy), which its
    // QPs share; answers come to the device's port.
    for (side, c) in [&a, &b].into_iter().enumerate() {
        let mut by_shard = std::collections::BTreeMap::new();
        for pair in &p.qps {
            let qp = &pair[side];
            let port = qp.source_addr().port();
            assert_eq!(qp.source_addr().ip(), c.local_addr().ip());
            assert_ne!(port, c.local_addr().port(), "a shard's QPs send from its source port");
            let shard = qp.qpn().get() % SHARDS as u32;
            assert_eq!(*by_shard.entry(shard).or_insert(port), port, "one port per shard");
        }
        let mut ports: Vec<u16> = by_shard.values().copied().collect();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), SHARDS, "a port per shard: {by_shard:?}");
    }
    exercise(&p);
    for c in [&a, &b] {
        assert!(every_shard_received(c), "{:?}", c.shard_io_stats());
        assert_eq!(c.io_stats().strays, 0, "the kernel steered every datagram to its shard");
    }
}

#[test]
fn without_steering_the_shards_hand_each_other_their_datagrams() {
    let a = Context::open_sharded_unsteered(ip(7, 4), 0, SHARDS).unwrap();
    let b = Context::open_sharded_unsteered(ip(7, 5), 0, SHARDS).unwrap();
    let p = pairs(&a, &b, 2 * SHARDS);
    exercise(&p);
    // The kernel's hash puts every datagram from one peer on one socket: 3 in 4 QPs' are
    // strays there.
    let strays = a.io_stats().strays + b.io_stats().strays;
    assert!(strays > 0, "no datagram handed over");
}

#[test]
fn a_sharded_device_and_a_plain_one_talk() {
    let a = Context::open_sharded(ip(7, 6), 0, SHARDS).unwrap();
    let b = Context::open_port(ip(7, 7), 0).unwrap();
    assert_eq!(b.shard_io_stats().len(), 1);
    let p = pairs(&a, &b, SHARDS);
    exercise(&p);
    assert!(every_shard_received(&a));
    // One QP at a time: the plain device's trains each carry one QP's packets. (A plain
    // sender's QPs streaming at once share trains to one peer, which a sharded receiver
    // takes on one socket and partly hands over.)
    assert_eq!(a.io_stats().strays, 0);
}

#[test]
fn a_deregistered_region_is_gone_from_every_shard() {
    let a = Context::open_sharded(ip(7, 8), 0, SHARDS).unwrap();
    let b = Context::open_sharded(ip(7, 9), 0, SHARDS).unwrap();
    let p = pairs(&a, &b, SHARDS);
    let [ca, _] = &p.cqs;
    let [ma, mb] = &p.mrs;
    let extra = mb.remote();
    // Every QP reaches the region while it is registered...
    for [x, _] in &p.qps {
        let op = SendOp::Write { remote_addr: extra.addr, rkey: Rkey(extra.rkey) };
        let sg_list = softrdma::sgl![ma.sge(0, 64).unwrap()];
        x.post_send(SendWr { wr_id: 1, op, sg_list, flags: signaled(), ud: None }).unwrap();
        assert_eq!(wait(ca).status, WcStatus::Success);
    }
    // ...and none once it is dropped: each QP's first WRITE after is refused by its shard.
    let Pairs { cqs, mrs: [ma, mb], qps } = p;
    drop(mb);
    for [x, _] in &qps {
        let op = SendOp::Write { remote_addr: extra.addr, rkey: Rkey(extra.rkey) };
        let sg_list = softrdma::sgl![ma.sge(0, 64).unwrap()];
        x.post_send(SendWr { wr_id: 2, op, sg_list, flags: signaled(), ud: None }).unwrap();
        assert_eq!(wait(&cqs[0]).status, WcStatus::RemAccessErr, "QP {:#x}", x.qpn().get());
    }
}

#[test]
fn a_cq_overrun_on_another_shard_raises_the_devices_async_event() {
    let a = Context::open_sharded(ip(7, 10), 0, SHARDS).unwrap();
    let b = Context::open_sharded(ip(7, 11), 0, SHARDS).unwrap();
    // The first QP goes to shard 0: take it, so that the small CQ's QP is on shard 1.
    let p = pairs(&a, &b, 1);
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let small = a.create_cq(1, None).unwrap();
    let cb = b.create_cq(16, None).unwrap();
    let x = pa.prepare_qp(&QpBuilder::rc(), &small, &small).unwrap();
    let y = pb.prepare_qp(&QpBuilder::rc(), &cb, &cb).unwrap();
    let (ex, ey) = (x.endpoint(), y.endpoint());
    let x = x.handshake(&ey, &ConnectOptions::default()).unwrap();
    let y = y.handshake(&ex, &ConnectOptions::default()).unwrap();
    assert_eq!(x.qpn().get() % SHARDS as u32, 1);
    while a.poll_async_event().is_some() {}
    let mr = pa.register(64, Access::LOCAL_WRITE).unwrap();
    let rmr = pb.register(64, Access::LOCAL_WRITE).unwrap();
    for id in 0..3 {
        y.post_recv(RecvWr { wr_id: id, sg_list: softrdma::sgl![rmr.sge(0, 8).unwrap()] }).unwrap();
    }
    for id in 0..3 {
        let sg_list = softrdma::sgl![mr.sge(0, 8).unwrap()];
        let _ = x.post_send(SendWr { wr_id: id, op: SendOp::Send, sg_list, flags: signaled(), ud: None });
    }
    let start = std::time::Instant::now();
    let event = loop {
        // The small CQ is not polled: shard 1's progress thread delivers into it.
        if let Some(ev) = a.poll_async_event() {
            break ev;
        }
        assert!(start.elapsed() < WAIT, "no asynchronous event");
        std::thread::yield_now();
    };
    assert_eq!(event, AsyncEvent::CqError { cq: small.id() });
    assert_eq!(x.state(), QpState::Error);
    drop(p);
}

#[test]
fn the_cm_connects_and_disconnects_a_qp_on_another_shard() {
    let (c, s) = (ip(7, 12), ip(7, 13));
    let port = softrdma::default_port();
    // The CM opens these addresses on the default port: opened sharded first, it finds them.
    let cctx = Context::open_sharded(c, port, SHARDS).unwrap();
    let sctx = Context::open_sharded(s, port, SHARDS).unwrap();
    // A QP on each first, so that the CM's QPs go to shard 1.
    let _p = pairs(&cctx, &sctx, 1);

    let sch = EventChannel::new().unwrap();
    let listener = CmId::new(&sch, PortSpace::Tcp);
    listener.bind_addr(SocketAddr::new(s, 7480)).unwrap();
    listener.listen(4).unwrap();
    let cch = EventChannel::new().unwrap();
    let client = CmId::new(&cch, PortSpace::Tcp);
    client.resolve_addr(Some(c), SocketAddr::new(s, 7480), WAIT).unwrap();
    let ev = |ch: &EventChannel, want| {
        let e = ch.get_event_timeout(WAIT).expect("a CM event");
        assert_eq!(e.kind, want);
        e
    };
    ev(&cch, CmEventKind::AddrResolved);
    client.resolve_route(WAIT).unwrap();
    ev(&cch, CmEventKind::RouteResolved);
    let setup = |id: &CmId| {
        let ctx = id.context().unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(16, None).unwrap();
        let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
        let qp = id.create_qp(&pd, &QpBuilder::rc(), &cq, &cq).unwrap();
        qp.post_recv(RecvWr { wr_id: 9, sg_list: softrdma::sgl![mr.sge(0, 4096).unwrap()] }).unwrap();
        (cq, mr, qp)
    };
    let (ccq, cmr, cqp) = setup(&client);
    assert_eq!(client.context().unwrap().local_addr(), cctx.local_addr(), "the CM uses the sharded device");
    assert_eq!(cqp.qpn().get() % SHARDS as u32, 1);
    client.connect(&ConnParam { initiator_depth: 1, responder_resources: 1, ..Default::default() }).unwrap();
    let req = ev(&sch, CmEventKind::ConnectRequest);
    let server = req.id.clone();
    let (scq, _smr, sqp) = setup(&server);
    assert_eq!(sqp.qpn().get() % SHARDS as u32, 1);
    server.accept(&req.param).unwrap();
    ev(&cch, CmEventKind::Established);
    ev(&sch, CmEventKind::Established);
    assert_eq!((cqp.state(), sqp.state()), (QpState::Rts, QpState::Rts));

    cmr.write(0, b"sharded").unwrap();
    let sg_list = softrdma::sgl![cmr.sge(0, 7).unwrap()];
    cqp.post_send(SendWr { wr_id: 1, op: SendOp::Send, sg_list, flags: signaled(), ud: None }).unwrap();
    assert_eq!(wait(&ccq).status, WcStatus::Success);
    let wc = wait(&scq);
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 7));

    // The DREQ fails both QPs, each on its own shard: the client's posted receive is
    // flushed.
    client.disconnect().unwrap();
    ev(&cch, CmEventKind::Disconnected);
    ev(&sch, CmEventKind::Disconnected);
    assert_eq!(cqp.state(), QpState::Error);
    let wc = wait(&ccq);
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::WrFlushErr));
    assert_eq!(sqp.state(), QpState::Error);
}

#[test]
fn a_send_with_invalidate_kills_the_key_on_every_shard() {
    let a = Context::open_sharded(ip(7, 14), 0, SHARDS).unwrap();
    let b = Context::open_sharded(ip(7, 15), 0, SHARDS).unwrap();
    let p = pairs(&a, &b, SHARDS);
    let [ca, cb] = &p.cqs;
    let [ma, mb] = &p.mrs;
    let target = mb.remote();
    let write = |x: &QueuePair, id| {
        let op = SendOp::Write { remote_addr: target.addr, rkey: Rkey(target.rkey) };
        let sg_list = softrdma::sgl![ma.sge(0, 64).unwrap()];
        x.post_send(SendWr { wr_id: id, op, sg_list, flags: signaled(), ud: None }).unwrap();
        wait(ca).status
    };
    assert_eq!(write(&p.qps[0][0], 1), WcStatus::Success);
    // The QP pair on shard 1 invalidates the key at b (its responder is on b's shard 1)...
    let [x1, y1] = &p.qps[1];
    assert_eq!(y1.qpn().get() % SHARDS as u32, 1);
    y1.post_recv(RecvWr { wr_id: 5, sg_list: softrdma::sgl![mb.sge(4096, 64).unwrap()] }).unwrap();
    let sg_list = softrdma::sgl![ma.sge(0, 8).unwrap()];
    let op = SendOp::SendWithInv(Rkey(target.rkey));
    x1.post_send(SendWr { wr_id: 2, op, sg_list, flags: signaled(), ud: None }).unwrap();
    assert_eq!(wait(ca).status, WcStatus::Success);
    let wc = wait(cb);
    assert_eq!((wc.status, wc.invalidated_rkey), (WcStatus::Success, Some(Rkey(target.rkey))));
    // ...and the QPs of b's shards 0, 2 and 3 find it dead too.
    for k in [0, 2, 3] {
        assert_eq!(write(&p.qps[k][0], 10 + k as u64), WcStatus::RemAccessErr, "shard {k}");
    }
}

#[test]
fn max_qp_is_the_devices_whatever_its_shards() {
    let a = Context::open_sharded(ip(7, 16), 0, SHARDS).unwrap();
    let pd = a.alloc_pd();
    let cq = a.create_cq(16, None).unwrap();
    let max = a.query_device().max_qp as usize;
    let qps: Vec<_> = (0..max).map(|_| pd.create_qp(&QpBuilder::rc(), &cq, &cq).unwrap()).collect();
    assert!(matches!(pd.create_qp(&QpBuilder::rc(), &cq, &cq), Err(softrdma::Error::Limit("max_qp"))));
    drop(qps);
    pd.create_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
}
