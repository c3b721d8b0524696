//! rdma_cm's convenience layer: `rdma_getaddrinfo`, `rdma_create_ep` and the
//! `rdma_verbs.h` wrappers, for programs that want a connection in a few blocking calls.
//!
//! | rdma_cm | here |
//! |---|---|
//! | `rdma_getaddrinfo(node, service, hints)` | [`getaddrinfo`] with [`AddrHints`] |
//! | `rdma_create_ep(&id, res, pd, qp_init_attr)` | [`Ep::create`] with an [`AddrInfo`] and [`EpQp`] |
//! | `rdma_listen`, `rdma_get_request` | [`Ep::listen`], [`Ep::get_request`] |
//! | `rdma_connect`, `rdma_accept` (synchronous IDs) | [`Ep::connect`], [`Ep::accept`]: they return once ESTABLISHED |
//! | `rdma_reg_msgs`, `rdma_reg_read`, `rdma_reg_write` | [`Ep::reg_msgs`], [`Ep::reg_read`], [`Ep::reg_write`] |
//! | `rdma_post_recv`, `rdma_post_send`, `rdma_post_write`, `rdma_post_read` | the same names on [`Ep`] |
//! | `rdma_get_send_comp`, `rdma_get_recv_comp` | the same names, plus `_timeout` forms |
//! | `rdma_disconnect`, `rdma_destroy_ep` | [`Ep::disconnect`], dropping the [`Ep`] |
//!
//! An [`Ep`] is what rdma_cm calls a synchronous ID: it has an event channel of its own
//! that its blocking calls read, so the caller never sees events. Services are port
//! numbers (rdma_cm's services are too); names resolve through the system's resolver.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use softrdma_proto::qp::{QpCaps, QpType};

use super::{CmEvent, CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use crate::cq::CompletionQueue;
use crate::pd::{MemoryRegion, ProtectionDomain, RemoteRegion};
use crate::qp::{QpBuilder, QueuePair};
use crate::{Access, Error, RecvWr, Result, SendFlags, SendOp, SendWr, WorkCompletion};

/// How long address and route resolution may take in [`Ep::create`] (rdma_cm's
/// convenience layer uses 2 s too).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// What [`getaddrinfo`] looks for (`struct rdma_addrinfo` hints).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddrHints {
    /// A listener's address (`RAI_PASSIVE`): the node is the local address (none: every
    /// address).
    pub passive: bool,
    /// The node must be a numeric address (`RAI_NUMERICHOST`).
    pub numeric_host: bool,
    /// RC over TCP's port space (the default) or UD over UDP's.
    pub port_space: PortSpace,
    /// Only IPv4 or only IPv6 answers (`ai_family`); `None` takes both.
    pub ipv6: Option<bool>,
    /// Active: the source address to use.
    pub src: Option<IpAddr>,
}

impl Default for AddrHints {
    fn default() -> Self {
        AddrHints { passive: false, numeric_host: false, port_space: PortSpace::Tcp, ipv6: None, src: None }
    }
}

/// One answer of [`getaddrinfo`] (`struct rdma_addrinfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddrInfo {
    /// A listener's address.
    pub passive: bool,
    /// The port space, and with it the QP type.
    pub port_space: PortSpace,
    /// The local address: the listener's, or the active side's chosen source.
    pub src: Option<SocketAddr>,
    /// The peer's address (active).
    pub dst: Option<SocketAddr>,
}

impl AddrInfo {
    /// RC for the TCP and IB port spaces, UD for UDP and IPoIB.
    pub fn qp_type(&self) -> QpType {
        match self.port_space {
            PortSpace::Tcp | PortSpace::Ib => QpType::Rc,
            PortSpace::Udp | PortSpace::Ipoib => QpType::Ud,
        }
    }
}

/// Resolves `node` and `service` (a port number) to connection addresses
/// (`rdma_getaddrinfo`): the node's addresses as the peer's (active), or as the address to
/// listen on (passive; no node listens on every address).
pub fn getaddrinfo(node: Option<&str>, service: Option<&str>, hints: &AddrHints) -> Result<Vec<AddrInfo>> {
    let port = match service {
        None => 0,
        Some(s) => {
            s.parse::<u16>().map_err(|_| Error::InvalidArgument("the service must be a port number"))?
        }
    };
    let addrs: Vec<IpAddr> = match node {
        None if hints.passive => {
            let any =
                if hints.ipv6 == Some(true) { IpAddr::from([0u16; 8]) } else { Ipv4Addr::UNSPECIFIED.into() };
            vec![any]
        }
        None => return Err(Error::InvalidArgument("an active address needs a node")),
        Some(n) => match n.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) if hints.numeric_host => {
                return Err(Error::InvalidArgument("the node is not a numeric address"))
            }
            Err(_) => (n, port).to_socket_addrs()?.map(|a| a.ip()).collect(),
        },
    };
    let mut out: Vec<AddrInfo> = Vec::new();
    for ip in addrs {
        if hints.ipv6.is_some_and(|v6| v6 != ip.is_ipv6()) {
            continue;
        }
        let at = SocketAddr::new(ip, port);
        let info = if hints.passive {
            AddrInfo { passive: true, port_space: hints.port_space, src: Some(at), dst: None }
        } else {
            let src = hints.src.map(|s| SocketAddr::new(s, 0));
            AddrInfo { passive: false, port_space: hints.port_space, src, dst: Some(at) }
        };
        if !out.contains(&info) {
            out.push(info);
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidArgument("no address of the node fits the hints"));
    }
    Ok(out)
}

/// The QP an [`Ep`] creates for itself (`struct ibv_qp_init_attr` of `rdma_create_ep`):
/// its CQs are created with it, each as deep as its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpQp {
    /// Queue depths, scatter/gather entries, inline size.
    pub caps: QpCaps,
    /// Every send completes (`sq_sig_all`).
    pub sq_sig_all: bool,
}

impl Default for EpQp {
    fn default() -> Self {
        EpQp {
            caps: QpCaps {
                max_send_wr: 16,
                max_recv_wr: 16,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
        }
    }
}

/// An ID's QP and what it runs on.
#[derive(Debug, Clone)]
struct Resources {
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    qp: Arc<QueuePair>,
}

/// A synchronous CM ID with its QP (rdma_cm's endpoint): every call returns once done.
#[derive(Debug)]
pub struct Ep {
    id: CmId,
    chan: EventChannel,
    /// A listener's QP template, for the requests it hands out.
    template: Option<(Option<ProtectionDomain>, EpQp)>,
    res: Option<Resources>,
    /// The peer's parameters, from the request (passive) or ESTABLISHED (active).
    peer: Option<ConnParam>,
}

impl Ep {
    /// Creates an endpoint for `info` (`rdma_create_ep`). Passive: an ID bound to the
    /// address, whose requests get a QP made from `qp` ([`Self::get_request`]). Active: an
    /// ID with its address and route resolved, and a QP if `qp` is given, on `pd` or on
    /// a protection domain of its own.
    pub fn create(info: &AddrInfo, pd: Option<&ProtectionDomain>, qp: Option<&EpQp>) -> Result<Ep> {
        let chan = EventChannel::new()?;
        let id = CmId::new(&chan, info.port_space);
        let mut ep = Ep { id, chan, template: None, res: None, peer: None };
        if info.passive {
            let at = info.src.unwrap_or_else(|| SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0));
            ep.id.bind_addr(at)?;
            ep.template = qp.map(|q| (pd.cloned(), *q));
            return Ok(ep);
        }
        let dst = info.dst.ok_or(Error::InvalidArgument("an active AddrInfo needs a destination"))?;
        ep.id.resolve_addr(info.src.map(|s| s.ip()), dst, RESOLVE_TIMEOUT)?;
        ep.expect(CmEventKind::AddrResolved, RESOLVE_TIMEOUT)?;
        ep.id.resolve_route(RESOLVE_TIMEOUT)?;
        ep.expect(CmEventKind::RouteResolved, RESOLVE_TIMEOUT)?;
        if let Some(q) = qp {
            ep.make_qp(pd, q)?;
        }
        Ok(ep)
    }

    /// The CM ID.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// The QP, once there is one.
    pub fn qp(&self) -> Option<&Arc<QueuePair>> {
        self.res.as_ref().map(|r| &r.qp)
    }

    /// The protection domain of the QP.
    pub fn pd(&self) -> Option<&ProtectionDomain> {
        self.res.as_ref().map(|r| &r.pd)
    }

    /// The send CQ.
    pub fn send_cq(&self) -> Option<&CompletionQueue> {
        self.res.as_ref().map(|r| &r.send_cq)
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> Option<&CompletionQueue> {
        self.res.as_ref().map(|r| &r.recv_cq)
    }

    /// What the peer offered: the request's parameters and private data (passive), or the
    /// reply's (active, once connected).
    pub fn peer_param(&self) -> Option<&ConnParam> {
        self.peer.as_ref()
    }

    /// Creates the QP on CQs of the caller's (`rdma_create_qp` with `send_cq`/`recv_cq`
    /// set), as the tutorial's programs do.
    pub fn create_qp(
        &mut self,
        pd: &ProtectionDomain,
        builder: &QpBuilder,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> Result<Arc<QueuePair>> {
        let qp = self.id.create_qp(pd, builder, send_cq, recv_cq)?;
        self.res = Some(Resources {
            pd: pd.clone(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            qp: qp.clone(),
        });
        Ok(qp)
    }

    fn make_qp(&mut self, pd: Option<&ProtectionDomain>, q: &EpQp) -> Result<()> {
        let ctx = self.id.context().ok_or(Error::CmState("the ID has no device"))?;
        let pd = match pd {
            Some(p) if Arc::ptr_eq(&p.ctx, &ctx.inner) => p.clone(),
            _ => ctx.alloc_pd(),
        };
        let send_cq = ctx.create_cq(q.caps.max_send_wr.max(1) as usize, None)?;
        let recv_cq = ctx.create_cq(q.caps.max_recv_wr.max(1) as usize, None)?;
        let builder = match self.id.qp_type() {
            QpType::Ud => QpBuilder::ud(super::UDP_QKEY),
            _ => QpBuilder::rc(),
        }
        .caps(q.caps)
        .sq_sig_all(q.sq_sig_all);
        self.create_qp(&pd, &builder, &send_cq, &recv_cq)?;
        Ok(())
    }

    /// Waits for the ID's next event, which must be `want`.
    fn expect(&self, want: CmEventKind, timeout: Duration) -> Result<CmEvent> {
        let ev = self
            .chan
            .get_event_timeout(timeout)
            .ok_or(Error::TimedOut("waiting for the connection manager"))?;
        if ev.kind == want {
            Ok(ev)
        } else {
            Err(Error::CmFailed { event: ev.kind.name(), status: ev.status })
        }
    }

    /// Listens (`rdma_listen`); requests then come from [`Self::get_request`].
    pub fn listen(&self, backlog: usize) -> Result<()> {
        self.id.listen(backlog)
    }

    /// The next connection request (`rdma_get_request`), as an endpoint with its QP made
    /// from the listener's template; answer it with [`Self::accept`] or
    /// [`Self::reject`].
    pub fn get_request(&self) -> Result<Ep> {
        loop {
            if let Some(ep) = self.next_request(Duration::from_secs(3600))? {
                return Ok(ep);
            }
        }
    }

    /// [`Self::get_request`], waiting at most `timeout`.
    pub fn get_request_timeout(&self, timeout: Duration) -> Result<Ep> {
        self.next_request(timeout)?.ok_or(Error::TimedOut("no connection request"))
    }

    fn next_request(&self, timeout: Duration) -> Result<Option<Ep>> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let Some(ev) = self.chan.get_event_timeout(left) else { return Ok(None) };
            if ev.kind != CmEventKind::ConnectRequest {
                // A listener's channel carries only requests; anything else is stale.
                continue;
            }
            let chan = EventChannel::new()?;
            ev.id.migrate(&chan);
            let mut ep =
                Ep { id: ev.id.clone(), chan, template: None, res: None, peer: Some(ev.param.clone()) };
            if let Some((pd, q)) = &self.template {
                if let Err(e) = ep.make_qp(pd.as_ref(), q) {
                    // Tell the peer at once rather than leaving it to time out.
                    let _ = ep.id.reject(&[]);
                    return Err(e);
                }
            }
            return Ok(Some(ep));
        }
    }

    /// Connects (`rdma_connect` on a synchronous ID) and returns once ESTABLISHED; a
    /// REJECTED or UNREACHABLE becomes [`Error::CmFailed`].
    pub fn connect(&mut self, param: &ConnParam) -> Result<()> {
        self.id.connect(param)?;
        let ev = self.chan.get_event();
        match ev.kind {
            CmEventKind::Established => {
                self.peer = Some(ev.param.clone());
                Ok(())
            }
            CmEventKind::ConnectResponse => {
                self.peer = Some(ev.param.clone());
                self.id.establish()
            }
            other => Err(Error::CmFailed { event: other.name(), status: ev.status }),
        }
    }

    /// Accepts the request (`rdma_accept` on a synchronous ID) and returns once
    /// ESTABLISHED (RC) or at once (UD).
    pub fn accept(&mut self, param: &ConnParam) -> Result<()> {
        self.id.accept(param)?;
        if self.id.qp_type() == QpType::Ud {
            return Ok(());
        }
        let ev = self.chan.get_event();
        match ev.kind {
            CmEventKind::Established => Ok(()),
            other => Err(Error::CmFailed { event: other.name(), status: ev.status }),
        }
    }

    /// Refuses the request with private data (`rdma_reject`).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.id.reject(private_data)
    }

    /// Disconnects (`rdma_disconnect`): the QP's outstanding requests flush with errors.
    pub fn disconnect(&self) -> Result<()> {
        self.id.disconnect()
    }

    /// Whether the peer has disconnected (a DISCONNECTED event waits); does not block.
    pub fn peer_disconnected(&self) -> bool {
        std::iter::from_fn(|| self.chan.try_get_event()).any(|e| e.kind == CmEventKind::Disconnected)
    }

    fn res(&self) -> Result<&Resources> {
        self.res.as_ref().ok_or(Error::CmState("the endpoint has no QP"))
    }

    fn register(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        self.res()?.pd.register(len, access)
    }

    /// A buffer for messages sent and received (`rdma_reg_msgs`).
    pub fn reg_msgs(&self, len: usize) -> Result<MemoryRegion> {
        self.register(len, Access::LOCAL_WRITE)
    }

    /// A buffer the peer may RDMA READ (`rdma_reg_read`).
    pub fn reg_read(&self, len: usize) -> Result<MemoryRegion> {
        self.register(len, Access::LOCAL_WRITE | Access::REMOTE_READ)
    }

    /// A buffer the peer may RDMA WRITE (`rdma_reg_write`).
    pub fn reg_write(&self, len: usize) -> Result<MemoryRegion> {
        self.register(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
    }

    /// Posts a receive into `mr[offset..offset + len]` (`rdma_post_recv`).
    pub fn post_recv(&self, wr_id: u64, mr: &MemoryRegion, offset: usize, len: usize) -> Result<()> {
        self.res()?.qp.post_recv(RecvWr { wr_id, sg_list: softrdma_proto::sgl![mr.sge(offset, len)?] })
    }

    fn post(
        &self,
        wr_id: u64,
        op: SendOp,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        flags: SendFlags,
    ) -> Result<()> {
        let sg_list =
            if len == 0 { crate::SgList::new() } else { softrdma_proto::sgl![mr.sge(offset, len)?] };
        self.res()?.qp.post_send(SendWr { wr_id, op, sg_list, flags, ud: None })
    }

    /// Sends `mr[offset..offset + len]` (`rdma_post_send`).
    pub fn post_send(
        &self,
        wr_id: u64,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        flags: SendFlags,
    ) -> Result<()> {
        self.post(wr_id, SendOp::Send, mr, offset, len, flags)
    }

    /// Writes `mr[offset..offset + len]` to the start of the peer's `remote`
    /// (`rdma_post_write`).
    pub fn post_write(
        &self,
        wr_id: u64,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        flags: SendFlags,
        remote: &RemoteRegion,
    ) -> Result<()> {
        let op = SendOp::Write { remote_addr: remote.addr, rkey: crate::Rkey(remote.rkey) };
        self.post(wr_id, op, mr, offset, len, flags)
    }

    /// Reads the start of the peer's `remote` into `mr[offset..offset + len]`
    /// (`rdma_post_read`).
    pub fn post_read(
        &self,
        wr_id: u64,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        flags: SendFlags,
        remote: &RemoteRegion,
    ) -> Result<()> {
        let op = SendOp::Read { remote_addr: remote.addr, rkey: crate::Rkey(remote.rkey) };
        self.post(wr_id, op, mr, offset, len, flags)
    }

    /// The next send completion (`rdma_get_send_comp`), waiting as long as it takes: a
    /// disconnect flushes outstanding requests, so a posted request always completes.
    pub fn get_send_comp(&self) -> Result<WorkCompletion> {
        Ok(wait(&self.res()?.send_cq))
    }

    /// The next receive completion (`rdma_get_recv_comp`), waiting as long as it takes.
    pub fn get_recv_comp(&self) -> Result<WorkCompletion> {
        Ok(wait(&self.res()?.recv_cq))
    }

    /// [`Self::get_send_comp`], waiting at most `timeout`.
    pub fn get_send_comp_timeout(&self, timeout: Duration) -> Result<WorkCompletion> {
        self.res()?.send_cq.wait_one_timeout(timeout).ok_or(Error::TimedOut("no send completion"))
    }

    /// [`Self::get_recv_comp`], waiting at most `timeout`.
    pub fn get_recv_comp_timeout(&self, timeout: Duration) -> Result<WorkCompletion> {
        self.res()?.recv_cq.wait_one_timeout(timeout).ok_or(Error::TimedOut("no receive completion"))
    }
}

/// The CQ's next completion, polling without spinning the CPU once the first
/// microseconds are spent (as rdma_cm's notify loop sleeps).
fn wait(cq: &CompletionQueue) -> WorkCompletion {
    loop {
        if let Some(wc) = cq.wait_one_timeout(Duration::from_secs(1)) {
            return wc;
        }
    }
}
