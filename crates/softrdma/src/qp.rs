//! Queue pairs, and connecting them out of band.
//!
//! Verbs-level control, as `ibv_create_qp` and `ibv_modify_qp` have it:
//! [`ProtectionDomain::create_qp`] gives a [`QueuePair`] in RESET, and
//! [`QueuePair::modify`] (attributes in `Option`s) or [`QueuePair::modify_masked`]
//! (attributes and an `ibv_qp_attr_mask`) drive it RESET → INIT → RTR → RTS, to SQD, SQE
//! and ERROR, and back to RESET, with `ibv_modify_qp`'s table of required and optional
//! attributes; [`QueuePair::query`] returns the attributes and the creation attributes.
//! Dropping a QP flushes its outstanding work requests to its CQs, then destroys it.
//!
//! A typestate convenience on top: [`ProtectionDomain::prepare_qp`] gives a
//! [`PreparedQp`] (in INIT), whose [`PreparedQp::endpoint`] is what the peer needs; once
//! the peer's [`EndpointInfo`] has arrived — over TCP, a file, stdin, anything —
//! [`PreparedQp::handshake`] moves it through RTR to RTS and gives the [`QueuePair`]. UD
//! QPs need no peer: [`PreparedQp::ready`].

use std::net::SocketAddr;
use std::sync::Arc;

use softrdma_proto::memory::Access;
use softrdma_proto::qp::{
    ModifyError, Mtu, QpAttr, QpAttrMask, QpCaps, QpConfig, QpState, QpStats, QpType, RecvWr, SendWr, SrqId,
};
use softrdma_proto::{Psn, Qkey, Qpn};

use crate::cq::CompletionQueue;
use crate::device::{ContextInner, MAX_INLINE, MAX_QP, MAX_QP_RD_ATOM, MAX_QP_WR, MAX_SGE};
use crate::pd::{check_access_bits, ProtectionDomain, RemoteRegion};
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
    /// The transport service.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
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
        let id = self.ctx.engine.create_srq(max_wr, max_sge);
        Ok(SharedReceiveQueue { ctx: self.ctx.clone(), id })
    }
}

impl SharedReceiveQueue {
    /// Posts a receive WR.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        self.ctx.engine.srq_post_recv(self.id, wr)
    }

    /// WQEs posted and not yet consumed.
    pub fn len(&self) -> usize {
        self.ctx.engine.srq_len(self.id)
    }

    /// Whether no WQE is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        self.ctx.engine.destroy_srq(self.id);
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

/// What a QP was created with (`ibv_qp_init_attr`), as [`QueuePair::query`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInitAttr {
    /// Transport service.
    pub qp_type: QpType,
    /// Queue sizes and limits.
    pub caps: QpCaps,
    /// Every send WR is signaled.
    pub sq_sig_all: bool,
    /// Receive WQEs come from a shared receive queue.
    pub srq: bool,
    /// The send CQ's number.
    pub send_cq: u32,
    /// The receive CQ's number.
    pub recv_cq: u32,
}

impl ProtectionDomain {
    /// Creates a QP in RESET whose completions go to `send_cq` and `recv_cq`
    /// (`ibv_create_qp`); move it to INIT, RTR and RTS with [`QueuePair::modify`]. The
    /// builder's access flags and Q_Key are not applied here: they are INIT attributes
    /// (see [`Self::prepare_qp`] for the typestate path that applies them).
    pub fn create_qp(
        &self,
        b: &QpBuilder,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> Result<QueuePair> {
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
        let (shard, engine) = self.ctx.place_qp(b.qp_type, b.srq.is_some());
        let cfg = QpConfig {
            qp_type: b.qp_type,
            pd: self.id,
            local: engine.local(),
            caps,
            sq_sig_all: b.sq_sig_all,
            srq: b.srq,
        };
        let mtu = self.ctx.device.active_mtu();
        let sinks: [Arc<dyn crate::engine::CompletionSink>; 2] =
            [send_cq.shared.clone(), recv_cq.shared.clone()];
        // max_qp is the device's, whatever its shards.
        let elsewhere: usize =
            self.ctx.shards.iter().filter(|e| !Arc::ptr_eq(e, engine)).map(|e| e.qp_count()).sum();
        let max_qp = (MAX_QP as usize).saturating_sub(elsewhere);
        let qpn = engine.create_qp(cfg, sinks, max_qp, |qp| qp.set_ud_mtu(mtu))?;
        send_cq.shared.add_shard(shard);
        recv_cq.shared.add_shard(shard);
        Ok(QueuePair {
            engine: engine.clone(),
            ctx: self.ctx.clone(),
            qpn,
            qp_type: b.qp_type,
            init: QpInitAttr {
                qp_type: b.qp_type,
                caps,
                sq_sig_all: b.sq_sig_all,
                srq: b.srq.is_some(),
                send_cq: send_cq.id(),
                recv_cq: recv_cq.id(),
            },
            pd: self.clone(),
            _cqs: [send_cq.clone(), recv_cq.clone()],
            groups: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Creates a QP and moves it to INIT with the builder's access flags (RC, UC) or Q_Key
    /// (UD): the first step of the out-of-band typestate connection.
    pub fn prepare_qp(
        &self,
        b: &QpBuilder,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> Result<PreparedQp> {
        let qp = self.create_qp(b, send_cq, recv_cq)?;
        let init = match b.qp_type {
            QpType::Ud => QpAttr { qkey: Some(b.qkey), ..Default::default() },
            _ => QpAttr { access_flags: Some(b.access), ..Default::default() },
        };
        qp.modify(&QpAttr { state: Some(QpState::Init), pkey_index: Some(0), port: Some(1), ..init })?;
        Ok(PreparedQp { qp, psn: random_psn() })
    }
}

fn random_psn() -> Psn {
    Psn::new(crate::random_u64() as u32)
}

impl PreparedQp {
    /// What the peer needs, offering no memory region.
    pub fn endpoint(&self) -> EndpointInfo {
        EndpointInfo {
            addr: self.qp.engine.local(),
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
        if opts.rd_atomic > MAX_QP_RD_ATOM {
            return Err(ModifyError::OutOfRange("max_rd_atomic").into());
        }
        let peer = crate::sys::canonical(remote.addr);
        if peer.is_ipv4() != self.qp.engine.local().is_ipv4() {
            return Err(Error::InvalidArgument(
                "the peer's address is of another IP family than the device's (IPv4 and IPv6 do not mix)",
            ));
        }
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
            remote: Some(peer),
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
        self.qp.engine.modify_qp(self.qp.qpn, &rtr, |qp| qp.set_foreign_peer(opts.foreign_peer))?;
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
    /// The shard that owns it (the device's engine unless sharded).
    engine: Arc<crate::engine::Engine>,
    qpn: Qpn,
    qp_type: QpType,
    init: QpInitAttr,
    pd: ProtectionDomain,
    _cqs: [CompletionQueue; 2],
    /// The multicast groups it is attached to, with its place in each group's registry.
    groups: std::sync::Mutex<Vec<(std::net::IpAddr, crate::mcast::Membership)>>,
}

impl QueuePair {
    /// The QP number.
    pub fn qpn(&self) -> Qpn {
        self.qpn
    }

    /// The transport service.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// Whether receive WQEs come from a shared receive queue.
    pub fn has_srq(&self) -> bool {
        self.init.srq
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Posts a send WR; its packets leave from this thread before the call returns (as
    /// far as the window and limits allow; the rest follow as ACKs come back).
    pub fn post_send(&self, wr: SendWr) -> Result<()> {
        self.engine.post_send(self.qpn, [wr]).map(|_| ()).map_err(|(_, e)| e)
    }

    /// Posts several send WRs with one pass of the engine, so that their packets leave in
    /// as few system calls as possible (a WR list, as `ibv_post_send` takes). Stops at the
    /// first WR refused and returns how many were posted with the error.
    pub fn post_send_many(
        &self,
        wrs: impl IntoIterator<Item = SendWr>,
    ) -> std::result::Result<usize, (usize, Error)> {
        self.engine.post_send(self.qpn, wrs)
    }

    /// Posts a receive WR.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        self.engine.post_recv(self.qpn, wr)
    }

    /// Changes state and attributes (`ibv_modify_qp`): the attributes set are the mask.
    /// Access flags are checked
    /// bit by bit as `ibv_reg_mr` checks them. On error nothing changes.
    pub fn modify(&self, attr: &QpAttr) -> Result<()> {
        let mut attr = *attr;
        if let Some(a) = attr.access_flags {
            attr.access_flags = Some(check_access_bits(a)?);
        }
        // The device advertises max_qp_rd_atom and max_qp_init_rd_atom; more is refused,
        // as a NIC refuses it.
        if attr.max_rd_atomic.is_some_and(|n| n > MAX_QP_RD_ATOM) {
            return Err(ModifyError::OutOfRange("max_rd_atomic").into());
        }
        if attr.max_dest_rd_atomic.is_some_and(|n| n > MAX_QP_RD_ATOM) {
            return Err(ModifyError::OutOfRange("max_dest_rd_atomic").into());
        }
        self.engine.modify_qp(self.qpn, &attr, |_| {})
    }

    /// [`Self::modify`] with the attributes and the `ibv_qp_attr_mask` apart, as the C
    /// API passes them: only the attributes `mask` names are applied, and each of them
    /// must be set in `attr`.
    pub fn modify_masked(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.modify(&attr.masked(mask)?)
    }

    /// The current attributes and the creation attributes (`ibv_query_qp`).
    pub fn query(&self) -> Result<(QpAttr, QpInitAttr)> {
        let attr =
            self.engine.with_qp(self.qpn, |q| q.attr()).ok_or(Error::InvalidArgument("QP destroyed"))?;
        Ok((attr, self.init))
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.engine.with_qp(self.qpn, |q| q.state()).unwrap_or(QpState::Error)
    }

    /// Marks the peers as foreign (Linux rxe, a RoCE NIC) or softrdma; see
    /// [`ConnectOptions::foreign_peer`]. For UD QPs, which have no single peer, this is the
    /// way to accept datagrams from foreign senders.
    pub fn set_foreign_peer(&self, foreign: bool) {
        self.engine.set_foreign_peer(self.qpn, foreign);
    }

    /// Whether the peer is treated as foreign (Linux rxe, a RoCE NIC: go-back-N, no SACKs,
    /// no GSO trains), as set at connection or found by the connection manager.
    pub fn foreign_peer(&self) -> bool {
        self.engine.with_qp(self.qpn, |q| q.foreign_peer()).unwrap_or(false)
    }

    /// Counters.
    pub fn stats(&self) -> QpStats {
        self.engine.with_qp(self.qpn, |q| q.stats()).unwrap_or_default()
    }

    /// The address and UDP port this QP's packets leave from: the device's address, and
    /// for RC and UC one of its source ports, which carry the flow's entropy as RoCEv2
    /// asks (`SOFTRDMA_SOURCE_PORTS`; answers still go to the device's port).
    pub fn source_addr(&self) -> std::net::SocketAddr {
        self.engine.with_qp(self.qpn, |q| q.local_addr()).unwrap_or_else(|| self.engine.local())
    }

    /// Attaches this UD QP to the multicast group `group` (`ibv_attach_mcast`, with the
    /// group as an IP address; [`crate::mcast::group_of_mgid`] converts an MGID): from now
    /// on it receives a copy of every datagram sent to the group's address at the device's
    /// port with destination QP 0xFFFFFF and this QP's Q_Key, one per posted receive
    /// (with no receive posted, the datagram is lost and counted in
    /// [`QpStats::dropped`]). To send to the group, post a UD send to
    /// `UdDest { addr: (group, port), qpn: Qpn::MULTICAST, .. }`; a QP does not receive its
    /// own datagrams. Returns the group's MTU: the first member's active MTU
    /// ([`crate::mcast`]); a device with a smaller active MTU is refused
    /// ([`Error::GroupMtu`]), and sends to the group must fit the group's MTU.
    pub fn attach_mcast(&self, group: std::net::IpAddr) -> Result<crate::Mtu> {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        if groups.iter().any(|(g, _)| *g == group) {
            return Err(softrdma_proto::endpoint::McastError::AlreadyAttached.into());
        }
        if self.qp_type != QpType::Ud {
            return Err(softrdma_proto::endpoint::McastError::NotUd.into());
        }
        if !group.is_multicast() {
            return Err(softrdma_proto::endpoint::McastError::NotMulticast.into());
        }
        let who = format!("{} {:#x}", self.engine.local(), self.qpn.get());
        let (membership, mtu) = crate::mcast::Membership::join(group, self.ctx.device.active_mtu(), &who)?;
        self.engine.attach_mcast(self.qpn, group)?;
        groups.push((group, membership));
        Ok(mtu)
    }

    /// Detaches this QP from a group (`ibv_detach_mcast`).
    pub fn detach_mcast(&self, group: std::net::IpAddr) -> Result<()> {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        let at = groups
            .iter()
            .position(|(g, _)| *g == group)
            .ok_or(softrdma_proto::endpoint::McastError::NotAttached)?;
        self.engine.detach_mcast(self.qpn, group)?;
        groups.remove(at);
        Ok(())
    }

    /// The ids of its send and receive CQs.
    pub(crate) fn cq_ids(&self) -> [u32; 2] {
        [self._cqs[0].id(), self._cqs[1].id()]
    }

    /// The groups this QP is attached to.
    pub fn mcast_groups(&self) -> Vec<std::net::IpAddr> {
        self.groups.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(g, _)| *g).collect()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.engine.destroy_qp(self.qpn);
    }
}
