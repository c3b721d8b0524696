//! A mixed RC workload with end-to-end checks, run in the simulator: the engine of
//! `softrdma sim` and of the randomized transport tests.
//!
//! Node 0 posts SENDs (with and without immediate), WRITEs (with and without immediate),
//! READs, FetchAdds and CompareSwaps to node 1, keeping `depth` operations in flight, with
//! sizes mostly small and now and then up to `max_size`. Every operation has its own
//! memory slots, filled with fresh random bytes, so that every byte that lands can be
//! checked; atomics run on one shared counter whose value the checker tracks. Completions
//! must arrive in posting order, with success, the right opcode and length.
//!
//! What the checker holds the transport to:
//! - every completion once, in order, with the right status, opcode, length and immediate;
//! - every byte that lands (a SEND or WRITE at node 1, a READ or an atomic's fetched value
//!   at node 0) is, when it lands, the byte of an operation in flight whose target holds
//!   it: a write anywhere else, or of other bytes (a late duplicate of an older operation
//!   into a reused slot, a corrupted byte) is an error;
//! - atomics: each fetched value is the counter the model expects before it, and at the end
//!   the counter in memory equals the model's (a FetchAdd executed twice shows in both);
//! - after the last completion the network is run until idle: any further completion or
//!   write is an error.
//!
//! A CompareSwap executed twice in a row is invisible in memory (the second compare fails
//! and changes nothing); it shows only if its second result is the one returned.
//!
//! Tests prove that the checker fires: [`run_workload_with_fault`] injects one fault (an
//! atomic executed twice, a completion dropped, two completions swapped, a message
//! delivered twice, a trailing completion, a byte written outside its target, a payload
//! byte corrupted past the ICRC check, a late duplicate write) and the report must show it.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use super::{ConnectParams, Impairments, MemFault, NetStats, Rng, Sim};
use crate::memory::{Access, PdId};
use crate::qp::{
    QpStats, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};
use crate::{Lkey, Qpn, Rkey};

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkloadConfig {
    /// Operations to complete.
    pub ops: u64,
    /// Seed of the workload and the network.
    pub seed: u64,
    /// Network impairments.
    pub impairments: Impairments,
    /// Operations in flight at once.
    pub depth: usize,
    /// Largest message.
    pub max_size: usize,
    /// Connection attributes.
    pub params: ConnectParams,
    /// Give up after this much virtual time.
    pub time_limit: Duration,
}

impl Default for WorkloadConfig {
    fn default() -> WorkloadConfig {
        WorkloadConfig {
            ops: 1000,
            seed: 1,
            impairments: Impairments::default(),
            depth: 16,
            max_size: 64 << 10,
            params: ConnectParams::default(),
            time_limit: Duration::from_secs(3600),
        }
    }
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkloadReport {
    /// Operations posted.
    pub ops: u64,
    /// Operations whose every completion was a success (their checks run).
    pub completed: u64,
    /// Operations whose data (landed bytes, fetched values) was wrong.
    pub data_errors: u64,
    /// Completions with a wrong status, opcode, length or order, or never completed.
    pub status_errors: u64,
    /// Bytes moved by completed operations.
    pub bytes: u64,
    /// Virtual time at the end.
    pub virtual_time: Duration,
    /// Network counters.
    pub net: NetStats,
    /// The requester QP's counters.
    pub requester: QpStats,
    /// The responder QP's counters.
    pub responder: QpStats,
    /// The first few problems, described.
    pub problems: Vec<String>,
}

/// A fault to inject, to show that the checker reports it (tests only).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Node `node`'s memory commits `fault` on its `nth` occasion.
    Memory {
        /// 0: the requester's side; 1: the responder's.
        node: usize,
        /// What goes wrong.
        fault: MemFault,
        /// On which occasion.
        nth: u32,
    },
    /// The `nth` send completion is lost.
    DropCompletion(u32),
    /// The `nth` send completion and the next come the other way round (the first one that
    /// is polled together with the next).
    SwapCompletions(u32),
    /// The `nth` receive completion is delivered twice.
    DeliverTwice(u32),
    /// A copy of the last send completion comes after the end.
    TrailingCompletion,
    /// The bytes of the `nth` write at node 1 land again after their operation completed,
    /// as a late duplicate WRITE would: when the slot is free or a newer operation's bytes
    /// are already in place there.
    LateWrite(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    SendImm,
    Write,
    WriteImm,
    Read,
    FetchAdd,
    CompareSwap,
}

struct Op {
    kind: Kind,
    len: usize,
    slot: usize,
    /// Bytes that must land (SEND, WRITE at node 1; READ at node 0).
    data: Vec<u8>,
    /// For atomics, the value the counter must have held.
    atomic_before: u64,
    imm: u32,
    /// Completions still awaited: the send's, and for SEND and WRITE_WITH_IMM the receive's.
    awaiting: u8,
    /// One of its completions had a status other than success.
    failed: bool,
}

const A_BASE: u64 = 0x10_0000_0000;
const B_BASE: u64 = 0x20_0000_0000;

struct Run {
    sim: Sim,
    rng: Rng,
    cfg: WorkloadConfig,
    qa: Qpn,
    qb: Qpn,
    a: (Lkey, Rkey),
    b: (Lkey, Rkey),
    /// Counter address at node 1, after the slots.
    counter_off: usize,
    counter: u64,
    ops: HashMap<u64, Op>,
    /// Send completions expected, in order.
    send_order: VecDeque<u64>,
    /// Receive completions expected at node 1, in order.
    recv_order: VecDeque<u64>,
    free_slots: Vec<usize>,
    report: WorkloadReport,
    fault: Option<Fault>,
    /// Send and receive completions seen so far (for the completion faults).
    send_seen: u32,
    recv_seen: u32,
    /// The last send completion polled.
    last_send: Option<WorkCompletion>,
    /// [`Fault::LateWrite`]: writes at node 1 seen, and the one to replay (its operation,
    /// address and bytes).
    writes_seen: u32,
    replay: Option<(u64, u64, Vec<u8>)>,
}

/// Runs the workload.
pub fn run_workload(cfg: WorkloadConfig) -> WorkloadReport {
    run(cfg, None)
}

/// Runs the workload with `fault` injected (tests of the checker only).
#[doc(hidden)]
pub fn run_workload_with_fault(cfg: WorkloadConfig, fault: Fault) -> WorkloadReport {
    run(cfg, Some(fault))
}

fn run(cfg: WorkloadConfig, fault: Option<Fault>) -> WorkloadReport {
    let mut sim = Sim::new(cfg.seed, cfg.impairments, 2);
    let (qa, qb) = sim.connect(0, 1, QpType::Rc, cfg.params);
    let slot_len = cfg.max_size.max(8);
    let region = (slot_len * cfg.depth).next_multiple_of(8) + 64;
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let a = sim.nodes[0].mem.register(PdId(1), A_BASE, region, all).expect("region");
    let b = sim.nodes[1].mem.register(PdId(1), B_BASE, region, all).expect("region");
    let mut run = Run {
        sim,
        rng: Rng::new(cfg.seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0xA5A5),
        cfg,
        qa,
        qb,
        a,
        b,
        counter_off: (slot_len * cfg.depth).next_multiple_of(8),
        counter: 0,
        ops: HashMap::new(),
        send_order: VecDeque::new(),
        recv_order: VecDeque::new(),
        free_slots: (0..cfg.depth).rev().collect(),
        report: WorkloadReport::default(),
        fault,
        send_seen: 0,
        recv_seen: 0,
        last_send: None,
        writes_seen: 0,
        replay: None,
    };
    if let Some(Fault::Memory { node, fault, nth }) = fault {
        run.sim.nodes[node].mem.inject(fault, nth);
    }
    run.go();
    run.report
}

impl Run {
    fn slot_len(&self) -> usize {
        self.cfg.max_size.max(8)
    }

    fn problem(&mut self, data: bool, what: String) {
        if data {
            self.report.data_errors += 1;
        } else {
            self.report.status_errors += 1;
        }
        if self.report.problems.len() < 10 {
            self.report.problems.push(what);
        }
    }

    fn size(&mut self) -> usize {
        let max = self.cfg.max_size as u64;
        let r = self.rng.below(100);
        let cap = if r < 70 {
            256
        } else if r < 95 {
            4096
        } else {
            max
        };
        self.rng.below(cap.min(max) + 1) as usize
    }

    fn post_next(&mut self, wr_id: u64) {
        let slot = self.free_slots.pop().expect("a free slot when below depth");
        let kind = match self.rng.below(14) {
            0..=2 => Kind::Send,
            3..=4 => Kind::SendImm,
            5..=7 => Kind::Write,
            8 => Kind::WriteImm,
            9..=10 => Kind::Read,
            11..=12 => Kind::FetchAdd,
            _ => Kind::CompareSwap,
        };
        let atomic = matches!(kind, Kind::FetchAdd | Kind::CompareSwap);
        let len = if atomic { 8 } else { self.size() };
        let off = slot * self.slot_len();
        let (a_addr, b_addr) = (A_BASE + off as u64, B_BASE + off as u64);
        let mut data = vec![0u8; len];
        self.rng.fill(&mut data);
        let imm = self.rng.next_u32();
        match kind {
            Kind::Read => {
                let b = self.sim.nodes[1].mem.bytes_mut(self.b.0).expect("region");
                b[off..off + len].copy_from_slice(&data);
            }
            Kind::FetchAdd | Kind::CompareSwap => {}
            _ => {
                let a = self.sim.nodes[0].mem.bytes_mut(self.a.0).expect("region");
                a[off..off + len].copy_from_slice(&data);
            }
        }
        if matches!(kind, Kind::Send | Kind::SendImm | Kind::WriteImm) {
            let sge = Sge { addr: b_addr, length: self.slot_len() as u32, lkey: self.b.0 };
            let qp = self.sim.nodes[1].endpoint.qp_mut(self.qb).expect("qp");
            if let Err(e) = qp.post_recv(RecvWr { wr_id, sg_list: crate::sgl![sge] }) {
                self.problem(false, format!("post_recv {wr_id}: {e}"));
            }
            self.recv_order.push_back(wr_id);
        }
        let counter = B_BASE + self.counter_off as u64;
        let rkey = self.b.1;
        let (op, atomic_before) = match kind {
            Kind::Send => (SendOp::Send, 0),
            Kind::SendImm => (SendOp::SendWithImm(imm), 0),
            Kind::Write => (SendOp::Write { remote_addr: b_addr, rkey }, 0),
            Kind::WriteImm => (SendOp::WriteWithImm { remote_addr: b_addr, rkey, imm }, 0),
            Kind::Read => (SendOp::Read { remote_addr: b_addr, rkey }, 0),
            Kind::FetchAdd => {
                let add = self.rng.below(1000);
                let before = self.counter;
                self.counter = before.wrapping_add(add);
                (SendOp::FetchAdd { remote_addr: counter, rkey, add }, before)
            }
            Kind::CompareSwap => {
                let before = self.counter;
                // Half the time the compare matches.
                let compare = if self.rng.below(2) == 0 { before } else { before ^ 1 };
                let swap = self.rng.next_u64();
                if compare == before {
                    self.counter = swap;
                }
                (SendOp::CompareSwap { remote_addr: counter, rkey, compare, swap }, before)
            }
        };
        let wr = SendWr {
            wr_id,
            op,
            sg_list: crate::sgl![Sge { addr: a_addr, length: len as u32, lkey: self.a.0 }],
            flags: SendFlags { signaled: true, ..SendFlags::default() },
            ud: None,
        };
        let node = &mut self.sim.nodes[0];
        let qp = node.endpoint.qp_mut(self.qa).expect("qp");
        if let Err(e) = qp.post_send(wr, &node.mem) {
            self.problem(false, format!("post_send {wr_id}: {e}"));
        }
        let awaiting = if matches!(kind, Kind::Send | Kind::SendImm | Kind::WriteImm) { 2 } else { 1 };
        self.ops.insert(wr_id, Op { kind, len, slot, data, atomic_before, imm, awaiting, failed: false });
        self.send_order.push_back(wr_id);
        self.report.ops += 1;
    }

    /// One completion of `op` arrived, with `status`; when it has all it awaits, it is
    /// done, and counts as completed if every completion was a success.
    fn settle(&mut self, wr_id: u64, status: WcStatus) {
        let Some(op) = self.ops.get_mut(&wr_id) else { return };
        op.awaiting -= 1;
        op.failed |= status != WcStatus::Success;
        if op.awaiting == 0 {
            let op = self.ops.remove(&wr_id).expect("present");
            self.free_slots.push(op.slot);
            if !op.failed {
                self.report.bytes += op.len as u64;
                self.report.completed += 1;
            }
        }
    }

    fn check_send_wc(&mut self, wc: WorkCompletion) {
        let Some(wr_id) = self.send_order.pop_front() else {
            return self.problem(false, format!("send completion {} with nothing pending", wc.wr_id));
        };
        let Some(op) = self.ops.get(&wr_id) else { return };
        let want = match op.kind {
            Kind::Send | Kind::SendImm => WcOpcode::Send,
            Kind::Write | Kind::WriteImm => WcOpcode::RdmaWrite,
            Kind::Read => WcOpcode::RdmaRead,
            Kind::FetchAdd => WcOpcode::FetchAdd,
            Kind::CompareSwap => WcOpcode::CompareSwap,
        };
        let off = op.slot * self.slot_len();
        let (kind, len) = (op.kind, op.len);
        let bytes_ok = match kind {
            Kind::Write | Kind::WriteImm => {
                self.sim.nodes[1].mem.bytes(self.b.0).is_some_and(|b| b[off..off + len] == op.data[..])
            }
            Kind::Read => {
                self.sim.nodes[0].mem.bytes(self.a.0).is_some_and(|a| a[off..off + len] == op.data[..])
            }
            Kind::FetchAdd | Kind::CompareSwap => self.sim.nodes[0]
                .mem
                .bytes(self.a.0)
                .is_some_and(|a| a[off..off + 8] == op.atomic_before.to_ne_bytes()),
            Kind::Send | Kind::SendImm => true,
        };
        if wc.wr_id != wr_id || wc.status != WcStatus::Success || wc.opcode != want {
            self.problem(
                false,
                format!("op {wr_id} {kind:?}: completion wr {} {:?} {:?}", wc.wr_id, wc.status, wc.opcode),
            );
        } else if !bytes_ok {
            self.problem(true, format!("op {wr_id} {kind:?} of {len} bytes: wrong data"));
        }
        self.settle(wr_id, wc.status);
    }

    fn check_recv_wc(&mut self, wc: WorkCompletion) {
        let Some(wr_id) = self.recv_order.pop_front() else {
            return self.problem(false, format!("receive completion {} with nothing pending", wc.wr_id));
        };
        let Some(op) = self.ops.get(&wr_id) else { return };
        let off = op.slot * self.slot_len();
        let (want_op, imm) = match op.kind {
            Kind::Send => (WcOpcode::Recv, None),
            Kind::SendImm => (WcOpcode::Recv, Some(op.imm)),
            _ => (WcOpcode::RecvRdmaWithImm, Some(op.imm)),
        };
        let landed =
            self.sim.nodes[1].mem.bytes(self.b.0).is_some_and(|b| b[off..off + op.len] == op.data[..]);
        let (kind, len) = (op.kind, op.len);
        if wc.wr_id != wr_id
            || wc.status != WcStatus::Success
            || wc.opcode != want_op
            || wc.byte_len as usize != len
        {
            self.problem(
                false,
                format!(
                    "op {wr_id} {kind:?}: receive wr {} {:?} {:?} len {}",
                    wc.wr_id, wc.status, wc.opcode, wc.byte_len
                ),
            );
        } else if wc.imm_data != imm || !landed {
            self.problem(true, format!("op {wr_id} {kind:?} of {len} bytes: wrong data or immediate"));
        }
        self.settle(wr_id, wc.status);
    }

    /// Every byte written since the last check must lie in memory an in-flight operation
    /// targets — its slot at node 1 (SEND, WRITE) or node 0 (READ, atomic result), or the
    /// atomic counter — and hold that operation's bytes. Anything else is a stray or wrong
    /// write.
    fn check_writes(&mut self) {
        self.late_write();
        let slot_len = self.slot_len() as u64;
        let counter = B_BASE + self.counter_off as u64;
        let mut bad = Vec::new();
        for (node, base, lkey) in [(0usize, A_BASE, self.a.0), (1, B_BASE, self.b.0)] {
            let mem = &self.sim.nodes[node].mem;
            let now = mem.bytes(lkey).unwrap_or(&[]);
            for &(_, addr, len) in mem.writes() {
                if node == 1 && addr == counter && len == 8 {
                    // The counter: any atomic in flight may write it; its value is checked
                    // by the fetched values and at the end.
                    if !self.ops.values().any(|op| matches!(op.kind, Kind::FetchAdd | Kind::CompareSwap)) {
                        bad.push("write to the counter with no atomic in flight".to_string());
                    }
                    continue;
                }
                let owner = self.ops.values().find(|op| {
                    let targets_here = match op.kind {
                        Kind::Send | Kind::SendImm | Kind::Write | Kind::WriteImm => node == 1,
                        Kind::Read | Kind::FetchAdd | Kind::CompareSwap => node == 0,
                    };
                    let start = base + op.slot as u64 * slot_len;
                    let atomic = matches!(op.kind, Kind::FetchAdd | Kind::CompareSwap);
                    let end = start + if atomic { 8 } else { op.len as u64 };
                    targets_here && addr >= start && addr + len as u64 <= end
                });
                let Some(op) = owner else {
                    bad.push(format!("stray write of {len} bytes at {addr:#x} on node {node}"));
                    continue;
                };
                let start = (addr - base) as usize;
                let within = start - op.slot * slot_len as usize;
                let before = op.atomic_before.to_ne_bytes();
                let want = match op.kind {
                    Kind::FetchAdd | Kind::CompareSwap => &before[within..within + len],
                    _ => &op.data[within..within + len],
                };
                if now.get(start..start + len) != Some(want) {
                    bad.push(format!(
                        "write of {len} bytes at {addr:#x} on node {node}: not the bytes of its operation"
                    ));
                }
            }
        }
        for node in 0..2 {
            self.sim.nodes[node].mem.clear_write_log();
        }
        for s in bad {
            self.problem(true, s);
        }
    }

    /// [`Fault::LateWrite`]: remembers the chosen write, and replays it once its operation
    /// is done and the slot is free or holds a newer operation's bytes.
    fn late_write(&mut self) {
        let Some(Fault::LateWrite(nth)) = self.fault else { return };
        let slot_len = self.slot_len();
        fn owner(ops: &HashMap<u64, Op>, slot: usize) -> Option<(u64, &Op)> {
            ops.iter().find(|(_, op)| op.slot == slot).map(|(id, op)| (*id, op))
        }
        if self.replay.is_none() {
            let writes = self.sim.nodes[1].mem.writes().to_vec();
            for (_, addr, len) in writes {
                self.writes_seen += 1;
                let off = (addr - B_BASE) as usize;
                if self.writes_seen >= nth && len >= 2 && off < self.counter_off {
                    let Some((id, _)) = owner(&self.ops, off / slot_len) else { continue };
                    let bytes =
                        self.sim.nodes[1].mem.bytes(self.b.0).expect("region")[off..off + len].to_vec();
                    self.replay = Some((id, addr, bytes));
                    break;
                }
            }
            return;
        }
        let Some((id, addr, bytes)) = self.replay.clone() else { return };
        let off = (addr - B_BASE) as usize;
        let ready = match owner(&self.ops, off / slot_len) {
            None => true,
            Some((now, op))
                if now != id
                    && matches!(op.kind, Kind::Send | Kind::SendImm | Kind::Write | Kind::WriteImm) =>
            {
                let within = off - op.slot * slot_len;
                let mem = self.sim.nodes[1].mem.bytes(self.b.0).expect("region");
                within + bytes.len() <= op.len
                    && mem[off..off + bytes.len()] == op.data[within..within + bytes.len()]
            }
            Some(_) => false,
        };
        if ready && !self.ops.contains_key(&id) {
            let key = crate::memory::MemKey::Local(self.b.0);
            let _ = crate::memory::Memory::write(
                &mut self.sim.nodes[1].mem,
                PdId(1),
                key,
                addr,
                &bytes,
                Access::LOCAL_WRITE,
            );
            self.fault = None;
        }
    }

    /// Polls both QPs' completions and checks them (with the completion faults applied).
    fn poll(&mut self) {
        let mut sends = Vec::new();
        let qp = self.sim.nodes[0].endpoint.qp_mut(self.qa).expect("qp");
        while let Some(wc) = qp.poll_send_completion() {
            sends.push(wc);
        }
        let mut recvs = Vec::new();
        let qp = self.sim.nodes[1].endpoint.qp_mut(self.qb).expect("qp");
        while let Some(wc) = qp.poll_recv_completion() {
            recvs.push(wc);
        }
        let first = self.send_seen;
        self.send_seen += sends.len() as u32;
        self.last_send = sends.last().copied().or(self.last_send);
        let at = |n: u32| (n > first && n <= first + sends.len() as u32).then(|| (n - first - 1) as usize);
        match self.fault {
            Some(Fault::DropCompletion(n)) => {
                if let Some(i) = at(n) {
                    sends.remove(i);
                    self.fault = None;
                }
            }
            Some(Fault::SwapCompletions(n)) if n > first => {
                if let Some(i) = at(n).filter(|&i| i + 1 < sends.len()) {
                    sends.swap(i, i + 1);
                    self.fault = None;
                } else if at(n).is_some() {
                    // Alone in its batch: try the next batch's first.
                    self.fault = Some(Fault::SwapCompletions(self.send_seen + 1));
                }
            }
            _ => {}
        }
        let first = self.recv_seen;
        self.recv_seen += recvs.len() as u32;
        if let Some(Fault::DeliverTwice(n)) = self.fault {
            if n > first && n <= self.recv_seen {
                let i = (n - first - 1) as usize;
                recvs.insert(i + 1, recvs[i]);
                self.fault = None;
            }
        }
        for wc in sends {
            self.check_send_wc(wc);
        }
        for wc in recvs {
            self.check_recv_wc(wc);
        }
    }

    /// After the last completion: runs the network until nothing is left (a bounded time),
    /// and requires that no completion and no write comes, and that the counter in memory
    /// is the model's.
    fn drain(&mut self) {
        let end = self.sim.now + Duration::from_secs(60);
        while self.sim.now <= end && self.sim.advance() {}
        let mut late = Vec::new();
        let qp = self.sim.nodes[0].endpoint.qp_mut(self.qa).expect("qp");
        while let Some(wc) = qp.poll_send_completion() {
            late.push(wc);
        }
        let qp = self.sim.nodes[1].endpoint.qp_mut(self.qb).expect("qp");
        while let Some(wc) = qp.poll_recv_completion() {
            late.push(wc);
        }
        if self.fault == Some(Fault::TrailingCompletion) {
            late.extend(self.last_send);
        }
        for wc in late {
            self.problem(false, format!("completion of wr {} after the end", wc.wr_id));
        }
        self.check_writes();
        let counter = self.sim.nodes[1]
            .mem
            .bytes(self.b.0)
            .and_then(|b| b.get(self.counter_off..self.counter_off + 8))
            .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")));
        if counter != Some(self.counter) {
            self.problem(true, format!("the counter ends at {counter:x?}, the model at {:x}", self.counter));
        }
    }

    fn go(&mut self) {
        let mut next_wr = 0u64;
        let deadline = self.cfg.time_limit;
        loop {
            while self.ops.len() < self.cfg.depth && next_wr < self.cfg.ops {
                self.post_next(next_wr);
                next_wr += 1;
            }
            self.poll();
            if self.ops.is_empty() && next_wr >= self.cfg.ops {
                self.drain();
                break;
            }
            if self.ops.len() < self.cfg.depth && next_wr < self.cfg.ops {
                continue;
            }
            let advanced = self.sim.now <= deadline && self.sim.advance();
            self.check_writes();
            if !advanced {
                let stuck = self.ops.len() as u64;
                self.problem(
                    false,
                    match self.sim.stuck {
                        Some(t) => format!("{stuck} operations never completed: virtual time stuck at {t:?} (a timer stays due)"),
                        None => format!("{stuck} operations never completed (virtual time {:?})", self.sim.now),
                    },
                );
                self.report.status_errors += stuck.saturating_sub(1);
                break;
            }
        }
        self.report.virtual_time = self.sim.now;
        self.report.net = self.sim.net.stats();
        self.report.requester = self.sim.nodes[0].endpoint.qp(self.qa).map(|q| q.stats()).unwrap_or_default();
        self.report.responder = self.sim.nodes[1].endpoint.qp(self.qb).map(|q| q.stats()).unwrap_or_default();
    }
}
