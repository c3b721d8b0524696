//! Queue pairs: the RC, UC and UD transport as a sans-IO state machine.
//!
//! A [`QueuePair`] takes events — work requests posted, packets received, the current
//! time — and yields packets to transmit, work completions and its next deadline. It
//! never reads a clock, owns no socket and reaches memory only through
//! [`crate::memory::Memory`]. A transmitted packet is described, not copied: the headers
//! are written into the caller's buffer and the payload is a list of memory segments, with
//! the ICRC already computed over all the pieces, so that a runtime can gather straight
//! from registered memory.
//!
//! The three roles of an RC QP live in their own files: [`requester`] turns send WQEs into
//! request packets and retransmits; [`completer`] handles ACKs, NAKs and responses and
//! completes send WQEs in order; [`responder`] checks and executes incoming requests and
//! answers them.
//!
//! Where the IBTA and Linux rxe differ, the wire follows rxe (accept what it sends, never
//! send what it drops) and local semantics follow the IBTA and hardware NICs:
//! - `retry_cnt = 7` means seven retries (rxe: infinite); `rnr_retry = 7` is infinite.
//! - A SEND larger than the receive buffer is NAKed *Invalid Request* (IBTA; the requester
//!   completes with REM_INV_REQ_ERR) and the receive completes with LOC_LEN_ERR; rxe NAKs
//!   *Remote Operational Error*. Both NAKs are accepted on receive.
//! - A fence waits for earlier READs and atomics only (IBTA; rxe waits for every WR).
//! - Sequence NAKs are not charged to `retry_cnt` (unspecified; rxe charges them).
//! - A UD send larger than the path MTU is refused at post time (rxe silently drops it and
//!   completes with success).

mod attr;
mod completer;
mod psnset;
mod requester;
mod responder;
mod srq;
mod wr;

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

pub use attr::{ModifyError, Mtu, QpAttr, QpAttrMask, QpState, QpType, PMTU_HEADROOM};
pub use psnset::SACK_SPAN;
pub use srq::{Srq, SrqId};
pub use wr::{RecvWr, SendFlags, SendOp, SendWr, SgList, Sge, UdDest, WcOpcode, WcStatus, WorkCompletion};

use crate::memory::{Access, Memory, PdId, Segment, Segments};
use crate::wire::{bundle, fill, icrc, Packet, PacketRepr, ICRC_LEN};
use crate::{Psn, Qkey, Qpn};
use psnset::PsnBits;

/// Largest message softrdma sends or accepts (as current rxe): 2^31 bytes.
pub const MAX_MESSAGE: u64 = 1 << 31;

/// Outstanding READs and atomics a QP may be given (rxe's `max_qp_rd_atom`).
pub const MAX_RD_ATOMIC: u8 = 128;

/// Unacknowledged PSNs a requester allows in flight (rxe's limit is 128); towards a peer
/// that sends SACKs, packets in flight that the peer does not hold yet, within a span of
/// [`SACK_SPAN`] PSNs.
pub const MAX_INFLIGHT_PSNS: u32 = 128;

/// Packets whose headers after the BTH, payload and pad fit in this many bytes are built
/// contiguous, the payload copied after the headers (see `finish_packet`), in any buffer
/// that holds them; larger ones are too when the buffer also has room for the tail.
const SMALL_INLINE: usize = 256;

/// How many work requests and scatter entries a QP holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send WR.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive WR.
    pub max_recv_sge: u32,
    /// Largest inline send.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> QpCaps {
        QpCaps {
            max_send_wr: 1024,
            max_recv_wr: 1024,
            max_send_sge: 32,
            max_recv_sge: 32,
            max_inline_data: 512,
        }
    }
}

/// What a QP is created with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpConfig {
    /// Transport service.
    pub qp_type: QpType,
    /// Protection domain: the QP reaches only memory of this domain.
    pub pd: PdId,
    /// The local address packets leave from (IP and UDP port); the ICRC covers it.
    pub local: SocketAddr,
    /// Queue sizes.
    pub caps: QpCaps,
    /// Every send WR is signaled.
    pub sq_sig_all: bool,
    /// Take receive WQEs from this shared receive queue instead of the QP's own.
    pub srq: Option<SrqId>,
}

/// Why a post was refused; nothing was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// The QP's state does not accept this kind of WR.
    #[error("QP in state {0:?} does not accept this work request")]
    InvalidState(QpState),
    /// The queue is full.
    #[error("queue full")]
    QueueFull,
    /// More scatter/gather entries than the QP's capability.
    #[error("too many scatter/gather entries")]
    TooManySge,
    /// Inline data longer than the QP's capability.
    #[error("inline data too long")]
    InlineTooLong,
    /// The message is longer than the transport allows (2^31, or the MTU on UD).
    #[error("message too long")]
    MessageTooLong,
    /// The operation does not exist on this QP type, or a UD destination is missing or
    /// given to a connected QP.
    #[error("operation not supported on this QP type")]
    Unsupported,
    /// An atomic needs one 8-byte local buffer for the result.
    #[error("an atomic needs a scatter list of at least 8 bytes")]
    AtomicBuffer,
    /// An inline WR's data could not be read.
    #[error("inline data is not readable registered memory")]
    InlineFault,
}

/// Room for a [`Transmit`]'s tail: pad (3 at most), ICRC, and a bundled ACK; or pad,
/// filler (16 at most, see [`crate::wire::fill`]) and ICRC: a filled packet is full, and
/// never takes a bundle.
pub const TAIL_ROOM: usize = 3 + ICRC_LEN + crate::wire::bundle::BUNDLED_ACK_LEN;
const _: () = assert!(3 + 16 + ICRC_LEN <= TAIL_ROOM);

/// A packet ready to go: its head in the caller's buffer (headers, and the payload when
/// the buffer held it), any payload left in registered memory, then the tail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// The UDP port it leaves from, on the endpoint's address: the QP's (see
    /// [`crate::endpoint::Endpoint::set_source_ports`]); the ICRC covers it.
    pub src_port: u16,
    /// Destination address (port 4791 unless configured otherwise).
    pub dst: SocketAddr,
    /// Bytes at the start of the caller's buffer: BTH, extension headers and any inline
    /// payload.
    pub head_len: usize,
    /// Payload to gather from memory, in order, after the head.
    pub payload: Segments,
    /// The protection domain the segments belong to.
    pub pd: PdId,
    /// Pad bytes (and any filler, [`crate::wire::fill`]) and ICRC, to append after the
    /// payload, and a bundled ACK if one rides along (see [`crate::wire::bundle`]).
    pub tail: [u8; TAIL_ROOM],
    /// Used length of `tail`.
    pub tail_len: usize,
    /// Send this datagram on its own (not in a GSO train): its peer checks the ICRC
    /// against the Identification the kernel writes, which is 0 only for single sends.
    pub alone: bool,
    /// The IP TOS byte (traffic class: DSCP and ECN) to send with; the ICRC does not
    /// cover it.
    pub tos: u8,
}

impl Transmit {
    /// The packet ECN-capable (ECT(0)), as connected requests go, unless its traffic class
    /// already gave it an ECN codepoint.
    pub(crate) fn ect(mut self) -> Transmit {
        self.set_ect();
        self
    }

    /// [`Self::ect`] in place (no copy of the whole struct on the way out).
    pub(crate) fn set_ect(&mut self) {
        if self.tos & 3 == 0 {
            self.tos |= 0b10;
        }
    }

    /// Length of the whole UDP payload.
    pub fn len(&self) -> usize {
        self.head_len + self.payload.iter().map(|s| s.len as usize).sum::<usize>() + self.tail_len
    }
    /// Never true: a packet has at least a BTH.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// Assembles the datagram into a vector (simulator and tests; a runtime gathers with
    /// iovecs instead).
    pub fn assemble(&self, head: &[u8], mem: &dyn Memory) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        v.extend_from_slice(&head[..self.head_len]);
        for seg in &self.payload {
            // The segments were readable when the ICRC was computed a moment ago; if the
            // region vanished since, the bytes are missing and the receiver's ICRC check
            // drops the packet, as it would any damaged one.
            let _ = mem.gather(self.pd, seg, &mut |b| v.extend_from_slice(b));
        }
        v.extend_from_slice(&self.tail[..self.tail_len]);
        v
    }
}

/// Counters of what a QP dropped or retried, for tools and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpStats {
    /// Request packets sent, retransmissions included.
    pub packets_sent: u64,
    /// Packets resent by go-back-N.
    pub retransmits: u64,
    /// Local ACK timeouts.
    pub timeouts: u64,
    /// Probes: go-backs after a probe timeout without an ACK (no retry spent).
    pub probes: u64,
    /// Requests that arrived marked Congestion Experienced.
    pub ce_received: u64,
    /// CNPs sent (one per CE-marked arrival, at most one per 50 µs).
    pub cnps_sent: u64,
    /// CNPs received.
    pub cnps_received: u64,
    /// The congestion window now, in PSNs (RC).
    pub cwnd: u64,
    /// The smoothed round trip the requester measured, in nanoseconds (RC; 0 before the
    /// first measurement).
    pub srtt_ns: u64,
    /// Window cuts for a round trip past the delay target (see the requester's delay
    /// reaction).
    pub delay_cuts: u64,
    /// Window cuts for a loss while a queue stood (see the requester's loss reaction).
    pub loss_cuts: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// Sequence NAKs received.
    pub seq_naks_received: u64,
    /// Duplicate requests seen by the responder.
    pub duplicates: u64,
    /// Packets dropped for a bad state, address, Q_Key or out-of-window PSN.
    pub dropped: u64,
    /// Of those, packets from the peer's IP address but not from the UDP port its first
    /// valid packet came from (see [`QueuePair::handle_packet`]).
    pub wrong_port: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// Sequence NAKs sent.
    pub seq_naks_sent: u64,
    /// Requests that arrived ahead of a gap and were held for selective recovery.
    pub held: u64,
    /// SACKs sent.
    pub sacks_sent: u64,
    /// SACKs received.
    pub sacks_received: u64,
    /// Positive ACKs sent in the datagram of a request (see [`crate::wire::bundle`]).
    pub acks_bundled: u64,
}

struct SendWqe {
    wr_id: u64,
    op: SendOp,
    sgl: SgList,
    inline: Option<Vec<u8>>,
    signaled: bool,
    solicited: bool,
    fence: bool,
    ud: Option<UdDest>,
    len: u32,
    /// First PSN, set when the first packet goes out.
    first_psn: Psn,
    /// PSNs the message uses (packets, or a READ's responses); 0 until first sent.
    npsn: u32,
    /// READ: response bytes received so far.
    read_done: u32,
    /// Completed, waiting for the WQEs before it.
    done: Option<WcStatus>,
    /// A READ whose every response arrived while a WQE before it was still incomplete:
    /// it completes when it reaches the front, and is never requested again.
    answered: bool,
    /// A READ's responses taken out of order (selective recovery): see [`ReadRepair`].
    repair: Option<Box<ReadRepair>>,
}

/// Selective repair of a READ's responses, between softrdma peers: responses that arrive
/// after a lost one are placed where they belong and remembered, and every missing range
/// is asked for again at once, each with a READ request for just that range (which a
/// softrdma responder answers, IBTA 9.7.5.1.1's duplicate READ with a shorter length).
/// The bitmaps cover `SACK_SPAN` responses from the first missing one on (`base`); one
/// further on is not kept (it is asked for again once the window reaches it).
#[derive(Default)]
struct ReadRepair {
    /// The response (counted from the READ's first PSN) that bit 0 stands for: every one
    /// before it arrived.
    base: u32,
    /// Bit i: response `base + i` arrived.
    seen: PsnBits,
    /// Bit i: response `base + i` was asked for again, and the answer may still come.
    asked: PsnBits,
    /// Something the responder sent after this READ's last response arrived (an answer
    /// to a later request): every response not seen by now was lost.
    tail_lost: bool,
}

impl ReadRepair {
    /// The bit of response `i`, if the window holds it.
    fn bit(&self, i: u32) -> Option<u32> {
        i.checked_sub(self.base).filter(|&k| k < psnset::SACK_SPAN)
    }
    /// Whether response `i` arrived.
    fn has(&self, i: u32) -> bool {
        i < self.base || self.bit(i).is_some_and(|k| self.seen.get(k))
    }
    /// Whether response `i` was asked for again.
    fn was_asked(&self, i: u32) -> bool {
        self.bit(i).is_some_and(|k| self.asked.get(k))
    }
    /// Records response `i` as arrived (one outside the window is not recorded).
    fn see(&mut self, i: u32) {
        if let Some(k) = self.bit(i) {
            self.seen.set(k);
        }
    }
    /// Records response `i` as asked for again.
    fn ask(&mut self, i: u32) {
        if let Some(k) = self.bit(i) {
            self.asked.set(k);
        }
    }
    /// Moves the window to start at response `to` (everything before it arrived).
    fn slide(&mut self, to: u32) {
        if to > self.base {
            let d = (to - self.base).min(psnset::SACK_SPAN) as i32;
            self.seen.move_base(d);
            self.asked.move_base(d);
            self.base = to;
        }
    }
    /// The last response seen past the window's start, if any.
    fn highest_seen(&self) -> Option<u32> {
        self.seen.ones().last().map(|k| self.base + k)
    }
    /// One past the last response the window holds.
    fn window_end(&self) -> u32 {
        self.base + psnset::SACK_SPAN
    }
}

impl SendWqe {
    fn last_psn(&self) -> Psn {
        self.first_psn + (self.npsn - 1)
    }
    fn contains(&self, psn: Psn) -> bool {
        let d = psn.distance(self.first_psn);
        d >= 0 && (d as u32) < self.npsn
    }
}

struct RecvWqe {
    wr_id: u64,
    sgl: SgList,
    len: u64,
}

/// Where a QP's receive WQEs come from: its own queue or its SRQ.
type RecvSource<'a, 'b> = &'a mut Option<&'b mut Srq>;

/// A queue pair.
pub struct QueuePair {
    qpn: Qpn,
    cfg: QpConfig,
    state: QpState,
    access: Access,
    qkey: Qkey,
    mtu: Mtu,
    remote: Option<SocketAddr>,
    /// The UDP port the peer sends from, latched from its first valid packet.
    peer_port: Option<u16>,
    /// The address vector's traffic class.
    traffic_class: u8,
    dest_qpn: Qpn,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    sq: VecDeque<SendWqe>,
    rq: VecDeque<RecvWqe>,
    send_cq: VecDeque<WorkCompletion>,
    recv_cq: VecDeque<WorkCompletion>,
    req: requester::Requester,
    resp: responder::Responder,
    stats: QpStats,
    /// The peer is not softrdma (Linux rxe, a RoCE NIC): see [`Self::set_foreign_peer`].
    foreign_peer: bool,
    /// Selective recovery as a responder: see [`Self::set_selective`].
    selective: bool,
    /// The request just returned left its waiting ACK to come next (`take_ack_follows`).
    ack_follows: bool,
    /// The request being built may carry the waiting ACK in its datagram: `finish_packet`
    /// flags it if it leaves room (see [`crate::wire::bundle`]).
    bundling: bool,
    /// Bundles may be sent to a softrdma peer: see [`Self::set_bundle_acks`].
    bundle_acks: bool,
    /// The peer's requests say that it splits bundles ([`bundle::SPLITS_BUNDLES`]): only
    /// then do ACKs ride with this QP's requests (a softrdma build older than bundles
    /// would take a bundle whole and drop it on its ICRC).
    peer_splits: bool,
    /// This QP's requests say that it splits bundles (on; off only to play an older build
    /// in tests).
    announce_splits: bool,
    /// The peer's packets say that it takes filler off ([`fill::TAKES_FILL`]): only then
    /// are this QP's full packets filled to their message's first packet's length.
    peer_fills: bool,
    /// This QP's packets say that it takes filler off (on; off only to play an older build
    /// in tests).
    announce_fill: bool,
    /// A packet of this QP carrying [`fill::TAKES_FILL`] has gone to the peer.
    told_fill: bool,
    /// A UC QP that has only received from a softrdma peer owes it a word that it takes
    /// filler off (see `Self::fill_hello`).
    fill_hello_due: bool,
    /// While a multicast packet is handled: the group it was sent to (the destination in
    /// the receive buffer's GRH area).
    mcast_dst: Option<IpAddr>,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.qpn)
            .field("type", &self.cfg.qp_type)
            .field("state", &self.state)
            .field("sq", &self.sq.len())
            .field("rq", &self.rq.len())
            .finish_non_exhaustive()
    }
}

impl QueuePair {
    /// A new QP in the RESET state.
    pub fn new(qpn: Qpn, cfg: QpConfig) -> QueuePair {
        QueuePair {
            qpn,
            cfg,
            state: QpState::Reset,
            access: Access::NONE,
            qkey: Qkey(0),
            mtu: Mtu::Mtu1024,
            remote: None,
            peer_port: None,
            mcast_dst: None,
            traffic_class: 0,
            dest_qpn: Qpn::new(0),
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            sq: VecDeque::new(),
            rq: VecDeque::new(),
            send_cq: VecDeque::new(),
            recv_cq: VecDeque::new(),
            req: requester::Requester::new(Psn::new(0)),
            resp: responder::Responder::new(Psn::new(0)),
            stats: QpStats::default(),
            foreign_peer: false,
            selective: false,
            ack_follows: false,
            bundling: false,
            bundle_acks: true,
            peer_splits: false,
            announce_splits: true,
            peer_fills: false,
            announce_fill: true,
            told_fill: false,
            fill_hello_due: false,
        }
    }

    /// The QP number.
    pub fn qpn(&self) -> Qpn {
        self.qpn
    }
    /// The QP type.
    pub fn qp_type(&self) -> QpType {
        self.cfg.qp_type
    }
    /// The local address and UDP port the QP's packets leave from.
    pub fn local_addr(&self) -> SocketAddr {
        self.cfg.local
    }
    /// The current state.
    pub fn state(&self) -> QpState {
        self.state
    }
    /// The protection domain.
    pub fn pd(&self) -> PdId {
        self.cfg.pd
    }
    /// The peer's address, for connected QPs past INIT.
    pub fn remote(&self) -> Option<SocketAddr> {
        self.remote
    }
    /// Counters.
    pub fn stats(&self) -> QpStats {
        QpStats {
            cwnd: u64::from(self.req.cwnd),
            srtt_ns: self.req.srtt.map_or(0, |d| d.as_nanos() as u64),
            delay_cuts: self.req.delay_cuts,
            loss_cuts: self.req.loss_cuts,
            ..self.stats
        }
    }
    /// The path MTU (RC, UC) or the MTU UD sends are limited to.
    pub fn mtu(&self) -> Mtu {
        self.mtu
    }
    /// Send WQEs not yet completed.
    pub fn send_queue_len(&self) -> usize {
        self.sq.len()
    }
    /// Receive WQEs posted and not yet consumed.
    pub fn recv_queue_len(&self) -> usize {
        self.rq.len()
    }

    /// Sets the path MTU of a UD QP (the port's active MTU); connected QPs take it from
    /// `modify`.
    pub fn set_ud_mtu(&mut self, mtu: Mtu) {
        if self.cfg.qp_type == QpType::Ud {
            self.mtu = mtu;
        }
    }

    /// Marks the peer as foreign (Linux rxe, a RoCE NIC) or softrdma (the default).
    ///
    /// A softrdma peer computes every ICRC for IPv4 Identification 0 and DF, so its packets
    /// are checked with all 32 bits. A foreign peer's kernel or NIC fills the
    /// Identification, which a UDP socket cannot see, so its packets are accepted when
    /// *some* Identification and DF make the ICRC match (15 of 32 bits of strength left;
    /// see [`crate::wire::icrc`]); and packets to it are marked so that a runtime does not
    /// batch them into GSO trains, whose segments would get IDs the ICRC did not cover.
    pub fn set_foreign_peer(&mut self, foreign: bool) {
        self.foreign_peer = foreign;
    }

    /// Whether the peer is foreign.
    pub fn foreign_peer(&self) -> bool {
        self.foreign_peer
    }

    /// Turns selective recovery on or off for this QP's responder (RC, softrdma peers).
    ///
    /// Go-back-N, what the IBTA specifies, throws away everything after a lost packet:
    /// the responder NAKs the gap and drops what follows, and the requester sends it all
    /// again. With selective recovery the responder instead holds requests that arrive
    /// ahead of a gap (up to [`SACK_SPAN`] PSNs ahead, as copies of the packets),
    /// answers with a SACK (vendor opcode 0xC0, see [`crate::wire::Operation::Sack`])
    /// saying what it holds, and executes the held requests in PSN order once the gap is
    /// filled, so that execution, completions and every check stay exactly as in order.
    /// The requester resends only what a SACK shows missing, or after a probe timeout
    /// what no SACK covered; its window then counts the packets the peer does not hold
    /// (at most 128, within a span of [`SACK_SPAN`] PSNs), so a hole under repair does
    /// not stop fresh packets. Every softrdma requester understands SACKs; a responder sends
    /// them only when this is on and the peer is not foreign (Linux rxe and NICs know no
    /// vendor opcode: towards them the wire stays go-back-N). Off by default in this
    /// crate; the runtime turns it on for softrdma peers.
    pub fn set_selective(&mut self, on: bool) {
        self.selective = on;
    }

    /// Whether a positive ACK that waits for the QP's next request may ride in that
    /// request's datagram towards a softrdma peer ([`crate::wire::bundle`]; on by default):
    /// off, the two go one after the other, as towards a foreign peer. Bundles received
    /// are split either way.
    pub fn set_bundle_acks(&mut self, on: bool) {
        self.bundle_acks = on;
    }

    /// Whether this QP's requests to a softrdma peer carry [`bundle::SPLITS_BUNDLES`] (on
    /// by default): off, the QP looks to its peer like a softrdma build older than
    /// bundles, which is what the tests of that case use it for.
    pub fn set_announce_splits(&mut self, on: bool) {
        self.announce_splits = on;
    }

    /// Whether this QP's packets to a softrdma peer carry [`fill::TAKES_FILL`] (on by
    /// default): off, the QP looks to its peer like a softrdma build older than filler,
    /// and gets none.
    pub fn set_announce_fill(&mut self, on: bool) {
        self.announce_fill = on;
    }

    /// Whether the peer's packets have said that it takes filler off: this QP's full
    /// packets then go filled ([`crate::wire::fill`]).
    pub fn peer_takes_fill(&self) -> bool {
        self.peer_fills
    }

    /// Takes the peer for one that takes filler off (or not) without waiting for its
    /// packets to say so: for tests of the framing on its own.
    #[doc(hidden)]
    pub fn set_peer_takes_fill(&mut self, on: bool) {
        self.peer_fills = on;
    }

    /// Whether the peer's requests have said that it splits bundles.
    pub fn peer_splits_bundles(&self) -> bool {
        self.peer_splits
    }

    /// Takes the peer for one that splits bundles (or not) without waiting for its
    /// requests to say so: for tests of a receiver that gets bundles it did not ask for.
    #[doc(hidden)]
    pub fn set_peer_splits_bundles(&mut self, on: bool) {
        self.peer_splits = on;
    }

    /// Whether selective recovery is on towards this QP's peer (softrdma, RC): the
    /// responder holds early requests and sends SACKs, and the requester takes READ
    /// responses out of order and asks again only for the missing ones.
    fn selective_peer(&self) -> bool {
        self.selective && !self.foreign_peer && self.cfg.qp_type == QpType::Rc
    }

    /// Changes state and attributes, as `ibv_modify_qp`. On error nothing changes.
    pub fn modify(&mut self, attr: &QpAttr) -> Result<(), ModifyError> {
        let to = attr.state.unwrap_or(self.state);
        attr::check_transition(self.cfg.qp_type, self.state, to, attr, MAX_RD_ATOMIC)?;
        if let Some(a) = attr.access_flags {
            self.access = a;
        }
        if let Some(q) = attr.qkey {
            self.qkey = q;
        }
        if let Some(m) = attr.path_mtu {
            self.mtu = m;
        }
        if let Some(r) = attr.remote {
            self.remote = Some(r);
            self.peer_port = None;
            // A new peer says for itself whether it splits bundles and takes filler off,
            // and is told for itself.
            self.peer_splits = false;
            self.peer_fills = false;
            self.told_fill = false;
            self.fill_hello_due = false;
        }
        if let Some(t) = attr.traffic_class {
            self.traffic_class = t;
        }
        if let Some(d) = attr.dest_qpn {
            self.dest_qpn = d;
        }
        if let Some(p) = attr.rq_psn {
            self.resp = responder::Responder::new(p);
        }
        if let Some(p) = attr.sq_psn {
            self.req = requester::Requester::new(p);
        }
        if let Some(v) = attr.max_rd_atomic {
            self.max_rd_atomic = v;
        }
        if let Some(v) = attr.max_dest_rd_atomic {
            self.max_dest_rd_atomic = v;
        }
        if let Some(v) = attr.min_rnr_timer {
            self.min_rnr_timer = v;
        }
        if let Some(v) = attr.timeout {
            self.timeout = v;
        }
        if let Some(v) = attr.retry_cnt {
            self.retry_cnt = v;
            self.req.retry_left = v;
        }
        if let Some(v) = attr.rnr_retry {
            self.rnr_retry = v;
            self.req.rnr_left = v;
        }
        match to {
            QpState::Reset => {
                self.peer_splits = false;
                self.peer_fills = false;
                self.told_fill = false;
                self.fill_hello_due = false;
                self.sq.clear();
                self.rq.clear();
                self.req = requester::Requester::new(Psn::new(0));
                self.resp = responder::Responder::new(Psn::new(0));
            }
            QpState::Error => self.enter_error(),
            _ => {}
        }
        if self.state != to {
            tracing::debug!(qpn = %format_args!("{:#08x}", self.qpn.get()), from = ?self.state, to = ?to, "QP state");
        }
        self.state = to;
        Ok(())
    }

    /// What the QP was created with.
    pub fn config(&self) -> &QpConfig {
        &self.cfg
    }

    /// The current attributes, every field set (`ibv_query_qp` with a full mask). For UD
    /// QPs the connection fields (`remote`, `dest_qpn`, `rq_psn`, RC timers) are `None`;
    /// for connected QPs `qkey` is.
    pub fn attr(&self) -> QpAttr {
        let connected = self.cfg.qp_type != QpType::Ud;
        let rc = self.cfg.qp_type == QpType::Rc;
        QpAttr {
            state: Some(self.state),
            pkey_index: Some(0),
            port: Some(1),
            access_flags: connected.then_some(self.access),
            qkey: (!connected).then_some(self.qkey),
            path_mtu: Some(self.mtu),
            remote: if connected { self.remote } else { None },
            traffic_class: connected.then_some(self.traffic_class),
            dest_qpn: connected.then_some(self.dest_qpn),
            rq_psn: connected.then_some(self.resp.expected_psn()),
            sq_psn: Some(self.req.next_psn),
            max_rd_atomic: rc.then_some(self.max_rd_atomic),
            max_dest_rd_atomic: rc.then_some(self.max_dest_rd_atomic),
            min_rnr_timer: rc.then_some(self.min_rnr_timer),
            timeout: rc.then_some(self.timeout),
            retry_cnt: rc.then_some(self.retry_cnt),
            rnr_retry: rc.then_some(self.rnr_retry),
        }
    }

    /// The shared receive queue the QP takes receive WQEs from, if any.
    pub fn srq(&self) -> Option<SrqId> {
        self.cfg.srq
    }

    /// Posts a receive WR (not on a QP attached to an SRQ: post to the SRQ).
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        if self.state == QpState::Reset {
            return Err(PostError::InvalidState(self.state));
        }
        if self.cfg.srq.is_some() {
            return Err(PostError::Unsupported);
        }
        if wr.sg_list.len() > self.cfg.caps.max_recv_sge as usize {
            return Err(PostError::TooManySge);
        }
        if self.rq.len() >= self.cfg.caps.max_recv_wr as usize {
            return Err(PostError::QueueFull);
        }
        let len = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
        let wqe = RecvWqe { wr_id: wr.wr_id, sgl: wr.sg_list, len };
        if self.state == QpState::Error {
            self.recv_cq.push_back(self.flush_wc(wqe.wr_id, WcOpcode::Recv));
            return Ok(());
        }
        self.rq.push_back(wqe);
        Ok(())
    }

    /// Posts a send WR. `mem` is read only for inline data.
    pub fn post_send(&mut self, wr: SendWr, mem: &dyn Memory) -> Result<(), PostError> {
        let ud = self.cfg.qp_type == QpType::Ud;
        match self.state {
            QpState::Rts | QpState::Sqd | QpState::Error => {}
            s => return Err(PostError::InvalidState(s)),
        }
        if wr.ud.is_some() != ud {
            return Err(PostError::Unsupported);
        }
        let supported = match self.cfg.qp_type {
            QpType::Rc => true,
            QpType::Uc => matches!(
                wr.op,
                SendOp::Send | SendOp::SendWithImm(_) | SendOp::Write { .. } | SendOp::WriteWithImm { .. }
            ),
            QpType::Ud => matches!(wr.op, SendOp::Send | SendOp::SendWithImm(_)),
        };
        if !supported {
            return Err(PostError::Unsupported);
        }
        if wr.sg_list.len() > self.cfg.caps.max_send_sge as usize {
            return Err(PostError::TooManySge);
        }
        if self.sq.len() >= self.cfg.caps.max_send_wr as usize {
            return Err(PostError::QueueFull);
        }
        let total: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
        if total > MAX_MESSAGE || (ud && total > u64::from(self.mtu.bytes())) {
            return Err(PostError::MessageTooLong);
        }
        if wr.op.is_atomic() && total < 8 {
            return Err(PostError::AtomicBuffer);
        }
        let inline = if wr.flags.inline && !wr.op.is_read_or_atomic() {
            if total > u64::from(self.cfg.caps.max_inline_data) {
                return Err(PostError::InlineTooLong);
            }
            let mut data = Vec::with_capacity(total as usize);
            for s in &wr.sg_list {
                let seg = Segment { key: crate::memory::MemKey::Local(s.lkey), addr: s.addr, len: s.length };
                mem.gather(self.cfg.pd, &seg, &mut |b| data.extend_from_slice(b))
                    .map_err(|_| PostError::InlineFault)?;
            }
            Some(data)
        } else {
            None
        };
        let len = if wr.op.is_atomic() { 8 } else { total as u32 };
        let wqe = SendWqe {
            wr_id: wr.wr_id,
            op: wr.op,
            sgl: wr.sg_list,
            inline,
            signaled: wr.flags.signaled || self.cfg.sq_sig_all,
            solicited: wr.flags.solicited,
            fence: wr.flags.fence,
            ud: wr.ud,
            len,
            first_psn: Psn::new(0),
            npsn: 0,
            read_done: 0,
            done: None,
            answered: false,
            repair: None,
        };
        if self.state == QpState::Error {
            self.send_cq.push_back(self.flush_wc(wqe.wr_id, wqe.op.wc_opcode()));
            return Ok(());
        }
        self.sq.push_back(wqe);
        Ok(())
    }

    /// The next send-queue completion.
    pub fn poll_send_completion(&mut self) -> Option<WorkCompletion> {
        self.send_cq.pop_front()
    }

    /// The next receive-queue completion.
    pub fn poll_recv_completion(&mut self) -> Option<WorkCompletion> {
        self.recv_cq.pop_front()
    }

    /// The earliest time at which [`Self::handle_timeout`] has work to do.
    pub fn poll_timeout(&self) -> Option<Duration> {
        [
            self.req.ack_deadline,
            self.req.rnr_until,
            self.req.probe_at,
            self.resp.ack_deadline(),
            self.resend_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs the timers that are due at `now`.
    pub fn handle_timeout(&mut self, now: Duration) {
        self.requester_timeout(now);
    }

    /// Handles a multicast packet for a group this QP is attached to (the endpoint picks
    /// the QPs): a UD receive whose GRH area names the group as the destination.
    pub fn handle_multicast(
        &mut self,
        now: Duration,
        arrival: crate::endpoint::Arrival,
        pkt: &Packet<&[u8]>,
        mem: &mut dyn Memory,
        srq: Option<&mut Srq>,
    ) {
        self.mcast_dst = Some(arrival.dst.ip());
        self.handle_packet(now, arrival.src, arrival.tos, pkt, mem, srq);
        self.mcast_dst = None;
    }

    /// Handles a packet addressed to this QP that passed the ICRC check, from `src`, that
    /// arrived with IP TOS byte `tos`. `srq` is the QP's shared receive queue, if it has
    /// one.
    #[allow(clippy::too_many_arguments)]
    pub fn handle_packet(
        &mut self,
        now: Duration,
        src: SocketAddr,
        tos: u8,
        pkt: &Packet<&[u8]>,
        mem: &mut dyn Memory,
        mut srq: Option<&mut Srq>,
    ) {
        let op = pkt.opcode();
        if op.transport() == crate::wire::Transport::Cnp {
            // A congestion notification from the peer's responder.
            // Only from the peer: its address and, once latched, its UDP port (as every
            // other packet).
            let connected = self.cfg.qp_type != QpType::Ud;
            let from_peer = self.remote.is_some_and(|r| r.ip() == src.ip())
                && self.peer_port.is_none_or(|p| p == src.port());
            if connected && from_peer {
                self.on_cnp(now);
            } else {
                self.stats.dropped += 1;
            }
            return;
        }
        let transport_ok = match self.cfg.qp_type {
            QpType::Rc => op.transport() == crate::wire::Transport::Rc,
            QpType::Uc => op.transport() == crate::wire::Transport::Uc,
            QpType::Ud => op.transport() == crate::wire::Transport::Ud,
        };
        let _span =
            tracing::debug_span!("qp", qpn = %format_args!("{:#08x}", self.qpn.get()), peer = %src).entered();
        let connected = self.cfg.qp_type != QpType::Ud;
        let state_ok = matches!(self.state, QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe);
        // A connected QP takes packets from its peer's IP address, and from one UDP port:
        // the peer's source port is not known in advance (rxe sends from a port of its own
        // per QP, 0xC000 | a hash, while replies go to 4791), so the QP latches the port of
        // the first packet that could only come from the peer (the PSN it expects, or a
        // response to a PSN outstanding) and drops packets from any other port after that.
        // A blind attacker who spoofs the peer's address must then also guess the port.
        let from_peer = self.remote.is_some_and(|r| r.ip() == src.ip());
        if !transport_ok || !state_ok || (connected && !from_peer) {
            let cause = if !transport_ok {
                "another transport's opcode"
            } else if !state_ok {
                "QP not ready to receive"
            } else {
                "not from the peer's address"
            };
            tracing::debug!(state = ?self.state, opcode = %op, cause, "dropped");
            self.stats.dropped += 1;
            return;
        }
        if connected {
            match self.peer_port {
                Some(port) if port != src.port() => {
                    tracing::debug!(latched = port, "dropped: not from the peer's UDP port");
                    self.stats.dropped += 1;
                    self.stats.wrong_port += 1;
                    return;
                }
                Some(_) => {}
                None if self.latches(pkt) => self.peer_port = Some(src.port()),
                None => {}
            }
            // Any packet from the peer's latched port may say that it takes filler off
            // (see `wire::fill`): a WRITE stream's receiver sends only ACKs.
            let says_fill = self.peer_port == Some(src.port())
                && pkt.as_bytes().get(fill::FLAG_BYTE).is_some_and(|b| b & fill::TAKES_FILL != 0);
            if says_fill {
                self.peer_fills = true;
                if self.is_fill_hello(pkt) {
                    // Said and heard: nothing for the responder (see `fill_hello`).
                    return;
                }
                // A UC receiver's peer learns the same of it only from its packets.
                if self.cfg.qp_type == QpType::Uc
                    && !self.told_fill
                    && self.announce_fill
                    && !self.foreign_peer
                {
                    self.fill_hello_due = true;
                }
            }
        }
        if op.is_request() {
            // A request from the peer's latched port that says its QP splits bundles (see
            // `wire::bundle`).
            if connected
                && self.peer_port == Some(src.port())
                && pkt.as_bytes().get(bundle::FLAG_BYTE).is_some_and(|b| b & bundle::SPLITS_BUNDLES != 0)
            {
                self.peer_splits = true;
            }
            if self.cfg.srq.is_some() && srq.is_none() {
                // The runtime must pass the SRQ; without it, nothing can be received.
                self.stats.dropped += 1;
                return;
            }
            self.handle_request(now, src, tos, pkt, mem, &mut srq);
            self.resp.last_request = Some(now);
            // An ACK waits for company only on a QP that talks back (it sent a request
            // lately: a ping-pong, an RPC); towards a peer that only sends, the reply it
            // would wait for is not coming, and its sender would wait on the delay.
            let talks_back =
                self.req.last_request.is_some_and(|t| now.saturating_sub(t) < responder::TALKS_BACK);
            self.resp.schedule_ack(now, talks_back);
        } else if self.state != QpState::Rtr {
            self.handle_response(now, pkt, mem);
        }
    }

    /// Whether `pkt`, from the peer, is its word that it takes filler off (see
    /// `fill_hello`): a zero-length UC RDMA WRITE ONLY from a softrdma peer.
    fn is_fill_hello(&self, pkt: &Packet<&[u8]>) -> bool {
        self.cfg.qp_type == QpType::Uc
            && !self.foreign_peer
            && pkt.opcode().operation() == crate::wire::Operation::RdmaWriteOnly
            && pkt.reth().is_some_and(|r| r.dma_len() == 0)
            && pkt.payload().is_empty()
    }

    /// Whether a packet from the peer's address is one only the peer could send (before its
    /// port is known): a request with the PSN expected next (any first packet on UC), or
    /// a response to a PSN outstanding.
    fn latches(&self, pkt: &Packet<&[u8]>) -> bool {
        let psn = pkt.bth().psn();
        if pkt.opcode().is_request() {
            self.cfg.qp_type == QpType::Uc || psn == self.resp.expected_psn()
        } else {
            self.req.outstanding(psn)
        }
    }

    /// The next packet this QP wants to send, if any: responses first, then requests.
    pub fn poll_transmit(&mut self, now: Duration, buf: &mut [u8], mem: &dyn Memory) -> Option<Transmit> {
        let peer = !self.foreign_peer && self.cfg.qp_type != QpType::Ud;
        // Towards a softrdma peer, a request that is ready goes before the lone positive ACK
        // that waited for it, and the ACK with it: in the same datagram, after the request
        // (a bundle, see `wire::bundle`: a pong that carries its ping's ACK); where the
        // packet leaves no room for it, with a later packet of the message, or right after
        // the message's last packet (`ack_follows`), the shorter packet last, so that the
        // packets leave as one GSO train. Not before a zero-length SEND, the one request
        // shorter than an ACK.
        if peer && self.resp.ack_may_wait(now) && self.requests_ready() && !self.next_is_empty_send() {
            self.bundling = self.bundle_acks && self.peer_splits;
            let t = self.next_request(now, buf, mem);
            self.bundling = false;
            if let Some(mut t) = t {
                self.req.last_request = Some(now);
                if buf.get(bundle::FLAG_BYTE).is_some_and(|b| b & bundle::BUNDLED_ACK != 0) {
                    self.resp.ack_now();
                    self.append_ack(now, &mut t, mem);
                } else if !Self::begins_message(buf) {
                    // The message's last packet, or a lone one: the ACK comes next.
                    self.resp.ack_now();
                    self.ack_follows = true;
                }
                // A FIRST or MIDDLE packet: the ACK still waits, for the next one.
                return Some(t);
            }
        }
        if let Some(t) = self.next_response(now, buf, mem) {
            // A plain ACK or NAK to a softrdma peer carries the requests' ECN codepoint
            // (ECT(0)), so that it may share a train with them; a CE mark on it means
            // nothing to the peer, and a router that would have dropped it marks it
            // instead. Responses with data (READ responses) stay not ECN-capable: nothing
            // answers a CE mark on them.
            let ack = crate::wire::Opcode::from_parts(
                crate::wire::Transport::Rc,
                crate::wire::Operation::Acknowledge,
            )
            .is_some_and(|o| buf.first() == Some(&o.code()));
            return Some(if peer && ack { t.ect() } else { t });
        }
        let idle = self.req.send_idx >= self.sq.len();
        if self.fill_hello_due && idle && matches!(self.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            // Said once per peer, whatever becomes of it (UC: no answer, no retry).
            self.fill_hello_due = false;
            self.told_fill = true;
            return self.fill_hello(buf, mem);
        }
        let t = self.next_request(now, buf, mem);
        if t.is_some() {
            self.req.last_request = Some(now);
            if buf.get(fill::FLAG_BYTE).is_some_and(|b| b & fill::TAKES_FILL != 0) {
                self.told_fill = true;
                self.fill_hello_due = false;
            }
        }
        t
    }

    /// Whether the packet whose head is in `buf` is a FIRST or MIDDLE packet: more of its
    /// message follows.
    fn begins_message(buf: &[u8]) -> bool {
        use crate::wire::Position;
        buf.first()
            .and_then(|&b| crate::wire::Opcode::new(b))
            .is_some_and(|o| matches!(o.position(), Position::First | Position::Middle))
    }

    /// Appends the positive ACK that waits (and that `poll_transmit` found alone in the
    /// queue of answers) to the request `t`, flagged for it by `finish_packet`.
    fn append_ack(&mut self, now: Duration, t: &mut Transmit, mem: &dyn Memory) {
        let mut head = [0u8; 32];
        let ack = self.next_response(now, &mut head, mem);
        let room = t.tail.len() - t.tail_len;
        match ack {
            Some(a)
                if a.payload.is_empty()
                    && a.head_len + a.tail_len == bundle::BUNDLED_ACK_LEN
                    && room >= bundle::BUNDLED_ACK_LEN =>
            {
                let at = t.tail_len;
                t.tail[at..at + a.head_len].copy_from_slice(&head[..a.head_len]);
                t.tail[at + a.head_len..at + bundle::BUNDLED_ACK_LEN].copy_from_slice(&a.tail[..a.tail_len]);
                t.tail_len += bundle::BUNDLED_ACK_LEN;
                self.stats.acks_bundled += 1;
            }
            // Cannot happen (`poll_transmit` found one positive ACK waiting, which
            // `next_response` builds as 20 bytes). Were it to, the request still goes
            // (its ICRC covers the flag, a bit the peer otherwise ignores), and only a
            // request whose byte 20 from the end is an ACK opcode would be split wrongly
            // at the peer; the answer taken is gone, and the next ACK covers its PSNs.
            _ => tracing::error!(qpn = self.qpn.get(), "a request flagged for an ACK went without it"),
        }
    }

    /// Whether the packet just returned by `poll_transmit` was a request with the ACK that
    /// waited for it still to come: the caller should take this QP's next packet at once,
    /// so that the two stay together (one GSO train). Reading it clears it.
    pub fn take_ack_follows(&mut self) -> bool {
        std::mem::take(&mut self.ack_follows)
    }

    /// Whether the next request to go is a zero-length SEND (16 bytes, shorter than an ACK).
    fn next_is_empty_send(&self) -> bool {
        self.sq.get(self.req.send_idx).is_some_and(|w| w.len == 0 && matches!(w.op, SendOp::Send))
    }

    /// Lets a positive ACK that waits for company go with the next `poll_transmit`: call it
    /// before the QP is destroyed or moved to ERROR or RESET, so that the peer still hears
    /// that everything received was received.
    pub fn send_acks_now(&mut self) {
        self.resp.ack_now();
    }

    /// Whether a request of this QP may go out now (a limit may still hold it back).
    fn requests_ready(&self) -> bool {
        self.req.send_idx < self.sq.len() && matches!(self.state, QpState::Rts | QpState::Sqd)
    }

    /// Whether the QP has packets to send now (cheap; `poll_transmit` may still return
    /// `None` if a limit holds them back, or a lone ACK waits for company).
    pub fn wants_transmit(&self) -> bool {
        self.resp.has_tx()
            || ((self.req.send_idx < self.sq.len()
                || self.req.pending_back.is_some()
                || self.req.read_repair)
                && matches!(self.state, QpState::Rts | QpState::Sqd))
            || (self.fill_hello_due && matches!(self.state, QpState::Rtr | QpState::Rts | QpState::Sqd))
    }

    fn flush_wc(&self, wr_id: u64, opcode: WcOpcode) -> WorkCompletion {
        self.wc(wr_id, WcStatus::WrFlushErr, opcode)
    }

    fn wc(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len: 0,
            imm_data: None,
            invalidated_rkey: None,
            qp_num: self.qpn,
            src_qp: Qpn::new(0),
            src: None,
            grh: false,
            solicited: false,
        }
    }

    /// Moves to ERROR: every WQE still queued completes with WR_FLUSH_ERR, in order.
    fn enter_error(&mut self) {
        if self.state != QpState::Error {
            tracing::info!(qpn = %format_args!("{:#08x}", self.qpn.get()), from = ?self.state, "QP to ERROR");
        }
        self.state = QpState::Error;
        while let Some(w) = self.sq.pop_front() {
            let status = w.done.unwrap_or(WcStatus::WrFlushErr);
            if status != WcStatus::Success || w.signaled {
                let wc = WorkCompletion {
                    byte_len: if status == WcStatus::Success { w.len } else { 0 },
                    ..self.wc(w.wr_id, status, w.op.wc_opcode())
                };
                self.send_cq.push_back(wc);
            }
        }
        while let Some(r) = self.rq.pop_front() {
            self.recv_cq.push_back(self.flush_wc(r.wr_id, WcOpcode::Recv));
        }
        self.req.send_idx = 0;
        self.req.pending_back = None;
        self.req.ack_deadline = None;
        self.req.rnr_until = None;
        self.req.probe_at = None;
        self.resp.abandon_message();
    }

    /// Fails the send WQE at the front with `status` and moves the QP to ERROR.
    fn fail_front(&mut self, status: WcStatus) {
        let wr_id = self.sq.front().map(|w| w.wr_id);
        tracing::warn!(qpn = %format_args!("{:#08x}", self.qpn.get()), wr_id, %status, "work request failed");
        if let Some(w) = self.sq.front_mut() {
            w.done = Some(status);
        }
        self.enter_error();
    }

    /// Computes the ICRC of a packet made of the first `head_len` bytes of `buf`, the
    /// `payload` segments and `pad` zero bytes, and fills in the tail. The payload is
    /// copied into `buf` after the headers, with its pad, when it is small or when `buf`
    /// holds the whole packet and its tail: the packet is then contiguous, hashed in one
    /// update from the copy and sent from one buffer, so the bytes hashed are the bytes
    /// sent, and a runtime that places packets end to end hands the kernel one iovec per
    /// GSO train (three per packet cost the kernel a fifth of its throughput on
    /// loopback). Otherwise the segments stay in the `Transmit`, to be gathered again.
    ///
    /// `longer_last`: the packet belongs to a message whose LAST packet carries a header
    /// its other packets lack (a SEND with immediate data or an invalidate key), which a
    /// full FIRST or MIDDLE then makes up with filler (see `wire::fill`).
    #[allow(clippy::too_many_arguments)]
    fn finish_packet(
        &self,
        dst: SocketAddr,
        buf: &mut [u8],
        head_len: usize,
        payload: Segments,
        pad: usize,
        longer_last: bool,
        mem: &dyn Memory,
    ) -> Result<Transmit, crate::memory::MemError> {
        let seg_len: usize = payload.iter().map(|s| s.len as usize).sum();
        let opcode = buf.first().and_then(|&b| crate::wire::Opcode::new(b));
        let towards_softrdma = !self.foreign_peer && self.cfg.qp_type != QpType::Ud;
        // A full packet that lacks its message's longest header, towards a peer that
        // takes filler off, is filled to its first packet's length (see `wire::fill`).
        let fill = match opcode {
            Some(op) if towards_softrdma && self.peer_fills && seg_len == self.mtu.bytes() as usize => {
                fill::to_send(op, longer_last)
            }
            _ => 0,
        };
        // Pad, then filler: zeros either way.
        let pad = pad + fill;
        let whole = head_len + seg_len + pad;
        let total = whole + ICRC_LEN;
        let encap = icrc::Encap::new(self.cfg.local, dst).ok_or(crate::memory::MemError::BadKey)?;
        let inline = whole <= buf.len()
            && (head_len.saturating_sub(12) + seg_len + pad <= SMALL_INLINE
                || whole + TAIL_ROOM <= buf.len());
        let (head_len, payload, tail_pad) = if inline {
            let mut at = head_len;
            for seg in &payload {
                let n = seg.len as usize;
                mem.copy_out(self.cfg.pd, seg, &mut buf[at..at + n])?;
                at += n;
            }
            buf[at..at + pad].fill(0);
            (at + pad, Segments::Empty, 0)
        } else {
            (head_len, payload, pad)
        };
        if self.bundling
            && fill == 0
            && !Self::begins_message(buf)
            && total + bundle::BUNDLED_ACK_LEN
                <= self.mtu.bytes() as usize
                    + bundle::max_over_pmtu(matches!(encap.ip, icrc::IpFields::V6 { .. }))
        {
            // Room for the waiting ACK in this datagram (see `wire::bundle`), the last
            // packet of its message: longer than the packets before it, a bundle must end
            // their GSO train.
            buf[bundle::FLAG_BYTE] |= bundle::BUNDLED_ACK;
        }
        if self.announce_splits && towards_softrdma && opcode.is_some_and(|o| o.is_request()) {
            // This QP splits bundles: say so to a softrdma peer, on its requests (see
            // `wire::bundle`).
            buf[bundle::FLAG_BYTE] |= bundle::SPLITS_BUNDLES;
        }
        if self.announce_fill && towards_softrdma {
            // And takes filler off: on everything it sends (see `wire::fill`).
            buf[fill::FLAG_BYTE] |= fill::TAKES_FILL;
        }
        if fill > 0 {
            buf[fill::FLAG_BYTE] |= fill::FILLED;
        }
        let (bth, rest) = buf[..head_len].split_first_chunk::<12>().ok_or(crate::memory::MemError::BadKey)?;
        let mut h = icrc::IcrcHasher::with_bth(&encap, total, bth);
        h.update(rest);
        for seg in &payload {
            mem.gather(self.cfg.pd, seg, &mut |b| h.update(b))?;
        }
        let mut tail = [0u8; TAIL_ROOM];
        h.update(&tail[..tail_pad]);
        tail[tail_pad..tail_pad + ICRC_LEN].copy_from_slice(&h.finish().to_le_bytes());
        Ok(Transmit {
            src_port: self.cfg.local.port(),
            dst,
            head_len,
            payload,
            pd: self.cfg.pd,
            tail,
            tail_len: tail_pad + ICRC_LEN,
            alone: self.foreign_peer,
            tos: self.traffic_class,
        })
    }

    /// Emits `repr` into `buf`, with `inline` bytes right after the headers.
    fn emit_head(repr: &PacketRepr, buf: &mut [u8], inline: &[u8]) -> Option<usize> {
        let h = repr.emit_headers(buf).ok()?;
        let end = h + inline.len();
        buf.get_mut(h..end)?.copy_from_slice(inline);
        Some(end)
    }

    fn access_allows(&self, need: Access) -> bool {
        self.access.contains(need)
    }

    fn rq_is_empty(&self, srq: &Option<&mut Srq>) -> bool {
        match srq {
            Some(s) => s.is_empty(),
            None => self.rq.is_empty(),
        }
    }

    fn rq_take(&mut self, srq: RecvSource<'_, '_>) -> Option<RecvWqe> {
        match srq {
            Some(s) => s.take(),
            None => self.rq.pop_front(),
        }
    }

    /// Puts back a receive WQE whose message was abandoned (UC), to be used next.
    fn rq_return(&mut self, srq: RecvSource<'_, '_>, wqe: RecvWqe) {
        match srq {
            Some(s) => s.put_back(wqe),
            None => self.rq.push_front(wqe),
        }
    }
}

/// Splits `[offset, offset + len)` of a scatter/gather list into memory segments.
fn sgl_segments(sgl: &[Sge], mut offset: u64, mut len: u64) -> Segments {
    // Most often the first entry holds the whole range (a list of one).
    if let Some(s) = sgl.first().filter(|s| offset.saturating_add(len) <= u64::from(s.length)) {
        return if len == 0 {
            Segments::Empty
        } else {
            Segments::One(Segment {
                key: crate::memory::MemKey::Local(s.lkey),
                addr: s.addr.wrapping_add(offset),
                len: len as u32,
            })
        };
    }
    let mut out = Segments::Empty;
    for s in sgl {
        let sl = u64::from(s.length);
        if offset >= sl {
            offset -= sl;
            continue;
        }
        let take = (sl - offset).min(len);
        if take > 0 {
            out.push(Segment {
                key: crate::memory::MemKey::Local(s.lkey),
                addr: s.addr.wrapping_add(offset),
                len: take as u32,
            });
        }
        len -= take;
        offset = 0;
        if len == 0 {
            break;
        }
    }
    out
}

/// Writes `data` into a scatter/gather list starting at byte `offset`; fails without
/// writing past the list's end.
fn scatter(
    mem: &mut dyn Memory,
    pd: PdId,
    sgl: &[Sge],
    offset: u64,
    data: &[u8],
) -> Result<(), crate::memory::MemError> {
    let mut done = 0usize;
    for seg in &sgl_segments(sgl, offset, data.len() as u64) {
        let n = seg.len as usize;
        mem.write(pd, seg.key, seg.addr, &data[done..done + n], Access::LOCAL_WRITE)?;
        done += n;
    }
    if done == data.len() {
        Ok(())
    } else {
        Err(crate::memory::MemError::OutOfBounds)
    }
}

#[cfg(test)]
mod tests;
