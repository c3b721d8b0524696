//! Host network interfaces and their IP addresses.
//!
//! This module owns the enumeration of local IP addresses that the device list is built from:
//! softrdma exposes one RDMA device per local IP address (loopback included), and each device
//! needs the interface name and index, whether the link is usable, its MTU (to derive the
//! RoCE path MTU), and a stable node GUID.
//!
//! Enumeration uses `getifaddrs(3)`, wrapped in a RAII guard ([`IfAddrs`]) so the list is
//! freed on every path. Full information is Linux (and Android) only: the MTU comes from the
//! `SIOCGIFMTU` ioctl (falling back to `/sys/class/net/NAME/mtu`), and the hardware address
//! from the `AF_PACKET` entries of `getifaddrs` (falling back to
//! `/sys/class/net/NAME/address`). On other unix systems the module still compiles and lists
//! addresses, but reports `mtu == 0` and `mac == None`.
//!
//! Nothing here panics; a failing `getifaddrs` is reported as an [`io::Error`], while a
//! failing MTU or MAC lookup just leaves that field unknown.

use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// One IP address of one network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InterfaceAddr {
    /// Interface name, e.g. `"lo"`, `"eth0"` (lossily decoded if not UTF-8).
    pub(crate) name: String,
    /// Interface index (`if_nametoindex`); 0 if unknown.
    pub(crate) index: u32,
    /// The IP address.
    pub(crate) addr: IpAddr,
    /// IPv6 scope id (`sin6_scope_id`, the interface index for link-local addresses); 0 for
    /// IPv4 and global IPv6 addresses.
    pub(crate) scope_id: u32,
    /// `IFF_UP && IFF_RUNNING` (for loopback, `IFF_UP` suffices).
    pub(crate) up: bool,
    /// `IFF_LOOPBACK`.
    pub(crate) loopback: bool,
    /// Interface MTU in bytes; 0 if unknown.
    pub(crate) mtu: u32,
    /// Hardware (Ethernet) address; `None` for loopback, interfaces without a 6-byte
    /// hardware address, or when unknown.
    pub(crate) mac: Option<[u8; 6]>,
}

/// Every IPv4 and IPv6 address of every interface, in `getifaddrs` order.
///
/// IPv6 link-local addresses are kept; their [`InterfaceAddr::scope_id`] tells which link
/// they belong to. Entries without an address, or with a non-IP address family, are skipped.
pub(crate) fn list() -> io::Result<Vec<InterfaceAddr>> {
    let ifaddrs = IfAddrs::new()?;
    let mut cache = InfoCache::default();

    // First pass: hardware addresses from the AF_PACKET entries (Linux), keyed by name.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    for ifa in ifaddrs.iter() {
        if let (Some(name), Some(mac)) = (ifa_name(ifa), packet_mac(ifa)) {
            cache.macs.push((name.to_bytes().to_vec(), mac));
        }
    }

    let mut out = Vec::new();
    for ifa in ifaddrs.iter() {
        let Some(name) = ifa_name(ifa) else { continue };
        let Some((addr, scope_id)) = ip_of(ifa) else { continue };
        let flags = ifa.ifa_flags;
        let loopback = flags & (libc::IFF_LOOPBACK as libc::c_uint) != 0;
        let is_up = flags & (libc::IFF_UP as libc::c_uint) != 0;
        let running = flags & (libc::IFF_RUNNING as libc::c_uint) != 0;
        let info = cache.get(name, loopback);
        out.push(InterfaceAddr {
            name: name.to_string_lossy().into_owned(),
            index: info.index,
            addr,
            scope_id,
            up: is_up && (running || loopback),
            loopback,
            mtu: info.mtu,
            mac: info.mac,
        });
    }
    Ok(out)
}

/// The interface that owns `addr` (exact match on the address), if any.
///
/// Addresses in `127.0.0.0/8` that are not listed (e.g. `127.0.0.2`) are answered by the
/// loopback interface, since Linux routes the whole block to `lo`; the returned entry is the
/// loopback's IPv4 entry with `addr` replaced.
pub(crate) fn find(addr: IpAddr) -> io::Result<Option<InterfaceAddr>> {
    let all = list()?;
    if let Some(found) = all.iter().find(|i| i.addr == addr) {
        return Ok(Some(found.clone()));
    }
    if let IpAddr::V4(v4) = addr {
        if v4.is_loopback() {
            let lo = all
                .iter()
                .find(|i| i.loopback && i.addr.is_ipv4())
                .or_else(|| all.iter().find(|i| i.loopback));
            if let Some(lo) = lo {
                return Ok(Some(InterfaceAddr { addr, scope_id: 0, ..lo.clone() }));
            }
        }
    }
    Ok(None)
}

/// The interface's link speed in Mb/s from sysfs; `None` when it reports none (loopback,
/// most virtual NICs).
pub(crate) fn speed_mbps(name: &str) -> Option<u32> {
    if name.contains('/') || name.starts_with('.') {
        return None;
    }
    std::fs::read_to_string(format!("/sys/class/net/{name}/speed"))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .filter(|&s| s > 0)
        .map(|s| u32::try_from(s).unwrap_or(u32::MAX))
}

/// A stable 64-bit node GUID for a device, returned as the big-endian value of its 8 wire
/// bytes (so `guid.to_be_bytes()` is the GUID as it appears in packets and in `ibv_devinfo`).
///
/// * With a MAC: modified EUI-64, as Linux rxe does with `addrconf_addr_eui48`:
///   `mac[0] ^ 0x02, mac[1], mac[2], 0xFF, 0xFE, mac[3], mac[4], mac[5]` (the
///   universal/local bit flipped). `addr` is ignored, so every address of one NIC shares the
///   NIC's GUID.
/// * Without a MAC (loopback, tunnels), derived from the IP address, with byte 3 always
///   `0x00` so it can never collide with an EUI-64 GUID (whose byte 3 is `0xFF`):
///   * IPv4 `a.b.c.d` → `02:00:00:00:a:b:c:d` (locally administered prefix, then the
///     address bytes; injective, so `127.0.0.2` and `127.0.0.3` differ);
///   * IPv6 → `06:h1:h2:00:h4:h5:h6:h7`, where `h` is the big-endian FNV-1a-64 hash of the 16
///     address bytes (a fixed, version-independent hash, so the GUID is stable across runs).
pub(crate) fn guid_from(mac: Option<[u8; 6]>, addr: IpAddr) -> u64 {
    let bytes = match (mac, addr) {
        (Some(m), _) => [m[0] ^ 0x02, m[1], m[2], 0xFF, 0xFE, m[3], m[4], m[5]],
        (None, IpAddr::V4(v4)) => {
            let [a, b, c, d] = v4.octets();
            [0x02, 0x00, 0x00, 0x00, a, b, c, d]
        }
        (None, IpAddr::V6(v6)) => {
            let h = fnv1a64(&v6.octets()).to_be_bytes();
            [0x06, h[1], h[2], 0x00, h[4], h[5], h[6], h[7]]
        }
    };
    u64::from_be_bytes(bytes)
}

/// FNV-1a, 64-bit: a tiny hash whose output is fixed by its definition.
fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Owner of a `getifaddrs` list; frees it with `freeifaddrs` on drop.
#[derive(Debug)]
struct IfAddrs {
    head: *mut libc::ifaddrs,
}

impl IfAddrs {
    fn new() -> io::Result<Self> {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        // SAFETY: `head` is a valid out-pointer; on success getifaddrs stores a list that we
        // own and free exactly once in `Drop`; on failure it stores nothing we must free.
        let rc = unsafe { libc::getifaddrs(&mut head) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(IfAddrs { head })
    }

    /// The entries, borrowed from the list (so they cannot outlive the guard).
    fn iter(&self) -> impl Iterator<Item = &libc::ifaddrs> + '_ {
        // SAFETY: `head` is null or points to the first node of the list we own; nodes stay
        // valid until `freeifaddrs` in `Drop`, which cannot run while `self` is borrowed.
        let first = unsafe { self.head.as_ref() };
        std::iter::successors(first, |ifa| {
            // SAFETY: `ifa_next` is null or points to the next node of the same list.
            unsafe { ifa.ifa_next.as_ref() }
        })
    }
}

impl Drop for IfAddrs {
    fn drop(&mut self) {
        if !self.head.is_null() {
            // SAFETY: `head` came from a successful getifaddrs and is freed only here, once.
            unsafe { libc::freeifaddrs(self.head) };
        }
    }
}

/// The entry's interface name, or `None` if the pointer is null.
fn ifa_name(ifa: &libc::ifaddrs) -> Option<&CStr> {
    if ifa.ifa_name.is_null() {
        return None;
    }
    // SAFETY: a non-null `ifa_name` points to a NUL-terminated string owned by the list,
    // which outlives the borrow of `ifa`.
    Some(unsafe { CStr::from_ptr(ifa.ifa_name) })
}

/// The entry's IP address and IPv6 scope id, if it has an `AF_INET`/`AF_INET6` address.
fn ip_of(ifa: &libc::ifaddrs) -> Option<(IpAddr, u32)> {
    let sa = ifa.ifa_addr;
    if sa.is_null() {
        return None;
    }
    // SAFETY: a non-null `ifa_addr` points to at least a `sockaddr` header.
    let family = i32::from(unsafe { (*sa).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: family AF_INET means the storage is a `sockaddr_in`; read_unaligned
            // makes no alignment assumption.
            let sin = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            Some((IpAddr::V4(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes())), 0))
        }
        libc::AF_INET6 => {
            // SAFETY: family AF_INET6 means the storage is a `sockaddr_in6`.
            let sin6 = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            Some((IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)), sin6.sin6_scope_id))
        }
        _ => None,
    }
}

/// The 6-byte hardware address of an `AF_PACKET` entry; `None` for other entries and for
/// all-zero addresses (loopback's AF_PACKET entry reports `00:00:00:00:00:00`).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn packet_mac(ifa: &libc::ifaddrs) -> Option<[u8; 6]> {
    let sa = ifa.ifa_addr;
    if sa.is_null() {
        return None;
    }
    // SAFETY: a non-null `ifa_addr` points to at least a `sockaddr` header.
    if i32::from(unsafe { (*sa).sa_family }) != libc::AF_PACKET {
        return None;
    }
    // SAFETY: family AF_PACKET means glibc/musl stored a `sockaddr_ll` (in storage at least
    // that large); read_unaligned makes no alignment assumption.
    let sll = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_ll>()) };
    if sll.sll_halen != 6 {
        return None;
    }
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&sll.sll_addr[..6]);
    nonzero_mac(mac)
}

fn nonzero_mac(mac: [u8; 6]) -> Option<[u8; 6]> {
    (mac != [0; 6]).then_some(mac)
}

/// Per-interface facts, shared by all addresses of the interface.
#[derive(Debug, Clone, Copy)]
struct IfInfo {
    index: u32,
    mtu: u32,
    mac: Option<[u8; 6]>,
}

/// Looks each interface up once per `list()` call.
#[derive(Debug, Default)]
struct InfoCache {
    /// MACs seen in `AF_PACKET` entries, by raw interface name.
    macs: Vec<(Vec<u8>, [u8; 6])>,
    /// Facts already computed, by raw interface name.
    infos: Vec<(Vec<u8>, IfInfo)>,
    /// Throwaway `AF_INET` datagram socket for `SIOCGIFMTU`, opened on first use.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    sock: Option<std::os::fd::OwnedFd>,
}

impl InfoCache {
    fn get(&mut self, name: &CStr, loopback: bool) -> IfInfo {
        let key = name.to_bytes();
        if let Some((_, info)) = self.infos.iter().find(|(k, _)| k == key) {
            return *info;
        }
        // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        let mac = if loopback {
            None
        } else {
            self.macs.iter().find(|(k, _)| k == key).map(|(_, m)| *m).or_else(|| sysfs_mac(key))
        };
        let info = IfInfo { index, mtu: self.mtu(name), mac };
        self.infos.push((key.to_vec(), info));
        info
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn mtu(&mut self, name: &CStr) -> u32 {
        self.ioctl_mtu(name).or_else(|| sysfs_mtu(name.to_bytes())).unwrap_or(0)
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    fn mtu(&mut self, _name: &CStr) -> u32 {
        0
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn ioctl_mtu(&mut self, name: &CStr) -> Option<u32> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

        let bytes = name.to_bytes();
        if bytes.len() >= libc::IFNAMSIZ {
            return None;
        }
        if self.sock.is_none() {
            // SAFETY: plain socket(2) call; a non-negative result is a fresh fd we own.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
            if fd < 0 {
                return None;
            }
            // SAFETY: `fd` is a freshly opened descriptor owned by nobody else.
            self.sock = Some(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let fd = self.sock.as_ref()?.as_raw_fd();
        // SAFETY: `ifreq` is plain old data (arrays, integers, pointers); all-zero is valid.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        for (dst, &src) in ifr.ifr_name.iter_mut().zip(bytes) {
            *dst = src as libc::c_char;
        }
        // SAFETY: `fd` is an open socket, `ifr` is a valid, NUL-terminated `ifreq` that the
        // kernel fills in for SIOCGIFMTU.
        let rc = unsafe { libc::ioctl(fd, libc::SIOCGIFMTU as _, &mut ifr) };
        if rc != 0 {
            return None;
        }
        // SAFETY: after a successful SIOCGIFMTU the kernel has set `ifru_mtu`; reading an
        // integer field of a zero-initialized union is always defined.
        let mtu = unsafe { ifr.ifr_ifru.ifru_mtu };
        u32::try_from(mtu).ok().filter(|&m| m > 0)
    }
}

/// `/sys/class/net/NAME/<file>` as trimmed text (Linux).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn sysfs_read(name: &[u8], file: &str) -> Option<String> {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    if name.is_empty() || name.contains(&b'/') || name == b"." || name == b".." {
        return None;
    }
    let path = std::path::Path::new("/sys/class/net").join(OsStr::from_bytes(name)).join(file);
    let text = std::fs::read_to_string(path).ok()?;
    Some(text.trim().to_owned())
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn sysfs_mtu(name: &[u8]) -> Option<u32> {
    sysfs_read(name, "mtu")?.parse().ok().filter(|&m| m > 0)
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn sysfs_mac(name: &[u8]) -> Option<[u8; 6]> {
    parse_mac(&sysfs_read(name, "address")?)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn sysfs_mac(_name: &[u8]) -> Option<[u8; 6]> {
    None
}

/// Parses `aa:bb:cc:dd:ee:ff`; `None` for any other shape or an all-zero address.
#[cfg_attr(not(any(target_os = "linux", target_os = "android", test)), allow(dead_code))]
fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    nonzero_mac(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }

    #[test]
    fn list_has_loopback_127_0_0_1() {
        let all = list().unwrap();
        let lo = all.iter().find(|i| i.addr == v4(127, 0, 0, 1)).expect("no 127.0.0.1 entry");
        assert!(lo.loopback, "{lo:?}");
        assert!(lo.up, "{lo:?}");
        assert_eq!(lo.mac, None, "{lo:?}");
        assert_eq!(lo.scope_id, 0);
        if cfg!(any(target_os = "linux", target_os = "android")) {
            assert!(lo.mtu > 0, "{lo:?}");
            assert!(lo.index > 0, "{lo:?}");
        }
    }

    #[test]
    fn find_other_loopback_address() {
        let addr = v4(127, 0, 0, 5);
        let lo = find(addr).unwrap().expect("127.0.0.5 not answered by loopback");
        assert_eq!(lo.addr, addr);
        assert!(lo.loopback);
        assert!(lo.up);
        let listed = find(v4(127, 0, 0, 1)).unwrap().unwrap();
        assert_eq!(lo.name, listed.name);
        assert_eq!(lo.index, listed.index);
    }

    #[test]
    fn find_non_local_is_none() {
        // TEST-NET-2: this host itself uses TEST-NET-1 (192.0.2.0/24) on eth0.
        assert_eq!(find(v4(198, 51, 100, 77)).unwrap(), None);
        assert_eq!(find("2001:db8::77".parse().unwrap()).unwrap(), None);
    }

    #[test]
    fn find_every_listed_address() {
        for entry in list().unwrap() {
            let found = find(entry.addr).unwrap().expect("listed address not found");
            assert_eq!(found.addr, entry.addr);
        }
    }

    #[test]
    fn guid_from_mac_is_modified_eui64() {
        let mac = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
        assert_eq!(guid_from(Some(mac), v4(10, 0, 0, 1)), 0x5054_00ff_fe12_3456);
        // The address does not matter when there is a MAC.
        assert_eq!(guid_from(Some(mac), v4(10, 0, 0, 2)), 0x5054_00ff_fe12_3456);
        // A locally administered MAC gets the bit cleared.
        assert_eq!(guid_from(Some([0x02, 0, 0, 0, 0, 1]), v4(10, 0, 0, 1)), 0x0000_00ff_fe00_0001);
    }

    #[test]
    fn guid_from_ip_without_mac() {
        let a = guid_from(None, v4(127, 0, 0, 2));
        let b = guid_from(None, v4(127, 0, 0, 3));
        assert_ne!(a, b);
        assert_eq!(a, 0x0200_0000_7f00_0002);
        let six1 = guid_from(None, IpAddr::V6(Ipv6Addr::LOCALHOST));
        let six2 = guid_from(None, "fe80::1".parse().unwrap());
        assert_ne!(six1, six2);
        assert_eq!(six1, guid_from(None, IpAddr::V6(Ipv6Addr::LOCALHOST)));
        assert_eq!(six1.to_be_bytes()[0], 0x06);
        assert_eq!(six1.to_be_bytes()[3], 0x00);
    }

    #[test]
    fn parse_mac_shapes() {
        assert_eq!(parse_mac("02:fc:00:00:00:01"), Some([0x02, 0xfc, 0, 0, 0, 1]));
        assert_eq!(parse_mac("00:00:00:00:00:00"), None);
        assert_eq!(parse_mac("02:fc:00:00:00"), None);
        assert_eq!(parse_mac("02:fc:00:00:00:01:02"), None);
        assert_eq!(parse_mac("zz:fc:00:00:00:01"), None);
    }
}
