//! The RC completer: ACKs, NAKs, READ responses and atomic ACKs, turned into completions in
//! SQ order, retries and error states.

use std::time::Duration;

use super::psnset::PsnBits;
use super::{scatter, QueuePair, SendOp, WcStatus, SACK_SPAN};
use crate::memory::Memory;
use crate::wire::{rnr_timer_us, AethSyndrome, NakCode, Operation, Packet, PayloadRule};
use crate::Psn;

impl QueuePair {
    pub(super) fn handle_response(&mut self, now: Duration, pkt: &Packet<&[u8]>, mem: &mut dyn Memory) {
        if self.cfg.qp_type != super::QpType::Rc {
            self.stats.dropped += 1;
            return;
        }
        // The peer answers: a resend that is still missing a round trip from now was lost.
        self.req.resend_armed = true;
        let psn = pkt.bth().psn();
        let syndrome = pkt.aeth().map(|a| AethSyndrome::from_byte(a.syndrome_raw()));
        let op = pkt.opcode().operation();
        if op == Operation::Sack {
            self.on_sack_packet(now, pkt, psn);
            return;
        }
        if op == Operation::Acknowledge
            && matches!(syndrome, Some(Ok(AethSyndrome::Ack { .. })))
            && self.req.sack_peer
            && !self.req.outstanding(psn)
            && self.req.sent_after_rewind(psn)
        {
            // An ACK of PSNs the send position went back past (selective recovery):
            // they count as held, so the resends skip them.
            self.req.on_sack(now, psn + 1, &PsnBits::default());
            let p = self.req.next_psn - 1;
            self.on_ack(now, p);
            return;
        }
        // A response can only be for something sent and not yet acknowledged.
        if !self.req.outstanding(psn) {
            tracing::debug!(psn = psn.get(), "dropped: response for a PSN not outstanding");
            self.stats.dropped += 1;
            return;
        }
        match op {
            Operation::Acknowledge => match syndrome {
                Some(Ok(AethSyndrome::Ack { .. })) => {
                    self.on_ack(now, psn);
                }
                Some(Ok(AethSyndrome::Nak(NakCode::PsnSequenceError))) => {
                    tracing::debug!(psn = psn.get(), "sequence NAK received: going back");
                    self.stats.seq_naks_received += 1;
                    self.req.on_lost(now);
                    // The peer threw away what came after `psn`: whatever it does not hold
                    // goes again (a peer that takes ACKs past a READ for SACKs may be one
                    // that goes back N).
                    if !self.on_ack(now, psn - 1) && self.req.go_back_guard != Some(psn) {
                        if self.req.sack_peer {
                            self.req.restart_recovery(false);
                        }
                        self.req.go_back_guard = Some(psn);
                        self.go_back(psn);
                    }
                }
                Some(Ok(AethSyndrome::RnrNak { timer })) => {
                    tracing::debug!(
                        psn = psn.get(),
                        timer,
                        "RNR NAK received: the peer has no receive posted"
                    );
                    self.stats.rnr_naks_received += 1;
                    if self.on_ack(now, psn - 1) {
                        return;
                    }
                    if self.req.rnr_left == 0 {
                        // Not while a READ or atomic before the refused request waits for
                        // its answer: the failure is the refused request's, when it is at
                        // the front.
                        let waiting = self.req.send_idx > 0
                            && self.sq.front().is_some_and(|w| {
                                w.op.is_read_or_atomic() && !w.answered && w.last_psn().distance(psn) < 0
                            });
                        if !waiting {
                            self.fail_front(WcStatus::RnrRetryExcErr);
                            return;
                        }
                    } else if self.rnr_retry != 7 {
                        self.req.rnr_left -= 1;
                    }
                    // The peer dropped the request it could not take; it may drop held ones
                    // too: resend everything from there.
                    self.req.restart_recovery(true);
                    self.go_back(psn);
                    self.req.ack_deadline = None;
                    self.req.rnr_until = Some(now + Duration::from_micros(u64::from(rnr_timer_us(timer))));
                }
                Some(Ok(AethSyndrome::Nak(code))) => {
                    tracing::warn!(psn = psn.get(), nak = %code, "NAK received");
                    self.on_ack(now, psn - 1);
                    let status = match code {
                        NakCode::InvalidRequest => WcStatus::RemInvReqErr,
                        NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                        NakCode::InvalidRdRequest => WcStatus::RemInvRdReqErr,
                        _ => WcStatus::RemOpErr,
                    };
                    self.fail_front(status);
                }
                _ => self.fail_front(WcStatus::BadRespErr),
            },
            Operation::AtomicAcknowledge => {
                self.ack_before(psn);
                self.reads_answered_before(psn);
                // The front atomic's answer, or a later one's while an earlier WQE waits
                // (kept: the atomic is not asked for again).
                let Some(k) = self.sent_wqe(|w| w.op.is_atomic() && w.first_psn == psn) else {
                    self.stats.dropped += 1;
                    return;
                };
                let w = &self.sq[k];
                if w.answered {
                    self.stats.dropped += 1;
                    return;
                }
                let orig = pkt.atomic_ack_eth().map_or(0, |h| h.orig());
                let sgl = w.sgl.clone();
                let placed = scatter(mem, self.cfg.pd, &sgl, 0, &orig.to_ne_bytes()).is_ok();
                if k > 0 {
                    // A failure shows when the atomic reaches the front and is asked again.
                    self.sq[k].answered = placed;
                    return;
                }
                if !placed {
                    self.fail_front(WcStatus::LocProtErr);
                    return;
                }
                self.req.acked_psn = psn;
                self.complete_front(WcStatus::Success);
                self.progress(now);
                self.ack_held_back(now);
            }
            _ => self.on_read_response(now, pkt, psn, syndrome, mem),
        }
    }

    /// The first WQE sent at least once (so a go-back may have rewound past it) for which
    /// `f` holds.
    fn sent_wqe(&self, f: impl Fn(&super::SendWqe) -> bool) -> Option<usize> {
        self.sq.iter().take_while(|w| w.npsn > 0).position(f)
    }

    /// A SACK (selective recovery, see `QueuePair::set_selective`): every PSN before
    /// `first_missing` arrived, and the payload's bitmap says which after it did.
    fn on_sack_packet(&mut self, now: Duration, pkt: &Packet<&[u8]>, first_missing: Psn) {
        // Valid when it acknowledges something sent: its first missing PSN lies after the
        // acknowledged ones and at most one past the highest PSN sent (everything sent
        // arrived; the bitmap may then show only packets the requester never sent, held
        // by the responder although forged, which `on_sack` ignores).
        let valid = first_missing.distance(self.req.acked_psn) > 0
            && first_missing.distance(self.req.max_sent + 1) <= 0;
        let Ok(bits) = <[u8; PsnBits::BYTES]>::try_from(pkt.payload()) else {
            self.stats.dropped += 1;
            return;
        };
        if !valid {
            self.stats.dropped += 1;
            return;
        }
        self.stats.sacks_received += 1;
        // Everything before the first missing PSN arrived: a cumulative ACK, as far as the
        // send position (a go-back may have rewound it: the bitmap keeps the rest).
        let mut cum = first_missing - 1;
        if !self.req.outstanding(cum) && cum.distance(self.req.acked_psn) > 0 {
            cum = self.req.next_psn - 1;
        }
        let went_back = self.on_ack(now, cum);
        let (news, lost) = self.req.on_sack(now, first_missing, &PsnBits::from_le_bytes(&bits));
        if news {
            // The peer is receiving: the probe waits from now (what is lost is resent
            // below, on the SACK's word).
            self.req.probe_at = self.pto(now).map(|t| now + t);
        }
        if let (false, Some(lost)) = (went_back, lost) {
            // Resend from the first lost PSN, unless the send position is before it.
            if self.send_position().distance(lost) > 0 {
                self.go_back(lost);
            }
        }
    }

    /// Completes the SENDs and WRITEs that end before `psn`: a response for `psn` implies
    /// every earlier request was received.
    fn ack_before(&mut self, psn: Psn) {
        let mut any = false;
        while let Some(w) = self.sq.front() {
            let sent = self.req.send_idx > 0;
            if !sent
                || w.npsn == 0
                || (w.op.is_read_or_atomic() && !w.answered)
                || w.last_psn().distance(psn) >= 0
            {
                break;
            }
            self.req.acked_psn = w.last_psn();
            self.complete_front(WcStatus::Success);
            any = true;
        }
        if any {
            self.req.go_back_guard = None;
        }
    }

    /// Handles a cumulative ACK of every PSN up to `p`. Returns true if it found a READ or
    /// atomic whose response must have been lost, and went back to it.
    fn on_ack(&mut self, now: Duration, p: Psn) -> bool {
        if p.distance(self.req.acked_psn) <= 0 {
            return false;
        }
        let pmtu = self.mtu.bytes();
        if p.distance(self.req.peer_acked) > 0 {
            self.req.peer_acked = p;
        }
        self.stale_read_asks(now);
        self.reads_answered_before(p + 1);
        let mut went_back = false;
        let mut stop = false;
        while let Some(w) = self.sq.front() {
            if self.req.send_idx == 0 || w.npsn == 0 {
                break;
            }
            if w.answered {
                self.req.acked_psn = w.last_psn();
                self.complete_front(WcStatus::Success);
                continue;
            }
            if w.op.is_read_or_atomic() {
                if p.distance(w.first_psn) >= 0 {
                    // The peer acknowledged past a READ or atomic we have no answer for.
                    let resume = w.first_psn + w.read_done / pmtu;
                    self.req.acked_psn = resume - 1;
                    if self.read_repairable(w) {
                        // Its missing responses are asked for again, range by range.
                        self.sq[0].repair.get_or_insert_with(Default::default).tail_lost = true;
                        self.req.read_repair = true;
                        stop = true;
                    } else {
                        if self.req.go_back_guard != Some(resume) {
                            self.req.go_back_guard = Some(resume);
                            self.go_back_resend(resume);
                        }
                        went_back = true;
                    }
                }
                break;
            }
            if w.last_psn().distance(p) > 0 {
                break;
            }
            self.complete_front(WcStatus::Success);
        }
        if went_back || stop {
            // A peer with selective recovery holds what it acknowledged past the READ or
            // atomic: a go-back to it skips them (a SACK need not have come first).
            if self.selective_peer() {
                self.req.sack_peer = true;
            }
            self.req.held_through(p);
            // The timed PSN's round trip ends now, not when the READ or atomic has its
            // answer and this ACK is applied (see `ack_held_back`).
            if let Some((_, sent)) = self.req.timed.filter(|&(psn, _)| psn.distance(p) <= 0) {
                self.req.timed = None;
                self.req.rtt_sample(now, now.saturating_sub(sent));
            }
        } else {
            // Partial progress inside a multi-packet message counts too.
            if p.distance(self.req.acked_psn) > 0 {
                self.req.acked_psn = p;
            }
            self.req.go_back_guard = None;
        }
        self.progress(now);
        went_back
    }

    /// The front READ or atomic completed: ACKs that went past it while it waited for
    /// its answer (and that `on_ack` could not apply then) count now, so that the SENDs
    /// and WRITEs after it complete without being sent again.
    fn ack_held_back(&mut self, now: Duration) {
        let p = self.req.peer_acked;
        if p.distance(self.req.acked_psn) <= 0 {
            self.req.peer_acked = self.req.acked_psn;
            return;
        }
        let last_sent = self.req.next_psn - 1;
        self.on_ack(now, if p.distance(last_sent) > 0 { last_sent } else { p });
    }

    /// Something was acknowledged: reset the retry budgets and the timer.
    fn progress(&mut self, now: Duration) {
        self.req.retry_left = self.retry_cnt;
        self.req.rnr_left = self.rnr_retry;
        self.req.ack_every = false;
        // The probe's back-off holds until a fresh measurement (Karn): an ACK of packets
        // sent before a probe says nothing of how late the peer now is.
        self.grow_window();
        // With selective recovery a probe resends one packet, not a window: its answer is
        // the fresh news.
        let fresh =
            self.req.sack_peer || self.req.probe_mark.is_none_or(|m| self.req.acked_psn.distance(m) > 0);
        if self.sample_rtt(now) || fresh {
            self.req.probes = 0;
            self.req.probe_mark = None;
        }
        self.req.probe_at = if self.req.inflight() > 0 { self.pto(now).map(|t| now + t) } else { None };
        self.rearm_ack_timer(now);
    }

    fn on_read_response(
        &mut self,
        now: Duration,
        pkt: &Packet<&[u8]>,
        psn: Psn,
        syndrome: Option<Result<AethSyndrome, crate::wire::Error>>,
        mem: &mut dyn Memory,
    ) {
        if matches!(syndrome, Some(Ok(AethSyndrome::Nak(_) | AethSyndrome::RnrNak { .. }) | Err(_))) {
            self.fail_front(WcStatus::BadRespErr);
            return;
        }
        self.ack_before(psn);
        let pmtu = self.mtu.bytes();
        // The READ this response is for: the front WQE, or a later READ whose responses
        // come while an earlier one waits for a lost response (kept, not asked for again).
        let Some(k) = self.sent_wqe(|w| matches!(w.op, SendOp::Read { .. }) && w.contains(psn)) else {
            self.stats.dropped += 1;
            return;
        };
        let w = &self.sq[k];
        if w.answered {
            self.stats.dropped += 1;
            return;
        }
        if self.read_repairable(w) {
            self.on_read_response_selective(now, pkt, k, psn, mem);
            return;
        }
        let expected = w.first_psn + w.read_done / pmtu;
        let d = psn.distance(expected);
        if d < 0 || (d > 0 && k > 0) {
            // A duplicate, or a gap in a later READ's responses (its turn comes at the front).
            self.stats.dropped += 1;
            return;
        }
        // Towards anyone but a softrdma peer, the IBTA's way: after a gap, ask again for
        // the rest of the message.
        if d > 0 {
            if self.req.go_back_guard != Some(expected) {
                self.req.go_back_guard = Some(expected);
                self.go_back_resend(expected);
            }
            return;
        }
        let data = pkt.payload();
        let len = data.len() as u32;
        let remaining = w.len - w.read_done;
        let fits = match pkt.opcode().payload() {
            PayloadRule::Full => len == pmtu && len < remaining,
            PayloadRule::NonEmpty | PayloadRule::UpToMtu => len <= pmtu && len == remaining,
            _ => false,
        };
        if !fits {
            self.fail_front(WcStatus::BadRespErr);
            return;
        }
        let sgl = w.sgl.clone();
        if scatter(mem, self.cfg.pd, &sgl, u64::from(w.read_done), data).is_err() {
            self.fail_front(WcStatus::LocProtErr);
            return;
        }
        let w = &mut self.sq[k];
        w.read_done += len;
        if k > 0 {
            w.answered = w.read_done == w.len;
            return;
        }
        let (first, done, total) = (w.first_psn, w.read_done, w.len);
        self.front_read_progress(now, first, done, total);
    }

    /// The front READ has `done` of its `total` bytes in order (from its first PSN
    /// `first`): acknowledged as far, completed when whole (and then the ACKs that went
    /// past it while it waited count).
    fn front_read_progress(&mut self, now: Duration, first: Psn, done: u32, total: u32) {
        let pmtu = self.mtu.bytes();
        self.req.acked_psn = first + done.div_ceil(pmtu).max(1) - 1;
        self.req.go_back_guard = None;
        if done == total {
            self.complete_front(WcStatus::Success);
        }
        self.progress(now);
        if done == total {
            self.ack_held_back(now);
        }
    }

    /// A READ response between softrdma peers (see `ReadRepair`): placed wherever it
    /// belongs, whatever came before it; a response past a missing one has the missing
    /// ones asked for again at once, and the READs before this one have all their
    /// responses sent, so what they miss was lost.
    fn on_read_response_selective(
        &mut self,
        now: Duration,
        pkt: &Packet<&[u8]>,
        k: usize,
        psn: Psn,
        mem: &mut dyn Memory,
    ) {
        self.stale_read_asks(now);
        self.reads_answered_before(psn);
        let pmtu = self.mtu.bytes();
        let w = &self.sq[k];
        let i = psn.distance(w.first_psn) as u32;
        let asked = w.repair.as_ref().is_some_and(|r| r.was_asked(i));
        if let Some((_, sent)) = self.req.timed.filter(|&(t, _)| t == w.first_psn) {
            // The READ's round trip: to its first response, unless that was lost (or
            // asked for again) and another came first.
            self.req.timed = None;
            if i == 0 && !asked {
                self.req.rtt_sample(now, now.saturating_sub(sent));
            }
        }
        if asked && i == w.read_done / pmtu {
            // The first missing response, asked for again, came: the asking works.
            self.req.read_ask_rounds = 0;
        }
        let prefix = w.read_done / pmtu;
        // A duplicate: every response placed has its bit (those of the in-order prefix too).
        if i < prefix || w.repair.as_ref().is_some_and(|r| r.has(i)) {
            self.stats.dropped += 1;
            return;
        }
        if w.repair.as_ref().map_or(i >= SACK_SPAN, |r| i >= r.window_end()) {
            // Past what the window can remember: not kept; every response before it was
            // sent, so the missing ones were lost, and this one is asked for again once
            // the window reaches it.
            self.stats.dropped += 1;
            self.sq[k].repair.get_or_insert_with(Default::default).tail_lost = true;
            self.req.read_repair = true;
            return;
        }
        // Any position: a range asked for again has its own FIRST and LAST.
        let data = pkt.payload();
        let len = data.len() as u32;
        let offset = i * pmtu;
        let remaining = w.len - offset;
        let fits = len == remaining.min(pmtu) && len > 0 || len == 0 && remaining == 0 && i == 0;
        if !fits {
            self.fail_front(WcStatus::BadRespErr);
            return;
        }
        let sgl = w.sgl.clone();
        if scatter(mem, self.cfg.pd, &sgl, u64::from(offset), data).is_err() {
            self.fail_front(WcStatus::LocProtErr);
            return;
        }
        let w = &mut self.sq[k];
        let r = w.repair.get_or_insert_with(Default::default);
        r.see(i);
        while w.read_done < w.len && r.has(w.read_done / pmtu) {
            w.read_done += (w.len - w.read_done).min(pmtu);
        }
        r.slide(w.read_done / pmtu);
        if r.tail_lost && w.read_done / pmtu > prefix {
            // The window moved on over responses known lost.
            self.req.read_repair = true;
        }
        if i > prefix {
            // A gap before this one. The peer is answering: the probe waits from now, as
            // for a SACK with news (the gap is asked for below).
            self.req.read_repair = true;
            if k == 0 {
                self.req.probe_at = self.pto(now).map(|t| now + t);
            }
        }
        let w = &mut self.sq[k];
        let (first, done, total) = (w.first_psn, w.read_done, w.len);
        if k > 0 {
            w.answered = done == total;
            return;
        }
        if done / pmtu == prefix && done < total {
            // Nothing new in order.
            return;
        }
        self.front_read_progress(now, first, done, total);
    }
}
