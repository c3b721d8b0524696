//! The whole runtime — engine, progress threads, CQs, completion channels — through the
//! in-memory network's seeded impairments: loss, duplication, reordering, corruption and
//! delay. Every byte and every completion is checked.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use softrdma::proto::sim::{Impairments, Rng};
use softrdma::{
    Access, CompletionQueue, ConnectOptions, Context, MemoryNetwork, QpBuilder, QueuePair, RecvWr, Rkey,
    SendFlags, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

const ALL: Access = Access::from_bits(0x0F);
/// Bytes per slot of every area.
const SLOT: usize = 16 << 10;
/// Slots per area: more than the operations in flight, so no two in flight share one.
const SLOTS: usize = 64;
const DEPTH: usize = 16;

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn bytes_of(op: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(op.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED);
    let mut v = vec![0; len];
    rng.fill(&mut v);
    v
}

fn wait(cq: &CompletionQueue, deadline: Instant) -> WorkCompletion {
    loop {
        if let Some(wc) = cq.poll_one() {
            return wc;
        }
        assert!(Instant::now() < deadline, "no completion before the deadline");
        std::thread::yield_now();
    }
}

struct Side {
    ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    /// Source and destination of local data: SEND payloads, READ and atomic results.
    local: softrdma::MemoryRegion,
    /// Target of the peer's WRITEs, READs (a fixed pattern in the second half) and atomics.
    target: softrdma::MemoryRegion,
}

fn connect(net: &MemoryNetwork, channel_on_b: bool) -> (Side, Side, Option<softrdma::CompletionChannel>) {
    let opts = ConnectOptions { timeout: 10, retry_cnt: 7, rnr_retry: 7, ..Default::default() };
    let ca = Context::open_in(net, addr("10.0.0.1:4791")).unwrap();
    let cb = Context::open_in(net, addr("10.0.0.2:4791")).unwrap();
    let channel = channel_on_b.then(|| cb.create_channel().unwrap());
    let mut prepared = Vec::new();
    for (i, c) in [&ca, &cb].into_iter().enumerate() {
        let pd = c.alloc_pd();
        let cq = c.create_cq(4096, if i == 1 { channel.as_ref() } else { None }).unwrap();
        let p = pd.prepare_qp(&QpBuilder::rc().access(ALL), &cq, &cq).unwrap();
        let local = pd.register(SLOTS * SLOT, ALL).unwrap();
        let target = pd.register(2 * SLOTS * SLOT + 8, ALL).unwrap();
        prepared.push((c.clone(), cq, p, local, target));
    }
    let ends = [prepared[0].2.endpoint(), prepared[1].2.endpoint()];
    let mut sides = prepared.into_iter().enumerate().map(|(i, (ctx, cq, p, local, target))| {
        let qp = p.handshake(&ends[1 - i], &opts).unwrap();
        Side { ctx, cq, qp, local, target }
    });
    let a = sides.next().unwrap();
    let b = sides.next().unwrap();
    (a, b, channel)
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Send { len: usize },
    Write { slot: usize, len: usize },
    Read { off: usize, len: usize },
    FetchAdd { add: u64 },
}

#[test]
fn mixed_operations_through_loss_duplication_reordering_and_corruption() {
    let imp =
        Impairments { delay: Duration::from_micros(50), ..Impairments::from_percent(4.0, 1.0, 3.0, 0.5) };
    let net = MemoryNetwork::new(11, imp);
    let (a, b, _) = connect(&net, false);
    let deadline = Instant::now() + Duration::from_secs(120);

    // The READ area of B: a fixed pattern. Its WRITE area starts zeroed.
    let read_area = SLOTS * SLOT;
    let pattern = bytes_of(u64::MAX, SLOTS * SLOT);
    b.target.write(read_area, &pattern).unwrap();
    let counter = 2 * SLOTS * SLOT;
    let rkey = Rkey(b.target.rkey().0);
    let base = b.target.addr();

    // B keeps receives posted; each SEND carries its sequence number as immediate data.
    let recv_buf = b.local.len() / SLOTS;
    let post_recv = |i: usize| {
        let slot = i % SLOTS;
        b.qp.post_recv(RecvWr {
            wr_id: slot as u64,
            sg_list: softrdma::sgl![b.local.sge(slot * recv_buf, recv_buf).unwrap()],
        })
        .unwrap();
    };
    for i in 0..DEPTH * 2 {
        post_recv(i);
    }

    let n = 3000usize;
    let mut rng = Rng::new(5);
    let ops: Vec<Op> = (0..n)
        .map(|_| match rng.below(4) {
            0 => Op::Send { len: rng.below(SLOT as u64 + 1) as usize },
            1 => {
                Op::Write { slot: rng.below(SLOTS as u64) as usize, len: 1 + rng.below(SLOT as u64) as usize }
            }
            2 => {
                let len = 1 + rng.below(SLOT as u64) as usize;
                Op::Read { off: rng.below((SLOTS * SLOT - len) as u64) as usize, len }
            }
            _ => Op::FetchAdd { add: 1 + rng.below(1000) },
        })
        .collect();

    // The model of B's WRITE area and counter.
    let mut model_write = vec![0u8; SLOTS * SLOT];
    let mut model_counter = 0u64;
    let mut expected_old = Vec::new();
    let mut sends = Vec::new();
    let mut next_post = 0;
    let mut next_done = 0;
    let mut recvs_seen = 0usize;
    let mut recv_posted = DEPTH * 2;
    let signaled = SendFlags { signaled: true, ..Default::default() };
    while next_done < n {
        while next_post < n && next_post - next_done < DEPTH {
            let i = next_post;
            let slot = i % SLOTS;
            let lo = slot * SLOT;
            let (op, sg_list) = match ops[i] {
                Op::Send { len } => {
                    a.local.write(lo, &bytes_of(i as u64, len)).unwrap();
                    sends.push((i, len));
                    (SendOp::SendWithImm(i as u32), softrdma::sgl![a.local.sge(lo, len).unwrap()])
                }
                Op::Write { slot: t, len } => {
                    let data = bytes_of(i as u64, len);
                    a.local.write(lo, &data).unwrap();
                    model_write[t * SLOT..t * SLOT + len].copy_from_slice(&data);
                    let remote_addr = base + (t * SLOT) as u64;
                    (SendOp::Write { remote_addr, rkey }, softrdma::sgl![a.local.sge(lo, len).unwrap()])
                }
                Op::Read { off, len } => {
                    let remote_addr = base + (read_area + off) as u64;
                    (SendOp::Read { remote_addr, rkey }, softrdma::sgl![a.local.sge(lo, len).unwrap()])
                }
                Op::FetchAdd { add } => {
                    expected_old.push((i, model_counter));
                    model_counter = model_counter.wrapping_add(add);
                    let remote_addr = base + counter as u64;
                    (SendOp::FetchAdd { remote_addr, rkey, add }, softrdma::sgl![a.local.sge(lo, 8).unwrap()])
                }
            };
            a.qp.post_send(SendWr { wr_id: i as u64, op, sg_list, flags: signaled, ud: None }).unwrap();
            next_post += 1;
        }
        // B: consume receives as they come, checking each SEND's bytes, and re-post.
        while let Some(wc) = b.cq.poll_one() {
            assert_eq!(wc.status, WcStatus::Success, "receive {recvs_seen}: {wc:?}");
            let (seq, len) = sends[recvs_seen];
            assert_eq!(wc.imm_data, Some(seq as u32), "SENDs arrive once each, in order");
            assert_eq!(wc.byte_len as usize, len);
            let mut got = vec![0; len];
            b.local.read(wc.wr_id as usize * recv_buf, &mut got).unwrap();
            assert!(got == bytes_of(seq as u64, len), "SEND {seq}: payload differs");
            recvs_seen += 1;
            post_recv(recv_posted);
            recv_posted += 1;
        }
        // A: completions in order, each checked.
        let Some(wc) = a.cq.poll_one() else {
            assert!(Instant::now() < deadline, "stalled at op {next_done} of {n}: {:?}", a.qp.stats());
            std::thread::yield_now();
            continue;
        };
        let i = next_done;
        assert_eq!((wc.wr_id, wc.status), (i as u64, WcStatus::Success), "op {i} ({:?})", ops[i]);
        let lo = (i % SLOTS) * SLOT;
        match ops[i] {
            Op::Read { off, len } => {
                assert_eq!(wc.opcode, WcOpcode::RdmaRead);
                let mut got = vec![0; len];
                a.local.read(lo, &mut got).unwrap();
                assert!(got == pattern[off..off + len], "READ {i}: bytes differ");
            }
            Op::FetchAdd { .. } => {
                let mut old = [0u8; 8];
                a.local.read(lo, &mut old).unwrap();
                let want = expected_old.iter().find(|(k, _)| *k == i).map(|(_, v)| *v);
                assert_eq!(Some(u64::from_le_bytes(old)), want, "FetchAdd {i}: executed once, in order");
            }
            _ => {}
        }
        next_done += 1;
    }
    // The passive side's memory: every WRITE landed where it should, nothing else changed.
    while recvs_seen < sends.len() {
        let wc = wait(&b.cq, deadline);
        assert_eq!(wc.status, WcStatus::Success);
        let (seq, len) = sends[recvs_seen];
        let mut got = vec![0; len];
        b.local.read(wc.wr_id as usize * recv_buf, &mut got).unwrap();
        assert!(got == bytes_of(seq as u64, len), "SEND {seq}: payload differs");
        recvs_seen += 1;
    }
    let mut written = vec![0; SLOTS * SLOT];
    b.target.read(0, &mut written).unwrap();
    assert!(written == model_write, "B's WRITE area differs from the model");
    let mut rest = vec![0; SLOTS * SLOT];
    b.target.read(read_area, &mut rest).unwrap();
    assert!(rest == pattern, "the READ area changed");
    let mut c = [0u8; 8];
    b.target.read(counter, &mut c).unwrap();
    assert_eq!(u64::from_le_bytes(c), model_counter, "each FetchAdd executed exactly once");
    assert!(a.cq.poll_one().is_none() && b.cq.poll_one().is_none(), "no completion twice");

    let s = net.stats();
    eprintln!("network: {s}; requester: {:?}", a.qp.stats());
    assert!(s.lost > 50 && s.duplicated > 10 && s.reordered > 10 && s.corrupted > 5, "{s}");
    assert!(a.qp.stats().retransmits > 0);
    assert!(b.ctx.endpoint_stats().icrc_errors > 0, "corrupted packets are caught by the ICRC");
    drop(a.ctx);
}

/// Event mode through the impaired network: the receiver sleeps on its completion channel
/// (the memory link's fd wakes its engine), and every SEND arrives once, in order.
#[test]
fn event_mode_receiver_through_an_impaired_network() {
    let imp =
        Impairments { delay: Duration::from_micros(100), ..Impairments::from_percent(5.0, 2.0, 5.0, 1.0) };
    let net = MemoryNetwork::new(23, imp);
    let (a, b, channel) = connect(&net, true);
    let channel = channel.unwrap();
    let n = 400u32;
    let receiver = std::thread::spawn(move || {
        let recv_buf = 4096;
        for i in 0..64 {
            b.qp.post_recv(RecvWr {
                wr_id: i,
                sg_list: softrdma::sgl![b.local.sge(i as usize * recv_buf, recv_buf).unwrap()],
            })
            .unwrap();
        }
        let mut seen = 0u32;
        let mut events = 0;
        while seen < n {
            b.cq.req_notify(false).unwrap();
            let wc = match b.cq.poll_one() {
                Some(wc) => wc,
                None => {
                    let cq = channel.get_event_timeout(Duration::from_secs(30)).unwrap().expect("an event");
                    events += 1;
                    channel.ack_events(1);
                    match cq.poll_one() {
                        Some(wc) => wc,
                        None => continue,
                    }
                }
            };
            assert_eq!(wc.status, WcStatus::Success);
            assert_eq!(wc.imm_data, Some(seen), "once each, in order");
            let mut got = vec![0; wc.byte_len as usize];
            b.local.read(wc.wr_id as usize * recv_buf, &mut got).unwrap();
            assert!(got == bytes_of(u64::from(seen), got.len()));
            b.qp.post_recv(RecvWr {
                wr_id: wc.wr_id,
                sg_list: softrdma::sgl![b.local.sge(wc.wr_id as usize * recv_buf, recv_buf).unwrap()],
            })
            .unwrap();
            seen += 1;
        }
        (events, b)
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut rng = Rng::new(9);
    for i in 0..n {
        let len = rng.below(4097) as usize;
        let slot = (i as usize % 8) * 4096;
        a.local.write(slot, &bytes_of(u64::from(i), len)).unwrap();
        let flags = SendFlags { signaled: true, ..Default::default() };
        let sg_list = softrdma::sgl![a.local.sge(slot, len).unwrap()];
        a.qp.post_send(SendWr { wr_id: u64::from(i), op: SendOp::SendWithImm(i), sg_list, flags, ud: None })
            .unwrap();
        let wc = wait(&a.cq, deadline);
        assert_eq!((wc.wr_id, wc.status), (u64::from(i), WcStatus::Success));
    }
    let (events, _b) = receiver.join().unwrap();
    let s = net.stats();
    assert!(events > 0, "the receiver slept on its channel");
    assert!(s.lost > 0 && s.duplicated > 0, "{s}");
}

/// Both ends in event mode, each thread blocked on its channel between messages, through a
/// network that delays every datagram: a delayed datagram is announced by no descriptor
/// until someone collects it when it falls due, so a progress thread woken for it must
/// collect it although a thread watches the link (which, with real sockets, it leaves to
/// the watcher).
#[test]
fn event_mode_on_both_ends_through_a_delaying_network() {
    use softrdma::{AhAttr, Qkey};
    let imp =
        Impairments { delay: Duration::from_micros(200), ..Impairments::from_percent(0.0, 0.0, 0.0, 0.0) };
    let net = MemoryNetwork::new(29, imp);
    const QKEY: Qkey = Qkey(0x2929);
    let mut ends = Vec::new();
    for a in ["10.0.0.1:4791", "10.0.0.2:4791"] {
        let ctx = Context::open_in(&net, addr(a)).unwrap();
        let ch = ctx.create_channel().unwrap();
        let pd = ctx.alloc_pd();
        let rcq = ctx.create_cq(64, Some(&ch)).unwrap();
        let scq = ctx.create_cq(64, None).unwrap();
        let qp = pd.prepare_qp(&QpBuilder::ud(QKEY), &scq, &rcq).unwrap().ready().unwrap();
        let mr = pd.register(4096, ALL).unwrap();
        for i in 0..16 {
            qp.post_recv(RecvWr {
                wr_id: i,
                sg_list: softrdma::sgl![mr.sge(i as usize * 128, 128).unwrap()],
            })
            .unwrap();
        }
        ends.push((ctx, ch, rcq, scq, qp, mr, pd));
    }
    let dest = |from: usize, to: usize| {
        let ah = ends[from].6.create_ah(&AhAttr::to_socket(ends[to].0.local_addr())).unwrap();
        ah.dest(ends[to].4.qpn(), QKEY)
    };
    let dests = [dest(0, 1), dest(1, 0)];
    let n = 100u64;
    let start = Instant::now();
    std::thread::scope(|s| {
        for (k, end) in ends.iter().enumerate() {
            let to = dests[k];
            s.spawn(move || {
                let (_, ch, rcq, scq, qp, mr, _) = end;
                let send = |i: u64| {
                    let flags = SendFlags { signaled: true, ..Default::default() };
                    let sg_list = softrdma::sgl![mr.sge(2048, 8).unwrap()];
                    qp.post_send(SendWr { wr_id: i, op: SendOp::Send, sg_list, flags, ud: Some(to) })
                        .unwrap();
                };
                for i in 0..n {
                    if k == 0 {
                        send(i);
                    }
                    // The next message, waited for on the channel.
                    let wc = loop {
                        rcq.req_notify(false).unwrap();
                        if let Some(wc) = rcq.poll_one() {
                            break wc;
                        }
                        let cq = ch
                            .get_event_timeout(Duration::from_secs(5))
                            .unwrap()
                            .unwrap_or_else(|| panic!("end {k}: message {i} not received within 5 s"));
                        ch.ack_events(1);
                        if let Some(wc) = cq.poll_one() {
                            break wc;
                        }
                    };
                    assert_eq!(wc.status, WcStatus::Success);
                    qp.post_recv(RecvWr {
                        wr_id: wc.wr_id,
                        sg_list: softrdma::sgl![mr.sge(wc.wr_id as usize * 128, 128).unwrap()],
                    })
                    .unwrap();
                    if k == 1 {
                        send(i);
                    }
                    while let Some(wc) = scq.poll_one() {
                        assert_eq!(wc.status, WcStatus::Success);
                    }
                }
            });
        }
    });
    let rtt = start.elapsed() / n as u32;
    eprintln!("{n} round trips through 200 µs of delay each way, both ends in event mode: {rtt:?} each");
}
