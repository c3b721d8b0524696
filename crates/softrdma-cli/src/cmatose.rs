//! `softrdma cmatose`: rdmacm-utils' ucmatose, the multi-connection rdma_cm test, with its
//! options, flow and output, so that it runs against the real `ucmatose` in either role.
//!
//! The client opens `-c` connections to the server; each side posts `-C` receives of `-S`
//! bytes per connection before connecting. The server then SENDs `-C` messages on every
//! connection, the client receives them all and SENDs as many back, and the server
//! disconnects every connection.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use softrdma::cm::{CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use softrdma::{
    Access, CompletionQueue, MemoryRegion, ProtectionDomain, QpBuilder, QpCaps, QueuePair, RecvWr, SendFlags,
    SendOp, SendWr, WcStatus,
};

/// Arguments of `softrdma cmatose`.
#[derive(Debug, clap::Args)]
pub struct CmatoseArgs {
    /// The server's address: run as the client (without it, run as the server).
    #[arg(short = 's')]
    pub server: Option<IpAddr>,
    /// Local address to bind (the server's listening address; the client's source).
    #[arg(short = 'b')]
    pub bind: Option<IpAddr>,
    /// Connections.
    #[arg(short = 'c', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub connections: u32,
    /// Messages each way per connection.
    #[arg(short = 'C', default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=4096))]
    pub count: u32,
    /// Message size in bytes.
    #[arg(short = 'S', default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=(1 << 20)))]
    pub size: u32,
    /// rdma_cm port.
    #[arg(short = 'p', default_value_t = 7471)]
    pub port: u16,
}

/// What the CM tools (rping, cmatose, udaddy, connrate) fail with.
pub(crate) type Fail = Box<dyn std::error::Error>;

/// How long the CM tools wait for any one event or completion.
pub(crate) const STEP: Duration = Duration::from_secs(30);

pub fn run(a: &CmatoseArgs) -> i32 {
    let r = match a.server {
        Some(s) => client(a, s),
        None => server(a),
    };
    report("cmatose", r)
}

/// rdmacm-utils' test ending: the error if any, `test complete`, `return status N`.
pub(crate) fn report(tool: &str, r: Result<(), Fail>) -> i32 {
    let code = match r {
        Ok(()) => 0,
        Err(e) => {
            println!("{tool}: {e}");
            1
        }
    };
    println!("test complete");
    println!("return status {code}");
    code
}

/// One connection's resources.
struct Node {
    id: CmId,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    mr: MemoryRegion,
    qp: Arc<QueuePair>,
    _pd: ProtectionDomain,
}

impl Node {
    /// cmatose's init_node and post_recvs: CQs of `count` entries, an RC QP signalling
    /// every send, `count` receives.
    fn new(id: &CmId, a: &CmatoseArgs) -> Result<Node, Fail> {
        let ctx = id.context().ok_or("the CM ID has no device")?;
        let pd = ctx.alloc_pd();
        let cqe = a.count.max(1) as usize;
        let send_cq = ctx.create_cq(cqe, None)?;
        let recv_cq = ctx.create_cq(cqe, None)?;
        let mr = pd.register(a.size as usize, Access::LOCAL_WRITE)?;
        let caps = QpCaps {
            max_send_wr: cqe as u32,
            max_recv_wr: cqe as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            ..QpCaps::default()
        };
        let qp = id.create_qp(&pd, &QpBuilder::rc().caps(caps).sq_sig_all(true), &send_cq, &recv_cq)?;
        for _ in 0..a.count {
            qp.post_recv(RecvWr { wr_id: 0, sg_list: softrdma::sgl![mr.sge(0, a.size as usize)?] })?;
        }
        Ok(Node { id: id.clone(), send_cq, recv_cq, mr, qp, _pd: pd })
    }

    fn post_sends(&self, a: &CmatoseArgs) -> Result<(), Fail> {
        for _ in 0..a.count {
            let sg = softrdma::sgl![self.mr.sge(0, a.size as usize)?];
            let wr =
                SendWr { wr_id: 0, op: SendOp::Send, sg_list: sg, flags: SendFlags::default(), ud: None };
            self.qp.post_send(wr)?;
        }
        Ok(())
    }
}

/// Waits for `count` completions on one CQ of every node.
fn poll_cqs(nodes: &[Node], count: u32, recv: bool) -> Result<(), Fail> {
    for n in nodes {
        let cq = if recv { &n.recv_cq } else { &n.send_cq };
        for _ in 0..count {
            let wc = cq.wait_one_timeout(STEP).ok_or("no completion within 30 s")?;
            if wc.status != WcStatus::Success {
                return Err(format!("completion failed: {:?}", wc.status).into());
            }
        }
    }
    Ok(())
}

fn conn_param() -> ConnParam {
    ConnParam { responder_resources: 1, initiator_depth: 1, retry_count: 5, ..Default::default() }
}

/// Handles events until every connection is established; a failed one fails the test.
fn connect_events(ch: &EventChannel, a: &CmatoseArgs, nodes: &mut Vec<Node>) -> Result<(), Fail> {
    let mut left = a.connections;
    while left > 0 {
        let ev = ch.get_event_timeout(STEP).ok_or("no CM event within 30 s")?;
        match ev.kind {
            CmEventKind::AddrResolved => ev.id.resolve_route(Duration::from_secs(2))?,
            CmEventKind::RouteResolved => {
                let node = Node::new(&ev.id, a)?;
                ev.id.connect(&conn_param())?;
                nodes.push(node);
            }
            CmEventKind::ConnectRequest => {
                if nodes.len() as u32 == a.connections {
                    println!("cmatose: failing connection request");
                    ev.id.reject(&[])?;
                    continue;
                }
                let node = Node::new(&ev.id, a)?;
                ev.id.accept(&ConnParam::default())?;
                nodes.push(node);
            }
            CmEventKind::Established => left -= 1,
            k @ (CmEventKind::AddrError
            | CmEventKind::RouteError
            | CmEventKind::ConnectError
            | CmEventKind::Unreachable
            | CmEventKind::Rejected) => {
                return Err(format!("event: {k}, error: {}", ev.status).into());
            }
            _ => {}
        }
    }
    Ok(())
}

/// Handles events until every connection is disconnected (answering the peer's DREQs).
fn disconnect_events(ch: &EventChannel, mut left: usize) -> Result<(), Fail> {
    while left > 0 {
        let ev = ch.get_event_timeout(STEP).ok_or("no DISCONNECTED within 30 s")?;
        if ev.kind == CmEventKind::Disconnected {
            ev.id.disconnect()?;
            left -= 1;
        }
    }
    Ok(())
}

fn server(a: &CmatoseArgs) -> Result<(), Fail> {
    println!("cmatose: starting server");
    let ch = EventChannel::new()?;
    let listener = CmId::new(&ch, PortSpace::Tcp);
    let addr = a.bind.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    listener.bind_addr(SocketAddr::new(addr, a.port))?;
    listener.listen(a.connections as usize)?;
    let mut nodes = Vec::new();
    connect_events(&ch, a, &mut nodes)?;
    if a.count > 0 {
        println!("initiating data transfers");
        for n in &nodes {
            n.post_sends(a)?;
        }
        println!("completing sends");
        poll_cqs(&nodes, a.count, false)?;
        println!("receiving data transfers");
        poll_cqs(&nodes, a.count, true)?;
        println!("data transfers complete");
    }
    println!("cmatose: disconnecting");
    for n in &nodes {
        n.id.disconnect()?;
    }
    disconnect_events(&ch, nodes.len())?;
    println!("disconnected");
    Ok(())
}

fn client(a: &CmatoseArgs, dst: IpAddr) -> Result<(), Fail> {
    println!("cmatose: starting client");
    let ch = EventChannel::new()?;
    println!("cmatose: connecting");
    let ids: Vec<CmId> = (0..a.connections).map(|_| CmId::new(&ch, PortSpace::Tcp)).collect();
    for id in &ids {
        id.resolve_addr(a.bind, SocketAddr::new(dst, a.port), Duration::from_secs(2))?;
    }
    let mut nodes = Vec::new();
    connect_events(&ch, a, &mut nodes)?;
    if a.count > 0 {
        println!("receiving data transfers");
        poll_cqs(&nodes, a.count, true)?;
        println!("sending replies");
        for n in &nodes {
            n.post_sends(a)?;
        }
        println!("data transfers complete");
    }
    disconnect_events(&ch, nodes.len())?;
    Ok(())
}
