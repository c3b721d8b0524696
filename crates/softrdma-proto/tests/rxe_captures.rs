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
