//! Limits are typed errors, and a thousand QPs with traffic on every one lose nothing.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use softrdma::{
    Access, ConnectOptions, Context, Error, QpBuilder, QpCaps, RecvWr, SendFlags, SendOp, SendWr, WcStatus,
};

#[test]
fn limits_are_typed_errors() {
    let ctx = Context::open_port(IpAddr::from([127, 0, 5, 2]), 0).unwrap();
    let pd = ctx.alloc_pd();
    assert!(matches!(ctx.create_cq(0, None), Err(Error::InvalidArgument(_))));
    assert!(matches!(ctx.create_cq(softrdma::MAX_CQE + 1, None), Err(Error::InvalidArgument(_))));
    let cq = ctx.create_cq(16, None).unwrap();
    let big = QpCaps { max_send_wr: softrdma::MAX_QP_WR + 1, ..QpCaps::default() };
    assert!(matches!(pd.prepare_qp(&QpBuilder::rc().caps(big), &cq, &cq), Err(Error::Limit("max_qp_wr"))));
    let sges = QpCaps { max_send_sge: softrdma::MAX_SGE + 1, ..QpCaps::default() };
    assert!(matches!(pd.prepare_qp(&QpBuilder::rc().caps(sges), &cq, &cq), Err(Error::Limit("max_sge"))));
    let inline = QpCaps { max_inline_data: softrdma::MAX_INLINE + 1, ..QpCaps::default() };
    assert!(matches!(pd.prepare_qp(&QpBuilder::rc().caps(inline), &cq, &cq), Err(Error::Limit(_))));
    assert!(matches!(pd.register(16, Access::REMOTE_WRITE), Err(Error::InvalidArgument(_))));
    // A full send queue refuses the next WR; nothing is queued.
    let caps = QpCaps { max_send_wr: 4, ..QpCaps::default() };
    let p = pd.prepare_qp(&QpBuilder::rc().caps(caps), &cq, &cq).unwrap();
    let me = p.endpoint();
    // Connected to itself's address with a QPN nobody has: nothing is ever answered.
    let qp = p.handshake(&softrdma::EndpointInfo { qpn: 0xABCDE, ..me }, &ConnectOptions::default()).unwrap();
    let mr = pd.register(8, Access::NONE).unwrap();
    let wr = || SendWr {
        wr_id: 0,
        op: SendOp::Send,
        sg_list: softrdma::sgl![mr.sge(0, 8).unwrap()],
        flags: SendFlags::default(),
        ud: None,
    };
    for _ in 0..4 {
        qp.post_send(wr()).unwrap();
    }
    let e = qp.post_send(wr()).unwrap_err();
    assert!(matches!(e, Error::Post(softrdma::proto::qp::PostError::QueueFull)));
    assert_eq!(e.errno(), libc_enomem());
}

fn libc_enomem() -> i32 {
    12
}

#[test]
fn a_thousand_qps_with_traffic_on_every_one() {
    let (ca, cb) = (
        Context::open_port(IpAddr::from([127, 0, 5, 3]), 0).unwrap(),
        Context::open_port(IpAddr::from([127, 0, 5, 4]), 0).unwrap(),
    );
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (cqa, cqb) = (ca.create_cq(4096, None).unwrap(), cb.create_cq(4096, None).unwrap());
    let n = 1000;
    let src = pa.register(64 * n, Access::NONE).unwrap();
    let dst = pb.register(64 * n, Access::LOCAL_WRITE).unwrap();
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, ..QpCaps::default() };
    let mut qps = Vec::new();
    for i in 0..n {
        let qa = pa.prepare_qp(&QpBuilder::rc().caps(caps), &cqa, &cqa).unwrap();
        let qb = pb.prepare_qp(&QpBuilder::rc().caps(caps), &cqb, &cqb).unwrap();
        qb.post_recv(RecvWr { wr_id: i as u64, sg_list: softrdma::sgl![dst.sge(64 * i, 64).unwrap()] })
            .unwrap();
        let (ea, eb) = (qa.endpoint(), qb.endpoint());
        qps.push((
            qa.handshake(&eb, &ConnectOptions::default()).unwrap(),
            qb.handshake(&ea, &ConnectOptions::default()).unwrap(),
        ));
    }
    let data: Vec<u8> = (0..64 * n).map(|k| (k % 241) as u8).collect();
    src.write(0, &data).unwrap();
    for (i, (qa, _)) in qps.iter().enumerate() {
        let flags = SendFlags { signaled: true, ..Default::default() };
        qa.post_send(SendWr {
            wr_id: i as u64,
            op: SendOp::Send,
            sg_list: softrdma::sgl![src.sge(64 * i, 64).unwrap()],
            flags,
            ud: None,
        })
        .unwrap();
    }
    let (mut sends, mut recvs) = (vec![false; n], vec![false; n]);
    let (mut ns, mut nr) = (0, 0);
    let t = Instant::now();
    while ns < n || nr < n {
        assert!(t.elapsed() < Duration::from_secs(60), "{ns} sends, {nr} receives completed");
        while let Some(wc) = cqa.poll_one() {
            assert_eq!(wc.status, WcStatus::Success);
            assert!(!std::mem::replace(&mut sends[wc.wr_id as usize], true), "completed twice");
            ns += 1;
        }
        while let Some(wc) = cqb.poll_one() {
            assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 64));
            assert!(!std::mem::replace(&mut recvs[wc.wr_id as usize], true), "completed twice");
            nr += 1;
        }
    }
    assert_eq!(dst.to_vec(), data);
}

/// Each advertised limit admits its maximum and refuses one more, with a typed error.
#[test]
fn every_limit_admits_its_maximum_and_refuses_one_more() {
    use softrdma::{MAX_MR, MAX_MR_SIZE, MAX_QP, MAX_QP_RD_ATOM, MAX_QP_WR, MAX_SGE};
    let ctx = Context::open_port(IpAddr::from([127, 0, 5, 5]), 0).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(16, None).unwrap();
    let attr = ctx.query_device();
    assert_eq!((attr.max_qp, attr.max_mr, attr.max_mr_size), (MAX_QP, MAX_MR, MAX_MR_SIZE));

    // Region size: a large region is lazily zeroed memory, not an abort; more than
    // max_mr_size is refused before any allocation; the maximum itself is either granted
    // or refused for want of memory, never an abort.
    let big = pd.register(1 << 30, Access::LOCAL_WRITE).unwrap();
    assert_eq!(big.len(), 1 << 30);
    drop(big);
    for len in [MAX_MR_SIZE as usize + 1, usize::MAX] {
        let e = pd.register(len, Access::LOCAL_WRITE).unwrap_err();
        assert!(matches!(e, Error::Limit(l) if l.starts_with("max_mr_size")), "{len}: {e}");
        assert_eq!(e.errno(), libc_enomem());
    }
    match pd.register(MAX_MR_SIZE as usize, Access::LOCAL_WRITE) {
        Ok(mr) => assert_eq!(mr.len() as u64, MAX_MR_SIZE),
        Err(e) => assert!(matches!(e, Error::OutOfMemory { .. }), "{e}"),
    }

    // Receive queue depth and scatter/gather entries, as the send side's.
    let ok = QpCaps { max_recv_wr: MAX_QP_WR, max_recv_sge: MAX_SGE, ..QpCaps::default() };
    pd.prepare_qp(&QpBuilder::rc().caps(ok), &cq, &cq).unwrap();
    let wr = QpCaps { max_recv_wr: MAX_QP_WR + 1, ..QpCaps::default() };
    assert!(matches!(pd.prepare_qp(&QpBuilder::rc().caps(wr), &cq, &cq), Err(Error::Limit("max_qp_wr"))));
    let sge = QpCaps { max_recv_sge: MAX_SGE + 1, ..QpCaps::default() };
    assert!(matches!(pd.prepare_qp(&QpBuilder::rc().caps(sge), &cq, &cq), Err(Error::Limit("max_sge"))));
    // A receive with more entries than the QP was created for is refused.
    let two = QpCaps { max_recv_sge: 2, ..QpCaps::default() };
    let p = pd.prepare_qp(&QpBuilder::rc().caps(two), &cq, &cq).unwrap();
    let mr = pd.register(64, Access::LOCAL_WRITE).unwrap();
    let sges = |n: usize| (0..n).map(|k| mr.sge(8 * k, 8).unwrap()).collect::<Vec<_>>();
    p.post_recv(RecvWr { wr_id: 1, sg_list: sges(2).into() }).unwrap();
    assert!(matches!(p.post_recv(RecvWr { wr_id: 2, sg_list: sges(3).into() }), Err(Error::Post(_))));

    // A peer of the other IP family is refused at once, not after the retries run out.
    let v6 = softrdma::EndpointInfo { addr: "[::1]:4791".parse().unwrap(), ..p.endpoint() };
    let e = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap().handshake(&v6, &ConnectOptions::default());
    assert!(matches!(e, Err(Error::InvalidArgument(m)) if m.contains("IP family")), "{:?}", e.map(|_| ()));

    // READs and atomics in flight: the maximum connects, one more is refused.
    let me = p.endpoint();
    let peer = softrdma::EndpointInfo { qpn: 0xABCDE, ..me };
    let with = |rd_atomic| ConnectOptions { rd_atomic, ..ConnectOptions::default() };
    pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap().handshake(&peer, &with(MAX_QP_RD_ATOM)).unwrap();
    let e = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap().handshake(&peer, &with(MAX_QP_RD_ATOM + 1));
    let range = softrdma::proto::qp::ModifyError::OutOfRange("max_rd_atomic");
    assert!(matches!(e, Err(Error::Modify(m)) if m == range), "{:?}", e.map(|_| ()));
    drop((p, mr));

    // Memory regions: exactly MAX_MR of them, whatever their size.
    let mrs: Vec<_> = (0..MAX_MR).map(|_| pd.register(1, Access::NONE).unwrap()).collect();
    assert!(matches!(pd.register(1, Access::NONE), Err(Error::Limit("max_mr"))));
    drop(mrs);
    pd.register(1, Access::NONE).unwrap();

    // QPs: exactly MAX_QP of them.
    let qps: Vec<_> = (0..MAX_QP).map(|_| pd.create_qp(&QpBuilder::rc(), &cq, &cq).unwrap()).collect();
    assert!(matches!(pd.create_qp(&QpBuilder::rc(), &cq, &cq), Err(Error::Limit("max_qp"))));
    drop(qps);
    pd.create_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
}
