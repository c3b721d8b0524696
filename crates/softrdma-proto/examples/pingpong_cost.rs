//! What the protocol itself costs per message: two endpoints in one thread play an 8-byte
//! SEND ping-pong over RC, handing each other their packets directly (no network, no
//! system call, no lock), with the clock moving 2 µs per hop so that each pong carries
//! the ACK of its ping, as on a real link. Prints the mean nanoseconds of protocol work
//! per message: building the message and the ACK riding with it on one side, checking and
//! handling both on the other, the completions and the posts. It is the part of
//! `bench/stages.sh`'s turnaround that lives in `softrdma-proto`, measured without the
//! noise of two busy processes; run it before and after a change to the fast path:
//!
//! ```text
//! cargo run --release -p softrdma-proto --example pingpong_cost [ROUND_TRIPS]
//! ```

use std::time::{Duration, Instant};

use softrdma_proto::endpoint::Arrival;
use softrdma_proto::memory::{Access, Memory, PdId};
use softrdma_proto::qp::{Mtu, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge};
use softrdma_proto::sim::{ConnectParams, Impairments, Sim};
use softrdma_proto::{sgl, Lkey, Qpn};

const BASE: u64 = 0x10_0000;
const SIZE: u32 = 8;
const HOP: Duration = Duration::from_micros(2);

/// One side of the ping-pong.
struct Side {
    node: usize,
    qpn: Qpn,
    lkey: Lkey,
}

fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2_000_000);
    let mut sim = Sim::new(1, Impairments::default(), 2);
    let params = ConnectParams { mtu: Mtu::Mtu4096, ..ConnectParams::default() };
    let (qa, qb) = sim.connect(0, 1, QpType::Rc, params);
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let side = |sim: &mut Sim, node: usize, qpn: Qpn| {
        let (lkey, _) = sim.nodes[node].mem.register(PdId(1), BASE, 4096, access).expect("region");
        Side { node, qpn, lkey }
    };
    let (a, b) = (side(&mut sim, 0, qa), side(&mut sim, 1, qb));
    let mut buf = vec![0u8; 8192];
    let mut bytes = Vec::with_capacity(8192);
    let mut now = Duration::from_millis(1);
    // Warm up, then measure.
    for (rounds, report) in [(n / 10, false), (n, true)] {
        let start = Instant::now();
        for i in 0..rounds {
            for (from, to) in [(&a, &b), (&b, &a)] {
                now += HOP;
                post_recv(&mut sim, to, i);
                post_send(&mut sim, from, i);
                deliver(&mut sim, from.node, to.node, now, &mut buf, &mut bytes);
                drain_completions(&mut sim, to);
            }
            drain_completions(&mut sim, &a);
            if i % 1024 == 0 {
                // The simulated memory logs every write for the workload's checker.
                sim.nodes.iter_mut().for_each(|n| n.mem.clear_write_log());
            }
        }
        if report {
            let per = start.elapsed().as_nanos() as f64 / (2 * rounds) as f64;
            let datagrams = sim.nodes.iter().map(|n| n.endpoint.stats().received).sum::<u64>();
            let total_rounds = n + n / 10;
            println!(
                "protocol work per message (8-byte SEND and its ACK, both sides): {per:.0} ns over {rounds} round trips; {:.2} datagrams per message",
                datagrams as f64 / (2 * total_rounds) as f64
            );
        }
    }
}

fn post_recv(sim: &mut Sim, s: &Side, i: u64) {
    let qp = sim.nodes[s.node].endpoint.qp_mut(s.qpn).expect("qp");
    qp.post_recv(RecvWr { wr_id: i, sg_list: sgl![Sge { addr: BASE, length: 4096, lkey: s.lkey }] })
        .expect("post_recv");
}

fn post_send(sim: &mut Sim, s: &Side, i: u64) {
    let node = &mut sim.nodes[s.node];
    let wr = SendWr {
        wr_id: i,
        op: SendOp::Send,
        sg_list: sgl![Sge { addr: BASE + 64, length: SIZE, lkey: s.lkey }],
        flags: SendFlags { signaled: true, ..SendFlags::default() },
        ud: None,
    };
    node.endpoint.qp_mut(s.qpn).expect("qp").post_send(wr, &node.mem).expect("post_send");
}

/// Moves every packet node `from` has to send into node `to`.
fn deliver(sim: &mut Sim, from: usize, to: usize, now: Duration, buf: &mut [u8], bytes: &mut Vec<u8>) {
    let (src, dst) = (Sim::addr_of(from), Sim::addr_of(to));
    loop {
        let node = &mut sim.nodes[from];
        let Some(t) = node.endpoint.poll_transmit(now, buf, &node.mem) else { break };
        bytes.clear();
        bytes.extend_from_slice(&buf[..t.head_len]);
        for seg in &t.payload {
            node.mem.gather(t.pd, seg, &mut |b| bytes.extend_from_slice(b)).expect("gather");
        }
        bytes.extend_from_slice(&t.tail[..t.tail_len]);
        let peer = &mut sim.nodes[to];
        peer.endpoint.handle_datagram(now, Arrival { src, dst, tos: t.tos }, bytes, &mut peer.mem);
    }
}

fn drain_completions(sim: &mut Sim, s: &Side) {
    let ep = &mut sim.nodes[s.node].endpoint;
    ep.poll_completions(|qp| {
        while let Some(wc) = qp.poll_send_completion() {
            assert!(wc.status as u32 == 0, "send failed: {wc:?}");
        }
        while let Some(wc) = qp.poll_recv_completion() {
            assert_eq!(wc.byte_len, SIZE, "recv: {wc:?}");
        }
    });
    assert!(ep.qp(s.qpn).is_some());
}
