//! perftest's rdma_cm mode (`-R`): the exchange runs over an RC connection the connection
//! manager sets up, and the benchmark's QPs are connected by the CM too.
//!
//! As perftest 4.5 does it:
//! - The control connection: the server listens on the rdma_cm port (`-p`, TCP port
//!   space), accepts one request and closes its listener; the client resolves, connects
//!   and waits for ESTABLISHED. Each message of the exchange is one SEND of exactly its
//!   bytes, into a 56-byte receive re-posted after each message; the QP messages are
//!   perftest's `struct pingpong_dest` in network order (56 bytes), not the text of the
//!   TCP exchange, and the goodbye has no `done`.
//! - The benchmark's connections: after one swap as a barrier, the server listens again on
//!   the same port and accepts `-q` requests; the client connects each QP, retrying while
//!   the server is not listening yet (10 tries, 100 ms apart); another swap follows. The CM
//!   carries the PSNs, MTU and, for READ and atomics, the responder resources, and moves
//!   the QPs to RTS.
//! - At the end the client disconnects the benchmark's connections.
//!
//! Only RC: perftest runs UD over rdma_cm through SIDR with a QP-number message of its own,
//! which `softrdma perf -R` does not speak.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softrdma::cm::{CmEvent, CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use softrdma::{
    Access, CompletionQueue, Context, EndpointInfo, MemoryRegion, ProtectionDomain, QpBuilder, QpCaps,
    QueuePair, RecvWr, RemoteRegion, SendFlags, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

use super::args::{PerfArgs, Test};
use super::Fail;

/// `sizeof(struct pingpong_dest)`: the receive size of perftest's control QP and the size
/// of its QP message.
pub(super) const DEST_LEN: usize = 56;
/// Where the control QP's outgoing message is staged, after the receive buffer.
const SEND_AT: usize = 64;
/// How long one CM step (resolution, a connection) may take.
const STEP: Duration = Duration::from_secs(15);
/// perftest's retries of a benchmark connection, and the pause between them.
const DATA_TRIES: u32 = 10;
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The address the benchmark runs on: `-d`'s device, or 127.0.0.1.
fn device_addr(args: &PerfArgs) -> Result<IpAddr, Fail> {
    if args.gid_index.is_some() {
        return Err("-x cannot be combined with -R: the connection manager uses the address's GID".into());
    }
    match &args.device {
        Some(d) => softrdma::find_device(d).map(|d| d.addr).map_err(|e| e.to_string()),
        None => Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)),
    }
}

/// The server's rdma_cm address: the host and `-p`.
fn server_addr(host: &str, port: u16) -> Result<SocketAddr, Fail> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("{host}: {e}"))?
        .find(SocketAddr::is_ipv4)
        .ok_or_else(|| format!("{host} has no IPv4 address"))
}

/// The next event of `ch` within `wait`.
fn next_event(ch: &EventChannel, wait: Duration, what: &str) -> Result<CmEvent, Fail> {
    ch.get_event_timeout(wait).ok_or_else(|| format!("no {what} within {} s", wait.as_secs()))
}

/// Resolves `id` towards `dst` from `src` (ADDR_RESOLVED, then ROUTE_RESOLVED).
fn resolve(ch: &EventChannel, id: &CmId, src: Option<IpAddr>, dst: SocketAddr) -> Result<(), Fail> {
    id.resolve_addr(src, dst, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    let ev = next_event(ch, STEP, "ADDR_RESOLVED")?;
    if ev.kind != CmEventKind::AddrResolved {
        return Err(format!("{} (status {}) resolving {dst}", ev.kind, ev.status));
    }
    id.resolve_route(Duration::from_secs(2)).map_err(|e| e.to_string())?;
    let ev = next_event(ch, STEP, "ROUTE_RESOLVED")?;
    if ev.kind != CmEventKind::RouteResolved {
        return Err(format!("{} (status {}) resolving the route to {dst}", ev.kind, ev.status));
    }
    Ok(())
}

/// perftest's connection parameters: responder resources and initiator depth for READ
/// and atomics, retry counts 7.
fn conn_param(args: &PerfArgs) -> ConnParam {
    let reads = if args.test.is_send() || matches!(args.test, Test::WriteBw | Test::WriteLat) {
        0
    } else {
        softrdma::MAX_QP_RD_ATOM
    };
    ConnParam {
        responder_resources: reads,
        initiator_depth: reads,
        retry_count: 7,
        rnr_retry_count: 7,
        ..ConnParam::default()
    }
}

/// The control connection: perftest's exchange over SEND and RECV.
pub(super) struct Control {
    ch: EventChannel,
    id: CmId,
    qp: Arc<QueuePair>,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    /// The receive buffer, then the outgoing message at [`SEND_AT`].
    mr: MemoryRegion,
    /// A receive completion taken while looking for a waiting message.
    pending: Option<WorkCompletion>,
    _pd: ProtectionDomain,
}

impl Control {
    /// Connects the control QP: the client to `host`, the server by accepting the first
    /// request on `-p`.
    pub(super) fn connect(args: &PerfArgs) -> Result<Control, Fail> {
        let local = device_addr(args)?;
        match &args.host {
            Some(host) => {
                let dst = server_addr(host, args.port)?;
                let src = args.device.as_ref().map(|_| local);
                // perftest's server may not listen yet: try for as long as the TCP exchange does.
                let deadline = Instant::now() + STEP;
                loop {
                    match Control::try_connect(args, src, dst) {
                        Ok(c) => return Ok(c),
                        Err(e) if Instant::now() > deadline => return Err(format!("rdma_cm {dst}: {e}")),
                        Err(_) => std::thread::sleep(RETRY_PAUSE),
                    }
                }
            }
            None => {
                let ch = EventChannel::new().map_err(|e| e.to_string())?;
                let listener = CmId::new(&ch, PortSpace::Tcp);
                let at = SocketAddr::new(local, args.port);
                listener.bind_addr(at).map_err(|e| format!("rdma_cm port {at}: {e}"))?;
                listener.listen(1).map_err(|e| e.to_string())?;
                // As perftest's server: wait for a client as long as it takes.
                let ev = loop {
                    if let Some(ev) = ch.get_event_timeout(Duration::from_secs(3600)) {
                        break ev;
                    }
                };
                if ev.kind != CmEventKind::ConnectRequest {
                    return Err(format!("{} while waiting for a connection request", ev.kind));
                }
                let c = Control::new(ch, ev.id)?;
                c.id.accept(&conn_param(args)).map_err(|e| e.to_string())?;
                // The benchmark's listener takes the port next.
                listener.destroy();
                Ok(c)
            }
        }
    }

    fn try_connect(args: &PerfArgs, src: Option<IpAddr>, dst: SocketAddr) -> Result<Control, Fail> {
        let ch = EventChannel::new().map_err(|e| e.to_string())?;
        let id = CmId::new(&ch, PortSpace::Tcp);
        resolve(&ch, &id, src, dst)?;
        let c = Control::new(ch, id)?;
        c.id.connect(&conn_param(args)).map_err(|e| e.to_string())?;
        let ev = next_event(&c.ch, STEP, "ESTABLISHED")?;
        if ev.kind != CmEventKind::Established {
            c.id.destroy();
            return Err(format!("{} (status {})", ev.kind, ev.status));
        }
        Ok(c)
    }

    /// The control QP on `id`'s device, with its receive posted.
    fn new(ch: EventChannel, id: CmId) -> Result<Control, Fail> {
        let ctx = id.context().ok_or("the CM ID has no device")?;
        let pd = ctx.alloc_pd();
        let send_cq = ctx.create_cq(4, None).map_err(|e| e.to_string())?;
        let recv_cq = ctx.create_cq(4, None).map_err(|e| e.to_string())?;
        let mr = pd.register(2 * SEND_AT, Access::LOCAL_WRITE).map_err(|e| e.to_string())?;
        let caps = QpCaps { max_send_wr: 2, max_recv_wr: 2, ..QpCaps::default() };
        let qp =
            id.create_qp(&pd, &QpBuilder::rc().caps(caps), &send_cq, &recv_cq).map_err(|e| e.to_string())?;
        let c = Control { ch, id, qp, send_cq, recv_cq, mr, pending: None, _pd: pd };
        c.post_recv()?;
        Ok(c)
    }

    /// The device the connection manager opened for the control connection, which the
    /// benchmark's QPs share.
    pub(super) fn context(&self) -> Result<Context, Fail> {
        self.id.context().ok_or_else(|| "the CM ID has no device".into())
    }

    fn post_recv(&self) -> Result<(), Fail> {
        let sge = self.mr.sge(0, DEST_LEN).map_err(|e| e.to_string())?;
        self.qp.post_recv(RecvWr { wr_id: 1, sg_list: vec![sge] }).map_err(|e| e.to_string())
    }

    fn send(&self, msg: &[u8]) -> Result<(), Fail> {
        if msg.len() > DEST_LEN {
            return Err(format!("exchange message of {} bytes (at most {DEST_LEN})", msg.len()));
        }
        self.mr.write(SEND_AT, msg).map_err(|e| e.to_string())?;
        let wr = SendWr {
            wr_id: 2,
            op: SendOp::Send,
            sg_list: vec![self.mr.sge(SEND_AT, msg.len()).map_err(|e| e.to_string())?],
            flags: SendFlags { signaled: true, ..Default::default() },
            ud: None,
        };
        self.qp.post_send(wr).map_err(|e| e.to_string())?;
        let wc = self.send_cq.wait_one_timeout(STEP).ok_or("exchange: no send completion within 15 s")?;
        if wc.status != WcStatus::Success {
            return Err(format!("exchange: SEND failed: {:?}", wc.status));
        }
        Ok(())
    }

    /// Whether the peer's next message has arrived (kept for [`Self::recv`]).
    pub(super) fn message_waiting(&mut self) -> bool {
        if self.pending.is_none() {
            self.pending = self.recv_cq.poll_one();
        }
        self.pending.is_some()
    }

    /// The peer's next message, which must be `len` bytes. Waits while the connection
    /// stands: the peer may be running a long benchmark; it fails when the peer
    /// disconnects or the connection breaks.
    fn recv(&mut self, len: usize) -> Result<Vec<u8>, Fail> {
        let wc = loop {
            if let Some(wc) =
                self.pending.take().or_else(|| self.recv_cq.wait_one_timeout(Duration::from_millis(100)))
            {
                break wc;
            }
            if let Some(ev) = self.ch.try_get_event() {
                if matches!(ev.kind, CmEventKind::Disconnected | CmEventKind::DeviceRemoval) {
                    return Err("exchange: the peer disconnected".into());
                }
            }
        };
        if wc.status != WcStatus::Success || wc.opcode != WcOpcode::Recv {
            return Err(format!("exchange: receive failed: {:?}", wc.status));
        }
        if wc.byte_len as usize != len {
            return Err(format!("exchange: the peer sent {} bytes where {len} were due", wc.byte_len));
        }
        let mut got = vec![0u8; len];
        self.mr.read(0, &mut got).map_err(|e| e.to_string())?;
        self.post_recv()?;
        Ok(got)
    }

    /// Sends `msg` and receives the peer's message of the same length (the client speaks
    /// first).
    pub(super) fn swap(&mut self, client: bool, msg: &[u8]) -> Result<Vec<u8>, Fail> {
        if client {
            self.send(msg)?;
            self.recv(msg.len())
        } else {
            let got = self.recv(msg.len())?;
            self.send(msg)?;
            Ok(got)
        }
    }
}

/// The benchmark's connections: their IDs, kept until the end.
pub(super) struct DataConns {
    ch: EventChannel,
    ids: Vec<CmId>,
}

impl DataConns {
    /// Connects `n` QPs, each made by `make` on its ID: the client to the server's address,
    /// the server by accepting `n` requests on `-p`.
    pub(super) fn connect(
        args: &PerfArgs,
        n: usize,
        mut make: impl FnMut(&CmId) -> Result<Arc<QueuePair>, Fail>,
    ) -> Result<(DataConns, Vec<Arc<QueuePair>>), Fail> {
        let local = device_addr(args)?;
        let ch = EventChannel::new().map_err(|e| e.to_string())?;
        let param = conn_param(args);
        let mut ids = Vec::with_capacity(n);
        let mut qps = Vec::with_capacity(n);
        match &args.host {
            Some(host) => {
                let dst = server_addr(host, args.port)?;
                let src = args.device.as_ref().map(|_| local);
                for _ in 0..n {
                    let mut tries = 0;
                    let (id, qp) = loop {
                        tries += 1;
                        match connect_one(&ch, src, dst, &param, &mut make) {
                            Ok(c) => break c,
                            Err(e) if tries >= DATA_TRIES => {
                                return Err(format!("rdma_cm: connecting a QP to {dst}, {tries} tries: {e}"))
                            }
                            Err(_) => std::thread::sleep(RETRY_PAUSE),
                        }
                    };
                    ids.push(id);
                    qps.push(qp);
                }
            }
            None => {
                let listener = CmId::new(&ch, PortSpace::Tcp);
                let at = SocketAddr::new(local, args.port);
                listener.bind_addr(at).map_err(|e| format!("rdma_cm port {at}: {e}"))?;
                listener.listen(n).map_err(|e| e.to_string())?;
                let mut established = 0;
                while established < n {
                    let ev = next_event(&ch, STEP, "connection of the benchmark's QPs")?;
                    match ev.kind {
                        CmEventKind::ConnectRequest if ids.len() < n => {
                            let qp = make(&ev.id)?;
                            ev.id.accept(&param).map_err(|e| e.to_string())?;
                            ids.push(ev.id);
                            qps.push(qp);
                        }
                        CmEventKind::ConnectRequest => ev.id.reject(&[]).map_err(|e| e.to_string())?,
                        CmEventKind::Established => established += 1,
                        k => {
                            return Err(format!(
                                "{k} (status {}) while accepting the benchmark's QPs",
                                ev.status
                            ))
                        }
                    }
                }
                listener.destroy();
            }
        }
        Ok((DataConns { ch, ids }, qps))
    }

    /// Disconnects every connection and waits (boundedly) for their DISCONNECTED events.
    pub(super) fn disconnect(self) {
        let mut left = 0;
        for id in &self.ids {
            if id.disconnect().is_ok() {
                left += 1;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while left > 0 {
            match self.ch.get_event_timeout(deadline.saturating_duration_since(Instant::now())) {
                Some(ev) if ev.kind == CmEventKind::Disconnected => left -= 1,
                Some(_) => {}
                None => break,
            }
        }
    }
}

/// One benchmark connection of the client.
fn connect_one(
    ch: &EventChannel,
    src: Option<IpAddr>,
    dst: SocketAddr,
    param: &ConnParam,
    make: &mut impl FnMut(&CmId) -> Result<Arc<QueuePair>, Fail>,
) -> Result<(CmId, Arc<QueuePair>), Fail> {
    let id = CmId::new(ch, PortSpace::Tcp);
    resolve(ch, &id, src, dst)?;
    let qp = make(&id)?;
    id.connect(param).map_err(|e| e.to_string())?;
    let ev = next_event(ch, STEP, "ESTABLISHED")?;
    if ev.kind != CmEventKind::Established {
        id.destroy();
        return Err(format!("{} (status {})", ev.kind, ev.status));
    }
    Ok((id, qp))
}

/// perftest's `struct pingpong_dest` in network order: lid, out_reads, qpn, psn, rkey,
/// (padding), vaddr, gid, srqn, gid_index.
pub(super) fn dest_message(e: &EndpointInfo, gid_index: u32) -> Vec<u8> {
    let r = e.region.unwrap_or(RemoteRegion { addr: 0, len: 0, rkey: 0 });
    let mut m = vec![0u8; DEST_LEN];
    m[4..8].copy_from_slice(&1u32.to_be_bytes());
    m[8..12].copy_from_slice(&e.qpn.to_be_bytes());
    m[12..16].copy_from_slice(&e.psn.to_be_bytes());
    m[16..20].copy_from_slice(&r.rkey.to_be_bytes());
    m[24..32].copy_from_slice(&r.addr.to_be_bytes());
    m[32..48].copy_from_slice(&softrdma::gid_of(e.addr.ip()));
    m[52..56].copy_from_slice(&gid_index.to_be_bytes());
    m
}

/// (address, qpn, psn, rkey, vaddr) of a `struct pingpong_dest` message.
pub(super) fn parse_dest_message(m: &[u8]) -> Result<(IpAddr, u32, u32, u32, u64), Fail> {
    if m.len() != DEST_LEN {
        return Err(format!("QP message of {} bytes, not {DEST_LEN}", m.len()));
    }
    let u32_at = |k: usize| u32::from_be_bytes([m[k], m[k + 1], m[k + 2], m[k + 3]]);
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&m[32..48]);
    let mut vaddr = [0u8; 8];
    vaddr.copy_from_slice(&m[24..32]);
    Ok((softrdma::addr_of_gid(gid), u32_at(8), u32_at(12), u32_at(16), u64::from_be_bytes(vaddr)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dest_message_is_perftests_struct_and_round_trips() {
        let e = EndpointInfo {
            addr: "192.168.77.10:4791".parse().unwrap(),
            qpn: 0x21,
            psn: 0x2c27a5,
            mtu: 1024,
            region: Some(RemoteRegion { addr: 0x562b_6dc6_d000, len: 64, rkey: 0x11e1 }),
        };
        let m = dest_message(&e, 1);
        assert_eq!(m.len(), 56);
        assert_eq!(&m[8..12], &[0, 0, 0, 0x21]);
        assert_eq!(&m[24..32], &[0, 0, 0x56, 0x2b, 0x6d, 0xc6, 0xd0, 0]);
        assert_eq!(&m[42..48], &[0xff, 0xff, 192, 168, 77, 10]);
        assert_eq!(parse_dest_message(&m).unwrap(), (e.addr.ip(), 0x21, 0x2c27a5, 0x11e1, 0x562b_6dc6_d000));
        assert!(parse_dest_message(&m[..55]).is_err());
    }
}
