//! Just enough IPv4, IPv6 and UDP to find RoCEv2 inside captured frames and to build frames
//! for captures: parse with length checks, emit with checksums.
//!
//! softrdma itself never sees these headers on the data path (the kernel owns them); this
//! module serves the capture decoder, the ICRC of captured packets and test tooling.

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{be, check_len, icrc, Error, Result};

/// IP protocol number of UDP.
pub const PROTO_UDP: u8 = 17;

/// An IPv4 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Repr {
    /// Source address.
    pub src: Ipv4Addr,
    /// Destination address.
    pub dst: Ipv4Addr,
    /// Type of service (DSCP and ECN).
    pub tos: u8,
    /// Identification.
    pub ident: u16,
    /// Don't Fragment.
    pub dont_fragment: bool,
    /// More Fragments.
    pub more_fragments: bool,
    /// Fragment offset in 8-byte units.
    pub frag_offset: u16,
    /// Time to live.
    pub ttl: u8,
    /// Protocol of the payload.
    pub protocol: u8,
    /// Header length in bytes (20 without options).
    pub header_len: usize,
    /// Total length (header and payload).
    pub total_len: u16,
}

impl Ipv4Repr {
    /// The header softrdma sends a UDP datagram of `udp_len` bytes with: Identification 0
    /// and DF (the canonical encapsulation its ICRCs assume), TTL 64.
    pub fn canonical(src: Ipv4Addr, dst: Ipv4Addr, tos: u8, udp_len: u16) -> Option<Ipv4Repr> {
        Some(Ipv4Repr {
            src,
            dst,
            tos,
            ident: 0,
            dont_fragment: true,
            more_fragments: false,
            frag_offset: 0,
            ttl: 64,
            protocol: PROTO_UDP,
            header_len: 20,
            total_len: udp_len.checked_add(20)?,
        })
    }

    /// Parses an IPv4 header at the start of `b`; the total length must fit in `b`.
    pub fn parse(b: &[u8]) -> Result<Ipv4Repr> {
        check_len("IPv4 header", b, 20)?;
        if b[0] >> 4 != 4 {
            return Err(Error::BadField { header: "IPv4", reason: "version is not 4" });
        }
        let header_len = usize::from(b[0] & 0xF) * 4;
        if header_len < 20 {
            return Err(Error::BadField { header: "IPv4", reason: "IHL below 5" });
        }
        let total_len = be::u16_at(b, 2);
        if usize::from(total_len) < header_len {
            return Err(Error::BadField { header: "IPv4", reason: "total length below header length" });
        }
        check_len("IPv4 packet", b, usize::from(total_len))?;
        let frag = be::u16_at(b, 6);
        Ok(Ipv4Repr {
            src: Ipv4Addr::new(b[12], b[13], b[14], b[15]),
            dst: Ipv4Addr::new(b[16], b[17], b[18], b[19]),
            tos: b[1],
            ident: be::u16_at(b, 4),
            dont_fragment: frag & 0x4000 != 0,
            more_fragments: frag & 0x2000 != 0,
            frag_offset: frag & 0x1FFF,
            ttl: b[8],
            protocol: b[9],
            header_len,
            total_len,
        })
    }

    /// Whether the datagram is a fragment (and so cannot be decoded alone).
    pub fn is_fragment(&self) -> bool {
        self.more_fragments || self.frag_offset != 0
    }

    /// Writes a 20-byte header (options are not supported) with its checksum.
    pub fn emit(&self, b: &mut [u8; 20]) {
        b[0] = 0x45;
        b[1] = self.tos;
        be::put_u16(b, 2, self.total_len);
        be::put_u16(b, 4, self.ident);
        let flags = (u16::from(self.dont_fragment) << 14) | (u16::from(self.more_fragments) << 13);
        be::put_u16(b, 6, flags | (self.frag_offset & 0x1FFF));
        b[8] = self.ttl;
        b[9] = self.protocol;
        b[10..12].fill(0);
        b[12..16].copy_from_slice(&self.src.octets());
        b[16..20].copy_from_slice(&self.dst.octets());
        let sum = !fold(sum16(0, &b[..]));
        be::put_u16(b, 10, sum);
    }
}

/// An IPv6 header (extension headers are not followed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv6Repr {
    /// Source address.
    pub src: Ipv6Addr,
    /// Destination address.
    pub dst: Ipv6Addr,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label, 20 bits.
    pub flow_label: u32,
    /// Payload length.
    pub payload_len: u16,
    /// Next header.
    pub next_header: u8,
    /// Hop limit.
    pub hop_limit: u8,
}

impl Ipv6Repr {
    /// Length of the fixed IPv6 header.
    pub const LEN: usize = 40;

    /// Parses an IPv6 header at the start of `b`; the payload must fit in `b`.
    pub fn parse(b: &[u8]) -> Result<Ipv6Repr> {
        check_len("IPv6 header", b, Self::LEN)?;
        if b[0] >> 4 != 6 {
            return Err(Error::BadField { header: "IPv6", reason: "version is not 6" });
        }
        let payload_len = be::u16_at(b, 4);
        check_len("IPv6 packet", b, Self::LEN + usize::from(payload_len))?;
        let mut src = [0u8; 16];
        let mut dst = [0u8; 16];
        src.copy_from_slice(&b[8..24]);
        dst.copy_from_slice(&b[24..40]);
        let word = be::u32_at(b, 0);
        Ok(Ipv6Repr {
            src: Ipv6Addr::from(src),
            dst: Ipv6Addr::from(dst),
            traffic_class: (word >> 20) as u8,
            flow_label: word & 0xF_FFFF,
            payload_len,
            next_header: b[6],
            hop_limit: b[7],
        })
    }

    /// Writes the header.
    pub fn emit(&self, b: &mut [u8; 40]) {
        let word = (6 << 28) | (u32::from(self.traffic_class) << 20) | (self.flow_label & 0xF_FFFF);
        be::put_u32(b, 0, word);
        be::put_u16(b, 4, self.payload_len);
        b[6] = self.next_header;
        b[7] = self.hop_limit;
        b[8..24].copy_from_slice(&self.src.octets());
        b[24..40].copy_from_slice(&self.dst.octets());
    }
}

/// A UDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdpRepr {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Length of header and payload.
    pub length: u16,
    /// Checksum (0: none).
    pub checksum: u16,
}

impl UdpRepr {
    /// Length of the UDP header.
    pub const LEN: usize = 8;

    /// Parses a UDP header at the start of `b`; the length field must be at least 8 and fit
    /// in `b` (trailing bytes, such as Ethernet padding, are allowed).
    pub fn parse(b: &[u8]) -> Result<UdpRepr> {
        check_len("UDP header", b, Self::LEN)?;
        let length = be::u16_at(b, 4);
        if usize::from(length) < Self::LEN {
            return Err(Error::BadField { header: "UDP", reason: "length below 8" });
        }
        check_len("UDP datagram", b, usize::from(length))?;
        Ok(UdpRepr {
            src_port: be::u16_at(b, 0),
            dst_port: be::u16_at(b, 2),
            length,
            checksum: be::u16_at(b, 6),
        })
    }

    /// Writes the header.
    pub fn emit(&self, b: &mut [u8; 8]) {
        be::put_u16(b, 0, self.src_port);
        be::put_u16(b, 2, self.dst_port);
        be::put_u16(b, 4, self.length);
        be::put_u16(b, 6, self.checksum);
    }

    /// The UDP checksum of `payload` between `src` and `dst` (never 0: a zero sum is sent as
    /// 0xFFFF).
    pub fn checksum_for(&self, src: IpAddr, dst: IpAddr, payload: &[u8]) -> u16 {
        let mut s = 0u32;
        match (src, dst) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                s = sum16(s, &a.octets());
                s = sum16(s, &b.octets());
            }
            (a, b) => {
                s = sum16(s, &to_v6(a).octets());
                s = sum16(s, &to_v6(b).octets());
            }
        }
        s += u32::from(PROTO_UDP) + u32::from(self.length);
        let mut h = [0u8; 8];
        UdpRepr { checksum: 0, ..*self }.emit(&mut h);
        s = sum16(s, &h);
        s = sum16(s, payload);
        match !fold(s) {
            0 => 0xFFFF,
            c => c,
        }
    }
}

fn to_v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V4(v) => v.to_ipv6_mapped(),
        IpAddr::V6(v) => v,
    }
}

fn sum16(mut s: u32, b: &[u8]) -> u32 {
    let mut chunks = b.chunks_exact(2);
    for c in &mut chunks {
        s += u32::from(u16::from_be_bytes([c[0], c[1]]));
        s = (s & 0xFFFF) + (s >> 16);
    }
    if let [last] = chunks.remainder() {
        s += u32::from(*last) << 8;
    }
    s
}

fn fold(mut s: u32) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xFFFF) + (s >> 16);
    }
    s as u16
}

/// A UDP datagram found inside an IP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpDatagram<'a> {
    /// The IP header that carried it.
    pub ip: IpRepr,
    /// The UDP header.
    pub udp: UdpRepr,
    /// The UDP payload, trimmed to the UDP length.
    pub payload: &'a [u8],
}

/// Either IP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpRepr {
    /// IPv4.
    V4(Ipv4Repr),
    /// IPv6.
    V6(Ipv6Repr),
}

impl IpRepr {
    /// Source address.
    pub fn src(&self) -> IpAddr {
        match self {
            IpRepr::V4(h) => h.src.into(),
            IpRepr::V6(h) => h.src.into(),
        }
    }
    /// Destination address.
    pub fn dst(&self) -> IpAddr {
        match self {
            IpRepr::V4(h) => h.dst.into(),
            IpRepr::V6(h) => h.dst.into(),
        }
    }
}

impl UdpDatagram<'_> {
    /// The ICRC encapsulation of this datagram, from its real headers.
    pub fn encap(&self) -> icrc::Encap {
        let ip = match self.ip {
            IpRepr::V4(h) => {
                icrc::IpFields::V4 { src: h.src, dst: h.dst, ident: h.ident, dont_fragment: h.dont_fragment }
            }
            IpRepr::V6(h) => icrc::IpFields::V6 { src: h.src, dst: h.dst },
        };
        icrc::Encap { ip, src_port: self.udp.src_port, dst_port: self.udp.dst_port }
    }
}

/// What an IP packet turned out to hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpContent<'a> {
    /// A complete UDP datagram.
    Udp(UdpDatagram<'a>),
    /// Something else: another protocol, a fragment, IPv6 extension headers, IPv4 options.
    Other(&'static str),
}

/// Finds the UDP datagram in an IP packet (version taken from its first nibble). Errors
/// mean the IP or UDP header is malformed or cut short.
pub fn parse_ip_udp(b: &[u8]) -> Result<IpContent<'_>> {
    let (ip, rest) = match b.first().map(|v| v >> 4) {
        Some(4) => {
            let h = Ipv4Repr::parse(b)?;
            if h.protocol != PROTO_UDP {
                return Ok(IpContent::Other("IPv4, not UDP"));
            }
            if h.is_fragment() {
                return Ok(IpContent::Other("IPv4 fragment"));
            }
            if h.header_len != 20 {
                return Ok(IpContent::Other("IPv4 with options"));
            }
            (IpRepr::V4(h), &b[h.header_len..usize::from(h.total_len)])
        }
        Some(6) => {
            let h = Ipv6Repr::parse(b)?;
            if h.next_header != PROTO_UDP {
                return Ok(IpContent::Other("IPv6, not UDP"));
            }
            (IpRepr::V6(h), &b[Ipv6Repr::LEN..Ipv6Repr::LEN + usize::from(h.payload_len)])
        }
        Some(_) => return Err(Error::BadField { header: "IP", reason: "version is neither 4 nor 6" }),
        None => return Err(Error::Truncated { what: "IP header", need: 1, have: 0 }),
    };
    let udp = UdpRepr::parse(rest)?;
    Ok(IpContent::Udp(UdpDatagram { ip, udp, payload: &rest[UdpRepr::LEN..usize::from(udp.length)] }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The IPv4 and UDP headers of spec vector V2, whose checksums scapy computed.
    const V2_HEAD: [u8; 28] = [
        0x45, 0x01, 0x00, 0x40, 0x04, 0x78, 0x40, 0x00, 0x40, 0x11, 0xb4, 0xd5, 0xc0, 0xa8, 0x00, 0x07, 0xc0,
        0xa8, 0x00, 0x07, 0xc0, 0x00, 0x12, 0xb7, 0x00, 0x2c, 0xac, 0xa2,
    ];
    const V2_UDP_PAYLOAD: [u8; 36] = [
        0x24, 0x60, 0xff, 0xff, 0x00, 0x00, 0x00, 0xd3, 0x00, 0xcf, 0x17, 0x10, 0x46, 0x30, 0x81, 0x8b, 0xe2,
        0x89, 0x35, 0xd9, 0x0e, 0x9a, 0x95, 0x50, 0x54, 0x01, 0xbe, 0x88, 0x5e, 0x50, 0x00, 0x00, 0x78, 0xf3,
        0x53, 0xf3,
    ];

    #[test]
    fn ipv4_and_udp_checksums_match_v2() {
        let mut pkt = V2_HEAD.to_vec();
        pkt.extend_from_slice(&V2_UDP_PAYLOAD);
        let IpContent::Udp(d) = parse_ip_udp(&pkt).unwrap() else { panic!("not UDP") };
        let IpRepr::V4(h) = d.ip else { panic!("not v4") };
        assert_eq!((h.ident, h.dont_fragment, h.ttl, h.tos), (0x0478, true, 64, 1));
        let mut out = [0u8; 20];
        h.emit(&mut out);
        assert_eq!(out[..], V2_HEAD[..20], "header checksum 0xb4d5");
        assert_eq!(d.udp.checksum_for(d.ip.src(), d.ip.dst(), d.payload), 0xaca2);
        assert!(icrc::verify(&d.encap(), d.payload));
    }

    #[test]
    fn trailing_padding_is_trimmed_and_short_input_rejected() {
        let mut pkt = V2_HEAD.to_vec();
        pkt.extend_from_slice(&V2_UDP_PAYLOAD);
        pkt.extend_from_slice(&[0; 6]);
        let IpContent::Udp(d) = parse_ip_udp(&pkt).unwrap() else { panic!("not UDP") };
        assert_eq!(d.payload.len(), 36);
        for cut in 0..64 {
            assert!(parse_ip_udp(&pkt[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn ipv6_round_trip() {
        let h = Ipv6Repr {
            src: "fe80::5054:ff:fe77:a".parse().unwrap(),
            dst: "fe80::5054:ff:fe77:b".parse().unwrap(),
            traffic_class: 96,
            flow_label: 0x12345,
            payload_len: 8,
            next_header: PROTO_UDP,
            hop_limit: 64,
        };
        let mut b = [0u8; 48];
        h.emit((&mut b[..40]).try_into().unwrap());
        UdpRepr { src_port: 1, dst_port: 4791, length: 8, checksum: 0 }
            .emit((&mut b[40..]).try_into().unwrap());
        assert_eq!(Ipv6Repr::parse(&b).unwrap(), h);
        assert!(matches!(parse_ip_udp(&b).unwrap(), IpContent::Udp(d) if d.payload.is_empty()));
    }
}
