//! The connection manager over real UDP sockets: two devices in one process (distinct
//! loopback addresses, RoCE port 4791), connected through rdma_cm's calls and events.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use softrdma::cm::{CmEvent, CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use softrdma::{
    Access, CompletionQueue, MemoryRegion, QpBuilder, QpState, QueuePair, RecvWr, SendFlags, SendOp, SendWr,
    WcOpcode, WcStatus,
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
    cside.qp.post_recv(RecvWr { wr_id: 7, sg_list: vec![cside.mr.sge(0, 4096).unwrap()] }).unwrap();
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
    sside.qp.post_recv(RecvWr { wr_id: 8, sg_list: vec![sside.mr.sge(0, 4096).unwrap()] }).unwrap();
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
        sg_list: vec![side.mr.sge(0, 4).unwrap()],
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
    w.sg_list = vec![cside.mr.sge(100, 7).unwrap()];
    cside.qp.post_send(w).unwrap();
    assert_eq!(wait_wc(&cside.cq).status, WcStatus::Success);
    let mut r =
        send(&cside, SendOp::Read { remote_addr: remote.addr + 200, rkey: softrdma::Rkey(remote.rkey) });
    r.sg_list = vec![cside.mr.sge(300, 7).unwrap()];
    cside.qp.post_send(r).unwrap();
    assert_eq!(wait_wc(&cside.cq).status, WcStatus::Success);
    let mut back = [0u8; 7];
    cside.mr.read(300, &mut back).unwrap();
    assert_eq!(&back, b"written");

    client.disconnect().unwrap();
    event(&cch, CmEventKind::Disconnected);
    event(&sch, CmEventKind::Disconnected);
    assert_eq!(cside.qp.state(), QpState::Error, "rdma_disconnect moves the QP to ERR");
    assert_eq!(sside.qp.state(), QpState::Error, "a DREQ moves the peer's QP to ERR");
    server.disconnect().unwrap();
}
