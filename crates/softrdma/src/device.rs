//! Devices: what exists before anything is opened, and the state an opened device's
//! objects share.
//!
//! A device is one local IP address: every address of every interface (loopback
//! included) is listed, and any other bindable address — 127.0.0.2 is loopback too, though
//! no interface lists it — can be opened by address.
//!
//! Each device has one GID, index 0: the address itself (IPv4-mapped for IPv4), as RoCEv2
//! defines it. Linux rxe differs: per netdev, index 0 is the IPv6 link-local GID and the
//! IPv4-mapped one is at index 1; tools that talk to rxe must pick the IPv4-mapped GID on
//! its side.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use softrdma_proto::qp::Mtu;
use softrdma_proto::wire::ROCEV2_PORT;

use crate::engine::Engine;
use crate::sys::interfaces::{self, InterfaceAddr};
use crate::{Error, Result};

/// Largest CQ.
pub const MAX_CQE: usize = 1 << 20;
/// Largest send or receive queue.
pub const MAX_QP_WR: u32 = 1 << 16;
/// Scatter/gather entries per WR.
pub const MAX_SGE: u32 = 32;
/// Largest inline send.
pub const MAX_INLINE: u32 = 512;
/// QPs per device.
pub const MAX_QP: u32 = 1 << 16;
/// Memory regions per device.
pub const MAX_MR: u32 = 1 << 20;
/// Outstanding READs and atomics per QP.
pub const MAX_QP_RD_ATOM: u8 = 16;

/// The environment variable that sets the UDP port devices bind (default 4791).
pub const PORT_ENV: &str = "SOFTRDMA_PORT";

/// A device: one local IP address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// Stable name: `srdma_<interface>` for an interface's first address,
    /// `srdma_<interface>_<n>` for its n-th other one, and `srdma_<interface>_<address>`
    /// for an address the interface does not list (127.0.0.2 on `lo`).
    pub name: String,
    /// The address.
    pub addr: IpAddr,
    /// The interface.
    pub netdev: String,
    /// Whether the interface is up (the port is then ACTIVE).
    pub up: bool,
    /// The interface MTU.
    pub netdev_mtu: u32,
    /// Node GUID, derived from the interface's MAC (or from the address on loopback).
    pub node_guid: u64,
}

impl Device {
    /// `index`: the address's position among its interface's listed addresses, or `None`
    /// for an address no interface lists (such as 127.0.0.2).
    fn from_iface(i: &InterfaceAddr, index: Option<usize>) -> Device {
        let name = match index {
            Some(0) => format!("srdma_{}", i.name),
            Some(k) => format!("srdma_{}_{k}", i.name),
            None => {
                let a: String = i
                    .addr
                    .to_string()
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                    .collect();
                format!("srdma_{}_{}", i.name, a)
            }
        };
        Device {
            name,
            addr: i.addr,
            netdev: i.name.clone(),
            up: i.up,
            netdev_mtu: i.mtu,
            node_guid: interfaces::guid_from(i.mac, i.addr),
        }
    }

    /// The device of an address on an in-process network.
    pub(crate) fn in_memory(addr: IpAddr) -> Device {
        let a: String =
            addr.to_string().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        Device {
            name: format!("srdma_mem_{a}"),
            addr,
            netdev: "mem".into(),
            up: true,
            netdev_mtu: 9000,
            node_guid: interfaces::guid_from(None, addr),
        }
    }

    /// The GID: the address as 16 bytes, IPv4-mapped for IPv4.
    pub fn gid(&self) -> [u8; 16] {
        gid_of(self.addr)
    }

    /// The port's active MTU: the largest IB MTU that fits the interface with RoCE's
    /// headers (256 if the interface MTU is unknown).
    pub fn active_mtu(&self) -> Mtu {
        Mtu::for_link(self.netdev_mtu).unwrap_or(Mtu::Mtu256)
    }
}

/// The 16-byte GID of an address.
pub fn gid_of(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The address of a 16-byte GID.
pub fn addr_of_gid(gid: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(gid);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// Every device of this host: one per address of every interface.
pub fn devices() -> Result<Vec<Device>> {
    let mut count: HashMap<String, usize> = HashMap::new();
    Ok(interfaces::list()?
        .iter()
        .map(|i| {
            let k = count.entry(i.name.clone()).or_insert(0);
            *k += 1;
            Device::from_iface(i, Some(*k - 1))
        })
        .collect())
}

/// The device with this name, or of this address (which need not be listed, e.g.
/// 127.0.0.2).
pub fn find_device(name_or_addr: &str) -> Result<Device> {
    if let Ok(addr) = name_or_addr.parse::<IpAddr>() {
        if let Some(d) = devices()?.into_iter().find(|d| d.addr == addr) {
            return Ok(d);
        }
        let i = interfaces::find(addr)?.ok_or(Error::NoSuchDevice(addr))?;
        return Ok(Device::from_iface(&i, None));
    }
    devices()?
        .into_iter()
        .find(|d| d.name == name_or_addr)
        .ok_or_else(|| Error::UnknownDevice(name_or_addr.into()))
}

/// The port devices bind: `SOFTRDMA_PORT` if set and valid, else 4791.
pub fn default_port() -> u16 {
    std::env::var(PORT_ENV).ok().and_then(|p| p.parse().ok()).filter(|&p| p != 0).unwrap_or(ROCEV2_PORT)
}

/// An opened device, shared by its objects: the engine, the device's description, and
/// the progress thread, stopped when the last object goes.
#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) engine: Arc<Engine>,
    pub(crate) device: Device,
    thread: Option<JoinHandle<()>>,
    pub(crate) next_pd: Mutex<u32>,
}

impl ContextInner {
    /// Starts the engine's progress thread.
    pub(crate) fn start(engine: Engine, device: Device) -> Result<ContextInner> {
        let engine = Arc::new(engine);
        let runner = engine.clone();
        let thread = std::thread::Builder::new()
            .name(format!("softrdma-{}", device.name))
            .spawn(move || runner.run())?;
        Ok(ContextInner { engine, device, thread: Some(thread), next_pd: Mutex::new(1) })
    }
}

impl ContextInner {
    /// GID `index` of the port.
    pub(crate) fn gid(&self, index: u32) -> Option<[u8; 16]> {
        (index == 0).then(|| self.device.gid())
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        self.engine.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Port attributes (`ibv_query_port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// ACTIVE when the interface is up, DOWN otherwise.
    pub active: bool,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// The MTU the interface allows.
    pub active_mtu: Mtu,
    /// Always 0: RoCE has no LIDs.
    pub lid: u16,
    /// GID table entries: one, the address.
    pub gid_tbl_len: u32,
    /// P_Key table entries: one, 0xFFFF.
    pub pkey_tbl_len: u16,
}

/// Device attributes (`ibv_query_device`): the limits softrdma enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Node GUID.
    pub node_guid: u64,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// QPs.
    pub max_qp: u32,
    /// WRs per queue.
    pub max_qp_wr: u32,
    /// SGEs per WR.
    pub max_sge: u32,
    /// CQ entries.
    pub max_cqe: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Outstanding READs and atomics per QP, as responder.
    pub max_qp_rd_atom: u8,
    /// Outstanding READs and atomics per QP, as initiator.
    pub max_qp_init_rd_atom: u8,
    /// Ports.
    pub phys_port_cnt: u8,
}
