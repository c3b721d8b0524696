//! The connection manager over real UDP sockets: two devices in one process (distinct
//! loopback addresses, RoCE port 4791), connected through rdma_cm's calls and events.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use softrdma::cm::{CmEvent, CmEventKind, CmId, ConnParam, EventChannel, PortSpace, UDP_QKEY};
use softrdma::{
    Access, CompletionQueue, MemoryRegion, QpBuilder, QpState, QueuePair, RecvWr, SendFlags, SendOp, SendWr,
    UdDest, WcOpcode, WcStatus,
};

const WAIT: Duration = Duration::from_secs(10);

fn ip(last: [u8; 4]) -> IpAddr {
    IpAddr::from(last)
}

fn event(ch: &EventChannel, want: CmEventKind) -> CmEvent {
    let ev = ch.get_event_timeout(WAIT).unwrap_or_else(|| panic!("no event, waiting for {want}"));
    assert_eq!(ev.kind, want, "status {} ", ev.status);
    ev
}

/// A QP's resources: a CQ and a registered buffer.
struct Side {
    cq: CompletionQueue,
    mr: MemoryRegion,
    qp: Arc<QueuePair>,
}

fn setup_qp(id: &CmId, builder: QpBuilder) -> Side {
    let ctx = id.context().expect("the ID has a device");
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let mr = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ).unwrap();
    let qp = id.create_qp(&pd, &builder, &cq, &cq).unwrap();
    Side { cq, mr, qp }
}

fn wait_wc(cq: &CompletionQueue) -> softrdma::WorkCompletion {
    cq.wait_one_timeout(WAIT).expect("a completion")
}

/// Client at `c`, server at `s` on rdma_cm port `port`: the whole handshake, with
/// private data both ways. Returns the channels, IDs and QPs.
fn connect_pair(
    c: IpAddr,
    s: IpAddr,
    port: u16,
) -> (EventChannel, CmId, Side, EventChannel, CmId, Side, CmId) {
    let sch = EventChannel::new().unwrap();
    let listener = CmId::new(&sch, PortSpace::Tcp);
    listener.bind_addr(SocketAddr::new(s, port)).unwrap();
    listener.listen(8).unwrap();

    let cch = EventChannel::new().unwrap();
    let client = CmId::new(&cch, PortSpace::Tcp);
    client.resolve_addr(Some(c), SocketAddr::new(s, port), WAIT).unwrap();
    event(&cch, CmEventKind::AddrResolved);
    client.resolve_route(WAIT).unwrap();
    event(&cch, CmEventKind::RouteResolved);
    let cside = setup_qp(&client, QpBuilder::rc());
    cside.qp.post_recv(RecvWr { wr_id: 7, sg_list: softrdma::sgl![cside.mr.sge(0, 4096).unwrap()] }).unwrap();
    let offer = ConnParam {
        private_data: b"from the client".to_vec(),
        initiator_depth: 4,
        responder_resources: 4,
        ..Default::default()
    };
    client.connect(&offer).unwrap();

    let req = event(&sch, CmEventKind::ConnectRequest);
    assert!(req.listen_id.as_ref().is_some_and(|l| l.same(&listener)));
    // As rdma_cm reports it: the REQ's 92 bytes less its 36-byte header, zero padded.
    assert_eq!(req.param.private_data.len(), 56);
    assert_eq!(&req.param.private_data[..15], b"from the client", "rdma_cm's header is stripped");
    assert_eq!((req.param.initiator_depth, req.param.responder_resources), (4, 4));
    let server = req.id.clone();
    assert_eq!(server.peer_addr().map(|a| a.ip()), Some(c));
    assert_eq!(server.peer_addr().map(|a| a.port()), client.local_addr().map(|a| a.port()));
    assert_eq!(server.local_addr(), Some(SocketAddr::new(s, port)));
    let sside = setup_qp(&server, QpBuilder::rc());
    sside.qp.post_recv(RecvWr { wr_id: 8, sg_list: softrdma::sgl![sside.mr.sge(0, 4096).unwrap()] }).unwrap();
    server.accept(&ConnParam { private_data: b"from the server".to_vec(), ..req.param.clone() }).unwrap();

    let est = event(&cch, CmEventKind::Established);
    assert_eq!(&est.param.private_data[..15], b"from the server");
    event(&sch, CmEventKind::Established);
    (cch, client, cside, sch, server, sside, listener)
}

#[test]
fn connect_send_both_ways_write_read_and_disconnect() {
    let (c, s) = (ip([127, 0, 6, 2]), ip([127, 0, 6, 3]));
    let (cch, client, cside, sch, server, sside, _listener) = connect_pair(c, s, 7471);
    for side in [&cside, &sside] {
        assert_eq!(side.qp.state(), QpState::Rts);
        assert!(!side.qp.foreign_peer(), "both sides announced softrdma's ECE");
    }
    let (attr, _) = cside.qp.query().unwrap();
    let (sattr, _) = sside.qp.query().unwrap();
    assert_eq!(attr.dest_qpn, Some(sside.qp.qpn()));
    assert_eq!(sattr.dest_qpn, Some(cside.qp.qpn()));
    assert_eq!(attr.sq_psn, sattr.rq_psn, "the client's PSN is what the server expects");
    assert_eq!(sattr.sq_psn, attr.rq_psn);
    assert_eq!((attr.max_rd_atomic, sattr.max_dest_rd_atomic), (Some(4), Some(4)));

    // SEND each way.
    cside.mr.write(0, b"ping").unwrap();
    let send = |side: &Side, op| SendWr {
        wr_id: 1,
        op,
        sg_list: softrdma::sgl![side.mr.sge(0, 4).unwrap()],
        flags: SendFlags { signaled: true, ..Default::default() },
        ud: None,
    };
    cside.qp.post_send(send(&cside, SendOp::Send)).unwrap();
    assert_eq!(wait_wc(&cside.cq).status, WcStatus::Success);
    let wc = wait_wc(&sside.cq);
    assert_eq!((wc.status, wc.opcode, wc.byte_len, wc.wr_id), (WcStatus::Success, WcOpcode::Recv, 4, 8));
    let mut got = [0u8; 4];
    sside.mr.read(0, &mut got).unwrap();
    assert_eq!(&got, b"ping");
    sside.mr.write(0, b"pong").unwrap();
    sside.qp.post_send(send(&sside, SendOp::Send)).unwrap();
    assert_eq!(wait_wc(&sside.cq).status, WcStatus::Success);
    assert_eq!(wait_wc(&cside.cq).wr_id, 7);

    // The CM granted remote WRITE and READ: the client writes into the server's buffer
    // and reads it back.
    let remote = sside.mr.remote();
    cside.mr.write(100, b"written").unwrap();
    let mut w =
        send(&cside, SendOp::Write { remote_addr: remote.addr + 200, rkey: softrdma::Rkey(remote.rkey) });
    w.sg_list = softrdma::sgl![cside.mr.sge(100, 7).unwrap()];
    cside.qp.post_send(w).unwrap();
    assert_eq!(wait_wc(&cside.cq).status, WcStatus::Success);
    let mut r =
        send(&cside, SendOp::Read { remote_addr: remote.addr + 200, rkey: softrdma::Rkey(remote.rkey) });
    r.sg_list = softrdma::sgl![cside.mr.sge(300, 7).unwrap()];
    cside.qp.post_send(r).unwrap();
    assert_eq!(wait_wc(&cside.cq).status, WcStatus::Success);
    let mut back = [0u8; 7];
    cside.mr.read(300, &mut back).unwrap();
    assert_eq!(&back, b"written");

    client.disconnect().unwrap();
    // At once, as rdma_disconnect does, not when the peer's DREP comes back.
    assert_eq!(cside.qp.state(), QpState::Error, "rdma_disconnect moves the QP to ERR");
    event(&cch, CmEventKind::Disconnected);
    event(&sch, CmEventKind::Disconnected);
    assert_eq!(cside.qp.state(), QpState::Error, "rdma_disconnect moves the QP to ERR");
    assert_eq!(sside.qp.state(), QpState::Error, "a DREQ moves the peer's QP to ERR");
    server.disconnect().unwrap();
}

#[test]
fn a_rejected_request_reports_the_reason_and_the_private_data() {
    let (c, s) = (ip([127, 0, 6, 4]), ip([127, 0, 6, 5]));
    let sch = EventChannel::new().unwrap();
    let listener = CmId::new(&sch, PortSpace::Tcp);
    listener.bind_addr(SocketAddr::new(s, 7472)).unwrap();
    listener.listen(8).unwrap();
    let cch = EventChannel::new().unwrap();
    let client = CmId::new(&cch, PortSpace::Tcp);
    client.resolve_addr(Some(c), SocketAddr::new(s, 7472), WAIT).unwrap();
    event(&cch, CmEventKind::AddrResolved);
    client.resolve_route(WAIT).unwrap();
    event(&cch, CmEventKind::RouteResolved);
    let side = setup_qp(&client, QpBuilder::rc());
    client.connect(&ConnParam::default()).unwrap();
    let req = event(&sch, CmEventKind::ConnectRequest);
    req.id.reject(b"go away").unwrap();
    let rej = event(&cch, CmEventKind::Rejected);
    assert_eq!(rej.status, 28, "consumer-defined reject");
    assert_eq!(&rej.param.private_data[..7], b"go away");
    assert_eq!(side.qp.state(), QpState::Error);
    assert!(req.id.accept(&ConnParam::default()).is_err(), "a rejected request cannot be accepted");

    // A port nobody listens on: REJ "invalid service ID" (8).
    let other = CmId::new(&cch, PortSpace::Tcp);
    other.resolve_addr(Some(c), SocketAddr::new(s, 7473), WAIT).unwrap();
    event(&cch, CmEventKind::AddrResolved);
    other.resolve_route(WAIT).unwrap();
    event(&cch, CmEventKind::RouteResolved);
    other.connect(&ConnParam::default()).unwrap();
    assert_eq!(event(&cch, CmEventKind::Rejected).status, 8);
}

#[test]
fn a_listener_a_moment_late_still_gets_the_request() {
    // perftest -R's server closes the listener of its first connection and listens
    // again on the same port for the second; a client quicker than that must not be
    // refused. The server's device already runs the CM (its first listener).
    let (c, s) = (ip([127, 0, 6, 20]), ip([127, 0, 6, 21]));
    let sch = EventChannel::new().unwrap();
    let first = CmId::new(&sch, PortSpace::Tcp);
    first.bind_addr(SocketAddr::new(s, 7480)).unwrap();
    first.listen(8).unwrap();
    let cch = EventChannel::new().unwrap();
    let client = CmId::new(&cch, PortSpace::Tcp);
    client.resolve_addr(Some(c), SocketAddr::new(s, 7481), WAIT).unwrap();
    event(&cch, CmEventKind::AddrResolved);
    client.resolve_route(WAIT).unwrap();
    event(&cch, CmEventKind::RouteResolved);
    let _cside = setup_qp(&client, QpBuilder::rc());
    client.connect(&ConnParam::default()).unwrap();
    std::thread::sleep(Duration::from_millis(150));
    let listener = CmId::new(&sch, PortSpace::Tcp);
    listener.bind_addr(SocketAddr::new(s, 7481)).unwrap();
    listener.listen(8).unwrap();
    let req = event(&sch, CmEventKind::ConnectRequest);
    let _sside = setup_qp(&req.id, QpBuilder::rc());
    req.id.accept(&ConnParam::default()).unwrap();
    event(&cch, CmEventKind::Established);
    event(&sch, CmEventKind::Established);
}

/// A CM peer that is not softrdma's runtime: the protocol crate's endpoint with its CM,
/// on a plain UDP socket at the RoCE port of its own address. Its packets' ICRC holds
/// with IP Identification 0, as softrdma's do, so only what its CM messages say can tell
/// it from softrdma.
struct FakePeer {
    ep: softrdma_proto::endpoint::Endpoint,
    mem: softrdma_proto::sim::SimMemory,
    sock: std::net::UdpSocket,
    addr: SocketAddr,
    start: std::time::Instant,
    /// Send packets whose ICRC holds for IP Identification 0x1234 only, as a kernel's or a
    /// NIC's do.
    kernel_ids: bool,
}

impl FakePeer {
    fn new(addr: IpAddr, port: u16) -> FakePeer {
        let addr = SocketAddr::new(addr, port);
        let sock = std::net::UdpSocket::bind(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let mut ep = softrdma_proto::endpoint::Endpoint::new(addr);
        ep.enable_cm(softrdma_proto::cm::CmConfig { seed: 5, ..Default::default() });
        let mem = softrdma_proto::sim::SimMemory::new(1);
        FakePeer { ep, mem, sock, addr, start: std::time::Instant::now(), kernel_ids: false }
    }

    fn now(&self) -> Duration {
        self.start.elapsed()
    }

    fn cm(&mut self) -> &mut softrdma_proto::cm::CmAgent {
        self.ep.cm_mut().unwrap()
    }

    /// Sends what the endpoint has, then takes one datagram if one comes within 100 ms;
    /// returns the CM events.
    fn pump(&mut self) -> Vec<softrdma_proto::cm::CmEvent> {
        let now = self.now();
        let mut buf = vec![0u8; 4096];
        while let Some(t) = self.ep.poll_transmit(now, &mut buf, &self.mem) {
            let mut bytes = t.assemble(&buf, &self.mem);
            if self.kernel_ids {
                use softrdma_proto::wire::icrc;
                let encap = icrc::Encap::new(self.addr, t.dst).unwrap().with_ipv4_ident(0x1234, true);
                let n = bytes.len() - 4;
                let crc = icrc::compute(&encap, &bytes[..n]);
                bytes[n..].copy_from_slice(&crc.to_le_bytes());
            }
            self.sock.send_to(&bytes, SocketAddr::new(t.dst.ip(), self.addr.port())).unwrap();
        }
        let mut rx = [0u8; 4096];
        if let Ok((n, from)) = self.sock.recv_from(&mut rx) {
            let arrival = softrdma_proto::endpoint::Arrival::new(from, self.addr);
            self.ep.handle_datagram(self.now(), arrival, &rx[..n], &mut self.mem);
        }
        std::iter::from_fn(|| self.cm().poll_event()).collect()
    }
}

/// An RC REQ from `c` to rdma_cm port `port` at `s`, with no ECE, as Linux rxe's.
fn plain_req(c: IpAddr, s: IpAddr, port: u16) -> softrdma_proto::cm::Req {
    use softrdma_proto::cm::{CmPath, CmaHeader, PortSpace as Ps, Req};
    let gid = |a: IpAddr| match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    Req {
        local_comm_id: 0,
        ece_vendor_id: 0,
        service_id: softrdma_proto::cm::service_id(Ps::Tcp, port),
        local_ca_guid: 0,
        local_qkey: 0,
        local_qpn: 0x77,
        responder_resources: 1,
        initiator_depth: 1,
        remote_cm_response_timeout: 18,
        transport_type: 0,
        e2e_flow_control: false,
        starting_psn: 0x1234,
        local_cm_response_timeout: 18,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: 3,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        extended_transport_type: 0,
        primary_path: CmPath {
            local_lid: 0xFFFF,
            remote_lid: 0xFFFF,
            local_gid: gid(c),
            remote_gid: gid(s),
            hop_limit: 64,
            local_ack_timeout: 14,
            ..CmPath::default()
        },
        alternate_path: None,
        private_data: CmaHeader { src: SocketAddr::new(c, 40000), dst: s }
            .with_user_data(&[], Req::PRIVATE_DATA_LEN)
            .unwrap(),
    }
}

#[test]
fn a_peer_whose_req_lacks_softrdmas_ece_is_foreign() {
    use softrdma_proto::cm::CmEvent;
    let (c, s) = (ip([127, 0, 6, 30]), ip([127, 0, 6, 31]));
    let sch = EventChannel::new().unwrap();
    let listener = CmId::new(&sch, PortSpace::Tcp);
    listener.bind_addr(SocketAddr::new(s, 7482)).unwrap();
    listener.listen(8).unwrap();
    let mut peer = FakePeer::new(c, listener.context().unwrap().local_addr().port());
    let now = peer.now();
    peer.cm().connect(now, s, plain_req(c, s, 7482)).unwrap();
    peer.pump();
    let req = event(&sch, CmEventKind::ConnectRequest);
    let sside = setup_qp(&req.id, QpBuilder::rc());
    req.id.accept(&ConnParam::default()).unwrap();
    let rep = (0..50)
        .flat_map(|_| peer.pump())
        .find_map(|e| match e {
            CmEvent::ConnectResponse { rep, .. } => Some(rep),
            _ => None,
        })
        .expect("a REP");
    assert_eq!(rep.ece_vendor_id, 0, "no ECE in the REP to a peer that announced none");
    assert!(sside.qp.foreign_peer(), "a REQ without softrdma's ECE makes the peer foreign");
}

#[test]
fn a_peer_whose_rep_echoes_the_reqs_ece_is_foreign() {
    // Linux's rdma_cm answers a REQ's ECE with the same ECE (rxe does, in the lab): a REP
    // that echoes softrdma's REQ proves nothing.
    use softrdma_proto::cm::{CmEvent, Rep};
    let (c, s) = (ip([127, 0, 6, 32]), ip([127, 0, 6, 33]));
    let svc = softrdma_proto::cm::service_id(softrdma_proto::cm::PortSpace::Tcp, 7483);
    let cch = EventChannel::new().unwrap();
    let client = CmId::new(&cch, PortSpace::Tcp);
    client.resolve_addr(Some(c), SocketAddr::new(s, 7483), WAIT).unwrap();
    event(&cch, CmEventKind::AddrResolved);
    client.resolve_route(WAIT).unwrap();
    event(&cch, CmEventKind::RouteResolved);
    let mut peer = FakePeer::new(s, client.context().unwrap().local_addr().port());
    peer.cm().listen(svc, 8).unwrap();
    let cside = setup_qp(&client, QpBuilder::rc());
    client.connect(&ConnParam::default()).unwrap();
    let (id, req) = (0..50)
        .flat_map(|_| peer.pump())
        .find_map(|e| match e {
            CmEvent::ConnectRequest { id, req, .. } => Some((id, req)),
            _ => None,
        })
        .expect("a REQ");
    assert_eq!(req.ece_vendor_id, softrdma::cm::SOFTRDMA_ECE, "softrdma announces itself");
    let rep = Rep {
        local_comm_id: 0,
        remote_comm_id: 0,
        local_qkey: 0,
        local_qpn: 0x99,
        local_eecn: 0,
        starting_psn: 0x4321,
        ece_vendor_id: req.ece_vendor_id,
        responder_resources: 1,
        initiator_depth: 1,
        target_ack_delay: 15,
        failover_accepted: 0,
        e2e_flow_control: false,
        rnr_retry_count: 7,
        srq: false,
        local_ca_guid: 0,
        private_data: Vec::new(),
    };
    let now = peer.now();
    peer.cm().accept(now, id, rep).unwrap();
    peer.pump();
    event(&cch, CmEventKind::Established);
    assert!(cside.qp.foreign_peer(), "an echoed ECE does not make the peer softrdma");
}

#[test]
fn a_qp_connected_by_hand_to_a_peer_the_cm_found_foreign_is_foreign() {
    // An rdma_cm program that brings its own QP (UCX does) moves it to RTR itself: the CM
    // never marks it. The peer's CM messages needed the ID-agnostic ICRC check, so the
    // device knows it is foreign, and the QP is marked when it connects to it.
    let (c, s) = (ip([127, 0, 6, 34]), ip([127, 0, 6, 35]));
    let sch = EventChannel::new().unwrap();
    let listener = CmId::new(&sch, PortSpace::Tcp);
    listener.bind_addr(SocketAddr::new(s, 7484)).unwrap();
    listener.listen(8).unwrap();
    let ctx = listener.context().unwrap();
    let port = ctx.local_addr().port();
    let mut peer = FakePeer::new(c, port);
    peer.kernel_ids = true;
    let now = peer.now();
    peer.cm().connect(now, s, plain_req(c, s, 7484)).unwrap();
    peer.pump();
    let req = event(&sch, CmEventKind::ConnectRequest);
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(8, None).unwrap();
    let own = pd.create_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
    let connect = |qp: &QueuePair, to: IpAddr| {
        qp.modify(&softrdma::QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access_flags: Some(Access::LOCAL_WRITE),
            ..Default::default()
        })
        .unwrap();
        qp.modify(&softrdma::QpAttr {
            state: Some(QpState::Rtr),
            path_mtu: Some(softrdma::Mtu::Mtu1024),
            remote: Some(SocketAddr::new(to, port)),
            dest_qpn: Some(softrdma::Qpn::new(0x77)),
            rq_psn: Some(softrdma::Psn::new(0x1234)),
            max_dest_rd_atomic: Some(1),
            min_rnr_timer: Some(12),
            ..Default::default()
        })
        .unwrap();
    };
    connect(&own, c);
    assert!(own.foreign_peer(), "connected to a peer whose CM messages came from a kernel");
    // One connected by hand to an address the CM has not heard from stays softrdma's.
    let other = pd.create_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
    connect(&other, ip([127, 0, 6, 36]));
    assert!(!other.foreign_peer());
    drop(req);
    // A peer whose packets look like softrdma's but whose REQ lacked softrdma's ECE.
    let d = ip([127, 0, 6, 37]);
    let mut quiet = FakePeer::new(d, port);
    let now = quiet.now();
    quiet.cm().connect(now, s, plain_req(d, s, 7484)).unwrap();
    quiet.pump();
    let _req = event(&sch, CmEventKind::ConnectRequest);
    let third = pd.create_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
    connect(&third, d);
    assert!(third.foreign_peer(), "connected to a peer that did not announce softrdma's ECE");
}

#[test]
fn calls_out_of_order_and_taken_ports_are_clear_errors() {
    let ch = EventChannel::new().unwrap();
    let id = CmId::new(&ch, PortSpace::Tcp);
    assert!(id.connect(&ConnParam::default()).is_err(), "connect before resolving");
    assert!(id.resolve_route(WAIT).is_err(), "route before address");
    assert!(id.accept(&ConnParam::default()).is_err());
    assert!(id.disconnect().is_err());
    let a = SocketAddr::new(ip([127, 0, 6, 6]), 7474);
    id.bind_addr(a).unwrap();
    let again = CmId::new(&ch, PortSpace::Tcp);
    let err = again.bind_addr(a).unwrap_err();
    assert_eq!(err.errno(), libc_eaddrinuse(), "{err}");
    // The same port in another port space is free.
    CmId::new(&ch, PortSpace::Udp).bind_addr(a).unwrap();
    // Private data beyond the REQ's 56 bytes.
    let c = CmId::new(&ch, PortSpace::Tcp);
    c.resolve_addr(Some(ip([127, 0, 6, 7])), a, WAIT).unwrap();
    event(&ch, CmEventKind::AddrResolved);
    c.resolve_route(WAIT).unwrap();
    event(&ch, CmEventKind::RouteResolved);
    let long = ConnParam { private_data: vec![1; 57], ..Default::default() };
    assert!(c.connect(&long).is_err());
    // The port is free again once its ID is gone.
    drop(id);
    CmId::new(&ch, PortSpace::Tcp).bind_addr(a).unwrap();
}

fn libc_eaddrinuse() -> i32 {
    98
}

#[test]
fn many_concurrent_connections_to_one_listener_and_an_id_dropped_while_connected() {
    let (c, s) = (ip([127, 0, 6, 8]), ip([127, 0, 6, 9]));
    let sch = EventChannel::new().unwrap();
    let listener = CmId::new(&sch, PortSpace::Tcp);
    listener.bind_addr(SocketAddr::new(s, 7475)).unwrap();
    listener.listen(64).unwrap();
    let cch = EventChannel::new().unwrap();
    const N: usize = 40;
    let mut clients = Vec::new();
    for _ in 0..N {
        let id = CmId::new(&cch, PortSpace::Tcp);
        id.resolve_addr(Some(c), SocketAddr::new(s, 7475), WAIT).unwrap();
        clients.push(id);
    }
    let mut sides = Vec::new();
    let mut servers = Vec::new();
    let (mut resolved, mut routed, mut established, mut requests) = (0, 0, 0, 0);
    while established < 2 * N {
        let mut progressed = false;
        if let Some(ev) = cch.get_event_timeout(Duration::from_millis(5)) {
            progressed = true;
            match ev.kind {
                CmEventKind::AddrResolved => {
                    resolved += 1;
                    ev.id.resolve_route(WAIT).unwrap();
                }
                CmEventKind::RouteResolved => {
                    routed += 1;
                    let side = setup_qp(&ev.id, QpBuilder::rc());
                    let n = sides.len() as u8;
                    ev.id.connect(&ConnParam { private_data: vec![n], ..Default::default() }).unwrap();
                    sides.push(side);
                }
                CmEventKind::Established => established += 1,
                k => panic!("client event {k}"),
            }
        }
        if let Some(ev) = sch.get_event_timeout(Duration::from_millis(5)) {
            progressed = true;
            match ev.kind {
                CmEventKind::ConnectRequest => {
                    requests += 1;
                    let side = setup_qp(&ev.id, QpBuilder::rc());
                    ev.id.accept(&ev.param).unwrap();
                    servers.push((ev.id.clone(), side, ev.param.private_data[0]));
                }
                CmEventKind::Established => established += 1,
                k => panic!("server event {k}"),
            }
        }
        assert!(progressed || established >= 2 * N, "stalled at {established} established");
    }
    assert_eq!((resolved, routed, requests), (N, N, N));
    let mut tags: Vec<u8> = servers.iter().map(|s| s.2).collect();
    tags.sort_unstable();
    assert_eq!(tags, (0..N as u8).collect::<Vec<_>>(), "each request reached its own ID once");

    // Every connection carries its own traffic.
    for (i, (_, side, tag)) in servers.iter().enumerate() {
        side.qp
            .post_recv(RecvWr { wr_id: i as u64, sg_list: softrdma::sgl![side.mr.sge(0, 1).unwrap()] })
            .unwrap();
        let _ = tag;
    }
    for (i, side) in sides.iter().enumerate() {
        side.mr.write(0, &[i as u8]).unwrap();
        side.qp
            .post_send(SendWr {
                wr_id: 0,
                op: SendOp::Send,
                sg_list: softrdma::sgl![side.mr.sge(0, 1).unwrap()],
                flags: SendFlags::default(),
                ud: None,
            })
            .unwrap();
    }
    for (_, side, tag) in &servers {
        let wc = wait_wc(&side.cq);
        assert_eq!(wc.status, WcStatus::Success);
        let mut b = [0u8];
        side.mr.read(0, &mut b).unwrap();
        assert_eq!(b[0], *tag, "the message came over its own connection");
    }

    // Dropping a connected client ID disconnects it: its server sees DISCONNECTED.
    drop(clients);
    let mut disconnected = 0;
    while disconnected < N {
        let ev = sch.get_event_timeout(WAIT).expect("DISCONNECTED for every dropped client");
        assert_eq!(ev.kind, CmEventKind::Disconnected);
        disconnected += 1;
    }
}

#[test]
fn ud_ids_resolve_the_peer_qp_with_sidr_and_exchange_datagrams() {
    let (c, s) = (ip([127, 0, 6, 10]), ip([127, 0, 6, 11]));
    let sch = EventChannel::new().unwrap();
    let listener = CmId::new(&sch, PortSpace::Udp);
    listener.bind_addr(SocketAddr::new(s, 7476)).unwrap();
    listener.listen(8).unwrap();
    let cch = EventChannel::new().unwrap();
    let client = CmId::new(&cch, PortSpace::Udp);
    client.resolve_addr(Some(c), SocketAddr::new(s, 7476), WAIT).unwrap();
    event(&cch, CmEventKind::AddrResolved);
    client.resolve_route(WAIT).unwrap();
    event(&cch, CmEventKind::RouteResolved);
    let cside = setup_qp(&client, QpBuilder::ud(UDP_QKEY));
    assert_eq!(cside.qp.state(), QpState::Rts, "rdma_cm readies UD QPs at once");
    client.connect(&ConnParam { private_data: b"sidr".to_vec(), ..Default::default() }).unwrap();
    let req = event(&sch, CmEventKind::ConnectRequest);
    assert_eq!(&req.param.private_data[..4], b"sidr");
    let sside = setup_qp(&req.id, QpBuilder::ud(UDP_QKEY));
    sside.qp.post_recv(RecvWr { wr_id: 5, sg_list: softrdma::sgl![sside.mr.sge(0, 4096).unwrap()] }).unwrap();
    req.id.accept(&ConnParam::default()).unwrap();
    let est = event(&cch, CmEventKind::Established);
    let ud = est.ud.expect("ESTABLISHED carries the peer's QP");
    assert_eq!((ud.qpn, ud.qkey), (sside.qp.qpn(), UDP_QKEY));
    assert_eq!(ud.addr.ip(), s);

    cside.mr.write(0, b"datagram").unwrap();
    cside
        .qp
        .post_send(SendWr {
            wr_id: 1,
            op: SendOp::Send,
            sg_list: softrdma::sgl![cside.mr.sge(0, 8).unwrap()],
            flags: SendFlags { signaled: true, ..Default::default() },
            ud: Some(UdDest { addr: ud.addr, qpn: ud.qpn, qkey: ud.qkey, traffic_class: 0 }),
        })
        .unwrap();
    assert_eq!(wait_wc(&cside.cq).status, WcStatus::Success);
    let wc = wait_wc(&sside.cq);
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 8 + 40));
}

/// The tutorial's (seed 003) client and server, through the convenience layer: each side
/// gets a connected QP in a few blocking calls and one message goes each way; the server
/// also READs the client's buffer, whose address came in the private data.
#[test]
fn the_convenience_layer_runs_the_tutorials_client_and_server() {
    use softrdma::cm::{getaddrinfo, AddrHints, Ep, EpQp};
    let hints = AddrHints { passive: true, ..Default::default() };
    let info = getaddrinfo(Some("127.0.6.12"), Some("7477"), &hints).unwrap();
    assert_eq!(info.len(), 1);
    assert_eq!(info[0].src, Some("127.0.6.12:7477".parse().unwrap()));
    let listener = Ep::create(&info[0], None, Some(&EpQp::default())).unwrap();
    listener.listen(4).unwrap();
    let server = std::thread::spawn(move || {
        let mut ep = listener.get_request().unwrap();
        let peer = ep.peer_param().unwrap().clone();
        let pd = &peer.private_data;
        let remote = softrdma::RemoteRegion {
            addr: u64::from_le_bytes(pd[..8].try_into().unwrap()),
            rkey: u32::from_le_bytes(pd[8..12].try_into().unwrap()),
            len: u32::from_le_bytes(pd[12..16].try_into().unwrap()).into(),
        };
        let msg = ep.reg_msgs(64).unwrap();
        ep.post_recv(1, &msg, 0, 64).unwrap();
        ep.accept(&ConnParam::default()).unwrap();
        let wc = ep.get_recv_comp_timeout(WAIT).unwrap();
        assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 5));
        assert_eq!(&msg.to_vec()[..5], b"hello");
        let flags = SendFlags { signaled: true, ..Default::default() };
        ep.post_read(2, &msg, 8, 16, flags, &softrdma::RemoteRegion { addr: remote.addr + 4, ..remote })
            .unwrap();
        assert_eq!(ep.get_send_comp_timeout(WAIT).unwrap().status, WcStatus::Success);
        msg.write(0, b"world").unwrap();
        ep.post_send(3, &msg, 0, 5, flags).unwrap();
        assert_eq!(ep.get_send_comp_timeout(WAIT).unwrap().status, WcStatus::Success);
        let read = msg.to_vec()[8..24].to_vec();
        // Wait for the client's disconnect: the receive posted last flushes.
        ep.post_recv(4, &msg, 32, 32).unwrap();
        let wc = ep.get_recv_comp_timeout(WAIT).unwrap();
        assert_eq!((wc.wr_id, wc.status), (4, WcStatus::WrFlushErr));
        read
    });

    let hints = AddrHints { src: Some(ip([127, 0, 6, 13])), ..Default::default() };
    let info = getaddrinfo(Some("127.0.6.12"), Some("7477"), &hints).unwrap();
    let mut ep = Ep::create(&info[0], None, Some(&EpQp::default())).unwrap();
    let exposed = ep.reg_read(64).unwrap();
    exposed.write(0, b"0123456789abcdefghijklmnop").unwrap();
    let msg = ep.reg_msgs(64).unwrap();
    ep.post_recv(9, &msg, 0, 64).unwrap();
    let r = exposed.remote();
    let advert = [&r.addr.to_le_bytes()[..], &r.rkey.to_le_bytes(), &(r.len as u32).to_le_bytes()].concat();
    let offer = ConnParam { private_data: advert, ..Default::default() };
    ep.connect(&offer).unwrap();
    msg.write(32, b"hello").unwrap();
    ep.post_send(8, &msg, 32, 5, SendFlags { signaled: true, ..Default::default() }).unwrap();
    assert_eq!(ep.get_send_comp_timeout(WAIT).unwrap().status, WcStatus::Success);
    let wc = ep.get_recv_comp_timeout(WAIT).unwrap();
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (9, WcStatus::Success, 5));
    assert_eq!(&msg.to_vec()[..5], b"world");
    ep.disconnect().unwrap();
    assert_eq!(server.join().unwrap(), b"456789abcdefghij", "the READ fetched the client's bytes 4..20");
}

#[test]
fn the_convenience_layer_reports_a_refused_connection_and_bad_hints() {
    use softrdma::cm::{getaddrinfo, AddrHints, Ep, EpQp};
    let hints = AddrHints { numeric_host: true, ..Default::default() };
    assert!(getaddrinfo(Some("localhost"), Some("7478"), &hints).is_err());
    assert!(getaddrinfo(Some("127.0.6.14"), Some("rdma"), &AddrHints::default()).is_err());
    assert!(getaddrinfo(None, Some("7478"), &AddrHints::default()).is_err(), "active needs a node");
    let v6 = AddrHints { ipv6: Some(true), ..Default::default() };
    assert!(getaddrinfo(Some("127.0.6.14"), Some("7478"), &v6).is_err());
    // 127.0.6.14 runs a CM (a listener on 7480) but nobody listens on 7478: the REQ is
    // rejected (reason 8, invalid service ID).
    let other =
        getaddrinfo(Some("127.0.6.14"), Some("7480"), &AddrHints { passive: true, ..Default::default() });
    let other = Ep::create(&other.unwrap()[0], None, None).unwrap();
    other.listen(1).unwrap();
    let hints = AddrHints { src: Some(ip([127, 0, 6, 15])), ..Default::default() };
    let info = getaddrinfo(Some("127.0.6.14"), Some("7478"), &hints).unwrap();
    let mut ep = Ep::create(&info[0], None, Some(&EpQp::default())).unwrap();
    let err = ep.connect(&ConnParam::default()).unwrap_err();
    assert!(matches!(err, softrdma::Error::CmFailed { event: "RDMA_CM_EVENT_REJECTED", status: 8 }), "{err}");
    assert_eq!(err.errno(), libc::ECONNREFUSED);
}

/// The channel as an async stream: events arrive through a waker, not by polling.
#[test]
fn events_arrive_through_the_async_stream() {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Wake, Waker};

    struct Flag(std::sync::atomic::AtomicUsize);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let flag = Arc::new(Flag(0.into()));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);

    let ch = EventChannel::new().unwrap();
    let mut events = pin!(ch.events());
    let mut next = || futures_core::Stream::poll_next(events.as_mut(), &mut cx);
    assert!(next().is_pending(), "no event yet");
    let id = CmId::new(&ch, PortSpace::Tcp);
    id.resolve_addr(Some(ip([127, 0, 6, 16])), SocketAddr::new(ip([127, 0, 6, 17]), 7479), WAIT).unwrap();
    assert_eq!(flag.0.load(std::sync::atomic::Ordering::SeqCst), 1, "the event woke the task");
    match next() {
        Poll::Ready(Some(ev)) => assert_eq!(ev.kind, CmEventKind::AddrResolved),
        other => panic!("{other:?}"),
    }
    assert!(next().is_pending());
    // And the single-event future.
    id.resolve_route(WAIT).unwrap();
    let mut fut = pin!(ch.next_event());
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(ev) => assert_eq!(ev.kind, CmEventKind::RouteResolved),
        Poll::Pending => panic!("the event waits"),
    }
}

/// `destroy` frees the ID's port at once, even while another handle (an event being
/// delivered, say) still names the ID: perftest -R destroys its control listener and binds
/// the same port again straight away.
#[test]
fn a_destroyed_listener_frees_its_port_at_once() {
    let ch = EventChannel::new().unwrap();
    let at = SocketAddr::new(ip([127, 0, 6, 18]), 7481);
    let first = CmId::new(&ch, PortSpace::Tcp);
    first.bind_addr(at).unwrap();
    first.listen(4).unwrap();
    let lingering = first.clone();
    drop(first);
    let second = CmId::new(&ch, PortSpace::Tcp);
    assert_eq!(second.bind_addr(at).unwrap_err().errno(), libc::EADDRINUSE, "a handle keeps the port");
    lingering.destroy();
    second.bind_addr(at).unwrap();
    second.listen(4).unwrap();
    assert!(lingering.listen(4).is_err(), "a destroyed ID does nothing more");
}
