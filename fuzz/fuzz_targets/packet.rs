//! Feeds arbitrary bytes to every parser of untrusted input in the wire layer: as a RoCEv2
//! UDP payload, and as an IP packet carrying one. Parsed packets are re-emitted and parsed
//! again, and must come back the same.
#![no_main]

use std::net::SocketAddrV4;

use libfuzzer_sys::fuzz_target;
use softrdma_proto::wire::{icrc, ip, mad, Packet, PacketRepr};

fn roce(bytes: &[u8], encap: &icrc::Encap) {
    let Ok(p) = Packet::new_checked(bytes) else { return };
    let repr = PacketRepr::parse(&p).expect("a checked packet parses");
    let _ = (p.icrc(), p.bth().psn(), p.reth().map(|h| h.dma_len()), p.cnp().map(|c| c.reserved_is_zero()));
    let _ = mad::MadHeader::parse(p.payload());
    let _ = icrc::verify(encap, bytes);
    // Re-emit what was parsed: the result must parse to the same meaning.
    let mut buf = vec![0u8; repr.total_len()];
    let n = repr.emit(&mut buf, p.payload(), encap).expect("a parsed repr emits");
    let again = Packet::new_checked(&buf[..n]).expect("our own packet is valid");
    let mut canonical = repr;
    canonical.bth.pad_count = softrdma_proto::wire::pad_count(repr.payload_len);
    assert_eq!(PacketRepr::parse(&again).unwrap(), canonical);
    assert!(icrc::verify(encap, &buf[..n]));
}

fuzz_target!(|data: &[u8]| {
    let src: SocketAddrV4 = "10.0.0.1:49152".parse().unwrap();
    let dst: SocketAddrV4 = "10.0.0.2:4791".parse().unwrap();
    let encap = icrc::Encap::new(src.into(), dst.into()).unwrap();
    roce(data, &encap);
    let _ = icrc::solve_ipv4_ident(src, dst, data);
    if let Ok(ip::IpContent::Udp(d)) = ip::parse_ip_udp(data) {
        roce(d.payload, &d.encap());
    }
});
