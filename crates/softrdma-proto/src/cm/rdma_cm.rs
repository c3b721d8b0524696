//! What rdma_cm adds on top of the IB CM: service IDs made of a port space and a port, and
//! the 36-byte header at the start of a REQ's (or SIDR_REQ's) private data that carries the
//! IP addresses and the source port (Linux `cma.c`'s `cma_hdr`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// rdma_cm's port spaces (`enum rdma_port_space`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortSpace {
    /// `RDMA_PS_TCP`: RC connections.
    Tcp,
    /// `RDMA_PS_UDP`: UD, through SIDR.
    Udp,
    /// `RDMA_PS_IB`: either.
    Ib,
    /// `RDMA_PS_IPOIB`.
    Ipoib,
}

impl PortSpace {
    /// The value in service IDs and in `rdma_create_id`.
    pub fn value(self) -> u16 {
        match self {
            PortSpace::Tcp => 0x0106,
            PortSpace::Udp => 0x0111,
            PortSpace::Ib => 0x013F,
            PortSpace::Ipoib => 0x0002,
        }
    }

    /// The port space of a value, if rdma_cm defines it.
    pub fn from_value(v: u16) -> Option<PortSpace> {
        Some(match v {
            0x0106 => PortSpace::Tcp,
            0x0111 => PortSpace::Udp,
            0x013F => PortSpace::Ib,
            0x0002 => PortSpace::Ipoib,
            _ => return None,
        })
    }
}

/// The service ID of a port in a port space: `0x0000_0000_0100_0000 | ps << 16 | port`.
pub fn service_id(ps: PortSpace, port: u16) -> u64 {
    0x0000_0000_0100_0000 | u64::from(ps.value()) << 16 | u64::from(port)
}

/// The port space and port of an rdma_cm service ID; `None` for other service IDs.
pub fn parse_service_id(sid: u64) -> Option<(PortSpace, u16)> {
    if sid & !0xFFFF_FFFF != 0 || sid & 0xFF00_0000 != 0x0100_0000 {
        return None;
    }
    Some((PortSpace::from_value((sid >> 16) as u16)?, sid as u16))
}

/// The rdma_cm header at the start of REQ and SIDR_REQ private data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmaHeader {
    /// The active side's address and port.
    pub src: SocketAddr,
    /// The address it connects to (the port is the service ID's).
    pub dst: IpAddr,
}

impl CmaHeader {
    /// Length of the header.
    pub const LEN: usize = 36;
    /// `cma_version`.
    pub const VERSION: u8 = 0;

    /// Parses the header from private data; `None` if it is not one (short, another
    /// version, an IP version other than 4 or 6, or mixed families).
    pub fn parse(b: &[u8]) -> Option<CmaHeader> {
        if b.len() < Self::LEN || b[0] != Self::VERSION {
            return None;
        }
        let port = u16::from_be_bytes([b[2], b[3]]);
        let (src, dst) = match b[1] >> 4 {
            4 => (ipv4_at(b, 4), ipv4_at(b, 20)),
            6 => (ipv6_at(b, 4), ipv6_at(b, 20)),
            _ => return None,
        };
        Some(CmaHeader { src: SocketAddr::new(src, port), dst })
    }

    /// Writes the header into `b[..36]`; `None` if the two addresses are of different
    /// families.
    pub fn emit(&self, b: &mut [u8]) -> Option<()> {
        let b = b.get_mut(..Self::LEN)?;
        b.fill(0);
        b[0] = Self::VERSION;
        b[2..4].copy_from_slice(&self.src.port().to_be_bytes());
        match (self.src.ip(), self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                b[1] = 0x40;
                b[16..20].copy_from_slice(&s.octets());
                b[32..36].copy_from_slice(&d.octets());
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                b[1] = 0x60;
                b[4..20].copy_from_slice(&s.octets());
                b[20..36].copy_from_slice(&d.octets());
            }
            _ => return None,
        }
        Some(())
    }

    /// The header followed by the user's private data, at most `room` bytes in all;
    /// `None` if the user's data does not fit or the families differ.
    pub fn with_user_data(&self, user: &[u8], room: usize) -> Option<Vec<u8>> {
        if Self::LEN + user.len() > room {
            return None;
        }
        let mut v = vec![0u8; Self::LEN + user.len()];
        self.emit(&mut v)?;
        v[Self::LEN..].copy_from_slice(user);
        Some(v)
    }
}

/// An IPv4 address in the last 4 bytes of a 16-byte slot.
fn ipv4_at(b: &[u8], at: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(b[at + 12], b[at + 13], b[at + 14], b[at + 15]))
}

fn ipv6_at(b: &[u8], at: usize) -> IpAddr {
    let mut o = [0u8; 16];
    o.copy_from_slice(&b[at..at + 16]);
    IpAddr::V6(Ipv6Addr::from(o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_ids_are_rdma_cms() {
        assert_eq!(service_id(PortSpace::Tcp, 7471), 0x0000_0000_0106_1D2F);
        assert_eq!(parse_service_id(0x0000_0000_0106_1D2F), Some((PortSpace::Tcp, 7471)));
        assert_eq!(parse_service_id(service_id(PortSpace::Udp, 1)), Some((PortSpace::Udp, 1)));
        assert_eq!(parse_service_id(0x0000_0001_0106_1D2F), None);
        assert_eq!(parse_service_id(0x0000_0000_0206_1D2F), None);
        assert_eq!(parse_service_id(0x0000_0000_0100_1D2F), None);
    }

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = CmaHeader { src: "10.0.0.1:5000".parse().unwrap(), dst: "10.0.0.2".parse().unwrap() };
        let v = h.with_user_data(b"hi", 92).unwrap();
        assert_eq!(&v[..4], &[0, 0x40, 0x13, 0x88]);
        assert_eq!(&v[16..20], &[10, 0, 0, 1]);
        assert_eq!(&v[32..36], &[10, 0, 0, 2]);
        assert_eq!(CmaHeader::parse(&v), Some(h));
        assert_eq!(&v[36..], b"hi");
        let h6 = CmaHeader { src: "[fe80::1]:7".parse().unwrap(), dst: "fe80::2".parse().unwrap() };
        let v6 = h6.with_user_data(&[], 92).unwrap();
        assert_eq!(CmaHeader::parse(&v6), Some(h6));
        assert!(h.with_user_data(&[0; 57], 92).is_none());
        let mixed = CmaHeader { src: "10.0.0.1:1".parse().unwrap(), dst: "fe80::2".parse().unwrap() };
        assert!(mixed.with_user_data(&[], 92).is_none());
        let mut bad = v.clone();
        bad[1] = 0x50;
        assert!(CmaHeader::parse(&bad).is_none());
        bad[1] = 0x40;
        bad[0] = 1;
        assert!(CmaHeader::parse(&bad).is_none());
        assert!(CmaHeader::parse(&v[..35]).is_none());
    }
}
