//! A deterministic simulator: endpoints, registered memory and a seeded, impaired network,
//! all on virtual time.
//!
//! Modelled on quinn-proto's test `Pair`: [`Sim::step`] delivers what is due, runs due
//! timers and lets every endpoint transmit; [`Sim::advance`] jumps the clock to the next
//! event when nothing is left to do now. Everything — loss, duplication, reordering,
//! corruption, delay — comes from the seed, so a failing run replays exactly.

mod memory;
mod network;
mod rng;
mod workload;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

pub use memory::{MemFault, RegisterError, SimMemory, WriteRecord};
pub use network::{Bottleneck, Datagram, Impairments, NetStats, Network, LINK_OVERHEAD};
pub use rng::Rng;
pub use workload::{run_workload, run_workload_with_fault, Fault, WorkloadConfig, WorkloadReport};

use crate::endpoint::{Arrival, Endpoint};
use crate::memory::{Access, PdId};
use crate::qp::{Mtu, QpAttr, QpCaps, QpConfig, QpState, QpType, SrqId};
use crate::wire::ROCEV2_PORT;
use crate::{Psn, Qpn};

/// One simulated host: an endpoint and its memory.
#[derive(Debug)]
pub struct Node {
    /// The QPs.
    pub endpoint: Endpoint,
    /// Registered memory.
    pub mem: SimMemory,
}

/// Attributes for connecting an RC or UC pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectParams {
    /// Path MTU.
    pub mtu: Mtu,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Timeout retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// RNR timer code the responders ask for.
    pub min_rnr_timer: u8,
    /// Initiator depth and responder resources.
    pub rd_atomic: u8,
    /// Remote access both QPs allow.
    pub access: Access,
    /// Selective recovery (both sides are softrdma); off: go-back-N, as towards rxe.
    pub selective: bool,
    /// Node `b`'s QP stays in RTR, a receiver that never sends a request (as perftest's
    /// bandwidth servers leave theirs).
    pub b_stays_in_rtr: bool,
}

impl Default for ConnectParams {
    fn default() -> ConnectParams {
        ConnectParams {
            mtu: Mtu::Mtu1024,
            timeout: 12,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            rd_atomic: 16,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            selective: true,
            b_stays_in_rtr: false,
        }
    }
}

/// The simulation.
#[derive(Debug)]
pub struct Sim {
    /// Virtual time.
    pub now: Duration,
    /// The hosts; node `i` is at `10.0.0.(i+1)`, port 4791.
    pub nodes: Vec<Node>,
    /// The network between them.
    pub net: Network,
    buf: Vec<u8>,
    /// Packets each node may send per step, so that one busy sender cannot starve the
    /// others within an instant.
    pub burst: usize,
    /// The instant at which the simulation stopped because a timer stayed due after it
    /// was handled, with nothing else happening (see [`STUCK_STEPS`]).
    pub stuck: Option<Duration>,
    /// Steps in a row that only ran timers, one of which stayed due.
    spins: u32,
}

/// Steps in a row at one instant that only run timers while one of them stays due, after
/// which [`Sim::step`] reports nothing happening: a timer that its handling never clears
/// (a bug) would otherwise spin the simulation at one virtual instant for good.
pub const STUCK_STEPS: u32 = 10_000;

impl Sim {
    /// `n` nodes on a network with `imp`, everything seeded from `seed`.
    pub fn new(seed: u64, imp: Impairments, n: usize) -> Sim {
        let nodes = (0..n)
            .map(|i| Node {
                endpoint: Endpoint::new(Self::addr_of(i)),
                mem: SimMemory::new(seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i as u64 + 1))),
            })
            .collect();
        Sim {
            now: Duration::ZERO,
            nodes,
            net: Network::new(seed, imp),
            buf: vec![0u8; 8192],
            burst: 64,
            stuck: None,
            spins: 0,
        }
    }

    /// The address of node `i`.
    pub fn addr_of(i: usize) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, (i >> 8) as u8, (i & 0xFF) as u8 + 1)), ROCEV2_PORT)
    }

    /// One round at the current time. Returns whether anything happened (false too once
    /// the simulation is [`stuck`](Sim::stuck)).
    pub fn step(&mut self) -> bool {
        if self.stuck.is_some() {
            return false;
        }
        let mut busy = false;
        let mut timers = false;
        while let Some(d) = self.net.poll(self.now) {
            busy = true;
            if let Some(node) = self.nodes.iter_mut().find(|n| n.endpoint.local() == d.to) {
                let arrival = Arrival { src: d.from, dst: d.to, tos: d.tos };
                node.endpoint.handle_datagram(self.now, arrival, &d.bytes, &mut node.mem);
            }
        }
        for node in &mut self.nodes {
            if node.endpoint.poll_timeout().is_some_and(|t| t <= self.now) {
                node.endpoint.handle_timeout(self.now);
                timers = true;
            }
        }
        for node in &mut self.nodes {
            for _ in 0..self.burst {
                let Some(t) = node.endpoint.poll_transmit(self.now, &mut self.buf, &node.mem) else { break };
                let bytes = t.assemble(&self.buf, &node.mem);
                let src = SocketAddr::new(node.endpoint.local().ip(), t.src_port);
                self.net.send_tos(self.now, src, t.dst, t.tos, bytes);
                busy = true;
            }
        }
        if timers && !busy {
            let now = self.now;
            if self.nodes.iter_mut().any(|n| n.endpoint.poll_timeout().is_some_and(|t| t <= now)) {
                self.spins += 1;
                if self.spins >= STUCK_STEPS {
                    tracing::error!(?now, "simulation stuck: a timer stays due after it was handled");
                    self.stuck.get_or_insert(now);
                    return false;
                }
                return true;
            }
        }
        self.spins = 0;
        busy || timers
    }

    /// The time of the next event (a delivery or a timer), if any.
    pub fn next_event(&mut self) -> Option<Duration> {
        let timers = self.nodes.iter_mut().filter_map(|n| n.endpoint.poll_timeout()).collect::<Vec<_>>();
        let timers = timers.into_iter();
        timers.chain(self.net.next_delivery()).min()
    }

    /// Steps, or when nothing happens now, moves the clock to the next event. Returns false
    /// when there is nothing left to do at all, or the simulation is [`stuck`](Sim::stuck).
    pub fn advance(&mut self) -> bool {
        if self.stuck.is_some() {
            return false;
        }
        if self.step() {
            return true;
        }
        match self.next_event() {
            Some(t) => {
                self.now = self.now.max(t);
                true
            }
            None => false,
        }
    }

    /// Advances until `done` holds, nothing is left to do, or `limit` of virtual time has
    /// passed. Returns whether `done` held.
    pub fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&mut Sim) -> bool) -> bool {
        let end = self.now + limit;
        loop {
            if done(self) {
                return true;
            }
            if self.now > end || !self.advance() {
                return done(self);
            }
        }
    }

    /// Creates a QP of `qp_type` on node `i`, in protection domain `pd`.
    pub fn create_qp(&mut self, i: usize, qp_type: QpType, pd: PdId, caps: QpCaps) -> Qpn {
        let cfg = QpConfig { qp_type, pd, local: Self::addr_of(i), caps, sq_sig_all: false, srq: None };
        self.nodes[i].endpoint.create_qp(cfg)
    }

    /// Creates and connects a QP on node `a` with one on node `b` (RC or UC), through
    /// INIT, RTR and RTS. Returns their QPNs.
    pub fn connect(&mut self, a: usize, b: usize, qp_type: QpType, p: ConnectParams) -> (Qpn, Qpn) {
        self.connect_srq(a, b, qp_type, p, None)
    }

    /// [`Self::connect`], with node `b`'s QP drawing receive WQEs from `srq_b`.
    pub fn connect_srq(
        &mut self,
        a: usize,
        b: usize,
        qp_type: QpType,
        p: ConnectParams,
        srq_b: Option<SrqId>,
    ) -> (Qpn, Qpn) {
        let pd = PdId(1);
        let qa = self.create_qp(a, qp_type, pd, QpCaps::default());
        let cfg = QpConfig {
            qp_type,
            pd,
            local: Self::addr_of(b),
            caps: QpCaps::default(),
            sq_sig_all: false,
            srq: srq_b,
        };
        let qb = self.nodes[b].endpoint.create_qp(cfg);
        let psn_a = Psn::new(0xFF_FF00 + a as u32);
        let psn_b = Psn::new(0x12_3456 + b as u32);
        for (node, qpn, peer, peer_qpn, rq_psn, sq_psn) in
            [(a, qa, b, qb, psn_b, psn_a), (b, qb, a, qa, psn_a, psn_b)]
        {
            let rc = qp_type == QpType::Rc;
            let qp = self.nodes[node].endpoint.qp_mut(qpn).expect("just created");
            qp.set_selective(p.selective);
            let steps = [
                QpAttr {
                    state: Some(QpState::Init),
                    pkey_index: Some(0),
                    port: Some(1),
                    access_flags: Some(p.access),
                    ..QpAttr::default()
                },
                QpAttr {
                    state: Some(QpState::Rtr),
                    path_mtu: Some(p.mtu),
                    remote: Some(Self::addr_of(peer)),
                    dest_qpn: Some(peer_qpn),
                    rq_psn: Some(rq_psn),
                    max_dest_rd_atomic: rc.then_some(p.rd_atomic),
                    min_rnr_timer: rc.then_some(p.min_rnr_timer),
                    ..QpAttr::default()
                },
                QpAttr {
                    state: Some(QpState::Rts),
                    sq_psn: Some(sq_psn),
                    timeout: rc.then_some(p.timeout),
                    retry_cnt: rc.then_some(p.retry_cnt),
                    rnr_retry: rc.then_some(p.rnr_retry),
                    max_rd_atomic: rc.then_some(p.rd_atomic),
                    ..QpAttr::default()
                },
            ];
            let steps = if node == b && p.b_stays_in_rtr { &steps[..2] } else { &steps[..] };
            for attr in steps {
                qp.modify(attr).expect("valid connection attributes");
            }
        }
        (qa, qb)
    }
}
