//! Send-queue and receive-queue features in the simulator: shared receive queues, inline
//! data, scatter/gather lists, unsignaled WRs, fences, the outstanding READ/atomic limit,
//! SEND_WITH_INVALIDATE.

mod common;

use std::time::Duration;

use common::*;
use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::{QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus};
use softrdma_proto::sim::{ConnectParams, Impairments, Sim};

#[test]
fn two_qps_share_one_srq() {
    let mut sim = Sim::new(5, Impairments::from_percent(5.0, 1.0, 2.0, 0.5), 3);
    let srq = sim.nodes[2].endpoint.create_srq(64, 4);
    let (q0, r0) = sim.connect_srq(0, 2, QpType::Rc, ConnectParams::default(), Some(srq));
    let (q1, r1) = sim.connect_srq(1, 2, QpType::Rc, ConnectParams::default(), Some(srq));
    let (l2, _) = sim.nodes[2].mem.register(PdId(1), 0x5000_0000, 64 * 4096, Access::LOCAL_WRITE).unwrap();
    let mut src = Vec::new();
    for n in 0..2 {
        let (l, _) = sim.nodes[n].mem.register(PdId(1), 0x100_0000, 4096, Access::LOCAL_WRITE).unwrap();
        sim.nodes[n].mem.bytes_mut(l).unwrap().fill(0xA0 + n as u8);
        src.push(l);
    }
    for i in 0..8u64 {
        let sge = Sge { addr: 0x5000_0000 + 4096 * i, length: 4096, lkey: l2 };
        sim.nodes[2]
            .endpoint
            .srq_mut(srq)
            .unwrap()
            .post_recv(RecvWr { wr_id: i, sg_list: softrdma_proto::sgl![sge] })
            .unwrap();
    }
    assert!(sim.nodes[2]
        .endpoint
        .qp_mut(r0)
        .unwrap()
        .post_recv(RecvWr { wr_id: 0, sg_list: softrdma_proto::sgl![] })
        .is_err());
    for (n, q) in [(0, q0), (1, q1)] {
        for k in 0..4 {
            let wr = SendWr {
                wr_id: k,
                op: SendOp::SendWithImm(n as u32),
                sg_list: softrdma_proto::sgl![Sge { addr: 0x100_0000, length: 3000, lkey: src[n] }],
                flags: signaled(),
                ud: None,
            };
            let node = &mut sim.nodes[n];
            node.endpoint.qp_mut(q).unwrap().post_send(wr, &node.mem).unwrap();
        }
    }
    let mut got = Vec::new();
    sim.run_until(Duration::from_secs(60), |s| {
        for r in [r0, r1] {
            while let Some(wc) = s.nodes[2].endpoint.qp_mut(r).unwrap().poll_recv_completion() {
                got.push((r, wc));
            }
        }
        got.len() == 8
    });
    assert_eq!(got.len(), 8);
    let mut ids: Vec<u64> = got.iter().map(|(_, wc)| wc.wr_id).collect();
    ids.sort();
    assert_eq!(ids, (0..8).collect::<Vec<_>>(), "each SRQ WQE used once");
    for (r, wc) in &got {
        assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 3000));
        let n = wc.imm_data.unwrap() as usize;
        assert_eq!(*r, if n == 0 { r0 } else { r1 }, "completion on the QP the message came through");
        let buf = &sim.nodes[2].mem.bytes(l2).unwrap()[4096 * wc.wr_id as usize..][..3000];
        assert!(buf.iter().all(|&b| b == 0xA0 + n as u8));
    }
    assert!(sim.nodes[2].endpoint.srq_mut(srq).unwrap().is_empty());
}

#[test]
fn inline_gather_lists_and_unsignaled_wrs() {
    let mut p = Pair::new(21, Impairments::from_percent(5.0, 1.0, 2.0, 0.5));
    let a0 = p.a_bytes();
    p.post_recv(1, 4096);
    // An inline SEND is read at post time: changing the buffer afterwards changes nothing.
    let inline = SendFlags { signaled: true, inline: true, ..SendFlags::default() };
    p.post_send(SendWr {
        wr_id: 10,
        op: SendOp::Send,
        sg_list: sge(p.a.0, A_BASE, 300),
        flags: inline,
        ud: None,
    });
    p.sim.nodes[0].mem.bytes_mut(p.a.0).unwrap()[OFF..OFF + 300].fill(0);
    // An unsignaled WRITE gathered from three pieces, then a signaled one.
    let pieces = vec![
        Sge { addr: A_BASE + 5000, length: 1000, lkey: p.a.0 },
        Sge { addr: A_BASE + 9000, length: 7, lkey: p.a.0 },
        Sge { addr: A_BASE + 20000, length: 2500, lkey: p.a.0 },
    ];
    let op = SendOp::Write { remote_addr: B_BASE + 100_000, rkey: p.b.1 };
    p.post_send(SendWr { wr_id: 11, op, sg_list: pieces.into(), flags: SendFlags::default(), ud: None });
    p.post_send(SendWr {
        wr_id: 12,
        op: SendOp::Write { remote_addr: B_BASE + 200_000, rkey: p.b.1 },
        sg_list: sge(p.a.0, A_BASE, 8),
        flags: signaled(),
        ud: None,
    });
    let (s, r) = p.complete(2, 1);
    assert_eq!(
        s.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(10, WcStatus::Success), (12, WcStatus::Success)]
    );
    assert_eq!(r[0].byte_len, 300);
    let b = p.b_bytes();
    assert_eq!(&b[OFF..OFF + 300], &a0[OFF..OFF + 300], "inline data was taken at post time");
    let mut want = a0[5000..6000].to_vec();
    want.extend_from_slice(&a0[9000..9007]);
    want.extend_from_slice(&a0[20000..22500]);
    assert_eq!(&b[100_000..100_000 + want.len()], &want[..]);
}

#[test]
fn fence_and_the_outstanding_read_limit() {
    // One READ or atomic at a time: the second READ waits for the first, and the fenced
    // WRITE waits for both, so it sees the values the READs were answered with.
    let params = ConnectParams { rd_atomic: 1, ..ConnectParams::default() };
    let mut p = Pair::with(22, Impairments::default(), params);
    let b0 = p.b_bytes();
    for i in 0..2u64 {
        let op = SendOp::Read { remote_addr: B_BASE + 4096 * i, rkey: p.b.1 };
        p.post_send(SendWr {
            wr_id: i,
            op,
            sg_list: softrdma_proto::sgl![Sge { addr: A_BASE + 4096 * i, length: 64, lkey: p.a.0 }],
            flags: signaled(),
            ud: None,
        });
    }
    // The fenced WRITE overwrites what the READs read.
    // With one READ allowed in flight, the first round sends the first READ alone.
    p.sim.step();
    let sent = p.sim.nodes[0].endpoint.qp(p.qa).unwrap().stats().packets_sent;
    assert_eq!(sent, 1, "the second READ waits for the first's response");
    let fenced = SendFlags { signaled: true, fence: true, ..SendFlags::default() };
    let op = SendOp::Write { remote_addr: B_BASE, rkey: p.b.1 };
    p.post_send(SendWr {
        wr_id: 2,
        op,
        sg_list: softrdma_proto::sgl![Sge { addr: A_BASE + 50_000, length: 4096 + 64, lkey: p.a.0 }],
        flags: fenced,
        ud: None,
    });
    let (s, _) = p.complete(3, 0);
    assert!(s.iter().all(|w| w.status == WcStatus::Success));
    let a = p.a_bytes();
    assert_eq!(&a[..64], &b0[..64], "the READ saw memory before the WRITE");
    assert_eq!(&a[4096..4160], &b0[4096..4160]);
    let stats = p.sim.nodes[0].endpoint.qp(p.qa).unwrap().stats();
    assert_eq!(stats.retransmits, 0);
}

#[test]
fn send_with_invalidate_kills_the_key() {
    let mut p = Pair::new(23, Impairments::default());
    let (_, victim) = p.sim.nodes[1]
        .mem
        .register(PdId(1), 0xC000_0000, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    p.post_recv(1, 64);
    p.post_send(SendWr {
        wr_id: 1,
        op: SendOp::SendWithInv(victim),
        sg_list: sge(p.a.0, A_BASE, 16),
        flags: signaled(),
        ud: None,
    });
    let (s, r) = p.complete(1, 1);
    assert_eq!(s[0].status, WcStatus::Success);
    assert_eq!((r[0].opcode, r[0].invalidated_rkey), (WcOpcode::Recv, Some(victim)));
    // The key is dead now.
    p.post_send(SendWr {
        wr_id: 2,
        op: SendOp::Write { remote_addr: 0xC000_0000, rkey: victim },
        sg_list: sge(p.a.0, A_BASE, 8),
        flags: signaled(),
        ud: None,
    });
    let (s, _) = p.complete(1, 0);
    assert_eq!(s[0].status, WcStatus::RemAccessErr);
}
