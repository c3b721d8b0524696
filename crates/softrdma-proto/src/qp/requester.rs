//! The RC/UC/UD requester: turns send WQEs into request packets, in SQ order, and goes back
//! N when the completer or the ACK timer says packets were lost.
//!
//! Segmentation follows the path MTU; a READ takes one request packet and as many PSNs as
//! it will have responses. Go-back-N reuses the PSNs first assigned, so a WQE's PSN range
//! never changes, and resumes a SEND or WRITE at the right byte and a READ at its missing
//! tail.

use std::net::SocketAddr;
use std::time::Duration;

use super::psnset::{PsnBits, SACK_SPAN};
use super::{
    sgl_segments, QpState, QpType, QueuePair, SendOp, SendWqe, Transmit, WcStatus, MAX_INFLIGHT_PSNS,
};
use crate::memory::{Access, MemKey, Memory};
use crate::wire::{
    AtomicEthRepr, BthRepr, DethRepr, IethRepr, ImmDtRepr, Opcode, Operation, PacketRepr, RethRepr, Transport,
};
use crate::Psn;

/// Request packets between AckReq flags inside a long message (rxe: about 64).
const ACK_REQ_EVERY: u32 = 32;

/// The queueing delay beyond which a loss counts as congestion (see
/// `Requester::on_lost`): a round trip this much longer than the smallest measured means a
/// queue stands on the path. (At 250 µs, scheduling delays on a busy 2-core machine were
/// taken for queues.)
const TARGET_QUEUE: Duration = Duration::from_millis(1);

/// The queueing delay beyond which the window shrinks whether or not anything is lost
/// (see `Requester::on_rtt`), unless the smallest round trip is longer.
const DELAY_GUARD: Duration = Duration::from_millis(2);

pub(super) struct Requester {
    /// PSN of the next packet to send.
    pub(super) next_psn: Psn,
    /// Every PSN up to and including this one is acknowledged.
    pub(super) acked_psn: Psn,
    /// Index in the SQ of the WQE being sent.
    pub(super) send_idx: usize,
    /// Bytes of that WQE already sent in this pass.
    pub(super) send_offset: u32,
    /// That WQE has passed its start checks in this pass.
    pub(super) started: bool,
    /// READs and atomics sent and not completed.
    pub(super) rd_outstanding: u32,
    pub(super) retry_left: u8,
    pub(super) rnr_left: u8,
    /// Local ACK timeout.
    pub(super) ack_deadline: Option<Duration>,
    /// No request leaves before this time (RNR back-off).
    pub(super) rnr_until: Option<Duration>,
    /// When to resend from the first unacknowledged PSN without spending a retry (a
    /// probe), if nothing is acknowledged before: see [`QueuePair::pto`].
    pub(super) probe_at: Option<Duration>,
    /// Smoothed round-trip time and its variation (RFC 6298's estimator), from ACKs of
    /// PSNs sent once.
    pub(super) srtt: Option<Duration>,
    pub(super) rttvar: Duration,
    /// The PSN being timed and when it was sent (one at a time, as TCP times segments).
    pub(super) timed: Option<(Psn, Duration)>,
    /// The smoothed interval between ACKs that make progress while data is in flight,
    /// and when the last one came: a peer that acknowledges every 32 packets on a slow
    /// link is not late because its ACKs are further apart than a round trip.
    pub(super) ack_gap: Duration,
    pub(super) last_progress: Option<Duration>,
    /// When this QP last sent a request packet (see `responder::TALKS_BACK`).
    pub(super) last_request: Option<Duration>,
    /// Probes sent since the last fresh news from the peer: each doubles the next
    /// probe's wait.
    pub(super) probes: u32,
    /// The highest PSN sent when the last probe went: an ACK beyond it acknowledges
    /// packets first sent after the probe, fresh news that ends the back-off.
    pub(super) probe_mark: Option<Psn>,
    /// The congestion window, in PSNs (at most MAX_INFLIGHT_PSNS): cut by CNPs, grown
    /// by one per window of PSNs acknowledged (see `on_cnp`).
    pub(super) cwnd: u32,
    /// PSNs acknowledged towards the next growth of the window.
    pub(super) cwnd_credit: u32,
    /// The last PSN the window's growth counted.
    pub(super) cc_acked: Psn,
    /// DCQCN's alpha, the estimate of how congested the path is, in 1/65536.
    pub(super) alpha: u32,
    /// When the window was last cut (at most one cut per round trip).
    pub(super) last_cut: Option<Duration>,
    /// The smallest round trip measured (the path with empty queues) and the last one
    /// (see `on_rtt`, `on_lost`).
    pub(super) min_rtt: Option<Duration>,
    last_rtt: Duration,
    /// Window cuts for queueing delay and for congestive loss.
    pub(super) delay_cuts: u64,
    pub(super) loss_cuts: u64,
    /// The PSN of the last go-back triggered by a response, to ignore repeats of it.
    pub(super) go_back_guard: Option<Psn>,
    since_ack_req: u32,
    /// After a timeout, every packet asks for an ACK until one arrives, so that the first
    /// packet of the resent window that gets through shows up as progress at once.
    pub(super) ack_every: bool,
    /// Highest PSN ever sent, to count retransmissions.
    pub(super) max_sent: Psn,
    /// Selective recovery (see `QueuePair::set_selective`): the peer has sent a SACK, so
    /// resends skip what it holds.
    pub(super) sack_peer: bool,
    /// PSNs the peer's SACKs say it holds, and PSNs resent since the last probe, as
    /// bitmaps from `sack_base` (kept at the first unacknowledged PSN by `sync_sack`).
    sacked: PsnBits,
    rexmitted: PsnBits,
    sack_base: Psn,
    /// Unacknowledged PSNs up to this one that no SACK covers are lost; later ones may
    /// still be on their way.
    lost_limit: Psn,
    /// A READ or atomic request to send again although the peer received it (its answer
    /// was lost): never skipped, until sent.
    reread: Option<Psn>,
    /// When the last PSN was resent on a SACK's word: a SACK a round trip later that
    /// still shows it missing means the resend was lost too.
    rexmit_at: Option<Duration>,
    /// Some READ may have responses to ask for again (see `ReadRepair`): the next
    /// transmit looks.
    pub(super) read_repair: bool,
    /// When the last READ response was asked for again: a response that comes a round
    /// trip later while the asked ones are still missing means the asking was lost too.
    pub(super) read_asked_at: Option<Duration>,
    /// The last PSN `reads_answered_before` marked every READ before (see there).
    pub(super) answered_mark: Psn,
    /// Rounds of asking READ ranges again without an answer (see `read_ask_wait`).
    pub(super) read_ask_rounds: u32,
    /// A response came since the resend timer last acted (see `resend_timeout`): it acts
    /// at most once between answers of the peer, so that a peer gone silent gets probes,
    /// which back off, and not a resend every round trip.
    pub(super) resend_armed: bool,
    /// The highest PSN the peer's ACKs have covered: beyond `acked_psn` while the front
    /// READ or atomic waits for its answer (see `QueuePair::ack_held_back`).
    pub(super) peer_acked: Psn,
    /// Where to go back to before sending next (see `QueuePair::go_back`).
    pub(super) pending_back: Option<Psn>,
}

impl Requester {
    pub(super) fn new(sq_psn: Psn) -> Requester {
        Requester {
            next_psn: sq_psn,
            acked_psn: sq_psn - 1,
            send_idx: 0,
            send_offset: 0,
            started: false,
            rd_outstanding: 0,
            retry_left: 0,
            rnr_left: 0,
            ack_deadline: None,
            rnr_until: None,
            probe_at: None,
            srtt: None,
            rttvar: Duration::ZERO,
            timed: None,
            ack_gap: Duration::ZERO,
            last_progress: None,
            last_request: None,
            probes: 0,
            probe_mark: None,
            cwnd: MAX_INFLIGHT_PSNS,
            cwnd_credit: 0,
            cc_acked: sq_psn - 1,
            alpha: 1 << 16,
            last_cut: None,
            min_rtt: None,
            last_rtt: Duration::ZERO,
            delay_cuts: 0,
            loss_cuts: 0,
            go_back_guard: None,
            since_ack_req: 0,
            ack_every: false,
            max_sent: sq_psn - 1,
            sack_peer: false,
            sacked: PsnBits::default(),
            rexmitted: PsnBits::default(),
            sack_base: sq_psn,
            lost_limit: sq_psn - 1,
            reread: None,
            rexmit_at: None,
            pending_back: None,
            read_repair: false,
            read_asked_at: None,
            answered_mark: sq_psn - 1,
            read_ask_rounds: 0,
            resend_armed: false,
            peer_acked: sq_psn - 1,
        }
    }

    /// Feeds one round-trip measurement to the estimator (RFC 6298) and to the delay
    /// reaction (see `on_rtt`).
    pub(super) fn rtt_sample(&mut self, now: Duration, r: Duration) {
        self.on_rtt(now, r);
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(r);
                self.rttvar = self.rttvar * 3 / 4 + diff / 4;
                self.srtt = Some(s * 7 / 8 + r / 8);
            }
        }
    }

    /// Whether the window may be cut now: at most once per round trip (50 µs before the
    /// first measurement), whichever signal asks. Starts the hold when it may.
    fn may_cut(&mut self, now: Duration) -> bool {
        let hold = self.srtt.unwrap_or(Duration::from_micros(50));
        if self.last_cut.is_some_and(|t| now < t + hold) {
            return false;
        }
        self.last_cut = Some(now);
        true
    }

    /// Cuts the window to `keep` (in 1/65536) of itself: by one PSN at least, to one PSN
    /// at most.
    fn cut_to(&mut self, keep: u32) {
        let kept = ((u64::from(self.cwnd) * u64::from(keep.min(1 << 16))) >> 16) as u32;
        self.cwnd = kept.min(self.cwnd.saturating_sub(1)).max(1);
        self.cwnd_credit = 0;
    }

    /// The delay reaction: a round trip `r` longer than the target — the smallest
    /// measured plus as much again or `DELAY_GUARD`, whichever is more — means a deep queue
    /// is building (a bottleneck with a large buffer and no ECN); the window shrinks in
    /// proportion to the excess, `1 - 0.8 (r - target) / r` as Swift's does, by half at
    /// most, once per round trip. The target is generous on purpose: a flow that starts
    /// while a queue stands takes that queue for part of its path, so a tight target
    /// would push older flows down in favour of newer ones (delay-based control's
    /// latecomer problem); below it, losses and ECN marks steer the window.
    fn on_rtt(&mut self, now: Duration, r: Duration) {
        let base = self.min_rtt.map_or(r, |m| m.min(r));
        self.min_rtt = Some(base);
        self.last_rtt = r;
        let target = base + base.max(DELAY_GUARD);
        if r <= target || !self.may_cut(now) {
            return;
        }
        let excess = ((r - target).as_nanos() << 16) / r.as_nanos().max(1);
        let keep = (1u128 << 16).saturating_sub(excess * 4 / 5).max(1 << 15) as u32;
        self.cut_to(keep);
        self.delay_cuts += 1;
    }

    /// A loss found (by a SACK, or a sequence NAK from a go-back-N peer). A loss
    /// while the last round trip measured stood `TARGET_QUEUE` above the smallest is a
    /// queue overflowing: the window halves, once per round trip, as TCP's does. A loss on
    /// a path without a queue is taken for damage, not congestion, and costs no window
    /// (selective recovery repairs it): random loss of a few percent leaves the rate as it
    /// is.
    pub(super) fn on_lost(&mut self, now: Duration) {
        let queued = self.min_rtt.is_some_and(|base| self.last_rtt > base + TARGET_QUEUE);
        if queued && self.may_cut(now) {
            self.cut_to(1 << 15);
            self.loss_cuts += 1;
        }
    }

    /// Moves the SACK bitmaps' base to the first unacknowledged PSN.
    fn sync_sack(&mut self) {
        let base = self.acked_psn + 1;
        let d = base.distance(self.sack_base);
        if d == 0 {
            return;
        }
        self.sacked.move_base(d);
        self.rexmitted.move_base(d);
        self.sack_base = base;
    }

    /// The bitmaps' bit for `psn`, if it is within them.
    fn sack_bit(&mut self, psn: Psn) -> Option<u32> {
        self.sync_sack();
        let k = psn.distance(self.sack_base);
        (0..SACK_SPAN as i32).contains(&k).then_some(k as u32)
    }

    /// Whether the peer holds `psn` or it was resent since the last probe.
    fn held_or_resent(&mut self, psn: Psn) -> bool {
        self.sack_bit(psn).is_some_and(|k| self.sacked.get(k) || self.rexmitted.get(k))
    }

    /// Packets in flight, as far as the send position: the PSNs sent and not
    /// acknowledged, less those a SACK says the peer holds (RFC 6675's pipe, but for
    /// what is lost: a lost packet is resent as soon as a SACK shows it, so it stays
    /// counted).
    pub(super) fn pipe(&self) -> u32 {
        self.unheld_in(self.acked_psn + 1, self.inflight())
    }

    /// Of the PSNs `first..first + n`, how many are sent, not acknowledged, and not held
    /// by the peer as far as its SACKs tell.
    fn unheld_in(&self, first: Psn, n: u32) -> u32 {
        let lo = first.distance(self.acked_psn + 1).max(0);
        let hi = (first + n).distance(self.acked_psn + 1).min(self.max_sent.distance(self.acked_psn));
        if hi <= lo {
            return 0;
        }
        let (lo, hi) = (lo as u32, hi as u32);
        if !self.sack_peer {
            return hi - lo;
        }
        // From the bitmaps' base, which may lag the acknowledgements (see `sync_sack`).
        let shift = (self.acked_psn + 1).distance(self.sack_base);
        if shift < 0 {
            return hi - lo;
        }
        let (a, b) = (lo + shift as u32, hi + shift as u32);
        let held = self.sacked.count_below(b) - self.sacked.count_below(a);
        (b - a) - held.min(b - a)
    }

    /// The peer acknowledged every PSN up to `p`, past the front READ or atomic, which
    /// waits for its answer: with selective recovery they count as held, so that the
    /// window and the probe see what is really missing.
    pub(super) fn held_through(&mut self, p: Psn) {
        if !self.sack_peer {
            return;
        }
        self.sync_sack();
        let n = (p + 1).distance(self.sack_base).clamp(0, SACK_SPAN as i32) as u32;
        self.sacked.set_range(0, n);
    }

    /// Whether resending `psn` can be skipped: the peer holds it (or, for a READ, held
    /// its request), it was resent since the last probe, or it is not known lost.
    fn skips(&mut self, psn: Psn) -> bool {
        if self.reread == Some(psn) {
            return false;
        }
        let Some(k) = self.sack_bit(psn) else { return false };
        psn.distance(self.lost_limit) > 0 || self.rexmitted.get(k) || self.sacked.get(k)
    }

    /// Records a SACK: `bits` after the cumulative acknowledgement. Returns whether it
    /// told of PSNs not known to be held before, and the first PSN now known lost and not
    /// yet resent, if any.
    pub(super) fn on_sack(
        &mut self,
        now: Duration,
        first_missing: Psn,
        bits: &PsnBits,
    ) -> (bool, Option<Psn>) {
        self.sack_peer = true;
        self.sync_sack();
        let rtt = self.srtt.unwrap_or(Duration::from_micros(50));
        if self.rexmit_at.is_some_and(|t| now > t + rtt + rtt / 4) {
            // Resends a round trip old that are still missing were lost: send them again.
            self.rexmitted = PsnBits::default();
            self.rexmit_at = None;
        }
        // Everything before the first missing PSN arrived, also what the cumulative
        // acknowledgement could not cover (PSNs after a READ still being answered).
        let before = first_missing.distance(self.sack_base).clamp(0, SACK_SPAN as i32) as u32;
        self.sacked.set_range(0, before);
        let mut held = [Psn::new(0); 3];
        let mut count = 0usize;
        let mut news = false;
        for i in bits.ones() {
            let psn = first_missing + (i + 1);
            if psn.distance(self.max_sent) > 0 {
                break;
            }
            if let Some(k) = self.sack_bit(psn) {
                news |= !self.sacked.get(k);
                self.sacked.set(k);
                held[count % 3] = psn;
                count += 1;
            }
        }
        // The timed PSN held by the peer measures the round trip, which its cumulative ACK,
        // delayed behind the gap, would not.
        if let Some((psn, sent)) = self.timed {
            if self.sack_bit(psn).is_some_and(|k| self.sacked.get(k)) {
                self.timed = None;
                self.rtt_sample(now, now.saturating_sub(sent));
            }
        }
        if count == 0 {
            return (news, None);
        }
        // A PSN is lost once three later ones are held (reordering tolerated up to
        // that), or when the highest PSN sent is held and nothing more will tell.
        let highest = held[(count - 1) % 3];
        let limit = if count >= 3 {
            held[count % 3]
        } else if highest == self.max_sent {
            highest
        } else {
            return (news, None);
        };
        if limit.distance(self.lost_limit) > 0 {
            // Does this SACK show a PSN lost (not held, not resent) that no earlier one
            // did? Then the loss reaction hears of it. A probe's resends do not count: a
            // probe is a guess.
            let from =
                if self.lost_limit.distance(self.acked_psn) > 0 { self.lost_limit } else { self.acked_psn };
            let mut psn = from + 1;
            while psn.distance(limit) < 0 {
                if self.sack_bit(psn).is_some() && !self.held_or_resent(psn) {
                    self.on_lost(now);
                    break;
                }
                psn = psn + 1;
            }
            self.lost_limit = limit;
        }
        (news, self.first_lost())
    }

    /// The first PSN known lost (before `lost_limit`) that the peer does not hold and that
    /// was not resent since the last probe.
    fn first_lost(&mut self) -> Option<Psn> {
        let mut psn = self.acked_psn + 1;
        while psn.distance(self.lost_limit) < 0 {
            self.sack_bit(psn)?;
            if !self.held_or_resent(psn) {
                return Some(psn);
            }
            psn = psn + 1;
        }
        None
    }

    /// Forgets what was resent (a probe or timeout resends everything no SACK covers),
    /// and with `sacked` what the peer held (an RNR NAK: it dropped the packet it could
    /// not take).
    pub(super) fn restart_recovery(&mut self, sacked: bool) {
        self.rexmitted = PsnBits::default();
        self.rexmit_at = None;
        if sacked {
            self.sacked = PsnBits::default();
        }
        self.lost_limit = self.max_sent;
    }

    /// Whether `psn` was sent and is not yet acknowledged: the only PSNs a response (ACK,
    /// NAK, READ response, atomic ACK) may carry.
    pub(super) fn outstanding(&self, psn: Psn) -> bool {
        psn.distance(self.next_psn - 1) <= 0 && psn.distance(self.acked_psn) > 0
    }

    /// Whether `psn` was sent, but lies at or after the send position, which a go-back
    /// moved back.
    pub(super) fn sent_after_rewind(&self, psn: Psn) -> bool {
        psn.distance(self.max_sent) <= 0 && psn.distance(self.next_psn) >= 0
    }

    /// PSNs sent and not acknowledged.
    pub(super) fn inflight(&self) -> u32 {
        (self.next_psn.get().wrapping_sub(self.acked_psn.get()).wrapping_sub(1)) & crate::MASK_24
    }
}

impl QueuePair {
    fn ack_timeout(&self) -> Option<Duration> {
        (self.timeout != 0).then(|| Duration::from_nanos(4096u64 << self.timeout))
    }

    /// Re-arms the local ACK timer from `now`, or stops it when nothing is outstanding.
    pub(super) fn rearm_ack_timer(&mut self, now: Duration) {
        self.req.ack_deadline =
            if self.req.inflight() > 0 { self.ack_timeout().map(|t| now + t) } else { None };
    }

    /// How long to wait for an ACK before probing: resending from the first
    /// unacknowledged PSN without spending a retry. The IBTA's local ACK timeout is a
    /// fixed bound chosen for the worst fabric (16.8 ms at timeout 12, 67 ms at 14) and
    /// counts retries; waiting that long for every lost tail costs thousands of round
    /// trips on an ordinary network. So, as TCP does (RFC 6298), the requester measures
    /// the round trip and probes after `srtt + 4 * rttvar` (at least 50 µs), doubling for
    /// each probe without progress, never later than half the ACK timeout. Before the
    /// first measurement it waits half the ACK timeout. Probes spend no retry: RETRY_EXC_ERR
    /// still comes after `retry_cnt + 1` ACK timeouts, and a peer receives at most
    /// duplicates, which it acknowledges again (duplicate READs and atomics are answered
    /// as IBTA 9.7.5.1 says).
    ///
    /// A softrdma peer may hold a lone ACK up to `responder::ACK_DELAY` when its QP talks
    /// back, which from here looks like a peer that sent this QP a request lately: then
    /// the probe waits that much longer too (as QUIC's PTO adds the peer's max_ack_delay),
    /// so that a reply that takes the peer a while draws no spurious resend.
    pub(super) fn pto(&self, now: Duration) -> Option<Duration> {
        let cap = self.ack_timeout()? / 2;
        // A peer sending SACKs reports every arrival past a gap, so the interval between
        // ACKs that move the cumulative point (long while a gap is repaired) says nothing
        // of how late the peer is.
        let ack_gap = if self.req.sack_peer { Duration::ZERO } else { 2 * self.req.ack_gap };
        // The floor keeps a busy machine's scheduling delays from passing for losses; it
        // is lower when the probe would resend a few packets only (every other one held
        // by a SACK peer): a spurious one costs little, a late one a stalled window.
        let floor = if self.req.sack_peer && self.probe_size() <= 4 { 10 } else { 50 };
        // Without SACKs a probe goes back N, resending the whole window: wait at least two
        // round trips (as TCP's tail-loss probe), for a stream's round trip is mostly the
        // queue it keeps, steady enough that `4 * rttvar` is a few microseconds, and a
        // scheduling hiccup of the receiver passed for the loss of a window.
        let spread = if self.req.sack_peer {
            4 * self.req.rttvar
        } else {
            (4 * self.req.rttvar).max(self.req.srtt.unwrap_or_default())
        };
        let base = match self.req.srtt {
            Some(srtt) => (srtt + spread).max(ack_gap).max(Duration::from_micros(floor)),
            None => cap,
        };
        let delayed_acks = !self.foreign_peer
            && self.resp.last_request.is_some_and(|t| now.saturating_sub(t) < super::responder::TALKS_BACK);
        let base = if delayed_acks { base + super::responder::ACK_DELAY } else { base };
        Some(base.saturating_mul(1u32 << self.req.probes.min(16)).min(cap))
    }

    /// How many packets a probe would send, as far as that is more than four: the PSNs
    /// sent that the peer neither acknowledged nor holds, a READ or atomic counted as its
    /// one request.
    fn probe_size(&self) -> u32 {
        let mut n = 0;
        for w in self.sq.iter().take(self.req.send_idx.min(64)) {
            if w.npsn == 0 {
                break;
            }
            let unheld = self.req.unheld_in(w.first_psn, w.npsn);
            n += if w.op.is_read_or_atomic() { unheld.min(1) } else { unheld };
            if n > 4 {
                return n;
            }
        }
        if self.req.send_idx > 64 {
            n + self.req.unheld_in(
                self.sq[64].first_psn,
                self.req.max_sent.distance(self.sq[64].first_psn).max(0) as u32 + 1,
            )
        } else {
            n
        }
    }

    /// A CNP: the path is congested. As DCQCN's reaction point does, raise alpha (the
    /// congestion estimate) and cut the window by alpha / 2, at most once per round trip
    /// (50 µs before the first measurement); the window never goes below one PSN.
    pub(super) fn on_cnp(&mut self, now: Duration) {
        self.stats.cnps_received += 1;
        if !self.req.may_cut(now) {
            return;
        }
        self.req.alpha = self.req.alpha - self.req.alpha / 16 + (1 << 16) / 16;
        self.req.cut_to((1 << 16) - self.req.alpha / 2);
    }

    /// Progress without news of congestion: one PSN more per window acknowledged
    /// (additive increase), and alpha decays as DCQCN's does when no CNP comes.
    pub(super) fn grow_window(&mut self) {
        let n = self.req.acked_psn.distance(self.req.cc_acked);
        if n <= 0 {
            return;
        }
        self.req.cc_acked = self.req.acked_psn;
        if self.req.cwnd >= MAX_INFLIGHT_PSNS {
            return;
        }
        self.req.cwnd_credit += n as u32;
        while self.req.cwnd_credit >= self.req.cwnd && self.req.cwnd < MAX_INFLIGHT_PSNS {
            self.req.cwnd_credit -= self.req.cwnd;
            self.req.cwnd += 1;
            self.req.alpha -= self.req.alpha / 16;
        }
    }

    /// An ACK (or response) acknowledged every PSN up to `acked_psn`: takes the round-trip
    /// sample if the timed PSN is among them (and returns whether it did), and the
    /// interval since the previous progress.
    pub(super) fn sample_rtt(&mut self, now: Duration) -> bool {
        if let Some(last) = self.req.last_progress {
            let gap = now.saturating_sub(last);
            self.req.ack_gap = self.req.ack_gap * 7 / 8 + gap / 8;
        }
        self.req.last_progress = (self.req.inflight() > 0).then_some(now);
        let Some((psn, sent)) = self.req.timed else { return false };
        if psn.distance(self.req.acked_psn) > 0 {
            return false;
        }
        self.req.timed = None;
        self.req.rtt_sample(now, now.saturating_sub(sent));
        true
    }

    pub(super) fn next_request(
        &mut self,
        now: Duration,
        buf: &mut [u8],
        mem: &dyn Memory,
    ) -> Option<Transmit> {
        if !matches!(self.state, QpState::Rts | QpState::Sqd) {
            return None;
        }
        if self.req.rnr_until.is_some_and(|t| now < t) {
            return None;
        }
        let rc = self.cfg.qp_type == QpType::Rc;
        if let Some(psn) = self.req.pending_back.take() {
            let psn = if psn.distance(self.req.acked_psn) > 0 { psn } else { self.req.acked_psn + 1 };
            self.rewind(psn);
        }
        if rc {
            self.skip_unneeded();
        }
        // READ ranges asked for again go first (a go-back passing a READ just asked for
        // what it misses).
        if self.req.read_repair {
            if let Some(t) = self.next_read_repair(now, buf, mem) {
                return Some(t);
            }
        }
        let i = self.req.send_idx;
        let w = self.sq.get(i)?;
        // The congestion window holds back fresh PSNs only: a go-back resends up to the
        // highest PSN sent at once, as before, since the peer's ACKs of the first copies
        // count only once the resends have caught up with them. Towards a peer that sends
        // SACKs the window counts what the peer does not hold yet (see `pipe`), so that a
        // hole under repair does not hold it shut, and fresh PSNs stay within the span a
        // SACK can describe, less room for one window more (a READ takes its responses'
        // PSNs at once).
        let fresh = self.req.next_psn.distance(self.req.max_sent) > 0;
        let window = if fresh { self.req.cwnd.min(MAX_INFLIGHT_PSNS) } else { MAX_INFLIGHT_PSNS };
        let used = self.req.pipe();
        let span_full = fresh && self.req.sack_peer && self.req.inflight() >= SACK_SPAN - MAX_INFLIGHT_PSNS;
        if rc && (used >= window || span_full) {
            return None;
        }
        let pmtu = self.mtu.bytes();
        if !self.req.started {
            if self.state == QpState::Sqd && self.req.send_offset == 0 && w.read_done == 0 {
                return None;
            }
            if w.fence && self.req.rd_outstanding > 0 {
                return None;
            }
            if w.op.is_read_or_atomic() && self.req.rd_outstanding >= u32::from(self.max_rd_atomic) {
                return None;
            }
            if w.inline.is_none() {
                let need = if w.op.is_read_or_atomic() { Access::LOCAL_WRITE } else { Access::NONE };
                let bad = w.sgl.iter().any(|s| {
                    mem.check(self.cfg.pd, MemKey::Local(s.lkey), s.addr, u64::from(s.length), need).is_err()
                });
                if bad {
                    self.sq[i].done = Some(WcStatus::LocProtErr);
                    self.enter_error();
                    return None;
                }
            }
            let w = &mut self.sq[i];
            if w.npsn == 0
                || w.first_psn != self.req.next_psn && self.req.send_offset == 0 && w.read_done == 0
            {
                w.first_psn = self.req.next_psn;
            }
            w.npsn = match w.op {
                SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => 1,
                _ => w.len.div_ceil(pmtu).max(1),
            };
            if w.op.is_read_or_atomic() {
                self.req.rd_outstanding += 1;
            }
            self.req.started = true;
        }
        let w = &self.sq[i];
        let transport = match self.cfg.qp_type {
            QpType::Rc => Transport::Rc,
            QpType::Uc => Transport::Uc,
            QpType::Ud => Transport::Ud,
        };
        let (dst, dest_qp) = match w.ud {
            Some(ud) => (ud.addr, ud.qpn),
            None => (self.remote?, self.dest_qpn),
        };
        let off = self.req.send_offset;
        let opcode = |op| Opcode::from_parts(transport, op);
        let mut inline: &[u8] = &[];
        let mut payload = crate::memory::Segments::Empty;
        let (repr, psn, payload_len, last) = match w.op {
            SendOp::Read { remote_addr, rkey } => {
                let psn = w.first_psn + off / pmtu;
                let mut r =
                    PacketRepr::new(BthRepr::new(opcode(Operation::RdmaReadRequest)?, dest_qp, psn), 0);
                let dma_len = w.len - off;
                r.ext.reth = Some(RethRepr { va: remote_addr.wrapping_add(u64::from(off)), rkey, dma_len });
                (r, psn, 0, true)
            }
            SendOp::CompareSwap { remote_addr, rkey, compare, swap } => {
                let mut r =
                    PacketRepr::new(BthRepr::new(opcode(Operation::CompareSwap)?, dest_qp, w.first_psn), 0);
                r.ext.atomic_eth = Some(AtomicEthRepr { va: remote_addr, rkey, swap_add: swap, compare });
                (r, w.first_psn, 0, true)
            }
            SendOp::FetchAdd { remote_addr, rkey, add } => {
                let mut r =
                    PacketRepr::new(BthRepr::new(opcode(Operation::FetchAdd)?, dest_qp, w.first_psn), 0);
                r.ext.atomic_eth = Some(AtomicEthRepr { va: remote_addr, rkey, swap_add: add, compare: 0 });
                (r, w.first_psn, 0, true)
            }
            _ => {
                let plen = (w.len - off).min(pmtu);
                let first = off == 0;
                let last = off + plen == w.len;
                let psn = w.first_psn + off / pmtu;
                let write = matches!(w.op, SendOp::Write { .. } | SendOp::WriteWithImm { .. });
                use Operation as O;
                let op = match (write, first, last, w.op) {
                    (false, true, true, SendOp::SendWithImm(_)) => O::SendOnlyWithImmediate,
                    (false, true, true, SendOp::SendWithInv(_)) => O::SendOnlyWithInvalidate,
                    (false, true, true, _) => O::SendOnly,
                    (false, true, false, _) => O::SendFirst,
                    (false, false, false, _) => O::SendMiddle,
                    (false, false, true, SendOp::SendWithImm(_)) => O::SendLastWithImmediate,
                    (false, false, true, SendOp::SendWithInv(_)) => O::SendLastWithInvalidate,
                    (false, false, true, _) => O::SendLast,
                    (true, true, true, SendOp::WriteWithImm { .. }) => O::RdmaWriteOnlyWithImmediate,
                    (true, true, true, _) => O::RdmaWriteOnly,
                    (true, true, false, _) => O::RdmaWriteFirst,
                    (true, false, false, _) => O::RdmaWriteMiddle,
                    (true, false, true, SendOp::WriteWithImm { .. }) => O::RdmaWriteLastWithImmediate,
                    (true, false, true, _) => O::RdmaWriteLast,
                };
                let mut bth = BthRepr::new(opcode(op)?, dest_qp, psn);
                bth.solicited = last && w.solicited;
                let mut r = PacketRepr::new(bth, plen as usize);
                let h = r.bth.opcode.headers();
                use crate::wire::HeaderKind as K;
                if h.contains(K::Reth) {
                    if let SendOp::Write { remote_addr, rkey }
                    | SendOp::WriteWithImm { remote_addr, rkey, .. } = w.op
                    {
                        r.ext.reth = Some(RethRepr { va: remote_addr, rkey, dma_len: w.len });
                    }
                }
                if h.contains(K::ImmDt) {
                    if let SendOp::SendWithImm(imm) | SendOp::WriteWithImm { imm, .. } = w.op {
                        r.ext.immdt = Some(ImmDtRepr { value: imm });
                    }
                }
                if let (true, SendOp::SendWithInv(rkey)) = (h.contains(K::Ieth), w.op) {
                    r.ext.ieth = Some(IethRepr { rkey });
                }
                if let Some(ud) = w.ud {
                    r.ext.deth = Some(DethRepr { qkey: ud.qkey, src_qp: self.qpn });
                }
                match &w.inline {
                    Some(data) => inline = &data[off as usize..(off + plen) as usize],
                    None => payload = sgl_segments(&w.sgl, u64::from(off), u64::from(plen)),
                }
                (r, psn, plen as usize, last)
            }
        };
        let mut repr = repr;
        if rc {
            // The last packet of a message asks for an ACK when the message wants its
            // completion, or unless the next WR will follow it at once: one queued behind
            // it that is a SEND or WRITE without a fence, in RTS (a READ or atomic may wait
            // for the ones outstanding, a fenced WR for their answers, and in SQD no new WR
            // starts: the tail would wait for the ACK timer). A stream's unsignaled
            // messages leave it to every 32nd packet and to the window, which halves its
            // ACKs (`perf write_bw`: one per 16 packets before, at 64 KiB).
            let streams_on = self.state == QpState::Rts
                && self.sq.get(i + 1).is_some_and(|n| !n.fence && !n.op.is_read_or_atomic());
            repr.bth.ack_req = (last && (self.sq[i].signaled || !streams_on))
                || self.req.ack_every
                || self.req.since_ack_req + 1 >= ACK_REQ_EVERY
                || used + 1 >= self.req.cwnd.min(MAX_INFLIGHT_PSNS);
        }
        let head_len = Self::emit_head(&repr, buf, inline)?;
        let pad = usize::from(crate::wire::pad_count(payload_len));
        let longer_last = matches!(self.sq[i].op, SendOp::SendWithImm(_) | SendOp::SendWithInv(_));
        let tx = match self.finish_packet(dst, buf, head_len, payload, pad, longer_last, mem) {
            Ok(mut t) => {
                match self.sq[i].ud {
                    Some(ud) => t.tos = ud.traffic_class,
                    // Connected requests are ECN-capable (ECT(0)) unless the address vector's
                    // traffic class says otherwise: a congested router marks them instead of
                    // dropping them, and the responder answers a mark with a CNP.
                    None => t.set_ect(),
                }
                t
            }
            Err(_) => {
                // The memory vanished or shrank under a posted WR.
                self.sq[i].done = Some(WcStatus::LocProtErr);
                self.enter_error();
                return None;
            }
        };
        self.after_send(now, i, psn, payload_len as u32, last, repr.bth.ack_req);
        Some(tx)
    }

    /// A UC QP that has only received from a softrdma peer, and so never told it that it
    /// takes filler off (see `wire::fill`), says so once with a zero-length RDMA WRITE ONLY
    /// carrying [`crate::wire::fill::TAKES_FILL`]: a one-way UC WRITE stream's receiver
    /// sends nothing else (perftest's keeps its QP in RTR), so without it the stream never
    /// goes in packets of one size. The peer takes the word and hands the packet to no
    /// one (see `QueuePair::is_fill_hello`), so it takes no PSN: it carries the next one
    /// of this QP's send queue, which is idle, and which in RTR has no sequence yet.
    pub(super) fn fill_hello(&mut self, buf: &mut [u8], mem: &dyn Memory) -> Option<Transmit> {
        let dst = self.remote?;
        let op = Opcode::from_parts(Transport::Uc, Operation::RdmaWriteOnly)?;
        let mut r = PacketRepr::new(BthRepr::new(op, self.dest_qpn, self.req.next_psn), 0);
        r.ext.reth = Some(RethRepr { va: 0, rkey: crate::Rkey(0), dma_len: 0 });
        let head_len = Self::emit_head(&r, buf, &[])?;
        let t = self.finish_packet(dst, buf, head_len, crate::memory::Segments::Empty, 0, false, mem).ok()?;
        self.stats.packets_sent += 1;
        Some(t.ect())
    }

    /// Whether READ `w`'s responses may be repaired range by range: towards a softrdma
    /// peer with selective recovery, for a READ whose responses a SACK's span can hold.
    pub(super) fn read_repairable(&self, w: &SendWqe) -> bool {
        matches!(w.op, SendOp::Read { .. }) && self.selective_peer()
    }

    /// A READ request for the first range of missing READ responses not yet asked for
    /// again, of the first READ that has one (see `ReadRepair`): the responses past the
    /// last one seen count only once the READ's tail is known lost. Clears
    /// `read_repair` when there is none.
    fn next_read_repair(&mut self, now: Duration, buf: &mut [u8], mem: &dyn Memory) -> Option<Transmit> {
        let pmtu = self.mtu.bytes();
        // Every WQE sent at least once: a go-back may have moved the send position back
        // before a READ whose responses are coming.
        let found = self.sq.iter_mut().take_while(|w| w.npsn > 0).find_map(|w| {
            let SendOp::Read { remote_addr, rkey } = w.op else { return None };
            let r = w.repair.as_deref_mut().filter(|_| !w.answered && w.npsn > 0)?;
            let end = if r.tail_lost { w.npsn.min(r.window_end()) } else { r.highest_seen()? };
            let mut k = w.read_done / pmtu;
            while k < end && (r.has(k) || r.was_asked(k)) {
                k += 1;
            }
            let start = k;
            while k < end && !r.has(k) && !r.was_asked(k) {
                k += 1;
            }
            // The part of a lost tail that a sliding window opens up is asked for by the
            // eighth of a window, not a response at a time as the window moves.
            if k == end && end < w.npsn && r.tail_lost && k - start < SACK_SPAN / 8 {
                return None;
            }
            for j in start..k {
                r.ask(j);
            }
            (k > start).then(|| {
                let off = start * pmtu;
                let len = (w.len - off).min((k - start) * pmtu);
                (
                    w.first_psn + start,
                    RethRepr { va: remote_addr.wrapping_add(u64::from(off)), rkey, dma_len: len },
                )
            })
        });
        let Some((psn, reth)) = found else {
            self.req.read_repair = false;
            return None;
        };
        // Karn: the timed READ's first response asked for again would not measure one
        // round trip.
        if self.req.timed.is_some_and(|(t, _)| t == psn) {
            self.req.timed = None;
        }
        let opcode = Opcode::from_parts(Transport::Rc, Operation::RdmaReadRequest)?;
        let mut repr = PacketRepr::new(BthRepr::new(opcode, self.dest_qpn, psn), 0);
        repr.ext.reth = Some(reth);
        let head_len = Self::emit_head(&repr, buf, &[])?;
        let t = self
            .finish_packet(self.remote?, buf, head_len, crate::memory::Segments::Empty, 0, false, mem)
            .ok()?;
        self.stats.packets_sent += 1;
        self.stats.retransmits += 1;
        self.req.read_asked_at = Some(now);
        Some(t.ect())
    }

    /// A response came: READ responses asked for again a round trip ago (and a quarter)
    /// that are still missing were lost again, so they may be asked for once more.
    pub(super) fn stale_read_asks(&mut self, now: Duration) {
        let Some(at) = self.req.read_asked_at else { return };
        if now < at + self.read_ask_wait() {
            return;
        }
        self.req.read_asked_at = None;
        self.req.read_ask_rounds += 1;
        for w in self.sq.iter_mut() {
            if let Some(r) = w.repair.as_deref_mut() {
                r.asked = PsnBits::default();
            }
        }
        self.req.read_repair = true;
    }

    /// A response for `psn` came: the responder sent every response of the READs before
    /// it, so what is missing of them was lost (selective recovery).
    pub(super) fn reads_answered_before(&mut self, psn: Psn) {
        if self.req.rd_outstanding == 0 || !self.selective_peer() {
            return;
        }
        // Every READ before the last PSN this looked at was marked then (or has completed
        // since): the answers that follow, mostly the rest of one READ's responses, need
        // no walk of the send queue each.
        let mark = self.req.answered_mark;
        if psn.distance(mark) <= 0 && mark.distance(self.req.acked_psn) > 0 {
            return;
        }
        let sent = self.req.send_idx.min(self.sq.len());
        for i in 0..sent {
            let w = &self.sq[i];
            if w.npsn == 0 || w.last_psn().distance(psn) >= 0 {
                // Every sent READ before `psn` was looked at.
                self.req.answered_mark = psn;
                break;
            }
            if w.answered || !self.read_repairable(w) {
                continue;
            }
            self.sq[i].repair.get_or_insert_with(Default::default).tail_lost = true;
            self.req.read_repair = true;
        }
    }

    /// The PSN, payload length and last-ness of WQE `i`'s packet at the send offset.
    fn packet_at(&self, i: usize) -> (Psn, u32, bool) {
        let w = &self.sq[i];
        let off = self.req.send_offset;
        let pmtu = self.mtu.bytes();
        match w.op {
            SendOp::Read { .. } => (w.first_psn + off / pmtu, 0, true),
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => (w.first_psn, 0, true),
            _ => {
                let plen = (w.len - off).min(pmtu);
                (w.first_psn + off / pmtu, plen, off + plen == w.len)
            }
        }
    }

    /// Passes over resends the peer does not need: READs already answered and, with
    /// selective recovery, packets the peer holds, ones resent since the last probe, and
    /// ones not known lost.
    fn skip_unneeded(&mut self) {
        while let Some(w) = self.sq.get(self.req.send_idx) {
            if w.npsn == 0 || w.done.is_some() {
                return;
            }
            let (psn, plen, last) = self.packet_at(self.req.send_idx);
            if psn.distance(self.req.max_sent) > 0 || psn != self.req.next_psn {
                return;
            }
            // A READ with responses here already is repaired range by range (see
            // `next_read_repair`): going back to it asks for everything still missing.
            let repaired = w.repair.is_some() || w.read_done > 0 && self.read_repairable(w);
            let answered = w.answered;
            if !(answered || repaired || self.req.sack_peer && self.req.skips(psn)) {
                return;
            }
            if repaired && !answered {
                let r = self.sq[self.req.send_idx].repair.get_or_insert_with(Default::default);
                r.tail_lost = true;
                r.asked = PsnBits::default();
                self.req.read_repair = true;
            }
            if !self.req.started {
                if self.sq[self.req.send_idx].op.is_read_or_atomic() {
                    self.req.rd_outstanding += 1;
                }
                self.req.started = true;
            }
            self.advance_send(self.req.send_idx, psn, plen, last);
        }
    }

    /// Moves the send position past WQE `i`'s packet at `psn`; returns its PSN range's end.
    fn advance_send(&mut self, i: usize, psn: Psn, payload_len: u32, last: bool) -> Psn {
        let w = &self.sq[i];
        let end_psn = match w.op {
            SendOp::Read { .. } => w.first_psn + w.npsn,
            _ => psn + 1,
        };
        if end_psn.distance(self.req.max_sent + 1) > 0 {
            self.req.max_sent = end_psn - 1;
        }
        self.req.next_psn = end_psn;
        self.req.send_offset += payload_len;
        if last {
            self.req.send_idx += 1;
            self.req.send_offset = 0;
            self.req.started = false;
        }
        end_psn
    }

    fn after_send(&mut self, now: Duration, i: usize, psn: Psn, payload_len: u32, last: bool, ack_req: bool) {
        self.stats.packets_sent += 1;
        let resent = psn.distance(self.req.max_sent) <= 0;
        if resent {
            self.stats.retransmits += 1;
            // Karn: the timed PSN sent again would no longer measure one round trip.
            if self.req.timed.is_some_and(|(t, _)| t == psn) {
                self.req.timed = None;
            }
            if self.req.reread == Some(psn) {
                self.req.reread = None;
            }
            if self.req.sack_peer {
                if let Some(k) = self.req.sack_bit(psn) {
                    self.req.rexmitted.set(k);
                    self.req.rexmit_at = Some(now);
                }
            }
        }
        let end_psn = self.advance_send(i, psn, payload_len, last);
        self.req.since_ack_req = if ack_req { 0 } else { self.req.since_ack_req + 1 };
        match self.cfg.qp_type {
            QpType::Rc => {
                if self.req.ack_deadline.is_none() {
                    self.rearm_ack_timer(now);
                }
                // Time a PSN sent for the first time that asks for an ACK (Karn: never a
                // resent one, whose ACK could answer either copy), of a SEND or WRITE: a
                // READ's or atomic's answer comes after the peer's work and the data.
                // Between softrdma peers a READ is timed too, to its first response (see
                // `on_read_response_selective`): a flow of READs alone otherwise never
                // measures the path.
                let w = &self.sq[i];
                let read = matches!(w.op, SendOp::Read { .. }) && self.read_repairable(w);
                let timeable = !w.op.is_read_or_atomic() || read;
                if ack_req && !resent && timeable && self.req.timed.is_none() {
                    self.req.timed = Some((if read { w.first_psn } else { end_psn - 1 }, now));
                }
                if self.req.probe_at.is_none() {
                    self.req.probe_at = self.pto(now).map(|t| now + t);
                }
            }
            // Unacknowledged transports complete a WR once its last packet is out.
            QpType::Uc | QpType::Ud => {
                if last {
                    self.req.acked_psn = end_psn - 1;
                    self.complete_front(WcStatus::Success);
                }
            }
        }
    }

    /// Goes back to the WQE holding `psn` (or the first unfinished one after it) and
    /// resends from there, when it next sends: the responses still to be handled before
    /// then (the rest of a received batch) are judged against what was sent, not against
    /// a send position already moved back.
    pub(super) fn go_back(&mut self, psn: Psn) {
        let earlier = self.req.pending_back.is_none_or(|p| psn.distance(p) < 0);
        if earlier {
            self.req.pending_back = Some(psn);
        }
    }

    /// Where the next packet sent will be: the send position after any pending go-back.
    pub(super) fn send_position(&self) -> Psn {
        match self.req.pending_back {
            Some(p) if p.distance(self.req.next_psn) < 0 => p,
            _ => self.req.next_psn,
        }
    }

    /// Moves the send position back to `psn` now (see `go_back`).
    fn rewind(&mut self, psn: Psn) {
        let end = if self.req.started { self.req.send_idx + 1 } else { self.req.send_idx };
        let end = end.min(self.sq.len());
        let Some(idx) = (0..end).find(|&k| {
            let w = &self.sq[k];
            w.done.is_none() && w.npsn > 0 && (w.contains(psn) || w.first_psn.distance(psn) > 0)
        }) else {
            return;
        };
        let pmtu = self.mtu.bytes();
        let w = &self.sq[idx];
        let (offset, resume_psn) = match w.op {
            SendOp::Read { .. } => (w.read_done, w.first_psn + w.read_done / pmtu),
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => (0, w.first_psn),
            _ if w.contains(psn) => (psn.distance(w.first_psn) as u32 * pmtu, psn),
            _ => (0, w.first_psn),
        };
        self.req.send_idx = idx;
        self.req.send_offset = offset;
        self.req.started = offset > 0 && !w.op.is_read_or_atomic();
        self.req.next_psn = resume_psn;
        self.req.rd_outstanding =
            self.sq.iter().take(idx).filter(|w| w.op.is_read_or_atomic() && w.done.is_none()).count() as u32;
    }

    /// Goes back to resend `psn` (a READ's missing responses, or a NAK's PSN), which
    /// selective recovery must not skip.
    pub(super) fn go_back_resend(&mut self, psn: Psn) {
        // (Also before the first SACK: one may come before the resend goes.)
        self.req.reread = Some(psn);
        if self.req.sack_peer && psn.distance(self.req.lost_limit) > 0 {
            self.req.lost_limit = psn;
        }
        self.go_back(psn);
    }

    /// How long a resend (or a READ range asked for again) gets to show up in the peer's
    /// answers before it counts as lost too: a round trip and a quarter, or the round
    /// trip's usual spread if that is wider. (A filled gap is acknowledged at once.)
    pub(super) fn resend_wait(&self) -> Duration {
        let rtt = self.req.srtt.unwrap_or(Duration::from_millis(1));
        rtt + (rtt / 4).max(4 * self.req.rttvar)
    }

    /// How long READ ranges asked for again get: `resend_wait`, doubled for each round of
    /// asking again that had no answer yet (an answer may queue behind a long stream of
    /// responses at the peer), until an asked-for response comes.
    fn read_ask_wait(&self) -> Duration {
        self.resend_wait() * (1u32 << self.req.read_ask_rounds.min(6))
    }

    /// When the resends and READ ranges asked for again should have been answered (see
    /// `resend_wait`), if any wait.
    pub(super) fn resend_deadline(&self) -> Option<Duration> {
        if !self.req.resend_armed {
            return None;
        }
        let resend = self.req.rexmit_at.map(|t| t + self.resend_wait());
        let ask = self.req.read_asked_at.map(|t| t + self.read_ask_wait());
        match (resend, ask) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Resends and READ ranges asked for again that are not answered a round trip later
    /// were lost as well: they may go again (at once, before a probe would find them when
    /// nothing else is left to send).
    fn resend_timeout(&mut self, now: Duration) {
        self.req.resend_armed = false;
        let wait = self.resend_wait();
        let mut again = false;
        if self.req.rexmit_at.is_some_and(|t| now >= t + wait) {
            self.req.rexmitted = PsnBits::default();
            self.req.rexmit_at = None;
            if let Some(lost) = self.req.first_lost() {
                if self.send_position().distance(lost) > 0 {
                    self.go_back(lost);
                }
                again = true;
            }
        }
        if self.req.read_asked_at.is_some_and(|t| now >= t + self.read_ask_wait()) {
            self.stale_read_asks(now);
            again |= self.req.read_repair;
        }
        if again {
            // What goes again now is what a probe would have sent: the probe waits anew.
            self.req.probe_at = self.pto(now).map(|t| now + t);
        }
    }

    pub(super) fn requester_timeout(&mut self, now: Duration) {
        if self.resend_deadline().is_some_and(|t| now >= t) {
            self.resend_timeout(now);
        }
        if self.req.rnr_until.is_some_and(|t| now >= t) {
            self.req.rnr_until = None;
            self.rearm_ack_timer(now);
        }
        if self.req.ack_deadline.is_none_or(|t| now < t) {
            self.requester_probe(now);
            return;
        }
        self.req.ack_deadline = None;
        if self.req.inflight() == 0 || self.state != QpState::Rts && self.state != QpState::Sqd {
            return;
        }
        self.stats.timeouts += 1;
        tracing::debug!(
            qpn = %format_args!("{:#08x}", self.qpn.get()),
            from = self.req.acked_psn.get().wrapping_add(1) & crate::MASK_24,
            retries_left = self.req.retry_left,
            "ACK timeout: going back"
        );
        if self.req.retry_left == 0 {
            self.fail_front(WcStatus::RetryExcErr);
            return;
        }
        self.req.retry_left -= 1;
        self.req.go_back_guard = None;
        self.req.ack_every = true;
        self.req.restart_recovery(true);
        self.req.pending_back = None;
        self.rewind(self.req.acked_psn + 1);
        self.req.reread = Some(self.req.next_psn);
        self.rearm_ack_timer(now);
        self.req.probes += 1;
        self.req.probe_at = self.pto(now).map(|t| now + t);
    }

    /// The probe timer (see [`Self::pto`]), when the ACK timer did not fire in the same
    /// pass (a timeout resends anyway, and counts).
    fn requester_probe(&mut self, now: Duration) {
        if self.req.probe_at.is_some_and(|t| now >= t) {
            // The wait counts from the last request sent, as RFC 8985's tail-loss probe and
            // QUIC's PTO count it, and is judged as the probe would be sent now: the timer
            // was armed when the first packet after the last progress went, and a burst
            // that took longer to post and send than a probe timeout (perftest's 100 WRs
            // at a time, the first ones a few packets in flight, which a SACK peer's
            // timeout is shortest for) would draw a probe before its last packet could be
            // answered, and a probe resends the whole burst.
            let due = self.req.last_request.zip(self.pto(now)).map(|(sent, wait)| sent + wait);
            if let Some(due) = due.filter(|&d| d > now) {
                self.req.probe_at = Some(due);
                return;
            }
            // A probe (see `pto`): nothing acknowledged for a probe timeout, so the tail of
            // what was sent, or its ACK, was probably lost: go back and resend, asking for
            // an ACK with every packet, without spending a retry. Not while an RNR NAK
            // says to wait.
            self.req.probe_at = None;
            // Not in SQD: a WQE sent before the drain began and rewound to its start would
            // not be sent again there.
            let may = self.req.rnr_until.is_none() && self.state == QpState::Rts;
            if self.req.inflight() > 0 && may {
                tracing::debug!(
                    srtt = ?self.req.srtt,
                    rttvar = ?self.req.rttvar,
                    inflight = self.req.inflight(),
                    since_progress = ?self.req.last_progress.map(|t| now.saturating_sub(t)),
                    probes = self.req.probes,
                    since_request = ?self.req.last_request.map(|t| now.saturating_sub(t)),
                    pto = ?self.pto(now),
                    sack_peer = self.req.sack_peer,
                    "probe: nothing acknowledged for a probe timeout"
                );
                self.stats.probes += 1;

                self.req.go_back_guard = None;
                self.req.ack_every = true;
                self.req.restart_recovery(false);
                self.req.pending_back = None;
                self.rewind(self.req.acked_psn + 1);
                // The first packet goes again even if the peer holds it: its answer is
                // the news that was missing (the last ACK may be what was lost).
                self.req.reread = Some(self.req.next_psn);
                self.req.probes += 1;
                self.req.probe_mark = Some(self.req.max_sent);
                self.req.probe_at = self.pto(now).map(|t| now + t);
            }
        }
    }

    /// Completes the WQE at the front of the SQ with `status` and pops it, with a
    /// completion if it is signaled or failed.
    pub(super) fn complete_front(&mut self, status: super::WcStatus) {
        self.pop_front_wqe(status);
        if status == WcStatus::Success {
            // READs answered while waiting behind this one complete now, in order.
            while self.sq.front().is_some_and(|w| w.answered) && self.req.send_idx > 0 {
                self.req.acked_psn = self.sq[0].last_psn();
                self.pop_front_wqe(WcStatus::Success);
            }
            // A READ now at the front may have responses already, taken while it waited.
            if let Some(w) = self.sq.front().filter(|w| w.read_done > 0 && self.req.send_idx > 0) {
                let got = w.first_psn + (w.read_done / self.mtu.bytes() - 1);
                if got.distance(self.req.acked_psn) > 0 {
                    self.req.acked_psn = got;
                }
            }
        }
    }

    fn pop_front_wqe(&mut self, status: super::WcStatus) {
        let Some(w) = self.sq.pop_front() else { return };
        self.req.send_idx = self.req.send_idx.saturating_sub(1);
        if w.op.is_read_or_atomic() {
            self.req.rd_outstanding = self.req.rd_outstanding.saturating_sub(1);
        }
        if w.signaled || status != WcStatus::Success {
            let byte_len = if status == WcStatus::Success { w.len } else { 0 };
            let wc = super::WorkCompletion { byte_len, ..self.wc(w.wr_id, status, w.op.wc_opcode()) };
            self.send_cq.push_back(wc);
        }
    }

    /// The destination a response to the peer goes to.
    pub(super) fn peer(&self) -> Option<SocketAddr> {
        self.remote
    }
}
