//! Verbs-level control at the runtime: QPs born in RESET and driven by `modify` exactly as
//! `ibv_modify_qp` drives them (every legal transition, illegal ones refused and changing
//! nothing), `query`, attribute masks, access flags by name, destroy flushing, the P_Key
//! check on a real socket, and address handles from attributes and from a completion.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use softrdma::proto::qp::ModifyError;
use softrdma::proto::sim::Impairments;
use softrdma::proto::wire::{icrc, BthRepr, Opcode, PacketRepr};
use softrdma::{
    Access, AhAttr, CompletionQueue, ConnectOptions, Context, EndpointInfo, Error, MemoryNetwork, Mtu, Psn,
    Qkey, QpAttr, QpAttrMask, QpBuilder, QpState, QpType, Qpn, QueuePair, RecvWr, SendFlags, SendOp, SendWr,
    WcStatus, WorkCompletion,
};

fn wait(cq: &CompletionQueue) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(wc) = cq.poll_one() {
            return wc;
        }
        assert!(Instant::now() < deadline, "no completion");
        std::thread::yield_now();
    }
}

fn state(s: QpState) -> QpAttr {
    QpAttr { state: Some(s), ..Default::default() }
}

fn init(access: Access) -> QpAttr {
    QpAttr {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(1),
        access_flags: Some(access),
        ..Default::default()
    }
}

fn rtr(peer: SocketAddr) -> QpAttr {
    QpAttr {
        state: Some(QpState::Rtr),
        path_mtu: Some(Mtu::Mtu1024),
        remote: Some(peer),
        dest_qpn: Some(Qpn::new(0x77)),
        rq_psn: Some(Psn::new(0x1234)),
        max_dest_rd_atomic: Some(4),
        min_rnr_timer: Some(12),
        ..Default::default()
    }
}

fn rts() -> QpAttr {
    QpAttr {
        state: Some(QpState::Rts),
        sq_psn: Some(Psn::new(0x4321)),
        timeout: Some(14),
        retry_cnt: Some(7),
        rnr_retry: Some(6),
        max_rd_atomic: Some(3),
        ..Default::default()
    }
}

/// Tries `attr`, which must be refused with `want`, and checks that the QP did not change.
fn refused(qp: &QueuePair, attr: QpAttr, want: fn(&Error) -> bool) {
    let before = qp.query().unwrap();
    let e = qp.modify(&attr).expect_err("must be refused");
    assert!(want(&e), "{attr:?}: unexpected error {e:?}");
    assert_eq!(qp.query().unwrap(), before, "a refused modify changed the QP");
}

fn invalid_transition(e: &Error) -> bool {
    matches!(e, Error::Modify(ModifyError::InvalidTransition { .. }))
}

#[test]
fn rc_qps_follow_ibv_modify_qp_from_reset_and_back() {
    let net = MemoryNetwork::new(1, Impairments::default());
    let ctx = Context::open_in(&net, "10.1.0.1:4791".parse().unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let qp = pd.create_qp(&QpBuilder::rc().sq_sig_all(true), &cq, &cq).unwrap();
    let peer: SocketAddr = "10.1.0.2:4791".parse().unwrap();
    assert_eq!(qp.state(), QpState::Reset, "ibv_create_qp gives RESET");
    let (attr, init_attr) = qp.query().unwrap();
    assert_eq!(attr.state, Some(QpState::Reset));
    assert_eq!((init_attr.qp_type, init_attr.sq_sig_all, init_attr.send_cq), (QpType::Rc, true, cq.id()));

    // From RESET: only INIT (or RESET, ERROR), and only with pkey_index, port and access.
    for to in [QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe] {
        refused(&qp, state(to), invalid_transition);
    }
    refused(&qp, state(QpState::Init), |e| matches!(e, Error::Modify(ModifyError::Missing("pkey_index"))));
    refused(&qp, QpAttr { sq_psn: Some(Psn::new(1)), ..init(Access::NONE) }, |e| {
        matches!(e, Error::Modify(ModifyError::NotAllowed("sq_psn")))
    });
    refused(&qp, QpAttr { port: Some(2), ..init(Access::NONE) }, |e| {
        matches!(e, Error::Modify(ModifyError::OutOfRange("port")))
    });
    let w = Access::REMOTE_WRITE;
    qp.modify(&init(w)).unwrap();
    qp.modify(&QpAttr { access_flags: Some(w | Access::REMOTE_READ), ..state(QpState::Init) }).unwrap();
    assert_eq!(qp.query().unwrap().0.access_flags, Some(w | Access::REMOTE_READ), "INIT→INIT changes access");

    // From INIT: not RTS; RTR needs the whole address vector and receive side.
    refused(&qp, rts(), invalid_transition);
    refused(&qp, QpAttr { min_rnr_timer: None, ..rtr(peer) }, |e| {
        matches!(e, Error::Modify(ModifyError::Missing("min_rnr_timer")))
    });
    refused(&qp, QpAttr { max_dest_rd_atomic: Some(200), ..rtr(peer) }, |e| {
        matches!(e, Error::Modify(ModifyError::OutOfRange("max_dest_rd_atomic")))
    });
    qp.modify(&rtr(peer)).unwrap();
    refused(&qp, init(w), invalid_transition);
    refused(&qp, QpAttr { retry_cnt: Some(8), ..rts() }, |e| {
        matches!(e, Error::Modify(ModifyError::OutOfRange("retry_cnt")))
    });
    qp.modify(&rts()).unwrap();

    let (a, _) = qp.query().unwrap();
    assert_eq!(a.state, Some(QpState::Rts));
    assert_eq!((a.remote, a.dest_qpn, a.path_mtu), (Some(peer), Some(Qpn::new(0x77)), Some(Mtu::Mtu1024)));
    assert_eq!((a.rq_psn, a.sq_psn), (Some(Psn::new(0x1234)), Some(Psn::new(0x4321))));
    assert_eq!((a.timeout, a.retry_cnt, a.rnr_retry, a.max_rd_atomic), (Some(14), Some(7), Some(6), Some(3)));
    assert_eq!((a.max_dest_rd_atomic, a.min_rnr_timer), (Some(4), Some(12)));

    // RTS ⇄ SQD, RTS→RTS with optional attributes, no SQE for RC, no way back to RTR.
    qp.modify(&QpAttr { min_rnr_timer: Some(5), ..state(QpState::Rts) }).unwrap();
    assert_eq!(qp.query().unwrap().0.min_rnr_timer, Some(5));
    refused(&qp, QpAttr { timeout: Some(3), ..state(QpState::Rts) }, |e| {
        matches!(e, Error::Modify(ModifyError::NotAllowed("timeout")))
    });
    refused(&qp, state(QpState::Sqe), invalid_transition);
    qp.modify(&state(QpState::Sqd)).unwrap();
    qp.modify(&state(QpState::Sqd)).unwrap();
    refused(&qp, rtr(peer), invalid_transition);
    qp.modify(&state(QpState::Rts)).unwrap();
    // Any state to ERROR; from ERROR only to RESET; RESET starts over.
    qp.modify(&state(QpState::Error)).unwrap();
    refused(&qp, state(QpState::Rts), invalid_transition);
    refused(&qp, init(w), invalid_transition);
    qp.modify(&state(QpState::Reset)).unwrap();
    qp.modify(&init(w)).unwrap();
    qp.modify(&state(QpState::Reset)).unwrap();
    assert_eq!(qp.state(), QpState::Reset);

    // The C API's form: attributes and a mask apart.
    let full = QpAttr { sq_psn: Some(Psn::new(9)), ..init(w) };
    let mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
    qp.modify_masked(&full, mask).unwrap();
    assert_eq!(qp.state(), QpState::Init, "attributes outside the mask are ignored");
    let e = qp
        .modify_masked(&rtr(peer), QpAttrMask::STATE | QpAttrMask::DEST_QPN | QpAttrMask::QKEY)
        .unwrap_err();
    assert!(matches!(e, Error::Modify(ModifyError::Missing("qkey"))), "{e:?}");
    let e = qp.modify_masked(&rtr(peer), QpAttrMask::STATE | QpAttrMask::ALT_PATH).unwrap_err();
    assert!(matches!(e, Error::Modify(ModifyError::Unsupported("alt_path"))), "{e:?}");
    assert_eq!(qp.state(), QpState::Init);
}

#[test]
fn ud_qps_follow_ibv_modify_qp() {
    let net = MemoryNetwork::new(2, Impairments::default());
    let ctx = Context::open_in(&net, "10.1.1.1:4791".parse().unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let qp = pd.create_qp(&QpBuilder::ud(Qkey(0)), &cq, &cq).unwrap();
    // UD INIT takes a Q_Key, not access flags.
    refused(&qp, init(Access::NONE), |e| matches!(e, Error::Modify(ModifyError::Missing("qkey"))));
    let ud_init = QpAttr { qkey: Some(Qkey(0x11)), access_flags: None, ..init(Access::NONE) };
    qp.modify(&ud_init).unwrap();
    refused(&qp, QpAttr { dest_qpn: Some(Qpn::new(3)), ..state(QpState::Rtr) }, |e| {
        matches!(e, Error::Modify(ModifyError::NotAllowed("dest_qpn")))
    });
    qp.modify(&state(QpState::Rtr)).unwrap();
    refused(&qp, state(QpState::Rts), |e| matches!(e, Error::Modify(ModifyError::Missing("sq_psn"))));
    qp.modify(&QpAttr { sq_psn: Some(Psn::new(5)), ..state(QpState::Rts) }).unwrap();
    qp.modify(&QpAttr { qkey: Some(Qkey(0x22)), ..state(QpState::Rts) }).unwrap();
    let (a, _) = qp.query().unwrap();
    assert_eq!((a.state, a.qkey, a.remote), (Some(QpState::Rts), Some(Qkey(0x22)), None));
    qp.modify(&state(QpState::Sqd)).unwrap();
    qp.modify(&state(QpState::Rts)).unwrap();
    qp.modify(&state(QpState::Error)).unwrap();
    qp.modify(&state(QpState::Reset)).unwrap();
}

#[test]
fn access_flags_are_recognised_by_name() {
    let net = MemoryNetwork::new(3, Impairments::default());
    let ctx = Context::open_in(&net, "10.1.2.1:4791".parse().unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let flag = |bits: u32| Access::from_bits(0x01 | bits);
    for (bit, name) in [
        (1 << 4, "IBV_ACCESS_MW_BIND"),
        (1 << 5, "IBV_ACCESS_ZERO_BASED"),
        (1 << 8, "IBV_ACCESS_FLUSH_GLOBAL"),
        (1 << 9, "IBV_ACCESS_FLUSH_PERSISTENT"),
    ] {
        match pd.register(64, flag(bit)) {
            Err(Error::UnsupportedAccess(n)) => assert_eq!(n, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    // Satisfied already: on-demand paging (nothing is pinned), huge pages, relaxed ordering
    // and any other optional flag.
    for bit in [1 << 6, 1 << 7, 1 << 20, 1 << 27] {
        let mr = pd.register(64, flag(bit | 0x2)).unwrap();
        assert_eq!(mr.access(), Access::LOCAL_WRITE | Access::REMOTE_WRITE, "only the rights are kept");
    }
    assert!(matches!(pd.register(64, flag(1 << 15)), Err(Error::InvalidArgument(_))), "unknown bit");
    assert!(matches!(pd.register(64, Access::REMOTE_WRITE), Err(Error::InvalidArgument(_))));
    let cq = ctx.create_cq(8, None).unwrap();
    let qp = pd.create_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
    let e = qp.modify(&init(Access::from_bits(1 << 4))).unwrap_err();
    assert!(matches!(e, Error::UnsupportedAccess("IBV_ACCESS_MW_BIND")), "{e:?}");
    assert_eq!(qp.state(), QpState::Reset);
    qp.modify(&init(Access::REMOTE_WRITE)).unwrap();
}

#[test]
fn destroying_a_qp_flushes_its_work_requests() {
    let net = MemoryNetwork::new(4, Impairments::default());
    let ctx = Context::open_in(&net, "10.1.3.1:4791".parse().unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
    let qp = pd.create_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
    qp.modify(&init(Access::NONE)).unwrap();
    for i in 0..3 {
        qp.post_recv(RecvWr { wr_id: 10 + i, sg_list: softrdma::sgl![mr.sge(0, 64).unwrap()] }).unwrap();
    }
    let qpn = qp.qpn();
    drop(qp);
    let got: Vec<_> = std::iter::from_fn(|| cq.poll_one()).map(|w| (w.wr_id, w.status, w.qp_num)).collect();
    assert_eq!(got, (10..13).map(|i| (i, WcStatus::WrFlushErr, qpn)).collect::<Vec<_>>());
}

/// rxe's P_Key rule on a real socket: a packet whose P_Key does not match the table is
/// dropped before any QP sees it, and counted; the same packet with the default P_Key is
/// received.
#[test]
fn pkey_mismatch_is_dropped_and_counted_on_a_real_socket() {
    let ctx = Context::open_port(IpAddr::from([127, 0, 20, 1]), 0).unwrap();
    assert_eq!((ctx.query_pkey(0), ctx.query_pkey(1)), (Some(0xFFFF), None));
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
    let attacker = UdpSocket::bind("127.0.20.2:0").unwrap();
    let p = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
    p.post_recv(RecvWr { wr_id: 1, sg_list: softrdma::sgl![mr.sge(0, 4096).unwrap()] }).unwrap();
    let fake =
        EndpointInfo { addr: attacker.local_addr().unwrap(), qpn: 0x99, psn: 100, mtu: 1024, region: None };
    let qp = p.handshake(&fake, &ConnectOptions::default()).unwrap();
    let send = |pkey: u16| {
        let mut bth = BthRepr::new(Opcode::new(0x04).unwrap(), qp.qpn(), Psn::new(100));
        bth.pkey = pkey;
        let r = PacketRepr::new(bth, 5);
        let encap = icrc::Encap::new(attacker.local_addr().unwrap(), ctx.local_addr()).unwrap();
        let mut buf = vec![0u8; r.total_len()];
        r.emit(&mut buf, b"hello", &encap).unwrap();
        attacker.send_to(&buf, ctx.local_addr()).unwrap();
    };
    for (k, bad) in [0x1234u16, 0x8001].into_iter().enumerate() {
        send(bad);
        let deadline = Instant::now() + Duration::from_secs(10);
        while ctx.endpoint_stats().pkey_violations < k as u64 + 1 {
            assert!(Instant::now() < deadline, "P_Key {bad:#x} not counted: {:?}", ctx.endpoint_stats());
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert!(cq.poll_one().is_none(), "a packet of another partition reached the QP");
    send(0xFFFF);
    let wc = wait(&cq);
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (1, WcStatus::Success, 5));
    assert_eq!(ctx.endpoint_stats().pkey_violations, 2);
}

/// Address handles on real sockets: A sends through a handle made from attributes, with a
/// traffic class that travels as the IP TOS byte; B answers through a handle made from
/// the completion and the GRH area of its receive buffer, which carries A's address and
/// that traffic class.
#[test]
fn address_handles_from_attributes_and_from_a_completion() {
    let qkey = Qkey(0x1111_0000);
    let side = |last: u8| {
        let ctx = Context::open_port(IpAddr::from([127, 0, 20, last]), 0).unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(64, None).unwrap();
        let mr = pd.register(8192, Access::LOCAL_WRITE).unwrap();
        let qp = pd.prepare_qp(&QpBuilder::ud(qkey), &cq, &cq).unwrap().ready().unwrap();
        qp.post_recv(RecvWr { wr_id: 7, sg_list: softrdma::sgl![mr.sge(4096, 4096).unwrap()] }).unwrap();
        (ctx, pd, cq, mr, qp)
    };
    let (ca, pda, cqa, mra, qpa) = side(3);
    let (cb, pdb, cqb, mrb, qpb) = side(4);

    // Refused: another port, a GID index not in the table, a flow label above 20 bits, no
    // destination, another address family.
    let to_b = AhAttr { traffic_class: 0x48, ..AhAttr::to_socket(cb.local_addr()) };
    for bad in [
        AhAttr { port_num: 2, ..to_b },
        AhAttr { sgid_index: Some(9), ..to_b },
        AhAttr { sgid_index: Some(0), ..to_b },
        AhAttr { flow_label: 1 << 20, ..to_b },
        AhAttr { dgid: [0; 16], ..to_b },
        AhAttr::to("::1".parse().unwrap()),
    ] {
        assert!(matches!(pda.create_ah(&bad), Err(Error::InvalidArgument(_))), "{bad:?}");
    }
    let ah = pda.create_ah(&to_b).unwrap();
    assert_eq!(ah.addr(), cb.local_addr());
    mra.write(0, b"ping").unwrap();
    let flags = SendFlags { signaled: true, ..Default::default() };
    let wr = |sge, dest| SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sg_list: softrdma::sgl![sge],
        flags,
        ud: Some(dest),
    };
    qpa.post_send(wr(mra.sge(0, 4).unwrap(), ah.dest(qpb.qpn(), qkey))).unwrap();
    assert_eq!(wait(&cqa).status, WcStatus::Success);
    let wc = wait(&cqb);
    assert_eq!((wc.status, wc.byte_len, wc.src_qp), (WcStatus::Success, 44, qpa.qpn()));
    let mut grh = [0u8; 40];
    mrb.read(4096, &mut grh).unwrap();
    let back = pdb.create_ah_from_wc(&wc, Some(&grh)).unwrap();
    assert_eq!(back.addr(), ca.local_addr(), "the handle answers the sender");
    assert_eq!(back.attr().traffic_class, 0x48, "the traffic class came through the IP TOS byte");
    let plain = pdb.create_ah_from_wc(&wc, None).unwrap();
    assert_eq!(plain.addr(), ca.local_addr());

    mrb.write(0, b"pong!").unwrap();
    qpb.post_send(wr(mrb.sge(0, 5).unwrap(), back.dest(qpa.qpn(), qkey))).unwrap();
    assert_eq!(wait(&cqb).status, WcStatus::Success);
    let wc = wait(&cqa);
    assert_eq!((wc.status, wc.byte_len, wc.src_qp), (WcStatus::Success, 45, qpb.qpn()));
    let mut got = [0u8; 5];
    mra.read(4096 + 40, &mut got).unwrap();
    assert_eq!(&got, b"pong!");
}
