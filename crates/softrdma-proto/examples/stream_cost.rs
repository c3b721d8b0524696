//! What the protocol itself costs per message of a stream of small SENDs, each side apart:
//! the shape of `softrdma perf send_bw -s 2` (perftest's defaults: 100 WRs posted in one
//! go, the last of them signaled), with two endpoints in one thread handing each other
//! their packets directly (no network, no system call, no lock). The sender's figure is
//! posting the WRs and building their packets; the receiver's, checking and handling the
//! packets and taking their completions; the ACK of each burst is not counted. Prints
//! nanoseconds per message; run it before and after a change to the small-message path:
//!
//! ```text
//! cargo run --release -p softrdma-proto --example stream_cost [BURSTS] [SIZE]
//! ```

use std::time::{Duration, Instant};

use softrdma_proto::endpoint::Arrival;
use softrdma_proto::memory::{Access, Memory, PdId};
use softrdma_proto::qp::{Mtu, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge};
use softrdma_proto::sgl;
use softrdma_proto::sim::{ConnectParams, Impairments, Sim};

const BASE: u64 = 0x10_0000;
const BURST: u64 = 100;

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().ok());
    let bursts = args.next().flatten().unwrap_or(20_000);
    let size = args.next().flatten().unwrap_or(2).min(4096) as u32;
    let mut sim = Sim::new(1, Impairments::default(), 2);
    let params = ConnectParams { mtu: Mtu::Mtu4096, ..ConnectParams::default() };
    let (qa, qb) = sim.connect(0, 1, QpType::Rc, params);
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let (la, _) = sim.nodes[0].mem.register(PdId(1), BASE, 8192, access).expect("region");
    let (lb, _) = sim.nodes[1].mem.register(PdId(1), BASE, 8192, access).expect("region");
    let (from, to) = (
        Arrival { src: Sim::addr_of(0), dst: Sim::addr_of(1), tos: 0 },
        Arrival { src: Sim::addr_of(1), dst: Sim::addr_of(0), tos: 0 },
    );
    let mut buf = vec![0u8; 8192];
    // The burst's packets end to end, and where each lies.
    let mut wire: Vec<u8> = Vec::with_capacity(1 << 20);
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let mut now = Duration::from_millis(1);
    let (mut sending, mut receiving) = (Duration::ZERO, Duration::ZERO);
    let mut received = 0u64;
    // A tenth to warm up, then the measured bursts.
    for i in 0..bursts + bursts / 10 {
        let measured = i >= bursts / 10;
        now += Duration::from_micros(5);
        for k in 0..BURST {
            let qp = sim.nodes[1].endpoint.qp_mut(qb).expect("qp");
            qp.post_recv(RecvWr { wr_id: k, sg_list: sgl![Sge { addr: BASE, length: 4096, lkey: lb }] })
                .expect("post_recv");
        }
        let t0 = Instant::now();
        let node = &mut sim.nodes[0];
        for k in 0..BURST {
            let wr = SendWr {
                wr_id: k,
                op: SendOp::Send,
                sg_list: sgl![Sge { addr: BASE + 4096, length: size, lkey: la }],
                flags: SendFlags { signaled: k == BURST - 1, ..SendFlags::default() },
                ud: None,
            };
            node.endpoint.qp_mut(qa).expect("qp").post_send(wr, &node.mem).expect("post_send");
        }
        wire.clear();
        spans.clear();
        while let Some(t) = node.endpoint.poll_transmit(now, &mut buf, &node.mem) {
            // `Transmit::assemble`'s work, into one reused buffer: no allocation is timed.
            let start = wire.len();
            wire.extend_from_slice(&buf[..t.head_len]);
            for seg in &t.payload {
                node.mem.gather(t.pd, seg, &mut |b| wire.extend_from_slice(b)).expect("gather");
            }
            wire.extend_from_slice(&t.tail[..t.tail_len]);
            spans.push((start, wire.len()));
        }
        let t1 = Instant::now();
        let peer = &mut sim.nodes[1];
        for &(a, b) in &spans {
            peer.endpoint.handle_datagram(now, from, &wire[a..b], &mut peer.mem);
        }
        peer.endpoint.poll_completions(|qp| {
            while let Some(wc) = qp.poll_recv_completion() {
                assert_eq!(wc.byte_len, size, "recv: {wc:?}");
                received += u64::from(measured);
            }
        });
        let t2 = Instant::now();
        if measured {
            sending += t1 - t0;
            receiving += t2 - t1;
        }
        // The burst's ACK, once the receiver's ACK timer is surely due, back to the sender,
        // which then completes the burst's one signaled WR.
        now += Duration::from_micros(200);
        let peer = &mut sim.nodes[1];
        peer.endpoint.handle_timeout(now);
        let mut acks = Vec::new();
        while let Some(t) = peer.endpoint.poll_transmit(now, &mut buf, &peer.mem) {
            acks.push(t.assemble(&buf, &peer.mem));
        }
        let node = &mut sim.nodes[0];
        for ack in &acks {
            node.endpoint.handle_datagram(now, to, ack, &mut node.mem);
        }
        let mut completed = 0;
        node.endpoint.poll_completions(|qp| {
            while let Some(wc) = qp.poll_send_completion() {
                assert!(wc.status as u32 == 0, "send failed: {wc:?}");
                completed += 1;
            }
        });
        assert_eq!(completed, 1, "the burst's signaled WR completes");
        if i % 64 == 0 {
            // The simulated memory logs every write for the workload's checker.
            sim.nodes.iter_mut().for_each(|n| n.mem.clear_write_log());
        }
    }
    let messages = (bursts * BURST) as f64;
    assert_eq!(received, bursts * BURST, "every message received");
    println!(
        "protocol work per {size}-byte SEND in bursts of {BURST}: sender {:.0} ns, receiver {:.0} ns, over {} messages",
        sending.as_nanos() as f64 / messages,
        receiving.as_nanos() as f64 / messages,
        bursts * BURST
    );
}
