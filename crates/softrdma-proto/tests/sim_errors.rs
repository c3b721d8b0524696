//! Error scenarios in the simulator: each failure gives the status the spec gives, fails
//! the QPs it should, flushes what was queued, and changes no byte it must not.

mod common;

use std::time::Duration;

use common::*;
use softrdma_proto::endpoint::Arrival;
use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::{
    ModifyError, PostError, QpAttr, QpState, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};
use softrdma_proto::sim::{ConnectParams, Impairments};
use softrdma_proto::Rkey;

fn write_to(p: &Pair, rkey: Rkey, remote_addr: u64, len: usize) -> SendWr {
    SendWr {
        wr_id: 1,
        op: SendOp::Write { remote_addr, rkey },
        sg_list: sge(p.a.0, A_BASE, len),
        flags: signaled(),
        ud: None,
    }
}

fn state(p: &Pair, node: usize) -> QpState {
    let qpn = if node == 0 { p.qa } else { p.qb };
    p.sim.nodes[node].endpoint.qp(qpn).unwrap().state()
}

/// Posts one more WR and one more receive after a failure: both must be flushed.
fn assert_flushes(p: &mut Pair) {
    p.post_send(SendWr {
        wr_id: 99,
        op: SendOp::Send,
        sg_list: softrdma_proto::sgl![],
        flags: Default::default(),
        ud: None,
    });
    let wc = p.sim.nodes[0].endpoint.qp_mut(p.qa).unwrap().poll_send_completion().unwrap();
    assert_eq!((wc.wr_id, wc.status), (99, WcStatus::WrFlushErr), "even an unsignaled WR");
}

#[test]
fn bad_rkey_is_remote_access_error_and_changes_nothing() {
    let mut p = Pair::new(1, Impairments::default());
    let b0 = p.b_bytes();
    let bad = Rkey(p.b.1.get() ^ 0x5A5A_0001);
    p.post_send(write_to(&p, bad, B_BASE + OFF as u64, 100));
    // A second WR behind the failing one is flushed.
    p.post_send(write_to(&p, p.b.1, B_BASE + OFF as u64, 100));
    let (s, _) = p.complete(2, 0);
    assert_eq!(s[0].status, WcStatus::RemAccessErr);
    assert_eq!(s[1].status, WcStatus::WrFlushErr);
    assert_eq!(p.b_bytes(), b0);
    assert_eq!(state(&p, 0), QpState::Error);
    assert_eq!(state(&p, 1), QpState::Error, "the responder fails too");
    assert_flushes(&mut p);
}

#[test]
fn write_past_the_region_end_is_refused_whole() {
    let mut p = Pair::new(2, Impairments::default());
    let b0 = p.b_bytes();
    // Starts inside, ends 1 byte past the end: not one byte may land.
    let start = B_BASE + REGION as u64 - 3000;
    p.post_send(write_to(&p, p.b.1, start, 3001));
    let (s, _) = p.complete(1, 0);
    assert_eq!(s[0].status, WcStatus::RemAccessErr);
    assert_eq!(p.b_bytes(), b0);
    assert!(p.sim.nodes[1].mem.writes().is_empty());
}

#[test]
fn missing_rights_region_and_qp() {
    // The region lacks REMOTE_WRITE: remote access error.
    let mut p = Pair::new(3, Impairments::default());
    let (lkey, rkey) = p.sim.nodes[1]
        .mem
        .register(PdId(1), 0x9000_0000, 4096, Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    let _ = lkey;
    p.post_send(write_to(&p, rkey, 0x9000_0000, 16));
    let (s, _) = p.complete(1, 0);
    assert_eq!(s[0].status, WcStatus::RemAccessErr);

    // The QP lacks REMOTE_READ: invalid request (rxe checks QP rights before the key).
    let params = ConnectParams { access: Access::REMOTE_WRITE, ..ConnectParams::default() };
    let mut p = Pair::with(4, Impairments::default(), params);
    let op = SendOp::Read { remote_addr: B_BASE, rkey: p.b.1 };
    p.post_send(SendWr { wr_id: 5, op, sg_list: sge(p.a.0, A_BASE, 64), flags: signaled(), ud: None });
    let (s, _) = p.complete(1, 0);
    assert_eq!(s[0].status, WcStatus::RemInvReqErr);

    // A key from another protection domain never works.
    let mut p = Pair::new(5, Impairments::default());
    let (_, other_pd_key) = p.sim.nodes[1].mem.register(PdId(2), 0xA000_0000, 4096, all_access()).unwrap();
    p.post_send(write_to(&p, other_pd_key, 0xA000_0000, 8));
    let (s, _) = p.complete(1, 0);
    assert_eq!(s[0].status, WcStatus::RemAccessErr);
}

#[test]
fn misaligned_atomic_is_invalid_request() {
    let mut p = Pair::new(6, Impairments::default());
    let b0 = p.b_bytes();
    let op = SendOp::FetchAdd { remote_addr: B_BASE + 4, rkey: p.b.1, add: 1 };
    p.post_send(SendWr { wr_id: 1, op, sg_list: sge(p.a.0, A_BASE, 8), flags: signaled(), ud: None });
    let (s, _) = p.complete(1, 0);
    assert_eq!((s[0].status, s[0].opcode), (WcStatus::RemInvReqErr, WcOpcode::FetchAdd));
    assert_eq!(p.b_bytes(), b0);
}

#[test]
fn rnr_retries_exhausted() {
    let params = ConnectParams { rnr_retry: 2, min_rnr_timer: 5, ..ConnectParams::default() };
    let mut p = Pair::with(7, Impairments::default(), params);
    p.post_send(SendWr {
        wr_id: 8,
        op: SendOp::Send,
        sg_list: sge(p.a.0, A_BASE, 10),
        flags: signaled(),
        ud: None,
    });
    let t0 = p.sim.now;
    let (s, _) = p.complete(1, 0);
    assert_eq!(s[0].status, WcStatus::RnrRetryExcErr);
    let stats = p.sim.nodes[0].endpoint.qp(p.qa).unwrap().stats();
    assert_eq!(stats.rnr_naks_received, 3, "the first try and two retries");
    // Timer code 5 is 60 µs; two back-offs happened.
    assert!(p.sim.now - t0 >= Duration::from_micros(120));
}

#[test]
fn rnr_then_a_receive_is_posted_and_it_succeeds() {
    let mut p = Pair::new(8, Impairments::default());
    let a0 = p.a_bytes();
    p.post_send(SendWr {
        wr_id: 8,
        op: SendOp::Send,
        sg_list: sge(p.a.0, A_BASE, 3000),
        flags: signaled(),
        ud: None,
    });
    let until = p.sim.now + Duration::from_millis(5);
    p.sim.run_until(Duration::from_millis(5), |s| s.now >= until);
    assert!(p.sim.nodes[0].endpoint.qp(p.qa).unwrap().stats().rnr_naks_received > 0);
    p.post_recv(1, 4096);
    let (s, r) = p.complete(1, 1);
    assert_eq!((s[0].status, r[0].status, r[0].byte_len), (WcStatus::Success, WcStatus::Success, 3000));
    assert_eq!(&p.b_bytes()[OFF..OFF + 3000], &a0[OFF..OFF + 3000]);
}

#[test]
fn peer_gone_is_retry_exceeded_after_the_configured_time() {
    // timeout 14 = 67.1 ms, retry_cnt 3: four timeouts.
    let params = ConnectParams { timeout: 14, retry_cnt: 3, ..ConnectParams::default() };
    let mut p = Pair::with(9, Impairments::default(), params);
    p.sim.nodes[1].endpoint.destroy_qp(p.qb);
    let t0 = p.sim.now;
    p.post_send(write_to(&p, p.b.1, B_BASE, 64));
    let qa = p.qa;
    let mut wc = None;
    p.sim.run_until(Duration::from_secs(10), |s| {
        wc = s.nodes[0].endpoint.qp_mut(qa).unwrap().poll_send_completion();
        wc.is_some()
    });
    assert_eq!(wc.unwrap().status, WcStatus::RetryExcErr);
    let elapsed = p.sim.now - t0;
    let one = Duration::from_nanos(4096 << 14);
    assert!(elapsed >= one * 4 && elapsed < one * 5, "{elapsed:?}");
    assert_eq!(p.sim.nodes[0].endpoint.qp(qa).unwrap().stats().timeouts, 4);
    assert_flushes(&mut p);
}

#[test]
fn receive_buffer_too_small() {
    let mut p = Pair::new(10, Impairments::default());
    p.post_recv(3, 100);
    p.post_send(SendWr {
        wr_id: 4,
        op: SendOp::Send,
        sg_list: sge(p.a.0, A_BASE, 101),
        flags: signaled(),
        ud: None,
    });
    let (s, r) = p.complete(1, 1);
    assert_eq!(s[0].status, WcStatus::RemInvReqErr);
    assert_eq!((r[0].wr_id, r[0].status), (3, WcStatus::LocLenErr));
}

#[test]
fn bad_lkey_is_local_protection_error() {
    let mut p = Pair::new(11, Impairments::default());
    let mut wr = write_to(&p, p.b.1, B_BASE, 64);
    wr.sg_list[0].lkey = softrdma_proto::Lkey(p.a.0.get().wrapping_add(1));
    p.post_send(wr);
    let (s, _) = p.complete(1, 0);
    assert_eq!(s[0].status, WcStatus::LocProtErr);
    assert_eq!(state(&p, 0), QpState::Error);
}

#[test]
fn flush_on_error_completes_every_queued_wr_in_order() {
    let mut p = Pair::new(12, Impairments::default());
    for i in 0..5 {
        p.post_recv(100 + i, 64);
    }
    for i in 0..4 {
        let flags = Default::default(); // unsignaled
        p.post_send(SendWr { wr_id: i, op: SendOp::Send, sg_list: sge(p.a.0, A_BASE, 8), flags, ud: None });
    }
    let qa = p.qa;
    p.sim.nodes[0]
        .endpoint
        .qp_mut(qa)
        .unwrap()
        .modify(&QpAttr { state: Some(QpState::Error), ..Default::default() })
        .unwrap();
    let qb = p.qb;
    p.sim.nodes[1]
        .endpoint
        .qp_mut(qb)
        .unwrap()
        .modify(&QpAttr { state: Some(QpState::Error), ..Default::default() })
        .unwrap();
    let (s, r) = p.complete(4, 5);
    // Some sends may have completed before the error; the unsignaled ones left no trace.
    assert!(s.iter().all(|w| w.status == WcStatus::WrFlushErr));
    assert_eq!(s.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert!(r.iter().all(|w| w.status == WcStatus::WrFlushErr && w.opcode == WcOpcode::Recv));
    assert_eq!(r.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![100, 101, 102, 103, 104]);
}

#[test]
fn modify_rules_and_post_limits() {
    let mut p = Pair::new(13, Impairments::default());
    let qp = p.sim.nodes[0].endpoint.qp_mut(p.qa).unwrap();
    // RTS -> RTR is not a transition.
    let e = qp.modify(&QpAttr { state: Some(QpState::Rtr), ..Default::default() }).unwrap_err();
    assert!(matches!(e, ModifyError::InvalidTransition { .. }));
    // RTS -> RTS may not change the path MTU.
    let e = qp
        .modify(&QpAttr { path_mtu: Some(softrdma_proto::qp::Mtu::Mtu256), ..Default::default() })
        .unwrap_err();
    assert_eq!(e, ModifyError::NotAllowed("path_mtu"));
    assert_eq!(qp.state(), QpState::Rts, "nothing changed");
    assert_eq!(qp.mtu(), softrdma_proto::qp::Mtu::Mtu1024);

    // A fresh QP: INIT needs the access flags; RTR needs its attributes; ranges are checked.
    let q = p.sim.create_qp(0, softrdma_proto::qp::QpType::Rc, PdId(1), Default::default());
    let node = &mut p.sim.nodes[0];
    let qp = node.endpoint.qp_mut(q).unwrap();
    let init =
        QpAttr { state: Some(QpState::Init), pkey_index: Some(0), port: Some(1), ..Default::default() };
    assert_eq!(qp.modify(&init), Err(ModifyError::Missing("access_flags")));
    assert_eq!(
        qp.modify(&QpAttr { port: Some(2), access_flags: Some(Access::NONE), ..init }),
        Err(ModifyError::OutOfRange("port"))
    );
    qp.modify(&QpAttr { access_flags: Some(Access::NONE), ..init }).unwrap();
    let rtr = QpAttr { state: Some(QpState::Rtr), ..Default::default() };
    assert_eq!(qp.modify(&rtr), Err(ModifyError::Missing("path_mtu")));
    assert_eq!(qp.state(), QpState::Init);
    let e = qp.post_send(
        SendWr {
            wr_id: 0,
            op: SendOp::Send,
            sg_list: softrdma_proto::sgl![],
            flags: Default::default(),
            ud: None,
        },
        &node.mem,
    );
    assert_eq!(e, Err(PostError::InvalidState(QpState::Init)));

    let node = &mut p.sim.nodes[0];
    let qp = node.endpoint.qp_mut(p.qa).unwrap();
    let many = vec![Sge { addr: A_BASE, length: 1, lkey: p.a.0 }; 33];
    assert_eq!(qp.post_recv(RecvWr { wr_id: 0, sg_list: many.into() }), Err(PostError::TooManySge));
    let cas = SendOp::CompareSwap { remote_addr: B_BASE, rkey: p.b.1, compare: 0, swap: 1 };
    let e = qp.post_send(
        SendWr { wr_id: 0, op: cas, sg_list: sge(p.a.0, A_BASE, 4), flags: signaled(), ud: None },
        &node.mem,
    );
    assert_eq!(e, Err(PostError::AtomicBuffer));
    for i in 0..1024 {
        qp.post_recv(RecvWr { wr_id: i, sg_list: softrdma_proto::sgl![] }).unwrap();
    }
    assert_eq!(qp.post_recv(RecvWr { wr_id: 0, sg_list: softrdma_proto::sgl![] }), Err(PostError::QueueFull));
}

#[test]
fn a_flood_of_duplicate_reads_is_not_amplified() {
    use softrdma_proto::wire::{icrc, BthRepr, Opcode, PacketRepr, RethRepr};
    let mut p = Pair::new(30, Impairments::default());
    // One legitimate 64 KiB READ, completed.
    let op = SendOp::Read { remote_addr: B_BASE, rkey: p.b.1 };
    p.post_send(SendWr { wr_id: 1, op, sg_list: sge(p.a.0, A_BASE, 65536), flags: signaled(), ud: None });
    let (s, _) = p.complete(1, 0);
    assert_eq!(s[0].status, WcStatus::Success);
    // Now 10,000 copies of that READ request arrive from the peer's address, at once.
    let qp = p.sim.nodes[0].endpoint.qp(p.qa).unwrap();
    let first = softrdma_proto::Psn::new(0xFF_FF00);
    let _ = qp;
    let mut r = PacketRepr::new(BthRepr::new(Opcode::new(0x0C).unwrap(), p.qb, first), 0);
    r.ext.reth = Some(RethRepr { va: B_BASE, rkey: p.b.1, dma_len: 65536 });
    let encap =
        icrc::Encap::new(softrdma_proto::sim::Sim::addr_of(0), softrdma_proto::sim::Sim::addr_of(1)).unwrap();
    let mut buf = vec![0u8; r.total_len()];
    r.emit(&mut buf, &[], &encap).unwrap();
    let sent_before = p.sim.net.stats().sent;
    for _ in 0..10_000 {
        p.sim.net.send(
            p.sim.now,
            softrdma_proto::sim::Sim::addr_of(0),
            softrdma_proto::sim::Sim::addr_of(1),
            buf.clone(),
        );
    }
    let until = p.sim.now + Duration::from_millis(50);
    p.sim.run_until(Duration::from_millis(50), |s| s.now >= until);
    let responses = p.sim.net.stats().sent - sent_before - 10_000;
    // Each replay is 64 packets; without a bound this would be 640,000.
    assert!(responses < 64 * 64, "{responses} response packets for a flood of duplicates");
    assert!(p.sim.nodes[1].endpoint.qp(p.qb).unwrap().stats().dropped > 9_000);
    // The connection still works.
    p.post_recv(2, 64);
    p.post_send(SendWr {
        wr_id: 2,
        op: SendOp::Send,
        sg_list: sge(p.a.0, A_BASE, 64),
        flags: signaled(),
        ud: None,
    });
    let (s, r) = p.complete(1, 1);
    assert_eq!((s[0].status, r[0].status), (WcStatus::Success, WcStatus::Success));
}

#[test]
fn foreign_peers_are_checked_without_the_ipv4_identification() {
    use softrdma_proto::sim::Sim;
    use softrdma_proto::wire::{icrc, BthRepr, Opcode, PacketRepr};
    // A SEND from node 0's address whose ICRC covers Identification 4242, as Linux rxe's
    // kernel might have sent it.
    let packet = |p: &Pair| {
        let mut bth = BthRepr::new(Opcode::new(0x04).unwrap(), p.qb, softrdma_proto::Psn::new(0xFF_FF00));
        bth.ack_req = true;
        let r = PacketRepr::new(bth, 5);
        let encap = icrc::Encap::new(Sim::addr_of(0), Sim::addr_of(1)).unwrap().with_ipv4_ident(4242, true);
        let mut buf = vec![0u8; r.total_len()];
        r.emit(&mut buf, b"hello", &encap).unwrap();
        buf
    };
    for foreign in [false, true] {
        let mut p = Pair::new(40, Impairments::default());
        p.sim.nodes[1].endpoint.qp_mut(p.qb).unwrap().set_foreign_peer(foreign);
        p.post_recv(1, 64);
        let bytes = packet(&p);
        let node = &mut p.sim.nodes[1];
        node.endpoint.handle_datagram(
            p.sim.now,
            Arrival::new(Sim::addr_of(0), Sim::addr_of(1)),
            &bytes,
            &mut node.mem,
        );
        let wc = node.endpoint.qp_mut(p.qb).unwrap().poll_recv_completion();
        if foreign {
            assert_eq!(wc.map(|w| (w.status, w.byte_len)), Some((WcStatus::Success, 5)));
            assert_eq!(node.endpoint.stats().icrc_errors, 0);
            // One flipped bit is still caught.
            let mut bad = bytes.clone();
            bad[20] ^= 1;
            node.endpoint.handle_datagram(
                p.sim.now,
                Arrival::new(Sim::addr_of(0), Sim::addr_of(1)),
                &bad,
                &mut node.mem,
            );
            assert_eq!(node.endpoint.stats().icrc_errors, 1);
        } else {
            assert!(wc.is_none(), "a softrdma peer's packets must match with ID 0: all 32 bits");
            assert_eq!(node.endpoint.stats().icrc_errors, 1);
        }
    }
}

/// rxe's P_Key rule: a packet's P_Key must match table entry 0 (0xFFFF) — equal low 15
/// bits, one side a full member — or it is dropped and counted, reaching no QP.
#[test]
fn pkey_mismatch_is_dropped_and_counted() {
    use softrdma_proto::sim::Sim;
    use softrdma_proto::wire::{icrc, BthRepr, Opcode, PacketRepr};
    let packet = |p: &Pair, pkey: u16, psn: u32| {
        let mut bth = BthRepr::new(Opcode::new(0x04).unwrap(), p.qb, softrdma_proto::Psn::new(psn));
        bth.ack_req = true;
        bth.pkey = pkey;
        let r = PacketRepr::new(bth, 5);
        let encap = icrc::Encap::new(Sim::addr_of(0), Sim::addr_of(1)).unwrap();
        let mut buf = vec![0u8; r.total_len()];
        r.emit(&mut buf, b"hello", &encap).unwrap();
        buf
    };
    let mut p = Pair::new(41, Impairments::default());
    p.post_recv(1, 64);
    p.post_recv(2, 64);
    let recv = |p: &mut Pair, pkey, psn| {
        let bytes = packet(p, pkey, psn);
        let node = &mut p.sim.nodes[1];
        node.endpoint.handle_datagram(
            p.sim.now,
            Arrival::new(Sim::addr_of(0), Sim::addr_of(1)),
            &bytes,
            &mut node.mem,
        );
        node.endpoint.qp_mut(p.qb).unwrap().poll_recv_completion()
    };
    // Another partition, a limited member of ours, and the invalid key 0.
    for bad in [0x1234, 0x8001, 0x0000, 0x8000] {
        assert!(recv(&mut p, bad, 0xFF_FF00).is_none(), "P_Key {bad:#x} must be dropped");
    }
    assert_eq!(p.sim.nodes[1].endpoint.stats().pkey_violations, 4);
    assert_eq!(p.sim.nodes[1].endpoint.qp(p.qb).unwrap().stats().dropped, 0, "no QP saw them");
    // A limited member of the default partition matches our full membership.
    let wc = recv(&mut p, 0x7FFF, 0xFF_FF00);
    assert_eq!(wc.map(|w| (w.status, w.byte_len)), Some((WcStatus::Success, 5)));
    assert_eq!(p.sim.nodes[1].endpoint.stats().pkey_violations, 4);
}
