//! An endpoint: the queue pairs behind one local address, as a device has them.
//!
//! It checks every datagram's ICRC and P_Key, parses it, hands it to the QP it names and
//! collects the QPs' packets to send, round robin. Like the QPs it owns no socket and reads
//! no clock: the runtime (or the simulator) moves the datagrams and passes the time.
//!
//! Every operation costs the same whatever the number of QPs: a QP that was touched (a
//! packet for it, a work request posted through [`Endpoint::qp_mut`], a timer fired, a
//! packet sent) is noted once; before the next query the endpoint re-arms its timer in a
//! heap of deadlines, queues it for transmission if it has packets ready, and lists it for
//! [`Endpoint::poll_completions`]. Idle QPs are never visited.
//!
//! ICRC policy: traffic between softrdma endpoints is checked exactly, for the canonical
//! encapsulation softrdma sends (IPv4 Identification 0, DF; see [`crate::wire::icrc`]).
//! P_Key policy (rxe's): the P_Key in a packet's BTH must match the device's P_Key table
//! entry 0 (0xFFFF) — the low 15 bits equal and nonzero, one side a full member — or the
//! packet is dropped and counted.
//!
//! QP1, the GSI: with [`Endpoint::enable_cm`] the endpoint carries the connection
//! manager's MADs (IBTA vol. 1 §13.4, §12.11): UD SEND_ONLY packets to QP1 with Q_Key
//! 0x80010000 go to the [`CmAgent`], and the agent's MADs leave first, before any QP's
//! packets. A CM message may come from any RoCE sender, so QP1 accepts the ID-agnostic
//! ICRC check; the endpoint remembers which peers needed it ([`Endpoint::peer_is_foreign`]),
//! so that the QPs the CM connects are told whether their peer is foreign.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use crate::cm::{CmAgent, CmConfig};
use crate::memory::{Memory, PdId};
use crate::qp::{QpConfig, QpType, QueuePair, Srq, SrqId, Transmit};
use crate::wire::mad::MAD_LEN;
use crate::wire::{
    bundle, fill, icrc, pkey_match, BthRepr, DethRepr, Opcode, Operation, Packet, PacketRepr, Transport,
    DEFAULT_PKEY,
};
use crate::{Psn, Qkey, Qpn};

/// The GSI's QP number.
const GSI_QPN: u32 = 1;
/// Peers the endpoint remembers as foreign or not; the memory is cleared when full.
const MAX_PEERS: usize = 4096;

/// The first QPN handed out; 0 and 1 are the special QPs, and rxe also starts at 16.
const FIRST_QPN: u32 = 16;

/// Datagrams an endpoint refused before any QP saw them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EndpointStats {
    /// Datagrams handed in.
    pub received: u64,
    /// ICRC mismatches.
    pub icrc_errors: u64,
    /// Datagrams that are not RoCEv2 packets.
    pub malformed: u64,
    /// Packets for a QP that does not exist.
    pub unknown_qp: u64,
    /// Packets whose P_Key does not match the P_Key table (dropped, as rxe does).
    pub pkey_violations: u64,
    /// Packets to QP1 that are not GSI MADs (wrong opcode, Q_Key or length), or that came
    /// while the CM is off.
    pub gsi_dropped: u64,
    /// Multicast packets (destination QP 0xFFFFFF) for a group no QP here is attached to,
    /// or not sent to a multicast address.
    pub mcast_unattached: u64,
    /// Copies of multicast packets handed to attached QPs (one per QP per packet).
    pub mcast_delivered: u64,
    /// Datagrams that carried a request and its ACK (see [`crate::wire::bundle`]), each
    /// handled as two packets.
    pub bundles: u64,
}

impl std::ops::AddAssign for EndpointStats {
    /// Two endpoints' counters together (the shards of one device).
    fn add_assign(&mut self, o: EndpointStats) {
        let EndpointStats {
            received,
            icrc_errors,
            malformed,
            unknown_qp,
            pkey_violations,
            gsi_dropped,
            mcast_unattached,
            mcast_delivered,
            bundles,
        } = o;
        self.received += received;
        self.icrc_errors += icrc_errors;
        self.malformed += malformed;
        self.unknown_qp += unknown_qp;
        self.pkey_violations += pkey_violations;
        self.gsi_dropped += gsi_dropped;
        self.mcast_unattached += mcast_unattached;
        self.mcast_delivered += mcast_delivered;
        self.bundles += bundles;
    }
}

/// Most QPs of one endpoint attached to one multicast group (rxe: 56).
pub const MAX_MCAST_QP_ATTACH: usize = 56;
/// Most multicast groups one endpoint has QPs attached to (rxe: 8192).
pub const MAX_MCAST_GROUPS: usize = 8192;

/// Why a QP cannot be attached to a multicast group, or detached from one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum McastError {
    /// No such QP.
    #[error("no such QP")]
    NoSuchQp,
    /// Only UD QPs take multicast.
    #[error("only UD QPs can be attached to multicast groups")]
    NotUd,
    /// The address is not an IPv4 (224.0.0.0/4) or IPv6 (ff00::/8) multicast address.
    #[error("not a multicast address")]
    NotMulticast,
    /// The QP is already attached to the group.
    #[error("the QP is already attached to the group")]
    AlreadyAttached,
    /// The QP is not attached to the group.
    #[error("the QP is not attached to the group")]
    NotAttached,
    /// The group has `MAX_MCAST_QP_ATTACH` QPs, or the endpoint `MAX_MCAST_GROUPS` groups.
    #[error("too many multicast attachments")]
    TooMany,
}

/// How a datagram arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// The sender's address and UDP port.
    pub src: SocketAddr,
    /// The local address and port it was sent to: the device's, or another its link
    /// receives on (a multicast group).
    pub dst: SocketAddr,
    /// The IP TOS byte or IPv6 traffic class (DSCP and ECN).
    pub tos: u8,
}

impl Arrival {
    /// A datagram from `src` to `dst` with TOS 0.
    pub fn new(src: SocketAddr, dst: SocketAddr) -> Arrival {
        Arrival { src, dst, tos: 0 }
    }
}

/// A QP and the endpoint's bookkeeping for it.
#[derive(Debug)]
struct Slot {
    qp: QueuePair,
    /// Touched since the endpoint last settled it.
    touched: bool,
    /// In the transmit queue.
    ready: bool,
    /// In the list of QPs that may have completions.
    pending: bool,
    /// The deadline the heap holds for it (entries with another deadline are stale), in
    /// heap mode (see [`SCAN_QPS`]).
    armed: Option<Duration>,
}

/// Up to this many QPs, the earliest deadline is found by asking each QP (a few
/// comparisons each), not kept in a heap: a ping-pong re-arms its QP's timers several
/// times per message, and every re-arm cost a heap push and, later, the pop of the entry
/// it made stale (13 % of the protocol's work per message, `examples/pingpong_cost.rs`).
/// Past it, the heap (a device with thousands of idle QPs looks at one entry).
const SCAN_QPS: usize = 8;

/// Packets a QP of a shard (see [`Endpoint::set_qpn_shard`]) sends in a row before the next
/// ready QP's turn: a 64 KiB message at MTU 4096, one GSO train.
pub(crate) const BURST: u32 = 16;

/// The QPs of one local address.
#[derive(Debug)]
pub struct Endpoint {
    local: SocketAddr,
    qps: BTreeMap<u32, Slot>,
    srqs: BTreeMap<u32, Srq>,
    next_qpn: u32,
    /// With a key, QPNs are drawn from a keyed function of a counter instead of counting.
    qpn_key: Option<u64>,
    /// `(index, count)`: every QPN drawn has `index` in its low bits (`count` a power of
    /// two), so that a receiver steering datagrams by destination QPN finds this
    /// endpoint's shard from the number alone (see [`Endpoint::set_qpn_shard`]).
    qpn_shard: (u32, u32),
    pkeys: Vec<u16>,
    /// QPs touched since the last settle.
    touched: Vec<u32>,
    /// QPs that may have packets to send, in round-robin order.
    ready: VecDeque<u32>,
    /// The QP that sent the last packets, and how many in a row (see `BURST`).
    burst: (u32, u32),
    /// QPs that may have completions.
    pending: Vec<u32>,
    /// QP deadlines; an entry is live while it equals its slot's `armed`. Kept only in
    /// heap mode: more than [`SCAN_QPS`] QPs.
    timers: BinaryHeap<Reverse<(Duration, u32)>>,
    /// More than [`SCAN_QPS`] QPs: deadlines are kept in `timers`.
    heap_mode: bool,
    stats: EndpointStats,
    /// The connection manager on QP1, once enabled.
    cm: Option<CmAgent>,
    /// The PSN of the GSI's next packet.
    gsi_psn: u32,
    /// Whether each peer the GSI heard from needed the ID-agnostic ICRC check.
    foreign: HashMap<IpAddr, bool>,
    /// Multicast groups and the QPs attached to each, in attach order.
    mcast: BTreeMap<IpAddr, Vec<u32>>,
    /// UDP ports that RC and UC QPs send from (see [`Endpoint::set_source_ports`]); empty:
    /// every QP sends from `local`'s.
    source_ports: Vec<u16>,
}

impl Endpoint {
    /// An endpoint with no QP, at `local`.
    pub fn new(local: SocketAddr) -> Endpoint {
        Endpoint {
            local,
            qps: BTreeMap::new(),
            srqs: BTreeMap::new(),
            next_qpn: FIRST_QPN,
            qpn_key: None,
            qpn_shard: (0, 1),
            pkeys: vec![DEFAULT_PKEY],
            touched: Vec::new(),
            ready: VecDeque::new(),
            burst: (0, 0),
            pending: Vec::new(),
            timers: BinaryHeap::new(),
            heap_mode: false,
            stats: EndpointStats::default(),
            cm: None,
            gsi_psn: 0,
            foreign: HashMap::new(),
            mcast: BTreeMap::new(),
            source_ports: Vec::new(),
        }
    }

    /// Draws QP numbers from now on from a function of `key` and a counter, so that a peer
    /// who has not seen a QPN cannot guess it: with a secret key each new QPN is one of
    /// the 2^24 - 16 usable numbers, unpredictable without the key. Without a key (the
    /// default, for reproducible simulations) QPNs count up from 16, as rxe's do.
    ///
    /// The function is SipHash of the key and the counter, with the standard library's
    /// fixed hasher keys: a keyed pseudo-random function as long as `key` stays secret.
    pub fn set_qpn_key(&mut self, key: u64) {
        self.qpn_key = Some(key);
    }

    /// Draws QP numbers from now on whose low bits are `index` modulo `count` (a power of
    /// two, at most 2^16): the endpoint is shard `index` of `count` sharing one address
    /// and port, and the kernel steers each datagram to its shard by those bits of the
    /// destination QPN. Numbers 1 (the CM's QP1) and 0xFFFFFF (multicast) are never
    /// drawn. A `count` that is not a power of two, or an `index` past it, is ignored.
    pub fn set_qpn_shard(&mut self, index: u32, count: u32) {
        if count.is_power_of_two() && count <= 1 << 16 && index < count {
            self.qpn_shard = (index, count);
        }
    }

    /// Starts the connection manager on QP1 (replacing one started before).
    pub fn enable_cm(&mut self, cfg: CmConfig) {
        self.cm = Some(CmAgent::new(cfg));
    }

    /// The connection manager, if enabled.
    pub fn cm(&self) -> Option<&CmAgent> {
        self.cm.as_ref()
    }

    /// The connection manager, mutably, if enabled.
    pub fn cm_mut(&mut self) -> Option<&mut CmAgent> {
        self.cm.as_mut()
    }

    /// Whether the last CM message from `peer` passed only the ID-agnostic ICRC check:
    /// the peer is Linux rxe or a NIC, not softrdma.
    pub fn peer_is_foreign(&self, peer: IpAddr) -> bool {
        self.foreign.get(&peer).copied().unwrap_or(false)
    }

    /// The local address.
    pub fn local(&self) -> SocketAddr {
        self.local
    }

    /// Counters.
    pub fn stats(&self) -> EndpointStats {
        self.stats
    }

    /// The P_Key table (index 0 is 0xFFFF, the default full-membership key).
    pub fn pkey_table(&self) -> &[u16] {
        &self.pkeys
    }

    /// Number of QPs.
    pub fn qp_count(&self) -> usize {
        self.qps.len()
    }

    /// Has RC and UC QPs created from now on send from one of `ports` (UDP ports bound
    /// to the endpoint's address), picked by a hash of the QP number, instead of from the
    /// endpoint's own port: RoCEv2 puts a flow's entropy in its UDP source port (IBTA
    /// Annex A17.3.1; Linux rxe and RoCE NICs do it per QP), so that switches spread QPs
    /// over equal-cost paths and a receiving host's NIC spreads them over its receive
    /// queues and cores. Packets still go to the peer's port, and answers come to ours;
    /// a softrdma peer latches whatever source port a QP's first packet brings. UD QPs
    /// and the CM keep the endpoint's port: a UD answer is addressed to the port its
    /// request came from (`ibv_create_ah_from_wc`).
    pub fn set_source_ports(&mut self, ports: Vec<u16>) {
        self.source_ports = ports;
    }

    /// Creates a QP in RESET; `cfg.local` is replaced by the endpoint's address (with one
    /// of the source ports for RC and UC, see [`Endpoint::set_source_ports`]).
    pub fn create_qp(&mut self, mut cfg: QpConfig) -> Qpn {
        cfg.local = self.local;
        let n = loop {
            let n = match self.qpn_key {
                Some(key) => {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::hash::DefaultHasher::new();
                    (key, self.next_qpn).hash(&mut h);
                    self.next_qpn = self.next_qpn.wrapping_add(1);
                    h.finish() as u32 & crate::MASK_24
                }
                None => {
                    let n = self.next_qpn;
                    self.next_qpn = (n + 1) & crate::MASK_24;
                    n
                }
            };
            let (index, count) = self.qpn_shard;
            let n = (n & !(count - 1)) | index;
            if n >= FIRST_QPN && n != crate::MASK_24 && !self.qps.contains_key(&n) {
                break n;
            }
        };
        let qpn = Qpn::new(n);
        if cfg.qp_type != QpType::Ud && !self.source_ports.is_empty() {
            // The QPN's bits mixed (the low ones may all name the shard), then reduced.
            let h = (u64::from(n.wrapping_mul(0x9E37_79B1)) * self.source_ports.len() as u64) >> 32;
            cfg.local.set_port(self.source_ports[h as usize]);
        }
        let slot =
            Slot { qp: QueuePair::new(qpn, cfg), touched: false, ready: false, pending: false, armed: None };
        self.qps.insert(n, slot);
        self.choose_timer_mode();
        qpn
    }

    /// Switches between scanning the QPs for the earliest deadline and keeping a heap of
    /// them, as the number of QPs crosses [`SCAN_QPS`]; entering heap mode arms every QP.
    fn choose_timer_mode(&mut self) {
        let heap = self.qps.len() > SCAN_QPS;
        if heap == self.heap_mode {
            return;
        }
        self.heap_mode = heap;
        self.timers.clear();
        for (&qpn, slot) in &mut self.qps {
            slot.armed = if heap { slot.qp.poll_timeout() } else { None };
            if let Some(t) = slot.armed {
                self.timers.push(Reverse((t, qpn)));
            }
        }
    }

    /// Creates a shared receive queue.
    pub fn create_srq(&mut self, max_wr: u32, max_sge: u32) -> SrqId {
        let id = self.srqs.last_key_value().map_or(1, |(k, _)| k + 1);
        self.srqs.insert(id, Srq::new(max_wr, max_sge));
        SrqId(id)
    }

    /// A shared receive queue, mutably (to post to it).
    pub fn srq_mut(&mut self, id: SrqId) -> Option<&mut Srq> {
        self.srqs.get_mut(&id.0)
    }

    /// Destroys a shared receive queue.
    pub fn destroy_srq(&mut self, id: SrqId) -> Option<Srq> {
        self.srqs.remove(&id.0)
    }

    /// Destroys a QP; packets for it are dropped from now on. Its multicast attachments
    /// go with it (see [`Self::mcast_groups`] for the groups to leave first).
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Option<QueuePair> {
        for members in self.mcast.values_mut() {
            members.retain(|&q| q != qpn.get());
        }
        self.mcast.retain(|_, m| !m.is_empty());
        // Its queue entries and heap entries go stale and are skipped.
        let qp = self.qps.remove(&qpn.get()).map(|s| s.qp);
        self.choose_timer_mode();
        qp
    }

    /// Attaches a UD QP to the multicast group `group` (IBTA 10.5.2.1, `ibv_attach_mcast`):
    /// from now on it gets a copy of every datagram sent to the group with destination QP
    /// 0xFFFFFF and its Q_Key. Returns whether the group is new to this endpoint (the link
    /// must then join it).
    pub fn attach_mcast(&mut self, qpn: Qpn, group: IpAddr) -> Result<bool, McastError> {
        let slot = self.qps.get(&qpn.get()).ok_or(McastError::NoSuchQp)?;
        if slot.qp.qp_type() != QpType::Ud {
            return Err(McastError::NotUd);
        }
        if !group.is_multicast() {
            return Err(McastError::NotMulticast);
        }
        let first = !self.mcast.contains_key(&group);
        if first && self.mcast.len() >= MAX_MCAST_GROUPS {
            return Err(McastError::TooMany);
        }
        let members = self.mcast.entry(group).or_default();
        if members.contains(&qpn.get()) {
            return Err(McastError::AlreadyAttached);
        }
        if members.len() >= MAX_MCAST_QP_ATTACH {
            return Err(McastError::TooMany);
        }
        members.push(qpn.get());
        Ok(first)
    }

    /// Detaches a QP from a group; returns whether it was the group's last QP here (the
    /// link may then leave it).
    pub fn detach_mcast(&mut self, qpn: Qpn, group: IpAddr) -> Result<bool, McastError> {
        let members = self.mcast.get_mut(&group).ok_or(McastError::NotAttached)?;
        let at = members.iter().position(|&q| q == qpn.get()).ok_or(McastError::NotAttached)?;
        members.remove(at);
        let last = members.is_empty();
        if last {
            self.mcast.remove(&group);
        }
        Ok(last)
    }

    /// The groups `qpn` is attached to.
    pub fn mcast_groups(&self, qpn: Qpn) -> Vec<IpAddr> {
        self.mcast.iter().filter(|(_, m)| m.contains(&qpn.get())).map(|(g, _)| *g).collect()
    }

    /// A datagram to destination QP 0xFFFFFF that passed the ICRC check: a copy for every
    /// QP attached to the group it was sent to (each QP checks the Q_Key and takes a
    /// posted receive, or drops it and counts it), but not for the QP that sent it.
    fn handle_mcast(&mut self, now: Duration, arrival: Arrival, pkt: &Packet<&[u8]>, mem: &mut dyn Memory) {
        let group = arrival.dst.ip();
        let Some(members) = self.mcast.get(&group).filter(|_| group.is_multicast()) else {
            tracing::debug!(src = %arrival.src, %group, "dropped: multicast for a group no QP is attached to");
            self.stats.mcast_unattached += 1;
            return;
        };
        if !pkey_match(pkt.bth().pkey(), self.pkeys[0]) {
            self.stats.pkey_violations += 1;
            return;
        }
        let sender = pkt.deth().map(|d| d.src_qp().get());
        for &qpn in members {
            if arrival.src.ip() == self.local.ip() && sender == Some(qpn) {
                continue;
            }
            let Some(slot) = self.qps.get_mut(&qpn) else { continue };
            touch(&mut self.touched, qpn, slot);
            let srq = slot.qp.srq().and_then(|id| self.srqs.get_mut(&id.0));
            slot.qp.handle_multicast(now, arrival, pkt, mem, srq);
            self.stats.mcast_delivered += 1;
        }
    }

    /// A QP.
    pub fn qp(&self, qpn: Qpn) -> Option<&QueuePair> {
        self.qps.get(&qpn.get()).map(|s| &s.qp)
    }

    /// A QP, mutably. The QP counts as touched: before the next query the endpoint looks
    /// at its timer, its packets and its completions.
    pub fn qp_mut(&mut self, qpn: Qpn) -> Option<&mut QueuePair> {
        let slot = self.qps.get_mut(&qpn.get())?;
        touch(&mut self.touched, qpn.get(), slot);
        Some(&mut slot.qp)
    }

    /// All QPs.
    pub fn qps(&self) -> impl Iterator<Item = &QueuePair> {
        self.qps.values().map(|s| &s.qp)
    }

    /// Handles one datagram that arrived as `arrival` says.
    pub fn handle_datagram(&mut self, now: Duration, arrival: Arrival, bytes: &[u8], mem: &mut dyn Memory) {
        self.stats.received += 1;
        // A request with the ACK it carries (see `wire::bundle`): two packets, in order,
        // each checked as if it had come alone. A bundle's request passes the exact ICRC
        // check on its own (its sender is softrdma, whatever this side's QP thinks of its
        // peer); a datagram that only looks like one (a foreign sender's reserved bit set,
        // and an ACK opcode 20 bytes from its end) does not, and is taken whole.
        if let Some((request, ack)) = bundle::split(bytes) {
            let exact = icrc::Encap::new(arrival.src, arrival.dst).is_some_and(|e| icrc::verify(&e, request));
            if exact {
                self.stats.bundles += 1;
                self.handle_packet_bytes(now, arrival, request, mem, true);
                self.handle_packet_bytes(now, arrival, ack, mem, false);
                return;
            }
        }
        self.handle_packet_bytes(now, arrival, bytes, mem, false);
    }

    /// One packet of a datagram; `verified`: its exact ICRC check passed already.
    fn handle_packet_bytes(
        &mut self,
        now: Duration,
        arrival: Arrival,
        bytes: &[u8],
        mem: &mut dyn Memory,
        verified: bool,
    ) {
        let Arrival { src, dst, tos } = arrival;
        let Some(encap) = icrc::Encap::new(src, dst) else {
            tracing::debug!(%src, "dropped: IPv4 and IPv6 mixed");
            self.stats.malformed += 1;
            return;
        };
        let pkt = match Packet::new_checked(bytes) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(%src, len = bytes.len(), reason = %e, "dropped: not a RoCEv2 packet");
                self.stats.malformed += 1;
                return;
            }
        };
        let qpn = pkt.bth().dest_qp().get();
        let exact = verified || icrc::verify(&encap, bytes);
        if !exact {
            // Only QP1 (CM messages come from any RoCE sender) and a QP whose peer is
            // foreign accept the ID-agnostic check.
            let may = qpn == GSI_QPN
                || qpn == Qpn::MULTICAST.get()
                || self.qps.get(&qpn).is_some_and(|s| s.qp.foreign_peer());
            let agnostic = match (src, dst) {
                (SocketAddr::V4(s), SocketAddr::V4(d)) if may => {
                    icrc::solve_ipv4_ident(s, d, bytes).is_some()
                }
                _ => false,
            };
            if !agnostic {
                tracing::debug!(%src, qpn = %format_args!("{qpn:#08x}"), "dropped: ICRC mismatch");
                self.stats.icrc_errors += 1;
                return;
            }
        }
        // Filler a softrdma peer put before the ICRC (see `wire::fill`) comes off once the
        // exact ICRC that covers it has passed; the packet is read without it. For a QP set
        // for a foreign peer, and for a packet that passed only the ID-agnostic check (a
        // foreign sender), the flag is a reserved bit, ignored.
        let flagged = bytes.get(fill::FLAG_BYTE).is_some_and(|b| b & fill::FILLED != 0);
        let strip = flagged && exact && !self.qps.get(&qpn).is_some_and(|s| s.qp.foreign_peer());
        let pkt = match strip.then(|| fill::strip(bytes)) {
            None => pkt,
            Some(Ok(b)) if b.len() == bytes.len() => pkt,
            Some(Ok(b)) => match Packet::new_checked(b) {
                Ok(p) => p,
                Err(_) => {
                    self.stats.malformed += 1;
                    return;
                }
            },
            Some(Err(_)) => {
                tracing::debug!(%src, "dropped: filler that cannot be");
                self.stats.malformed += 1;
                return;
            }
        };
        if qpn == Qpn::MULTICAST.get() || dst.ip().is_multicast() {
            // A group address takes multicast datagrams only; destination QP 0xFFFFFF
            // only comes to a group address (checked in handle_mcast).
            if qpn != Qpn::MULTICAST.get() {
                tracing::debug!(%src, group = %dst.ip(), "dropped: a unicast QP number sent to a group");
                self.stats.mcast_unattached += 1;
                return;
            }
            self.handle_mcast(now, arrival, &pkt, mem);
            return;
        }
        if qpn == GSI_QPN {
            self.handle_gsi(now, src.ip(), !exact, &pkt);
            return;
        }
        let Some(slot) = self.qps.get_mut(&qpn) else {
            tracing::debug!(%src, qpn = %format_args!("{qpn:#08x}"), "dropped: no such QP");
            self.stats.unknown_qp += 1;
            return;
        };
        if !pkey_match(pkt.bth().pkey(), self.pkeys[0]) {
            tracing::debug!(%src, qpn = %format_args!("{qpn:#08x}"), pkey = pkt.bth().pkey(), "dropped: P_Key mismatch");
            self.stats.pkey_violations += 1;
            return;
        }
        touch(&mut self.touched, qpn, slot);
        let srq = slot.qp.srq().and_then(|id| self.srqs.get_mut(&id.0));
        slot.qp.handle_packet(now, src, tos, &pkt, mem, srq);
    }

    /// A packet for QP1 that passed the ICRC check (`foreign`: only the ID-agnostic one):
    /// a MAD for the CM if it is one.
    fn handle_gsi(&mut self, now: Duration, peer: IpAddr, foreign: bool, pkt: &Packet<&[u8]>) {
        if !pkey_match(pkt.bth().pkey(), self.pkeys[0]) {
            self.stats.pkey_violations += 1;
            return;
        }
        let gsi_op = Opcode::from_parts(Transport::Ud, Operation::SendOnly);
        let qkey_ok = pkt.deth().is_some_and(|d| d.qkey() == Qkey::GSI);
        let Some(cm) = self.cm.as_mut() else {
            self.stats.gsi_dropped += 1;
            return;
        };
        if Some(pkt.opcode()) != gsi_op || !qkey_ok || pkt.payload().len() != MAD_LEN {
            self.stats.gsi_dropped += 1;
            return;
        }
        if self.foreign.len() >= MAX_PEERS && !self.foreign.contains_key(&peer) {
            self.foreign.clear();
        }
        self.foreign.insert(peer, foreign);
        cm.handle_mad(now, peer, pkt.payload());
    }

    /// The CM's next MAD as a whole packet in `buf`, if it has one.
    fn poll_gsi(&mut self, buf: &mut [u8]) -> Option<Transmit> {
        let cm = self.cm.as_mut()?;
        loop {
            let (peer, mad) = cm.poll_transmit()?;
            let dst = SocketAddr::new(peer, self.local.port());
            let Some(encap) = icrc::Encap::new(self.local, dst) else { continue };
            let op = Opcode::from_parts(Transport::Ud, Operation::SendOnly)?;
            let mut repr =
                PacketRepr::new(BthRepr::new(op, Qpn::new(GSI_QPN), Psn::new(self.gsi_psn)), MAD_LEN);
            repr.ext.deth = Some(DethRepr { qkey: Qkey::GSI, src_qp: Qpn::new(GSI_QPN) });
            let Ok(len) = repr.emit(buf, &mad, &encap) else { continue };
            self.gsi_psn = (self.gsi_psn + 1) & crate::MASK_24;
            return Some(Transmit {
                src_port: self.local.port(),
                dst,
                head_len: len,
                payload: crate::memory::Segments::Empty,
                pd: PdId(0),
                tail: [0; crate::qp::TAIL_ROOM],
                tail_len: 0,
                alone: true,
                tos: 0,
            });
        }
    }

    /// Brings the bookkeeping of every touched QP up to date: its deadline in the heap, its
    /// place in the transmit queue, its place in the completion list.
    fn settle(&mut self) {
        for qpn in self.touched.drain(..) {
            let Some(slot) = self.qps.get_mut(&qpn) else { continue };
            slot.touched = false;
            if self.heap_mode {
                let deadline = slot.qp.poll_timeout();
                if deadline != slot.armed {
                    slot.armed = deadline;
                    if let Some(t) = deadline {
                        self.timers.push(Reverse((t, qpn)));
                    }
                }
            }
            if !slot.ready && slot.qp.wants_transmit() {
                slot.ready = true;
                self.ready.push_back(qpn);
            }
            if !slot.pending {
                slot.pending = true;
                self.pending.push(qpn);
            }
        }
        // Drop stale entries from the top, so that the earliest deadline is a live one.
        while let Some(Reverse((t, qpn))) = self.timers.peek() {
            match self.qps.get(qpn) {
                Some(s) if s.armed == Some(*t) => break,
                _ => {
                    self.timers.pop();
                }
            }
        }
        // Stale entries deeper in the heap are few (one per re-arm until its time comes);
        // rebuild when they outnumber the QPs.
        if self.timers.len() > 64 && self.timers.len() > 4 * self.qps.len() {
            let qps = &self.qps;
            self.timers.retain(|Reverse((t, q))| qps.get(q).is_some_and(|s| s.armed == Some(*t)));
        }
    }

    /// The next packet any QP wants to send, taking ready QPs in turn.
    pub fn poll_transmit(&mut self, now: Duration, buf: &mut [u8], mem: &dyn Memory) -> Option<Transmit> {
        if let Some(t) = self.poll_gsi(buf) {
            return Some(t);
        }
        self.settle();
        while let Some(qpn) = self.ready.pop_front() {
            let Some(slot) = self.qps.get_mut(&qpn) else { continue };
            if let Some(t) = slot.qp.poll_transmit(now, buf, mem) {
                // Sending arms timers and may complete WQEs (UD): settle it again later.
                touch(&mut self.touched, qpn, slot);
                // A request whose ACK comes next keeps its QP first, so that no other QP's
                // packet goes between the two (they leave as one train). On a shard, so
                // does a QP that has sent fewer than BURST packets in a row, so that each
                // QP's packets leave as trains of their own (a receiver with shards steers
                // a train by its first packet's QP), and QPs still take turns by the burst.
                // So does a QP on an endpoint whose QPs send from several source ports
                // (see `set_source_ports`): packets from different ports cannot share a
                // train, and QPs that took turns packet by packet would each send one
                // datagram per system call. Otherwise QPs take turns packet by packet, and
                // their packets to one peer share trains.
                self.burst = if self.burst.0 == qpn { (qpn, self.burst.1 + 1) } else { (qpn, 1) };
                let burst = if self.qpn_shard.1 > 1 || self.source_ports.len() > 1 { BURST } else { 1 };
                if slot.qp.take_ack_follows() || self.burst.1 < burst {
                    self.ready.push_front(qpn);
                } else {
                    self.burst = (0, 0);
                    self.ready.push_back(qpn);
                }
                return Some(t);
            }
            slot.ready = false;
        }
        None
    }

    /// The earliest deadline of any QP or of the CM.
    pub fn poll_timeout(&mut self) -> Option<Duration> {
        self.settle();
        let qps = if self.heap_mode {
            self.timers.peek().map(|Reverse((t, _))| *t)
        } else {
            self.qps.values().filter_map(|s| s.qp.poll_timeout()).min()
        };
        let cm = self.cm.as_ref().and_then(CmAgent::poll_timeout);
        match (qps, cm) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Duration) {
        if let Some(cm) = self.cm.as_mut() {
            if cm.poll_timeout().is_some_and(|t| t <= now) {
                cm.handle_timeout(now);
            }
        }
        self.settle();
        if !self.heap_mode {
            for (&qpn, slot) in &mut self.qps {
                if slot.qp.poll_timeout().is_some_and(|d| d <= now) {
                    slot.qp.handle_timeout(now);
                    touch(&mut self.touched, qpn, slot);
                }
            }
        }
        while let Some(&Reverse((t, qpn))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            let Some(slot) = self.qps.get_mut(&qpn) else { continue };
            if slot.armed != Some(t) {
                continue;
            }
            slot.armed = None;
            if slot.qp.poll_timeout().is_some_and(|d| d <= now) {
                slot.qp.handle_timeout(now);
            }
            touch(&mut self.touched, qpn, slot);
        }
        self.settle();
    }

    /// Calls `f` with each QP that may have completions since the last call (touched in
    /// any way), so that the caller can move them to its completion queues.
    pub fn poll_completions(&mut self, mut f: impl FnMut(&mut QueuePair)) {
        self.settle();
        // Taken and given back emptied: the list keeps its capacity (no allocation per
        // pass).
        let mut pending = std::mem::take(&mut self.pending);
        for qpn in pending.drain(..) {
            let Some(slot) = self.qps.get_mut(&qpn) else { continue };
            slot.pending = false;
            f(&mut slot.qp);
        }
        self.pending = pending;
    }
}

fn touch(list: &mut Vec<u32>, qpn: u32, slot: &mut Slot) {
    if !slot.touched {
        slot.touched = true;
        list.push(qpn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qp::QpCaps;

    /// An RC QP's configuration at `local`.
    fn rc_config(local: SocketAddr) -> QpConfig {
        QpConfig {
            qp_type: QpType::Rc,
            pd: PdId(1),
            local,
            caps: QpCaps::default(),
            sq_sig_all: false,
            srq: None,
        }
    }

    /// Past [`SCAN_QPS`] QPs the deadlines go to the heap (a device with thousands of QPs
    /// must not ask each one for every pass), and back at it they leave it.
    #[test]
    fn many_qps_keep_their_deadlines_in_a_heap() {
        let local: SocketAddr = "10.0.0.1:4791".parse().unwrap();
        let mut e = Endpoint::new(local);
        let cfg = rc_config(local);
        let qpns: Vec<Qpn> = (0..=SCAN_QPS).map(|_| e.create_qp(cfg)).collect();
        assert!(e.heap_mode, "{} QPs", qpns.len());
        e.destroy_qp(qpns[0]);
        assert!(!e.heap_mode, "{SCAN_QPS} QPs");
        assert!(e.timers.is_empty());
    }

    /// Two endpoints' counters add up field by field.
    #[test]
    fn stats_add_up() {
        let one = |k: u64| EndpointStats {
            received: k,
            icrc_errors: 2 * k,
            malformed: 3 * k,
            unknown_qp: 4 * k,
            pkey_violations: 5 * k,
            gsi_dropped: 6 * k,
            mcast_unattached: 7 * k,
            mcast_delivered: 8 * k,
            bundles: 9 * k,
        };
        let mut sum = one(1);
        sum += one(10);
        assert_eq!(sum, one(11));
    }

    /// A shard's QPNs carry its index in their low bits, keyed or counting, and never
    /// name QP1 or the multicast QPN.
    #[test]
    fn shard_qpns_carry_the_index() {
        let local: SocketAddr = "10.0.0.1:4791".parse().unwrap();
        let cfg = rc_config(local);
        for key in [None, Some(7u64)] {
            for index in 0..4 {
                let mut e = Endpoint::new(local);
                if let Some(k) = key {
                    e.set_qpn_key(k);
                }
                e.set_qpn_shard(index, 4);
                let mut seen = std::collections::BTreeSet::new();
                for _ in 0..200 {
                    let q = e.create_qp(cfg).get();
                    assert_eq!(q & 3, index, "{q:#x}");
                    assert!((FIRST_QPN..crate::MASK_24).contains(&q), "{q:#x}");
                    assert!(seen.insert(q));
                }
            }
        }
        // Not a power of two, or an index past the count: ignored.
        for (index, count) in [(1, 3), (4, 4)] {
            let mut e = Endpoint::new(local);
            e.set_qpn_shard(index, count);
            assert_eq!(e.create_qp(cfg).get(), FIRST_QPN, "{index} of {count}");
        }
    }
}
