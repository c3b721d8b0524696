//! Packets of one size between softrdma peers (`wire::fill`): a WRITE's MIDDLE and LAST
//! packets and a READ response's MIDDLE packets go filled to their message's first
//! packet's length once the peer has said it takes filler off, land byte for byte, and
//! never go to a peer that has not said so; a filled packet that cannot be is dropped, and
//! the QP recovers it.

use std::time::Duration;

use softrdma_proto::endpoint::Arrival;
use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::{Mtu, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus};
use softrdma_proto::sim::{ConnectParams, Impairments, Sim};
use softrdma_proto::wire::{fill, icrc, Opcode, Operation, Transport};
use softrdma_proto::{sgl, Lkey, Qpn, Rkey};

const BASE: u64 = 0x20_0000;
const LEN: usize = 64 * 1024;

struct Pair {
    sim: Sim,
    qpn: [Qpn; 2],
    keys: [(Lkey, Rkey); 2],
    now: Duration,
    buf: Vec<u8>,
    /// Every datagram sent, by sender, as sent (before any tampering).
    sent: Vec<(usize, Vec<u8>)>,
    /// The TOS byte each of them went with.
    tos: Vec<u8>,
}

impl Pair {
    fn new(announce: [bool; 2]) -> Pair {
        Pair::with(QpType::Rc, announce, false)
    }

    /// `b_stays_in_rtr`: node 1 only receives, as perftest's bandwidth servers do.
    fn with(qp_type: QpType, announce: [bool; 2], b_stays_in_rtr: bool) -> Pair {
        let mut sim = Sim::new(7, Impairments::default(), 2);
        let params = ConnectParams { mtu: Mtu::Mtu1024, b_stays_in_rtr, ..ConnectParams::default() };
        let (qa, qb) = sim.connect(0, 1, qp_type, params);
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let mut keys = [(Lkey(0), Rkey(0)); 2];
        for (n, q) in [(0, qa), (1, qb)] {
            keys[n] = sim.nodes[n].mem.register(PdId(1), BASE, LEN, access).unwrap();
            let bytes = sim.nodes[n].mem.bytes_mut(keys[n].0).unwrap();
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = (i * 7 + n * 101) as u8;
            }
            sim.nodes[n].endpoint.qp_mut(q).unwrap().set_announce_fill(announce[n]);
        }
        Pair {
            sim,
            qpn: [qa, qb],
            keys,
            now: Duration::from_millis(1),
            buf: vec![0; 8192],
            sent: Vec::new(),
            tos: Vec::new(),
        }
    }

    fn bytes(&self, n: usize) -> Vec<u8> {
        self.sim.nodes[n].mem.bytes(self.keys[n].0).unwrap().to_vec()
    }

    /// Node 0 posts `op` over `len` bytes of its region at `local`.
    fn post(&mut self, wr_id: u64, op: SendOp, local: usize, len: u32) {
        let wr = SendWr {
            wr_id,
            op,
            sg_list: sgl![Sge { addr: BASE + local as u64, length: len, lkey: self.keys[0].0 }],
            flags: SendFlags { signaled: true, ..SendFlags::default() },
            ud: None,
        };
        let node = &mut self.sim.nodes[0];
        node.endpoint.qp_mut(self.qpn[0]).unwrap().post_send(wr, &node.mem).unwrap();
    }

    /// Delivers what both nodes send, each datagram through `tamper` (which may change
    /// it), until both are quiet and no timer is due within the next 50 ms.
    fn run(&mut self, tamper: &mut dyn FnMut(usize, &mut Vec<u8>)) {
        for _ in 0..10_000 {
            let mut moved = false;
            for from in 0..2 {
                let to = 1 - from;
                let (src, dst) = (Sim::addr_of(from), Sim::addr_of(to));
                loop {
                    let node = &mut self.sim.nodes[from];
                    let Some(t) = node.endpoint.poll_transmit(self.now, &mut self.buf, &node.mem) else {
                        break;
                    };
                    let mut bytes = t.assemble(&self.buf, &node.mem);
                    self.sent.push((from, bytes.clone()));
                    self.tos.push(t.tos);
                    tamper(from, &mut bytes);
                    let peer = &mut self.sim.nodes[to];
                    let arrival = Arrival { src, dst, tos: t.tos };
                    peer.endpoint.handle_datagram(self.now, arrival, &bytes, &mut peer.mem);
                    moved = true;
                }
            }
            if !moved {
                let next = (0..2).filter_map(|n| self.sim.nodes[n].endpoint.poll_timeout()).min();
                match next {
                    Some(t) if t < self.now + Duration::from_millis(50) => {
                        self.now = self.now.max(t);
                        for n in 0..2 {
                            self.sim.nodes[n].endpoint.handle_timeout(self.now);
                        }
                    }
                    _ => return,
                }
            }
            self.now += Duration::from_micros(2);
        }
        panic!("the pair never went quiet");
    }

    /// Node 1 posts a receive of `len` bytes at `at` in its region.
    fn post_recv(&mut self, wr_id: u64, at: u64, len: u32) {
        let wr = RecvWr { wr_id, sg_list: sgl![Sge { addr: BASE + at, length: len, lkey: self.keys[1].0 }] };
        self.sim.nodes[1].endpoint.qp_mut(self.qpn[1]).unwrap().post_recv(wr).unwrap();
    }

    fn send_statuses(&mut self) -> Vec<(u64, WcStatus)> {
        let qp = self.sim.nodes[0].endpoint.qp_mut(self.qpn[0]).unwrap();
        std::iter::from_fn(|| qp.poll_send_completion()).map(|wc| (wc.wr_id, wc.status)).collect()
    }

    /// The datagrams node `n` sent from index `from` on whose opcode is one of `ops`.
    fn of(&self, n: usize, from: usize, ops: &[Operation]) -> Vec<&Vec<u8>> {
        self.sent[from..]
            .iter()
            .filter(|(m, d)| *m == n && Opcode::new(d[0]).is_some_and(|o| ops.contains(&o.operation())))
            .map(|(_, d)| d)
            .collect()
    }
}

const WRITES: [Operation; 5] = [
    Operation::RdmaWriteFirst,
    Operation::RdmaWriteMiddle,
    Operation::RdmaWriteLast,
    Operation::RdmaWriteLastWithImmediate,
    Operation::RdmaWriteOnly,
];
const READ_RESPONSES: [Operation; 3] =
    [Operation::RdmaReadResponseFirst, Operation::RdmaReadResponseMiddle, Operation::RdmaReadResponseLast];

fn filled(d: &[u8]) -> bool {
    d[fill::FLAG_BYTE] & fill::FILLED != 0
}

/// Each datagram's length and whether it is filled.
fn shapes(ds: &[&Vec<u8>]) -> Vec<(usize, bool)> {
    ds.iter().map(|d| (d.len(), filled(d))).collect()
}

#[test]
fn writes_and_read_responses_go_as_packets_of_one_size_and_land_exactly() {
    let mut p = Pair::new([true, true]);
    let rkey = p.keys[1].1;
    // The first WRITE goes before node 1 has said anything: unfilled. Its ACKs say that
    // node 1 takes filler off.
    p.post(1, SendOp::Write { remote_addr: BASE, rkey }, 0, 4096);
    p.run(&mut |_, _| {});
    assert!(p.of(0, 0, &WRITES).iter().all(|d| !filled(d)));
    assert!(p.sim.nodes[0].endpoint.qp(p.qpn[0]).unwrap().peer_takes_fill());
    // Then: a WRITE of four full packets, one whose last packet is short, a READ of four,
    // a WRITE with immediate data of two, a SEND with immediate data of three.
    let mark = p.sent.len();
    p.post(2, SendOp::Write { remote_addr: BASE + 8192, rkey }, 100, 4096);
    p.post(3, SendOp::Write { remote_addr: BASE + 16384, rkey }, 5000, 2500);
    p.post(4, SendOp::Read { remote_addr: BASE + 30000, rkey }, 40000, 4096);
    p.post_recv(70, 0, 0);
    p.post(5, SendOp::WriteWithImm { remote_addr: BASE + 50000, rkey, imm: 0xFEED }, 9000, 2048);
    p.post_recv(71, 60000, 4096);
    p.post(6, SendOp::SendWithImm(0xBEEF), 20000, 3072);
    p.post_recv(72, 24000, 4096);
    p.post(7, SendOp::Send, 28000, 2048);
    let (a0, b0) = (p.bytes(0), p.bytes(1));
    p.run(&mut |_, _| {});
    let statuses: Vec<_> = (1..=7).map(|k| (k, WcStatus::Success)).collect();
    assert_eq!(p.send_statuses(), statuses);
    let qp1 = p.sim.nodes[1].endpoint.qp_mut(p.qpn[1]).unwrap();
    let wc = qp1.poll_recv_completion().expect("the immediate data's completion");
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.imm_data, wc.byte_len),
        (70, WcStatus::Success, WcOpcode::RecvRdmaWithImm, Some(0xFEED), 2048)
    );
    let wc = qp1.poll_recv_completion().expect("the SEND's completion");
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.imm_data, wc.byte_len),
        (71, WcStatus::Success, WcOpcode::Recv, Some(0xBEEF), 3072)
    );
    assert_eq!(qp1.poll_recv_completion().map(|wc| (wc.wr_id, wc.byte_len)), Some((72, 2048)));
    // The SEND with immediate data: its LAST carries 4 bytes that its FIRST and MIDDLE
    // make up with filler.
    // A plain SEND's packets are all of one size already: no filler.
    let ops =
        [Operation::SendFirst, Operation::SendMiddle, Operation::SendLast, Operation::SendLastWithImmediate];
    let sends = p.of(0, mark, &ops);
    assert_eq!(
        shapes(&sends),
        [
            (12 + 1024 + 4 + 4, true),
            (12 + 1024 + 4 + 4, true),
            (12 + 4 + 1024 + 4, false),
            (12 + 1024 + 4, false),
            (12 + 1024 + 4, false)
        ]
    );

    // Every packet of the full WRITE is as long as its FIRST (a RETH of 16 bytes); the
    // MIDDLE and LAST packets are flagged.
    let writes = p.of(0, mark, &WRITES);
    assert_eq!(writes.len(), 4 + 3 + 2);
    let first = writes[0].len();
    assert_eq!(first, 12 + 16 + 1024 + 4);
    assert!(
        writes[..4].iter().all(|d| d.len() == first),
        "{:?}",
        writes.iter().map(|d| d.len()).collect::<Vec<_>>()
    );
    assert_eq!(writes[..4].iter().map(|d| filled(d)).collect::<Vec<_>>(), [false, true, true, true]);
    // The 2,500-byte WRITE: FIRST, a filled MIDDLE, and a short LAST that takes none.
    assert_eq!(shapes(&writes[4..7]), [(first, false), (first, true), (12 + 452 + 4, false)]);
    // The WRITE with immediate data: its LAST carries 4 bytes of its own and 12 of filler.
    assert_eq!(shapes(&writes[7..]), [(first, false), (first, true)]);
    // The READ's responses: FIRST and LAST carry an AETH, the MIDDLE packets filler.
    let responses = p.of(1, mark, &READ_RESPONSES);
    assert_eq!(
        shapes(&responses),
        [
            (12 + 4 + 1024 + 4, false),
            (12 + 4 + 1024 + 4, true),
            (12 + 4 + 1024 + 4, true),
            (12 + 4 + 1024 + 4, false)
        ]
    );
    // Byte for byte where they belong, and nothing around them touched.
    let mut want_b = b0.clone();
    want_b[8192..8192 + 4096].copy_from_slice(&a0[100..100 + 4096]);
    want_b[16384..16384 + 2500].copy_from_slice(&a0[5000..5000 + 2500]);
    want_b[50000..50000 + 2048].copy_from_slice(&a0[9000..9000 + 2048]);
    want_b[60000..60000 + 3072].copy_from_slice(&a0[20000..20000 + 3072]);
    want_b[24000..24000 + 2048].copy_from_slice(&a0[28000..28000 + 2048]);
    assert!(p.bytes(1) == want_b, "node 1's region");
    let mut want_a = a0.clone();
    want_a[40000..40000 + 4096].copy_from_slice(&b0[30000..30000 + 4096]);
    assert!(p.bytes(0) == want_a, "node 0's region");
    let ep = |n: usize| p.sim.nodes[n].endpoint.stats();
    assert_eq!((ep(0).malformed, ep(1).malformed, ep(0).icrc_errors, ep(1).icrc_errors), (0, 0, 0, 0));
}

#[test]
fn no_filler_goes_to_a_peer_that_has_not_said_it_takes_it_off() {
    // Node 1 plays a softrdma build older than filler; node 0 still says it takes filler
    // off, so node 1's READ responses go filled to it.
    let mut p = Pair::new([true, false]);
    let rkey = p.keys[1].1;
    for k in 0..3 {
        p.post(k, SendOp::Write { remote_addr: BASE + k * 8192, rkey }, 0, 4096);
    }
    p.post(9, SendOp::Read { remote_addr: BASE + 30000, rkey }, 40000, 4096);
    let (a0, b0) = (p.bytes(0), p.bytes(1));
    p.run(&mut |_, _| {});
    let statuses: Vec<_> = [0, 1, 2, 9].into_iter().map(|k| (k, WcStatus::Success)).collect();
    assert_eq!(p.send_statuses(), statuses);
    let mut want_b = b0.clone();
    for k in 0..3 {
        want_b[k * 8192..k * 8192 + 4096].copy_from_slice(&a0[..4096]);
    }
    assert!(p.bytes(1) == want_b, "the unfilled WRITEs landed");
    assert!(p.bytes(0)[40000..40000 + 4096] == b0[30000..30000 + 4096], "the filled READ responses landed");
    assert!(!p.sim.nodes[0].endpoint.qp(p.qpn[0]).unwrap().peer_takes_fill());
    assert!(p.sent.iter().filter(|(n, _)| *n == 1).all(|(_, d)| d[fill::FLAG_BYTE] & fill::TAKES_FILL == 0));
    assert!(p.of(0, 0, &WRITES).iter().all(|d| !filled(d)));
    assert_eq!(p.of(1, 0, &READ_RESPONSES).iter().filter(|d| filled(d)).count(), 2);
}

#[test]
fn a_filled_packet_that_cannot_be_is_dropped_and_its_message_still_lands() {
    let mut p = Pair::new([true, true]);
    let rkey = p.keys[1].1;
    p.post(1, SendOp::Write { remote_addr: BASE, rkey }, 0, 64);
    p.run(&mut |_, _| {});
    p.post(2, SendOp::Write { remote_addr: BASE + 8192, rkey }, 100, 4096);
    let a0 = p.bytes(0);
    // The first filled MIDDLE gets a non-zero filler byte, its ICRC made good again: the
    // ICRC passes, the filler does not.
    let mut tampered = 0;
    let encap = icrc::Encap::new(Sim::addr_of(0), Sim::addr_of(1)).unwrap();
    p.run(&mut |from, d| {
        let middle = Opcode::from_parts(Transport::Rc, Operation::RdmaWriteMiddle).unwrap().code();
        if from == 0 && tampered == 0 && d[0] == middle && filled(d) {
            let end = d.len();
            d[end - 5] = 1;
            let crc = icrc::compute(&encap, &d[..end - 4]);
            d[end - 4..].copy_from_slice(&crc.to_le_bytes());
            tampered += 1;
        }
    });
    assert_eq!(tampered, 1);
    assert_eq!(p.sim.nodes[1].endpoint.stats().malformed, 1);
    assert_eq!(p.send_statuses(), [(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert!(p.bytes(1)[8192..8192 + 4096] == a0[100..100 + 4096], "the resent packet landed");
    // A filled MIDDLE with no payload and a pad count of 3: room for the filler, but what
    // is left has fewer bytes than its pad. Malformed, and the QP carries on.
    let middle = Opcode::from_parts(Transport::Rc, Operation::RdmaWriteMiddle).unwrap().code();
    let mut d = vec![0u8; 12 + 16 + 4];
    d[0] = middle;
    d[1] = 3 << 4; // PadCnt
    d[5..8].copy_from_slice(&p.qpn[1].get().to_be_bytes()[1..]);
    d[fill::FLAG_BYTE] = fill::FILLED;
    let crc = icrc::compute(&encap, &d[..28]);
    d[28..].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(fill::strip(&d).map(<[u8]>::len), Ok(16), "the filler comes off");
    let arrival = Arrival { src: Sim::addr_of(0), dst: Sim::addr_of(1), tos: 0 };
    let node = &mut p.sim.nodes[1];
    node.endpoint.handle_datagram(p.now, arrival, &d, &mut node.mem);
    assert_eq!(p.sim.nodes[1].endpoint.stats().malformed, 2);
    p.post(3, SendOp::Write { remote_addr: BASE + 16384, rkey }, 200, 4096);
    p.run(&mut |_, _| {});
    assert_eq!(p.send_statuses(), [(3, WcStatus::Success)]);
}

#[test]
fn a_one_way_uc_write_stream_learns_from_its_receivers_zero_length_write() {
    for b_stays_in_rtr in [false, true] {
        uc_stream_learns_filler(b_stays_in_rtr);
    }
}

fn uc_stream_learns_filler(b_stays_in_rtr: bool) {
    let mut p = Pair::with(QpType::Uc, [true, true], b_stays_in_rtr);
    let rkey = p.keys[1].1;
    let a0 = p.bytes(0);
    // The first WRITE goes before node 1 has said anything: unfilled. Node 1, which has
    // nothing of its own to send, answers it once with a zero-length WRITE ONLY that says
    // it takes filler off.
    p.post(1, SendOp::Write { remote_addr: BASE, rkey }, 0, 4096);
    p.run(&mut |_, _| {});
    assert!(p.of(0, 0, &WRITES).iter().all(|d| !filled(d)));
    let hello: Vec<_> = p.sent.iter().filter(|(n, _)| *n == 1).map(|(_, d)| d).collect();
    assert_eq!(hello.len(), 1, "one word from the receiver");
    let at = p.sent.iter().position(|(n, _)| *n == 1).unwrap();
    assert_eq!(p.tos[at] & 3, 0b10, "ECN-capable, as the QP's requests");
    assert_eq!(p.sim.nodes[1].endpoint.qp(p.qpn[1]).unwrap().stats().packets_sent, 1);
    let d = hello[0];
    assert_eq!(Opcode::new(d[0]), Opcode::from_parts(Transport::Uc, Operation::RdmaWriteOnly));
    assert_eq!(d.len(), 12 + 16 + 4, "BTH, RETH, ICRC: no payload");
    assert_eq!(&d[12 + 12..12 + 16], &[0, 0, 0, 0], "a DMA length of zero");
    assert_ne!(d[fill::FLAG_BYTE] & fill::TAKES_FILL, 0);
    assert!(p.sim.nodes[0].endpoint.qp(p.qpn[0]).unwrap().peer_takes_fill());
    // Then a WRITE of four full packets goes in packets of one size, and lands.
    let mark = p.sent.len();
    p.post(2, SendOp::Write { remote_addr: BASE + 8192, rkey }, 100, 4096);
    let b0 = p.bytes(1);
    p.run(&mut |_, _| {});
    let writes = p.of(0, mark, &WRITES);
    assert_eq!(
        shapes(&writes),
        [
            (12 + 16 + 1024 + 4, false),
            (12 + 16 + 1024 + 4, true),
            (12 + 16 + 1024 + 4, true),
            (12 + 16 + 1024 + 4, true)
        ]
    );
    assert_eq!(p.send_statuses(), [(1, WcStatus::Success), (2, WcStatus::Success)]);
    let mut want = b0.clone();
    want[8192..8192 + 4096].copy_from_slice(&a0[100..100 + 4096]);
    assert!(p.bytes(1) == want, "node 1's region: the second WRITE, nothing else");
    assert!(p.bytes(1)[..4096] == a0[..4096], "the first WRITE");
    // The word was said once, and nothing completed for it at either end.
    assert_eq!(p.sent.iter().filter(|(n, _)| *n == 1).count(), 1);
    let qp1 = p.sim.nodes[1].endpoint.qp_mut(p.qpn[1]).unwrap();
    assert!(qp1.poll_send_completion().is_none() && qp1.poll_recv_completion().is_none());
    let qp0 = p.sim.nodes[0].endpoint.qp_mut(p.qpn[0]).unwrap();
    assert!(qp0.poll_recv_completion().is_none());
    let ep = |n: usize| p.sim.nodes[n].endpoint.stats();
    assert_eq!((ep(0).malformed, ep(1).malformed, ep(0).icrc_errors, ep(1).icrc_errors), (0, 0, 0, 0));
    if b_stays_in_rtr {
        return;
    }
    // The word took no PSN from node 1's requests: its first WRITE, carrying the PSN the
    // word carried, lands at node 0.
    let wr = SendWr {
        wr_id: 9,
        op: SendOp::Write { remote_addr: BASE + 100, rkey: p.keys[0].1 },
        sg_list: sgl![Sge { addr: BASE + 30000, length: 64, lkey: p.keys[1].0 }],
        flags: SendFlags { signaled: true, ..SendFlags::default() },
        ud: None,
    };
    let node = &mut p.sim.nodes[1];
    node.endpoint.qp_mut(p.qpn[1]).unwrap().post_send(wr, &node.mem).unwrap();
    let b1 = p.bytes(1);
    p.run(&mut |_, _| {});
    assert!(p.bytes(0)[100..164] == b1[30000..30064], "node 1's WRITE landed");
}

#[test]
fn a_uc_receiver_says_nothing_to_a_peer_that_has_not_said_it_takes_filler_off() {
    // Node 0 plays a softrdma build older than filler: node 1 stays silent, as a UC
    // receiver always was, and node 0's WRITEs go unfilled.
    let mut p = Pair::with(QpType::Uc, [false, true], false);
    let rkey = p.keys[1].1;
    for k in 0..3 {
        p.post(k, SendOp::Write { remote_addr: BASE + k * 8192, rkey }, 0, 4096);
        p.run(&mut |_, _| {});
    }
    assert!(p.sent.iter().all(|(n, _)| *n == 0), "node 1 sent something");
    assert!(p.of(0, 0, &WRITES).iter().all(|d| !filled(d)));
    assert_eq!(p.send_statuses(), [(0, WcStatus::Success), (1, WcStatus::Success), (2, WcStatus::Success)]);
}

#[test]
fn a_uc_qp_whose_own_requests_said_it_takes_filler_off_sends_no_word() {
    // Node 1 writes to node 0 first: its WRITE carries the bit, so when node 0's stream
    // comes, node 1 owes it nothing.
    let mut p = Pair::with(QpType::Uc, [true, true], false);
    let wr = SendWr {
        wr_id: 9,
        op: SendOp::Write { remote_addr: BASE + 100, rkey: p.keys[0].1 },
        sg_list: sgl![Sge { addr: BASE + 30000, length: 64, lkey: p.keys[1].0 }],
        flags: SendFlags::default(),
        ud: None,
    };
    let node = &mut p.sim.nodes[1];
    node.endpoint.qp_mut(p.qpn[1]).unwrap().post_send(wr, &node.mem).unwrap();
    p.run(&mut |_, _| {});
    let rkey = p.keys[1].1;
    for k in 0..3 {
        p.post(k, SendOp::Write { remote_addr: BASE + k * 8192, rkey }, 0, 4096);
        p.run(&mut |_, _| {});
    }
    let from1: Vec<_> = p.sent.iter().filter(|(n, _)| *n == 1).map(|(_, d)| d.len()).collect();
    assert_eq!(from1, [12 + 16 + 64 + 4], "node 1's WRITE and nothing else");
    // Node 0 learned from that WRITE: its later WRITEs go filled.
    assert!(p.of(0, 0, &WRITES).iter().any(|d| filled(d)));
}
