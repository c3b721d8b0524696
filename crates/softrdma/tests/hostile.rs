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

/// A QP of the victim connected to the attacker's socket, which pretends to be a QP.
fn victim_qp(v: &Victim, attacker: &UdpSocket, access: Access) -> QueuePair {
    let p = v.pd.prepare_qp(&QpBuilder::rc().access(access), &v.cq, &v.cq).unwrap();
    let fake =
        EndpointInfo { addr: attacker.local_addr().unwrap(), qpn: 0x123, psn: 100, mtu: 1024, region: None };
    p.handshake(&fake, &ConnectOptions::default()).unwrap()
}

struct Attacker {
    sock: UdpSocket,
    to: SocketAddr,
}

impl Attacker {
    fn new(to: SocketAddr) -> Attacker {
        let sock = UdpSocket::bind("127.0.4.4:0").unwrap();
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
    /// The AETH syndromes of the answers that arrive within a short while.
    fn answers(&self) -> Vec<(Opcode, Psn, Option<AethSyndrome>)> {
        let mut out = Vec::new();
        let mut buf = [0u8; 9000];
        while let Ok(n) = self.sock.recv(&mut buf) {
            if let Ok(p) = Packet::new_checked(&buf[..n]) {
                let syn = p.aeth().and_then(|a| AethSyndrome::from_byte(a.syndrome_raw()).ok());
                out.push((p.opcode(), p.bth().psn(), syn));
            }
        }
        out
    }
}

fn req(opcode: u8, qpn: softrdma::Qpn, psn: u32) -> PacketRepr {
    let mut b = BthRepr::new(Opcode::new(opcode).unwrap(), qpn, Psn::new(psn));
    b.ack_req = true;
    PacketRepr::new(b, 0)
}

fn write(qpn: softrdma::Qpn, psn: u32, va: u64, rkey: Rkey, len: usize) -> (PacketRepr, Vec<u8>) {
    let mut r = req(0x0A, qpn, psn);
    r.payload_len = len;
    r.ext.reth = Some(RethRepr { va, rkey, dma_len: len as u32 });
    (r, vec![0xEE; len])
}

fn naks(answers: &[(Opcode, Psn, Option<AethSyndrome>)]) -> Vec<NakCode> {
    answers
        .iter()
        .filter_map(|a| match a.2 {
            Some(AethSyndrome::Nak(c)) => Some(c),
            _ => None,
        })
        .collect()
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
        vq.post_recv(RecvWr { wr_id: 77, sg_list: vec![dst.sge(0, 256).unwrap()] }).unwrap();
        let flags = SendFlags { signaled: true, ..Default::default() };
        oq.post_send(SendWr {
            wr_id: 1,
            op: SendOp::Send,
            sg_list: vec![src.sge(0, 256).unwrap()],
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
    let target = v.target.remote();
    let trk = Rkey(target.rkey);
    let rss_before = rss();

    // 1. Garbage and truncations: dropped silently, nothing answered.
    let mut seed = 0x9E37_79B9u32;
    for k in 0..2000 {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let len = (seed >> 20) as usize % 300;
        let bytes: Vec<u8> = (0..len).map(|i| (seed.wrapping_mul(i as u32 + 1) >> 11) as u8).collect();
        a.send_raw(&bytes);
        if k % 500 == 0 {
            legit();
        }
    }
    let qp = victim_qp(&v, &a.sock, ALL);
    let (w, data) = write(qp.qpn(), 100, target.addr, trk, 64);
    let mut whole = vec![0u8; w.total_len()];
    w.emit(&mut whole, &data, &a.encap()).unwrap();
    for cut in 0..whole.len() {
        a.send_raw(&whole[..cut]);
    }
    // Every opcode to QPNs that do not exist.
    for op in Opcode::all() {
        for qpn in [0u32, 1, 2, 0xFFFFFE, qp.qpn().get() + 1000] {
            let mut r = req(op.code(), softrdma::Qpn::new(qpn), 5);
            fill_headers(&mut r);
            a.send(&r, &vec![0; payload_for(op)]);
        }
    }
    assert!(naks(&a.answers()).is_empty(), "no answer to garbage or unknown QPs");
    legit();

    // 2. Guessed keys, the key of a region without remote write, a key of another PD:
    // each is a remote access error, and the QP fails.
    let guard_keys = [
        v.guards[0].0.rkey(),
        v.guards[1].0.rkey(),
        v.guards[2].0.rkey(),
        Rkey(trk.0 ^ 0x100),
        Rkey(trk.0.wrapping_add(1)),
    ];
    for key in guard_keys {
        let qp = victim_qp(&v, &a.sock, ALL);
        let addr = if key == v.guards[2].0.rkey() { v.guards[2].0.addr() } else { target.addr };
        let (w, d) = write(qp.qpn(), 100, addr, key, 64);
        a.send(&w, &d);
        assert_eq!(naks(&a.answers()), vec![NakCode::RemoteAccessError], "key {key:?}");
    }
    legit();

    // 3. A WRITE that overruns the target's end by one byte, a READ of 2 GiB (would be a
    // huge amplification), a misaligned atomic.
    let qp = victim_qp(&v, &a.sock, ALL);
    let (w, d) = write(qp.qpn(), 100, target.addr + target.len - 63, trk, 64);
    a.send(&w, &d);
    assert_eq!(naks(&a.answers()), vec![NakCode::RemoteAccessError]);
    let qp = victim_qp(&v, &a.sock, ALL);
    let mut r = req(0x0C, qp.qpn(), 100);
    r.ext.reth = Some(RethRepr { va: target.addr, rkey: trk, dma_len: 1 << 31 });
    a.send(&r, &[]);
    let ans = a.answers();
    assert_eq!(naks(&ans), vec![NakCode::RemoteAccessError]);
    assert!(ans.len() < 4, "no flood of READ responses: {}", ans.len());
    let qp = victim_qp(&v, &a.sock, ALL);
    let mut r = req(0x14, qp.qpn(), 100);
    r.ext.atomic_eth = Some(AtomicEthRepr { va: target.addr + 4, rkey: trk, swap_add: 1, compare: 0 });
    a.send(&r, &[]);
    assert_eq!(naks(&a.answers()), vec![NakCode::InvalidRequest]);
    // A QP without remote rights: invalid request even with a good key.
    let qp = victim_qp(&v, &a.sock, Access::NONE);
    let (w, d) = write(qp.qpn(), 100, target.addr, trk, 8);
    a.send(&w, &d);
    assert_eq!(naks(&a.answers()), vec![NakCode::InvalidRequest]);
    legit();

    // 4. Forged PSNs: ahead of the window (one sequence NAK, however many arrive), behind
    // it (a re-ACK, nothing executed).
    let qp = victim_qp(&v, &a.sock, ALL);
    for k in 0..50 {
        let (w, d) = write(qp.qpn(), 5000 + k, target.addr, trk, 8);
        a.send(&w, &d);
    }
    assert_eq!(naks(&a.answers()), vec![NakCode::PsnSequenceError], "one NAK per gap");
    for k in 0..50 {
        let (w, d) = write(qp.qpn(), 10 + k, target.addr, trk, 8);
        a.send(&w, &d);
    }
    assert!(naks(&a.answers()).is_empty(), "duplicates are re-ACKed, never NAKed");
    legit();

    // 5. A flood of SENDs with no receive posted: RNR NAKs, bounded, and the QP stays up.
    let qp = victim_qp(&v, &a.sock, ALL);
    for _ in 0..2000 {
        let mut s = req(0x04, qp.qpn(), 100);
        s.payload_len = 16;
        a.send(&s, &[1; 16]);
    }
    let ans = a.answers();
    assert!(ans.iter().all(|x| matches!(x.2, Some(AethSyndrome::RnrNak { .. }))), "only RNR NAKs");
    assert_eq!(qp.state(), softrdma::QpState::Rts);
    legit();

    // Nothing outside the target changed; the target only where no attack reached.
    for (mr, data) in &v.guards {
        assert_eq!(&mr.to_vec(), data, "a guard region changed");
    }
    assert!(v.target.to_vec().iter().all(|&b| b == 0 || b == 0xEE));
    legit();
    // Memory stays bounded: the attacks leave no queues or buffers behind.
    let grown = rss().saturating_sub(rss_before);
    assert!(grown < 64 << 20, "resident memory grew by {grown} bytes");
}

/// Resident memory of this process in bytes.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
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
    let (w, d) = write(qp.qpn(), 100, addr, key, 8);
    a.send(&w, &d);
    assert_eq!(naks(&a.answers()), vec![NakCode::RemoteAccessError]);
}
