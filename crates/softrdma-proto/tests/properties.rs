//! Property tests of the wire layer: emit → parse round trips for every opcode, the ICRC
//! checks under corruption, and the no-panic contract on arbitrary bytes.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};

use proptest::prelude::*;
use softrdma_proto::wire::{
    self, icrc, ip, mad, AethRepr, AethSyndrome, AtomicAckEthRepr, AtomicEthRepr, BthRepr, DethRepr,
    FethRepr, HeaderKind, IethRepr, ImmDtRepr, Opcode, Packet, PacketRepr, PayloadRule, RethRepr,
};
use softrdma_proto::{Psn, Qkey, Qpn, Rkey};

fn opcode() -> impl Strategy<Value = Opcode> {
    let all: Vec<Opcode> = Opcode::all().collect();
    proptest::sample::select(all)
}

fn bth(op: Opcode) -> impl Strategy<Value = BthRepr> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<u16>(),
        any::<bool>(),
        any::<bool>(),
        0u32..1 << 24,
        any::<bool>(),
        0u32..1 << 24,
    )
        .prop_map(move |(se, m, pkey, fecn, becn, qp, ack, psn)| BthRepr {
            opcode: op,
            solicited: se,
            mig_req: m,
            pad_count: 0,
            pkey,
            fecn,
            becn,
            dest_qp: Qpn::new(qp),
            ack_req: ack,
            psn: Psn::new(psn),
        })
}

/// A packet of `op` with random header values and a payload its rule allows.
fn packet_of(op: Opcode) -> impl Strategy<Value = (PacketRepr, Vec<u8>)> {
    let payload = match op.payload() {
        PayloadRule::None => proptest::collection::vec(any::<u8>(), 0..=0).boxed(),
        PayloadRule::Exactly(n) => proptest::collection::vec(any::<u8>(), n..=n).boxed(),
        PayloadRule::NonEmpty => proptest::collection::vec(any::<u8>(), 1..600).boxed(),
        _ => proptest::collection::vec(any::<u8>(), 0..600).boxed(),
    };
    let u = (any::<u64>(), any::<u32>(), any::<u32>(), any::<u64>(), any::<u64>(), 0u8..0x80, any::<u32>());
    (bth(op), payload, u).prop_map(move |(bth, payload, (a, b, c, d, e, syn, f))| {
        let h = op.headers();
        let mut r = PacketRepr::new(bth, payload.len());
        let x = &mut r.ext;
        let some = |k| h.contains(k);
        x.deth = some(HeaderKind::Deth).then_some(DethRepr { qkey: Qkey(b), src_qp: Qpn::new(c) });
        x.feth = some(HeaderKind::Feth)
            .then_some(FethRepr { placement_type: (b & 0xF) as u8, selectivity: (c & 3) as u8 });
        x.reth = some(HeaderKind::Reth).then_some(RethRepr { va: a, rkey: Rkey(b), dma_len: c });
        x.atomic_eth = some(HeaderKind::AtomicEth).then_some(AtomicEthRepr {
            va: a,
            rkey: Rkey(b),
            swap_add: d,
            compare: e,
        });
        x.aeth = some(HeaderKind::Aeth)
            .then(|| AethRepr { syndrome: AethSyndrome::from_byte(syn).unwrap(), msn: f & 0xFF_FFFF });
        x.atomic_ack_eth = some(HeaderKind::AtomicAckEth).then_some(AtomicAckEthRepr { orig: d });
        x.immdt = some(HeaderKind::ImmDt).then_some(ImmDtRepr { value: f });
        x.ieth = some(HeaderKind::Ieth).then_some(IethRepr { rkey: Rkey(c) });
        (r, payload)
    })
}

fn any_packet() -> impl Strategy<Value = (PacketRepr, Vec<u8>)> {
    opcode().prop_flat_map(packet_of)
}

fn v4_encap() -> impl Strategy<Value = icrc::Encap> {
    (any::<u32>(), any::<u32>(), any::<u16>(), any::<u16>(), any::<bool>()).prop_map(
        |(s, d, sport, id, df)| {
            icrc::Encap::new(
                SocketAddr::new(Ipv4Addr::from(s).into(), sport),
                SocketAddr::new(Ipv4Addr::from(d).into(), wire::ROCEV2_PORT),
            )
            .unwrap()
            .with_ipv4_ident(id, df)
        },
    )
}

fn any_encap() -> impl Strategy<Value = icrc::Encap> {
    prop_oneof![
        v4_encap(),
        (any::<u128>(), any::<u128>(), any::<u16>()).prop_map(|(s, d, sport)| {
            icrc::Encap::new(
                SocketAddr::new(Ipv6Addr::from(s).into(), sport),
                SocketAddr::new(Ipv6Addr::from(d).into(), wire::ROCEV2_PORT),
            )
            .unwrap()
        }),
    ]
}

fn emit(r: &PacketRepr, payload: &[u8], encap: &icrc::Encap) -> Vec<u8> {
    let mut buf = vec![0u8; r.total_len()];
    let n = r.emit(&mut buf, payload, encap).expect("a consistent repr emits");
    assert_eq!(n, buf.len());
    buf
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn emit_parse_round_trip((repr, payload) in any_packet(), encap in any_encap()) {
        let bytes = emit(&repr, &payload, &encap);
        let p = Packet::new_checked(&bytes[..]).unwrap();
        let parsed = PacketRepr::parse(&p).unwrap();
        let pad = wire::pad_count(payload.len());
        prop_assert_eq!(parsed, PacketRepr { bth: BthRepr { pad_count: pad, ..repr.bth }, ..repr });
        prop_assert_eq!(p.payload(), &payload[..]);
        prop_assert_eq!(bytes.len() % 4, 0, "pad aligns header, payload and pad to 4 bytes");
        prop_assert!(icrc::verify(&encap, &bytes));
    }

    #[test]
    fn any_single_bit_flip_fails_the_exact_check(
        (repr, payload) in any_packet(), encap in any_encap(), pos in any::<prop::sample::Index>(), bit in 0u8..8,
    ) {
        let mut bytes = emit(&repr, &payload, &encap);
        let i = pos.index(bytes.len());
        bytes[i] ^= 1 << bit;
        // BTH byte 4 (FECN, BECN, reserved) is masked out of the ICRC on purpose.
        prop_assert_eq!(icrc::verify(&encap, &bytes), i == 4);
    }

    #[test]
    fn id_agnostic_check_recovers_the_ident((repr, payload) in any_packet(), encap in v4_encap()) {
        let bytes = emit(&repr, &payload, &encap);
        let icrc::IpFields::V4 { src, dst, ident, dont_fragment } = encap.ip else { unreachable!() };
        let got = icrc::solve_ipv4_ident(
            SocketAddrV4::new(src, encap.src_port),
            SocketAddrV4::new(dst, encap.dst_port),
            &bytes,
        );
        prop_assert_eq!(got, Some(icrc::Ipv4Ident { ident, dont_fragment }));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(p) = Packet::new_checked(&bytes[..]) {
            let r = PacketRepr::parse(&p).unwrap();
            prop_assert_eq!(r.payload_len, p.payload().len());
            // The sender's pad count need not be the canonical one; the length still adds up.
            prop_assert_eq!(p.header_len() + r.payload_len + usize::from(p.pad_count()) + 4, bytes.len());
            let _ = (p.payload(), p.icrc(), p.bth().psn(), p.reth().map(|h| h.va()), p.aeth().map(|h| h.msn()));
        }
        let e = icrc::Encap::new("1.2.3.4:5".parse().unwrap(), "5.6.7.8:4791".parse().unwrap()).unwrap();
        let _ = icrc::verify(&e, &bytes);
        let _ = icrc::solve_ipv4_ident("1.2.3.4:5".parse().unwrap(), "5.6.7.8:4791".parse().unwrap(), &bytes);
        let _ = ip::parse_ip_udp(&bytes);
        let _ = mad::MadHeader::parse(&bytes);
    }

    #[test]
    fn structured_garbage_never_panics(
        op in any::<u8>(), flags in any::<u8>(), rest in proptest::collection::vec(any::<u8>(), 0..120),
    ) {
        // Mostly-valid BTHs reach much deeper into the parser than uniform noise.
        let mut bytes = vec![op, flags & 0x30, 0xFF, 0xFF, 0, 0, 0, 0x11, 0x80, 0, 0, 1];
        bytes.extend_from_slice(&rest);
        if let Ok(p) = Packet::new_checked(&bytes[..]) {
            prop_assert!(PacketRepr::parse(&p).is_ok());
            prop_assert!(p.header_len() + p.payload().len() + usize::from(p.pad_count()) + 4 == bytes.len());
        }
    }

    #[test]
    fn psn_order_follows_distance(a in 0u32..1 << 24, n in 1u32..1 << 23) {
        let a = Psn::new(a);
        let b = a + n;
        prop_assert!(b > a);
        prop_assert_eq!(a.partial_cmp(&b), Some(std::cmp::Ordering::Less));
        prop_assert_eq!(b.distance(a), n as i32);
        prop_assert_eq!(b - n, a);
    }
}

proptest! {
    /// Any 256 bytes under a CM header: parsing never panics, and what parses comes out of
    /// the emitter as a MAD that parses to the same message (reserved bits aside, which
    /// the emitter zeroes).
    #[test]
    fn cm_mads_parse_without_panic_and_round_trip(
        body in proptest::collection::vec(any::<u8>(), 232),
        attr in prop_oneof![0x0010u16..=0x0018, any::<u16>()],
        tid in any::<u64>(),
    ) {
        use softrdma_proto::cm::CmMad;
        let mut m = [0u8; 256];
        m[..4].copy_from_slice(&[1, 0x07, 2, 3]);
        m[8..16].copy_from_slice(&tid.to_be_bytes());
        m[16..18].copy_from_slice(&attr.to_be_bytes());
        m[24..].copy_from_slice(&body);
        if let Ok(parsed) = CmMad::parse(&m) {
            prop_assert_eq!(parsed.transaction_id, tid);
            let again = CmMad::parse(&parsed.emit()).unwrap();
            prop_assert_eq!(again, parsed);
        }
        for cut in [0, 24, 255] {
            prop_assert!(CmMad::parse(&m[..cut]).is_err());
        }
    }
}
