//! The responder: checks incoming requests in rxe's order (PSN, opcode sequence, QP
//! access, resources, lengths, keys), executes them against memory, and queues the
//! answers — coalesced ACKs, NAKs, READ responses generated one packet at a time, atomic
//! ACKs. Duplicates are never executed twice: SENDs and WRITEs are re-ACKed, READs are
//! replayed from memory, atomics answered from a ring of saved results
//! (`max_dest_rd_atomic` deep).

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::psnset::PsnBits;
use super::{
    scatter, QpType, QueuePair, RecvSource, RecvWqe, Transmit, WcOpcode, WcStatus, WorkCompletion,
    MAX_MESSAGE,
};
use crate::memory::{Access, AtomicOp, MemError, MemKey, Memory, Segment};
use crate::wire::{
    pad_count, AethRepr, AethSyndrome, AtomicAckEthRepr, BthRepr, NakCode, Opcode, Operation, Packet,
    PacketRepr, Position, Transport,
};
use crate::{Psn, Rkey};

/// A multi-packet message being received.
enum Current {
    None,
    Send { wqe: RecvWqe, offset: u64 },
    Write { va: u64, rkey: Rkey, total: u64, done: u64 },
}

/// A READ or atomic remembered for duplicate handling.
enum Resource {
    Read { first: Psn, npsn: u32, va: u64, rkey: Rkey, len: u64 },
    Atomic { psn: Psn, orig: u64 },
}

/// An answer waiting to be sent.
enum Answer {
    Ack {
        psn: Psn,
        syndrome: AethSyndrome,
    },
    AtomicAck {
        psn: Psn,
        orig: u64,
    },
    Read {
        psn: Psn,
        va: u64,
        rkey: Rkey,
        len: u64,
        sent: u64,
    },
    /// A congestion notification (RoCEv2 CNP) for the requester.
    Cnp,
    /// A selective acknowledgement (softrdma peers only): the first missing PSN and what is
    /// held after it, as they stand when it is sent.
    Sack,
}

/// How far ahead of the expected PSN a responder holds request packets: the span of PSNs a
/// requester keeps outstanding towards it, which a SACK describes.
const HOLD_WINDOW: u32 = super::SACK_SPAN;

/// A request packet that arrived ahead of a gap and waits for it to be filled (selective
/// recovery): executed, in PSN order, once every PSN before it has been.
struct Held {
    psn: Psn,
    /// PSNs it stands for: 1, or a READ request's response PSNs.
    span: u32,
    bytes: Vec<u8>,
    src: SocketAddr,
}

/// CNPs a QP sends at most one of per interval (DCQCN's notification point rate).
const CNP_INTERVAL: Duration = Duration::from_micros(50);

pub(super) struct Responder {
    epsn: Psn,
    msn: u32,
    nak_sent: bool,
    cur: Current,
    uc_resync: bool,
    resources: VecDeque<Resource>,
    tx: VecDeque<Answer>,
    /// When the last CNP was queued.
    last_cnp: Option<Duration>,
    /// Packets held ahead of a gap, by PSN modulo HOLD_WINDOW (allocated on the first
    /// gap), and how many.
    held: Vec<Option<Held>>,
    held_count: usize,
    /// A positive ACK waiting alone may wait until then for a packet to go with.
    ack_at: Option<Duration>,
    /// When the last request came (see `QueuePair::pto`).
    pub(super) last_request: Option<Duration>,
    /// The ACK queued must go at once (it answers a duplicate, which a requester sends
    /// when it thinks the ACK lost, or says a gap was filled).
    ack_urgent: bool,
    /// The PSN of the last positive ACK sent.
    last_ack: Psn,
}

/// How long a positive ACK may wait for the QP's next request, so that both leave in one
/// system call (in a ping-pong, the pong carries the ping's ACK along).
pub(super) const ACK_DELAY: Duration = Duration::from_micros(100);
/// A QP that sent a request this recently talks back: its ACKs may wait for its next one.
pub(super) const TALKS_BACK: Duration = Duration::from_millis(1);
/// An ACK that would acknowledge this many PSNs more than the last one goes at once, so
/// that a stream's sender never waits on the delay.
const ACK_OWED_MAX: i32 = 16;

impl Responder {
    /// The next PSN expected from the requester.
    pub(super) fn expected_psn(&self) -> Psn {
        self.epsn
    }

    pub(super) fn new(rq_psn: Psn) -> Responder {
        Responder {
            epsn: rq_psn,
            msn: 0,
            nak_sent: false,
            cur: Current::None,
            uc_resync: false,
            resources: VecDeque::new(),
            tx: VecDeque::new(),
            last_cnp: None,
            held: Vec::new(),
            held_count: 0,
            ack_at: None,
            ack_urgent: false,
            last_request: None,
            last_ack: rq_psn - 1,
        }
    }

    pub(super) fn has_tx(&self) -> bool {
        !self.tx.is_empty()
    }

    /// The only answer waiting is a positive ACK that may still wait at `now`: it
    /// acknowledges few PSNs and its delay has not run out.
    pub(super) fn ack_may_wait(&self, now: Duration) -> bool {
        match (self.tx.front(), self.tx.len(), self.ack_at) {
            (Some(Answer::Ack { psn, syndrome: AethSyndrome::Ack { .. } }), 1, Some(at)) => {
                now < at && psn.distance(self.last_ack) < ACK_OWED_MAX
            }
            _ => false,
        }
    }

    /// When a waiting ACK must go (for the QP's timer).
    pub(super) fn ack_deadline(&self) -> Option<Duration> {
        self.ack_at.filter(|_| !self.tx.is_empty())
    }

    /// A waiting ACK may wait no longer.
    pub(super) fn ack_now(&mut self) {
        if self.ack_at.is_some() {
            self.ack_at = Some(Duration::ZERO);
        }
    }

    /// After a request was handled at `now`: a lone positive ACK starts its delay if the
    /// QP is expected to send a request soon (`wait`), else it may go at once.
    pub(super) fn schedule_ack(&mut self, now: Duration, wait: bool) {
        let urgent = std::mem::take(&mut self.ack_urgent);
        if self.tx.is_empty() {
            self.ack_at = None;
        } else if !wait || urgent {
            self.ack_at = Some(now);
        } else if self.ack_at.is_none() {
            self.ack_at = Some(now + ACK_DELAY);
        }
    }

    /// Forgets a half-received message and every held packet (the QP failed).
    pub(super) fn abandon_message(&mut self) {
        self.cur = Current::None;
        self.held.clear();
        self.held_count = 0;
    }

    fn queue_ack(&mut self, psn: Psn) {
        if self.held_count > 0 {
            // With a gap open, every acknowledgement says what is held beyond it.
            self.queue_sack();
            return;
        }
        // Coalesce: a later ACK covers every earlier one (and a SACK whose gap is filled).
        match self.tx.back_mut() {
            Some(Answer::Ack { psn: p, syndrome: AethSyndrome::Ack { .. } }) => {
                *p = psn;
                return;
            }
            Some(a @ Answer::Sack) => {
                *a = Answer::Ack { psn, syndrome: AethSyndrome::ACK };
                return;
            }
            _ => {}
        }
        self.tx.push_back(Answer::Ack { psn, syndrome: AethSyndrome::ACK });
    }

    /// Queues a SACK unless the last answer queued is one (or a positive ACK, which it
    /// replaces): a SACK is built when sent, from the state then.
    fn queue_sack(&mut self) {
        match self.tx.back_mut() {
            Some(Answer::Sack) => {}
            Some(a @ Answer::Ack { syndrome: AethSyndrome::Ack { .. }, .. }) => *a = Answer::Sack,
            _ => self.tx.push_back(Answer::Sack),
        }
    }

    /// Holds a request `d` PSNs ahead of the expected one. Returns false if it was held
    /// already (a duplicate).
    ///
    /// A second copy replaces the first. A requester's resend carries the same request, so
    /// this changes nothing for it; but a packet forged with the peer's address, port and
    /// QPN and a PSN inside the window most likely lands beyond what the requester has sent
    /// yet, and the real packet, coming later, must not be thrown away as its duplicate.
    fn hold(&mut self, pkt: &Packet<&[u8]>, src: SocketAddr, span: u32) -> bool {
        if self.held.is_empty() {
            self.held.resize_with(HOLD_WINDOW as usize, || None);
        }
        let psn = pkt.bth().psn();
        let slot = &mut self.held[(psn.get() % HOLD_WINDOW) as usize];
        let again = slot.as_ref().is_some_and(|h| h.psn == psn);
        if slot.is_none() {
            self.held_count += 1;
        }
        *slot = Some(Held { psn, span, bytes: pkt.as_bytes().to_vec(), src });
        !again
    }

    /// Takes the held packet with the expected PSN, if there is one.
    fn take_next(&mut self) -> Option<Held> {
        if self.held_count == 0 {
            return None;
        }
        let slot = &mut self.held[(self.epsn.get() % HOLD_WINDOW) as usize];
        if slot.as_ref().is_some_and(|h| h.psn == self.epsn) {
            self.held_count -= 1;
            return slot.take();
        }
        None
    }

    /// Drops held packets the expected PSN has passed (a READ executed in order covered
    /// their PSNs: only a broken requester sends those).
    fn drop_passed(&mut self) {
        if self.held_count == 0 {
            return;
        }
        let epsn = self.epsn;
        for slot in &mut self.held {
            if slot.as_ref().is_some_and(|h| h.psn.distance(epsn) < 0) {
                *slot = None;
                self.held_count -= 1;
            }
        }
    }

    /// The SACK bitmap: bit `i` for PSN `epsn + 1 + i` held (a held READ request covers
    /// its response PSNs too).
    fn sack_bitmap(&self) -> PsnBits {
        let mut bits = PsnBits::default();
        if self.held_count == 0 {
            return bits;
        }
        let mut i = 0u32;
        while i < HOLD_WINDOW {
            let psn = self.epsn + (i + 1);
            match &self.held[(psn.get() % HOLD_WINDOW) as usize] {
                Some(h) if h.psn == psn => {
                    let n = h.span.clamp(1, HOLD_WINDOW - i);
                    bits.set_range(i, n);
                    i += n;
                }
                _ => i += 1,
            }
        }
        bits
    }

    fn remember(&mut self, r: Resource, depth: u8) {
        if self.resources.len() >= usize::from(depth.max(1)) {
            self.resources.pop_front();
        }
        self.resources.push_back(r);
    }
}

/// Why a request failed at the responder.
enum Fault {
    /// NAK with this code; the QP goes to ERROR.
    Fatal(NakCode),
    /// RNR NAK; the packet is dropped and will be resent.
    Rnr,
}

impl From<MemError> for Fault {
    fn from(e: MemError) -> Fault {
        tracing::debug!(reason = %e, "memory access refused");
        match e {
            MemError::Misaligned => Fault::Fatal(NakCode::InvalidRequest),
            _ => Fault::Fatal(NakCode::RemoteAccessError),
        }
    }
}

impl QueuePair {
    pub(super) fn handle_request(
        &mut self,
        now: Duration,
        src: SocketAddr,
        tos: u8,
        pkt: &Packet<&[u8]>,
        mem: &mut dyn Memory,
        srq: RecvSource<'_, '_>,
    ) {
        // A router on the way marked the packet Congestion Experienced: tell the
        // requester with a CNP (RoCEv2, Annex A17.9.3), at most one per CNP_INTERVAL.
        if tos & 3 == 3 && self.cfg.qp_type != QpType::Ud {
            self.stats.ce_received += 1;
            if self.resp.last_cnp.is_none_or(|t| now >= t + CNP_INTERVAL) {
                self.resp.last_cnp = Some(now);
                self.resp.tx.push_back(Answer::Cnp);
            }
        }
        match self.cfg.qp_type {
            QpType::Ud => self.ud_receive(src, tos, pkt, mem, srq),
            QpType::Uc => self.uc_receive(src, pkt, mem, srq),
            QpType::Rc => self.rc_receive(src, pkt, mem, srq),
        }
    }

    fn rc_receive(
        &mut self,
        src: SocketAddr,
        pkt: &Packet<&[u8]>,
        mem: &mut dyn Memory,
        srq: RecvSource<'_, '_>,
    ) {
        let psn = pkt.bth().psn();
        let d = psn.distance(self.resp.epsn);
        // Selective recovery: keep what arrived ahead of the gap, say so, and execute it
        // once the gap is filled. A PSN beyond the hold window (no softrdma requester sends
        // one: its window is smaller) gets go-back-N's one sequence NAK per gap below.
        if d > 0 && d < HOLD_WINDOW as i32 && self.selective_peer() {
            let span = match (Kind::of(pkt.opcode().operation()), pkt.reth()) {
                (Kind::Read, Some(reth)) => {
                    u64::from(reth.dma_len()).div_ceil(u64::from(self.mtu.bytes())).max(1) as u32
                }
                _ => 1,
            };
            let new_gap = self.resp.held_count == 0;
            if !self.resp.hold(pkt, src, span) {
                self.stats.duplicates += 1;
            } else if new_gap {
                tracing::debug!(
                    psn = psn.get(),
                    expected = self.resp.epsn.get(),
                    "PSN ahead: held, SACK sent"
                );
            }
            self.stats.held += 1;
            self.resp.queue_sack();
            return;
        }
        if d > 0 {
            if !self.resp.nak_sent {
                tracing::debug!(
                    psn = psn.get(),
                    expected = self.resp.epsn.get(),
                    "PSN ahead: sequence NAK sent"
                );
                self.resp.nak_sent = true;
                self.stats.seq_naks_sent += 1;
                let epsn = self.resp.epsn;
                self.resp.tx.push_back(Answer::Ack {
                    psn: epsn,
                    syndrome: AethSyndrome::Nak(NakCode::PsnSequenceError),
                });
            }
            return;
        }
        if d < 0 {
            self.stats.duplicates += 1;
            self.duplicate(pkt, mem);
            return;
        }
        if !self.execute_in_order(src, pkt, mem, srq) {
            return;
        }
        // Packets held behind the gap this one filled (selective recovery), in order.
        let mut any = false;
        while let Some(h) = self.resp.take_next() {
            let Ok(p) = Packet::new_checked(&h.bytes[..]) else { continue };
            any = true;
            if !self.execute_in_order(h.src, &p, mem, srq) {
                return;
            }
        }
        if any {
            self.resp.drop_passed();
        }
        if any || self.resp.held_count > 0 {
            // Tell the requester at once what the gap's filling changed.
            let last = self.resp.epsn - 1;
            self.resp.queue_ack(last);
            self.resp.ack_urgent = true;
        }
    }

    /// Executes the request with the expected PSN and queues what answers a failure.
    /// Returns whether it was executed.
    fn execute_in_order(
        &mut self,
        src: SocketAddr,
        pkt: &Packet<&[u8]>,
        mem: &mut dyn Memory,
        srq: RecvSource<'_, '_>,
    ) -> bool {
        let psn = pkt.bth().psn();
        match self.execute(src, pkt, mem, srq) {
            Ok(()) => {
                self.resp.nak_sent = false;
                true
            }
            Err(Fault::Rnr) => {
                tracing::debug!(psn = psn.get(), "no receive posted: RNR NAK sent");
                self.stats.rnr_naks_sent += 1;
                let syndrome = AethSyndrome::RnrNak { timer: self.min_rnr_timer };
                self.resp.tx.push_back(Answer::Ack { psn, syndrome });
                false
            }
            Err(Fault::Fatal(code)) => {
                self.responder_fatal(psn, code);
                false
            }
        }
    }

    /// NAKs `psn` with `code` and fails the QP; the NAK still goes out.
    fn responder_fatal(&mut self, psn: Psn, code: NakCode) {
        tracing::warn!(psn = psn.get(), nak = %code, "NAK sent; the QP goes to ERROR");
        if let Current::Send { wqe, .. } = std::mem::replace(&mut self.resp.cur, Current::None) {
            let status =
                if code == NakCode::InvalidRequest { WcStatus::LocLenErr } else { WcStatus::LocProtErr };
            self.recv_cq.push_back(self.wc(wqe.wr_id, status, WcOpcode::Recv));
        }
        self.resp.tx.push_back(Answer::Ack { psn, syndrome: AethSyndrome::Nak(code) });
        self.enter_error();
    }

    fn execute(
        &mut self,
        src: SocketAddr,
        pkt: &Packet<&[u8]>,
        mem: &mut dyn Memory,
        srq: RecvSource<'_, '_>,
    ) -> Result<(), Fault> {
        let inv = Fault::Fatal(NakCode::InvalidRequest);
        let op = pkt.opcode();
        let bth = pkt.bth();
        let psn = bth.psn();
        let pos = op.position();
        if matches!(op.operation(), Operation::Flush | Operation::AtomicWrite) {
            // Not implemented by softrdma's responder.
            return Err(inv);
        }
        let kind = Kind::of(op.operation());
        // Opcode sequence: a message started must be continued by its own kind.
        let seq_ok = match (&self.resp.cur, pos) {
            (Current::Send { .. }, Position::Middle | Position::Last) => kind == Kind::Send,
            (Current::Write { .. }, Position::Middle | Position::Last) => kind == Kind::Write,
            (Current::None, Position::First | Position::Only) => true,
            _ => false,
        };
        if !seq_ok {
            return Err(inv);
        }
        let need = match kind {
            Kind::Read => Access::REMOTE_READ,
            Kind::Write => Access::REMOTE_WRITE,
            Kind::Atomic => Access::REMOTE_ATOMIC,
            Kind::Send => Access::NONE,
        };
        if !self.access_allows(need) {
            return Err(inv);
        }
        if matches!(kind, Kind::Read | Kind::Atomic) && self.max_dest_rd_atomic == 0 {
            return Err(inv);
        }
        let pmtu = u64::from(self.mtu.bytes());
        let data = pkt.payload();
        let plen = data.len() as u64;
        let len_ok = match pos {
            Position::First | Position::Middle => plen == pmtu,
            Position::Last => plen >= 1 && plen <= pmtu,
            Position::Only => plen <= pmtu,
        };
        if !len_ok {
            return Err(inv);
        }
        if op.consumes_recv_wqe() && self.rq_is_empty(srq) {
            return Err(Fault::Rnr);
        }
        let pd = self.cfg.pd;
        match kind {
            Kind::Send => {
                if matches!(pos, Position::First | Position::Only) {
                    let wqe = self.rq_take(srq).ok_or(Fault::Rnr)?;
                    self.resp.cur = Current::Send { wqe, offset: 0 };
                }
                let Current::Send { wqe, offset } = &mut self.resp.cur else { return Err(inv) };
                if *offset + plen > wqe.len {
                    return Err(inv);
                }
                if scatter(mem, pd, &wqe.sgl, *offset, data).is_err() {
                    return Err(Fault::Fatal(NakCode::RemoteOperationalError));
                }
                *offset += plen;
                if matches!(pos, Position::Last | Position::Only) {
                    let Current::Send { wqe, offset } = std::mem::replace(&mut self.resp.cur, Current::None)
                    else {
                        return Err(inv);
                    };
                    let invalidated = pkt.ieth().map(|h| h.rkey());
                    if let Some(rkey) = invalidated {
                        if mem.invalidate(pd, rkey).is_err() {
                            self.recv_cq.push_back(self.wc(
                                wqe.wr_id,
                                WcStatus::RemInvReqErr,
                                WcOpcode::Recv,
                            ));
                            self.enter_error();
                            return Ok(());
                        }
                    }
                    self.resp.msn = self.resp.msn.wrapping_add(1);
                    let wc = WorkCompletion {
                        byte_len: offset as u32,
                        imm_data: pkt.immdt().map(|h| h.value()),
                        invalidated_rkey: invalidated,
                        src_qp: self.dest_qpn,
                        src: Some(src),
                        solicited: bth.solicited(),
                        ..self.wc(wqe.wr_id, WcStatus::Success, WcOpcode::Recv)
                    };
                    self.recv_cq.push_back(wc);
                }
            }
            Kind::Write => {
                if let Some(reth) = pkt.reth() {
                    let total = u64::from(reth.dma_len());
                    if total > MAX_MESSAGE || (pos == Position::Only && plen != total) {
                        return Err(inv);
                    }
                    if total > 0 {
                        mem.check(pd, MemKey::Remote(reth.rkey()), reth.va(), total, Access::REMOTE_WRITE)?;
                    }
                    self.resp.cur = Current::Write { va: reth.va(), rkey: reth.rkey(), total, done: 0 };
                }
                let Current::Write { va, rkey, total, done } = &mut self.resp.cur else { return Err(inv) };
                let last = matches!(pos, Position::Last | Position::Only);
                if *done + plen > *total || (last && *done + plen != *total) {
                    return Err(inv);
                }
                if last && pkt.pad_count() != pad_count(data.len()) {
                    return Err(inv);
                }
                if plen > 0 {
                    mem.write(pd, MemKey::Remote(*rkey), va.wrapping_add(*done), data, Access::REMOTE_WRITE)?;
                }
                *done += plen;
                if last {
                    let total = *total;
                    self.resp.cur = Current::None;
                    self.resp.msn = self.resp.msn.wrapping_add(1);
                    if op.consumes_recv_wqe() {
                        let wqe = self.rq_take(srq).ok_or(Fault::Rnr)?;
                        let wc = WorkCompletion {
                            byte_len: total as u32,
                            imm_data: pkt.immdt().map(|h| h.value()),
                            src_qp: self.dest_qpn,
                            src: Some(src),
                            solicited: bth.solicited(),
                            ..self.wc(wqe.wr_id, WcStatus::Success, WcOpcode::RecvRdmaWithImm)
                        };
                        self.recv_cq.push_back(wc);
                    }
                }
            }
            Kind::Read => {
                let reth = pkt.reth().ok_or(Fault::Fatal(NakCode::InvalidRequest))?;
                let len = u64::from(reth.dma_len());
                if len > MAX_MESSAGE {
                    return Err(inv);
                }
                if len > 0 {
                    mem.check(pd, MemKey::Remote(reth.rkey()), reth.va(), len, Access::REMOTE_READ)?;
                }
                let npsn = len.div_ceil(pmtu).max(1) as u32;
                self.resp.msn = self.resp.msn.wrapping_add(1);
                let depth = self.max_dest_rd_atomic;
                self.resp.remember(
                    Resource::Read { first: psn, npsn, va: reth.va(), rkey: reth.rkey(), len },
                    depth,
                );
                self.resp.tx.push_back(Answer::Read { psn, va: reth.va(), rkey: reth.rkey(), len, sent: 0 });
                self.resp.epsn = psn + npsn;
                return Ok(());
            }
            Kind::Atomic => {
                let a = pkt.atomic_eth().ok_or(Fault::Fatal(NakCode::InvalidRequest))?;
                if a.va() % 8 != 0 {
                    return Err(inv);
                }
                let aop = if op.operation() == Operation::CompareSwap {
                    AtomicOp::CompareSwap { compare: a.compare(), swap: a.swap_add() }
                } else {
                    AtomicOp::FetchAdd { add: a.swap_add() }
                };
                let orig = mem.atomic(pd, MemKey::Remote(a.rkey()), a.va(), aop)?;
                self.resp.msn = self.resp.msn.wrapping_add(1);
                let depth = self.max_dest_rd_atomic;
                self.resp.remember(Resource::Atomic { psn, orig }, depth);
                self.resp.tx.push_back(Answer::AtomicAck { psn, orig });
                self.resp.epsn = psn + 1;
                return Ok(());
            }
        }
        self.resp.epsn = psn + 1;
        if bth.ack_req() {
            self.resp.queue_ack(psn);
        }
        Ok(())
    }

    fn duplicate(&mut self, pkt: &Packet<&[u8]>, mem: &mut dyn Memory) {
        let psn = pkt.bth().psn();
        // A duplicate READ or atomic queues a replay. A requester retransmits at most its
        // outstanding ones, so more than that queued means a flood, and replaying it would
        // amplify it: answer duplicates only while few answers wait.
        let limit = 2 * usize::from(self.max_dest_rd_atomic.max(1)) + 8;
        if self.resp.tx.len() >= limit {
            self.stats.dropped += 1;
            return;
        }
        match Kind::of(pkt.opcode().operation()) {
            Kind::Send | Kind::Write => {
                let last = self.resp.epsn - 1;
                self.resp.queue_ack(last);
                // The requester sent it again because it heard no ACK: one now, not later.
                self.resp.ack_urgent = true;
            }
            Kind::Read => {
                let Some(reth) = pkt.reth() else { return };
                let pmtu = u64::from(self.mtu.bytes());
                let found = self.resp.resources.iter().find_map(|r| match *r {
                    Resource::Read { first, npsn, va, rkey, len } => {
                        let k = psn.distance(first);
                        (k >= 0 && (k as u32) < npsn).then_some((k as u64, va, rkey, len))
                    }
                    Resource::Atomic { .. } => None,
                });
                let Some((k, va, rkey, len)) = found else { return };
                let (rva, rlen) = (reth.va(), u64::from(reth.dma_len()));
                // A restart asks for the tail from this PSN on, of the same region; a
                // softrdma requester may ask for less, the responses it is missing
                // (see the completer's `on_read_response`).
                let start = k * pmtu;
                if reth.rkey() != rkey || rva != va.wrapping_add(start) || start + rlen > len {
                    return;
                }
                if rlen > 0
                    && mem.check(self.cfg.pd, MemKey::Remote(rkey), rva, rlen, Access::REMOTE_READ).is_err()
                {
                    return;
                }
                self.resp.tx.push_back(Answer::Read { psn, va: rva, rkey, len: rlen, sent: 0 });
            }
            Kind::Atomic => {
                let saved = self.resp.resources.iter().find_map(|r| match *r {
                    Resource::Atomic { psn: p, orig } if p == psn => Some(orig),
                    _ => None,
                });
                if let Some(orig) = saved {
                    self.resp.tx.push_back(Answer::AtomicAck { psn, orig });
                }
            }
        }
    }

    fn uc_receive(
        &mut self,
        src: SocketAddr,
        pkt: &Packet<&[u8]>,
        mem: &mut dyn Memory,
        srq: RecvSource<'_, '_>,
    ) {
        let psn = pkt.bth().psn();
        let starts = matches!(pkt.opcode().position(), Position::First | Position::Only);
        let d = psn.distance(self.resp.epsn);
        if d < 0 {
            self.stats.duplicates += 1;
            return;
        }
        if d > 0 || self.resp.uc_resync {
            // A gap: drop the rest of the message and resynchronise on the next FIRST or
            // ONLY. The half-filled receive WQE is reused.
            self.abandon_uc_message(srq);
            if !starts {
                self.resp.uc_resync = true;
                self.stats.dropped += 1;
                return;
            }
            self.resp.uc_resync = false;
            self.resp.epsn = psn;
        }
        if self.execute(src, pkt, mem, srq).is_err() {
            // UC has no NAKs: the message is lost.
            self.abandon_uc_message(srq);
            self.resp.uc_resync = true;
            self.resp.epsn = psn + 1;
            self.stats.dropped += 1;
        }
        // UC never acknowledges.
        self.resp.tx.clear();
    }

    fn abandon_uc_message(&mut self, srq: RecvSource<'_, '_>) {
        if let Current::Send { wqe, .. } = std::mem::replace(&mut self.resp.cur, Current::None) {
            self.rq_return(srq, wqe);
        }
    }

    fn ud_receive(
        &mut self,
        src: SocketAddr,
        tos: u8,
        pkt: &Packet<&[u8]>,
        mem: &mut dyn Memory,
        srq: RecvSource<'_, '_>,
    ) {
        let Some(deth) = pkt.deth() else { return };
        if deth.qkey() != self.qkey {
            tracing::debug!(qkey = %format_args!("{:#x}", deth.qkey().0), "dropped: Q_Key mismatch");
            self.stats.dropped += 1;
            return;
        }
        let Some(wqe) = self.rq_take(srq) else {
            tracing::debug!("dropped: UD datagram with no receive posted");
            self.stats.dropped += 1;
            return;
        };
        let data = pkt.payload();
        let mut wc = WorkCompletion {
            imm_data: pkt.immdt().map(|h| h.value()),
            src_qp: deth.src_qp(),
            src: Some(src),
            grh: true,
            solicited: pkt.bth().solicited(),
            ..self.wc(wqe.wr_id, WcStatus::Success, WcOpcode::Recv)
        };
        let needed = 40 + data.len() as u64;
        if needed > wqe.len {
            wc.status = WcStatus::LocLenErr;
            self.recv_cq.push_back(wc);
            return;
        }
        let dst = self.mcast_dst.unwrap_or(self.cfg.local.ip());
        let grh = grh_area(src.ip(), dst, tos, pkt.as_bytes().len());
        let pd = self.cfg.pd;
        if scatter(mem, pd, &wqe.sgl, 0, &grh).and_then(|_| scatter(mem, pd, &wqe.sgl, 40, data)).is_err() {
            wc.status = WcStatus::LocProtErr;
        } else {
            wc.byte_len = needed as u32;
        }
        self.recv_cq.push_back(wc);
    }

    /// The next answer to send at `now`: one ACK, NAK, SACK, CNP or atomic ACK, or one READ
    /// response packet. A lone positive ACK waits (up to [`ACK_DELAY`])
    /// unless a request of this QP is ready to go with it in the same batch.
    pub(super) fn next_response(
        &mut self,
        now: Duration,
        buf: &mut [u8],
        mem: &dyn Memory,
    ) -> Option<Transmit> {
        if self.resp.ack_may_wait(now) && !self.requests_ready() {
            return None;
        }
        let dst = self.peer()?;
        let dest_qp = self.dest_qpn;
        let msn = self.resp.msn;
        let pmtu = u64::from(self.mtu.bytes());
        let rc = |op| Opcode::from_parts(Transport::Rc, op);
        let front = self.resp.tx.front_mut()?;
        let positive = matches!(*front, Answer::Ack { syndrome: AethSyndrome::Ack { .. }, .. });
        let (repr, payload, done) = match *front {
            Answer::Ack { psn, syndrome } => {
                let mut r = PacketRepr::new(BthRepr::new(rc(Operation::Acknowledge)?, dest_qp, psn), 0);
                r.ext.aeth = Some(AethRepr { syndrome, msn });
                (r, crate::memory::Segments::Empty, true)
            }
            Answer::Sack => {
                self.resp.tx.pop_front();
                // A SACK is built when it goes, from the state then: it would acknowledge
                // READs and atomics executed since it was queued, ahead of their answers
                // queued behind it, and the requester takes an acknowledgement past a READ
                // for its responses all sent. It goes after them instead.
                if self.resp.tx.iter().any(|a| matches!(a, Answer::Read { .. } | Answer::AtomicAck { .. })) {
                    if !matches!(self.resp.tx.back(), Some(Answer::Sack)) {
                        self.resp.tx.push_back(Answer::Sack);
                    }
                    return self.next_response(now, buf, mem);
                }
                let bits = self.resp.sack_bitmap();
                if bits.is_empty() {
                    // The gap was filled since: a plain ACK says it all.
                    let psn = self.resp.epsn - 1;
                    self.resp.tx.push_front(Answer::Ack { psn, syndrome: AethSyndrome::ACK });
                    return self.next_response(now, buf, mem);
                }
                self.stats.sacks_sent += 1;
                let repr = PacketRepr::new(
                    BthRepr::new(Opcode::new(0xC0)?, dest_qp, self.resp.epsn),
                    PsnBits::BYTES,
                );
                let head_len = Self::emit_head(&repr, buf, &bits.to_le_bytes())?;
                return self
                    .finish_packet(dst, buf, head_len, crate::memory::Segments::Empty, 0, false, mem)
                    .ok();
            }
            Answer::Cnp => {
                let mut bth = BthRepr::new(Opcode::new(0x81)?, dest_qp, Psn::new(0));
                bth.becn = true;
                self.stats.cnps_sent += 1;
                (PacketRepr::new(bth, 0), crate::memory::Segments::Empty, true)
            }
            Answer::AtomicAck { psn, orig } => {
                let mut r = PacketRepr::new(BthRepr::new(rc(Operation::AtomicAcknowledge)?, dest_qp, psn), 0);
                r.ext.aeth = Some(AethRepr { syndrome: AethSyndrome::ACK, msn });
                r.ext.atomic_ack_eth = Some(AtomicAckEthRepr { orig });
                (r, crate::memory::Segments::Empty, true)
            }
            Answer::Read { psn, va, rkey, len, ref mut sent } => {
                let plen = (len - *sent).min(pmtu);
                let idx = *sent / pmtu;
                let last = *sent + plen == len;
                let op = match (len <= pmtu, idx == 0, last) {
                    (true, _, _) => Operation::RdmaReadResponseOnly,
                    (false, true, _) => Operation::RdmaReadResponseFirst,
                    (false, false, true) => Operation::RdmaReadResponseLast,
                    (false, false, false) => Operation::RdmaReadResponseMiddle,
                };
                let opcode = rc(op)?;
                let mut r = PacketRepr::new(BthRepr::new(opcode, dest_qp, psn + idx as u32), plen as usize);
                if opcode.headers().contains(crate::wire::HeaderKind::Aeth) {
                    r.ext.aeth = Some(AethRepr { syndrome: AethSyndrome::ACK, msn });
                }
                let seg =
                    Segment { key: MemKey::Remote(rkey), addr: va.wrapping_add(*sent), len: plen as u32 };
                *sent += plen;
                (
                    r,
                    if plen > 0 { crate::memory::Segments::One(seg) } else { crate::memory::Segments::Empty },
                    last,
                )
            }
        };
        if done {
            self.resp.tx.pop_front();
            if positive {
                self.resp.last_ack = repr.bth.psn;
            }
            if self.resp.tx.is_empty() {
                self.resp.ack_at = None;
            }
        }
        let head_len = repr.emit_headers(buf).ok()?;
        let pad = usize::from(pad_count(repr.payload_len));
        match self.finish_packet(dst, buf, head_len, payload, pad, false, mem) {
            Ok(t) => Some(t),
            Err(_) => {
                // The region went away while its READ was being answered.
                let psn = repr.bth.psn;
                self.resp.tx.clear();
                self.responder_fatal(psn, NakCode::RemoteAccessError);
                self.next_response(now, buf, mem)
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    Write,
    Read,
    Atomic,
}

impl Kind {
    fn of(op: Operation) -> Kind {
        use Operation as O;
        match op {
            O::RdmaWriteFirst
            | O::RdmaWriteMiddle
            | O::RdmaWriteLast
            | O::RdmaWriteLastWithImmediate
            | O::RdmaWriteOnly
            | O::RdmaWriteOnlyWithImmediate
            | O::AtomicWrite
            | O::Flush => Kind::Write,
            O::RdmaReadRequest => Kind::Read,
            O::CompareSwap | O::FetchAdd => Kind::Atomic,
            _ => Kind::Send,
        }
    }
}

/// The 40 bytes a UD receive buffer starts with: the IPv6 header, or for IPv4 twenty zero
/// bytes and the IPv4 header. A socket does not show the real header, so it is rebuilt from
/// what is known (addresses, TOS, lengths; TTL 64, DF, ID 0), with a valid IPv4 checksum, which
/// is what consumers such as `ib_get_rdma_header_version` look at.
fn grh_area(src: IpAddr, dst: IpAddr, tos: u8, udp_payload_len: usize) -> [u8; 40] {
    use crate::wire::ip::{Ipv4Repr, Ipv6Repr, PROTO_UDP};
    let mut g = [0u8; 40];
    let udp_len = 8 + udp_payload_len;
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            if let Some(h) = Ipv4Repr::canonical(s, d, tos, udp_len as u16) {
                let mut b = [0u8; 20];
                h.emit(&mut b);
                g[20..].copy_from_slice(&b);
            }
        }
        (s, d) => {
            let v6 = |a: IpAddr| match a {
                IpAddr::V4(v) => v.to_ipv6_mapped(),
                IpAddr::V6(v) => v,
            };
            let h = Ipv6Repr {
                src: v6(s),
                dst: v6(d),
                traffic_class: tos,
                flow_label: 0,
                payload_len: udp_len as u16,
                next_header: PROTO_UDP,
                hop_limit: 64,
            };
            h.emit(&mut g);
        }
    }
    g
}
