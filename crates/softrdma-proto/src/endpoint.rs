//! An endpoint: the queue pairs behind one local address, as a device has them.
//!
//! It checks every datagram's ICRC, parses it, hands it to the QP it names and collects the
//! QPs' packets to send, round robin. Like the QPs it owns no socket and reads no clock:
//! the runtime (or the simulator) moves the datagrams and passes the time.
//!
//! ICRC policy: traffic between softrdma endpoints is checked exactly, for the canonical
//! encapsulation softrdma sends (IPv4 Identification 0, DF; see [`crate::wire::icrc`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::memory::Memory;
use crate::qp::{QpConfig, QueuePair, Srq, SrqId, Transmit};
use crate::wire::{icrc, Packet};
use crate::Qpn;

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
}

/// The QPs of one local address.
#[derive(Debug)]
pub struct Endpoint {
    local: SocketAddr,
    qps: BTreeMap<u32, QueuePair>,
    srqs: BTreeMap<u32, Srq>,
    next_qpn: u32,
    /// Where the round robin of `poll_transmit` resumes.
    cursor: u32,
    stats: EndpointStats,
}

impl Endpoint {
    /// An endpoint with no QP, at `local`.
    pub fn new(local: SocketAddr) -> Endpoint {
        Endpoint {
            local,
            qps: BTreeMap::new(),
            srqs: BTreeMap::new(),
            next_qpn: FIRST_QPN,
            cursor: 0,
            stats: EndpointStats::default(),
        }
    }

    /// The local address.
    pub fn local(&self) -> SocketAddr {
        self.local
    }

    /// Counters.
    pub fn stats(&self) -> EndpointStats {
        self.stats
    }

    /// Creates a QP in RESET; `cfg.local` is replaced by the endpoint's address.
    pub fn create_qp(&mut self, mut cfg: QpConfig) -> Qpn {
        cfg.local = self.local;
        let mut n = self.next_qpn;
        while self.qps.contains_key(&n) || n < FIRST_QPN {
            n = (n + 1) & crate::MASK_24;
        }
        self.next_qpn = (n + 1) & crate::MASK_24;
        let qpn = Qpn::new(n);
        self.qps.insert(n, QueuePair::new(qpn, cfg));
        qpn
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

    /// Destroys a QP; packets for it are dropped from now on.
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Option<QueuePair> {
        self.qps.remove(&qpn.get())
    }

    /// A QP.
    pub fn qp(&self, qpn: Qpn) -> Option<&QueuePair> {
        self.qps.get(&qpn.get())
    }

    /// A QP, mutably.
    pub fn qp_mut(&mut self, qpn: Qpn) -> Option<&mut QueuePair> {
        self.qps.get_mut(&qpn.get())
    }

    /// All QPs.
    pub fn qps(&self) -> impl Iterator<Item = &QueuePair> {
        self.qps.values()
    }

    /// Handles one datagram received from `src`.
    pub fn handle_datagram(&mut self, now: Duration, src: SocketAddr, bytes: &[u8], mem: &mut dyn Memory) {
        self.stats.received += 1;
        let Some(encap) = icrc::Encap::new(src, self.local) else {
            self.stats.malformed += 1;
            return;
        };
        let Ok(pkt) = Packet::new_checked(bytes) else {
            self.stats.malformed += 1;
            return;
        };
        let qp = self.qps.get_mut(&pkt.bth().dest_qp().get());
        if !icrc::verify(&encap, bytes) {
            // Only a QP whose peer is foreign accepts the ID-agnostic check.
            let foreign = qp.as_ref().is_some_and(|q| q.foreign_peer());
            let agnostic = match (src, self.local) {
                (SocketAddr::V4(s), SocketAddr::V4(d)) if foreign => {
                    icrc::solve_ipv4_ident(s, d, bytes).is_some()
                }
                _ => false,
            };
            if !agnostic {
                self.stats.icrc_errors += 1;
                return;
            }
        }
        let Some(qp) = qp else {
            self.stats.unknown_qp += 1;
            return;
        };
        let srq = qp.srq().and_then(|id| self.srqs.get_mut(&id.0));
        qp.handle_packet(now, src, &pkt, mem, srq);
    }

    /// The next packet any QP wants to send, taking QPs in turn.
    pub fn poll_transmit(&mut self, now: Duration, buf: &mut [u8], mem: &dyn Memory) -> Option<Transmit> {
        use std::ops::Bound::{Excluded, Included, Unbounded};
        let start = self.cursor;
        for bounds in [(Included(start), Unbounded), (Unbounded, Excluded(start))] {
            for (k, qp) in self.qps.range_mut(bounds) {
                if !qp.wants_transmit() {
                    continue;
                }
                if let Some(t) = qp.poll_transmit(now, buf, mem) {
                    self.cursor = k.wrapping_add(1);
                    return Some(t);
                }
            }
        }
        None
    }

    /// The earliest deadline of any QP.
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.qps.values().filter_map(QueuePair::poll_timeout).min()
    }

    /// Runs every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Duration) {
        for qp in self.qps.values_mut() {
            if qp.poll_timeout().is_some_and(|t| t <= now) {
                qp.handle_timeout(now);
            }
        }
    }
}
