//! Feeds a connected RC or UC queue pair (the input's first byte chooses) a sequence of
//! arbitrary packets from its peer's address, each given a valid ICRC so that it reaches
//! the transport: the responder and completer must never panic, whatever the headers say,
//! and keep answering.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use softrdma_proto::endpoint::Arrival;
use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::{QpType, RecvWr, SendFlags, SendOp, SendWr, Sge};
use softrdma_proto::sim::{ConnectParams, Impairments, Sim};
use softrdma_proto::wire::{icrc, ICRC_LEN};

fuzz_target!(|data: &[u8]| {
    let Some((&kind, data)) = data.split_first() else { return };
    let qp_type = if kind & 1 == 0 { QpType::Rc } else { QpType::Uc };
    let mut sim = Sim::new(1, Impairments::default(), 2);
    let (qa, qb) = sim.connect(0, 1, qp_type, ConnectParams::default());
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let (la, _) = sim.nodes[0].mem.register(PdId(1), 0x1000, 1 << 16, all).unwrap();
    let (lb, _) = sim.nodes[1].mem.register(PdId(1), 0x1000, 1 << 16, all).unwrap();
    // Something in flight both ways, so that responses have a requester to confuse.
    for i in 0..2 {
        let wr = SendWr {
            wr_id: i,
            // UC has no READ: a WRITE there.
            op: match qp_type {
                QpType::Rc => SendOp::Read { remote_addr: 0x1000, rkey: softrdma_proto::Rkey(1) },
                _ => SendOp::Write { remote_addr: 0x1000, rkey: softrdma_proto::Rkey(1) },
            },
            sg_list: softrdma_proto::sgl![Sge { addr: 0x1000, length: 3000, lkey: lb }],
            flags: SendFlags { signaled: true, ..SendFlags::default() },
            ud: None,
        };
        let node = &mut sim.nodes[1];
        let _ = node.endpoint.qp_mut(qb).unwrap().post_send(wr, &node.mem);
        let _ = node.endpoint.qp_mut(qb).unwrap().post_recv(RecvWr { wr_id: i, sg_list: softrdma_proto::sgl![Sge { addr: 0x2000, length: 5000, lkey: lb }] });
    }
    let _ = (qa, la);
    let (from, to) = (Sim::addr_of(0), Sim::addr_of(1));
    let encap = icrc::Encap::new(from, to).unwrap();
    // The input is a list of packets, each prefixed by a one-byte length.
    let mut rest = data;
    let mut now = Duration::ZERO;
    let mut buf = vec![0u8; 8192];
    while let Some((&len, tail)) = rest.split_first() {
        let n = (len as usize).min(tail.len());
        let mut pkt = tail[..n].to_vec();
        rest = &tail[n..];
        if pkt.len() >= 12 {
            // Address it to the QP under test, in the default partition, and give it a
            // valid ICRC.
            pkt[2..4].copy_from_slice(&[0xFF, 0xFF]);
            pkt[5..8].copy_from_slice(&qb.get().to_be_bytes()[1..]);
            pkt.extend_from_slice(&[0; ICRC_LEN]);
            let body = pkt.len() - ICRC_LEN;
            let crc = icrc::compute(&encap, &pkt[..body]);
            pkt[body..].copy_from_slice(&crc.to_le_bytes());
        }
        let node = &mut sim.nodes[1];
        node.endpoint.handle_datagram(now, Arrival::new(from, node.endpoint.local()), &pkt, &mut node.mem);
        for _ in 0..64 {
            let Some(t) = node.endpoint.poll_transmit(now, &mut buf, &node.mem) else { break };
            let _ = t.assemble(&buf, &node.mem);
        }
        now += Duration::from_millis(1);
        node.endpoint.handle_timeout(now);
        while node.endpoint.qp_mut(qb).unwrap().poll_send_completion().is_some() {}
        while node.endpoint.qp_mut(qb).unwrap().poll_recv_completion().is_some() {}
    }
});
