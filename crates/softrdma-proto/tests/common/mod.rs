//! The two-node RC harness the simulator tests share.
#![allow(dead_code)]

use std::time::Duration;

use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::{QpType, RecvWr, SendFlags, SendWr, Sge, WorkCompletion};
use softrdma_proto::sim::{ConnectParams, Impairments, Sim};
use softrdma_proto::{Lkey, Qpn, Rkey};

pub const PMTU: usize = 1024;
pub const MIB: usize = 1 << 20;
pub const REGION: usize = 2 * MIB + 4096;
pub const A_BASE: u64 = 0x1000_0000;
pub const B_BASE: u64 = 0x7000_0000;
/// Offset of the target range inside each region: bytes before and after it are guards.
pub const OFF: usize = 64;

pub struct Pair {
    pub sim: Sim,
    pub qa: Qpn,
    pub qb: Qpn,
    pub a: (Lkey, Rkey),
    pub b: (Lkey, Rkey),
}

pub fn all_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

impl Pair {
    pub fn new(seed: u64, imp: Impairments) -> Pair {
        Pair::with(seed, imp, ConnectParams::default())
    }

    pub fn with(seed: u64, imp: Impairments, params: ConnectParams) -> Pair {
        let mut sim = Sim::new(seed, imp, 2);
        let (qa, qb) = sim.connect(0, 1, QpType::Rc, params);
        let a = sim.nodes[0].mem.register(PdId(1), A_BASE, REGION, all_access()).unwrap();
        let b = sim.nodes[1].mem.register(PdId(1), B_BASE, REGION, all_access()).unwrap();
        // Recognisable, different contents everywhere, guards included.
        for (i, x) in sim.nodes[0].mem.bytes_mut(a.0).unwrap().iter_mut().enumerate() {
            *x = (i * 7 + 3) as u8;
        }
        for (i, x) in sim.nodes[1].mem.bytes_mut(b.0).unwrap().iter_mut().enumerate() {
            *x = (i * 13 + 5) as u8;
        }
        Pair { sim, qa, qb, a, b }
    }

    pub fn a_bytes(&self) -> Vec<u8> {
        self.sim.nodes[0].mem.bytes(self.a.0).unwrap().to_vec()
    }
    pub fn b_bytes(&self) -> Vec<u8> {
        self.sim.nodes[1].mem.bytes(self.b.0).unwrap().to_vec()
    }

    pub fn post_send(&mut self, wr: SendWr) {
        let node = &mut self.sim.nodes[0];
        node.endpoint.qp_mut(self.qa).unwrap().post_send(wr, &node.mem).unwrap();
    }

    pub fn post_recv(&mut self, wr_id: u64, len: usize) {
        let sge = Sge { addr: B_BASE + OFF as u64, length: len as u32, lkey: self.b.0 };
        let qp = self.sim.nodes[1].endpoint.qp_mut(self.qb).unwrap();
        qp.post_recv(RecvWr { wr_id, sg_list: softrdma_proto::sgl![sge] }).unwrap();
    }

    /// Runs until `n_send` send completions at A and `n_recv` receive completions at B,
    /// then on until the network is idle (a bounded virtual time): exactly that many must
    /// come, so a doubled completion fails the caller.
    pub fn complete(&mut self, n_send: usize, n_recv: usize) -> (Vec<WorkCompletion>, Vec<WorkCompletion>) {
        let (qa, qb) = (self.qa, self.qb);
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let mut poll = |sim: &mut Sim| {
            while let Some(wc) = sim.nodes[0].endpoint.qp_mut(qa).unwrap().poll_send_completion() {
                sends.push(wc);
            }
            while let Some(wc) = sim.nodes[1].endpoint.qp_mut(qb).unwrap().poll_recv_completion() {
                recvs.push(wc);
            }
            (sends.len(), recvs.len())
        };
        let done = self.sim.run_until(Duration::from_secs(600), |sim| {
            let (s, r) = poll(sim);
            s >= n_send && r >= n_recv
        });
        // Idle: nothing left to deliver or time out.
        self.sim.run_until(Duration::from_secs(60), |sim| {
            poll(sim);
            false
        });
        let (s, r) = poll(&mut self.sim);
        assert!(done, "timed out: {s} of {n_send} send and {r} of {n_recv} recv completions");
        assert_eq!((s, r), (n_send, n_recv), "more completions than operations");
        (sends, recvs)
    }
}

pub fn sge(lkey: Lkey, base: u64, len: usize) -> softrdma_proto::SgList {
    softrdma_proto::sgl![Sge { addr: base + OFF as u64, length: len as u32, lkey }]
}

pub fn signaled() -> SendFlags {
    SendFlags { signaled: true, ..SendFlags::default() }
}
