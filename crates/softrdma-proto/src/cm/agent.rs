//! The CM state machines of one device, sans IO (IBTA vol. 1 §12.9, as Linux's `cm.c`
//! behaves): the active side (REQ → REP → RTU), the passive side (REQ → REP → RTU, or
//! REJ), disconnection (DREQ → DREP, then TIMEWAIT), MRA, SIDR for UD services, and the
//! answers to duplicates and strays.
//!
//! The agent takes MADs and the time, and yields MADs to send, events for the consumer
//! and its next deadline; the consumer owns the QPs (it moves them to RTR and RTS between
//! a REP and the RTU, as rdma_cm does) and the socket.
//!
//! Retries: every message that expects an answer (REQ, REP, DREQ, SIDR_REQ) is resent
//! after the response timeout, at most `max_cm_retries` times; then the exchange fails
//! (UNREACHABLE; a REQ or REP that times out is followed by a REJ "timeout" so the peer
//! forgets it too). Duplicates are answered from what was last sent: a REQ repeated while
//! the consumer decides gets an MRA, a REQ repeated after the REP gets the REP again, a REP
//! repeated after the RTU gets the RTU again, a DREQ repeated in TIMEWAIT gets the DREP
//! again; none of them makes a second connection. A REQ from a connection still in
//! TIMEWAIT is rejected as stale. Strays get what Linux sends: a REJ "invalid service
//! ID" for a REQ nobody listens for, a DREP for a DREQ about an unknown connection, a REJ
//! "invalid comm ID" for a REP nobody waits for. State is bounded: at most
//! `max_pending` passive connections are half-open at once; a new REQ then displaces the
//! oldest one still waiting for its RTU (which forged REQs never send), or is rejected
//! with "no resources" if all wait for the consumer, so a flood of forged REQs cannot grow
//! memory without bound and a real peer still gets through.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::IpAddr;
use std::time::Duration;

use super::msg::{
    CmMad, CmMsg, Dreq, Ids, IdsAndData, Mra, MsgKind, Rej, RejReason, Rep, Req, SidrRep, SidrReq,
};
use crate::wire::mad::MAD_LEN;

/// A communication ID: the agent's name for one connection (or SIDR exchange).
pub type CommId = u32;

/// Settings of an agent.
#[derive(Debug, Clone)]
pub struct CmConfig {
    /// The device's CA GUID, sent in REQ and REP.
    pub ca_guid: u64,
    /// CM response timeout exponent (4.096 µs × 2^t) put in our messages and used for
    /// our retries: 18 is about 1.07 s (rdma_cm uses 20, 4.3 s).
    pub response_timeout: u8,
    /// Times an unanswered message is sent again (rdma_cm: 15).
    pub max_cm_retries: u8,
    /// How long a closed connection stays in TIMEWAIT, remembered for stale REQs and
    /// repeated DREQs.
    pub timewait: Duration,
    /// Passive connections that may be half-open (REQ received, not yet established) at
    /// once.
    pub max_pending: usize,
    /// The service timeout an MRA announces (exponent, as above).
    pub mra_service_timeout: u8,
    /// How long a REQ or SIDR_REQ for a service nobody listens on waits for a listener
    /// before it is refused (zero: refused at once). A server that closes one listener
    /// and opens the next on the same port (perftest's `-R`, between its exchange and its
    /// data connection) is then not refused for being a moment late; a client that
    /// names a port nobody ever listens on hears so that much later. The active side
    /// grants the same grace to a peer that refuses at once (Linux's CM does): a REQ
    /// rejected for an invalid service ID within `listen_grace` of being first sent goes
    /// again every [`UNLISTENED_RETRY`] until the grace is over, and only a refusal after
    /// that reaches the consumer.
    pub listen_grace: Duration,
    /// Seed of the communication IDs and transaction IDs (a random value in production).
    pub seed: u64,
}

impl Default for CmConfig {
    fn default() -> Self {
        CmConfig {
            ca_guid: 0,
            response_timeout: 18,
            max_cm_retries: 15,
            timewait: Duration::from_secs(1),
            max_pending: 1024,
            mra_service_timeout: 20,
            listen_grace: Duration::from_millis(500),
            seed: 0x5eed,
        }
    }
}

/// `4.096 µs × 2^t`, the IBTA's timeout encoding (t capped at 31).
pub fn cm_timeout(t: u8) -> Duration {
    Duration::from_nanos(4096u64 << t.min(31))
}

/// Where a connection stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmState {
    /// Active: REQ sent, waiting for REP.
    ReqSent,
    /// Active: the passive side sent an MRA for the REQ; waiting longer.
    MraReqRcvd,
    /// Active: REP received; the consumer prepares its QP, then calls `rtu`.
    RepRcvd,
    /// Passive: REQ received; the consumer decides (`accept` or `reject`).
    ReqRcvd,
    /// Passive: MRA sent for a repeated REQ; the consumer still decides.
    MraReqSent,
    /// Passive: REP sent, waiting for RTU.
    RepSent,
    /// Connected.
    Established,
    /// DREQ sent, waiting for DREP.
    DreqSent,
    /// Closed; remembered until the TIMEWAIT ends.
    Timewait,
    /// SIDR_REQ sent, waiting for SIDR_REP.
    SidrReqSent,
    /// SIDR_REQ received; the consumer answers with `sidr_reply`.
    SidrReqRcvd,
}

/// What the agent tells its consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmEvent {
    /// Passive: a REQ for a service listened on (rdma_cm CONNECT_REQUEST).
    ConnectRequest {
        /// The new connection.
        id: CommId,
        /// The peer's address.
        peer: IpAddr,
        /// The REQ: QPN, PSN, resources, path, private data.
        req: Box<Req>,
    },
    /// Active: the REP arrived (rdma_cm CONNECT_RESPONSE); move the QP to RTR and RTS,
    /// then call [`CmAgent::rtu`].
    ConnectResponse {
        /// The connection.
        id: CommId,
        /// The REP.
        rep: Box<Rep>,
    },
    /// The connection is established (passive: RTU received or `establish` called;
    /// active: RTU sent).
    Established {
        /// The connection.
        id: CommId,
    },
    /// The peer refused (REJ); the connection is gone.
    Rejected {
        /// The connection.
        id: CommId,
        /// The REJ's reason.
        reason: u16,
        /// The REJ's private data.
        private_data: Vec<u8>,
    },
    /// No answer after every retry; the connection is gone.
    Unreachable {
        /// The connection.
        id: CommId,
    },
    /// The connection is closed (DREQ or DREP received, or our DREQ unanswered).
    Disconnected {
        /// The connection.
        id: CommId,
    },
    /// TIMEWAIT ended; the ID is free.
    TimewaitExit {
        /// The connection.
        id: CommId,
    },
    /// Passive: a SIDR_REQ for a service listened on.
    SidrRequest {
        /// The exchange.
        id: CommId,
        /// The peer's address.
        peer: IpAddr,
        /// The request.
        req: Box<SidrReq>,
    },
    /// Active: the SIDR_REP arrived.
    SidrResponse {
        /// The exchange.
        id: CommId,
        /// The answer.
        rep: Box<SidrRep>,
    },
}

impl CmEvent {
    /// The connection (or SIDR exchange) the event is about.
    pub fn id(&self) -> CommId {
        match *self {
            CmEvent::ConnectRequest { id, .. }
            | CmEvent::ConnectResponse { id, .. }
            | CmEvent::Established { id }
            | CmEvent::Rejected { id, .. }
            | CmEvent::Unreachable { id }
            | CmEvent::Disconnected { id }
            | CmEvent::TimewaitExit { id }
            | CmEvent::SidrRequest { id, .. }
            | CmEvent::SidrResponse { id, .. } => id,
        }
    }
}

/// Why a consumer's call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CmError {
    /// No such connection.
    #[error("no such CM connection")]
    UnknownId,
    /// The call does not fit the connection's state.
    #[error("not allowed in CM state {0:?}")]
    State(CmState),
    /// Someone already listens for the service.
    #[error("service ID already listened on")]
    InUse,
    /// Private data longer than the message carries.
    #[error("private data too long: {len} bytes, at most {max}")]
    PrivateDataTooLong {
        /// Bytes given.
        len: usize,
        /// Bytes the message carries.
        max: usize,
    },
}

/// Counters of what the agent saw and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CmStats {
    /// MADs that did not parse as CM messages.
    pub malformed: u64,
    /// Messages that matched no connection and got no answer.
    pub stray: u64,
    /// Messages sent again after a timeout.
    pub retransmits: u64,
    /// Duplicates answered from what was last sent.
    pub duplicates: u64,
    /// REQs refused for want of room (`max_pending`, or the listener's backlog).
    pub refused_full: u64,
    /// REQs sent again after the peer refused them for an invalid service ID within the
    /// listen grace (its server not listening yet).
    pub unlistened_retries: u64,
    /// Half-open connections dropped to make room for new REQs.
    pub evicted: u64,
}

#[derive(Debug)]
struct Conn {
    state: CmState,
    peer: IpAddr,
    remote_id: u32,
    tid: u64,
    service_id: u64,
    /// The last message sent, for retries and for answering duplicates.
    last: Option<CmMad>,
    /// The timeout of `last`'s retries.
    timeout: Duration,
    retries_left: u8,
    deadline: Option<Duration>,
    /// Passive and half-open (REQ received, not yet established): counted against
    /// `max_pending`.
    pending: bool,
    /// When the REQ came (passive), or first went (active).
    since: Duration,
    /// Active: a REQ refused for want of a listener waits to go again (see
    /// [`CmConfig::listen_grace`]); that resend spends none of the REQ's retries.
    unlistened: bool,
    /// Our QP and the peer's, from the REQ and the REP: a DREQ names the receiver's QP,
    /// and Linux drops one that names another.
    local_qpn: u32,
    remote_qpn: u32,
}

/// How long an active side waits before it sends again a REQ that its peer refused for an
/// invalid service ID within the listen grace (see [`CmConfig::listen_grace`]).
pub const UNLISTENED_RETRY: Duration = Duration::from_millis(50);

/// Requests that may wait for a listener at once; more are refused at once, so that a
/// flood of requests for unknown services holds no more than this.
pub const MAX_UNCLAIMED: usize = 64;

/// A request that came before its service's listener.
#[derive(Debug)]
struct Unclaimed {
    /// When it came.
    at: Duration,
    peer: IpAddr,
    tid: u64,
    msg: UnclaimedMsg,
}

#[derive(Debug)]
enum UnclaimedMsg {
    Req(Req),
    Sidr(SidrReq),
}

impl UnclaimedMsg {
    fn service_id(&self) -> u64 {
        match self {
            UnclaimedMsg::Req(r) => r.service_id,
            UnclaimedMsg::Sidr(r) => r.service_id,
        }
    }

    /// The peer's identifier of the request (its communication or request ID).
    fn remote_id(&self) -> u32 {
        match self {
            UnclaimedMsg::Req(r) => r.local_comm_id,
            UnclaimedMsg::Sidr(r) => r.request_id,
        }
    }
}

/// The CM of one device. See the module documentation.
#[derive(Debug)]
pub struct CmAgent {
    cfg: CmConfig,
    conns: HashMap<CommId, Conn>,
    /// Passive connections by the peer's address and communication ID (duplicates).
    by_remote: HashMap<(IpAddr, u32), CommId>,
    listeners: HashMap<u64, usize>,
    /// Requests for services nobody listens on, waiting [`CmConfig::listen_grace`] for a
    /// listener, oldest first (at most [`MAX_UNCLAIMED`]).
    unclaimed: VecDeque<Unclaimed>,
    deadlines: BTreeSet<(Duration, CommId)>,
    next_id: u32,
    hi_tid: u32,
    pending: usize,
    out: VecDeque<(IpAddr, [u8; MAD_LEN])>,
    events: VecDeque<CmEvent>,
    stats: CmStats,
}

impl CmAgent {
    /// An agent with no connections and no listeners.
    pub fn new(cfg: CmConfig) -> CmAgent {
        // splitmix64 of the seed: the first communication ID and the TID's high half.
        let mut z = cfg.seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        CmAgent {
            cfg,
            conns: HashMap::new(),
            by_remote: HashMap::new(),
            listeners: HashMap::new(),
            unclaimed: VecDeque::new(),
            deadlines: BTreeSet::new(),
            next_id: (z as u32).max(1),
            hi_tid: (z >> 32) as u32,
            pending: 0,
            out: VecDeque::new(),
            events: VecDeque::new(),
            stats: CmStats::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &CmConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> CmStats {
        self.stats
    }

    /// A connection's state.
    pub fn state(&self, id: CommId) -> Option<CmState> {
        self.conns.get(&id).map(|c| c.state)
    }

    /// The peer's address of a connection.
    pub fn peer(&self, id: CommId) -> Option<IpAddr> {
        self.conns.get(&id).map(|c| c.peer)
    }

    /// The peer's communication ID of a connection.
    pub fn remote_id(&self, id: CommId) -> Option<u32> {
        self.conns.get(&id).map(|c| c.remote_id)
    }

    /// Connections the agent holds (every state, TIMEWAIT included).
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// Whether the agent holds no connection.
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Accepts REQs and SIDR_REQs for `service_id`; at most `backlog` of its connections
    /// wait for the consumer at once (more are rejected with "no resources").
    pub fn listen(&mut self, service_id: u64, backlog: usize) -> Result<(), CmError> {
        if self.listeners.contains_key(&service_id) {
            return Err(CmError::InUse);
        }
        self.listeners.insert(service_id, backlog.max(1));
        // Requests that came a moment early are this listener's now, in arrival order.
        let (mine, rest) =
            std::mem::take(&mut self.unclaimed).into_iter().partition(|u| u.msg.service_id() == service_id);
        self.unclaimed = rest;
        for u in Vec::from(mine) {
            match u.msg {
                UnclaimedMsg::Req(req) => self.on_req(u.at, u.peer, u.tid, req),
                UnclaimedMsg::Sidr(req) => self.on_sidr_req(u.at, u.peer, u.tid, req),
            }
        }
        Ok(())
    }

    /// Stops accepting REQs for `service_id` (connections made stay).
    pub fn unlisten(&mut self, service_id: u64) {
        self.listeners.remove(&service_id);
    }

    /// The next MAD to send and where to (the peer's GSI, QP1).
    pub fn poll_transmit(&mut self) -> Option<(IpAddr, [u8; MAD_LEN])> {
        self.out.pop_front()
    }

    /// The next event for the consumer.
    pub fn poll_event(&mut self) -> Option<CmEvent> {
        self.events.pop_front()
    }

    /// When [`Self::handle_timeout`] next has work.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let unclaimed = self.unclaimed.front().map(|u| u.at + self.cfg.listen_grace);
        self.deadlines.first().map(|&(t, _)| t).into_iter().chain(unclaimed).min()
    }

    // ---- The consumer's calls -------------------------------------------------------

    /// Active: sends a REQ to `peer` and returns the connection's ID. The agent fills the
    /// communication ID, the CA GUID, the response timeouts and max CM retries; the
    /// caller fills the rest (QPN, starting PSN, resources, path, private data).
    pub fn connect(&mut self, now: Duration, peer: IpAddr, mut req: Req) -> Result<CommId, CmError> {
        check_len(&req.private_data, Req::PRIVATE_DATA_LEN)?;
        let id = self.alloc_id();
        req.local_comm_id = id;
        req.local_ca_guid = self.cfg.ca_guid;
        req.remote_cm_response_timeout = self.cfg.response_timeout;
        req.local_cm_response_timeout = self.cfg.response_timeout;
        req.max_cm_retries = self.cfg.max_cm_retries.min(15);
        let tid = u64::from(self.hi_tid) << 32 | u64::from(id);
        let timeout = cm_timeout(req.remote_cm_response_timeout);
        let service_id = req.service_id;
        self.insert(id, CmState::ReqSent, peer, 0, tid, service_id, false);
        if let Some(c) = self.conns.get_mut(&id) {
            c.local_qpn = req.local_qpn;
            c.since = now;
        }
        self.send_expecting(now, id, CmMsg::Req(req), timeout);
        Ok(id)
    }

    /// Passive: accepts a connection request with a REP (QPN, starting PSN, resources
    /// and private data filled by the caller).
    pub fn accept(&mut self, now: Duration, id: CommId, mut rep: Rep) -> Result<(), CmError> {
        check_len(&rep.private_data, Rep::PRIVATE_DATA_LEN)?;
        let c = self.conns.get(&id).ok_or(CmError::UnknownId)?;
        if !matches!(c.state, CmState::ReqRcvd | CmState::MraReqSent) {
            return Err(CmError::State(c.state));
        }
        rep.local_comm_id = id;
        rep.remote_comm_id = c.remote_id;
        rep.local_ca_guid = self.cfg.ca_guid;
        if let Some(c) = self.conns.get_mut(&id) {
            c.local_qpn = rep.local_qpn;
        }
        self.set_state(id, CmState::RepSent);
        let timeout = cm_timeout(self.cfg.response_timeout);
        self.send_expecting(now, id, CmMsg::Rep(rep), timeout);
        Ok(())
    }

    /// Passive: refuses a connection request (rdma_reject: reason 28, consumer defined).
    pub fn reject(&mut self, id: CommId, reason: u16, private_data: &[u8]) -> Result<(), CmError> {
        check_len(private_data, Rej::PRIVATE_DATA_LEN)?;
        let c = self.conns.get(&id).ok_or(CmError::UnknownId)?;
        let rejected = match c.state {
            CmState::ReqRcvd | CmState::MraReqSent => MsgKind::Req,
            CmState::RepRcvd => MsgKind::Rep,
            s => return Err(CmError::State(s)),
        };
        let rej = rej(id, c.remote_id, rejected, reason, private_data);
        let (peer, tid) = (c.peer, c.tid);
        self.send(peer, CmMad::new(tid, CmMsg::Rej(rej)));
        self.remove(id);
        Ok(())
    }

    /// Active: after the REP, sends the RTU; the connection is established.
    pub fn rtu(&mut self, id: CommId, private_data: &[u8]) -> Result<(), CmError> {
        check_len(private_data, IdsAndData::PRIVATE_DATA_LEN)?;
        let c = self.conns.get(&id).ok_or(CmError::UnknownId)?;
        if c.state != CmState::RepRcvd {
            return Err(CmError::State(c.state));
        }
        let ids = Ids { local_comm_id: id, remote_comm_id: c.remote_id };
        let mad = CmMad::new(c.tid, CmMsg::Rtu(IdsAndData { ids, private_data: private_data.to_vec() }));
        let peer = c.peer;
        self.send(peer, mad.clone());
        if let Some(c) = self.conns.get_mut(&id) {
            c.last = Some(mad);
        }
        self.set_state(id, CmState::Established);
        self.events.push_back(CmEvent::Established { id });
        Ok(())
    }

    /// Passive: the connection is in use before the RTU came (data arrived on the QP:
    /// rdma_establish / the QP's COMM_EST event).
    pub fn establish(&mut self, id: CommId) -> Result<(), CmError> {
        let c = self.conns.get(&id).ok_or(CmError::UnknownId)?;
        if c.state != CmState::RepSent {
            return Err(CmError::State(c.state));
        }
        self.unpend(id);
        self.set_state(id, CmState::Established);
        self.set_deadline(id, None);
        self.events.push_back(CmEvent::Established { id });
        Ok(())
    }

    /// Sends a DREQ; the connection closes when the DREP comes (or after the retries).
    pub fn disconnect(&mut self, now: Duration, id: CommId, private_data: &[u8]) -> Result<(), CmError> {
        check_len(private_data, 220)?;
        let c = self.conns.get(&id).ok_or(CmError::UnknownId)?;
        if !matches!(c.state, CmState::Established | CmState::RepSent | CmState::RepRcvd) {
            return Err(CmError::State(c.state));
        }
        let remote_qpn = c.remote_qpn;
        let dreq = Dreq {
            ids: Ids { local_comm_id: id, remote_comm_id: c.remote_id },
            remote_qpn,
            private_data: private_data.to_vec(),
        };
        self.set_state(id, CmState::DreqSent);
        let timeout = cm_timeout(self.cfg.response_timeout);
        self.send_expecting(now, id, CmMsg::Dreq(dreq), timeout);
        Ok(())
    }

    /// Forgets a connection at once, sending nothing (the consumer destroyed its ID; an
    /// established connection should be disconnected first).
    pub fn destroy(&mut self, id: CommId) {
        self.remove(id);
    }

    /// Active: asks `peer` which UD QP serves `service_id`.
    pub fn sidr_request(
        &mut self,
        now: Duration,
        peer: IpAddr,
        service_id: u64,
        private_data: &[u8],
    ) -> Result<CommId, CmError> {
        check_len(private_data, SidrReq::PRIVATE_DATA_LEN)?;
        let id = self.alloc_id();
        let tid = u64::from(self.hi_tid) << 32 | u64::from(id);
        self.insert(id, CmState::SidrReqSent, peer, 0, tid, service_id, false);
        let req = SidrReq { request_id: id, pkey: 0xFFFF, service_id, private_data: private_data.to_vec() };
        let timeout = cm_timeout(self.cfg.response_timeout);
        self.send_expecting(now, id, CmMsg::SidrReq(req), timeout);
        Ok(id)
    }

    /// Passive: answers a SIDR_REQ (status 0 with the QP and Q_Key, or a refusal).
    pub fn sidr_reply(
        &mut self,
        id: CommId,
        status: u8,
        qpn: u32,
        qkey: u32,
        private_data: &[u8],
    ) -> Result<(), CmError> {
        check_len(private_data, SidrRep::PRIVATE_DATA_LEN)?;
        let c = self.conns.get(&id).ok_or(CmError::UnknownId)?;
        if c.state != CmState::SidrReqRcvd {
            return Err(CmError::State(c.state));
        }
        let rep = sidr_rep(c.remote_id, status, qpn, qkey, c.service_id, private_data);
        let (peer, tid) = (c.peer, c.tid);
        self.send(peer, CmMad::new(tid, CmMsg::SidrRep(rep)));
        self.remove(id);
        Ok(())
    }

    // ---- Input ----------------------------------------------------------------------

    /// Takes a MAD that arrived on QP1 from `peer`.
    pub fn handle_mad(&mut self, now: Duration, peer: IpAddr, mad: &[u8]) {
        let m = match CmMad::parse(mad) {
            Ok(m) => m,
            Err(super::msg::CmParseError::ClassVersion(_)) if mad.len() >= 32 && mad[16..18] == [0, 0x10] => {
                // A REQ of another class version: REJ 31, as Linux answers.
                self.stats.malformed += 1;
                let remote = u32::from_be_bytes([mad[24], mad[25], mad[26], mad[27]]);
                let tid = u64::from_be_bytes(mad[8..16].try_into().unwrap_or_default());
                let r = rej(0, remote, MsgKind::Req, RejReason::InvalidClassVersion as u16, &[]);
                self.send(peer, CmMad::new(tid, CmMsg::Rej(r)));
                return;
            }
            Err(_) => {
                self.stats.malformed += 1;
                return;
            }
        };
        let tid = m.transaction_id;
        match m.msg {
            CmMsg::Req(req) => self.on_req(now, peer, tid, req),
            CmMsg::Rep(rep) => self.on_rep(peer, tid, rep),
            CmMsg::Rtu(rtu) => self.on_rtu(peer, rtu),
            CmMsg::Rej(rej) => self.on_rej(now, peer, rej),
            CmMsg::Mra(mra) => self.on_mra(now, peer, mra),
            CmMsg::Dreq(dreq) => self.on_dreq(now, peer, tid, dreq),
            CmMsg::Drep(drep) => self.on_drep(now, peer, drep),
            CmMsg::SidrReq(req) => self.on_sidr_req(now, peer, tid, req),
            CmMsg::SidrRep(rep) => self.on_sidr_rep(peer, rep),
        }
    }

    /// Resends what timed out, fails exchanges out of retries, ends TIMEWAITs.
    pub fn handle_timeout(&mut self, now: Duration) {
        while self.unclaimed.front().is_some_and(|u| u.at + self.cfg.listen_grace <= now) {
            if let Some(u) = self.unclaimed.pop_front() {
                self.refuse_unknown(u.peer, u.tid, &u.msg);
            }
        }
        while let Some(&(t, id)) = self.deadlines.first() {
            if t > now {
                break;
            }
            self.deadlines.pop_first();
            let Some(c) = self.conns.get_mut(&id) else { continue };
            c.deadline = None;
            match c.state {
                CmState::Timewait => {
                    self.remove(id);
                    self.events.push_back(CmEvent::TimewaitExit { id });
                }
                _ if c.last.is_some()
                    && ((c.unlistened && c.state == CmState::ReqSent) || c.retries_left > 0) =>
                {
                    // The resend of a REQ refused for want of a listener spends no retry.
                    if !(std::mem::take(&mut c.unlistened) && c.state == CmState::ReqSent) {
                        c.retries_left -= 1;
                        self.stats.retransmits += 1;
                    }
                    let (peer, mad, timeout) = (c.peer, c.last.clone(), c.timeout);
                    if let Some(mad) = mad {
                        self.send(peer, mad);
                    }
                    self.set_deadline(id, Some(now + timeout));
                }
                CmState::ReqSent | CmState::MraReqRcvd | CmState::RepSent => {
                    // Out of retries: tell the peer, and the consumer.
                    let (peer, tid, remote) = (c.peer, c.tid, c.remote_id);
                    let rejected = if c.state == CmState::RepSent { MsgKind::Rep } else { MsgKind::Req };
                    let r = rej(id, remote, rejected, RejReason::Timeout as u16, &[]);
                    self.send(peer, CmMad::new(tid, CmMsg::Rej(r)));
                    self.remove(id);
                    self.events.push_back(CmEvent::Unreachable { id });
                }
                CmState::DreqSent => {
                    self.enter_timewait(now, id);
                    self.events.push_back(CmEvent::Disconnected { id });
                }
                CmState::SidrReqSent => {
                    self.remove(id);
                    self.events.push_back(CmEvent::Unreachable { id });
                }
                _ => {}
            }
        }
    }

    // ---- Message handlers -----------------------------------------------------------

    fn on_req(&mut self, now: Duration, peer: IpAddr, tid: u64, req: Req) {
        let remote = req.local_comm_id;
        if let Some(&id) = self.by_remote.get(&(peer, remote)) {
            self.on_duplicate_req(now, id);
            return;
        }
        let refuse = |reason: RejReason| rej(0, remote, MsgKind::Req, reason as u16, &[]);
        let Some(&backlog) = self.listeners.get(&req.service_id) else {
            self.wait_for_listener(now, peer, tid, UnclaimedMsg::Req(req));
            return;
        };
        if req.transport_type > 1 {
            self.send(peer, CmMad::new(tid, CmMsg::Rej(refuse(RejReason::InvalidTransportType))));
            return;
        }
        // Half-open connections are bounded. When full, the oldest one that only waits
        // for an RTU (which a forged REQ never sends) makes room, as a SYN queue is
        // pruned; if every one waits for the consumer, the REQ is refused.
        let deciding = |c: &Conn| matches!(c.state, CmState::ReqRcvd | CmState::MraReqSent);
        let waiting = self.conns.values().filter(|c| deciding(c) && c.service_id == req.service_id).count();
        if waiting >= backlog || (self.pending >= self.cfg.max_pending && !self.evict_half_open()) {
            self.stats.refused_full += 1;
            self.send(peer, CmMad::new(tid, CmMsg::Rej(refuse(RejReason::NoResources))));
            return;
        }
        let id = self.alloc_id();
        self.insert(id, CmState::ReqRcvd, peer, remote, tid, req.service_id, true);
        if let Some(c) = self.conns.get_mut(&id) {
            c.since = now;
            c.remote_qpn = req.local_qpn;
        }
        self.events.push_back(CmEvent::ConnectRequest { id, peer, req: Box::new(req) });
    }

    /// A request for a service nobody listens on: kept for [`CmConfig::listen_grace`]
    /// in case its listener comes (a repeat of one kept is dropped), refused at once when
    /// there is no grace or no room.
    fn wait_for_listener(&mut self, now: Duration, peer: IpAddr, tid: u64, msg: UnclaimedMsg) {
        let same = |u: &Unclaimed| {
            u.peer == peer
                && u.msg.remote_id() == msg.remote_id()
                && std::mem::discriminant(&u.msg) == std::mem::discriminant(&msg)
        };
        if self.unclaimed.iter().any(same) {
            self.stats.duplicates += 1;
        } else if self.cfg.listen_grace.is_zero() || self.unclaimed.len() >= MAX_UNCLAIMED {
            self.refuse_unknown(peer, tid, &msg);
        } else {
            self.unclaimed.push_back(Unclaimed { at: now, peer, tid, msg });
        }
    }

    /// Refuses a request for a service nobody listens on: REJ "invalid service ID", or
    /// SIDR_REP status 1 ("service ID not supported").
    fn refuse_unknown(&mut self, peer: IpAddr, tid: u64, msg: &UnclaimedMsg) {
        let answer = match msg {
            UnclaimedMsg::Req(r) => {
                CmMsg::Rej(rej(0, r.local_comm_id, MsgKind::Req, RejReason::InvalidServiceId as u16, &[]))
            }
            UnclaimedMsg::Sidr(r) => CmMsg::SidrRep(sidr_rep(r.request_id, 1, 0, 0, r.service_id, &[])),
        };
        self.send(peer, CmMad::new(tid, answer));
    }

    fn on_duplicate_req(&mut self, now: Duration, id: CommId) {
        let Some(c) = self.conns.get(&id) else { return };
        self.stats.duplicates += 1;
        match c.state {
            CmState::ReqRcvd | CmState::MraReqSent => {
                // The consumer is still deciding: ask the peer for more time.
                let mra = Mra {
                    ids: Ids { local_comm_id: id, remote_comm_id: c.remote_id },
                    mraed: MsgKind::Req,
                    service_timeout: self.cfg.mra_service_timeout,
                    private_data: Vec::new(),
                };
                let (peer, tid) = (c.peer, c.tid);
                self.send(peer, CmMad::new(tid, CmMsg::Mra(mra)));
                self.set_state(id, CmState::MraReqSent);
            }
            CmState::RepSent => {
                let (peer, last) = (c.peer, c.last.clone());
                if let Some(rep) = last {
                    self.send(peer, rep);
                }
            }
            CmState::Timewait => {
                let (peer, tid, remote) = (c.peer, c.tid, c.remote_id);
                let r = rej(id, remote, MsgKind::Req, RejReason::StaleConnection as u16, &[]);
                self.send(peer, CmMad::new(tid, CmMsg::Rej(r)));
                let _ = now;
            }
            _ => {}
        }
    }

    /// The connection `id` names, if `peer` is its peer.
    fn conn_of(&self, peer: IpAddr, id: CommId) -> Option<&Conn> {
        self.conns.get(&id).filter(|c| c.peer == peer)
    }

    fn on_rep(&mut self, peer: IpAddr, tid: u64, rep: Rep) {
        let id = rep.remote_comm_id;
        let Some(c) = self.conn_of(peer, id) else {
            // A REP for a connection we gave up on: make the peer forget it too.
            let r = rej(0, rep.local_comm_id, MsgKind::Rep, RejReason::InvalidCommId as u16, &[]);
            self.send(peer, CmMad::new(tid, CmMsg::Rej(r)));
            return;
        };
        match c.state {
            CmState::ReqSent | CmState::MraReqRcvd => {
                if let Some(c) = self.conns.get_mut(&id) {
                    c.remote_id = rep.local_comm_id;
                    c.remote_qpn = rep.local_qpn;
                    c.last = None;
                }
                self.set_state(id, CmState::RepRcvd);
                self.set_deadline(id, None);
                self.events.push_back(CmEvent::ConnectResponse { id, rep: Box::new(rep) });
            }
            CmState::Established | CmState::DreqSent | CmState::Timewait
                if c.remote_id == rep.local_comm_id =>
            {
                // Our RTU was lost: send it again (or the DREQ that followed it).
                let (peer, last) = (c.peer, c.last.clone());
                self.stats.duplicates += 1;
                if let Some(m) = last {
                    self.send(peer, m);
                }
            }
            _ => self.stats.duplicates += 1,
        }
    }

    fn on_rtu(&mut self, peer: IpAddr, rtu: IdsAndData) {
        let id = rtu.ids.remote_comm_id;
        match self.conn_of(peer, id).map(|c| (c.state, c.remote_id)) {
            Some((CmState::RepSent, remote)) if remote == rtu.ids.local_comm_id => {
                self.unpend(id);
                self.set_state(id, CmState::Established);
                self.set_deadline(id, None);
                if let Some(c) = self.conns.get_mut(&id) {
                    c.last = None;
                }
                self.events.push_back(CmEvent::Established { id });
            }
            Some(_) => self.stats.duplicates += 1,
            None => self.stats.stray += 1,
        }
    }

    fn on_rej(&mut self, now: Duration, peer: IpAddr, rej: Rej) {
        let id = rej.ids.remote_comm_id;
        if id == 0 {
            // The peer gave up on a REQ we have not answered: if it waits for a listener,
            // forget it, so that no listener is handed a connection already abandoned.
            let before = self.unclaimed.len();
            self.unclaimed.retain(|u| {
                !(u.peer == peer
                    && matches!(u.msg, UnclaimedMsg::Req(_))
                    && u.msg.remote_id() == rej.ids.local_comm_id)
            });
            if self.unclaimed.len() < before {
                return;
            }
        }
        let Some(c) = self.conn_of(peer, id) else {
            self.stats.stray += 1;
            return;
        };
        // A REJ names our ID; its sender's ID is 0 when it rejects our REQ unseen.
        let theirs_ok =
            c.remote_id == 0 || rej.ids.local_comm_id == 0 || rej.ids.local_comm_id == c.remote_id;
        if !theirs_ok {
            self.stats.stray += 1;
            return;
        }
        let unlistened = c.state == CmState::ReqSent
            && rej.reason == RejReason::InvalidServiceId as u16
            && rej.rejected == MsgKind::Req
            && now < c.since + self.cfg.listen_grace;
        if unlistened {
            // Its server is not listening yet (see `CmConfig::listen_grace`): the REQ goes
            // again shortly, through the retry timer.
            let at = (now + UNLISTENED_RETRY).min(c.since + self.cfg.listen_grace);
            if let Some(c) = self.conns.get_mut(&id) {
                if c.unlistened {
                    // Another refusal (a duplicate, or the answer to an ordinary resend)
                    // while the resend waits: it goes once.
                    return;
                }
                c.unlistened = true;
            }
            self.stats.unlistened_retries += 1;
            self.set_deadline(id, Some(at));
            return;
        }
        match c.state {
            CmState::ReqSent | CmState::MraReqRcvd | CmState::RepRcvd | CmState::RepSent => {
                self.remove(id);
                self.events.push_back(CmEvent::Rejected {
                    id,
                    reason: rej.reason,
                    private_data: rej.private_data,
                });
            }
            CmState::Established => {
                // A stale-connection REJ for a live connection: it is over.
                self.events.push_back(CmEvent::Disconnected { id });
                self.remove(id);
            }
            _ => self.stats.stray += 1,
        }
    }

    fn on_mra(&mut self, now: Duration, peer: IpAddr, mra: Mra) {
        let id = mra.ids.remote_comm_id;
        let Some(c) = self.conn_of(peer, id) else {
            self.stats.stray += 1;
            return;
        };
        let wait = cm_timeout(mra.service_timeout) + c.timeout;
        match (c.state, mra.mraed) {
            (CmState::ReqSent | CmState::MraReqRcvd, MsgKind::Req) => {
                if let Some(c) = self.conns.get_mut(&id) {
                    c.remote_id = mra.ids.local_comm_id;
                }
                self.set_state(id, CmState::MraReqRcvd);
                self.set_deadline(id, Some(now + wait));
            }
            (CmState::RepSent, MsgKind::Rep) => self.set_deadline(id, Some(now + wait)),
            _ => self.stats.stray += 1,
        }
    }

    fn on_dreq(&mut self, now: Duration, peer: IpAddr, tid: u64, dreq: Dreq) {
        let id = dreq.ids.remote_comm_id;
        let state = self
            .conn_of(peer, id)
            .filter(|c| c.remote_id == dreq.ids.local_comm_id)
            .filter(|c| c.local_qpn == 0 || dreq.remote_qpn == c.local_qpn)
            .map(|c| c.state);
        let drep = |local: u32, remote: u32| {
            CmMsg::Drep(IdsAndData {
                ids: Ids { local_comm_id: local, remote_comm_id: remote },
                private_data: Vec::new(),
            })
        };
        match state {
            Some(CmState::Established | CmState::DreqSent | CmState::RepSent | CmState::RepRcvd) => {
                self.send(peer, CmMad::new(tid, drep(id, dreq.ids.local_comm_id)));
                self.enter_timewait(now, id);
                self.events.push_back(CmEvent::Disconnected { id });
            }
            Some(CmState::Timewait) => {
                self.stats.duplicates += 1;
                self.send(peer, CmMad::new(tid, drep(id, dreq.ids.local_comm_id)));
            }
            _ => {
                // Unknown connection: answer anyway, so the peer can close (Linux does).
                self.stats.stray += 1;
                self.send(peer, CmMad::new(tid, drep(dreq.ids.remote_comm_id, dreq.ids.local_comm_id)));
            }
        }
    }

    fn on_drep(&mut self, now: Duration, peer: IpAddr, drep: IdsAndData) {
        let id = drep.ids.remote_comm_id;
        match self.conn_of(peer, id).map(|c| c.state) {
            Some(CmState::DreqSent) => {
                self.enter_timewait(now, id);
                self.events.push_back(CmEvent::Disconnected { id });
            }
            Some(_) => self.stats.duplicates += 1,
            None => self.stats.stray += 1,
        }
    }

    fn on_sidr_req(&mut self, now: Duration, peer: IpAddr, tid: u64, req: SidrReq) {
        if self.by_remote.contains_key(&(peer, req.request_id)) {
            self.stats.duplicates += 1;
            return;
        }
        if !self.listeners.contains_key(&req.service_id) {
            self.wait_for_listener(now, peer, tid, UnclaimedMsg::Sidr(req));
            return;
        }
        if self.pending >= self.cfg.max_pending {
            self.stats.refused_full += 1;
            let rep = sidr_rep(req.request_id, 2, 0, 0, req.service_id, &[]);
            self.send(peer, CmMad::new(tid, CmMsg::SidrRep(rep)));
            return;
        }
        let id = self.alloc_id();
        self.insert(id, CmState::SidrReqRcvd, peer, req.request_id, tid, req.service_id, true);
        self.events.push_back(CmEvent::SidrRequest { id, peer, req: Box::new(req) });
    }

    fn on_sidr_rep(&mut self, peer: IpAddr, rep: SidrRep) {
        let id = rep.request_id;
        match self.conn_of(peer, id).map(|c| c.state) {
            Some(CmState::SidrReqSent) => {
                self.remove(id);
                self.events.push_back(CmEvent::SidrResponse { id, rep: Box::new(rep) });
            }
            _ => self.stats.stray += 1,
        }
    }

    // ---- Bookkeeping ----------------------------------------------------------------

    /// Drops the oldest half-open connection that waits for an RTU; false if none does.
    fn evict_half_open(&mut self) -> bool {
        let oldest = self
            .conns
            .iter()
            .filter(|(_, c)| c.pending && c.state == CmState::RepSent)
            .min_by_key(|(&id, c)| (c.since, id))
            .map(|(&id, _)| id);
        match oldest {
            Some(id) => {
                self.stats.evicted += 1;
                self.remove(id);
                self.events.push_back(CmEvent::Unreachable { id });
                true
            }
            None => false,
        }
    }

    fn alloc_id(&mut self) -> CommId {
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            if id != 0 && !self.conns.contains_key(&id) {
                return id;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn insert(
        &mut self,
        id: CommId,
        state: CmState,
        peer: IpAddr,
        remote: u32,
        tid: u64,
        service_id: u64,
        pending: bool,
    ) {
        let passive = matches!(state, CmState::ReqRcvd | CmState::SidrReqRcvd);
        if passive {
            self.by_remote.insert((peer, remote), id);
        }
        if pending {
            self.pending += 1;
        }
        self.conns.insert(
            id,
            Conn {
                state,
                peer,
                remote_id: remote,
                tid,
                service_id,
                last: None,
                timeout: Duration::ZERO,
                retries_left: 0,
                deadline: None,
                pending,
                since: Duration::ZERO,
                unlistened: false,
                local_qpn: 0,
                remote_qpn: 0,
            },
        );
    }

    fn remove(&mut self, id: CommId) {
        self.set_deadline(id, None);
        if let Some(c) = self.conns.remove(&id) {
            if c.pending {
                self.pending -= 1;
            }
            if self.by_remote.get(&(c.peer, c.remote_id)) == Some(&id) {
                self.by_remote.remove(&(c.peer, c.remote_id));
            }
        }
    }

    fn unpend(&mut self, id: CommId) {
        if let Some(c) = self.conns.get_mut(&id) {
            if c.pending {
                c.pending = false;
                self.pending -= 1;
            }
        }
    }

    fn set_state(&mut self, id: CommId, state: CmState) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.state = state;
        }
    }

    fn set_deadline(&mut self, id: CommId, at: Option<Duration>) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        if let Some(old) = c.deadline.take() {
            self.deadlines.remove(&(old, id));
        }
        if let Some(t) = at {
            c.deadline = Some(t);
            self.deadlines.insert((t, id));
        }
    }

    fn enter_timewait(&mut self, now: Duration, id: CommId) {
        self.unpend(id);
        self.set_state(id, CmState::Timewait);
        let tw = self.cfg.timewait;
        self.set_deadline(id, Some(now + tw));
    }

    fn send(&mut self, peer: IpAddr, mad: CmMad) {
        self.out.push_back((peer, mad.emit()));
    }

    /// Sends a message that expects an answer: kept for retries and duplicates.
    fn send_expecting(&mut self, now: Duration, id: CommId, msg: CmMsg, timeout: Duration) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        let mad = CmMad::new(c.tid, msg);
        c.last = Some(mad.clone());
        c.timeout = timeout;
        c.retries_left = self.cfg.max_cm_retries;
        let peer = c.peer;
        self.send(peer, mad);
        self.set_deadline(id, Some(now + timeout));
    }
}

fn check_len(data: &[u8], max: usize) -> Result<(), CmError> {
    if data.len() > max {
        return Err(CmError::PrivateDataTooLong { len: data.len(), max });
    }
    Ok(())
}

fn rej(local: u32, remote: u32, rejected: MsgKind, reason: u16, private_data: &[u8]) -> Rej {
    Rej {
        ids: Ids { local_comm_id: local, remote_comm_id: remote },
        rejected,
        ari_length: 0,
        reason,
        ari: Vec::new(),
        private_data: private_data.to_vec(),
    }
}

fn sidr_rep(
    request_id: u32,
    status: u8,
    qpn: u32,
    qkey: u32,
    service_id: u64,
    private_data: &[u8],
) -> SidrRep {
    SidrRep {
        request_id,
        status,
        info_length: 0,
        ece_vendor_id: 0,
        qpn,
        service_id,
        qkey,
        info: Vec::new(),
        private_data: private_data.to_vec(),
    }
}
