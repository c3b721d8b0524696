//! An ACK carried in the datagram of a request (`wire::bundle`), between softrdma peers
//! only: a ping-pong's pong carries its ping's ACK; a foreign peer never sees the flag; a
//! request that leaves no room keeps its ACK in a packet of its own; a bundle whose ACK
//! part is damaged still delivers its request; and a lossy ping-pong with bundles keeps
//! every message and completion.

#![allow(clippy::needless_range_loop)] // two nodes, indexed alike in several arrays

use std::time::Duration;

use softrdma_proto::endpoint::Arrival;
use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::{Mtu, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus};
use softrdma_proto::sim::{ConnectParams, Impairments, Sim};
use softrdma_proto::wire::{bundle, fill};
use softrdma_proto::{sgl, Lkey, Qpn};

const BASE: u64 = 0x10_0000;
const HOP: Duration = Duration::from_micros(2);

struct PingPong {
    sim: Sim,
    qpn: [Qpn; 2],
    lkey: [Lkey; 2],
    now: Duration,
    buf: Vec<u8>,
    /// Every datagram sent, by sender.
    sent: Vec<(usize, Vec<u8>)>,
}

impl PingPong {
    fn new(mtu: Mtu, foreign: bool) -> PingPong {
        PingPong::with(mtu, foreign, true)
    }

    fn with(mtu: Mtu, foreign: bool, bundle_acks: bool) -> PingPong {
        PingPong::each(mtu, [foreign; 2], bundle_acks)
    }

    /// `foreign[n]`: node `n`'s QP takes its peer for a foreign one.
    fn each(mtu: Mtu, foreign: [bool; 2], bundle_acks: bool) -> PingPong {
        let mut sim = Sim::new(1, Impairments::default(), 2);
        let (qa, qb) = sim.connect(0, 1, QpType::Rc, ConnectParams { mtu, ..ConnectParams::default() });
        let access = Access::LOCAL_WRITE;
        let mut lkey = [Lkey(0); 2];
        for (n, q) in [(0, qa), (1, qb)] {
            lkey[n] = sim.nodes[n].mem.register(PdId(1), BASE, 64 * 1024, access).unwrap().0;
            let qp = sim.nodes[n].endpoint.qp_mut(q).unwrap();
            qp.set_foreign_peer(foreign[n]);
            qp.set_bundle_acks(bundle_acks);
        }
        PingPong {
            sim,
            qpn: [qa, qb],
            lkey,
            now: Duration::from_millis(1),
            buf: vec![0; 8192],
            sent: Vec::new(),
        }
    }

    /// Node `from` sends a `len`-byte SEND to the other, which has a receive posted; every
    /// datagram `from` has to send is delivered (possibly altered by `tamper`).
    fn send(&mut self, from: usize, len: u32, wr_id: u64, tamper: &mut dyn FnMut(&mut Vec<u8>)) {
        let to = 1 - from;
        let recv =
            RecvWr { wr_id, sg_list: sgl![Sge { addr: BASE, length: 32 * 1024, lkey: self.lkey[to] }] };
        self.sim.nodes[to].endpoint.qp_mut(self.qpn[to]).unwrap().post_recv(recv).unwrap();
        let wr = SendWr {
            wr_id,
            op: SendOp::Send,
            sg_list: sgl![Sge { addr: BASE + 32 * 1024, length: len, lkey: self.lkey[from] }],
            flags: SendFlags { signaled: true, ..SendFlags::default() },
            ud: None,
        };
        let node = &mut self.sim.nodes[from];
        node.endpoint.qp_mut(self.qpn[from]).unwrap().post_send(wr, &node.mem).unwrap();
        self.now += HOP;
        self.deliver(from, tamper);
    }

    fn deliver(&mut self, from: usize, tamper: &mut dyn FnMut(&mut Vec<u8>)) {
        let to = 1 - from;
        let (src, dst) = (Sim::addr_of(from), Sim::addr_of(to));
        loop {
            let node = &mut self.sim.nodes[from];
            let Some(t) = node.endpoint.poll_transmit(self.now, &mut self.buf, &node.mem) else { break };
            let mut bytes = t.assemble(&self.buf, &node.mem);
            self.sent.push((from, bytes.clone()));
            tamper(&mut bytes);
            let peer = &mut self.sim.nodes[to];
            peer.endpoint.handle_datagram(self.now, Arrival { src, dst, tos: t.tos }, &bytes, &mut peer.mem);
        }
    }

    fn completions(&mut self, n: usize) -> Vec<(u64, WcOpcode, WcStatus, u32)> {
        let mut out = Vec::new();
        let qp = self.sim.nodes[n].endpoint.qp_mut(self.qpn[n]).unwrap();
        while let Some(wc) = qp.poll_send_completion() {
            out.push((wc.wr_id, wc.opcode, wc.status, wc.byte_len));
        }
        while let Some(wc) = qp.poll_recv_completion() {
            out.push((wc.wr_id, wc.opcode, wc.status, wc.byte_len));
        }
        out
    }

    /// Rounds of ping (0 → 1) and pong (1 → 0) of `len` bytes; returns the completions.
    fn rounds(&mut self, rounds: u64, len: u32) -> [Vec<(u64, WcOpcode, WcStatus, u32)>; 2] {
        let mut done = [Vec::new(), Vec::new()];
        for k in 0..rounds {
            self.send(0, len, k, &mut |_| {});
            self.send(1, len, k, &mut |_| {});
            for n in 0..2 {
                done[n].extend(self.completions(n));
            }
        }
        // The last pong's ACK: nothing comes back to carry it, so it goes alone after its
        // delay (before the pong's sender would probe).
        self.now += Duration::from_micros(150);
        self.deliver(0, &mut |_| {});
        for n in 0..2 {
            done[n].extend(self.completions(n));
        }
        done
    }

    fn flagged(&self) -> usize {
        self.sent.iter().filter(|(_, d)| d[bundle::FLAG_BYTE] & bundle::BUNDLED_ACK != 0).count()
    }
}

fn assert_all_done(done: &[Vec<(u64, WcOpcode, WcStatus, u32)>; 2], rounds: u64, len: u32) {
    for side in done {
        let mut want: Vec<_> = (0..rounds)
            .flat_map(|k| {
                [(k, WcOpcode::Send, WcStatus::Success, len), (k, WcOpcode::Recv, WcStatus::Success, len)]
            })
            .collect();
        let mut got = side.clone();
        want.sort_by_key(|w| (w.0, w.1 as u32));
        got.sort_by_key(|w| (w.0, w.1 as u32));
        assert_eq!(got, want);
    }
}

#[test]
fn a_pong_carries_its_pings_ack_in_its_datagram() {
    let mut p = PingPong::new(Mtu::Mtu1024, false);
    let done = p.rounds(100, 8);
    assert_all_done(&done, 100, 8);
    // Every ping but the first carries the ACK of the previous pong, every pong but the
    // first its ping's (the first ping's ACK goes at once and alone: its receiver had sent
    // no request yet, so nothing said a pong would follow).
    let bundles: Vec<&Vec<u8>> =
        p.sent.iter().map(|(_, d)| d).filter(|d| bundle::split(d).is_some()).collect();
    assert_eq!(bundles.len(), 198, "datagrams: {}", p.sent.len());
    assert_eq!(p.flagged(), 198);
    assert!(bundles.iter().all(|d| d.len() == 12 + 8 + 4 + bundle::BUNDLED_ACK_LEN));
    let stats = |n: usize| p.sim.nodes[n].endpoint.qp(p.qpn[n]).unwrap().stats();
    assert_eq!(stats(0).acks_bundled + stats(1).acks_bundled, 198);
    let ep = |n: usize| p.sim.nodes[n].endpoint.stats();
    assert_eq!(ep(0).bundles + ep(1).bundles, 198);
    assert_eq!((ep(0).icrc_errors, ep(1).icrc_errors), (0, 0));
    // 200 messages and 200 ACKs in 202 datagrams: the first and the last ACK alone.
    assert_eq!(p.sent.len(), 202);
}

#[test]
fn a_foreign_peer_never_sees_the_flag() {
    // Nor a softrdma peer when bundles are turned off (`SOFTRDMA_BUNDLE=0`).
    for (foreign, bundle_acks) in [(true, true), (false, false)] {
        let mut p = PingPong::with(Mtu::Mtu1024, foreign, bundle_acks);
        let done = p.rounds(50, 8);
        assert_all_done(&done, 50, 8);
        assert_eq!(p.flagged(), 0);
        assert_eq!(p.sent.len(), 200, "each message and each ACK a datagram of its own");
        assert!(p.sent.iter().all(|(_, d)| d.len() == 24 || d.len() == 20));
    }
}

#[test]
fn the_ack_rides_with_a_messages_last_packet_within_the_mtus_headroom() {
    // A bundle's UDP payload is at most the path MTU plus 68 bytes over IPv4
    // (`max_over_pmtu`), so a full packet takes the ACK. In a message of several packets
    // the ACK rides with the last one, never between the packets of a message.
    for len in [1004, 1005, 1024, 2000, 2048, 3000] {
        let mut p = PingPong::new(Mtu::Mtu1024, false);
        let done = p.rounds(20, len);
        assert_all_done(&done, 20, len);
        let flagged = p.flagged();
        assert!(flagged >= 38, "{len}-byte messages: {flagged} flagged");
        let longest = p.sent.iter().map(|(_, d)| d.len()).max().unwrap();
        assert!(
            longest <= 1024 + bundle::max_over_pmtu(false),
            "{len}-byte messages: a {longest}-byte datagram"
        );
        let first_or_middle = |d: &[u8]| matches!(d[0], 0x00 | 0x01);
        for w in p.sent.windows(2) {
            let (a, b) = (&w[0].1, &w[1].1);
            assert!(
                !(w[0].0 == w[1].0 && first_or_middle(a) && b[0] == 0x11),
                "{len}: an ACK inside a message"
            );
            if first_or_middle(a) {
                assert_eq!(a[bundle::FLAG_BYTE] & bundle::BUNDLED_ACK, 0, "{len}: a FIRST or MIDDLE flagged");
            }
        }
        // Each side's ACKs: all but the first and last ride along, so 20 rounds take 40
        // messages and at most 2 lone ACKs beyond them.
        let packets_per_message = len.div_ceil(1024) as usize;
        let acks_alone = p.sent.iter().filter(|(_, d)| d[0] == 0x11).count();
        assert_eq!(p.sent.len(), 40 * packets_per_message + acks_alone, "{len}");
        assert!(acks_alone <= 2, "{len}: {acks_alone} ACKs alone");
    }
}

#[test]
fn a_bundle_whose_ack_is_damaged_still_delivers_its_request() {
    let mut p = PingPong::new(Mtu::Mtu1024, false);
    // A first round: from now on both QPs talk back, so their ACKs wait for company.
    assert_all_done(&p.rounds(1, 8), 1, 8);
    p.send(0, 8, 0, &mut |_| {});
    // The pong carries the ping's ACK; one byte of the ACK's AETH flipped on the way.
    let mut damaged = 0;
    p.send(1, 8, 0, &mut |d| {
        if bundle::split(d).is_some() {
            let at = d.len() - 6;
            d[at] ^= 0x01;
            damaged += 1;
        }
    });
    assert_eq!(damaged, 1);
    let ep = p.sim.nodes[0].endpoint.stats();
    assert_eq!((ep.bundles, ep.icrc_errors), (1, 1), "{ep:?}");
    // The pong arrived; the ping is still unacknowledged (its ACK was the damaged part).
    let got = p.completions(0);
    assert_eq!(got, [(0, WcOpcode::Recv, WcStatus::Success, 8)]);
    // A damaged flag byte fails the request's own ICRC: nothing of it is taken.
    let before = p.completions(1);
    assert_eq!(before, [(0, WcOpcode::Recv, WcStatus::Success, 8)]);
}

#[test]
fn a_lossy_ping_pong_with_bundles_completes_everything() {
    let mut sim = Sim::new(9, Impairments::from_percent(5.0, 2.0, 5.0, 1.0), 2);
    let (qa, qb) = sim.connect(0, 1, QpType::Rc, ConnectParams::default());
    let q = [qa, qb];
    let mut lkey = [Lkey(0); 2];
    for n in 0..2 {
        lkey[n] = sim.nodes[n].mem.register(PdId(1), BASE, 64 * 1024, Access::LOCAL_WRITE).unwrap().0;
        sim.nodes[n].mem.bytes_mut(lkey[n]).unwrap()[32 * 1024..].fill(0xB0 + n as u8);
    }
    let rounds = 300u64;
    for k in 0..rounds {
        for from in [0, 1] {
            let to = 1 - from;
            let recv = RecvWr { wr_id: k, sg_list: sgl![Sge { addr: BASE, length: 4096, lkey: lkey[to] }] };
            sim.nodes[to].endpoint.qp_mut(q[to]).unwrap().post_recv(recv).unwrap();
            let wr = SendWr {
                wr_id: k,
                op: SendOp::Send,
                sg_list: sgl![Sge { addr: BASE + 32 * 1024, length: 64, lkey: lkey[from] }],
                flags: SendFlags { signaled: true, ..SendFlags::default() },
                ud: None,
            };
            let node = &mut sim.nodes[from];
            node.endpoint.qp_mut(q[from]).unwrap().post_send(wr, &node.mem).unwrap();
            let mut got = None;
            let ok = sim.run_until(Duration::from_secs(10), |s| {
                let qp = s.nodes[to].endpoint.qp_mut(q[to]).unwrap();
                if let Some(wc) = qp.poll_recv_completion() {
                    got = Some(wc);
                }
                got.is_some()
            });
            assert!(ok, "round {k}, {from} → {to}: the message never arrived");
            let wc = got.unwrap();
            assert_eq!((wc.wr_id, wc.status, wc.byte_len), (k, WcStatus::Success, 64));
            assert!(sim.nodes[to].mem.bytes(lkey[to]).unwrap()[..64].iter().all(|&b| b == 0xB0 + from as u8));
        }
    }
    // Every send completes, in order, exactly once.
    for n in 0..2 {
        let mut ids = Vec::new();
        sim.run_until(Duration::from_secs(10), |s| {
            while let Some(wc) = s.nodes[n].endpoint.qp_mut(q[n]).unwrap().poll_send_completion() {
                assert_eq!(wc.status, WcStatus::Success);
                ids.push(wc.wr_id);
            }
            ids.len() == rounds as usize
        });
        assert_eq!(ids, (0..rounds).collect::<Vec<_>>());
    }
    let bundled: u64 = (0..2).map(|n| sim.nodes[n].endpoint.qp(q[n]).unwrap().stats().acks_bundled).sum();
    assert!(bundled > rounds, "{bundled} ACKs bundled in {} messages", 2 * rounds);
}

#[test]
fn a_bundle_is_split_whatever_the_receiver_thinks_of_its_peer() {
    // Node 0 takes node 1 for foreign (an option set on one side only, or a stale memory
    // of a kernel peer at that address); node 1 does not, and bundles its ACKs. Node 0
    // still splits them: a bundle's request passes the exact ICRC check on its own.
    // (Node 0, taking its peer for foreign, does not say that it splits bundles: node 1 is
    // told so here, as a peer that had heard it earlier would be.)
    let mut p = PingPong::each(Mtu::Mtu1024, [true, false], true);
    let q1 = p.qpn[1];
    p.sim.nodes[1].endpoint.qp_mut(q1).unwrap().set_peer_splits_bundles(true);
    let done = p.rounds(30, 8);
    assert_all_done(&done, 30, 8);
    let from_1 = p.sent.iter().filter(|(n, d)| *n == 1 && bundle::split(d).is_some()).count();
    assert!(from_1 >= 29, "{from_1} bundles from node 1");
    assert_eq!(p.sim.nodes[0].endpoint.stats().icrc_errors, 0);
}

#[test]
fn no_bundle_goes_to_a_peer_that_does_not_say_it_splits_them() {
    // Node 0 plays a softrdma build older than bundles: its requests carry no
    // SPLITS_BUNDLES, and it would take a bundle whole and drop it on its ICRC. Node 1 sends
    // it none, and every message of the ping-pong completes; node 0 bundles towards node 1,
    // whose requests say it splits them.
    let mut p = PingPong::each(Mtu::Mtu1024, [false, false], true);
    let q0 = p.qpn[0];
    p.sim.nodes[0].endpoint.qp_mut(q0).unwrap().set_announce_splits(false);
    p.sim.nodes[0].endpoint.qp_mut(q0).unwrap().set_announce_fill(false);
    let done = p.rounds(30, 8);
    assert_all_done(&done, 30, 8);
    let from = |n: usize| p.sent.iter().filter(|(m, d)| *m == n && bundle::split(d).is_some()).count();
    assert_eq!(from(1), 0, "bundles towards a peer that never said it splits them");
    assert!(from(0) >= 29, "{} bundles from node 0", from(0));
    let flagged = |n: usize| {
        p.sent.iter().filter(|(m, d)| *m == n && d[bundle::FLAG_BYTE] & bundle::SPLITS_BUNDLES != 0).count()
    };
    assert_eq!(flagged(0), 0);
    assert!(flagged(1) > 0);
    // Requests say it, answers do not: a lone ACK (BTH, AETH, ICRC) carries no bit of
    // bundles; node 1's say that it takes filler off (`wire::fill`), the old build's
    // nothing.
    let lone_acks: Vec<_> = p.sent.iter().filter(|(_, d)| d.len() == bundle::BUNDLED_ACK_LEN).collect();
    assert!(lone_acks.iter().any(|(n, _)| *n == 0) && lone_acks.iter().any(|(n, _)| *n == 1));
    let bits = |n: usize| if n == 1 { fill::TAKES_FILL } else { 0 };
    assert!(lone_acks.iter().all(|(n, d)| d[bundle::FLAG_BYTE] & 0x7f == bits(*n)));
    // A foreign peer hears of neither: no reserved bit in anything sent to it.
    let mut p = PingPong::each(Mtu::Mtu1024, [true, true], true);
    let done = p.rounds(10, 8);
    assert_all_done(&done, 10, 8);
    assert!(
        p.sent.iter().all(|(_, d)| d[bundle::FLAG_BYTE] & 0x7f == 0),
        "a reserved bit towards a foreign peer"
    );
}

#[test]
fn a_datagram_that_only_looks_like_a_bundle_is_taken_whole() {
    // A foreign sender's SEND with the reserved bit set and an ACK opcode 20 bytes from
    // its end, its ICRC over the whole datagram: one message of 40 bytes, not two packets.
    let mut p = PingPong::new(Mtu::Mtu1024, false);
    let mut payload = [0x5Au8; 40];
    payload[40 - 16] = 0x11; // 20 bytes from the end of the datagram (ICRC 4)
    let recv = RecvWr { wr_id: 9, sg_list: sgl![Sge { addr: BASE, length: 64, lkey: p.lkey[1] }] };
    p.sim.nodes[1].endpoint.qp_mut(p.qpn[1]).unwrap().post_recv(recv).unwrap();
    let op = softrdma_proto::wire::Opcode::new(0x04).unwrap();
    let psn = p.sim.nodes[0].endpoint.qp(p.qpn[0]).unwrap().attr().sq_psn.unwrap();
    let r = softrdma_proto::wire::PacketRepr::new(softrdma_proto::wire::BthRepr::new(op, p.qpn[1], psn), 40);
    let (src, dst) = (Sim::addr_of(0), Sim::addr_of(1));
    let encap = softrdma_proto::wire::icrc::Encap::new(src, dst).unwrap();
    let mut d = vec![0u8; 128];
    let n = r.emit(&mut d, &payload, &encap).unwrap();
    d.truncate(n);
    d[bundle::FLAG_BYTE] |= bundle::BUNDLED_ACK;
    let crc = softrdma_proto::wire::icrc::compute(&encap, &d[..n - 4]);
    d[n - 4..].copy_from_slice(&crc.to_le_bytes());
    assert!(bundle::split(&d).is_some(), "shaped like a bundle");
    let node = &mut p.sim.nodes[1];
    node.endpoint.handle_datagram(p.now, Arrival { src, dst, tos: 0 }, &d, &mut node.mem);
    assert_eq!(p.completions(1), [(9, WcOpcode::Recv, WcStatus::Success, 40)]);
    assert_eq!(p.sim.nodes[1].endpoint.stats().bundles, 0);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    #[test]
    fn datagrams_shaped_like_bundles_harm_nothing(
        garbage in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 36..400), 1..8),
        valid_icrc in proptest::prelude::any::<bool>(),
    ) {
        // Arbitrary datagrams to a connected QP, flagged with an ACK opcode where a bundle's
        // would start, their first part given a valid ICRC or not: no panic.
        let mut p = PingPong::new(Mtu::Mtu1024, false);
        assert_all_done(&p.rounds(2, 8), 2, 8);
        let before = p.sim.nodes[1].endpoint.stats().received;
        let count = garbage.len();
        let (src, dst) = (Sim::addr_of(0), Sim::addr_of(1));
        let encap = softrdma_proto::wire::icrc::Encap::new(src, dst).unwrap();
        for mut d in garbage {
            let n = d.len();
            d[bundle::FLAG_BYTE] |= bundle::BUNDLED_ACK;
            d[5..8].copy_from_slice(&p.qpn[1].get().to_be_bytes()[1..]);
            d[n - 20] = 0x11;
            if valid_icrc {
                let first = n - 20;
                let crc = softrdma_proto::wire::icrc::compute(&encap, &d[..first - 4]);
                d[first - 4..first].copy_from_slice(&crc.to_le_bytes());
            }
            let node = &mut p.sim.nodes[1];
            node.endpoint.handle_datagram(p.now, Arrival { src, dst, tos: 0 }, &d, &mut node.mem);
        }
        // Whatever the garbage did to the QP (it may fail it, as any bad request from the
        // peer's address may), nothing panicked, and every datagram was taken in.
        let stats = p.sim.nodes[1].endpoint.stats();
        proptest::prop_assert_eq!(stats.received, before + count as u64);
    }
}
