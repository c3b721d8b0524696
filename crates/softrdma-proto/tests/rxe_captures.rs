//! Every RoCEv2 packet captured from Linux rxe (IPv4 and IPv6) must parse, pass the exact
//! ICRC check, let the ID-agnostic check recover its real IPv4 Identification, and come
//! out of our emitter byte for byte as rxe sent it.

use std::net::{IpAddr, SocketAddrV4};
use std::path::PathBuf;

use pcap_parser::{parse_pcap_frame, parse_pcap_header};
use softrdma_proto::wire::ip::{parse_ip_udp, IpContent, IpRepr};
use softrdma_proto::wire::{icrc, Packet, PacketRepr, ROCEV2_PORT};

fn testdata(dir: &str) -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata").join(dir);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pcap"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no captures in {}", root.display());
    v
}

/// The UDP payloads to port 4791 in an Ethernet pcap, with their datagram metadata.
fn roce_frames(path: &PathBuf, mut f: impl FnMut(&softrdma_proto::wire::ip::UdpDatagram<'_>)) {
    let bytes = std::fs::read(path).unwrap();
    let (mut rest, header) = parse_pcap_header(&bytes).unwrap();
    assert_eq!(header.network.0, 1, "lab captures are Ethernet");
    while !rest.is_empty() {
        let (next, frame) = parse_pcap_frame(rest).unwrap();
        rest = next;
        let d = frame.data;
        if d.len() < 14 || !matches!(u16::from_be_bytes([d[12], d[13]]), 0x0800 | 0x86DD) {
            continue;
        }
        if let Ok(IpContent::Udp(dgram)) = parse_ip_udp(&d[14..]) {
            if dgram.udp.dst_port == ROCEV2_PORT {
                f(&dgram);
            }
        }
    }
}

fn check_dir(dir: &str) -> (usize, usize) {
    let (mut v4, mut v6) = (0, 0);
    for path in testdata(dir) {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        roce_frames(&path, |dgram| {
            let p = Packet::new_checked(dgram.payload).unwrap_or_else(|e| panic!("{name}: {e}"));
            let encap = dgram.encap();
            assert!(icrc::verify(&encap, dgram.payload), "{name}: ICRC of {}", p.opcode());

            // Re-emit from the parsed representation: identical bytes.
            let repr = PacketRepr::parse(&p).unwrap();
            let mut buf = vec![0u8; repr.total_len()];
            let n = repr.emit(&mut buf, p.payload(), &encap).unwrap();
            assert_eq!(&buf[..n], dgram.payload, "{name}: re-emitted {}", p.opcode());

            match dgram.ip {
                IpRepr::V4(h) => {
                    v4 += 1;
                    let (IpAddr::V4(s), IpAddr::V4(d)) = (dgram.ip.src(), dgram.ip.dst()) else {
                        unreachable!()
                    };
                    let got = icrc::solve_ipv4_ident(
                        SocketAddrV4::new(s, dgram.udp.src_port),
                        SocketAddrV4::new(d, dgram.udp.dst_port),
                        dgram.payload,
                    );
                    assert_eq!(
                        got,
                        Some(icrc::Ipv4Ident { ident: h.ident, dont_fragment: h.dont_fragment }),
                        "{name}: ID-agnostic check"
                    );
                    // One flipped payload bit must not verify exactly.
                    let mut bad = dgram.payload.to_vec();
                    bad[12] ^= 0x04;
                    assert!(!icrc::verify(&encap, &bad), "{name}: corruption missed");
                }
                IpRepr::V6(_) => v6 += 1,
            }
        });
    }
    (v4, v6)
}

#[test]
fn every_ipv4_rxe_packet_verifies_and_reemits() {
    let (v4, v6) = check_dir("rxe");
    // The counts in testdata/rxe/SUMMARY.txt.
    assert_eq!((v4, v6), (3038, 0));
}

#[test]
fn every_ipv6_rxe_packet_verifies_and_reemits() {
    let (v4, v6) = check_dir("rxe-ipv6");
    assert_eq!((v4, v6), (40, 641));
}

#[test]
fn deliberate_garbage_is_rejected() {
    let mut malformed = 0;
    let mut ok = 0;
    for path in testdata("rxe-misc") {
        roce_frames(&path, |dgram| match Packet::new_checked(dgram.payload) {
            Err(_) => malformed += 1,
            Ok(_) => {
                assert!(icrc::verify(&dgram.encap(), dgram.payload));
                ok += 1;
            }
        });
    }
    assert_eq!((ok, malformed), (2, 4));
}

/// Every CM MAD (QP1) in the captures: parsed, and emitted again byte for byte.
fn cm_mads(dirs: &[&str]) -> Vec<(String, softrdma_proto::cm::CmMad, std::net::IpAddr, std::net::IpAddr)> {
    use softrdma_proto::cm::CmMad;
    let mut out = Vec::new();
    for dir in dirs {
        for path in testdata(dir) {
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            roce_frames(&path, |dgram| {
                let Ok(p) = Packet::new_checked(dgram.payload) else { return };
                if p.bth().dest_qp().get() != 1 {
                    return;
                }
                let mad = p.payload();
                let m = CmMad::parse(mad).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(&m.emit()[..], &mad[..256], "{name}: {} re-emitted", m.msg.name());
                out.push((name.clone(), m, dgram.ip.src(), dgram.ip.dst()));
            });
        }
    }
    out
}

#[test]
fn every_cm_mad_from_linux_parses_and_reemits() {
    use softrdma_proto::cm::{parse_service_id, CmMsg, CmaHeader, PortSpace};
    let mads = cm_mads(&["rxe", "rxe-ipv6", "rxe-misc"]);
    let mut seen = std::collections::BTreeMap::<&str, usize>::new();
    for (_, m, _, _) in &mads {
        *seen.entry(m.msg.name()).or_default() += 1;
    }
    for kind in ["REQ", "REP", "RTU", "DREQ", "DREP", "REJ", "SIDR_REQ", "SIDR_REP"] {
        assert!(seen.contains_key(kind), "no {kind} in the captures: {seen:?}");
    }
    // rping's REQ (rping.pcap: 192.168.77.10 connects to 192.168.77.11, port 7174): the
    // rdma_cm conventions, field by field.
    let (_, req, src, dst) = mads
        .iter()
        .find(|(n, m, _, _)| n == "rping.pcap" && matches!(m.msg, CmMsg::Req(_)))
        .expect("rping's REQ");
    let CmMsg::Req(r) = &req.msg else { unreachable!() };
    assert_eq!(parse_service_id(r.service_id), Some((PortSpace::Tcp, 7174)));
    let h = CmaHeader::parse(&r.private_data).expect("rdma_cm header");
    assert_eq!((h.src.ip(), h.dst), (*src, *dst));
    assert_eq!(r.primary_path.remote_gid[10..], [0xFF, 0xFF, 192, 168, 77, 11]);
    assert_eq!((r.transport_type, r.max_cm_retries, r.local_cm_response_timeout), (0, 15, 20));
    assert_eq!(r.pkey, 0xFFFF);
    assert!((1..=5).contains(&r.path_mtu));
    // The REP answers it: same transaction, the IDs crossed.
    let rep = mads
        .iter()
        .find_map(|(n, m, _, _)| match &m.msg {
            CmMsg::Rep(p) if n == "rping.pcap" && p.remote_comm_id == r.local_comm_id => Some((m, p)),
            _ => None,
        })
        .expect("rping's REP");
    assert_eq!(rep.0.transaction_id, req.transaction_id);
    // And the RTU closes the handshake with both IDs.
    assert!(mads.iter().any(|(n, m, _, _)| n == "rping.pcap"
        && matches!(&m.msg, CmMsg::Rtu(t) if t.ids.local_comm_id == r.local_comm_id
            && t.ids.remote_comm_id == rep.1.local_comm_id)));
}

#[test]
fn cm_parser_rejects_what_is_not_a_cm_message() {
    use softrdma_proto::cm::{CmMad, CmParseError};
    let mads = cm_mads(&["rxe"]);
    let good = mads[0].1.emit();
    assert!(matches!(CmMad::parse(&good[..255]), Err(CmParseError::Truncated(_))));
    let mut bad = good;
    bad[1] = 0x04; // another management class
    assert_eq!(CmMad::parse(&bad), Err(CmParseError::NotCm(0x04)));
    let mut bad = good;
    bad[2] = 1;
    assert_eq!(CmMad::parse(&bad), Err(CmParseError::ClassVersion(1)));
    let mut bad = good;
    bad[3] = 0x81;
    assert_eq!(CmMad::parse(&bad), Err(CmParseError::Method(0x81)));
    let mut bad = good;
    bad[17] = 0x19; // LAP
    assert_eq!(CmMad::parse(&bad), Err(CmParseError::Attribute(0x19)));
}
