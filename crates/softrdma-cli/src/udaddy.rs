//! `softrdma udaddy`: rdmacm-utils' udaddy, the UD rdma_cm test, with its options, flow and
//! output, so that it runs against the real `udaddy` in either role.
//!
//! The client resolves the server's UD QP per connection with SIDR (rdma_cm port space
//! UDP), SENDs `-C` messages with its QP number as immediate data, and waits for as many
//! replies; the server answers each connection to the address and QP the first message
//! came from.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use softrdma::cm::{CmEventKind, CmId, ConnParam, EventChannel, PortSpace, UDP_QKEY};
use softrdma::{
    Access, CompletionQueue, MemoryRegion, ProtectionDomain, QpBuilder, QpCaps, QueuePair, RecvWr, SendFlags,
    SendOp, SendWr, UdDest, WcOpcode, WcStatus,
};

/// Arguments of `softrdma udaddy`.
#[derive(Debug, clap::Args)]
pub struct UdaddyArgs {
    /// The server's address: run as the client (without it, run as the server).
    #[arg(short = 's')]
    pub server: Option<IpAddr>,
    /// Local address to bind (the server's listening address; the client's source).
    #[arg(short = 'b')]
    pub bind: Option<IpAddr>,
    /// Connections (UD endpoints).
    #[arg(short = 'c', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub connections: u32,
    /// Messages each way per connection.
    #[arg(short = 'C', default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=4096))]
    pub count: u32,
    /// Message size in bytes (at most the path MTU).
    #[arg(short = 'S', default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub size: u32,
    /// rdma_cm port.
    #[arg(short = 'p', default_value_t = 7174)]
    pub port: u16,
}

use crate::cmatose::{report, Fail, STEP};

/// The GRH in front of every UD receive.
const GRH: usize = 40;

pub fn run(a: &UdaddyArgs) -> i32 {
    let r = match a.server {
        Some(s) => client(a, s),
        None => server(a),
    };
    report("udaddy", r)
}

struct Node {
    _id: CmId,
    cq: CompletionQueue,
    mr: MemoryRegion,
    qp: Arc<QueuePair>,
    dest: Option<UdDest>,
    _pd: ProtectionDomain,
}

impl Node {
    fn new(id: &CmId, a: &UdaddyArgs) -> Result<Node, Fail> {
        let ctx = id.context().ok_or("the CM ID has no device")?;
        let mtu = ctx.query_port().active_mtu.bytes();
        if a.count > 0 && a.size > mtu {
            return Err(format!("message_size {} is larger than active mtu {mtu}", a.size).into());
        }
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(2 * a.count.max(1) as usize, None)?;
        let mr = pd.register(a.size as usize + GRH, Access::LOCAL_WRITE)?;
        let wr = a.count.max(1);
        let caps = QpCaps {
            max_send_wr: wr,
            max_recv_wr: wr,
            max_send_sge: 1,
            max_recv_sge: 1,
            ..QpCaps::default()
        };
        let qp = id.create_qp(&pd, &QpBuilder::ud(UDP_QKEY).caps(caps), &cq, &cq)?;
        for _ in 0..a.count {
            qp.post_recv(RecvWr { wr_id: 0, sg_list: softrdma::sgl![mr.sge(0, a.size as usize + GRH)?] })?;
        }
        Ok(Node { _id: id.clone(), cq, mr, qp, dest: None, _pd: pd })
    }

    fn post_sends(&self, a: &UdaddyArgs, signaled: bool) -> Result<(), Fail> {
        let dest = self.dest.ok_or("no peer to send to")?;
        for _ in 0..a.count {
            let wr = SendWr {
                wr_id: 0,
                op: SendOp::SendWithImm(self.qp.qpn().get()),
                sg_list: softrdma::sgl![self.mr.sge(0, a.size as usize)?],
                flags: SendFlags { signaled, ..Default::default() },
                ud: Some(dest),
            };
            self.qp.post_send(wr)?;
        }
        Ok(())
    }
}

/// Waits for `count` completions on every node; the first receive of a node without a
/// peer names the peer (its address, and its QP in the immediate data).
fn poll_cqs(nodes: &mut [Node], count: u32, port: u16) -> Result<(), Fail> {
    for n in nodes {
        for _ in 0..count {
            let wc = n.cq.wait_one_timeout(STEP).ok_or("no completion within 30 s")?;
            if wc.status != WcStatus::Success {
                return Err(format!("completion failed: {:?}", wc.status).into());
            }
            if n.dest.is_none() && wc.opcode == WcOpcode::Recv {
                let (Some(src), Some(imm)) = (wc.src, wc.imm_data) else {
                    return Err("a message without its sender's QP".into());
                };
                let qpn = softrdma::Qpn::try_new(imm).ok_or("a sender QP number above 24 bits")?;
                let addr = SocketAddr::new(src.ip(), port);
                n.dest = Some(UdDest { addr, qpn, qkey: UDP_QKEY, traffic_class: 0 });
            }
        }
    }
    Ok(())
}

fn server(a: &UdaddyArgs) -> Result<(), Fail> {
    println!("udaddy: starting server");
    let ch = EventChannel::new()?;
    let listener = CmId::new(&ch, PortSpace::Udp);
    let addr = a.bind.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    listener.bind_addr(SocketAddr::new(addr, a.port))?;
    listener.listen(a.connections as usize)?;
    let mut nodes = Vec::new();
    while nodes.len() < a.connections as usize {
        let ev = ch.get_event_timeout(STEP).ok_or("no CM event within 30 s")?;
        if ev.kind != CmEventKind::ConnectRequest {
            continue;
        }
        let node = Node::new(&ev.id, a)?;
        ev.id.accept(&ConnParam { qp_num: node.qp.qpn().get(), ..ConnParam::default() })?;
        nodes.push(node);
    }
    if a.count > 0 {
        let port = listener.context().map_or(4791, |c| c.local_addr().port());
        println!("receiving data transfers");
        poll_cqs(&mut nodes, a.count, port)?;
        println!("sending replies");
        for n in &nodes {
            n.post_sends(a, true)?;
        }
        poll_cqs(&mut nodes, a.count, port)?;
        println!("data transfers complete");
    }
    Ok(())
}

fn client(a: &UdaddyArgs, dst: IpAddr) -> Result<(), Fail> {
    println!("udaddy: starting client");
    let ch = EventChannel::new()?;
    println!("udaddy: connecting");
    let ids: Vec<CmId> = (0..a.connections).map(|_| CmId::new(&ch, PortSpace::Udp)).collect();
    for id in &ids {
        id.resolve_addr(a.bind, SocketAddr::new(dst, a.port), Duration::from_secs(2))?;
    }
    let mut nodes: Vec<(CmId, Node)> = Vec::new();
    let mut left = a.connections;
    while left > 0 {
        let ev = ch.get_event_timeout(STEP).ok_or("no CM event within 30 s")?;
        match ev.kind {
            CmEventKind::AddrResolved => ev.id.resolve_route(Duration::from_secs(2))?,
            CmEventKind::RouteResolved => {
                let node = Node::new(&ev.id, a)?;
                ev.id.connect(&ConnParam::default())?;
                nodes.push((ev.id.clone(), node));
            }
            CmEventKind::Established => {
                let ud = ev.ud.ok_or("ESTABLISHED without the server's QP")?;
                let node = nodes.iter_mut().find(|(id, _)| id.same(&ev.id)).ok_or("an unknown ID")?;
                node.1.dest = Some(UdDest { addr: ud.addr, qpn: ud.qpn, qkey: ud.qkey, traffic_class: 0 });
                left -= 1;
            }
            k => return Err(format!("event: {k}, error: {}", ev.status).into()),
        }
    }
    let mut nodes: Vec<Node> = nodes.into_iter().map(|(_, n)| n).collect();
    if a.count > 0 {
        println!("initiating data transfers");
        for n in &nodes {
            n.post_sends(a, false)?;
        }
        println!("receiving data transfers");
        poll_cqs(&mut nodes, a.count, 0)?;
        println!("data transfers complete");
    }
    Ok(())
}
