//! Devices: what exists before anything is opened, and the state an opened device's
//! objects share.
//!
//! The device model is rxe's (`rdma link add rxe0 type rxe netdev eth0`): one device per
//! network interface, `srdma_<interface>`, with its own node GUID (the interface's MAC as
//! an EUI-64; for interfaces without one, derived from the interface's first address) and
//! one port whose GID table holds the interface's addresses as RoCE v2 GIDs: its IPv4
//! addresses (IPv4-mapped) first, then its global IPv6 addresses, then its IPv6 link-local
//! ones. (rxe puts the link-local GID at index 0; softrdma puts an IPv4 address first so
//! that index 0 needs no scope.) Everything here is readable without opening a device:
//! [`Device::attr`], [`Device::port_attr`] and [`Device::gids`] are what `ibv_query_device`,
//! `ibv_query_port` and `ibv_query_gid` return.
//!
//! Opening a device binds one of its GIDs — the address a process uses — and nothing else.
//! Two processes share a host by using different addresses: Linux routes all of
//! `127.0.0.0/8` to `lo`, so `127.0.0.2` and `127.0.0.3` are loopback GIDs of `srdma_lo`
//! that [`find_device`] adds when asked for them by address, and that the environment
//! variable `SOFTRDMA_GIDS` (a comma-separated list of addresses) adds to every listing,
//! so that tools show them and pick them by index (`perf -x`, `pingpong -g`).

use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use softrdma_proto::qp::{Mtu, MAX_MESSAGE};
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
/// Outstanding READs and atomics per QP: 128, as Linux rxe advertises. perftest's READ
/// and atomic clients take the server's advertised count for their own `max_rd_atomic`,
/// so a smaller limit here made `ib_read_bw` against an rxe server fail to reach RTS.
pub const MAX_QP_RD_ATOM: u8 = 128;
/// Largest memory region.
pub const MAX_MR_SIZE: u64 = 1 << 40;
/// CQs, PDs, SRQs and address handles have no limit of their own; the QP limit is
/// reported for them.
const MAX_OBJECTS: u32 = MAX_QP;

/// The environment variable that sets the UDP port devices bind (default 4791).
pub const PORT_ENV: &str = "SOFTRDMA_PORT";

/// The address this process uses (`SOFTRDMA_BIND=ADDR`): the drop-in library lists its
/// device first with ADDR as GID 0, and the connection manager's wildcard listeners
/// listen on it too, beside the devices' own addresses.
pub const BIND_ENV: &str = "SOFTRDMA_BIND";

/// The address [`BIND_ENV`] names, if it names one.
pub fn bind_env() -> Option<std::net::IpAddr> {
    std::env::var(BIND_ENV).ok().and_then(|b| b.trim().parse().ok())
}
/// The environment variable that adds addresses to the GID tables: a comma-separated
/// list, each added to the interface that routes it (`127.0.0.2` → `lo`).
pub const GIDS_ENV: &str = "SOFTRDMA_GIDS";

/// The type of a GID table entry (`ibv_gid_type`); softrdma's are all RoCE v2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GidType {
    /// RoCE v2: the GID is an IP address, packets are UDP datagrams to port 4791.
    RoceV2,
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GidEntry {
    /// The index in the table.
    pub index: u32,
    /// The GID: the address as 16 bytes, IPv4-mapped for IPv4.
    pub gid: [u8; 16],
    /// The address.
    pub addr: IpAddr,
    /// The IPv6 scope (interface index) of a link-local address; 0 otherwise.
    pub scope_id: u32,
    /// The GID type.
    pub gid_type: GidType,
}

/// A device: one network interface, and the GID a context opened on it binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// `srdma_<interface>`, or `srdma_mem_<address>` on an in-process network.
    pub name: String,
    /// The address a context opened from this value binds: GID `gid_index`.
    pub addr: IpAddr,
    /// The GID a context opened from this value binds (0 unless chosen by address or with
    /// [`Device::with_gid`]).
    pub gid_index: u32,
    /// The interface.
    pub netdev: String,
    /// Whether the interface is up (the port is then ACTIVE).
    pub up: bool,
    /// The interface MTU.
    pub netdev_mtu: u32,
    /// The interface's speed in Mb/s (1000 when it reports none, as rxe assumes).
    pub speed_mbps: u32,
    /// Node GUID.
    pub node_guid: u64,
    /// The port's GID table.
    pub gids: Vec<GidEntry>,
}

/// Orders an interface's addresses as the GID table has them: IPv4, global IPv6,
/// link-local IPv6 (each in the kernel's order).
fn gid_rank(a: &IpAddr) -> u8 {
    match a {
        IpAddr::V4(_) => 0,
        IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80 => 2,
        IpAddr::V6(_) => 1,
    }
}

impl Device {
    /// The device of one interface from its addresses (all with the same name).
    fn of_interface(addrs: &[&InterfaceAddr], extra: &[IpAddr]) -> Option<Device> {
        let first = addrs.first()?;
        let mut listed: Vec<(IpAddr, u32)> = addrs.iter().map(|i| (i.addr, i.scope_id)).collect();
        listed.sort_by_key(|(a, _)| gid_rank(a));
        for &a in extra {
            if !listed.iter().any(|(l, _)| *l == a) {
                listed.push((a, 0));
            }
        }
        let gids = listed
            .iter()
            .enumerate()
            .map(|(k, &(addr, scope_id))| GidEntry {
                index: k as u32,
                gid: gid_of(addr),
                addr,
                scope_id,
                gid_type: GidType::RoceV2,
            })
            .collect::<Vec<_>>();
        Some(Device {
            name: format!("srdma_{}", first.name),
            addr: gids[0].addr,
            gid_index: 0,
            netdev: first.name.clone(),
            up: first.up,
            netdev_mtu: first.mtu,
            speed_mbps: interfaces::speed_mbps(&first.name).unwrap_or(1_000),
            node_guid: interfaces::guid_from(first.mac, first.addr),
            gids,
        })
    }

    /// The device of an address on an in-process network.
    pub(crate) fn in_memory(addr: IpAddr) -> Device {
        let a: String =
            addr.to_string().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        Device {
            name: format!("srdma_mem_{a}"),
            addr,
            gid_index: 0,
            netdev: "mem".into(),
            up: true,
            netdev_mtu: 9000,
            speed_mbps: 100_000,
            node_guid: interfaces::guid_from(None, addr),
            gids: vec![GidEntry {
                index: 0,
                gid: gid_of(addr),
                addr,
                scope_id: 0,
                gid_type: GidType::RoceV2,
            }],
        }
    }

    /// This device, opening GID `index` instead.
    pub fn with_gid(&self, index: u32) -> Result<Device> {
        let g =
            self.gids.get(index as usize).ok_or(Error::InvalidArgument("GID index not in the GID table"))?;
        Ok(Device { addr: g.addr, gid_index: index, ..self.clone() })
    }

    /// This device with `addr`'s GID moved to index 0 (added if the table lacks it), and
    /// bound: what a program that always takes GID 0 sees when it is given one address
    /// of a shared host (the drop-in `libibverbs.so.1` under `SOFTRDMA_BIND`).
    pub fn with_gid0(&self, addr: IpAddr) -> Device {
        let mut gids = self.gids.clone();
        let pos = gids.iter().position(|g| g.addr == addr);
        let first = match pos {
            Some(k) => gids.remove(k),
            None => GidEntry { index: 0, gid: gid_of(addr), addr, scope_id: 0, gid_type: GidType::RoceV2 },
        };
        gids.insert(0, first);
        for (k, g) in gids.iter_mut().enumerate() {
            g.index = k as u32;
        }
        Device { addr, gid_index: 0, gids, ..self.clone() }
    }

    /// The GID a context opened from this value binds.
    pub fn gid(&self) -> [u8; 16] {
        gid_of(self.addr)
    }

    /// The port's active MTU: the largest IB MTU that fits the interface with RoCE's
    /// headers (256 if the interface MTU is unknown).
    pub fn active_mtu(&self) -> Mtu {
        Mtu::for_link(self.netdev_mtu).unwrap_or(Mtu::Mtu256)
    }

    /// The device's attributes (`ibv_query_device`): the limits softrdma enforces.
    pub fn attr(&self) -> DeviceAttr {
        let rd = u32::from(MAX_QP_RD_ATOM);
        DeviceAttr {
            fw_ver: env!("CARGO_PKG_VERSION").to_string(),
            node_guid: self.node_guid,
            sys_image_guid: self.node_guid,
            max_mr_size: MAX_MR_SIZE,
            page_size_cap: 0xffff_f000,
            vendor_id: 0,
            vendor_part_id: 0,
            hw_ver: 0,
            max_qp: MAX_QP,
            max_qp_wr: MAX_QP_WR,
            device_cap_flags: DEVICE_CAP_FLAGS,
            max_sge: MAX_SGE,
            max_sge_rd: MAX_SGE,
            max_cq: MAX_OBJECTS,
            max_cqe: MAX_CQE as u32,
            max_mr: MAX_MR,
            max_pd: MAX_OBJECTS,
            max_qp_rd_atom: rd,
            max_ee_rd_atom: 0,
            max_res_rd_atom: rd.saturating_mul(MAX_QP),
            max_qp_init_rd_atom: rd,
            max_ee_init_rd_atom: 0,
            atomic_cap: AtomicCap::Hca,
            max_ee: 0,
            max_rdd: 0,
            max_mw: 0,
            max_raw_ipv6_qp: 0,
            max_raw_ethy_qp: 0,
            max_mcast_grp: softrdma_proto::endpoint::MAX_MCAST_GROUPS as u32,
            max_mcast_qp_attach: softrdma_proto::endpoint::MAX_MCAST_QP_ATTACH as u32,
            max_total_mcast_qp_attach: (softrdma_proto::endpoint::MAX_MCAST_GROUPS
                * softrdma_proto::endpoint::MAX_MCAST_QP_ATTACH)
                as u32,
            max_ah: MAX_OBJECTS,
            max_fmr: 0,
            max_map_per_fmr: 0,
            max_srq: MAX_OBJECTS,
            max_srq_wr: MAX_QP_WR,
            max_srq_sge: MAX_SGE,
            max_pkeys: 1,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
            max_inline_data: MAX_INLINE,
        }
    }

    /// Port 1's attributes (`ibv_query_port`).
    pub fn port_attr(&self) -> PortAttr {
        let link = LinkSpeed::from_mbps(self.speed_mbps);
        PortAttr {
            state: if self.up { PortState::Active } else { PortState::Down },
            max_mtu: Mtu::Mtu4096,
            active_mtu: self.active_mtu(),
            gid_tbl_len: self.gids.len() as u32,
            port_cap_flags: PORT_CAP_IP_BASED_GIDS,
            max_msg_sz: MAX_MESSAGE,
            bad_pkey_cntr: 0,
            qkey_viol_cntr: 0,
            pkey_tbl_len: 1,
            lid: 0,
            sm_lid: 0,
            lmc: 0,
            max_vl_num: 1,
            sm_sl: 0,
            subnet_timeout: 0,
            init_type_reply: 0,
            active_width: link.width,
            active_speed: link.speed,
            rate_gbps: link.rate,
            phys_state: if self.up { 5 } else { 3 },
            link_layer: LinkLayer::Ethernet,
            flags: 0,
            port_cap_flags2: 0,
        }
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

/// The addresses `SOFTRDMA_GIDS` adds; malformed entries are ignored.
fn configured_gids() -> Vec<IpAddr> {
    std::env::var(GIDS_ENV)
        .map(|v| v.split(',').filter_map(|a| a.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// Builds the device list from interface addresses, adding `extra` addresses to the
/// interfaces that route them.
fn build(all: &[InterfaceAddr], extra: &[IpAddr]) -> Result<Vec<Device>> {
    let mut names: Vec<&str> = Vec::new();
    for i in all {
        if !names.contains(&i.name.as_str()) {
            names.push(&i.name);
        }
    }
    let mut extra_of: Vec<(IpAddr, String)> = Vec::new();
    for &a in extra {
        if let Some(i) = interfaces::find(a)? {
            extra_of.push((a, i.name));
        }
    }
    Ok(names
        .iter()
        .filter_map(|n| {
            let addrs: Vec<&InterfaceAddr> = all.iter().filter(|i| i.name == *n).collect();
            let more: Vec<IpAddr> = extra_of.iter().filter(|(_, m)| m == n).map(|(a, _)| *a).collect();
            Device::of_interface(&addrs, &more)
        })
        .collect())
}

/// Every device of this host: one per interface, with the addresses of `SOFTRDMA_GIDS`
/// added to their interfaces' GID tables.
pub fn devices() -> Result<Vec<Device>> {
    build(&interfaces::list()?, &configured_gids())
}

/// The device with this name (opening GID 0), or the device of this address (opening
/// that address's GID). An address no interface lists but one routes — `127.0.0.2` on
/// `lo` — is added to that device's GID table.
pub fn find_device(name_or_addr: &str) -> Result<Device> {
    if let Ok(addr) = name_or_addr.parse::<IpAddr>() {
        let mut extra = configured_gids();
        extra.push(addr);
        let found = build(&interfaces::list()?, &extra)?
            .into_iter()
            .find_map(|d| d.gids.iter().find(|g| g.addr == addr).map(|g| d.with_gid(g.index)));
        return found.unwrap_or(Err(Error::NoSuchDevice(addr)));
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

/// An opened device, shared by its objects: the engine (shard 0, and the other shards of
/// a sharded device), the device's description, and the progress threads, stopped when
/// the last object goes.
#[derive(Debug)]
pub(crate) struct ContextInner {
    /// Shard 0: the CM, SRQs, UD QPs, asynchronous events; the only one unless sharded.
    pub(crate) engine: Arc<Engine>,
    /// Every shard by index, shard 0 first.
    pub(crate) shards: Vec<Arc<Engine>>,
    pub(crate) device: Device,
    threads: Vec<JoinHandle<()>>,
    pub(crate) next_pd: Mutex<u32>,
    /// Where the next RC or UC QP goes (round robin over the shards).
    next_shard: std::sync::atomic::AtomicUsize,
}

/// `SOFTRDMA_SHARDS`: how many shards a device opened on UDP gets (a power of two, at most
/// [`MAX_SHARDS`]; `auto`: half the cores, rounded down to a power of two, at most 8); 1,
/// one engine and one socket, unless set or set to anything else.
pub(crate) fn shards_env() -> usize {
    let v = std::env::var("SOFTRDMA_SHARDS").unwrap_or_default();
    if v.trim() == "auto" {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        return auto_shards(cores);
    }
    v.trim().parse::<usize>().ok().filter(|n| n.is_power_of_two() && *n <= MAX_SHARDS).unwrap_or(1)
}

/// `SOFTRDMA_SOURCE_PORTS`: how many UDP source ports a device opened on UDP spreads its
/// RC and UC QPs over (see `Endpoint::set_source_ports`), shared out among its shards (one
/// each at least); 0 sends everything from the device's own port; at most
/// [`MAX_SOURCE_PORTS`]. `None` when unset or not a number: one per shard of a sharded
/// device, none for an unsharded one.
pub(crate) fn source_ports_env() -> Option<usize> {
    source_ports_from(std::env::var("SOFTRDMA_SOURCE_PORTS").ok().as_deref())
}

fn source_ports_from(v: Option<&str>) -> Option<usize> {
    v?.trim().parse::<usize>().ok().map(|n| n.min(MAX_SOURCE_PORTS))
}

/// The most source ports a device opens.
pub(crate) const MAX_SOURCE_PORTS: usize = 64;

/// `SOFTRDMA_SHARDS=auto` on `cores` cores: a shard per two cores, a power of two, at most
/// 8 (where the measured scaling was taken; more shards than busy QPs buy nothing).
fn auto_shards(cores: usize) -> usize {
    let mut n = 1;
    while n * 4 <= cores && n < 8 {
        n *= 2;
    }
    n
}

#[cfg(test)]
mod shard_tests {
    #[test]
    fn source_ports_are_a_number_up_to_64_or_the_default() {
        let got: Vec<Option<usize>> =
            [None, Some(""), Some("0"), Some("3"), Some(" 16 "), Some("1000"), Some("x")]
                .iter()
                .map(|v| super::source_ports_from(*v))
                .collect();
        assert_eq!(got, [None, None, Some(0), Some(3), Some(16), Some(64), None]);
    }

    #[test]
    fn auto_takes_a_shard_per_two_cores_up_to_eight() {
        let got: Vec<usize> =
            [1, 2, 3, 4, 7, 8, 16, 32, 128].iter().map(|&c| super::auto_shards(c)).collect();
        assert_eq!(got, [1, 1, 1, 2, 2, 4, 8, 8, 8]);
    }
}

/// The most shards a device may have.
pub(crate) const MAX_SHARDS: usize = 64;

impl ContextInner {
    /// Starts the engines' progress threads: one per shard.
    pub(crate) fn start(engines: Vec<Engine>, device: Device) -> Result<ContextInner> {
        let shards: Vec<Arc<Engine>> = engines.into_iter().map(Arc::new).collect();
        Engine::set_shards(&shards);
        let mut threads = Vec::with_capacity(shards.len());
        for (k, engine) in shards.iter().enumerate() {
            let name = if k == 0 { device.name.clone() } else { format!("{}/{k}", device.name) };
            crate::introspect::register(engine, &name);
            let runner = engine.clone();
            let spawned = crate::sys::spawn_quiet(format!("softrdma-{name}"), move || runner.run());
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    for e in &shards {
                        e.stop();
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(ContextInner {
            engine: shards[0].clone(),
            shards,
            device,
            threads,
            next_pd: Mutex::new(1),
            next_shard: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// The shard a new QP goes to: RC and UC QPs without an SRQ in turn over the shards,
    /// the rest (UD and its multicast, SRQs) on shard 0.
    pub(crate) fn place_qp(&self, qp_type: softrdma_proto::qp::QpType, srq: bool) -> (usize, &Arc<Engine>) {
        use softrdma_proto::qp::QpType;
        if self.shards.len() == 1 || srq || !matches!(qp_type, QpType::Rc | QpType::Uc) {
            return (0, &self.engine);
        }
        let k = self.next_shard.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.shards.len();
        (k, &self.shards[k])
    }
}

impl ContextInner {
    /// GID `index` of the port.
    pub(crate) fn gid(&self, index: u32) -> Option<[u8; 16]> {
        self.device.gids.get(index as usize).map(|g| g.gid)
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        for e in &self.shards {
            e.stop();
        }
        tracing::debug!(device = %self.device.name, io = ?self.engine.io_stats(), "closing");
        for t in self.threads.drain(..) {
            // The last handle can go on the progress thread itself (an object dropped
            // while it hands out events): it then stops on its own, holding the engine
            // until it does.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// `IBV_DEVICE_PORT_ACTIVE_EVENT | IBV_DEVICE_SYS_IMAGE_GUID | IBV_DEVICE_RC_RNR_NAK_GEN`.
pub const DEVICE_CAP_FLAGS: u32 = (1 << 10) | (1 << 11) | (1 << 12);
/// `IBV_PORT_IP_BASED_GIDS`: the only port capability (no SM, no CM MADs yet).
pub const PORT_CAP_IP_BASED_GIDS: u32 = 1 << 26;

/// Atomic operation guarantees (`ibv_atomic_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AtomicCap {
    /// `IBV_ATOMIC_NONE`.
    None = 0,
    /// `IBV_ATOMIC_HCA`: atomic among the QPs of this device.
    Hca = 1,
    /// `IBV_ATOMIC_GLOB`: atomic with the CPU too.
    Glob = 2,
}

/// Device attributes (`ibv_device_attr`, every field, with rdma-core's names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version: the crate version.
    pub fw_ver: String,
    /// Node GUID.
    pub node_guid: u64,
    /// System image GUID: the node GUID.
    pub sys_image_guid: u64,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Supported page sizes.
    pub page_size_cap: u64,
    /// 0: assigned to no RDMA vendor, so no tool takes a vendor-specific path.
    pub vendor_id: u32,
    /// 0.
    pub vendor_part_id: u32,
    /// 0.
    pub hw_ver: u32,
    /// QPs.
    pub max_qp: u32,
    /// WRs per queue.
    pub max_qp_wr: u32,
    /// `ibv_device_cap_flags`.
    pub device_cap_flags: u32,
    /// SGEs per WR.
    pub max_sge: u32,
    /// SGEs per READ.
    pub max_sge_rd: u32,
    /// CQs.
    pub max_cq: u32,
    /// Entries per CQ.
    pub max_cqe: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Protection domains.
    pub max_pd: u32,
    /// Outstanding READs and atomics per QP, as responder.
    pub max_qp_rd_atom: u32,
    /// 0: no end-to-end contexts.
    pub max_ee_rd_atom: u32,
    /// Responder resources in all.
    pub max_res_rd_atom: u32,
    /// Outstanding READs and atomics per QP, as initiator.
    pub max_qp_init_rd_atom: u32,
    /// 0.
    pub max_ee_init_rd_atom: u32,
    /// Atomic guarantees.
    pub atomic_cap: AtomicCap,
    /// 0.
    pub max_ee: u32,
    /// 0.
    pub max_rdd: u32,
    /// 0: no memory windows.
    pub max_mw: u32,
    /// 0.
    pub max_raw_ipv6_qp: u32,
    /// 0.
    pub max_raw_ethy_qp: u32,
    /// Multicast groups the device's QPs can be attached to (8192, as rxe).
    pub max_mcast_grp: u32,
    /// QPs of the device attached to one group (56, as rxe).
    pub max_mcast_qp_attach: u32,
    /// Attachments in all.
    pub max_total_mcast_qp_attach: u32,
    /// Address handles.
    pub max_ah: u32,
    /// 0.
    pub max_fmr: u32,
    /// 0.
    pub max_map_per_fmr: u32,
    /// Shared receive queues.
    pub max_srq: u32,
    /// WRs per SRQ.
    pub max_srq_wr: u32,
    /// SGEs per SRQ WR.
    pub max_srq_sge: u32,
    /// P_Keys in the table.
    pub max_pkeys: u16,
    /// Responder ACK delay code (4.096 µs × 2^n), what rxe reports.
    pub local_ca_ack_delay: u8,
    /// Ports.
    pub phys_port_cnt: u8,
    /// Largest inline send (not in `ibv_device_attr`; `ibv_devinfo -v` shows it).
    pub max_inline_data: u32,
}

/// Port states (`ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortState {
    /// `IBV_PORT_DOWN`: the interface is down.
    Down = 1,
    /// `IBV_PORT_ACTIVE`.
    Active = 4,
}

/// Link layers (`IBV_LINK_LAYER_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// `IBV_LINK_LAYER_ETHERNET`: RoCE.
    Ethernet = 2,
}

/// Port attributes (`ibv_port_attr`, every field, with rdma-core's names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PortAttr {
    /// ACTIVE when the interface is up, DOWN otherwise.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// The MTU the interface allows.
    pub active_mtu: Mtu,
    /// GID table entries.
    pub gid_tbl_len: u32,
    /// `ibv_port_cap_flags`: IsIPBasedGIDs.
    pub port_cap_flags: u32,
    /// Largest message.
    pub max_msg_sz: u64,
    /// Counter of bad P_Keys (per device: see `Context::endpoint_stats`); 0 here.
    pub bad_pkey_cntr: u32,
    /// Counter of Q_Key violations; 0 here.
    pub qkey_viol_cntr: u32,
    /// P_Key table entries: one, 0xFFFF.
    pub pkey_tbl_len: u16,
    /// 0: RoCE has no LIDs.
    pub lid: u16,
    /// 0.
    pub sm_lid: u16,
    /// 0.
    pub lmc: u8,
    /// 1.
    pub max_vl_num: u8,
    /// 0.
    pub sm_sl: u8,
    /// 0.
    pub subnet_timeout: u8,
    /// 0.
    pub init_type_reply: u8,
    /// `ibv_port_attr.active_width` (1 = 1X, 2 = 4X, 4 = 8X, 8 = 12X, 16 = 2X).
    pub active_width: u8,
    /// `ibv_port_attr.active_speed` (1 = SDR ... 128 = NDR).
    pub active_speed: u16,
    /// Width × lane speed in Gb/s, as `ibstat` shows it.
    pub rate_gbps: f64,
    /// `phys_state`: 5 LinkUp, 3 Disabled.
    pub phys_state: u8,
    /// Ethernet.
    pub link_layer: LinkLayer,
    /// `ibv_port_attr.flags`: 0.
    pub flags: u8,
    /// 0.
    pub port_cap_flags2: u16,
}

/// Link width and speed from an Ethernet speed, as the kernel maps them for rxe
/// (`ib_get_eth_speed`, without lane information).
#[derive(Debug, Clone, Copy, PartialEq)]
struct LinkSpeed {
    width: u8,
    speed: u16,
    rate: f64,
}

impl LinkSpeed {
    fn from_mbps(mbps: u32) -> LinkSpeed {
        let (width, speed, rate) = match mbps {
            0..=1_000 => (1, 1, 2.5),            // 1X SDR
            1_001..=10_000 => (1, 8, 10.0),      // 1X FDR10
            10_001..=20_000 => (2, 2, 20.0),     // 4X DDR
            20_001..=25_000 => (1, 32, 25.0),    // 1X EDR
            25_001..=40_000 => (2, 8, 40.0),     // 4X FDR10
            40_001..=50_000 => (16, 32, 50.0),   // 2X EDR
            50_001..=100_000 => (2, 32, 100.0),  // 4X EDR
            100_001..=200_000 => (2, 64, 200.0), // 4X HDR
            _ => (2, 128, 400.0),                // 4X NDR
        };
        LinkSpeed { width, speed, rate }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, addr: &str, mac: Option<[u8; 6]>) -> InterfaceAddr {
        InterfaceAddr {
            name: name.into(),
            index: 1,
            addr: addr.parse().unwrap(),
            scope_id: 0,
            up: true,
            loopback: name == "lo",
            mtu: 1500,
            mac,
        }
    }

    #[test]
    fn one_device_per_interface_with_its_gid_table() {
        let mac = Some([0x52, 0x54, 0, 0x12, 0x34, 0x56]);
        let all = [
            iface("lo", "127.0.0.1", None),
            iface("eth0", "fe80::5054:ff:fe12:3456", mac),
            iface("eth0", "10.0.2.15", mac),
            iface("lo", "::1", None),
            iface("eth0", "2001:db8::15", mac),
            iface("eth1", "10.0.3.15", Some([0x52, 0x54, 0, 0x12, 0x34, 0x57])),
        ];
        let devs = build(&all, &[]).unwrap();
        let names: Vec<&str> = devs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["srdma_lo", "srdma_eth0", "srdma_eth1"]);
        let eth0: Vec<String> = devs[1].gids.iter().map(|g| g.addr.to_string()).collect();
        assert_eq!(
            eth0,
            ["10.0.2.15", "2001:db8::15", "fe80::5054:ff:fe12:3456"],
            "IPv4, global, link-local"
        );
        assert_eq!(devs[1].gids[0].gid[..12], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff], "IPv4-mapped");
        assert_eq!(devs[1].addr, "10.0.2.15".parse::<IpAddr>().unwrap());
        assert_eq!(devs[1].port_attr().gid_tbl_len, 3);
        // Each device its own GUID; a NIC's is its MAC as an EUI-64.
        assert_eq!(devs[1].node_guid, 0x5054_00ff_fe12_3456);
        assert_ne!(devs[1].node_guid, devs[2].node_guid);
        assert_ne!(devs[0].node_guid, devs[1].node_guid);
        let v6 = devs[1].with_gid(1).unwrap();
        assert_eq!((v6.addr, v6.gid_index), ("2001:db8::15".parse::<IpAddr>().unwrap(), 1));
        assert!(devs[1].with_gid(3).is_err());
    }

    #[test]
    fn eth_speed_mapping() {
        assert_eq!(LinkSpeed::from_mbps(1000).rate, 2.5);
        assert_eq!(LinkSpeed::from_mbps(10_000).speed, 8);
        assert_eq!(LinkSpeed::from_mbps(25_000).rate, 25.0);
        assert_eq!(LinkSpeed::from_mbps(100_000).width, 2);
    }

    #[test]
    fn attributes_are_complete_and_consistent() {
        let d = Device::in_memory("10.9.9.9".parse().unwrap());
        let a = d.attr();
        assert_eq!((a.vendor_id, a.vendor_part_id, a.phys_port_cnt, a.max_pkeys), (0, 0, 1, 1));
        assert_eq!((a.max_qp, a.max_qp_wr, a.max_mr_size), (MAX_QP, MAX_QP_WR, MAX_MR_SIZE));
        assert_eq!(a.atomic_cap, AtomicCap::Hca);
        let p = d.port_attr();
        assert_eq!(
            (p.state, p.link_layer, p.pkey_tbl_len, p.lid),
            (PortState::Active, LinkLayer::Ethernet, 1, 0)
        );
        assert_eq!((p.active_width, p.active_speed, p.rate_gbps), (2, 32, 100.0), "100 Gb/s: 4X EDR");
    }
}
