//! Devices and opened contexts.
//!
//! A device is one local IP address: every address of every interface (loopback
//! included) is listed, and any other bindable address — 127.0.0.2 is loopback too, though
//! no interface lists it — can be opened by address. Opening binds a UDP socket on the
//! address, port 4791 unless `SOFTRDMA_PORT` or [`Context::open_port`] says otherwise, and
//! starts the device's progress thread. Opening the same address and port twice in one
//! process returns the same context.
//!
//! Each device has one GID, index 0: the address itself (IPv4-mapped for IPv4), as RoCEv2
//! defines it. Linux rxe differs: per netdev, index 0 is the IPv6 link-local GID and the
//! IPv4-mapped one is at index 1; tools that talk to rxe must pick the IPv4-mapped GID on
//! its side.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;

use softrdma_proto::memory::PdId;
use softrdma_proto::qp::Mtu;
use softrdma_proto::wire::ROCEV2_PORT;

use crate::cq::{CompletionChannel, CompletionQueue};
use crate::engine::{AsyncEvent, Shared};
use crate::pd::ProtectionDomain;
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

/// An opened device, shared by its objects.
#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) shared: Arc<Shared>,
    pub(crate) device: Device,
    thread: Option<JoinHandle<()>>,
    next_pd: Mutex<u32>,
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        self.shared.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn opened() -> &'static Mutex<HashMap<SocketAddr, Weak<ContextInner>>> {
    static OPENED: OnceLock<Mutex<HashMap<SocketAddr, Weak<ContextInner>>>> = OnceLock::new();
    OPENED.get_or_init(Default::default)
}

/// An opened device (`ibv_context`).
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl Context {
    /// Opens the device of `addr` on the default port.
    pub fn open(addr: IpAddr) -> Result<Context> {
        Context::open_port(addr, default_port())
    }

    /// Opens a device found by name or address (see [`find_device`]).
    pub fn open_name(name_or_addr: &str) -> Result<Context> {
        let d = find_device(name_or_addr)?;
        Context::open_device(d, default_port())
    }

    /// Opens the device of `addr`, binding UDP `port` (0 picks a free port).
    pub fn open_port(addr: IpAddr, port: u16) -> Result<Context> {
        Context::open_device(find_device(&addr.to_string())?, port)
    }

    fn open_device(device: Device, port: u16) -> Result<Context> {
        let want = SocketAddr::new(device.addr, port);
        let mut table = opened().lock().unwrap_or_else(|p| p.into_inner());
        if port != 0 {
            if let Some(inner) = table.get(&want).and_then(Weak::upgrade) {
                return Ok(Context { inner });
            }
        }
        let socket = bind(want)?;
        let local = socket.local_addr()?;
        let shared = Arc::new(Shared::new(socket, local)?);
        let runner = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("softrdma-{}", device.name))
            .spawn(move || runner.run())?;
        let inner = Arc::new(ContextInner { shared, device, thread: Some(thread), next_pd: Mutex::new(1) });
        table.retain(|_, w| w.strong_count() > 0);
        table.insert(local, Arc::downgrade(&inner));
        Ok(Context { inner })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The address and UDP port the device is bound to: what peers send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.shared.local
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> ProtectionDomain {
        let mut n = self.inner.next_pd.lock().unwrap_or_else(|p| p.into_inner());
        let id = PdId(*n);
        *n += 1;
        ProtectionDomain::new(self.inner.clone(), id)
    }

    /// Creates a completion queue of `cqe` entries, reporting to `channel` when armed.
    pub fn create_cq(&self, cqe: usize, channel: Option<&CompletionChannel>) -> Result<CompletionQueue> {
        CompletionQueue::new(self.inner.clone(), cqe, channel)
    }

    /// Creates a completion channel.
    pub fn create_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new(self.inner.clone())
    }

    /// The next asynchronous event, if any (CQ overrun, QP fatal, port active).
    pub fn poll_async_event(&self) -> Option<AsyncEvent> {
        self.inner.shared.lock().events.pop_front()
    }

    /// Socket-level counters (batches, GSO and GRO trains).
    pub fn io_stats(&self) -> crate::engine::IoStats {
        self.inner.shared.io_stats()
    }

    /// Regions registered on this device.
    pub fn mr_count(&self) -> usize {
        self.inner.shared.lock().mem.len()
    }
}

/// Binds the device socket: non-blocking, DF with IP ID 0 on every datagram (so that
/// ICRCs can be computed for the header the kernel writes), big buffers, and zero-checksum
/// UDP accepted on IPv6 (rxe sends it).
fn bind(addr: SocketAddr) -> Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let domain = if addr.is_ipv4() { Domain::IPV4 } else { Domain::IPV6 };
    let s = Socket::new(domain, Type::DGRAM.cloexec(), Some(Protocol::UDP))?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
    let setopt = |level, name, value: libc::c_int| {
        // SAFETY: passes a pointer to a live c_int and its size to setsockopt on our socket.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        }
    };
    if addr.is_ipv4() {
        setopt(libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO);
    } else {
        setopt(libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IP_PMTUDISC_DO);
        setopt(libc::IPPROTO_UDP, 102 /* UDP_NO_CHECK6_RX */, 1);
        let _ = s.set_only_v6(true);
    }
    let _ = s.set_recv_buffer_size(8 << 20);
    let _ = s.set_send_buffer_size(8 << 20);
    match s.bind(&addr.into()) {
        Ok(()) => Ok(s.into()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(Error::AddressInUse { addr }),
        Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => Err(Error::NoSuchDevice(addr.ip())),
        Err(e) => Err(e.into()),
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

impl Context {
    /// The port's attributes (the only port, number 1).
    pub fn query_port(&self) -> PortAttr {
        let d = &self.inner.device;
        PortAttr {
            active: d.up,
            max_mtu: Mtu::Mtu4096,
            active_mtu: d.active_mtu(),
            lid: 0,
            gid_tbl_len: 1,
            pkey_tbl_len: 1,
        }
    }

    /// GID `index` of the port: index 0 is the device's address.
    pub fn query_gid(&self, index: u32) -> Option<[u8; 16]> {
        (index == 0).then(|| self.inner.device.gid())
    }
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

impl Context {
    /// The device's attributes.
    pub fn query_device(&self) -> DeviceAttr {
        DeviceAttr {
            node_guid: self.inner.device.node_guid,
            max_mr_size: 1 << 40,
            max_qp: MAX_QP,
            max_qp_wr: MAX_QP_WR,
            max_sge: MAX_SGE,
            max_cqe: MAX_CQE as u32,
            max_mr: MAX_MR,
            max_qp_rd_atom: MAX_QP_RD_ATOM,
            max_qp_init_rd_atom: MAX_QP_RD_ATOM,
            phys_port_cnt: 1,
        }
    }
}
