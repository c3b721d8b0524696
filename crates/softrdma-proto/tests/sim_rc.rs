//! The RC transport end to end in the simulator: every operation, at the sizes around the
//! path MTU and up to 1 MiB, over a clean and an impaired network; every byte and every
//! completion is checked, and memory outside the target range must stay untouched.

mod common;

use common::*;
use softrdma_proto::qp::{SendOp, SendWr, Sge, WcOpcode, WcStatus};
use softrdma_proto::sim::{Impairments, NetStats};

const SIZES: [usize; 6] = [0, 1, PMTU - 1, PMTU, PMTU + 1, MIB];

fn impairments() -> [(&'static str, Impairments); 2] {
    [("clean", Impairments::default()), ("impaired", Impairments::from_percent(10.0, 2.0, 5.0, 1.0))]
}

/// The seeds a case runs with: one on the clean network; on the impaired one, messages of
/// one or two packets see an impairment only now and then, so they run with sixteen seeds.
fn seeds(name: &str, len: usize, base: u64) -> std::ops::Range<u64> {
    let n = if name == "impaired" && len <= PMTU + 1 { 16 } else { 1 };
    base * 100..base * 100 + n
}

/// Adds a run's network counters to a case's.
fn tally(seen: &mut NetStats, p: &Pair) {
    let n = p.sim.net.stats();
    seen.lost += n.lost;
    seen.duplicated += n.duplicated;
}

/// The impaired runs of a case lost packets (so the case tested recovery).
fn assert_impaired(name: &str, ctx: &str, seen: &NetStats) {
    if name == "impaired" {
        assert!(seen.lost > 0, "{ctx}: the network lost nothing ({} duplicated)", seen.duplicated);
    }
}

/// Expected B region after `len` bytes of A's region at OFF landed at OFF.
fn landed(before: &[u8], src: &[u8], len: usize) -> Vec<u8> {
    let mut want = before.to_vec();
    want[OFF..OFF + len].copy_from_slice(&src[OFF..OFF + len]);
    want
}

#[test]
fn send_every_size_clean_and_impaired() {
    for (name, imp) in impairments() {
        for (k, &len) in SIZES.iter().enumerate() {
            for imm in [None, Some(0xABCD_0000 + k as u32)] {
                let mut seen = NetStats::default();
                for seed in seeds(name, len, 100 + k as u64) {
                    let mut p = Pair::new(seed, imp);
                    let (a0, b0) = (p.a_bytes(), p.b_bytes());
                    p.post_recv(7, len + 16);
                    let op = imm.map_or(SendOp::Send, SendOp::SendWithImm);
                    p.post_send(SendWr {
                        wr_id: 42,
                        op,
                        sg_list: sge(p.a.0, A_BASE, len),
                        flags: signaled(),
                        ud: None,
                    });
                    let (s, r) = p.complete(1, 1);
                    let ctx = format!("{name} SEND {len} imm={imm:?}");
                    assert_eq!(
                        (s[0].wr_id, s[0].status, s[0].opcode),
                        (42, WcStatus::Success, WcOpcode::Send),
                        "{ctx}"
                    );
                    assert_eq!(
                        (r[0].wr_id, r[0].status, r[0].opcode),
                        (7, WcStatus::Success, WcOpcode::Recv),
                        "{ctx}"
                    );
                    assert_eq!(r[0].byte_len as usize, len, "{ctx}");
                    assert_eq!(r[0].imm_data, imm, "{ctx}");
                    assert_eq!(r[0].src_qp, p.qa, "{ctx}");
                    assert_eq!(p.b_bytes(), landed(&b0, &a0, len), "{ctx}: receive buffer and guards");
                    assert_eq!(p.a_bytes(), a0, "{ctx}: sender memory untouched");
                    tally(&mut seen, &p);
                }
                assert_impaired(name, &format!("SEND {len} imm={imm:?}"), &seen);
            }
        }
    }
}

#[test]
fn write_every_size_clean_and_impaired() {
    for (name, imp) in impairments() {
        for (k, &len) in SIZES.iter().enumerate() {
            for imm in [None, Some(0x5EED_0000 + k as u32)] {
                let mut seen = NetStats::default();
                for seed in seeds(name, len, 200 + k as u64) {
                    let mut p = Pair::new(seed, imp);
                    let (a0, b0) = (p.a_bytes(), p.b_bytes());
                    let (remote_addr, rkey) = (B_BASE + OFF as u64, p.b.1);
                    let op = match imm {
                        None => SendOp::Write { remote_addr, rkey },
                        Some(imm) => {
                            p.post_recv(9, 0);
                            SendOp::WriteWithImm { remote_addr, rkey, imm }
                        }
                    };
                    p.post_send(SendWr {
                        wr_id: 1,
                        op,
                        sg_list: sge(p.a.0, A_BASE, len),
                        flags: signaled(),
                        ud: None,
                    });
                    let (s, r) = p.complete(1, usize::from(imm.is_some()));
                    let ctx = format!("{name} WRITE {len} imm={imm:?}");
                    assert_eq!((s[0].status, s[0].opcode), (WcStatus::Success, WcOpcode::RdmaWrite), "{ctx}");
                    if let Some(imm) = imm {
                        assert_eq!(
                            (r[0].wr_id, r[0].opcode, r[0].imm_data),
                            (9, WcOpcode::RecvRdmaWithImm, Some(imm))
                        );
                        assert_eq!(r[0].byte_len as usize, len, "{ctx}");
                    }
                    assert_eq!(p.b_bytes(), landed(&b0, &a0, len), "{ctx}");
                    assert_eq!(p.a_bytes(), a0, "{ctx}");
                    tally(&mut seen, &p);
                }
                assert_impaired(name, &format!("WRITE {len} imm={imm:?}"), &seen);
            }
        }
    }
}

#[test]
fn read_every_size_clean_and_impaired() {
    for (name, imp) in impairments() {
        for (k, &len) in SIZES.iter().enumerate() {
            let mut seen = NetStats::default();
            for seed in seeds(name, len, 300 + k as u64) {
                let mut p = Pair::new(seed, imp);
                let (a0, b0) = (p.a_bytes(), p.b_bytes());
                let op = SendOp::Read { remote_addr: B_BASE + OFF as u64, rkey: p.b.1 };
                p.post_send(SendWr {
                    wr_id: 3,
                    op,
                    sg_list: sge(p.a.0, A_BASE, len),
                    flags: signaled(),
                    ud: None,
                });
                let (s, _) = p.complete(1, 0);
                let ctx = format!("{name} READ {len}");
                assert_eq!(
                    (s[0].status, s[0].opcode, s[0].byte_len as usize),
                    (WcStatus::Success, WcOpcode::RdmaRead, len),
                    "{ctx}"
                );
                assert_eq!(p.a_bytes(), landed(&a0, &b0, len), "{ctx}");
                assert_eq!(p.b_bytes(), b0, "{ctx}");
                tally(&mut seen, &p);
            }
            assert_impaired(name, &format!("READ {len}"), &seen);
        }
    }
}

#[test]
fn atomics_clean_and_impaired_execute_exactly_once() {
    for (name, imp) in impairments() {
        let mut p = Pair::new(400, imp);
        let target = B_BASE + 4096;
        let off = 4096;
        p.sim.nodes[1].mem.bytes_mut(p.b.0).unwrap()[off..off + 8].copy_from_slice(&100u64.to_ne_bytes());
        let n = 50u64;
        for i in 0..n {
            let sg_list = softrdma_proto::sgl![Sge { addr: A_BASE + 8 * i, length: 8, lkey: p.a.0 }];
            let op = SendOp::FetchAdd { remote_addr: target, rkey: p.b.1, add: 1 };
            p.post_send(SendWr { wr_id: i, op, sg_list, flags: signaled(), ud: None });
        }
        let cas = SendOp::CompareSwap { remote_addr: target, rkey: p.b.1, compare: 100 + n, swap: 7 };
        let sg_list = softrdma_proto::sgl![Sge { addr: A_BASE + 8 * n, length: 8, lkey: p.a.0 }];
        p.post_send(SendWr { wr_id: n, op: cas, sg_list, flags: signaled(), ud: None });
        let (s, _) = p.complete(n as usize + 1, 0);
        assert!(s.iter().all(|w| w.status == WcStatus::Success), "{name}");
        let wr_ids: Vec<u64> = s.iter().map(|w| w.wr_id).collect();
        assert_eq!(wr_ids, (0..=n).collect::<Vec<_>>(), "{name}: completions in order");
        let a = p.a_bytes();
        for i in 0..=n {
            let got = u64::from_ne_bytes(a[8 * i as usize..8 * i as usize + 8].try_into().unwrap());
            assert_eq!(got, 100 + i, "{name}: fetched value {i}");
        }
        let b = p.b_bytes();
        assert_eq!(
            u64::from_ne_bytes(b[off..off + 8].try_into().unwrap()),
            7,
            "{name}: 50 adds then the swap"
        );
    }
}

#[test]
fn impairments_really_happen_and_are_recovered_from() {
    let mut p = Pair::new(77, Impairments::from_percent(10.0, 2.0, 5.0, 1.0));
    let (a0, b0) = (p.a_bytes(), p.b_bytes());
    let op = SendOp::Write { remote_addr: B_BASE + OFF as u64, rkey: p.b.1 };
    p.post_send(SendWr { wr_id: 1, op, sg_list: sge(p.a.0, A_BASE, MIB), flags: signaled(), ud: None });
    let (s, _) = p.complete(1, 0);
    assert_eq!(s[0].status, WcStatus::Success);
    assert_eq!(p.b_bytes(), landed(&b0, &a0, MIB));
    let net = p.sim.net.stats();
    let qa = p.sim.nodes[0].endpoint.qp(p.qa).unwrap().stats();
    let eb = p.sim.nodes[1].endpoint.stats();
    eprintln!("net: {net}\nrequester: {qa:?}\nresponder endpoint: {eb:?}");
    assert!(net.lost > 0 && net.duplicated > 0 && net.reordered > 0 && net.corrupted > 0, "{net}");
    assert!(qa.retransmits > 0, "losses force retransmissions");
    let ea = p.sim.nodes[0].endpoint.stats();
    assert!(ea.icrc_errors + eb.icrc_errors > 0, "corrupted packets are caught by the ICRC");
}
