//! Cross-checks our RoCEv2 emitter against an independent implementation: Wireshark's
//! InfiniBand dissector, run as `tshark`.
//!
//! The test builds one packet of every opcode softrdma knows, once over IPv4 and once over
//! IPv6, each with the extension headers its opcode calls for filled with realistic values
//! and a payload of a size its opcode allows (odd sizes, so that every pad count appears).
//! It adds a connection manager REQ to QP1 on each family, writes everything as Ethernet
//! frames into a pcap file and has tshark dissect it. For every frame, tshark must read the
//! opcode, destination QP, PSN, SE, AckReq and PadCnt we wrote, and report neither a
//! malformed packet nor an expert warning or error; it must see as many frames as we wrote.
//! Where tshark decodes the extension headers, the ICRC it finds must be our last four
//! bytes and the data it shows must be our payload: a header of another length than
//! Wireshark's would shift both. This proves our BTH and extension header layouts agree with
//! Wireshark's, and our IPv4 header and UDP checksums too (tshark is asked to verify them).
//!
//! tshark 4.0 (Debian 12) falls short in a few places, which the test works around rather
//! than copies:
//!
//! - it does not know FLUSH (0x1C), ATOMIC_WRITE (0x1D) and CNP (0x81): it names them
//!   "Unknown" and shows everything after their BTH as opaque data. Opcodes are compared as
//!   numbers, and for these three only the BTH is checked;
//! - it decodes the payload of a UD packet to QP1 as a MAD and flags filler bytes there as
//!   malformed, so the QP1 packets carry a real MAD (a CM REQ) and the other UD packets go
//!   to other QPs;
//! - it rejects an IPv6 UDP checksum of zero (RFC 8200 forbids it), so every datagram
//!   carries its real UDP checksum (softrdma's senders leave it to the kernel);
//! - its RPC-over-RDMA heuristic reads 16 bytes of an RC SEND payload before checking its
//!   length and reports short SENDs as malformed, so that heuristic is turned off.
//!
//! tshark is not a Rust dependency. Without it the test prints why and passes, except when
//! the `CI` environment variable is set: CI installs tshark, so there its absence fails.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;

use softrdma_proto::wire::ip::{Ipv4Repr, Ipv6Repr, UdpRepr, PROTO_UDP};
use softrdma_proto::wire::mad::{MadHeader, MAD_LEN, MGMT_CLASS_CM};
use softrdma_proto::wire::{
    icrc, pad_count, AethRepr, AethSyndrome, AtomicAckEthRepr, AtomicEthRepr, BthRepr, DethRepr, FethRepr,
    HeaderKind, IethRepr, ImmDtRepr, Opcode, Operation, PacketRepr, PayloadRule, Position, RethRepr,
    Transport, ICRC_LEN, ROCEV2_PORT,
};
use softrdma_proto::{Psn, Qkey, Qpn, Rkey};

/// The path MTU the packets are built for: the smallest InfiniBand MTU.
const PMTU: usize = 256;

/// The Q_Key of the UD packets that do not go to QP1.
const UD_QKEY: Qkey = Qkey(0x1111_1111);

/// What we put into one frame, to compare with what tshark reads back.
#[derive(Debug)]
struct Sent {
    /// 1-based frame number, as tshark counts.
    frame: usize,
    family: &'static str,
    /// The BTH as emitted, pad count included.
    bth: BthRepr,
    payload_len: usize,
    /// The last four bytes of the UDP payload, read big-endian as tshark shows them.
    icrc: u32,
    /// Whether the payload is a MAD (to QP1), which tshark decodes instead of showing data.
    mad: bool,
}

/// One IP family: the addresses and the Ethernet type.
struct Family {
    name: &'static str,
    src: IpAddr,
    dst: IpAddr,
    ethertype: u16,
}

fn families() -> [Family; 2] {
    [
        Family {
            name: "IPv4",
            src: IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
            dst: IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
            ethertype: 0x0800,
        },
        Family {
            name: "IPv6",
            src: IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1)),
            dst: IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2)),
            ethertype: 0x86DD,
        },
    ]
}

/// The payload length packet number `i` of `opcode` carries, within the opcode's rule.
fn payload_len(opcode: Opcode, i: usize) -> usize {
    match opcode.payload() {
        PayloadRule::None => 0,
        PayloadRule::Full => PMTU,
        PayloadRule::Exactly(n) => n,
        // Lengths that are not multiples of 4, so that every PadCnt appears.
        PayloadRule::NonEmpty => [13, 37, 1, 255][i % 4],
        PayloadRule::UpToMtu => [37, 13, 255, 2][i % 4],
    }
}

/// A packet of `opcode` with every extension header it needs, as a real sender would fill
/// them, and its payload. `i` makes QPN and PSN unique (the PSN wraps through 0).
fn build(opcode: Opcode, i: usize) -> (PacketRepr, Vec<u8>) {
    let len = payload_len(opcode, i);
    let qpn = Qpn::new(0x100 + i as u32);
    let psn = Psn::new(0xFF_FFF0).wrapping_add(i as u32);
    let mut bth = BthRepr::new(opcode, qpn, psn);
    let last = matches!(opcode.position(), Position::Last | Position::Only);
    // A requester asks for an ACK at the end of a message (and rxe on every few packets).
    bth.ack_req = opcode.transport() == Transport::Rc && opcode.is_request() && (last || i % 3 == 0);
    bth.solicited = opcode.headers().contains(HeaderKind::ImmDt) && i % 2 == 0;
    if opcode.transport() == Transport::Cnp {
        bth.becn = true;
    }
    let mut r = PacketRepr::new(bth, len);
    let h = opcode.headers();
    let e = &mut r.ext;
    if h.contains(HeaderKind::Deth) {
        e.deth = Some(DethRepr { qkey: UD_QKEY, src_qp: Qpn::new(0x200 + i as u32) });
    }
    if h.contains(HeaderKind::Feth) {
        // Global visibility of a memory range.
        e.feth = Some(FethRepr { placement_type: 1, selectivity: 0 });
    }
    if h.contains(HeaderKind::Reth) {
        let dma_len = match opcode.operation() {
            // The whole message: this packet and two more.
            Operation::RdmaWriteFirst => (3 * PMTU) as u32,
            Operation::RdmaReadRequest => 4096,
            Operation::Flush => 64,
            _ => len as u32,
        };
        e.reth = Some(RethRepr { va: 0x7f3a_5c20_1000 + 0x40 * i as u64, rkey: Rkey(0x0001_2345), dma_len });
    }
    if h.contains(HeaderKind::AtomicEth) {
        let compare = if opcode.operation() == Operation::CompareSwap { 0x1122_3344_5566_7788 } else { 0 };
        e.atomic_eth =
            Some(AtomicEthRepr { va: 0x7f3a_5c20_2008, rkey: Rkey(0x0001_2346), swap_add: 0x2a, compare });
    }
    if h.contains(HeaderKind::Aeth) {
        // ACKs without credit information, as rxe sends them, and one with a credit count.
        let syndrome = if i % 2 == 0 { AethSyndrome::ACK } else { AethSyndrome::Ack { credit_code: 6 } };
        e.aeth = Some(AethRepr { syndrome, msn: 0x40 + i as u32 });
    }
    if h.contains(HeaderKind::AtomicAckEth) {
        e.atomic_ack_eth = Some(AtomicAckEthRepr { orig: 0x1122_3344_5566_7788 });
    }
    if h.contains(HeaderKind::ImmDt) {
        e.immdt = Some(ImmDtRepr { value: 0xC0FF_EE00 + i as u32 });
    }
    if h.contains(HeaderKind::Ieth) {
        e.ieth = Some(IethRepr { rkey: Rkey(0x0001_2347) });
    }
    let payload = (0..len).map(|k| (k * 7 + i) as u8).collect();
    (r, payload)
}

/// A UD SEND_ONLY to QP1 carrying a connection manager REQ, as rdma_connect sends one.
fn cm_req(i: usize, fam: &Family) -> (PacketRepr, Vec<u8>) {
    let opcode =
        Opcode::from_parts(Transport::Ud, Operation::SendOnly).expect("UD SEND_ONLY is in the table");
    let psn = Psn::new(0xFF_FFF0).wrapping_add(i as u32);
    let mut r = PacketRepr::new(BthRepr::new(opcode, Qpn::GSI, psn), MAD_LEN);
    r.ext.deth = Some(DethRepr { qkey: Qkey::GSI, src_qp: Qpn::GSI });

    let mut mad = vec![0u8; MAD_LEN];
    let header = MadHeader {
        base_version: 1,
        mgmt_class: MGMT_CLASS_CM,
        class_version: 2,
        method: 0x03, // Send
        status: 0,
        class_specific: 0,
        transaction_id: 0x0000_0001_9e3c_4a5b + i as u64,
        attribute_id: 0x0010, // REQ
        attribute_modifier: 0,
    };
    let head: &mut [u8; MadHeader::LEN] =
        (&mut mad[..MadHeader::LEN]).try_into().expect("a MAD is longer than its header");
    header.emit(head);

    // The REQ message (IBTA vol. 1, 12.6.5), after the common header.
    let gid = |a: IpAddr| match a {
        IpAddr::V4(v) => v.to_ipv6_mapped().octets(),
        IpAddr::V6(v) => v.octets(),
    };
    let req = &mut mad[MadHeader::LEN..];
    // Local communication ID, service ID (RDMA_PS_TCP, port 0x4a2d), local CA GUID.
    req[0..4].copy_from_slice(&(0x5a5a_0000 + i as u32).to_be_bytes());
    req[8..16].copy_from_slice(&0x0000_0000_0106_4a2du64.to_be_bytes());
    req[16..24].copy_from_slice(&0x5254_00ff_fe12_3456u64.to_be_bytes());
    // Local Q_Key 0; local QPN 0x11 with 16 responder resources; initiator depth 16.
    req[32..36].copy_from_slice(&((0x11u32 << 8) | 16).to_be_bytes());
    req[36..40].copy_from_slice(&16u32.to_be_bytes());
    // Remote CM response timeout 20, transport RC, end-to-end flow control.
    req[40..44].copy_from_slice(&((20u32 << 3) | 1).to_be_bytes());
    // Starting PSN, local CM response timeout 20, retry count 7.
    req[44..48].copy_from_slice(&((0x00ab_cdefu32 << 8) | (20 << 3) | 7).to_be_bytes());
    // P_Key, path MTU 1024 and RNR retry count 7, max CM retries 15.
    req[48..50].copy_from_slice(&0xFFFFu16.to_be_bytes());
    req[50] = (3 << 4) | 7;
    req[51] = 15 << 4;
    // Primary path: permissive LIDs, the GIDs, hop limit 64, local ACK timeout 18.
    req[52..56].copy_from_slice(&[0xFF; 4]);
    req[56..72].copy_from_slice(&gid(fam.src));
    req[72..88].copy_from_slice(&gid(fam.dst));
    req[93] = 64;
    req[95] = 18 << 3;
    // No alternate path. The private data starts with rdma_cm's header: version 0, the IP
    // version, the source port and both addresses (IPv4 in the last four bytes of each).
    let (version, src, dst) = match (fam.src, fam.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let (mut a, mut b) = ([0u8; 16], [0u8; 16]);
            a[12..].copy_from_slice(&s.octets());
            b[12..].copy_from_slice(&d.octets());
            (4, a, b)
        }
        (s, d) => (6, gid(s), gid(d)),
    };
    let private = &mut req[140..];
    private[1] = version << 4;
    private[2..4].copy_from_slice(&0xC1A0u16.to_be_bytes());
    private[4..20].copy_from_slice(&src);
    private[20..36].copy_from_slice(&dst);
    (r, mad)
}

/// An Ethernet frame holding `udp_payload` from `src` to `dst` over IPv4 or IPv6, with
/// the IPv4 header checksum and the real UDP checksum.
fn frame(fam: &Family, src_port: u16, udp_payload: &[u8]) -> Vec<u8> {
    let udp_len = UdpRepr::LEN + udp_payload.len();
    let mut udp = UdpRepr { src_port, dst_port: ROCEV2_PORT, length: udp_len as u16, checksum: 0 };
    udp.checksum = udp.checksum_for(fam.src, fam.dst, udp_payload);

    let mut f = Vec::with_capacity(14 + 40 + udp_len);
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]); // destination MAC
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]); // source MAC
    f.extend_from_slice(&fam.ethertype.to_be_bytes());
    match (fam.src, fam.dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            // ECT(0), as RoCE traffic is marked for ECN.
            let ip = Ipv4Repr::canonical(src, dst, 0x02, udp_len as u16).unwrap();
            let mut b = [0u8; 20];
            ip.emit(&mut b);
            f.extend_from_slice(&b);
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let ip = Ipv6Repr {
                src,
                dst,
                traffic_class: 0x02,
                flow_label: 0,
                payload_len: udp_len as u16,
                next_header: PROTO_UDP,
                hop_limit: 64,
            };
            let mut b = [0u8; Ipv6Repr::LEN];
            ip.emit(&mut b);
            f.extend_from_slice(&b);
        }
        _ => unreachable!("a family has addresses of one version"),
    }
    let mut b = [0u8; UdpRepr::LEN];
    udp.emit(&mut b);
    f.extend_from_slice(&b);
    f.extend_from_slice(udp_payload);
    f
}

/// A classic pcap file (microsecond timestamps, little-endian) of Ethernet frames.
fn pcap(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes()); // magic
    out.extend_from_slice(&2u16.to_le_bytes()); // version 2.4
    out.extend_from_slice(&4u16.to_le_bytes());
    out.extend_from_slice(&0i32.to_le_bytes()); // GMT offset
    out.extend_from_slice(&0u32.to_le_bytes()); // timestamp accuracy
    out.extend_from_slice(&65535u32.to_le_bytes()); // snap length
    out.extend_from_slice(&1u32.to_le_bytes()); // LINKTYPE_ETHERNET
    for (n, f) in frames.iter().enumerate() {
        out.extend_from_slice(&1_700_000_000u32.to_le_bytes());
        out.extend_from_slice(&(n as u32 * 10).to_le_bytes());
        out.extend_from_slice(&(f.len() as u32).to_le_bytes()); // captured length
        out.extend_from_slice(&(f.len() as u32).to_le_bytes()); // original length
        out.extend_from_slice(f);
    }
    out
}

/// Every opcode on both families plus a CM REQ to QP1 on each, as frames.
fn capture() -> (Vec<Vec<u8>>, Vec<Sent>) {
    let mut frames = Vec::new();
    let mut sent = Vec::new();
    let mut i = 0;
    for fam in families() {
        let mut packets: Vec<(PacketRepr, Vec<u8>)> = Opcode::all()
            .map(|opcode| {
                i += 1;
                build(opcode, i)
            })
            .collect();
        i += 1;
        packets.push(cm_req(i, &fam));
        for (repr, payload) in packets {
            let src_port = 0xC000 + frames.len() as u16;
            let src = SocketAddr::new(fam.src, src_port);
            let encap = icrc::Encap::new(src, SocketAddr::new(fam.dst, ROCEV2_PORT))
                .expect("source and destination are of one family");
            let mut udp_payload = vec![0u8; repr.total_len()];
            let n = repr
                .emit(&mut udp_payload, &payload, &encap)
                .unwrap_or_else(|e| panic!("emitting {}: {e}", repr.bth.opcode));
            assert_eq!(n, udp_payload.len());
            frames.push(frame(&fam, src_port, &udp_payload));
            let tail = &udp_payload[n - ICRC_LEN..];
            sent.push(Sent {
                frame: frames.len(),
                family: fam.name,
                bth: BthRepr { pad_count: pad_count(payload.len()), ..repr.bth },
                payload_len: payload.len(),
                icrc: u32::from_be_bytes([tail[0], tail[1], tail[2], tail[3]]),
                mad: repr.bth.dest_qp == Qpn::GSI,
            });
        }
    }
    (frames, sent)
}

/// Deletes the capture file when the test ends, whether it passes or not.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Whether this runs under CI: `CI` set to anything but empty, `0` or `false`.
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.to_ascii_lowercase().as_str(), "" | "0" | "false"))
}

/// Whether tshark can be run; without it, fails under CI and skips elsewhere.
fn tshark_available() -> bool {
    match Command::new("tshark").arg("--version").output() {
        Ok(out) if out.status.success() => true,
        result => {
            let why = match result {
                Ok(out) => format!("`tshark --version` exited with {}", out.status),
                Err(e) => format!("cannot run tshark: {e}"),
            };
            assert!(!in_ci(), "{why}; CI must install tshark (Wireshark 4.0)");
            eprintln!("SKIPPED: the tshark cross-check (0 frames checked): {why}");
            false
        }
    }
}

/// The fields tshark prints per frame, in this order.
const FIELDS: [&str; 12] = [
    "frame.number",
    "infiniband.bth.opcode",
    "infiniband.bth.destqp",
    "infiniband.bth.psn",
    "infiniband.bth.se",
    "infiniband.bth.a",
    "infiniband.bth.padcnt",
    "infiniband.invariant.crc",
    "data.len",
    "infiniband.mad.attributeid",
    "_ws.malformed",
    "_ws.expert.severity",
];
const EXPERT_MESSAGE: &str = "_ws.expert.message";

/// Opcodes tshark 4.0 does not know: it decodes their BTH, then shows the rest of the
/// packet as unknown data, without ICRC. 0xC0 is softrdma's vendor SACK.
const UNKNOWN_TO_TSHARK_4_0: [u8; 4] = [0x1C, 0x1D, 0x81, 0xC0];

/// Runs tshark's dissectors over `path` and returns, per frame, the [`FIELDS`] and the
/// expert messages.
fn dissect(path: &Path) -> Vec<Vec<String>> {
    let mut cmd = Command::new("tshark");
    // -n: no name resolution. tshark decodes UDP port 4791 as InfiniBand by default.
    //
    // Checksum validation is off by default in Wireshark; it is turned on so that a wrong
    // IPv4 header checksum or UDP checksum shows up as an expert error.
    //
    // The RPC-over-RDMA heuristic is disabled: it reads 16 bytes of any RC SEND_ONLY or
    // SEND_LAST payload (with or without invalidate) before it checks the length, so a
    // short SEND, whose payload, pad and ICRC make fewer than 16 bytes, raises an exception
    // that tshark reports as a malformed packet (a Wireshark bug, not a malformation).
    cmd.arg("-n")
        .args(["-o", "ip.check_checksum:TRUE", "-o", "udp.check_checksum:TRUE"])
        .args(["--disable-heuristic", "rpcrdma_infiniband"])
        .arg("-r")
        .arg(path)
        .args(["-T", "fields", "-E", "separator=/t", "-E", "occurrence=a", "-E", "aggregator=|"]);
    for f in FIELDS.iter().chain([&EXPERT_MESSAGE]) {
        cmd.args(["-e", f]);
    }
    let out = cmd.output().unwrap_or_else(|e| panic!("running tshark: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "tshark failed with {}: {stderr}", out.status);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split('\t').map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

/// Parses a number as tshark prints it: decimal, or hexadecimal with `0x`.
fn number(s: &str) -> Option<u32> {
    match s.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// Wireshark's expert severity PI_WARN; warnings and errors (PI_ERROR) fail the test.
const PI_WARN: u32 = 0x0060_0000;

/// Checks one row of tshark's output against the frame we wrote.
fn check(row: &[String], s: &Sent) {
    let op = s.bth.opcode;
    let what = format!("frame {} ({} {:#04x} {op})", s.frame, s.family, op.code());
    assert_eq!(row.len(), FIELDS.len() + 1, "{what}: tshark printed {row:?}");
    let field = |name: &str| {
        let k = FIELDS.iter().position(|f| *f == name).unwrap_or_else(|| panic!("{name} is not in FIELDS"));
        row[k].as_str()
    };
    let num = |name: &str| number(field(name));
    let flag = |name: &str| match field(name) {
        "1" | "True" => Some(true),
        "0" | "False" => Some(false),
        _ => None,
    };
    let messages = &row[FIELDS.len()];

    assert!(field("_ws.malformed").is_empty(), "{what}: tshark reports a malformed packet: {messages}");
    let severities = field("_ws.expert.severity").split('|').filter(|v| !v.is_empty());
    assert!(
        severities.map(number).all(|v| v.is_some_and(|v| v < PI_WARN)),
        "{what}: tshark expert warning or error: {messages}"
    );
    assert_eq!(num("frame.number"), Some(s.frame as u32), "{what}: frame number");
    assert_eq!(num("infiniband.bth.opcode"), Some(u32::from(op.code())), "{what}: opcode");
    assert_eq!(num("infiniband.bth.destqp"), Some(s.bth.dest_qp.get()), "{what}: destination QP");
    assert_eq!(num("infiniband.bth.psn"), Some(s.bth.psn.get()), "{what}: PSN");
    assert_eq!(flag("infiniband.bth.se"), Some(s.bth.solicited), "{what}: SE");
    assert_eq!(flag("infiniband.bth.a"), Some(s.bth.ack_req), "{what}: AckReq");
    assert_eq!(num("infiniband.bth.padcnt"), Some(u32::from(s.bth.pad_count)), "{what}: PadCnt");

    // When tshark knows the opcode, it walks the extension headers and shows what is left
    // before the ICRC as data: if our headers had another length than Wireshark's, the
    // data length and the ICRC would be off. tshark 4.0 counts the pad bytes as data.
    match num("infiniband.invariant.crc") {
        Some(icrc) => {
            assert_eq!(icrc, s.icrc, "{what}: the ICRC tshark found is not the one we wrote");
            if s.mad {
                // QP1: tshark decodes the whole MAD (a CM REQ, attribute 0x0010), no data.
                assert_eq!(num("infiniband.mad.attributeid"), Some(0x0010), "{what}: the MAD");
                assert_eq!(field("data.len"), "", "{what}: bytes left after the MAD");
            } else {
                // tshark prints no data.len for a packet without payload bytes.
                let data = match field("data.len") {
                    "" => 0,
                    d => number(d).unwrap_or_else(|| panic!("{what}: data.len {d:?}")) as usize,
                };
                let pad = usize::from(s.bth.pad_count);
                assert!(
                    data == s.payload_len || data == s.payload_len + pad,
                    "{what}: tshark shows {data} bytes of data, we sent {} bytes and {pad} of pad",
                    s.payload_len,
                );
                assert_eq!(field("infiniband.mad.attributeid"), "", "{what}: no MAD");
            }
        }
        None => assert!(
            UNKNOWN_TO_TSHARK_4_0.contains(&op.code()),
            "{what}: tshark did not decode the headers of an opcode it knows"
        ),
    }
}

#[test]
fn tshark_dissects_every_opcode_as_we_emit_it() {
    if !tshark_available() {
        return;
    }
    let (frames, sent) = capture();
    let path = std::env::temp_dir().join(format!("softrdma-tshark-{}.pcap", std::process::id()));
    let file = TempFile(path);
    std::fs::write(&file.0, pcap(&frames)).unwrap_or_else(|e| panic!("writing {}: {e}", file.0.display()));

    let rows = dissect(&file.0);
    assert_eq!(rows.len(), sent.len(), "tshark read {} frames, we wrote {}", rows.len(), sent.len());
    for (row, s) in rows.iter().zip(&sent) {
        check(row, s);
    }
    let v4 = sent.iter().filter(|s| s.family == "IPv4").count();
    eprintln!(
        "tshark agrees on opcode, QPN and PSN of all {} frames ({v4} IPv4, {} IPv6)",
        sent.len(),
        sent.len() - v4
    );
}
