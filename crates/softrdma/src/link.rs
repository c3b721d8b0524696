//! The link layer: how datagrams leave and arrive, under the engine.
//!
//! The engine hands the link batches of outgoing messages ([`OutMsg`]: destination,
//! source address, TOS byte, the pieces to gather, an optional GSO segment size) and takes
//! received datagrams with their [`RecvMeta`] (source, destination and TOS byte), GRO
//! trains already split. The shape follows quinn-udp's `Transmit` and `RecvMeta`.
//!
//! Two implementations:
//! - [`UdpLink`]: UDP sockets — one per local address the device uses (its unicast
//!   address today; multicast groups and further addresses are more sockets on the same
//!   link). `sendmmsg`/`recvmmsg` batches, UDP GSO and GRO, `IP_PKTINFO`/`IPV6_RECVPKTINFO`
//!   for the destination and `IP_RECVTOS`/`IPV6_RECVTCLASS` for the TOS byte.
//! - [`MemoryLink`], attached to a [`MemoryNetwork`]: an in-process network with the
//!   simulator's seeded impairments (loss, duplication, reordering, corruption, delay), on
//!   real time, so that whole runtimes — progress threads, CQs, channels — can be tested
//!   through a bad network.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use softrdma_proto::sim::{Impairments, NetStats, Network};

use crate::sys::{self, canonical, EventFd, RecvBatch};
pub(crate) use crate::sys::{OutMsg, Sent};
use crate::{Error, Result};

/// Datagrams (or GRO trains) per receive call.
pub(crate) const RX_BATCH: usize = 32;
/// Receive buffer per datagram: room for a whole GRO train.
const RX_SLOT: usize = 65_536;

/// Where a received datagram came from and went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RecvMeta {
    /// The sender's address and port.
    pub(crate) src: SocketAddr,
    /// The local address and port it was sent to (a multicast group's, for group traffic).
    pub(crate) dst: SocketAddr,
    /// The IP TOS byte (DSCP and ECN bits) or IPv6 traffic class.
    pub(crate) tos: u8,
}

/// What one receive call found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Received {
    /// Datagrams, counting a GRO train once.
    pub(crate) datagrams: usize,
    /// Packets handed to the callback (GRO trains split).
    pub(crate) packets: u64,
    /// GRO trains of two or more packets.
    pub(crate) trains: u64,
}

/// A way to send and receive datagrams.
pub(crate) trait Link: Send + fmt::Debug {
    /// The device's own address and port.
    fn local(&self) -> SocketAddr;

    /// Receives one batch without blocking, calling `f` for every packet.
    fn recv(&mut self, f: &mut dyn FnMut(&RecvMeta, &[u8])) -> Received;

    /// Sends `msgs`; a datagram that cannot be sent is dropped, as a lossy network would.
    ///
    /// # Safety
    ///
    /// Every iovec must point to memory readable for its length during the call.
    unsafe fn send(&mut self, msgs: &mut [OutMsg]) -> Sent;

    /// Whether to build GSO trains.
    fn gso(&self) -> bool;

    /// Stops using GSO (the kernel refused a train).
    fn disable_gso(&mut self);

    /// File descriptors that become readable when datagrams arrive. They stay the same
    /// for the link's life, whatever groups it joins.
    fn fds(&self) -> Vec<RawFd>;

    /// Starts receiving datagrams sent to the multicast group `group` (at the device's
    /// port), joining it on the device's interface.
    fn join(&mut self, group: IpAddr) -> Result<()>;

    /// Stops receiving the group's datagrams.
    fn leave(&mut self, group: IpAddr);

    /// How soon the link will have something to deliver that no fd announces (the memory
    /// network's delayed datagrams); `None` for never.
    fn next_wake(&self) -> Option<Duration>;

    /// The UDP ports, besides the device's, that datagrams may leave from (see
    /// [`UdpLink::add_source_ports`]); a message whose source carries one of them goes
    /// from that port's socket.
    fn source_ports(&self) -> Vec<u16> {
        Vec::new()
    }
}

/// UDP sockets: the device's, then one per multicast group joined.
pub(crate) struct UdpLink {
    sockets: Vec<(UdpSocket, SocketAddr)>,
    rx: RecvBatch,
    gso: bool,
    /// Readable while a group socket is: what waiting threads watch for group traffic.
    groups: sys::Epoll,
    /// The device's interface index (for IPv6 group joins); 0 if unknown.
    ifindex: u32,
    /// The group sockets readable in this receive call.
    ready: Vec<RawFd>,
    /// The device socket's default TOS byte (ECT(0) where the kernel took it).
    tos: u8,
    /// Send-only sockets on the device's address, each on a port of its own: the source
    /// ports of RC and UC QPs (see [`UdpLink::add_source_ports`]).
    sources: Vec<(UdpSocket, u16)>,
    /// Alive while the link's sockets are open (the last field: it drops after them),
    /// shared by the links of one device's shards: an open of the same address waits for
    /// it to go (see [`UdpLink::open_guard`]).
    open: Arc<()>,
}

impl fmt::Debug for UdpLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdpLink").field("sockets", &self.sockets.len()).field("gso", &self.gso).finish()
    }
}

impl UdpLink {
    /// Binds the device socket on `addr` (port 0 picks one).
    pub(crate) fn bind(addr: SocketAddr) -> Result<UdpLink> {
        UdpLink::with_socket(bind(addr, false)?, Arc::new(()))
    }

    /// Gone once every socket of the link (and of the other shards' links of its device)
    /// is closed: then its address and port can be bound again.
    pub(crate) fn open_guard(&self) -> std::sync::Weak<()> {
        Arc::downgrade(&self.open)
    }

    /// Binds `n` device sockets on `addr` (port 0 picks one), one per shard of the device,
    /// in one `SO_REUSEPORT` group whose datagrams the kernel steers to the shard named
    /// by the low bits of their destination QPN (see [`sys::attach_qpn_steering`]); `n`
    /// a power of two. Returns the links in shard order; without the steering program
    /// (refused, which is logged, or not asked for) the kernel spreads datagrams by its
    /// own hash, and the shards hand each other what they were not meant to get. One
    /// socket, as [`UdpLink::bind`] makes, when `n` is 1.
    /// `steer: false` leaves the program out (to test the hand-over).
    pub(crate) fn bind_shards(addr: SocketAddr, n: usize, steer: bool) -> Result<Vec<UdpLink>> {
        if n <= 1 {
            return Ok(vec![UdpLink::bind(addr)?]);
        }
        // The address must be free: a group of another process of this user would let our
        // sockets join it. A plain bind says so (and picks the port for port 0); the group
        // binds the same port a moment later.
        let port = bind(addr, false)?.local_addr()?.port();
        let at = SocketAddr::new(addr.ip(), port);
        let open = Arc::new(());
        let links = (0..n)
            .map(|_| UdpLink::with_socket(bind(at, true)?, open.clone()))
            .collect::<Result<Vec<_>>>()?;
        if steer && !sys::attach_qpn_steering(links[0].sockets[0].0.as_raw_fd(), n as u32) {
            tracing::warn!(shards = n, "no QPN steering program: the shards hand datagrams to each other");
        }
        Ok(links)
    }

    fn with_socket(socket: UdpSocket, open: Arc<()>) -> Result<UdpLink> {
        let local = canonical(socket.local_addr()?);
        let ifindex = sys::interfaces::find(local.ip()).ok().flatten().map_or(0, |i| i.index);
        let s2 = socket2::SockRef::from(&socket);
        // Most of a device's datagrams are ECN-capable: its socket's default, so that they
        // carry no TOS control message (see `sys::send_batch`); read back, since sends
        // trust it.
        let ect0 = u32::from(sys::ECT0);
        let tos = if local.is_ipv6() {
            s2.set_tclass_v6(ect0).and_then(|()| s2.tclass_v6())
        } else {
            s2.set_tos(ect0).and_then(|()| s2.tos())
        };
        let tos = tos.ok().and_then(|t| u8::try_from(t).ok()).unwrap_or(0);
        // Multicast leaves from the device's own interface and address.
        let _ = match local.ip() {
            IpAddr::V4(v4) if !v4.is_unspecified() => s2.set_multicast_if_v4(&v4),
            IpAddr::V6(_) if ifindex != 0 => s2.set_multicast_if_v6(ifindex),
            _ => Ok(()),
        };
        Ok(UdpLink {
            sockets: vec![(socket, local)],
            rx: RecvBatch::new(RX_BATCH, RX_SLOT),
            gso: std::env::var_os("SOFTRDMA_NO_GSO").is_none(),
            groups: sys::Epoll::new()?,
            ifindex,
            ready: Vec::new(),
            tos,
            sources: Vec::new(),
            open,
        })
    }

    /// Opens `n` send-only sockets on the device's address, each on a port the kernel
    /// picks, for the QPs' source ports (RoCEv2's flow entropy: see
    /// `Endpoint::set_source_ports`). Nothing is sent to them (answers go to the device's
    /// port), so they are never read, and keep the smallest receive buffer. A port the
    /// kernel cannot give is left out (with none, QPs send from the device's port).
    pub(crate) fn add_source_ports(&mut self, n: usize) {
        let ip = self.sockets[0].1.ip();
        for _ in 0..n {
            let Ok(s) = bind_source(SocketAddr::new(ip, 0), self.tos) else { break };
            let Ok(port) = s.local_addr().map(|a| a.port()) else { break };
            self.sources.push((s, port));
        }
    }

    /// The socket `src` leaves from, and its default TOS byte: a source port's, or the
    /// device's (every datagram leaves from the device's address; group sockets only
    /// receive).
    fn socket_for(&self, src: SocketAddr) -> (RawFd, u8) {
        if src.port() != self.sockets[0].1.port() {
            if let Some((s, _)) = self.sources.iter().find(|(_, p)| *p == src.port()) {
                return (s.as_raw_fd(), self.tos);
            }
            // The endpoint's source ports are this link's (`Engine::new_shard`): a packet
            // from any other would carry an ICRC over a port it does not leave from.
            debug_assert!(false, "no socket of this link sends from port {}", src.port());
        }
        (self.sockets[0].0.as_raw_fd(), self.tos)
    }
}

impl Link for UdpLink {
    fn local(&self) -> SocketAddr {
        self.sockets[0].1
    }

    fn recv(&mut self, f: &mut dyn FnMut(&RecvMeta, &[u8])) -> Received {
        let mut got = Received::default();
        // Group sockets are read only when the epoll set says they are readable: one
        // system call for all of them, instead of one receive each on every pass.
        if self.sockets.len() > 1 {
            self.groups.ready(&mut self.ready);
        }
        for (k, (socket, local)) in self.sockets.iter().enumerate() {
            if k > 0 && !self.ready.contains(&socket.as_raw_fd()) {
                continue;
            }
            let n = self.rx.recv(socket.as_raw_fd());
            got.datagrams += n;
            for i in 0..n {
                let Some((src, anc, segments)) = self.rx.get(i) else { continue };
                let dst = canonical(SocketAddr::new(anc.dst.unwrap_or(local.ip()), local.port()));
                let meta = RecvMeta { src: canonical(src), dst, tos: anc.tos };
                let mut k = 0;
                for bytes in segments {
                    f(&meta, bytes);
                    k += 1;
                }
                got.packets += k;
                if k > 1 {
                    got.trains += 1;
                }
            }
        }
        got
    }

    unsafe fn send(&mut self, msgs: &mut [OutMsg]) -> Sent {
        let mut total = Sent::default();
        let mut at = 0;
        while at < msgs.len() {
            let (fd, tos) = self.socket_for(msgs[at].src);
            let run = msgs[at..].iter().take_while(|m| self.socket_for(m.src).0 == fd).count();
            // SAFETY: forwarded from this function's contract.
            let sent = unsafe { sys::send_batch(fd, &mut msgs[at..at + run], tos) };
            total.sent += sent.sent;
            total.gso_refused |= sent.gso_refused;
            total.too_big += sent.too_big;
            at += run;
        }
        total
    }

    fn gso(&self) -> bool {
        self.gso
    }

    fn disable_gso(&mut self) {
        self.gso = false;
    }

    fn fds(&self) -> Vec<RawFd> {
        vec![self.sockets[0].0.as_raw_fd(), self.groups.fd()]
    }

    fn join(&mut self, group: IpAddr) -> Result<()> {
        let local = self.sockets[0].1;
        if self.sockets.iter().any(|(_, l)| l.ip() == group) {
            return Ok(());
        }
        let socket = bind_group(group, local, self.ifindex)?;
        self.groups.add(socket.as_raw_fd())?;
        self.sockets.push((socket, SocketAddr::new(group, local.port())));
        Ok(())
    }

    fn leave(&mut self, group: IpAddr) {
        if let Some(k) = self.sockets.iter().skip(1).position(|(_, l)| l.ip() == group) {
            let (socket, _) = self.sockets.remove(k + 1);
            let _ = self.groups.remove(socket.as_raw_fd());
            // Closing the socket drops the membership.
        }
    }

    fn next_wake(&self) -> Option<Duration> {
        None
    }

    fn source_ports(&self) -> Vec<u16> {
        self.sources.iter().map(|&(_, p)| p).collect()
    }
}

/// A UDP socket for `addr`'s family with what every socket a device sends from needs: don't
/// fragment, IPv6 only for an IPv6 address, a send buffer of 8 MiB, non-blocking. Not bound.
fn sending_socket(addr: SocketAddr) -> Result<socket2::Socket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let domain = if addr.is_ipv4() { Domain::IPV4 } else { Domain::IPV6 };
    let s = Socket::new(domain, Type::DGRAM.cloexec(), Some(Protocol::UDP))?;
    let fd = s.as_raw_fd();
    if addr.is_ipv4() {
        sys::setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO);
    } else {
        sys::setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IP_PMTUDISC_DO);
        let _ = s.set_only_v6(true);
    }
    let _ = s.set_send_buffer_size(8 << 20);
    s.set_nonblocking(true)?;
    Ok(s)
}

/// A send-only socket on `addr` for a source port: a device socket's sending options with
/// its default TOS byte `tos`, and the smallest receive buffer.
fn bind_source(addr: SocketAddr, tos: u8) -> Result<UdpSocket> {
    let s = sending_socket(addr)?;
    if addr.is_ipv4() {
        s.set_tos(u32::from(tos))?;
    } else {
        s.set_tclass_v6(u32::from(tos))?;
    }
    let _ = s.set_recv_buffer_size(0);
    s.bind(&addr.into())?;
    Ok(s.into())
}

/// A socket that receives a multicast group's datagrams at the device's port: bound to
/// the group's address (so it gets only that group's traffic), shared with other
/// processes on the host that joined the same group (`SO_REUSEADDR`: each gets a copy),
/// joined on the device's interface. Joining needs no privilege; the kernel sends the
/// IGMP or MLD report.
fn bind_group(group: IpAddr, device: SocketAddr, ifindex: u32) -> Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let domain = if group.is_ipv4() { Domain::IPV4 } else { Domain::IPV6 };
    let s = Socket::new(domain, Type::DGRAM.cloexec(), Some(Protocol::UDP))?;
    s.set_reuse_address(true)?;
    let fd = s.as_raw_fd();
    sys::enable_recv_meta(fd, group.is_ipv6(), true);
    if std::env::var_os("SOFTRDMA_NO_GRO").is_none() {
        sys::enable_gro(fd);
    }
    if group.is_ipv6() {
        let _ = s.set_only_v6(true);
        sys::setsockopt_int(fd, libc::IPPROTO_UDP, 102 /* UDP_NO_CHECK6_RX */, 1);
    }
    grow_recv_buffer(&s);
    s.set_nonblocking(true)?;
    s.bind(&SocketAddr::new(group, device.port()).into())?;
    match (group, device.ip()) {
        (IpAddr::V4(g), IpAddr::V4(d)) => s.join_multicast_v4(&g, &d)?,
        (IpAddr::V6(g), _) => s.join_multicast_v6(&g, ifindex)?,
        (IpAddr::V4(_), IpAddr::V6(_)) => {
            return Err(Error::InvalidArgument("an IPv4 group on an IPv6 device"))
        }
    }
    Ok(s.into())
}

/// The receive buffer a device socket asks for: what arrives while no thread drains the
/// socket (a descheduled poller) waits here, and what does not fit is lost. UD has no
/// retransmission, so a burst that overflows it is gone for good: 2,000 datagrams of 4 KiB
/// (perftest's `ib_send_bw -c UD`) take about 16 MiB of kernel memory on loopback, and a
/// UD sender outruns its receiver on the same cores (the receiver copies each datagram
/// twice and checks its ICRC): `ib_send_bw -c UD -n 20000` overflowed 32 MiB in 4 runs of
/// 12, 64 MiB in none of 12 (nor `-n 200000` in 4).
const RECV_BUFFER: usize = 64 << 20;

/// Gives a socket [`RECV_BUFFER`]: beyond `net.core.rmem_max` where the process may
/// (`SO_RCVBUFFORCE`, with CAP_NET_ADMIN), else as much as `rmem_max` allows (the kernel
/// grants twice the limit it is asked, as bookkeeping room). Memory is charged only
/// for datagrams queued, not for the limit.
fn grow_recv_buffer(s: &socket2::Socket) {
    let half = libc::c_int::try_from(RECV_BUFFER / 2).unwrap_or(libc::c_int::MAX); // the kernel doubles it
    if !sys::setsockopt_int(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, half) {
        let _ = s.set_recv_buffer_size(RECV_BUFFER / 2);
    }
    if let Ok(got) = s.recv_buffer_size() {
        if got < RECV_BUFFER {
            tracing::debug!(
                bytes = got,
                "receive buffer held to net.core.rmem_max: a long burst can overflow it"
            );
        }
    }
}

/// Binds a device socket: non-blocking, DF with IP ID 0 on every datagram (so that ICRCs
/// can be computed for the header the kernel writes), big buffers, the TOS byte (and, on a
/// wildcard address, the destination address) reported with each datagram, GRO, and
/// zero-checksum UDP accepted on IPv6 (rxe sends it).
/// With `reuseport`, the socket joins the `SO_REUSEPORT` group on `addr` (a sharded
/// device's).
fn bind(addr: SocketAddr, reuseport: bool) -> Result<UdpSocket> {
    let s = sending_socket(addr)?;
    let fd = s.as_raw_fd();
    if reuseport {
        s.set_reuse_port(true)?;
    }
    if addr.is_ipv6() {
        sys::setsockopt_int(fd, libc::IPPROTO_UDP, 102 /* UDP_NO_CHECK6_RX */, 1);
    }
    // A datagram that reaches a socket bound to one unicast address was sent to that
    // address; a wildcard socket asks for each datagram's.
    sys::enable_recv_meta(fd, addr.is_ipv6(), addr.ip().is_unspecified());
    if std::env::var_os("SOFTRDMA_NO_GRO").is_none() {
        sys::enable_gro(fd);
    }
    grow_recv_buffer(&s);
    match s.bind(&addr.into()) {
        Ok(()) => Ok(s.into()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(Error::AddressInUse { addr }),
        Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => Err(Error::NoSuchDevice(addr.ip())),
        Err(e) => Err(e.into()),
    }
}

/// An in-process network between devices, with the simulator's seeded impairments on real
/// time: open devices on it with [`crate::Context::open_in`]. Cloning gives another handle
/// to the same network.
///
/// ```
/// use softrdma::{Context, MemoryNetwork};
/// use softrdma::proto::sim::Impairments;
/// let net = MemoryNetwork::new(7, Impairments::from_percent(5.0, 1.0, 2.0, 0.5));
/// let a = Context::open_in(&net, "10.0.0.1:4791".parse().unwrap())?;
/// let b = Context::open_in(&net, "10.0.0.2:4791".parse().unwrap())?;
/// # Ok::<(), softrdma::Error>(())
/// ```
#[derive(Clone)]
pub struct MemoryNetwork {
    inner: Arc<Mutex<NetInner>>,
}

struct NetInner {
    net: Network,
    epoch: Instant,
    inboxes: HashMap<SocketAddr, Arc<Inbox>>,
}

struct Inbox {
    queue: Mutex<VecDeque<(SocketAddr, SocketAddr, Vec<u8>)>>,
    signal: EventFd,
}

impl fmt::Debug for MemoryNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryNetwork").field("stats", &self.stats()).finish()
    }
}

impl MemoryNetwork {
    /// A network whose every random choice comes from `seed`.
    pub fn new(seed: u64, impairments: Impairments) -> MemoryNetwork {
        let inner =
            NetInner { net: Network::new(seed, impairments), epoch: Instant::now(), inboxes: HashMap::new() };
        MemoryNetwork { inner: Arc::new(Mutex::new(inner)) }
    }

    fn lock(&self) -> MutexGuard<'_, NetInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the network has done so far.
    pub fn stats(&self) -> NetStats {
        self.lock().net.stats()
    }

    /// Changes the impairments from now on (a clean network to finish a test, say).
    pub fn set_impairments(&self, impairments: Impairments) {
        self.lock().net.set_impairments(impairments);
    }

    /// Attaches a device at `addr`.
    pub(crate) fn attach(&self, addr: SocketAddr) -> Result<MemoryLink> {
        let addr = canonical(addr);
        let mut net = self.lock();
        if net.inboxes.contains_key(&addr) {
            return Err(Error::AddressInUse { addr });
        }
        let inbox = Arc::new(Inbox { queue: Mutex::new(VecDeque::new()), signal: EventFd::new()? });
        net.inboxes.insert(addr, inbox.clone());
        Ok(MemoryLink { net: self.clone(), local: addr, inbox, gso: true })
    }
}

impl NetInner {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Moves every datagram that is due into its receiver's inbox, and wakes the receiver.
    fn pump(&mut self) {
        let now = self.now();
        while let Some(d) = self.net.poll(now) {
            if let Some(inbox) = self.inboxes.get(&d.to) {
                inbox.queue.lock().unwrap_or_else(|p| p.into_inner()).push_back((d.from, d.to, d.bytes));
                inbox.signal.signal();
            }
        }
    }
}

/// A device's attachment to a [`MemoryNetwork`].
pub(crate) struct MemoryLink {
    net: MemoryNetwork,
    local: SocketAddr,
    inbox: Arc<Inbox>,
    gso: bool,
}

impl fmt::Debug for MemoryLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLink").field("local", &self.local).finish()
    }
}

impl Drop for MemoryLink {
    fn drop(&mut self) {
        self.net.lock().inboxes.remove(&self.local);
    }
}

impl Link for MemoryLink {
    fn local(&self) -> SocketAddr {
        self.local
    }

    fn recv(&mut self, f: &mut dyn FnMut(&RecvMeta, &[u8])) -> Received {
        self.net.lock().pump();
        self.inbox.signal.drain();
        let mut got = Received::default();
        while got.datagrams < RX_BATCH {
            let Some((src, dst, bytes)) =
                self.inbox.queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front()
            else {
                break;
            };
            f(&RecvMeta { src, dst, tos: 0 }, &bytes);
            got.datagrams += 1;
            got.packets += 1;
        }
        if got.datagrams == RX_BATCH {
            // More may wait: stay readable.
            self.inbox.signal.signal();
        }
        got
    }

    unsafe fn send(&mut self, msgs: &mut [OutMsg]) -> Sent {
        let mut net = self.net.lock();
        let now = net.now();
        for m in msgs.iter() {
            let mut bytes = Vec::new();
            for iov in &m.iov {
                // SAFETY: the caller guarantees every iovec is readable for its length.
                let piece = unsafe { std::slice::from_raw_parts(iov.iov_base as *const u8, iov.iov_len) };
                bytes.extend_from_slice(piece);
            }
            let seg = m.gso.map_or(bytes.len(), usize::from).max(1);
            for chunk in bytes.chunks(seg) {
                net.net.send(now, self.local, canonical(m.to), chunk.to_vec());
            }
        }
        net.pump();
        Sent { sent: msgs.len(), ..Sent::default() }
    }

    fn gso(&self) -> bool {
        self.gso
    }

    fn disable_gso(&mut self) {
        self.gso = false;
    }

    fn fds(&self) -> Vec<RawFd> {
        vec![self.inbox.signal.as_raw_fd()]
    }

    fn join(&mut self, _group: IpAddr) -> Result<()> {
        Err(Error::Io(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "the in-memory network has no multicast: open the device on a real address",
        )))
    }

    fn leave(&mut self, _group: IpAddr) {}

    fn next_wake(&self) -> Option<Duration> {
        let net = self.net.lock();
        let now = net.now();
        net.net.next_delivery().map(|t| t.saturating_sub(now))
    }
}
