//! One QP in isolation: hand-made packets in, the packets and completions it produces
//! checked one by one. The requester, the completer and the responder, each state change
//! on its own; the simulator tests run whole connections.

use std::net::SocketAddr;
use std::time::Duration;

use super::*;
use crate::memory::{Access, PdId};
use crate::sim::SimMemory;
use crate::wire::{
    icrc, AethRepr, AethSyndrome, BthRepr, NakCode, Opcode, Operation, Packet, PacketRepr, RethRepr,
    Transport,
};
use crate::{Lkey, Psn, Qpn, Rkey};

const SQ: u32 = 0x1000;
const RQ: u32 = 0x2000;
const BASE: u64 = 0x10_0000;
const PEER_QPN: u32 = 0x77;

fn me() -> SocketAddr {
    "10.0.0.1:4791".parse().unwrap()
}
fn peer() -> SocketAddr {
    "10.0.0.2:4791".parse().unwrap()
}

fn all() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

struct T {
    qp: QueuePair,
    mem: SimMemory,
    lkey: Lkey,
    rkey: Rkey,
    now: Duration,
    buf: Vec<u8>,
    /// The peer's requests say it splits bundles, as a softrdma peer's do (see
    /// `wire::bundle::SPLITS_BUNDLES`); off, the peer is an older build.
    peer_splits: bool,
}

/// A packet the QP sent, parsed.
#[derive(Debug)]
struct Out {
    op: Operation,
    psn: u32,
    ack_req: bool,
    syndrome: Option<AethSyndrome>,
    payload: Vec<u8>,
}

fn attrs(qp_type: QpType) -> [QpAttr; 3] {
    let rc = qp_type == QpType::Rc;
    [
        QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access_flags: Some(all()),
            ..QpAttr::default()
        },
        QpAttr {
            state: Some(QpState::Rtr),
            path_mtu: Some(Mtu::Mtu1024),
            remote: Some(peer()),
            dest_qpn: Some(Qpn::new(PEER_QPN)),
            rq_psn: Some(Psn::new(RQ)),
            max_dest_rd_atomic: rc.then_some(4),
            min_rnr_timer: rc.then_some(1),
            ..QpAttr::default()
        },
        QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(SQ)),
            timeout: rc.then_some(10),
            retry_cnt: rc.then_some(2),
            rnr_retry: rc.then_some(1),
            max_rd_atomic: rc.then_some(1),
            ..QpAttr::default()
        },
    ]
}

/// A QP of `qp_type` in PD 1 at `me()`.
fn config(qp_type: QpType) -> QpConfig {
    QpConfig { qp_type, pd: PdId(1), local: me(), caps: QpCaps::default(), sq_sig_all: false, srq: None }
}

impl T {
    /// A QP of `qp_type` in RTS, with a 64 KiB region of every right.
    fn new(qp_type: QpType) -> T {
        let mut qp = QueuePair::new(Qpn::new(0x42), config(qp_type));
        for a in attrs(qp_type) {
            qp.modify(&a).unwrap();
        }
        let mut mem = SimMemory::new(1);
        let (lkey, rkey) = mem.register(PdId(1), BASE, 65536, all()).unwrap();
        for (i, b) in mem.bytes_mut(lkey).unwrap().iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        T { qp, mem, lkey, rkey, now: Duration::ZERO, buf: vec![0; 9000], peer_splits: true }
    }

    fn bytes(&self) -> Vec<u8> {
        self.mem.bytes(self.lkey).unwrap().to_vec()
    }

    /// Everything the QP sends now.
    fn out(&mut self) -> Vec<Out> {
        let mut v = Vec::new();
        while let Some(t) = self.qp.poll_transmit(self.now, &mut self.buf, &self.mem) {
            assert_eq!(t.dst, peer());
            let bytes = t.assemble(&self.buf, &self.mem);
            let p = Packet::new_checked(&bytes[..]).unwrap();
            assert_eq!(p.bth().dest_qp().get(), PEER_QPN);
            v.push(Out {
                op: p.opcode().operation(),
                psn: p.bth().psn().get(),
                ack_req: p.bth().ack_req(),
                syndrome: p.aeth().and_then(|a| AethSyndrome::from_byte(a.syndrome_raw()).ok()),
                payload: p.payload().to_vec(),
            });
        }
        v
    }

    /// Hands the QP a packet from `src`.
    fn feed_from(&mut self, src: SocketAddr, r: &PacketRepr, payload: &[u8]) {
        let mut b = vec![0u8; r.total_len()];
        r.emit(&mut b, payload, &icrc::Encap::new(src, me()).unwrap()).unwrap();
        // (The QP takes packets whose ICRC the endpoint checked: the flag set after the
        // ICRC is computed changes nothing here.)
        if self.peer_splits && r.bth.opcode.is_request() {
            b[crate::wire::bundle::FLAG_BYTE] |= crate::wire::bundle::SPLITS_BUNDLES;
        }
        let p = Packet::new_checked(&b[..]).unwrap();
        self.qp.handle_packet(self.now, src, 0, &p, &mut self.mem, None);
    }

    fn feed(&mut self, r: &PacketRepr, payload: &[u8]) {
        self.feed_from(peer(), r, payload);
    }

    /// An ACK (or NAK) from the peer for `psn`.
    fn ack(&mut self, psn: u32, syndrome: AethSyndrome) {
        let op = Opcode::from_parts(Transport::Rc, Operation::Acknowledge).unwrap();
        let mut r = PacketRepr::new(BthRepr::new(op, Qpn::new(0x42), Psn::new(psn)), 0);
        r.ext.aeth = Some(AethRepr { syndrome, msn: 0 });
        self.feed(&r, &[]);
    }

    /// A request from the peer: `op` at `psn`, with a RETH for `va` when it has one.
    fn request(&mut self, op: Operation, psn: u32, va: u64, payload: &[u8]) {
        let opcode = Opcode::from_parts(Transport::Rc, op).unwrap();
        let mut b = BthRepr::new(opcode, Qpn::new(0x42), Psn::new(psn));
        b.ack_req = true;
        let mut r = PacketRepr::new(b, payload.len());
        if opcode.headers().contains(crate::wire::HeaderKind::Reth) {
            r.ext.reth = Some(RethRepr { va, rkey: self.rkey, dma_len: payload.len() as u32 });
        }
        self.feed(&r, payload);
    }

    fn post(&mut self, wr_id: u64, op: SendOp, off: u64, len: u32) {
        let wr = SendWr {
            wr_id,
            op,
            sg_list: crate::sgl![Sge { addr: BASE + off, length: len, lkey: self.lkey }],
            flags: SendFlags { signaled: true, ..SendFlags::default() },
            ud: None,
        };
        self.qp.post_send(wr, &self.mem).unwrap();
    }

    fn sends(&mut self) -> Vec<WorkCompletion> {
        std::iter::from_fn(|| self.qp.poll_send_completion()).collect()
    }
}

fn ops(out: &[Out]) -> Vec<(Operation, u32)> {
    out.iter().map(|o| (o.op, o.psn)).collect()
}

// --- Requester and completer ---

#[test]
fn a_packet_is_built_whole_where_the_buffer_holds_it_and_its_tail_with_the_same_bytes() {
    // The same SEND (a full 1024-byte packet, then a 301-byte one and its 3 pad bytes)
    // built into a buffer that holds it with its tail, and into one that holds only the
    // headers.
    let mut whole = T::new(QpType::Rc);
    let mut split = T::new(QpType::Rc);
    split.buf = vec![0; 64];
    let mut room = T::new(QpType::Rc);
    // Room for the packet but not its tail: the payload stays in memory.
    room.buf = vec![0; 12 + 1024 + 8];
    for t in [&mut whole, &mut split, &mut room] {
        t.post(1, SendOp::Send, 100, 1325);
    }
    for first in [true, false] {
        let a = whole.qp.poll_transmit(whole.now, &mut whole.buf, &whole.mem).unwrap();
        let b = split.qp.poll_transmit(split.now, &mut split.buf, &split.mem).unwrap();
        let c = room.qp.poll_transmit(room.now, &mut room.buf, &room.mem).unwrap();
        assert!(a.payload.is_empty(), "the payload is copied after the headers");
        assert!(!b.payload.is_empty(), "no room: the payload stays in memory");
        // The full packet has no room for its tail in `room`; the short one has.
        assert_eq!(c.payload.is_empty(), !first);
        let bytes = a.assemble(&whole.buf, &whole.mem);
        assert_eq!(bytes, b.assemble(&split.buf, &split.mem));
        assert_eq!(bytes, c.assemble(&room.buf, &room.mem));
        assert_eq!(a.head_len + a.tail_len, bytes.len());
        let p = Packet::new_checked(&bytes[..]).unwrap();
        assert_eq!(p.payload().len(), if first { 1024 } else { 301 });
        assert_eq!(p.payload(), &whole.bytes()[if first { 100..1124 } else { 1124..1425 }]);
        assert!(icrc::verify(&icrc::Encap::new(me(), peer()).unwrap(), &bytes), "the ICRC covers the copy");
    }
}

#[test]
fn a_filled_packet_is_the_same_bytes_whether_its_filler_goes_in_the_buffer_or_the_tail() {
    // A WRITE of two full packets towards a peer that takes filler off: its LAST takes 16
    // bytes of filler, built into a buffer that holds the packet and its tail, into one
    // that holds only the headers (the filler goes in the tail), and into one that holds
    // the packet but not its tail.
    let mut ts = [T::new(QpType::Rc), T::new(QpType::Rc), T::new(QpType::Rc)];
    ts[1].buf = vec![0; 64];
    ts[2].buf = vec![0; 12 + 1024 + 8];
    for t in &mut ts {
        t.qp.set_peer_takes_fill(true);
        t.post(1, SendOp::Write { remote_addr: 0x9000, rkey: Rkey(5) }, 100, 2048);
    }
    let encap = icrc::Encap::new(me(), peer()).unwrap();
    for (k, want) in [(0, 12 + 16 + 1024 + 4), (1, 12 + 1024 + 16 + 4)] {
        let mut bytes = Vec::new();
        for t in &mut ts {
            let tx = t.qp.poll_transmit(t.now, &mut t.buf, &t.mem).unwrap();
            bytes.push(tx.assemble(&t.buf, &t.mem));
        }
        assert!(bytes.iter().all(|b| *b == bytes[0]), "packet {k}: the same bytes from each buffer");
        let b = &bytes[0];
        assert_eq!(b.len(), want, "packet {k}: as long as the FIRST");
        assert!(icrc::verify(&encap, b), "packet {k}: the ICRC covers the filler");
        assert_eq!(b[8] & crate::wire::fill::FILLED != 0, k == 1);
        let unfilled = crate::wire::fill::strip(b).unwrap();
        let p = Packet::new_checked(unfilled).unwrap();
        assert_eq!(p.payload(), &ts[0].bytes()[100 + k * 1024..100 + (k + 1) * 1024]);
    }
}

#[test]
fn a_message_asks_for_an_ack_when_signaled_or_not_followed_at_once_and_every_32_packets() {
    // Ten unsignaled one-packet SENDs, then a signaled one, then two unsignaled: the
    // unsignaled ones with others queued behind ask for nothing (a stream's ACKs halve),
    // the signaled one and the last queued do; and never more than 32 packets go without.
    let mut t = T::new(QpType::Rc);
    let post = |t: &mut T, wr_id: u64, signaled: bool| {
        let wr = SendWr {
            wr_id,
            op: SendOp::Send,
            sg_list: crate::sgl![Sge { addr: BASE, length: 8, lkey: t.lkey }],
            flags: SendFlags { signaled, ..SendFlags::default() },
            ud: None,
        };
        t.qp.post_send(wr, &t.mem).unwrap();
    };
    for i in 0..10 {
        post(&mut t, i, false);
    }
    post(&mut t, 10, true);
    post(&mut t, 11, false);
    post(&mut t, 12, false);
    let asked: Vec<u64> = t.out().iter().filter(|o| o.ack_req).map(|o| u64::from(o.psn - SQ)).collect();
    assert_eq!(asked, vec![10, 12]);
    // The ACK of the last completes the signaled SEND and frees every slot.
    t.ack(SQ + 12, AethSyndrome::ACK);
    assert_eq!(t.sends().iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![10]);
    // A long run of unsignaled packets with more queued: every 32nd asks.
    for i in 0..70 {
        post(&mut t, 100 + i, false);
    }
    let out = t.out();
    let asked: Vec<u32> = out.iter().filter(|o| o.ack_req).map(|o| o.psn - SQ - 13).collect();
    assert_eq!(asked, vec![31, 63, 69]);
    t.ack(SQ + 82, AethSyndrome::ACK);
    // An unsignaled SEND followed by a WR that may not follow at once asks: a READ (which
    // may wait for the READs outstanding), a fenced SEND (which waits for their answers).
    let psn = SQ + 83;
    post(&mut t, 200, false);
    t.post(201, SendOp::Read { remote_addr: 0, rkey: Rkey(9) }, 0, 8);
    let out = t.out();
    assert_eq!(out.iter().map(|o| (o.psn - psn, o.ack_req)).collect::<Vec<_>>(), vec![(0, true), (1, true)]);
    t.ack(psn, AethSyndrome::ACK);
    let wr = SendWr {
        wr_id: 202,
        op: SendOp::Send,
        sg_list: crate::sgl![Sge { addr: BASE, length: 8, lkey: t.lkey }],
        flags: SendFlags { fence: true, ..SendFlags::default() },
        ud: None,
    };
    post(&mut t, 203, false);
    t.qp.post_send(wr, &t.mem).unwrap();
    // The READ is still outstanding: the unsignaled SEND goes, asking; the fenced one waits.
    let out = t.out();
    assert_eq!(out.iter().map(|o| (o.psn - psn, o.ack_req)).collect::<Vec<_>>(), vec![(2, true)]);
}

#[test]
fn a_send_is_cut_at_the_mtu_and_completes_on_the_ack_of_its_last_psn() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 2500);
    let out = t.out();
    use Operation::*;
    assert_eq!(ops(&out), vec![(SendFirst, SQ), (SendMiddle, SQ + 1), (SendLast, SQ + 2)]);
    assert_eq!(out.iter().map(|o| o.payload.len()).collect::<Vec<_>>(), vec![1024, 1024, 452]);
    assert!(out[2].ack_req, "the last packet asks for an ACK");
    assert_eq!(out.iter().flat_map(|o| o.payload.clone()).collect::<Vec<_>>(), t.bytes()[..2500].to_vec());
    // An ACK of the middle PSN completes nothing; the last one completes the SEND.
    t.ack(SQ + 1, AethSyndrome::ACK);
    assert!(t.sends().is_empty());
    t.ack(SQ + 2, AethSyndrome::ACK);
    let wc = t.sends();
    assert_eq!(wc.len(), 1);
    assert_eq!((wc[0].wr_id, wc[0].status, wc[0].opcode), (1, WcStatus::Success, WcOpcode::Send));
    assert_eq!(t.qp.poll_timeout(), None, "no timer once everything is acknowledged");
}

#[test]
fn responses_for_psns_not_outstanding_are_dropped() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 100);
    assert_eq!(t.out().len(), 1);
    let dropped = t.qp.stats().dropped;
    // Ahead of what was sent, and at or behind what was acknowledged already.
    for psn in [SQ + 1, SQ + 1000, SQ - 1, SQ.wrapping_sub(5000)] {
        t.ack(psn, AethSyndrome::Nak(NakCode::RemoteAccessError));
    }
    assert_eq!(t.qp.stats().dropped - dropped, 4);
    assert!(t.sends().is_empty());
    assert_eq!(t.qp.state(), QpState::Rts);
    t.ack(SQ, AethSyndrome::ACK);
    assert_eq!(t.sends()[0].status, WcStatus::Success);
}

#[test]
fn a_sequence_nak_goes_back_to_its_psn_once() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 3000);
    assert_eq!(t.out().len(), 3);
    t.ack(SQ + 1, AethSyndrome::Nak(NakCode::PsnSequenceError));
    use Operation::*;
    assert_eq!(ops(&t.out()), vec![(SendMiddle, SQ + 1), (SendLast, SQ + 2)], "resent from the NAK's PSN");
    // The same NAK again (the peer saw the old packets arrive) does not go back twice.
    t.ack(SQ + 1, AethSyndrome::Nak(NakCode::PsnSequenceError));
    assert!(t.out().is_empty());
    assert_eq!(t.qp.stats().seq_naks_received, 2);
    t.ack(SQ + 2, AethSyndrome::ACK);
    assert_eq!(t.sends()[0].status, WcStatus::Success);
}

#[test]
fn an_rnr_nak_waits_its_timer_then_resends_and_runs_out() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 10);
    assert_eq!(t.out().len(), 1);
    t.ack(SQ, AethSyndrome::RnrNak { timer: 14 });
    assert!(t.out().is_empty(), "nothing before the RNR timer");
    let wait = Duration::from_micros(u64::from(crate::wire::rnr_timer_us(14)));
    assert_eq!(t.qp.poll_timeout(), Some(wait));
    t.now = wait;
    t.qp.handle_timeout(t.now);
    assert_eq!(ops(&t.out()), vec![(Operation::SendOnly, SQ)]);
    // rnr_retry is 1: the second RNR NAK fails the SEND.
    t.ack(SQ, AethSyndrome::RnrNak { timer: 14 });
    let wc = t.sends();
    assert_eq!(wc[0].status, WcStatus::RnrRetryExcErr);
    assert_eq!(t.qp.state(), QpState::Error);
}

#[test]
fn a_fatal_nak_fails_its_wqe_and_flushes_the_rest() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 10);
    t.post(2, SendOp::Write { remote_addr: 0x99, rkey: Rkey(5) }, 0, 10);
    t.post(3, SendOp::Send, 0, 10);
    assert_eq!(t.out().len(), 3);
    t.ack(SQ + 1, AethSyndrome::Nak(NakCode::RemoteAccessError));
    let wc: Vec<_> = t.sends().iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(wc, vec![(1, WcStatus::Success), (2, WcStatus::RemAccessErr), (3, WcStatus::WrFlushErr)]);
    assert_eq!(t.qp.state(), QpState::Error);
    // In ERROR, new WRs complete flushed without going out.
    t.post(4, SendOp::Send, 0, 10);
    assert!(t.out().is_empty());
    assert_eq!(t.sends()[0].status, WcStatus::WrFlushErr);
}

#[test]
fn the_ack_timer_resends_and_gives_up_after_retry_cnt() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 10);
    assert_eq!(t.out().len(), 1);
    // retry_cnt 2: RETRY_EXC_ERR at the third timeout. Between timeouts a tail-loss probe
    // resends too, spending no retry. Every timer firing before the failure resends.
    let mut resends = 0;
    let status = loop {
        let at = t.qp.poll_timeout().expect("a timer while the SEND is unacknowledged");
        assert!(at > t.now, "timers move forward");
        t.now = at;
        t.qp.handle_timeout(t.now);
        if let Some(wc) = t.qp.poll_send_completion() {
            break wc.status;
        }
        assert_eq!(ops(&t.out()), vec![(Operation::SendOnly, SQ)], "a timer firing resends");
        resends += 1;
        assert!(resends < 20, "the retries never ran out");
    };
    assert_eq!(status, WcStatus::RetryExcErr);
    assert_eq!(t.qp.stats().timeouts, 3, "retry_cnt + 1 timeouts");
    assert!(resends >= 2, "{resends} resends");
    assert_eq!(t.qp.state(), QpState::Error);
}

#[test]
fn a_read_takes_its_responses_in_order_and_asks_again_for_a_gap() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Read { remote_addr: 0x5000, rkey: Rkey(9) }, 0x8000, 3000);
    let out = t.out();
    assert_eq!(ops(&out), vec![(Operation::RdmaReadRequest, SQ)]);
    // A READ of 3 MTUs uses PSNs SQ..SQ+2; the next request would start at SQ+3.
    let resp = |t: &mut T, op: Operation, psn: u32, fill: u8, len: usize| {
        let opcode = Opcode::from_parts(Transport::Rc, op).unwrap();
        let mut r = PacketRepr::new(BthRepr::new(opcode, Qpn::new(0x42), Psn::new(psn)), len);
        if opcode.headers().contains(crate::wire::HeaderKind::Aeth) {
            r.ext.aeth = Some(AethRepr { syndrome: AethSyndrome::ACK, msn: 0 });
        }
        t.feed(&r, &vec![fill; len]);
    };
    resp(&mut t, Operation::RdmaReadResponseFirst, SQ, 0xA1, 1024);
    // The middle response is lost: the last one shows a gap, and the READ is asked again
    // from the missing PSN.
    resp(&mut t, Operation::RdmaReadResponseLast, SQ + 2, 0xA3, 952);
    let again = t.out();
    assert_eq!(ops(&again), vec![(Operation::RdmaReadRequest, SQ + 1)]);
    resp(&mut t, Operation::RdmaReadResponseFirst, SQ + 1, 0xA2, 1024);
    resp(&mut t, Operation::RdmaReadResponseLast, SQ + 2, 0xA3, 952);
    let wc = t.sends();
    assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, 3000));
    let b = t.bytes();
    assert!(b[0x8000..0x8400].iter().all(|&x| x == 0xA1));
    assert!(b[0x8400..0x8800].iter().all(|&x| x == 0xA2));
    assert!(b[0x8800..0x8000 + 3000].iter().all(|&x| x == 0xA3));
    assert_eq!(b[0x8000 + 3000], ((0x8000 + 3000) * 7) as u8, "nothing past the READ's end");
}

#[test]
fn the_read_limit_holds_the_second_read_and_the_fence_holds_the_write() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Read { remote_addr: 0, rkey: Rkey(9) }, 0, 8);
    t.post(2, SendOp::Read { remote_addr: 0, rkey: Rkey(9) }, 8, 8);
    assert_eq!(ops(&t.out()), vec![(Operation::RdmaReadRequest, SQ)], "max_rd_atomic is 1");
    let mut r = PacketRepr::new(
        BthRepr::new(
            Opcode::from_parts(Transport::Rc, Operation::RdmaReadResponseOnly).unwrap(),
            Qpn::new(0x42),
            Psn::new(SQ),
        ),
        8,
    );
    r.ext.aeth = Some(AethRepr { syndrome: AethSyndrome::ACK, msn: 0 });
    t.feed(&r, &[1; 8]);
    assert_eq!(ops(&t.out()), vec![(Operation::RdmaReadRequest, SQ + 1)]);
}

// --- Responder ---

#[test]
fn a_write_at_the_expected_psn_lands_and_is_acknowledged() {
    let mut t = T::new(QpType::Rc);
    t.request(Operation::RdmaWriteOnly, RQ, BASE + 100, &[0xEE; 40]);
    let b = t.bytes();
    assert!(b[100..140].iter().all(|&x| x == 0xEE));
    assert_eq!(b[99], (99 * 7) as u8);
    assert_eq!(b[140], (140 * 7) as u8);
    // This QP never talks back: its ACK goes at once.
    let out = t.out();
    assert_eq!(ops(&out), vec![(Operation::Acknowledge, RQ)]);
    assert_eq!(out[0].syndrome, Some(AethSyndrome::ACK));
    assert_eq!(t.qp.poll_timeout(), None);
}

#[test]
fn the_ack_of_a_qp_that_talks_back_waits_a_little_for_company() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 8);
    assert_eq!(ops(&t.out()), vec![(Operation::SendOnly, SQ)]);
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[1; 8]);
    // It sent a request lately: the ACK waits for the next one, or alone until its deadline.
    assert!(t.out().is_empty());
    let deadline = t.now + responder::ACK_DELAY;
    assert!(t.qp.poll_timeout().is_some_and(|d| d <= deadline));
    t.now = deadline;
    assert_eq!(ops(&t.out()), vec![(Operation::Acknowledge, RQ)]);
    // A duplicate means the requester missed that ACK (its probe came first): the
    // answer goes at once.
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[1; 8]);
    assert_eq!(ops(&t.out()), vec![(Operation::Acknowledge, RQ)]);
    // Quiet for longer than TALKS_BACK: ACKs go at once again.
    t.now += responder::TALKS_BACK;
    t.request(Operation::RdmaWriteOnly, RQ + 1, BASE, &[1; 8]);
    assert_eq!(ops(&t.out()), vec![(Operation::Acknowledge, RQ + 1)]);
}

#[test]
fn the_probe_waits_for_a_peer_that_may_delay_its_ack() {
    // Two QPs alike, but one heard a request from its peer lately: that peer's QP talks
    // back and may hold its ACK up to ACK_DELAY, so this side's probe waits that much more.
    let probe_after = |heard: bool| {
        let mut t = T::new(QpType::Rc);
        t.post(1, SendOp::Send, 0, 8);
        t.out();
        t.now += Duration::from_micros(10);
        t.ack(SQ, AethSyndrome::ACK);
        t.sends();
        if heard {
            t.request(Operation::RdmaWriteOnly, RQ, BASE, &[1; 8]);
        }
        t.post(2, SendOp::Send, 0, 8);
        t.out();
        t.qp.poll_timeout().expect("a probe") - t.now
    };
    assert_eq!(probe_after(true), probe_after(false) + responder::ACK_DELAY);
}

#[test]
fn a_peer_says_for_itself_that_it_splits_bundles() {
    // Learned from a request of the peer's; forgotten when the QP is reset (a new peer,
    // which comes only through RESET, must say it again).
    let mut t = T::new(QpType::Rc);
    assert!(!t.qp.peer_splits_bundles());
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[1; 8]);
    assert!(t.qp.peer_splits_bundles());
    t.qp.modify(&QpAttr { state: Some(QpState::Reset), ..Default::default() }).unwrap();
    assert!(!t.qp.peer_splits_bundles());
    // A peer whose requests do not say it is never taken for one that does.
    let mut t = T::new(QpType::Rc);
    t.peer_splits = false;
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[1; 8]);
    assert!(!t.qp.peer_splits_bundles());
}

#[test]
fn an_ack_leaves_with_the_next_request_or_at_once_when_many_psns_are_owed() {
    // A ping-pong: the pong carries the ping's ACK in its datagram (`wire::bundle`), with
    // the pong's ECN codepoint (ECT(0)); each packet's ICRC is its own.
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 8);
    assert_eq!(ops(&t.out()), vec![(Operation::SendOnly, SQ)]);
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[1; 8]);
    assert!(t.out().is_empty());
    t.post(2, SendOp::Send, 0, 8);
    let send = Opcode::from_parts(Transport::Rc, Operation::SendOnly).unwrap().code();
    let ack = Opcode::from_parts(Transport::Rc, Operation::Acknowledge).unwrap().code();
    let tx = t.qp.poll_transmit(t.now, &mut t.buf, &t.mem).expect("the pong");
    assert_eq!(tx.tos, 0b10);
    let bytes = tx.assemble(&t.buf, &t.mem);
    assert!(t.qp.poll_transmit(t.now, &mut t.buf, &t.mem).is_none(), "the ACK went with the pong");
    let (request, with) = crate::wire::bundle::split(&bytes).expect("a bundle");
    let encap = icrc::Encap::new(me(), peer()).unwrap();
    for (part, code, psn) in [(request, send, SQ + 1), (with, ack, RQ)] {
        let p = Packet::new_checked(part).unwrap();
        assert_eq!((p.opcode().code(), p.bth().psn().get(), p.bth().dest_qp().get()), (code, psn, PEER_QPN));
        assert!(icrc::verify(&encap, part));
    }
    assert_eq!(t.qp.stats().acks_bundled, 1);
    // Over IPv4 even the longest request packet takes its ACK: a full WRITE ONLY, its RETH
    // and 1,024 bytes, 52 bytes over the path MTU with the ACK (68 allowed).
    t.request(Operation::RdmaWriteOnly, RQ + 1, BASE, &[1; 8]);
    assert!(t.out().is_empty());
    t.post(3, SendOp::Write { remote_addr: 0x1000, rkey: Rkey(1) }, 0, 1024);
    let tx = t.qp.poll_transmit(t.now, &mut t.buf, &t.mem).expect("the WRITE");
    let bytes = tx.assemble(&t.buf, &t.mem);
    assert_eq!(bytes.len(), 12 + 16 + 1024 + 4 + 20, "a full WRITE ONLY and its ACK, one datagram");
    assert!(crate::wire::bundle::split(&bytes).is_some());
    // Bundles off (`SOFTRDMA_BUNDLE=0`): the two go one after the other, the shorter ACK
    // last, for the runtime to send as one GSO train.
    t.qp.set_bundle_acks(false);
    t.request(Operation::RdmaWriteOnly, RQ + 2, BASE, &[1; 8]);
    assert!(t.out().is_empty());
    t.post(4, SendOp::Send, 0, 8);
    assert_eq!(raw_out(&mut t), vec![(send, false, 0b10), (ack, false, 0b10)]);
    // Towards a foreign peer the wire stays as rxe's: the ACK first, not ECN-capable.
    let mut t = T::new(QpType::Rc);
    t.qp.set_foreign_peer(true);
    t.post(1, SendOp::Send, 0, 8);
    t.out();
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[1; 8]);
    assert!(t.out().is_empty());
    t.post(2, SendOp::Send, 0, 8);
    assert_eq!(raw_out(&mut t), vec![(ack, false, 0), (send, false, 0b10)]);
    // A stream into a QP that talks back: sixteen PSNs owed, and the ACK goes without
    // waiting.
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 8);
    t.out();
    for k in 0..15 {
        t.request(Operation::RdmaWriteOnly, RQ + k, BASE, &[1; 8]);
        assert!(t.out().is_empty(), "{k}");
    }
    t.request(Operation::RdmaWriteOnly, RQ + 15, BASE, &[1; 8]);
    assert_eq!(ops(&t.out()), vec![(Operation::Acknowledge, RQ + 15)], "one ACK for sixteen");
    // NAKs never wait.
    t.request(Operation::RdmaWriteOnly, RQ + 40, BASE, &[1; 8]);
    assert_eq!(t.out()[0].syndrome, Some(AethSyndrome::Nak(NakCode::PsnSequenceError)));
}

#[test]
fn requests_ahead_get_one_sequence_nak_and_duplicates_a_re_ack() {
    let mut t = T::new(QpType::Rc);
    for k in 0..5 {
        t.request(Operation::RdmaWriteOnly, RQ + 3 + k, BASE, &[0xE1; 8]);
    }
    let out = t.out();
    assert_eq!(out.len(), 1, "one NAK per gap: {out:?}");
    assert_eq!((out[0].psn, out[0].syndrome), (RQ, Some(AethSyndrome::Nak(NakCode::PsnSequenceError))));
    assert_ne!(t.bytes()[0], 0xE1, "nothing executed");
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[0xE2; 8]);
    assert_eq!(t.bytes()[0], 0xE2);
    // A duplicate of it with other bytes: re-ACKed, not executed.
    t.now += responder::ACK_DELAY;
    t.out();
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[0xE3; 8]);
    assert_eq!(t.bytes()[0], 0xE2, "a duplicate is not executed");
    t.now += responder::ACK_DELAY;
    let out = t.out();
    assert_eq!(
        (out[0].op, out[0].psn, out[0].syndrome),
        (Operation::Acknowledge, RQ, Some(AethSyndrome::ACK))
    );
    assert_eq!(t.qp.stats().duplicates, 1);
}

// --- Selective recovery against forged packets ---

/// A SACK from the peer: every PSN before `first_missing` arrived, and `bits` after it.
fn sack(t: &mut T, first_missing: u32, bits: u128) {
    let r = PacketRepr::new(
        BthRepr::new(Opcode::new(0xC0).unwrap(), Qpn::new(0x42), Psn::new(first_missing)),
        64,
    );
    let mut payload = [0u8; 64];
    payload[..16].copy_from_slice(&bits.to_le_bytes());
    t.feed(&r, &payload);
}

#[test]
fn a_sack_past_everything_sent_acknowledges_it_all() {
    // The responder holds a packet the requester never sent (forged with the peer's
    // address and a PSN in its window): its SACKs then say "first missing: the next PSN",
    // which acknowledges everything sent, and the bits beyond say nothing.
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 3000);
    assert_eq!(t.out().len(), 3);
    sack(&mut t, SQ + 3, 1 << 10);
    let wc = t.sends();
    assert_eq!(wc.len(), 1, "the SACK completes the SEND");
    assert_eq!(wc[0].status, WcStatus::Success);
    assert!(t.out().is_empty(), "and resends nothing");
    // Further than one past what was sent, a SACK is forged: dropped.
    t.post(2, SendOp::Send, 0, 10);
    assert_eq!(t.out().len(), 1);
    let dropped = t.qp.stats().dropped;
    sack(&mut t, SQ + 5, 0b1);
    assert_eq!(t.qp.stats().dropped, dropped + 1);
    assert!(t.sends().is_empty());
}

#[test]
fn a_forged_packet_held_ahead_of_the_gap_gives_way_to_the_real_one() {
    let mut t = T::new(QpType::Rc);
    t.qp.set_selective(true);
    // Forged: a WRITE at a PSN inside the window, before the requester sent it.
    t.request(Operation::RdmaWriteOnly, RQ + 2, BASE + 64, &[0xF0; 8]);
    assert_eq!(ops(&t.out()), vec![(Operation::Sack, RQ)]);
    // The real packets, the one at RQ + 2 first (held), then the gap's.
    t.request(Operation::RdmaWriteOnly, RQ + 2, BASE + 64, &[0xA2; 8]);
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[0xA0; 8]);
    t.request(Operation::RdmaWriteOnly, RQ + 1, BASE + 32, &[0xA1; 8]);
    let b = t.bytes();
    assert_eq!((b[0], b[32], b[64]), (0xA0, 0xA1, 0xA2), "the real WRITE landed, not the forged one");
    // (The ACK waits its delay for a request to go with.)
    t.now += responder::ACK_DELAY;
    let out = t.out();
    assert_eq!(
        (out.last().unwrap().op, out.last().unwrap().psn),
        (Operation::Acknowledge, RQ + 2),
        "{out:?}"
    );
}

#[test]
fn a_send_without_a_receive_is_rnr_nakked_and_then_lands() {
    let mut t = T::new(QpType::Rc);
    t.request(Operation::SendOnly, RQ, 0, &[5; 16]);
    let out = t.out();
    assert_eq!(out[0].syndrome, Some(AethSyndrome::RnrNak { timer: 1 }));
    assert_eq!(t.qp.stats().rnr_naks_sent, 1);
    t.qp.post_recv(RecvWr {
        wr_id: 9,
        sg_list: crate::sgl![Sge { addr: BASE + 512, length: 64, lkey: t.lkey }],
    })
    .unwrap();
    t.request(Operation::SendOnly, RQ, 0, &[5; 16]);
    let wc = t.qp.poll_recv_completion().unwrap();
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (9, WcStatus::Success, 16));
    assert!(t.bytes()[512..528].iter().all(|&x| x == 5));
}

#[test]
fn a_bad_key_is_a_remote_access_nak_and_the_responder_fails() {
    let mut t = T::new(QpType::Rc);
    let opcode = Opcode::from_parts(Transport::Rc, Operation::RdmaWriteOnly).unwrap();
    let mut r = PacketRepr::new(BthRepr::new(opcode, Qpn::new(0x42), Psn::new(RQ)), 8);
    r.ext.reth = Some(RethRepr { va: BASE, rkey: Rkey(t.rkey.0 ^ 1), dma_len: 8 });
    t.feed(&r, &[1; 8]);
    let out = t.out();
    assert_eq!(out[0].syndrome, Some(AethSyndrome::Nak(NakCode::RemoteAccessError)));
    assert_eq!(t.qp.state(), QpState::Error);
    assert_eq!(t.bytes()[0], 0, "nothing written");
}

#[test]
fn the_peer_port_is_latched_from_its_first_valid_packet() {
    let mut t = T::new(QpType::Rc);
    let other: SocketAddr = "10.0.0.2:5000".parse().unwrap();
    // Before the latch, a packet from another port with an unexpected PSN does not latch.
    let opcode = Opcode::from_parts(Transport::Rc, Operation::RdmaWriteOnly).unwrap();
    let mut r = PacketRepr::new(BthRepr::new(opcode, Qpn::new(0x42), Psn::new(RQ + 50)), 8);
    r.ext.reth = Some(RethRepr { va: BASE, rkey: t.rkey, dma_len: 8 });
    t.feed_from(other, &r, &[1; 8]);
    assert_eq!(t.qp.stats().wrong_port, 0);
    t.out();
    // The expected PSN from the peer's port latches it; the same from another port is
    // dropped from then on.
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[2; 8]);
    let mut r = PacketRepr::new(BthRepr::new(opcode, Qpn::new(0x42), Psn::new(RQ + 1)), 8);
    r.ext.reth = Some(RethRepr { va: BASE, rkey: t.rkey, dma_len: 8 });
    t.feed_from(other, &r, &[3; 8]);
    assert_eq!(t.qp.stats().wrong_port, 1);
    assert_eq!(t.bytes()[0], 2);
    // A packet from another IP address is dropped before the port is looked at.
    t.feed_from("10.0.0.9:4791".parse().unwrap(), &r, &[4; 8]);
    assert_eq!(t.bytes()[0], 2);
    assert_eq!(t.qp.stats().wrong_port, 1);
    // A new remote (a reconnection) forgets the port: the other port may latch now.
    t.qp.modify(&QpAttr { state: Some(QpState::Reset), ..QpAttr::default() }).unwrap();
    for a in attrs(QpType::Rc) {
        t.qp.modify(&a).unwrap();
    }
    let mut r = PacketRepr::new(BthRepr::new(opcode, Qpn::new(0x42), Psn::new(RQ)), 8);
    r.ext.reth = Some(RethRepr { va: BASE, rkey: t.rkey, dma_len: 8 });
    t.feed_from(other, &r, &[5; 8]);
    assert_eq!(t.bytes()[0], 5);
    assert_eq!(t.qp.stats().wrong_port, 1);
}

// --- State transitions ---

#[test]
fn state_transitions_follow_the_verbs_rules() {
    let mut qp = QueuePair::new(Qpn::new(0x43), config(QpType::Rc));
    let [init, rtr, rts] = attrs(QpType::Rc);
    // RESET cannot go straight to RTR or RTS; RTR needs its attributes.
    assert!(qp.modify(&rts).is_err());
    assert!(qp.modify(&rtr).is_err());
    qp.modify(&init).unwrap();
    assert!(
        qp.modify(&QpAttr { state: Some(QpState::Rtr), ..QpAttr::default() }).is_err(),
        "RTR without a path"
    );
    assert_eq!(qp.state(), QpState::Init);
    // Receives may be posted in INIT; sends may not before RTS.
    qp.post_recv(RecvWr { wr_id: 1, sg_list: crate::sgl![] }).unwrap();
    let mem = SimMemory::new(2);
    let wr =
        SendWr { wr_id: 2, op: SendOp::Send, sg_list: crate::sgl![], flags: SendFlags::default(), ud: None };
    assert!(matches!(qp.post_send(wr.clone(), &mem), Err(PostError::InvalidState(QpState::Init))));
    qp.modify(&rtr).unwrap();
    qp.modify(&rts).unwrap();
    qp.post_send(wr, &mem).unwrap();
    // To ERROR: everything queued is flushed, receives included.
    qp.modify(&QpAttr { state: Some(QpState::Error), ..QpAttr::default() }).unwrap();
    assert_eq!(qp.poll_send_completion().map(|w| w.status), Some(WcStatus::WrFlushErr));
    assert_eq!(qp.poll_recv_completion().map(|w| (w.wr_id, w.status)), Some((1, WcStatus::WrFlushErr)));
    // ERROR goes only to RESET.
    assert!(qp.modify(&QpAttr { state: Some(QpState::Rts), ..QpAttr::default() }).is_err());
    qp.modify(&QpAttr { state: Some(QpState::Reset), ..QpAttr::default() }).unwrap();
    assert_eq!(qp.state(), QpState::Reset);
}

#[test]
fn packets_before_rtr_or_of_another_transport_are_dropped() {
    let mut qp = QueuePair::new(Qpn::new(0x44), config(QpType::Rc));
    let [init, ..] = attrs(QpType::Rc);
    qp.modify(&init).unwrap();
    let mut mem = SimMemory::new(3);
    let opcode = Opcode::from_parts(Transport::Rc, Operation::SendOnly).unwrap();
    let r = PacketRepr::new(BthRepr::new(opcode, Qpn::new(0x44), Psn::new(RQ)), 4);
    let mut b = vec![0u8; r.total_len()];
    r.emit(&mut b, &[1; 4], &icrc::Encap::new(peer(), me()).unwrap()).unwrap();
    qp.handle_packet(Duration::ZERO, peer(), 0, &Packet::new_checked(&b[..]).unwrap(), &mut mem, None);
    assert_eq!(qp.stats().dropped, 1, "INIT takes no packets");
    let mut t = T::new(QpType::Rc);
    let uc = Opcode::from_parts(Transport::Uc, Operation::SendOnly).unwrap();
    let r = PacketRepr::new(BthRepr::new(uc, Qpn::new(0x42), Psn::new(RQ)), 4);
    t.feed(&r, &[1; 4]);
    assert_eq!(t.qp.stats().dropped, 1, "an RC QP drops UC packets");
    assert!(t.out().is_empty());
}

#[test]
fn malformed_responses_fail_the_wqe_with_bad_response() {
    // A READ answered by a response of the wrong size, by a NAK in a READ response's
    // place, and an ACK with a reserved syndrome: BAD_RESP_ERR, and an invalid-RD NAK maps
    // to REM_INV_RD_REQ_ERR.
    fn read_resp(t: &mut T, op: Operation, len: usize, syndrome: AethSyndrome) {
        let opcode = Opcode::from_parts(Transport::Rc, op).unwrap();
        let mut r = PacketRepr::new(BthRepr::new(opcode, Qpn::new(0x42), Psn::new(SQ)), len);
        if opcode.headers().contains(crate::wire::HeaderKind::Aeth) {
            r.ext.aeth = Some(AethRepr { syndrome, msn: 0 });
        }
        t.feed(&r, &vec![7; len]);
    }
    let nak = AethSyndrome::Nak(NakCode::RemoteAccessError);
    let cases = [
        ("short ONLY", Operation::RdmaReadResponseOnly, 10, AethSyndrome::ACK),
        ("FIRST for a one-packet READ", Operation::RdmaReadResponseFirst, 1024, AethSyndrome::ACK),
        ("a NAK in a READ response", Operation::RdmaReadResponseOnly, 0, nak),
    ];
    // With selective recovery too, where a response may come at any position.
    for ((what, op, len, syndrome), selective) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
        let mut t = T::new(QpType::Rc);
        t.qp.set_selective(selective);
        t.post(1, SendOp::Read { remote_addr: 0, rkey: Rkey(9) }, 0x100, 100);
        assert_eq!(t.out().len(), 1);
        read_resp(&mut t, op, len, syndrome);
        let wc = t.sends();
        assert_eq!(wc.first().map(|w| w.status), Some(WcStatus::BadRespErr), "{what}, selective {selective}");
        assert!(t.bytes()[0x100..0x100 + 100].iter().enumerate().all(|(i, &b)| b == ((0x100 + i) * 7) as u8));
    }
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 10);
    t.out();
    t.ack(SQ, AethSyndrome::Nak(NakCode::InvalidRdRequest));
    assert_eq!(t.sends()[0].status, WcStatus::RemInvRdReqErr);
}

#[test]
fn an_atomic_ack_for_something_else_is_dropped() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 10);
    t.out();
    let opcode = Opcode::from_parts(Transport::Rc, Operation::AtomicAcknowledge).unwrap();
    let mut r = PacketRepr::new(BthRepr::new(opcode, Qpn::new(0x42), Psn::new(SQ)), 0);
    r.ext.aeth = Some(AethRepr { syndrome: AethSyndrome::ACK, msn: 0 });
    r.ext.atomic_ack_eth = Some(crate::wire::AtomicAckEthRepr { orig: 5 });
    let dropped = t.qp.stats().dropped;
    t.feed(&r, &[]);
    assert_eq!(t.qp.stats().dropped, dropped + 1);
    assert_eq!(t.qp.state(), QpState::Rts);
}

/// Every packet the QP sends now: (opcode code, BECN, TOS).
fn raw_out(t: &mut T) -> Vec<(u8, bool, u8)> {
    let mut v = Vec::new();
    while let Some(tx) = t.qp.poll_transmit(t.now, &mut t.buf, &t.mem) {
        let bytes = tx.assemble(&t.buf, &t.mem);
        let p = Packet::new_checked(&bytes[..]).unwrap();
        assert_eq!(p.bth().dest_qp().get(), PEER_QPN);
        v.push((p.opcode().code(), p.bth().becn(), tx.tos));
    }
    v
}

/// A SEND_ONLY from the peer at `psn` that arrived with IP TOS `tos`.
fn send_with_tos(t: &mut T, psn: u32, tos: u8) {
    let opcode = Opcode::from_parts(Transport::Rc, Operation::SendOnly).unwrap();
    let mut b = BthRepr::new(opcode, Qpn::new(0x42), Psn::new(psn));
    b.ack_req = true;
    let r = PacketRepr::new(b, 8);
    let mut bytes = vec![0u8; r.total_len()];
    r.emit(&mut bytes, &[1; 8], &icrc::Encap::new(peer(), me()).unwrap()).unwrap();
    let p = Packet::new_checked(&bytes[..]).unwrap();
    t.qp.handle_packet(t.now, peer(), tos, &p, &mut t.mem, None);
}

#[test]
fn a_congestion_mark_is_answered_with_one_cnp_per_interval() {
    let mut t = T::new(QpType::Rc);
    for k in 0..3 {
        t.qp.post_recv(RecvWr {
            wr_id: k,
            sg_list: crate::sgl![Sge { addr: BASE, length: 64, lkey: t.lkey }],
        })
        .unwrap();
    }
    // Not marked: an ACK, no CNP.
    send_with_tos(&mut t, RQ, 0b10);
    assert_eq!(raw_out(&mut t).iter().filter(|o| o.0 == 0x81).count(), 0);
    // Marked CE (0b11): the ACK and a CNP with BECN set, to the peer's QP.
    send_with_tos(&mut t, RQ + 1, 0b11);
    let out = raw_out(&mut t);
    assert!(out.iter().any(|&(op, becn, _)| op == 0x81 && becn), "{out:?}");
    // Another mark within 50 µs: no second CNP; after it, one more.
    send_with_tos(&mut t, RQ + 2, 0b11);
    assert_eq!(raw_out(&mut t).iter().filter(|o| o.0 == 0x81).count(), 0);
    t.now += Duration::from_micros(60);
    send_with_tos(&mut t, RQ + 2, 0b11); // a duplicate, marked: still congestion news
    assert_eq!(raw_out(&mut t).iter().filter(|o| o.0 == 0x81).count(), 1);
    let s = t.qp.stats();
    assert_eq!((s.ce_received, s.cnps_sent), (3, 2));
}

#[test]
fn requests_are_ecn_capable_and_cnps_shrink_the_window_that_acks_grow_back() {
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 8);
    let out = raw_out(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].2 & 3, 0b10, "ECT(0) on a request");
    t.ack(SQ, AethSyndrome::ACK);
    assert_eq!(t.qp.stats().cwnd, u64::from(MAX_INFLIGHT_PSNS));
    let cnp = |t: &mut T, from: SocketAddr| {
        let mut b = BthRepr::new(Opcode::new(0x81).unwrap(), Qpn::new(0x42), Psn::new(0));
        b.becn = true;
        t.feed_from(from, &PacketRepr::new(b, 0), &[]);
    };
    // A CNP from a stranger is ignored.
    cnp(&mut t, "192.0.2.99:4791".parse().unwrap());
    assert_eq!(t.qp.stats().cwnd, u64::from(MAX_INFLIGHT_PSNS));
    // CNPs from the peer, 100 µs apart, cut the window; it never reaches zero.
    let mut last = t.qp.stats().cwnd;
    for _ in 0..40 {
        t.now += Duration::from_micros(100);
        cnp(&mut t, peer());
        let w = t.qp.stats().cwnd;
        assert!(w <= last && w >= 1, "{w} after {last}");
        last = w;
    }
    assert!(last < 16, "forty CNPs leave a small window ({last})");
    assert_eq!(t.qp.stats().cnps_received, 40);
    // Two CNPs at once count as one cut.
    t.now += Duration::from_micros(100);
    cnp(&mut t, peer());
    let once = t.qp.stats().cwnd;
    cnp(&mut t, peer());
    assert_eq!(t.qp.stats().cwnd, once);
    // The window holds back packets: of 64 one-packet SENDs, `cwnd` leave before an ACK.
    for k in 0..64 {
        t.post(100 + k, SendOp::Send, 0, 8);
    }
    let sent = raw_out(&mut t).len() as u64;
    assert_eq!(sent, once, "as many packets in flight as the window");
    // ACKs grow it again, one PSN per window acknowledged.
    t.ack(SQ + sent as u32, AethSyndrome::ACK);
    assert!(t.qp.stats().cwnd > once, "{} after {once}", t.qp.stats().cwnd);
}

#[test]
fn a_zero_length_send_goes_after_the_ack_and_read_responses_are_not_ecn_capable() {
    let send = Opcode::from_parts(Transport::Rc, Operation::SendOnly).unwrap().code();
    let ack = Opcode::from_parts(Transport::Rc, Operation::Acknowledge).unwrap().code();
    // A zero-length SEND (16 bytes) is shorter than the ACK: it cannot end a train behind
    // it, so the ACK goes first, as before.
    let mut t = T::new(QpType::Rc);
    t.post(1, SendOp::Send, 0, 8);
    t.out();
    t.request(Operation::RdmaWriteOnly, RQ, BASE, &[1; 8]);
    assert!(t.out().is_empty());
    t.post(2, SendOp::Send, 0, 0);
    assert_eq!(raw_out(&mut t), vec![(ack, false, 0b10), (send, false, 0b10)]);
    // READ responses carry data, and nothing answers a CE mark on them: not ECN-capable.
    let mut t = T::new(QpType::Rc);
    t.request(Operation::RdmaReadRequest, RQ, BASE, &[]);
    let read_only = Opcode::from_parts(Transport::Rc, Operation::RdmaReadResponseOnly).unwrap().code();
    assert_eq!(raw_out(&mut t), vec![(read_only, false, 0)]);
}

/// An endpoint with RC QPs in RTS, QP `k` connected to the peer's QPN `PEER_QPN + k`, and
/// a 64 KiB region of every right.
struct Ep {
    ep: crate::endpoint::Endpoint,
    mem: SimMemory,
    lkey: Lkey,
    rkey: Rkey,
    qpns: Vec<Qpn>,
    buf: Vec<u8>,
    now: Duration,
}

impl Ep {
    fn new(qps: u32) -> Ep {
        Ep::with(qps, 1)
    }

    /// Shard 0 of two.
    fn new_shard(qps: u32) -> Ep {
        Ep::with(qps, 2)
    }

    fn with(qps: u32, shards: u32) -> Ep {
        let mut ep = crate::endpoint::Endpoint::new(me());
        ep.set_qpn_shard(0, shards);
        let mut mem = SimMemory::new(1);
        let (lkey, rkey) = mem.register(PdId(1), BASE, 65536, all()).unwrap();
        let mut qpns = Vec::new();
        for k in 0..qps {
            let q = ep.create_qp(config(QpType::Rc));
            for mut a in attrs(QpType::Rc) {
                if a.dest_qpn.is_some() {
                    a.dest_qpn = Some(Qpn::new(PEER_QPN + k));
                }
                ep.qp_mut(q).unwrap().modify(&a).unwrap();
            }
            qpns.push(q);
        }
        Ep { ep, mem, lkey, rkey, qpns, buf: vec![0; 9000], now: Duration::from_millis(1) }
    }

    /// An 8-byte unsignaled SEND on QP `k`.
    fn send(&mut self, k: usize, wr_id: u64, len: u32) {
        self.post(k, wr_id, len, SendOp::Send);
    }

    fn post(&mut self, k: usize, wr_id: u64, len: u32, op: SendOp) {
        let wr = SendWr {
            wr_id,
            op,
            sg_list: crate::sgl![Sge { addr: BASE, length: len, lkey: self.lkey }],
            flags: SendFlags::default(),
            ud: None,
        };
        self.ep.qp_mut(self.qpns[k]).unwrap().post_send(wr, &self.mem).unwrap();
    }

    /// Every datagram the endpoint sends now.
    fn out(&mut self) -> Vec<Vec<u8>> {
        let mut v = Vec::new();
        while let Some(t) = self.ep.poll_transmit(self.now, &mut self.buf, &self.mem) {
            v.push(t.assemble(&self.buf, &self.mem));
        }
        v
    }
}

#[test]
fn the_endpoint_keeps_a_request_and_its_following_ack_together() {
    // Two QPs of one endpoint with bundles off, each with a waiting ACK and a request
    // ready: each request is followed by its own QP's ACK, not by the other QP's request.
    let mut e = Ep::new(2);
    for k in 0..2 {
        e.send(k, 1, 8);
    }
    e.out();
    // A WRITE from the peer to each: their ACKs wait, for the QPs talk back.
    let encap = icrc::Encap::new(peer(), me()).unwrap();
    for q in e.qpns.clone() {
        let op = Opcode::from_parts(Transport::Rc, Operation::RdmaWriteOnly).unwrap();
        let mut b = BthRepr::new(op, q, Psn::new(RQ));
        b.ack_req = true;
        let mut r = PacketRepr::new(b, 8);
        r.ext.reth = Some(RethRepr { va: BASE, rkey: e.rkey, dma_len: 8 });
        let mut pkt = vec![0u8; 200];
        let n = r.emit(&mut pkt, &[5; 8], &encap).unwrap();
        e.ep.handle_datagram(e.now, crate::endpoint::Arrival::new(peer(), me()), &pkt[..n], &mut e.mem);
    }
    assert!(e.out().is_empty(), "the ACKs wait");
    for k in 0..2 {
        let q = e.qpns[k];
        e.ep.qp_mut(q).unwrap().set_bundle_acks(false);
        e.post(k, 2, 1024, SendOp::Write { remote_addr: 0x1000, rkey: Rkey(1) });
    }
    let order: Vec<(Operation, u32)> = e
        .out()
        .iter()
        .map(|d| Packet::new_checked(&d[..]).unwrap())
        .map(|p| (p.opcode().operation(), p.bth().dest_qp().get() - PEER_QPN))
        .collect();
    assert_eq!(
        order.iter().map(|o| o.0).collect::<Vec<_>>(),
        vec![
            Operation::RdmaWriteOnly,
            Operation::Acknowledge,
            Operation::RdmaWriteOnly,
            Operation::Acknowledge
        ],
        "{order:?}"
    );
    assert!(order[0].1 == order[1].1 && order[2].1 == order[3].1 && order[0].1 != order[2].1, "{order:?}");
}

/// Twelve SENDs of 8 bytes, each acknowledged `rtt` after it went (PSNs SQ to SQ + 11): a
/// measured round trip that hardly varies.
fn steady_round_trips(t: &mut T, rtt: Duration) {
    for k in 0..12 {
        t.post(k, SendOp::Send, 0, 8);
        assert_eq!(t.out().len(), 1);
        t.now += rtt;
        t.ack(SQ + k as u32, AethSyndrome::ACK);
        t.sends();
    }
}

#[test]
fn a_go_back_n_probe_waits_two_round_trips_even_when_they_hardly_vary() {
    // A stream's round trip is mostly its own queue: steady, so `4 * rttvar` is tiny. A
    // probe towards a peer that sends no SACKs resends the whole window, so it waits at
    // least two round trips, not one and a hair.
    let mut t = T::new(QpType::Rc);
    let rtt = Duration::from_micros(100);
    steady_round_trips(&mut t, rtt);
    t.post(99, SendOp::Send, 0, 8);
    t.out();
    let wait = t.qp.poll_timeout().expect("a probe") - t.now;
    assert!(wait >= 2 * rtt, "probe after {wait:?} with a steady {rtt:?} round trip");
    assert!(wait < 3 * rtt, "probe after {wait:?}");
}

#[test]
fn a_probe_waits_its_timeout_after_the_last_request_and_for_what_it_would_resend() {
    // The probe timer is armed when the first packet after progress goes. Towards a peer
    // that sends SACKs, with that one packet in flight, the wait is the shortest (a probe
    // that resends a packet or two costs little). A burst still being sent when that
    // wait runs out draws no probe: the wait counts from the last request sent, and is
    // that of a probe that would resend the whole burst.
    let mut t = T::new(QpType::Rc);
    let rtt = Duration::from_micros(100);
    steady_round_trips(&mut t, rtt);
    // A SACK peer from now on.
    t.post(12, SendOp::Send, 0, 8);
    t.out();
    t.now += rtt;
    sack(&mut t, SQ + 13, 0);
    assert_eq!(t.sends().len(), 1, "the SACK acknowledges the SEND");
    // The burst: one packet, then 20 more before its first wait is over.
    t.post(20, SendOp::Send, 0, 8);
    assert_eq!(t.out().len(), 1);
    let first = t.qp.poll_timeout().expect("a probe");
    t.now += (first - t.now) / 2;
    for k in 21..41 {
        t.post(k, SendOp::Send, 0, 8);
    }
    assert_eq!(t.out().len(), 20);
    let last_sent = t.now;
    t.now = first;
    t.qp.handle_timeout(t.now);
    assert!(t.out().is_empty(), "no probe while the burst's last packet is younger than a probe timeout");
    assert_eq!(t.qp.stats().probes, 0);
    let next = t.qp.poll_timeout().expect("a probe");
    assert!(
        next >= last_sent + rtt,
        "a probe timeout (a round trip and more) after the last request: {next:?}"
    );
    t.now = next;
    t.qp.handle_timeout(t.now);
    assert_eq!(t.qp.stats().probes, 1);
    let out = t.out();
    assert_eq!(
        out.first().map(|o| o.psn),
        Some(SQ + 13),
        "the probe resends from the first unacknowledged PSN"
    );
}

#[test]
fn the_endpoint_takes_ready_qps_in_turn() {
    // Packets of two QPs, none of them waiting for an ACK: one of each in turn, so that a
    // busy QP never starves another.
    let mut e = Ep::new(2);
    for k in 0..2 {
        for id in 0..3 {
            e.send(k, id, 8);
        }
    }
    let dests: Vec<u32> = e
        .out()
        .iter()
        .map(|d| Packet::new_checked(&d[..]).unwrap().bth().dest_qp().get() - PEER_QPN)
        .collect();
    assert_eq!(dests, vec![0, 1, 0, 1, 0, 1]);
}

#[test]
fn a_shards_endpoint_takes_ready_qps_in_turn_by_the_burst() {
    // On a shard of a device, each QP sends a burst in a row (its packets leave as a train
    // of their own, which a sharded receiver steers whole), and the QPs still take turns.
    let burst = crate::endpoint::BURST;
    let mut e = Ep::new_shard(2);
    for k in 0..2 {
        for id in 0..burst + 4 {
            e.send(k, u64::from(id), 8);
        }
    }
    let dests: Vec<u32> = e
        .out()
        .iter()
        .map(|d| Packet::new_checked(&d[..]).unwrap().bth().dest_qp().get() - PEER_QPN)
        .collect();
    let runs: Vec<(u32, usize)> = dests.chunk_by(|a, b| a == b).map(|r| (r[0], r.len())).collect();
    assert_eq!(runs, vec![(0, burst as usize), (1, burst as usize), (0, 4), (1, 4)]);
}

#[test]
fn a_loss_while_a_queue_stands_halves_the_window_and_is_counted() {
    // Round trips of 100 µs, then one of 1.5 ms (a queue of 1.4 ms, under the delay
    // reaction's target of 2.1 ms); a sequence NAK then reports a loss: the window halves
    // and `loss_cuts` counts it. The same loss on a path with no queue costs nothing.
    let run = |queued: bool| {
        let mut t = T::new(QpType::Rc);
        t.post(1, SendOp::Send, 0, 8);
        t.out();
        t.now += Duration::from_micros(100);
        t.ack(SQ, AethSyndrome::ACK);
        t.post(2, SendOp::Send, 0, 8);
        t.out();
        t.now += if queued { Duration::from_micros(1500) } else { Duration::from_micros(100) };
        t.ack(SQ + 1, AethSyndrome::ACK);
        for k in 3..5 {
            t.post(k, SendOp::Send, 0, 8);
        }
        t.out();
        t.ack(SQ + 2, AethSyndrome::Nak(NakCode::PsnSequenceError));
        let s = t.qp.stats();
        (s.loss_cuts, s.cwnd, s.delay_cuts)
    };
    let full = u64::from(MAX_INFLIGHT_PSNS);
    assert_eq!(run(true), (1, full / 2, 0));
    assert_eq!(run(false), (0, full, 0));
}
