//! Queue pairs, and connecting them out of band.
//!
//! Connected QPs follow a typestate: [`ProtectionDomain::create_qp`] gives a
//! [`PreparedQp`] (in INIT), whose [`PreparedQp::endpoint`] is what the peer needs; once
//! the peer's [`EndpointInfo`] has arrived — over TCP, a file, stdin, anything —
//! [`PreparedQp::handshake`] moves it through RTR to RTS and gives the [`QueuePair`]. UD
//! QPs need no peer: [`PreparedQp::ready`].

use std::net::SocketAddr;
use std::sync::Arc;

use softrdma_proto::memory::Access;
use softrdma_proto::qp::{Mtu, QpAttr, QpCaps, QpConfig, QpState, QpStats, QpType, RecvWr, SendWr, SrqId};
use softrdma_proto::{Psn, Qkey, Qpn};

use crate::context::{ContextInner, MAX_INLINE, MAX_QP, MAX_QP_RD_ATOM, MAX_QP_WR, MAX_SGE};
use crate::cq::CompletionQueue;
use crate::engine::Route;
use crate::pd::{ProtectionDomain, RemoteRegion};
use crate::{Error, Result};

/// How to build a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpBuilder {
    qp_type: QpType,
    caps: QpCaps,
    sq_sig_all: bool,
    access: Access,
    qkey: Qkey,
    srq: Option<SrqId>,
}

impl QpBuilder {
    /// A reliable connected QP.
    pub fn rc() -> QpBuilder {
        QpBuilder {
            qp_type: QpType::Rc,
            caps: QpCaps::default(),
            sq_sig_all: false,
            access: Access::NONE,
            qkey: Qkey(0),
            srq: None,
        }
    }
    /// An unreliable connected QP.
    pub fn uc() -> QpBuilder {
        QpBuilder { qp_type: QpType::Uc, ..QpBuilder::rc() }
    }
    /// An unreliable datagram QP with this Q_Key.
    pub fn ud(qkey: Qkey) -> QpBuilder {
        QpBuilder { qp_type: QpType::Ud, qkey, ..QpBuilder::rc() }
    }
    /// Queue sizes and scatter/gather limits.
    #[must_use]
    pub fn caps(mut self, caps: QpCaps) -> QpBuilder {
        self.caps = caps;
        self
    }
    /// Remote access the QP allows (REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC).
    #[must_use]
    pub fn access(mut self, access: Access) -> QpBuilder {
        self.access = access;
        self
    }
    /// Signal every send WR.
    #[must_use]
    pub fn sq_sig_all(mut self, on: bool) -> QpBuilder {
        self.sq_sig_all = on;
        self
    }
    /// Take receive WQEs from this shared receive queue.
    #[must_use]
    pub fn srq(mut self, srq: &SharedReceiveQueue) -> QpBuilder {
        self.srq = Some(srq.id);
        self
    }
}

/// A shared receive queue (`ibv_srq`): receive WQEs that several QPs draw from.
#[derive(Debug)]
pub struct SharedReceiveQueue {
    ctx: Arc<ContextInner>,
    id: SrqId,
}

impl ProtectionDomain {
    /// Creates a shared receive queue of `max_wr` WQEs with up to `max_sge` entries each.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        if max_wr == 0 || max_wr > MAX_QP_WR || max_sge > MAX_SGE {
            return Err(Error::Limit("SRQ size"));
        }
        let id = self.ctx.shared.lock().endpoint.create_srq(max_wr, max_sge);
        Ok(SharedReceiveQueue { ctx: self.ctx.clone(), id })
    }
}

impl SharedReceiveQueue {
    /// Posts a receive WR.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        let mut core = self.ctx.shared.lock();
        let srq = core.endpoint.srq_mut(self.id).ok_or(Error::InvalidArgument("SRQ destroyed"))?;
        srq.post_recv(wr)?;
        Ok(())
    }

    /// WQEs posted and not yet consumed.
    pub fn len(&self) -> usize {
        self.ctx.shared.lock().endpoint.srq_mut(self.id).map_or(0, |s| s.len())
    }

    /// Whether no WQE is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a peer needs to connect to a QP (and, optionally, to reach one memory region).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct EndpointInfo {
    /// The device's address and UDP port (the GID, as an address).
    pub addr: SocketAddr,
    /// The QP number.
    pub qpn: u32,
    /// The first PSN the QP will send.
    pub psn: u32,
    /// The path MTU in bytes the QP can use.
    pub mtu: u32,
    /// A region the peer may access with RDMA, if offered.
    pub region: Option<RemoteRegion>,
}

/// Connection attributes: the ones `ibv_modify_qp` takes for RTR and RTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Path MTU; default: the smaller of the two ports' active MTUs.
    pub mtu: Option<Mtu>,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout); default 14, 67 ms.
    pub timeout: u8,
    /// Timeout retries, 0–7.
    pub retry_cnt: u8,
    /// RNR retries, 0–7, 7 meaning infinite.
    pub rnr_retry: u8,
    /// RNR timer code asked of the peer; default 12, 0.64 ms.
    pub min_rnr_timer: u8,
    /// READs and atomics in flight, each way.
    pub rd_atomic: u8,
    /// The peer is Linux rxe or a RoCE NIC, not softrdma: its ICRCs are checked without
    /// the IPv4 Identification it cannot tell us (15 of 32 bits), and nothing is sent to it
    /// in GSO trains. See `QueuePair::set_foreign_peer` in the protocol crate.
    pub foreign_peer: bool,
}

impl Default for ConnectOptions {
    fn default() -> ConnectOptions {
        ConnectOptions {
            mtu: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            rd_atomic: MAX_QP_RD_ATOM,
            foreign_peer: false,
        }
    }
}

/// A QP created and in INIT, waiting for its peer's [`EndpointInfo`].
#[derive(Debug)]
pub struct PreparedQp {
    qp: QueuePair,
    psn: Psn,
}

impl ProtectionDomain {
    /// Creates a QP whose completions go to `send_cq` and `recv_cq`.
    pub fn create_qp(
        &self,
        b: &QpBuilder,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> Result<PreparedQp> {
        let caps = b.caps;
        if caps.max_send_wr > MAX_QP_WR || caps.max_recv_wr > MAX_QP_WR {
            return Err(Error::Limit("max_qp_wr"));
        }
        if caps.max_send_sge > MAX_SGE || caps.max_recv_sge > MAX_SGE {
            return Err(Error::Limit("max_sge"));
        }
        if caps.max_inline_data > MAX_INLINE {
            return Err(Error::Limit("max_inline_data"));
        }
        for cq in [send_cq, recv_cq] {
            if !Arc::ptr_eq(&cq.ctx, &self.ctx) {
                return Err(Error::Mismatch);
            }
        }
        let shared = &self.ctx.shared;
        let mut core = shared.lock();
        if core.endpoint.qps().count() >= MAX_QP as usize {
            return Err(Error::Limit("max_qp"));
        }
        let cfg = QpConfig {
            qp_type: b.qp_type,
            pd: self.id,
            local: shared.local,
            caps,
            sq_sig_all: b.sq_sig_all,
            srq: b.srq,
        };
        let qpn = core.endpoint.create_qp(cfg);
        core.routes
            .insert(qpn.get(), Route { send_cq: send_cq.shared.clone(), recv_cq: recv_cq.shared.clone() });
        let init = match b.qp_type {
            QpType::Ud => QpAttr { qkey: Some(b.qkey), ..Default::default() },
            _ => QpAttr { access_flags: Some(b.access), ..Default::default() },
        };
        let attr = QpAttr { state: Some(QpState::Init), pkey_index: Some(0), port: Some(1), ..init };
        let qp = core.endpoint.qp_mut(qpn).ok_or(Error::InvalidArgument("QP vanished"))?;
        if b.qp_type == QpType::Ud {
            qp.set_ud_mtu(self.ctx.device.active_mtu());
        }
        let modified = qp.modify(&attr);
        drop(core);
        let handle = QueuePair {
            ctx: self.ctx.clone(),
            qpn,
            qp_type: b.qp_type,
            pd: self.clone(),
            _cqs: [send_cq.clone(), recv_cq.clone()],
        };
        modified?;
        Ok(PreparedQp { qp: handle, psn: random_psn() })
    }
}

fn random_psn() -> Psn {
    use std::hash::{BuildHasher, Hasher};
    Psn::new(std::collections::hash_map::RandomState::new().build_hasher().finish() as u32)
}

impl PreparedQp {
    /// What the peer needs, offering no memory region.
    pub fn endpoint(&self) -> EndpointInfo {
        EndpointInfo {
            addr: self.qp.ctx.shared.local,
            qpn: self.qp.qpn.get(),
            psn: self.psn.get(),
            mtu: self.qp.ctx.device.active_mtu().bytes(),
            region: None,
        }
    }

    /// Posts a receive before the QP is connected, so that none of the peer's first
    /// messages meets an empty queue.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        self.qp.post_recv(wr)
    }

    /// The QP number.
    pub fn qpn(&self) -> Qpn {
        self.qp.qpn
    }

    /// Connects to the peer described by `remote` (RC, UC): RTR, then RTS.
    pub fn handshake(self, remote: &EndpointInfo, opts: &ConnectOptions) -> Result<QueuePair> {
        if self.qp.qp_type == QpType::Ud {
            return Err(Error::InvalidArgument("UD QPs have no peer: use ready()"));
        }
        let dest_qpn = Qpn::try_new(remote.qpn).ok_or(Error::InvalidArgument("remote QPN above 24 bits"))?;
        let rq_psn = Psn::try_new(remote.psn).ok_or(Error::InvalidArgument("remote PSN above 24 bits"))?;
        let ours = self.qp.ctx.device.active_mtu();
        let theirs = [Mtu::Mtu4096, Mtu::Mtu2048, Mtu::Mtu1024, Mtu::Mtu512, Mtu::Mtu256]
            .into_iter()
            .find(|m| m.bytes() <= remote.mtu)
            .ok_or(Error::InvalidArgument("remote MTU below 256"))?;
        let mtu = opts.mtu.unwrap_or(ours.min(theirs));
        let rc = self.qp.qp_type == QpType::Rc;
        let rtr = QpAttr {
            state: Some(QpState::Rtr),
            path_mtu: Some(mtu),
            remote: Some(crate::sys::canonical(remote.addr)),
            dest_qpn: Some(dest_qpn),
            rq_psn: Some(rq_psn),
            max_dest_rd_atomic: rc.then_some(opts.rd_atomic),
            min_rnr_timer: rc.then_some(opts.min_rnr_timer),
            ..Default::default()
        };
        let rts = QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(self.psn),
            timeout: rc.then_some(opts.timeout),
            retry_cnt: rc.then_some(opts.retry_cnt),
            rnr_retry: rc.then_some(opts.rnr_retry),
            max_rd_atomic: rc.then_some(opts.rd_atomic),
            ..Default::default()
        };
        self.qp.set_foreign_peer(opts.foreign_peer);
        self.qp.modify(&rtr)?;
        self.qp.modify(&rts)?;
        Ok(self.qp)
    }

    /// Activates a UD QP: RTR, then RTS.
    pub fn ready(self) -> Result<QueuePair> {
        if self.qp.qp_type != QpType::Ud {
            return Err(Error::InvalidArgument("connected QPs need handshake()"));
        }
        self.qp.modify(&QpAttr { state: Some(QpState::Rtr), ..Default::default() })?;
        self.qp.modify(&QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(self.psn),
            ..Default::default()
        })?;
        Ok(self.qp)
    }
}

/// A queue pair (`ibv_qp`).
#[derive(Debug)]
pub struct QueuePair {
    ctx: Arc<ContextInner>,
    qpn: Qpn,
    qp_type: QpType,
    pd: ProtectionDomain,
    _cqs: [CompletionQueue; 2],
}

impl QueuePair {
    /// The QP number.
    pub fn qpn(&self) -> Qpn {
        self.qpn
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Posts a send WR; its packets leave from this thread before the call returns (as
    /// far as the window and limits allow; the rest follow as ACKs come back).
    pub fn post_send(&self, wr: SendWr) -> Result<()> {
        let shared = &self.ctx.shared;
        let mut core = shared.lock();
        let crate::engine::Core { endpoint, mem, .. } = &mut *core;
        let qp = endpoint.qp_mut(self.qpn).ok_or(Error::InvalidArgument("QP destroyed"))?;
        qp.post_send(wr, mem)?;
        shared.flush(&mut core);
        shared.nudge(&core);
        Ok(())
    }

    /// Posts several send WRs with one pass of the engine, so that their packets leave in
    /// as few system calls as possible (a WR list, as `ibv_post_send` takes). Stops at the
    /// first WR refused and returns how many were posted with the error.
    pub fn post_send_many(
        &self,
        wrs: impl IntoIterator<Item = SendWr>,
    ) -> std::result::Result<usize, (usize, Error)> {
        let shared = &self.ctx.shared;
        let mut core = shared.lock();
        let crate::engine::Core { endpoint, mem, .. } = &mut *core;
        let Some(qp) = endpoint.qp_mut(self.qpn) else {
            return Err((0, Error::InvalidArgument("QP destroyed")));
        };
        let mut n = 0;
        let mut failed = None;
        for wr in wrs {
            if let Err(e) = qp.post_send(wr, mem) {
                failed = Some(e.into());
                break;
            }
            n += 1;
        }
        shared.flush(&mut core);
        shared.nudge(&core);
        match failed {
            None => Ok(n),
            Some(e) => Err((n, e)),
        }
    }

    /// Posts a receive WR.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        let shared = &self.ctx.shared;
        let mut core = shared.lock();
        let qp = core.endpoint.qp_mut(self.qpn).ok_or(Error::InvalidArgument("QP destroyed"))?;
        qp.post_recv(wr)?;
        shared.flush(&mut core);
        Ok(())
    }

    /// Changes state and attributes (`ibv_modify_qp`).
    pub fn modify(&self, attr: &QpAttr) -> Result<()> {
        let shared = &self.ctx.shared;
        let mut core = shared.lock();
        let qp = core.endpoint.qp_mut(self.qpn).ok_or(Error::InvalidArgument("QP destroyed"))?;
        qp.modify(attr)?;
        shared.flush(&mut core);
        shared.nudge(&core);
        Ok(())
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.ctx.shared.lock().endpoint.qp(self.qpn).map_or(QpState::Error, |q| q.state())
    }

    /// Marks the peers as foreign (Linux rxe, a RoCE NIC) or softrdma; see
    /// [`ConnectOptions::foreign_peer`]. For UD QPs, which have no single peer, this is the
    /// way to accept datagrams from foreign senders.
    pub fn set_foreign_peer(&self, foreign: bool) {
        if let Some(qp) = self.ctx.shared.lock().endpoint.qp_mut(self.qpn) {
            qp.set_foreign_peer(foreign);
        }
    }

    /// Counters.
    pub fn stats(&self) -> QpStats {
        self.ctx.shared.lock().endpoint.qp(self.qpn).map(|q| q.stats()).unwrap_or_default()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let mut core = self.ctx.shared.lock();
        core.endpoint.destroy_qp(self.qpn);
        core.routes.remove(&self.qpn.get());
    }
}
