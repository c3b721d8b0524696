//! Address handles (`ibv_ah`): where a UD send goes.
//!
//! RoCE addresses are GIDs (an IPv6 address, or an IPv4 address in IPv4-mapped form) and
//! every packet carries a GRH: traffic class, flow label and hop limit travel in the
//! address handle, as in `ibv_ah_attr`. An address handle is made from attributes
//! ([`ProtectionDomain::create_ah`]) or from a received completion and the 40-byte GRH
//! area at the start of its receive buffer ([`ProtectionDomain::create_ah_from_wc`], as
//! `ibv_create_ah_from_wc`), which is how a UD server answers whoever wrote to it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use softrdma_proto::qp::{UdDest, WorkCompletion};
use softrdma_proto::{Qkey, Qpn};

use crate::device::{addr_of_gid, default_port};
use crate::pd::ProtectionDomain;
use crate::{Error, Result};

/// Attributes of an address handle: `ibv_ah_attr` with its GRH, as RoCE uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AhAttr {
    /// The destination GID.
    pub dgid: [u8; 16],
    /// The source GID index on this port; `None` for the GID the context bound. A context
    /// sends from the one address it bound, so another index is refused.
    pub sgid_index: Option<u8>,
    /// The flow label (20 bits).
    pub flow_label: u32,
    /// The hop limit (TTL).
    pub hop_limit: u8,
    /// The traffic class: the IP TOS byte (DSCP and ECN) of every datagram sent.
    pub traffic_class: u8,
    /// The port number; only 1 exists.
    pub port_num: u8,
    /// The destination UDP port: 4791 for RoCE, or whatever port a softrdma peer bound
    /// (`SOFTRDMA_PORT`); `None` for this process's default.
    pub udp_port: Option<u16>,
}

impl AhAttr {
    /// Attributes for a destination address, everything else default (hop limit 64).
    pub fn to(addr: IpAddr) -> AhAttr {
        AhAttr {
            dgid: crate::device::gid_of(addr),
            sgid_index: None,
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            port_num: 1,
            udp_port: None,
        }
    }

    /// Attributes for a destination address and UDP port.
    pub fn to_socket(addr: SocketAddr) -> AhAttr {
        AhAttr { udp_port: Some(addr.port()), ..AhAttr::to(addr.ip()) }
    }
}

/// An address handle: a destination for UD sends.
#[derive(Debug, Clone)]
pub struct AddressHandle {
    attr: AhAttr,
    addr: SocketAddr,
    pd: ProtectionDomain,
}

impl AddressHandle {
    /// The attributes.
    pub fn attr(&self) -> &AhAttr {
        &self.attr
    }

    /// The destination's IP address and UDP port.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The destination of a UD send through this handle to QP `qpn` with Q_Key `qkey`
    /// (`wr.ud.ah`, `remote_qpn` and `remote_qkey`).
    pub fn dest(&self, qpn: Qpn, qkey: Qkey) -> UdDest {
        UdDest { addr: self.addr, qpn, qkey, traffic_class: self.attr.traffic_class }
    }
}

impl ProtectionDomain {
    /// Creates an address handle (`ibv_create_ah`). The port must be 1, the source GID
    /// index (if given) must be the context's, the flow label must fit 20 bits, and the destination GID must be
    /// an address of the device's family (IPv4-mapped for an IPv4 device).
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        if attr.port_num != 1 {
            return Err(Error::InvalidArgument("address handle port_num must be 1"));
        }
        if let Some(k) = attr.sgid_index {
            if self.ctx.gid(u32::from(k)).is_none() {
                return Err(Error::InvalidArgument("address handle sgid_index is not in the GID table"));
            }
            if u32::from(k) != self.ctx.device.gid_index {
                return Err(Error::InvalidArgument(
                    "address handle sgid_index names a GID this context did not bind (open the device with it)",
                ));
            }
        }
        if attr.flow_label >= 1 << 20 {
            return Err(Error::InvalidArgument("flow label above 20 bits"));
        }
        let ip = addr_of_gid(attr.dgid);
        if ip.is_unspecified() {
            return Err(Error::InvalidArgument("address handle destination GID is zero"));
        }
        if ip.is_ipv4() != self.ctx.engine.local().is_ipv4() {
            return Err(Error::InvalidArgument("address handle destination is of another IP family"));
        }
        let addr = SocketAddr::new(ip, attr.udp_port.unwrap_or_else(default_port));
        Ok(AddressHandle { attr: *attr, addr, pd: self.clone() })
    }

    /// Creates an address handle that answers the sender of a received UD completion
    /// (`ibv_create_ah_from_wc`): the destination is the source GID of `grh`, the first 40
    /// bytes of the receive buffer, with its traffic class and flow label; the UDP port is
    /// the one the datagram came from. Without `grh`, the completion's source address is
    /// used.
    pub fn create_ah_from_wc(&self, wc: &WorkCompletion, grh: Option<&[u8]>) -> Result<AddressHandle> {
        if !wc.grh && grh.is_some() {
            return Err(Error::InvalidArgument("the completion carries no GRH"));
        }
        let src = wc.src;
        let mut attr = match grh {
            Some(g) => parse_grh(g)?,
            None => {
                AhAttr::to(src.ok_or(Error::InvalidArgument("the completion has no source address"))?.ip())
            }
        };
        attr.hop_limit = 0xFF;
        attr.udp_port = src.map(|s| s.port());
        self.create_ah(&attr)
    }
}

impl AhAttr {
    /// The attributes that reach the sender of a UD receive, from the 40-byte GRH area
    /// of its buffer (source GID, traffic class, flow label).
    pub fn from_grh(grh: &[u8]) -> Result<AhAttr> {
        parse_grh(grh)
    }
}

/// The source GID, traffic class and flow label of a GRH area: for IPv4, twenty zero bytes
/// and the IPv4 header; for IPv6, the IPv6 header.
fn parse_grh(g: &[u8]) -> Result<AhAttr> {
    let g: &[u8; 40] = g
        .get(..40)
        .and_then(|s| s.try_into().ok())
        .ok_or(Error::InvalidArgument("GRH shorter than 40 bytes"))?;
    if g[..20].iter().all(|&b| b == 0) && g[20] >> 4 == 4 {
        let ip = Ipv4Addr::new(g[32], g[33], g[34], g[35]);
        return Ok(AhAttr { traffic_class: g[21], ..AhAttr::to(IpAddr::V4(ip)) });
    }
    if g[0] >> 4 == 6 {
        let mut src = [0u8; 16];
        src.copy_from_slice(&g[8..24]);
        let traffic_class = (g[0] << 4) | (g[1] >> 4);
        let flow_label = (u32::from(g[1] & 0x0F) << 16) | (u32::from(g[2]) << 8) | u32::from(g[3]);
        let ip = addr_of_gid(Ipv6Addr::from(src).octets());
        return Ok(AhAttr { traffic_class, flow_label, ..AhAttr::to(ip) });
    }
    Err(Error::InvalidArgument("GRH area holds neither an IPv4 nor an IPv6 header"))
}
