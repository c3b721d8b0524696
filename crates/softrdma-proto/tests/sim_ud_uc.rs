//! UD and UC in the simulator.

use std::time::Duration;

use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::{
    Mtu, PostError, QpAttr, QpCaps, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest,
    WcStatus, WorkCompletion,
};
use softrdma_proto::sim::{ConnectParams, Impairments, Sim};
use softrdma_proto::wire::ip::Ipv4Repr;
use softrdma_proto::{Lkey, Qkey, Qpn};

const QKEY: Qkey = Qkey(0x1234_5678);
const BASE: u64 = 0x4000_0000;

fn ud_qp(sim: &mut Sim, node: usize, qkey: Qkey) -> Qpn {
    let q = sim.create_qp(node, QpType::Ud, PdId(1), QpCaps::default());
    let qp = sim.nodes[node].endpoint.qp_mut(q).unwrap();
    qp.set_ud_mtu(Mtu::Mtu1024);
    for attr in [
        QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            qkey: Some(qkey),
            ..Default::default()
        },
        QpAttr { state: Some(QpState::Rtr), ..Default::default() },
        QpAttr { state: Some(QpState::Rts), sq_psn: Some(softrdma_proto::Psn::new(0)), ..Default::default() },
    ] {
        qp.modify(&attr).unwrap();
    }
    q
}

fn region(sim: &mut Sim, node: usize) -> Lkey {
    let (l, _) = sim.nodes[node].mem.register(PdId(1), BASE, 1 << 16, Access::LOCAL_WRITE).unwrap();
    for (i, b) in sim.nodes[node].mem.bytes_mut(l).unwrap().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    l
}

fn recvs(sim: &mut Sim, node: usize, q: Qpn, n: usize) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    sim.run_until(Duration::from_secs(1), |s| {
        while let Some(wc) = s.nodes[node].endpoint.qp_mut(q).unwrap().poll_recv_completion() {
            got.push(wc);
        }
        got.len() >= n
    });
    got
}

#[test]
fn ud_send_lands_after_the_grh_area() {
    let mut sim = Sim::new(1, Impairments::default(), 2);
    let (qa, qb) = (ud_qp(&mut sim, 0, QKEY), ud_qp(&mut sim, 1, QKEY));
    let (la, lb) = (region(&mut sim, 0), region(&mut sim, 1));
    sim.nodes[1]
        .endpoint
        .qp_mut(qb)
        .unwrap()
        .post_recv(RecvWr {
            wr_id: 5,
            sg_list: softrdma_proto::sgl![Sge { addr: BASE, length: 40 + 1024, lkey: lb }],
        })
        .unwrap();
    let dest = UdDest { addr: Sim::addr_of(1), qpn: qb, qkey: QKEY, traffic_class: 0 };
    let wr = SendWr {
        wr_id: 6,
        op: SendOp::SendWithImm(0xFEED),
        sg_list: softrdma_proto::sgl![Sge { addr: BASE + 100, length: 1000, lkey: la }],
        flags: SendFlags { signaled: true, solicited: true, ..Default::default() },
        ud: Some(dest),
    };
    let node = &mut sim.nodes[0];
    node.endpoint.qp_mut(qa).unwrap().post_send(wr, &node.mem).unwrap();
    let r = recvs(&mut sim, 1, qb, 1);
    assert_eq!(r.len(), 1);
    let wc = r[0];
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (5, WcStatus::Success, 1040));
    assert_eq!((wc.src_qp, wc.imm_data, wc.grh, wc.solicited), (qa, Some(0xFEED), true, true));
    assert_eq!(wc.src, Some(Sim::addr_of(0)));
    let a = sim.nodes[0].mem.bytes(la).unwrap().to_vec();
    let b = sim.nodes[1].mem.bytes(lb).unwrap();
    assert_eq!(&b[40..1040], &a[100..1100]);
    assert!(b[..20].iter().all(|&x| x == 0), "IPv4: 20 zero bytes first");
    // The rebuilt IPv4 header: version 4, IHL 5, UDP, the datagram's length, a valid checksum.
    assert_eq!((b[20], b[29]), (0x45, 17));
    assert_eq!(u16::from_be_bytes([b[22], b[23]]) as usize, 20 + 8 + 12 + 8 + 4 + 1000 + 4);
    let mut hdr = [0u8; 20];
    hdr.copy_from_slice(&b[20..40]);
    let parsed = Ipv4Repr::parse(&[&hdr[..], &[0u8; 1036][..]].concat()).unwrap();
    let mut again = [0u8; 20];
    parsed.emit(&mut again);
    assert_eq!(again, hdr, "checksum valid");
    assert_eq!(&b[32..36], &[10, 0, 0, 1], "source address");
    assert_eq!(&b[36..40], &[10, 0, 0, 2], "destination address");
    let s = sim.nodes[0].endpoint.qp_mut(qa).unwrap().poll_send_completion().unwrap();
    assert_eq!((s.wr_id, s.status), (6, WcStatus::Success));
}

#[test]
fn ud_wrong_qkey_is_dropped_and_short_buffer_is_a_length_error() {
    let mut sim = Sim::new(2, Impairments::default(), 2);
    let (qa, qb) = (ud_qp(&mut sim, 0, QKEY), ud_qp(&mut sim, 1, QKEY));
    let (la, lb) = (region(&mut sim, 0), region(&mut sim, 1));
    let qp_b = sim.nodes[1].endpoint.qp_mut(qb).unwrap();
    qp_b.post_recv(RecvWr {
        wr_id: 1,
        sg_list: softrdma_proto::sgl![Sge { addr: BASE, length: 40 + 10, lkey: lb }],
    })
    .unwrap();
    qp_b.post_recv(RecvWr {
        wr_id: 2,
        sg_list: softrdma_proto::sgl![Sge { addr: BASE, length: 40 + 100, lkey: lb }],
    })
    .unwrap();
    let send = |qkey, len| SendWr {
        wr_id: 0,
        op: SendOp::Send,
        sg_list: softrdma_proto::sgl![Sge { addr: BASE, length: len, lkey: la }],
        flags: SendFlags::default(),
        ud: Some(UdDest { addr: Sim::addr_of(1), qpn: qb, qkey, traffic_class: 0 }),
    };
    let node = &mut sim.nodes[0];
    let qp_a = node.endpoint.qp_mut(qa).unwrap();
    qp_a.post_send(send(Qkey(0x1111), 5), &node.mem).unwrap();
    qp_a.post_send(send(QKEY, 11), &node.mem).unwrap();
    qp_a.post_send(send(QKEY, 100), &node.mem).unwrap();
    assert_eq!(qp_a.post_send(send(QKEY, 1025), &node.mem), Err(PostError::MessageTooLong), "UD is one MTU");
    let r = recvs(&mut sim, 1, qb, 2);
    assert_eq!(
        r.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::LocLenErr), (2, WcStatus::Success)]
    );
    assert_eq!(sim.nodes[1].endpoint.qp(qb).unwrap().stats().dropped, 1, "the wrong Q_Key");
    assert_eq!(sim.nodes[1].endpoint.qp(qb).unwrap().state(), QpState::Rts, "UD errors do not fail the QP");
}

#[test]
fn uc_delivers_whole_messages_or_none() {
    // Over a lossy network UC loses messages but never delivers a damaged or partial one.
    let mut sim = Sim::new(3, Impairments::from_percent(5.0, 2.0, 5.0, 1.0), 2);
    let params = ConnectParams { access: Access::REMOTE_WRITE, ..ConnectParams::default() };
    let (qa, qb) = sim.connect(0, 1, QpType::Uc, params);
    let (la, lb) = (region(&mut sim, 0), region(&mut sim, 1));
    let n = 40u64;
    let len = 3000u32;
    let mut delivered = 0;
    for i in 0..n {
        sim.nodes[1]
            .endpoint
            .qp_mut(qb)
            .unwrap()
            .post_recv(RecvWr {
                wr_id: i,
                sg_list: softrdma_proto::sgl![Sge { addr: BASE + 4096 * (i % 8), length: 4096, lkey: lb }],
            })
            .unwrap();
    }
    for i in 0..n {
        let wr = SendWr {
            wr_id: i,
            op: SendOp::SendWithImm(i as u32),
            sg_list: softrdma_proto::sgl![Sge { addr: BASE + 7 * i, length: len, lkey: la }],
            flags: SendFlags { signaled: true, ..Default::default() },
            ud: None,
        };
        let node = &mut sim.nodes[0];
        node.endpoint.qp_mut(qa).unwrap().post_send(wr, &node.mem).unwrap();
        // One message at a time, so each landed buffer can be checked before reuse; every
        // completion that comes is checked (a message delivered twice shows as two).
        let got = recvs(&mut sim, 1, qb, 2);
        assert!(got.len() <= 1, "message {i} delivered {} times", got.len());
        delivered += got.len() as u64;
        for wc in &got {
            assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, len));
            let k = wc.imm_data.unwrap() as u64;
            let a = sim.nodes[0].mem.bytes(la).unwrap();
            let b = sim.nodes[1].mem.bytes(lb).unwrap();
            let slot = (4096 * (wc.wr_id % 8)) as usize;
            assert_eq!(
                &b[slot..slot + len as usize],
                &a[7 * k as usize..7 * k as usize + len as usize],
                "message {k}"
            );
        }
    }
    let mut sent = 0;
    while let Some(wc) = sim.nodes[0].endpoint.qp_mut(qa).unwrap().poll_send_completion() {
        assert_eq!(wc.status, WcStatus::Success);
        sent += 1;
    }
    assert_eq!(sent, n, "UC completes sends once they are out");
    // The network took some messages (so the test saw partial ones dropped) and left most.
    let dropped = sim.nodes[1].endpoint.qp(qb).unwrap().stats().dropped;
    assert!(delivered < n && delivered >= n / 2, "{delivered} of {n} messages delivered");
    assert!(dropped > 0, "the receiver dropped the rest of a damaged message");
}
