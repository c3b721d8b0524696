//! A hostile peer on real sockets: crafted packets sent at a running device. The device
//! must not panic, must not change a byte it should not (guard regions around the target,
//! a region without remote rights, a region of another protection domain), must answer
//! each attack as the spec says (NAK or silent drop), and its legitimate connection must
//! keep working throughout.

mod common;

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::{fill_headers, payload_for};
use softrdma::proto::wire::{
    icrc, AethSyndrome, AtomicEthRepr, BthRepr, NakCode, Opcode, Packet, PacketRepr, RethRepr,
};
use softrdma::{
    Access, CompletionQueue, ConnectOptions, Context, EndpointInfo, MemoryRegion, ProtectionDomain, Psn,
    QpBuilder, QueuePair, RecvWr, Rkey, SendFlags, SendOp, SendWr, WcStatus,
};

const ALL: Access = Access::from_bits(0x0F);

struct Victim {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    target: MemoryRegion,
    guards: Vec<(MemoryRegion, Vec<u8>)>,
}

fn victim() -> Victim {
    let ctx = Context::open_port(IpAddr::from([127, 0, 4, 2]), 0).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4096, None).unwrap();
    let mut guards = Vec::new();
    let make = |pd: &ProtectionDomain, len: usize, access: Access, seed: u8| {
        let mr = pd.register(len, access).unwrap();
        let data: Vec<u8> = (0..len).map(|k| (k as u8).wrapping_mul(seed)).collect();
        mr.write(0, &data).unwrap();
        (mr, data)
    };
    guards.push(make(&pd, 65536, Access::LOCAL_WRITE, 3));
    let target = pd.register(65536, ALL).unwrap();
    guards.push(make(&pd, 65536, Access::LOCAL_WRITE | Access::REMOTE_READ, 5));
    let other_pd = ctx.alloc_pd();
    guards.push(make(&other_pd, 65536, ALL, 7));
    Victim { ctx, pd, cq, target, guards }
}

/// A QP of the victim connected to the attacker's socket, which pretends to be a QP
/// that sends from PSN 100.
fn victim_qp(v: &Victim, attacker: &UdpSocket, access: Access) -> QueuePair {
    victim_qp_at(v, attacker, access, 100)
}

fn victim_qp_at(v: &Victim, attacker: &UdpSocket, access: Access, psn: u32) -> QueuePair {
    let p = v.pd.prepare_qp(&QpBuilder::rc().access(access), &v.cq, &v.cq).unwrap();
    let fake =
        EndpointInfo { addr: attacker.local_addr().unwrap(), qpn: 0x123, psn, mtu: 1024, region: None };
    p.handshake(&fake, &ConnectOptions::default()).unwrap()
}

/// The PSNs of the probe QP: far from every attack's.
const PROBE_PSN: u32 = 0x70_0000;

/// A QP of the victim the attacker uses to know when the victim has handled everything
/// sent before: the device handles datagrams in order and answers them in order, so the
/// answers that arrive before the probe's ACK are all the answers to the attacks.
struct Probe {
    qp: QueuePair,
    mr: MemoryRegion,
    next: std::cell::Cell<u32>,
}

impl Probe {
    fn new(v: &Victim, a: &Attacker) -> Probe {
        let qp = victim_qp_at(v, &a.sock, ALL, PROBE_PSN);
        let mr = v.pd.register(8, ALL).unwrap();
        Probe { qp, mr, next: std::cell::Cell::new(PROBE_PSN) }
    }
}

struct Attacker {
    sock: UdpSocket,
    to: SocketAddr,
}

type Answer = (Opcode, Psn, Option<AethSyndrome>, Vec<u8>);

impl Attacker {
    fn new(to: SocketAddr) -> Attacker {
        Attacker::at("127.0.4.4:0", to)
    }
    fn at(addr: &str, to: SocketAddr) -> Attacker {
        let sock = UdpSocket::bind(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        Attacker { sock, to }
    }
    fn encap(&self) -> icrc::Encap {
        icrc::Encap::new(self.sock.local_addr().unwrap(), self.to).unwrap()
    }
    fn send_raw(&self, bytes: &[u8]) {
        self.sock.send_to(bytes, self.to).unwrap();
    }
    /// Sends a packet with a valid ICRC.
    fn send(&self, r: &PacketRepr, payload: &[u8]) {
        let mut buf = vec![0u8; r.total_len()];
        r.emit(&mut buf, payload, &self.encap()).unwrap();
        self.send_raw(&buf);
    }
    /// Every answer to what was sent before: sends a one-byte WRITE on the probe QP and
    /// collects what arrives until its ACK (which must come within 10 s). The probe is
    /// sent again if a flood made the kernel drop it (its duplicate is re-ACKed).
    fn sync(&self, probe: &Probe) -> Vec<Answer> {
        let psn = probe.next.get();
        probe.next.set(psn + 1);
        let r = probe.mr.remote();
        let (w, d) = write(probe.qp.qpn(), psn, r.addr, Rkey(r.rkey), 1, 0x5A);
        let mut out = Vec::new();
        let mut buf = [0u8; 9000];
        let t = Instant::now();
        let mut sent = None::<Instant>;
        loop {
            assert!(t.elapsed() < Duration::from_secs(10), "the probe was not answered");
            if sent.is_none_or(|s| s.elapsed() > Duration::from_millis(500)) {
                self.send(&w, &d);
                sent = Some(Instant::now());
            }
            let Ok(n) = self.sock.recv(&mut buf) else { continue };
            let Ok(p) = Packet::new_checked(&buf[..n]) else { continue };
            let syn = p.aeth().and_then(|a| AethSyndrome::from_byte(a.syndrome_raw()).ok());
            if p.bth().psn() == Psn::new(psn) && syn == Some(AethSyndrome::ACK) {
                return out;
            }
            out.push((p.opcode(), p.bth().psn(), syn, p.payload().to_vec()));
        }
    }
}

impl Attacker {
    /// What arrives until `last` says it was the last (within 10 s).
    fn until(&self, last: impl Fn(&Answer) -> bool) -> Vec<Answer> {
        let mut out = Vec::new();
        let t = Instant::now();
        while out.last().is_none_or(|x| !last(x)) {
            assert!(t.elapsed() < Duration::from_secs(10), "the answer did not come: {} so far", out.len());
            out.extend(answers_once(self));
        }
        out
    }
}

fn req(opcode: u8, qpn: softrdma::Qpn, psn: u32) -> PacketRepr {
    let mut b = BthRepr::new(Opcode::new(opcode).unwrap(), qpn, Psn::new(psn));
    b.ack_req = true;
    PacketRepr::new(b, 0)
}

/// A WRITE ONLY of `len` bytes of `byte`.
fn write(qpn: softrdma::Qpn, psn: u32, va: u64, rkey: Rkey, len: usize, byte: u8) -> (PacketRepr, Vec<u8>) {
    let mut r = req(0x0A, qpn, psn);
    r.payload_len = len;
    r.ext.reth = Some(RethRepr { va, rkey, dma_len: len as u32 });
    (r, vec![byte; len])
}

fn naks(answers: &[Answer]) -> Vec<NakCode> {
    answers
        .iter()
        .filter_map(|a| match a.2 {
            Some(AethSyndrome::Nak(c)) => Some(c),
            _ => None,
        })
        .collect()
}

/// Datagrams the endpoint refused before any QP saw them.
fn refused(s: softrdma::proto::endpoint::EndpointStats) -> u64 {
    s.icrc_errors + s.malformed + s.unknown_qp + s.pkey_violations + s.gsi_dropped
}

/// A legitimate peer: a second device with a connected QP; returns a closure that does one
/// verified SEND round.
fn legit_pair(v: &Victim) -> impl FnMut() {
    let other = Context::open_port(IpAddr::from([127, 0, 4, 3]), 0).unwrap();
    let opd = other.alloc_pd();
    let ocq = other.create_cq(64, None).unwrap();
    let op = opd.prepare_qp(&QpBuilder::rc(), &ocq, &ocq).unwrap();
    let vp = v.pd.prepare_qp(&QpBuilder::rc(), &v.cq, &v.cq).unwrap();
    let (eo, ev) = (op.endpoint(), vp.endpoint());
    let oq = op.handshake(&ev, &ConnectOptions::default()).unwrap();
    let vq = vp.handshake(&eo, &ConnectOptions::default()).unwrap();
    let src = opd.register(256, Access::NONE).unwrap();
    let dst = v.pd.register(256, Access::LOCAL_WRITE).unwrap();
    let vcq = v.cq.clone();
    let mut round = 0u8;
    move || {
        round = round.wrapping_add(1);
        src.write(0, &[round; 256]).unwrap();
        vq.post_recv(RecvWr { wr_id: 77, sg_list: softrdma::sgl![dst.sge(0, 256).unwrap()] }).unwrap();
        let flags = SendFlags { signaled: true, ..Default::default() };
        oq.post_send(SendWr {
            wr_id: 1,
            op: SendOp::Send,
            sg_list: softrdma::sgl![src.sge(0, 256).unwrap()],
            flags,
            ud: None,
        })
        .unwrap();
        let t = Instant::now();
        let mut got_send = false;
        let mut got_recv = false;
        while !(got_send && got_recv) {
            assert!(t.elapsed() < Duration::from_secs(10), "legitimate traffic stalled");
            if let Some(wc) = ocq.poll_one() {
                assert_eq!(wc.status, WcStatus::Success);
                got_send = true;
            }
            while let Some(wc) = vcq.poll_one() {
                if wc.wr_id == 77 {
                    assert_eq!(wc.status, WcStatus::Success);
                    got_recv = true;
                }
            }
        }
        let mut back = [0u8; 256];
        dst.read(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == round));
        let _ = &other;
    }
}

#[test]
fn hostile_peer() {
    let v = victim();
    let mut legit = legit_pair(&v);
    legit();
    let a = Attacker::new(v.ctx.local_addr());
    let probe = Probe::new(&v, &a);
    assert!(a.sync(&probe).is_empty());
    let target = v.target.remote();
    let trk = Rkey(target.rkey);

    // 1. Garbage and truncations: dropped silently (each counted), nothing answered.
    let before = v.ctx.endpoint_stats();
    let mut seed = 0x9E37_79B9u32;
    for _ in 0..2000 {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let len = (seed >> 20) as usize % 300;
        let bytes: Vec<u8> = (0..len).map(|i| (seed.wrapping_mul(i as u32 + 1) >> 11) as u8).collect();
        a.send_raw(&bytes);
    }
    let qp = victim_qp(&v, &a.sock, ALL);
    let (w, data) = write(qp.qpn(), 100, target.addr, trk, 64, 0xE1);
    let mut whole = vec![0u8; w.total_len()];
    w.emit(&mut whole, &data, &a.encap()).unwrap();
    for cut in 0..whole.len() {
        a.send_raw(&whole[..cut]);
    }
    // Every opcode to QPNs that do not exist.
    for op in Opcode::all() {
        for qpn in [0u32, 2, 0xFFFFFE, qp.qpn().get() ^ 0x800000] {
            let mut r = req(op.code(), softrdma::Qpn::new(qpn), 5);
            fill_headers(&mut r);
            a.send(&r, &vec![0xE1; payload_for(op)]);
        }
    }
    assert!(a.sync(&probe).is_empty(), "no answer to garbage or unknown QPs");
    let after = v.ctx.endpoint_stats();
    let arrived = after.received - before.received - 1;
    assert!(arrived > 1000, "the garbage arrived ({arrived} datagrams)");
    assert_eq!(refused(after) - refused(before), arrived, "every datagram but the probe refused");
    legit();

    // 2. Guessed keys, and the key and address of a region without remote write (two),
    // and of another PD's region: each a remote access error, each on its own QP.
    let g = |k: usize| (v.guards[k].0.addr(), v.guards[k].0.rkey());
    let cases =
        [g(0), g(1), g(2), (target.addr, Rkey(trk.0 ^ 0x100)), (target.addr, Rkey(trk.0.wrapping_add(1)))];
    for (addr, key) in cases {
        let qp = victim_qp(&v, &a.sock, ALL);
        let (w, d) = write(qp.qpn(), 100, addr, key, 64, 0xE2);
        a.send(&w, &d);
        assert_eq!(naks(&a.sync(&probe)), vec![NakCode::RemoteAccessError], "key {key:?}");
        assert_eq!(qp.state(), softrdma::QpState::Error);
    }
    legit();

    // 3. A WRITE that overruns the target's end by one byte, a READ past its end, a
    // misaligned atomic, a QP without remote rights: NAKs, nothing touched.
    let qp = victim_qp(&v, &a.sock, ALL);
    let (w, d) = write(qp.qpn(), 100, target.addr + target.len - 63, trk, 64, 0xE3);
    a.send(&w, &d);
    assert_eq!(naks(&a.sync(&probe)), vec![NakCode::RemoteAccessError]);
    let qp = victim_qp(&v, &a.sock, ALL);
    let mut r = req(0x0C, qp.qpn(), 100);
    r.ext.reth = Some(RethRepr { va: target.addr, rkey: trk, dma_len: 1 << 31 });
    a.send(&r, &[]);
    let ans = a.sync(&probe);
    assert_eq!(naks(&ans), vec![NakCode::RemoteAccessError]);
    assert_eq!(ans.len(), 1, "a NAK and no READ response");
    let qp = victim_qp(&v, &a.sock, ALL);
    let mut r = req(0x14, qp.qpn(), 100);
    r.ext.atomic_eth = Some(AtomicEthRepr { va: target.addr + 4, rkey: trk, swap_add: 1, compare: 0 });
    a.send(&r, &[]);
    assert_eq!(naks(&a.sync(&probe)), vec![NakCode::InvalidRequest]);
    let qp = victim_qp(&v, &a.sock, Access::NONE);
    let (w, d) = write(qp.qpn(), 100, target.addr, trk, 8, 0xE3);
    a.send(&w, &d);
    assert_eq!(naks(&a.sync(&probe)), vec![NakCode::InvalidRequest]);
    legit();

    // 4. Amplification: a READ of the whole target is answered once, by exactly its
    // bytes; twenty duplicates of it get at most one replay each, to the peer only.
    let qp = victim_qp(&v, &a.sock, ALL);
    let mut r = req(0x0C, qp.qpn(), 100);
    r.ext.reth = Some(RethRepr { va: target.addr, rkey: trk, dma_len: target.len as u32 });
    a.send(&r, &[]);
    // The responses go out beside the probe's ACK, not all before it: wait for the last.
    let npsn = target.len as usize / 1024;
    let last = |x: &Answer| x.1 == Psn::new(100 + npsn as u32 - 1);
    let mut ans = a.sync(&probe);
    if !ans.iter().any(last) {
        ans.extend(a.until(last));
    }
    assert!(a.sync(&probe).is_empty(), "nothing after the last response");
    let bytes: Vec<u8> = ans.iter().flat_map(|x| x.3.clone()).collect();
    assert_eq!(ans.len(), npsn, "one response per MTU");
    assert_eq!(bytes, v.target.to_vec(), "the READ returned the target");
    for _ in 0..20 {
        a.send(&r, &[]);
    }
    std::thread::sleep(Duration::from_millis(100));
    let replays = a.sync(&probe).len() + answers(&a).len();
    assert!(replays <= 20 * npsn, "{replays} responses to 20 duplicates");
    legit();

    // 5. Forged PSNs: ahead of the window (one sequence NAK, however many arrive), behind
    // it (a re-ACK, nothing executed).
    let qp = victim_qp(&v, &a.sock, ALL);
    for k in 0..50 {
        let (w, d) = write(qp.qpn(), 5000 + k, target.addr, trk, 8, 0xE5);
        a.send(&w, &d);
    }
    assert_eq!(naks(&a.sync(&probe)), vec![NakCode::PsnSequenceError], "one NAK per gap");
    for k in 0..50 {
        let (w, d) = write(qp.qpn(), 10 + k, target.addr, trk, 8, 0xE5);
        a.send(&w, &d);
    }
    let ans = a.sync(&probe);
    assert!(naks(&ans).is_empty() && !ans.is_empty(), "duplicates are re-ACKed, never NAKed: {ans:?}");
    legit();

    // 6. A flood of SENDs with no receive posted: RNR NAKs, bounded, and the QP stays up.
    let qp = victim_qp(&v, &a.sock, ALL);
    for _ in 0..2000 {
        let mut s = req(0x04, qp.qpn(), 100);
        s.payload_len = 16;
        a.send(&s, &[0xE6; 16]);
    }
    let ans = a.sync(&probe);
    assert!(!ans.is_empty(), "RNR NAKs");
    assert!(ans.iter().all(|x| matches!(x.2, Some(AethSyndrome::RnrNak { .. }))), "only RNR NAKs");
    assert_eq!(qp.state(), softrdma::QpState::Rts);
    legit();

    // 7. A valid WRITE (right QPN, PSN and key) from anyone but the peer does nothing:
    // from another address, or from the peer's address and another port. From the peer
    // it is executed once; a duplicate with other bytes is not executed.
    let qp = victim_qp(&v, &a.sock, ALL);
    let spot = target.addr + 4096;
    let (w, d) = write(qp.qpn(), 100, spot, trk, 64, 0xE7);
    a.send(&w, &d); // latches the attacker's port as the peer's
    assert!(naks(&a.sync(&probe)).is_empty());
    let elsewhere = Attacker::at("127.0.4.5:0", v.ctx.local_addr());
    let other_port = Attacker::at("127.0.4.4:0", v.ctx.local_addr());
    let dropped = qp.stats().dropped;
    for x in [&elsewhere, &other_port] {
        let (w, d) = write(qp.qpn(), 101, spot + 64, trk, 64, 0xEB);
        x.send(&w, &d);
    }
    assert!(a.sync(&probe).is_empty());
    for x in [&elsewhere, &other_port] {
        x.sock.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
        assert!(x.sock.recv(&mut [0u8; 64]).is_err(), "nothing is answered to a non-peer");
    }
    assert_eq!(qp.stats().dropped - dropped, 2);
    assert_eq!(qp.stats().wrong_port, 1);
    let (w, d) = write(qp.qpn(), 100, spot, trk, 64, 0xEC);
    a.send(&w, &d);
    assert!(naks(&a.sync(&probe)).is_empty());
    legit();

    // Nothing outside the target changed, and in the target only the one WRITE executed.
    for (mr, data) in &v.guards {
        assert_eq!(&mr.to_vec(), data, "a guard region changed");
    }
    let mut expected = vec![0u8; target.len as usize];
    expected[4096..4096 + 64].fill(0xE7);
    assert!(v.target.to_vec() == expected, "the target holds exactly the one valid WRITE");
    legit();

    // 8. Memory stays bounded: after a warm-up flood, a second flood of every attack
    // above leaves no per-packet state behind.
    let flood = |n: u64| {
        let qp = victim_qp(&v, &a.sock, ALL);
        let before = v.ctx.endpoint_stats().received;
        for k in 0..n {
            match k % 4 {
                0 => a.send_raw(&whole[..(k as usize % whole.len())]),
                1 => {
                    let (w, d) = write(qp.qpn(), 5000 + k as u32, target.addr, trk, 64, 0xE8);
                    a.send(&w, &d);
                }
                2 => {
                    let mut s = req(0x04, qp.qpn(), 100);
                    s.payload_len = 16;
                    a.send(&s, &[0xE8; 16]);
                }
                _ => {
                    let mut r = req(0x0C, qp.qpn(), 50);
                    r.ext.reth = Some(RethRepr { va: target.addr, rkey: trk, dma_len: 64 });
                    a.send(&r, &[]);
                }
            }
            if k % 1000 == 999 {
                a.sync(&probe);
            }
        }
        a.sync(&probe);
        v.ctx.endpoint_stats().received - before
    };
    flood(50_000);
    let rss_before = rss();
    let n = flood(200_000);
    let grown = rss().saturating_sub(rss_before);
    assert!(n > 100_000, "the flood arrived ({n} datagrams)");
    eprintln!("hostile: {n} datagrams, resident memory grew by {grown} bytes");
    assert!(grown < n as usize * 16, "resident memory grew by {grown} bytes over {n} datagrams");
    legit();
}

/// Resident memory of this process in bytes.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: usize =
        statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).expect("statm's RSS field");
    pages * 4096
}

#[test]
fn qp_numbers_are_unpredictable() {
    // Two devices: the QPNs of one tell nothing about the other's.
    let qpns = |ip: [u8; 4]| {
        let ctx = Context::open_port(IpAddr::from(ip), 0).unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(16, None).unwrap();
        let qps: Vec<_> = (0..100).map(|_| pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap()).collect();
        qps.iter().map(|q| q.endpoint().qpn).collect::<Vec<u32>>()
    };
    let (a, b) = (qpns([127, 0, 4, 6]), qpns([127, 0, 4, 7]));
    for q in [&a, &b] {
        let close = q.windows(2).filter(|w| w[1].wrapping_sub(w[0]) & 0xFF_FFFF < 1024).count();
        assert!(close < 3, "QPNs look sequential: {:x?}", &q[..8]);
        assert!(q.iter().all(|&n| (16..1 << 24).contains(&n)), "QPNs in 16..2^24");
        let mut d = q.clone();
        d.sort_unstable();
        d.dedup();
        assert_eq!(d.len(), q.len(), "QPNs distinct");
    }
    assert_ne!(a[0], b[0], "two devices start from different QPNs");
    // The top bits are used too: 100 draws from 2^24 all below 2^20 would be a sign of a
    // narrow generator.
    assert!(a.iter().chain(&b).any(|&n| n >= 1 << 20));
}

#[test]
fn keys_are_unpredictable_and_dead_at_once() {
    let ctx = Context::open_port(IpAddr::from([127, 0, 4, 5]), 0).unwrap();
    let pd = ctx.alloc_pd();
    let mrs: Vec<MemoryRegion> = (0..200).map(|_| pd.register(64, ALL).unwrap()).collect();
    let mut keys: Vec<u32> = mrs.iter().flat_map(|m| [m.lkey().get(), m.rkey().get()]).collect();
    let sequential =
        mrs.windows(2).filter(|w| w[1].rkey().get().wrapping_sub(w[0].rkey().get()) < 1024).count();
    assert!(sequential < 5, "keys look sequential");
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), 400, "lkeys and rkeys are all distinct");
    // A deregistered region's key is dead at once: a peer's WRITE to it fails.
    let a = Attacker::new(ctx.local_addr());
    let cq = ctx.create_cq(16, None).unwrap();
    let p = pd.prepare_qp(&QpBuilder::rc().access(ALL), &cq, &cq).unwrap();
    let fake =
        EndpointInfo { addr: a.sock.local_addr().unwrap(), qpn: 0x55, psn: 100, mtu: 1024, region: None };
    let qp = p.handshake(&fake, &ConnectOptions::default()).unwrap();
    let victim = &mrs[17];
    let (addr, key) = (victim.addr(), victim.rkey());
    let mut mrs = mrs;
    drop(mrs.remove(17));
    let (w, d) = write(qp.qpn(), 100, addr, key, 8, 0xE9);
    a.send(&w, &d);
    assert_eq!(naks(&answers(&a)), vec![NakCode::RemoteAccessError]);
}

/// What arrives within a short while (for a test with no probe QP).
fn answers(a: &Attacker) -> Vec<Answer> {
    std::iter::from_fn(|| answers_once(a)).collect()
}

/// The next datagram's answer, if one arrives within the read timeout.
fn answers_once(a: &Attacker) -> Option<Answer> {
    let mut buf = [0u8; 9000];
    let n = a.sock.recv(&mut buf).ok()?;
    let p = Packet::new_checked(&buf[..n]).ok()?;
    let syn = p.aeth().and_then(|x| AethSyndrome::from_byte(x.syndrome_raw()).ok());
    Some((p.opcode(), p.bth().psn(), syn, p.payload().to_vec()))
}
