//! `softrdma ipoib`: an IP network interface carried over softrdma, as IPoIB carries IP
//! over InfiniBand (RFC 4391 datagram mode, RFC 4755 connected mode).
//!
//! A TUN interface takes the kernel's IPv4 packets; each goes to its neighbour over
//! softrdma and comes out of the neighbour's TUN interface:
//!
//! - **datagram mode**: one UD QP; every packet is one UD SEND, so the interface MTU is
//!   the device's active MTU less the 4-byte IPoIB header (4092 on loopback, 1020 on a
//!   1500-byte Ethernet link);
//! - **connected mode**: an RC connection per neighbour, set up with the connection
//!   manager when the first packet for it comes (the IPoIB-CM idea); a packet is one RC
//!   SEND of up to 65,520 bytes, which the transport segments, so the MTU is 65520.
//!
//! Every packet starts with IPoIB's 4-byte encapsulation header (EtherType, reserved).
//! Neighbours are found as IPoIB finds them: ARP (RFC 4391's form: hardware type 32, a
//! 20-byte hardware address of QPN and GID) to a broadcast group that every interface of
//! the subnet joins, here an IP multicast group (`--group`), and the answer straight
//! back. IPv4 only; packets to the subnet's broadcast address and to multicast addresses
//! go to the broadcast group.
//!
//! Needs CAP_NET_ADMIN (the TUN interface and its address); runs until SIGINT or
//! SIGTERM and prints its counters then.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use softrdma::cm::{CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use softrdma::{
    Access, CompletionChannel, CompletionQueue, Context, MemoryRegion, ProtectionDomain, Qkey, QpBuilder,
    QpCaps, Qpn, QueuePair, RecvWr, SendFlags, SendOp, SendWr, SharedReceiveQueue, UdDest, WcOpcode,
    WcStatus,
};

/// IPoIB's encapsulation header: EtherType and two reserved bytes.
const HDR: usize = 4;
const ETH_IPV4: u16 = 0x0800;
const ETH_ARP: u16 = 0x0806;
/// The UD receive buffer's GRH area.
const GRH: usize = 40;
/// Connected mode's MTU (IPoIB-CM's).
const CM_MTU: usize = 65_520;
/// The Q_Key of the interface's UD QP and broadcast group.
const QKEY: Qkey = Qkey(0x0B1B_0000);
/// Send slots and receive buffers.
const TX_SLOTS: usize = 128;
const UD_RX: usize = 512;
const RC_RX: usize = 128;
/// Packets kept per neighbour while it is resolved or connected.
const PENDING: usize = 16;
/// How long an unanswered ARP request waits before it is sent again.
const ARP_RETRY: Duration = Duration::from_millis(200);

/// `softrdma ipoib` arguments.
#[derive(Debug, clap::Args)]
pub struct IpoibArgs {
    /// The softrdma device (underlay) address.
    #[arg(long)]
    bind: IpAddr,
    /// The interface's address and prefix length, e.g. 10.99.0.1/24.
    #[arg(long, value_parser = parse_cidr)]
    ip: (Ipv4Addr, u8),
    /// The interface's name.
    #[arg(long, default_value = "ib0")]
    name: String,
    /// Datagram (UD) or connected (RC per neighbour) mode.
    #[arg(long, value_enum, default_value = "datagram")]
    mode: Mode,
    /// The broadcast group ARP goes to (every interface of the subnet joins it).
    #[arg(long, default_value = "239.255.73.1", value_parser = parse_group)]
    group: Ipv4Addr,
    /// The rdma_cm port connected mode listens on and connects to.
    #[arg(long, default_value_t = 7481)]
    cm_port: u16,
}

/// The IPoIB mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// UD: one datagram per packet, the device's MTU.
    Datagram,
    /// RC per neighbour: one message per packet, MTU 65520.
    Connected,
}

fn parse_group(s: &str) -> Result<Ipv4Addr, String> {
    let g: Ipv4Addr = s.parse().map_err(|e| format!("{e}"))?;
    if !g.is_multicast() {
        return Err("an IPv4 multicast address (224.0.0.0/4)".into());
    }
    Ok(g)
}

fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8), String> {
    let (a, p) = s.split_once('/').ok_or("ADDRESS/PREFIX, e.g. 10.99.0.1/24")?;
    let a: Ipv4Addr = a.parse().map_err(|e| format!("{e}"))?;
    let p: u8 = p.parse().map_err(|e| format!("{e}"))?;
    if !(1..=30).contains(&p) || a.is_multicast() || a.is_broadcast() || a.is_unspecified() {
        return Err("a unicast IPv4 address with a prefix of 1 to 30".into());
    }
    Ok((a, p))
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub fn run(a: &IpoibArgs) -> i32 {
    match serve(a) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ipoib: {e}");
            1
        }
    }
}

/// Opens the TUN interface `name` (packets without a protocol header).
fn open_tun(name: &str) -> std::io::Result<File> {
    let f = OpenOptions::new().read(true).write(true).open("/dev/net/tun")?;
    let mut ifr = [0u8; 40];
    let n = name.len().min(15);
    ifr[..n].copy_from_slice(&name.as_bytes()[..n]);
    let flags: i16 = 0x0001 /* IFF_TUN */ | 0x1000 /* IFF_NO_PI */;
    ifr[16..18].copy_from_slice(&flags.to_ne_bytes());
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    // SAFETY: TUNSETIFF reads and writes a struct ifreq (40 bytes) we own.
    if unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF as _, ifr.as_mut_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(f)
}

fn ip_cmd(args: &[&str]) -> Result<(), BoxError> {
    let o = std::process::Command::new("ip").args(args).output()?;
    if !o.status.success() {
        return Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()).into());
    }
    Ok(())
}

/// Counters, printed at exit.
#[derive(Debug, Default)]
struct Counters {
    tx_packets: AtomicU64,
    tx_bytes: AtomicU64,
    rx_packets: AtomicU64,
    rx_bytes: AtomicU64,
    arp_requests: AtomicU64,
    arp_replies: AtomicU64,
    no_neighbour: AtomicU64,
    too_big: AtomicU64,
    /// IPv6 and anything else not IPv4, from the interface.
    not_ipv4: AtomicU64,
    dropped: AtomicU64,
    connections: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A neighbour: its device address (port included) and UD QPN, from ARP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Neighbour {
    addr: SocketAddr,
    qpn: Qpn,
}

/// Packets held for a destination, when ARP was last asked about it, and how often.
type Held = (Instant, u32, Vec<Vec<u8>>);
/// Destinations packets may wait for at once.
const PENDING_DESTINATIONS: usize = 256;
/// ARP requests for one destination before its held packets are dropped.
const ARP_TRIES: u32 = 5;

/// What the interface shares between its threads.
struct Ipoib {
    mode: Mode,
    me: Ipv4Addr,
    prefix: u8,
    mtu: usize,
    /// The largest datagram (header included): the group's and device's MTU.
    dgram: usize,
    group: SocketAddr,
    ctx: Context,
    pd: ProtectionDomain,
    ud: QueuePair,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    tx: Mutex<Tx>,
    neighbours: Mutex<HashMap<Ipv4Addr, Neighbour>>,
    /// Packets waiting for ARP or a connection, and when ARP was last asked.
    pending: Mutex<HashMap<Ipv4Addr, Held>>,
    /// Connected mode: the RC QP each neighbour's packets go through.
    rc: Mutex<HashMap<Ipv4Addr, Arc<QueuePair>>>,
    /// Connected mode: neighbours to connect to (for the CM thread).
    connect: Mutex<mpsc::Sender<(Ipv4Addr, Neighbour)>>,
    c: Counters,
}

/// Registered send slots, each free once its send completes.
struct Tx {
    mr: MemoryRegion,
    slot: usize,
    free: Vec<usize>,
}

impl Ipoib {
    fn subnet(&self, ip: Ipv4Addr) -> bool {
        let mask = u32::MAX << (32 - u32::from(self.prefix));
        u32::from(ip) & mask == u32::from(self.me) & mask
    }

    fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.me) | !(u32::MAX << (32 - u32::from(self.prefix))))
    }

    /// Takes back the slots of completed sends; waits for one if none is free.
    fn slot(&self, tx: &mut Tx) -> Option<usize> {
        loop {
            let mut wcs = [softrdma::EMPTY_WC; 32];
            let n = self.send_cq.poll(&mut wcs);
            for wc in &wcs[..n] {
                if wc.status != WcStatus::Success && wc.status != WcStatus::WrFlushErr {
                    add(&self.c.dropped, 1);
                }
                tx.free.push(wc.wr_id as usize);
            }
            if let Some(s) = tx.free.pop() {
                return Some(s);
            }
            let wc = self.send_cq.wait_one_timeout(Duration::from_secs(1))?;
            tx.free.push(wc.wr_id as usize);
        }
    }

    /// Sends one packet (EtherType `kind`) on `qp`, to `ud` for datagrams.
    fn send(&self, qp: &QueuePair, ud: Option<UdDest>, kind: u16, pkt: &[u8]) -> bool {
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(s) = self.slot(&mut tx) else {
            add(&self.c.dropped, 1);
            return false;
        };
        let at = s * tx.slot;
        let mut hdr = [0u8; HDR];
        hdr[..2].copy_from_slice(&kind.to_be_bytes());
        let ok = tx.mr.write(at, &hdr).is_ok() && tx.mr.write(at + HDR, pkt).is_ok();
        let sge = tx.mr.sge(at, HDR + pkt.len());
        let wr = sge.ok().filter(|_| ok).map(|sge| SendWr {
            wr_id: s as u64,
            op: SendOp::Send,
            sg_list: softrdma::sgl![sge],
            flags: SendFlags { signaled: true, ..Default::default() },
            ud,
        });
        match wr.map(|wr| qp.post_send(wr)) {
            Some(Ok(())) => true,
            _ => {
                tx.free.push(s);
                add(&self.c.dropped, 1);
                false
            }
        }
    }

    /// Sends a UD datagram to a neighbour or the group.
    fn send_ud(&self, to: Neighbour, kind: u16, pkt: &[u8]) -> bool {
        let dest = UdDest { addr: to.addr, qpn: to.qpn, qkey: QKEY, traffic_class: 0 };
        self.send(&self.ud, Some(dest), kind, pkt)
    }

    fn to_group(&self) -> Neighbour {
        Neighbour { addr: self.group, qpn: Qpn::MULTICAST }
    }

    /// An IPv4 packet from the interface.
    fn outgoing(&self, pkt: &[u8]) {
        if pkt.len() < 20 || pkt[0] >> 4 != 4 {
            add(&self.c.not_ipv4, 1);
            return;
        }
        if pkt.len() > self.mtu {
            add(&self.c.too_big, 1);
            return;
        }
        let dst = Ipv4Addr::new(pkt[16], pkt[17], pkt[18], pkt[19]);
        if dst.is_multicast() || dst == self.broadcast() || dst.is_broadcast() {
            if pkt.len() + HDR <= self.ud_mtu() && self.send_ud(self.to_group(), ETH_IPV4, pkt) {
                self.sent(pkt.len());
            }
            return;
        }
        if !self.subnet(dst) {
            add(&self.c.no_neighbour, 1);
            return;
        }
        let neighbour = self.neighbours.lock().unwrap_or_else(|p| p.into_inner()).get(&dst).copied();
        match (self.mode, neighbour) {
            (Mode::Datagram, Some(n)) => {
                if self.send_ud(n, ETH_IPV4, pkt) {
                    self.sent(pkt.len());
                }
            }
            (Mode::Connected, Some(n)) => {
                let rc = self.rc.lock().unwrap_or_else(|p| p.into_inner()).get(&dst).cloned();
                match rc {
                    Some(qp) => {
                        if self.send(&qp, None, ETH_IPV4, pkt) {
                            self.sent(pkt.len());
                        }
                    }
                    None => {
                        self.hold(dst, pkt);
                        let _ = self.connect.lock().unwrap_or_else(|p| p.into_inner()).send((dst, n));
                    }
                }
            }
            (_, None) => {
                if self.hold(dst, pkt) {
                    self.arp(1, dst, None);
                }
            }
        }
    }

    fn sent(&self, bytes: usize) {
        add(&self.c.tx_packets, 1);
        add(&self.c.tx_bytes, bytes as u64);
    }

    /// Keeps a packet for `dst` (at most PENDING per destination, PENDING_DESTINATIONS
    /// destinations); true if it is time to ask ARP (again). After ARP_TRIES unanswered
    /// requests the held packets are dropped, and the next packet starts over.
    fn hold(&self, dst: Ipv4Addr, pkt: &[u8]) -> bool {
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if !p.contains_key(&dst) && p.len() >= PENDING_DESTINATIONS {
            add(&self.c.no_neighbour, 1);
            return false;
        }
        let e = p.entry(dst).or_insert((now - ARP_RETRY * 2, 0, Vec::new()));
        if e.2.len() < PENDING {
            e.2.push(pkt.to_vec());
        } else {
            add(&self.c.no_neighbour, 1);
        }
        if now.duration_since(e.0) < ARP_RETRY {
            return false;
        }
        if e.1 >= ARP_TRIES {
            add(&self.c.no_neighbour, e.2.len() as u64);
            p.remove(&dst);
            return false;
        }
        e.0 = now;
        e.1 += 1;
        true
    }

    /// Sends the packets held for `dst` (its neighbour, or its connection, is known now).
    fn release(&self, dst: Ipv4Addr) {
        let held = self.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&dst);
        for pkt in held.map(|(_, _, v)| v).unwrap_or_default() {
            self.outgoing(&pkt);
        }
    }

    /// The largest payload (header included) a UD datagram carries.
    fn ud_mtu(&self) -> usize {
        self.dgram
    }

    /// Our hardware address: flags and QPN, then the GID.
    fn hw(&self) -> [u8; 20] {
        let mut hw = [0u8; 20];
        hw[..4].copy_from_slice(&self.ud.qpn().get().to_be_bytes());
        hw[4..].copy_from_slice(&softrdma::gid_of(self.ctx.local_addr().ip()));
        hw
    }

    /// ARP (RFC 4391, section 8): a request to the group, or a reply to `to`.
    fn arp(&self, op: u16, target: Ipv4Addr, to: Option<(Neighbour, [u8; 20])>) {
        let mut a = Vec::with_capacity(56);
        a.extend_from_slice(&32u16.to_be_bytes()); // hardware type: InfiniBand
        a.extend_from_slice(&ETH_IPV4.to_be_bytes());
        a.extend_from_slice(&[20, 4]);
        a.extend_from_slice(&op.to_be_bytes());
        a.extend_from_slice(&self.hw());
        a.extend_from_slice(&self.me.octets());
        a.extend_from_slice(&to.map_or([0; 20], |(_, hw)| hw));
        a.extend_from_slice(&target.octets());
        let dest = to.map_or(self.to_group(), |(n, _)| n);
        if self.send_ud(dest, ETH_ARP, &a) {
            add(if op == 1 { &self.c.arp_requests } else { &self.c.arp_replies }, 1);
        }
    }

    /// An ARP packet from the wire.
    fn arp_in(&self, a: &[u8], port: u16) {
        if a.len() < 56 || a[..2] != 32u16.to_be_bytes() || a[4..6] != [20, 4] {
            add(&self.c.dropped, 1);
            return;
        }
        let op = u16::from_be_bytes([a[6], a[7]]);
        let hw: [u8; 20] = a[8..28].try_into().expect("20 bytes");
        let sender_ip = Ipv4Addr::new(a[28], a[29], a[30], a[31]);
        let target_ip = Ipv4Addr::new(a[52], a[53], a[54], a[55]);
        let gid: [u8; 16] = hw[4..].try_into().expect("16 bytes");
        let n = Neighbour {
            addr: SocketAddr::new(softrdma::addr_of_gid(gid), port),
            qpn: Qpn::new(u32::from_be_bytes(hw[..4].try_into().expect("4 bytes"))),
        };
        if sender_ip == self.me || !self.subnet(sender_ip) {
            return;
        }
        self.neighbours.lock().unwrap_or_else(|p| p.into_inner()).insert(sender_ip, n);
        if op == 1 && target_ip == self.me {
            self.arp(2, sender_ip, Some((n, hw)));
        }
        self.release(sender_ip);
    }

    /// A packet from the wire: to the interface, or to ARP.
    fn incoming(&self, tun: &mut File, bytes: &[u8], port: u16) {
        if bytes.len() < HDR {
            add(&self.c.dropped, 1);
            return;
        }
        let (hdr, pkt) = bytes.split_at(HDR);
        match u16::from_be_bytes([hdr[0], hdr[1]]) {
            ETH_IPV4 => {
                if tun.write_all(pkt).is_ok() {
                    add(&self.c.rx_packets, 1);
                    add(&self.c.rx_bytes, pkt.len() as u64);
                } else {
                    add(&self.c.dropped, 1);
                }
            }
            ETH_ARP => self.arp_in(pkt, port),
            _ => add(&self.c.dropped, 1),
        }
    }
}

/// The receive side: UD buffers (GRH area first) and, in connected mode, the SRQ's.
struct Rx {
    ud_mr: MemoryRegion,
    ud_slot: usize,
    srq: Option<(SharedReceiveQueue, MemoryRegion)>,
}

const SRQ_TAG: u64 = 1 << 63;

impl Rx {
    fn post_ud(&self, ud: &QueuePair, k: usize) -> softrdma::Result<()> {
        ud.post_recv(RecvWr {
            wr_id: k as u64,
            sg_list: softrdma::sgl![self.ud_mr.sge(k * self.ud_slot, self.ud_slot)?],
        })
    }

    fn post_srq(&self, k: usize) -> softrdma::Result<()> {
        let Some((srq, mr)) = &self.srq else { return Ok(()) };
        srq.post_recv(RecvWr {
            wr_id: SRQ_TAG | k as u64,
            sg_list: softrdma::sgl![mr.sge(k * (HDR + CM_MTU), HDR + CM_MTU)?],
        })
    }
}

fn serve(a: &IpoibArgs) -> Result<(), BoxError> {
    // Signals end the interface: blocked here, in every thread, and awaited at the end.
    // SAFETY: sigset operations on a local set, then the calling thread's mask.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let ctx = Context::open(a.bind)?;
    let port = ctx.local_addr().port();
    let pd = ctx.alloc_pd();
    let channel = ctx.create_channel()?;
    let send_cq = ctx.create_cq(TX_SLOTS * 2, None)?;
    let recv_cq = ctx.create_cq(UD_RX + RC_RX + 64, Some(&channel))?;
    let caps = QpCaps { max_send_wr: TX_SLOTS as u32, max_recv_wr: UD_RX as u32, ..QpCaps::default() };
    let ud = pd.prepare_qp(&QpBuilder::ud(QKEY).caps(caps), &send_cq, &recv_cq)?.ready()?;
    // The broadcast group's MTU (its first member's) bounds every datagram, as IPoIB's
    // broadcast group sets the interface MTU.
    let group_mtu = ud.attach_mcast(a.group.into())?.bytes() as usize;
    let ud_mtu = ctx.device().active_mtu().bytes() as usize;
    let mtu = match a.mode {
        Mode::Datagram => group_mtu.min(ud_mtu) - HDR,
        Mode::Connected => CM_MTU,
    };
    let slot = HDR + mtu;
    let tx_mr = pd.register(TX_SLOTS * slot, Access::LOCAL_WRITE)?;
    let ud_slot = GRH + ud_mtu;
    let rx = Arc::new(Rx {
        ud_mr: pd.register(UD_RX * ud_slot, Access::LOCAL_WRITE)?,
        ud_slot,
        srq: match a.mode {
            Mode::Connected => Some((
                pd.create_srq(RC_RX as u32, 1)?,
                pd.register(RC_RX * (HDR + CM_MTU), Access::LOCAL_WRITE)?,
            )),
            Mode::Datagram => None,
        },
    });
    for k in 0..UD_RX {
        rx.post_ud(&ud, k)?;
    }
    for k in 0..RC_RX {
        rx.post_srq(k)?;
    }

    let tun = open_tun(&a.name)?;
    let (ip, prefix) = a.ip;
    ip_cmd(&["link", "set", "dev", &a.name, "mtu", &mtu.to_string()])?;
    ip_cmd(&["addr", "add", &format!("{ip}/{prefix}"), "dev", &a.name])?;
    ip_cmd(&["link", "set", "dev", &a.name, "up"])?;

    let (connect_tx, connect_rx) = mpsc::channel();
    let me = Arc::new(Ipoib {
        mode: a.mode,
        me: ip,
        prefix,
        mtu,
        dgram: group_mtu.min(ud_mtu),
        group: SocketAddr::new(a.group.into(), port),
        ctx,
        pd,
        ud,
        send_cq,
        recv_cq: recv_cq.clone(),
        tx: Mutex::new(Tx { mr: tx_mr, slot, free: (0..TX_SLOTS).collect() }),
        neighbours: Mutex::new(HashMap::new()),
        pending: Mutex::new(HashMap::new()),
        rc: Mutex::new(HashMap::new()),
        connect: Mutex::new(connect_tx),
        c: Counters::default(),
    });
    let stop = Arc::new(AtomicBool::new(false));

    // Interface to wire.
    let mut tun_in = tun.try_clone()?;
    let m = me.clone();
    std::thread::Builder::new().name("ipoib-tx".into()).spawn(move || {
        let mut buf = vec![0u8; CM_MTU + 1];
        while let Ok(n) = tun_in.read(&mut buf) {
            m.outgoing(&buf[..n]);
        }
    })?;
    // Wire to interface.
    let mut tun_out = tun;
    let (m, s, r) = (me.clone(), stop.clone(), rx.clone());
    std::thread::Builder::new()
        .name("ipoib-rx".into())
        .spawn(move || receive(&m, &r, &recv_cq, &channel, &mut tun_out, port, &s))?;
    // Connected mode's connections.
    if a.mode == Mode::Connected {
        let (m, s, cm_port) = (me.clone(), stop.clone(), a.cm_port);
        std::thread::Builder::new()
            .name("ipoib-cm".into())
            .spawn(move || connections(&m, &rx, cm_port, &connect_rx, &s))?;
    }
    println!("{}: {ip}/{prefix} over {} ({:?} mode, MTU {mtu})", a.name, me.ctx.local_addr(), a.mode);
    std::io::stdout().flush()?;

    let mut sig = 0;
    // SAFETY: waits for one of the blocked signals of `set`.
    unsafe { libc::sigwait(&set, &mut sig) };
    stop.store(true, Ordering::Release);
    let c = &me.c;
    let g = |x: &AtomicU64| x.load(Ordering::Relaxed);
    println!(
        "{}: tx {} packets {} bytes, rx {} packets {} bytes, arp {} requests {} replies, connections {}, \
         not IPv4 {}, dropped {} (no neighbour {}, too big {})",
        a.name,
        g(&c.tx_packets),
        g(&c.tx_bytes),
        g(&c.rx_packets),
        g(&c.rx_bytes),
        g(&c.arp_requests),
        g(&c.arp_replies),
        g(&c.connections),
        g(&c.not_ipv4),
        g(&c.dropped),
        g(&c.no_neighbour),
        g(&c.too_big),
    );
    std::io::stdout().flush()?;
    std::process::exit(0)
}

fn receive(
    me: &Ipoib,
    rx: &Rx,
    cq: &CompletionQueue,
    channel: &CompletionChannel,
    tun: &mut File,
    port: u16,
    stop: &AtomicBool,
) {
    let mut wcs = [softrdma::EMPTY_WC; 32];
    let mut buf = vec![0u8; HDR + CM_MTU];
    while !stop.load(Ordering::Acquire) {
        let n = cq.poll(&mut wcs);
        if n == 0 {
            let _ = cq.req_notify(false);
            if cq.poll(&mut wcs[..1]) == 0 {
                if let Ok(Some(_)) = channel.get_event_timeout(Duration::from_millis(200)) {
                    channel.ack_events(1);
                }
                continue;
            }
            // One came between the poll and the arming: handle it below.
            let wc = wcs[0];
            handle(me, rx, &wc, &mut buf, tun, port);
            continue;
        }
        for wc in &wcs[..n] {
            handle(me, rx, wc, &mut buf, tun, port);
        }
    }
}

fn handle(me: &Ipoib, rx: &Rx, wc: &softrdma::WorkCompletion, buf: &mut [u8], tun: &mut File, port: u16) {
    if wc.opcode != WcOpcode::Recv && wc.status == WcStatus::Success {
        return;
    }
    let srq = wc.wr_id & SRQ_TAG != 0;
    let k = (wc.wr_id & !SRQ_TAG) as usize;
    if wc.status == WcStatus::Success {
        let len = wc.byte_len as usize;
        let got = if srq {
            rx.srq
                .as_ref()
                .and_then(|(_, mr)| mr.read(k * (HDR + CM_MTU), &mut buf[..len]).ok())
                .map(|()| &buf[..len])
        } else {
            let body = len.saturating_sub(GRH);
            rx.ud_mr.read(k * rx.ud_slot + GRH, &mut buf[..body]).ok().map(|()| &buf[..body])
        };
        match got {
            Some(bytes) => me.incoming(tun, bytes, port),
            None => add(&me.c.dropped, 1),
        }
    } else if wc.status != WcStatus::WrFlushErr {
        add(&me.c.dropped, 1);
    }
    let reposted = if srq { rx.post_srq(k) } else { rx.post_ud(&me.ud, k) };
    if reposted.is_err() {
        add(&me.c.dropped, 1);
    }
}

/// Connected mode: listens for neighbours' connections and makes the ones the interface
/// asks for; each connection's QP takes its receives from the SRQ. Both sides may connect
/// at once: each sends on the first of its connections to a neighbour that is
/// established, and receives on all of them.
fn connections(
    me: &Ipoib,
    rx: &Rx,
    cm_port: u16,
    asks: &mpsc::Receiver<(Ipv4Addr, Neighbour)>,
    stop: &AtomicBool,
) {
    let Some((srq, _)) = &rx.srq else { return };
    let fail = |what: &str, e: &dyn std::fmt::Display| eprintln!("ipoib: {what}: {e}");
    let ch = match EventChannel::new() {
        Ok(c) => c,
        Err(e) => return fail("event channel", &e),
    };
    let listener = CmId::new(&ch, PortSpace::Tcp);
    let at = SocketAddr::new(me.ctx.local_addr().ip(), cm_port);
    if let Err(e) = listener.bind_addr(at).and_then(|()| listener.listen(64)) {
        return fail("listening for connections", &e);
    }
    let builder = QpBuilder::rc().srq(srq).caps(QpCaps {
        max_send_wr: TX_SLOTS as u32,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    });
    let mine = me.me.octets().to_vec();
    // Every connection's ID, with the neighbour it goes to.
    let mut ids: Vec<(CmId, Ipv4Addr)> = Vec::new();
    let wait = Duration::from_secs(2);
    while !stop.load(Ordering::Acquire) {
        while let Ok((ip, n)) = asks.try_recv() {
            let connected = me.rc.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&ip);
            if connected || ids.iter().any(|(_, i)| *i == ip) {
                continue;
            }
            let id = CmId::new(&ch, PortSpace::Tcp);
            if let Err(e) = id.resolve_addr(Some(at.ip()), SocketAddr::new(n.addr.ip(), cm_port), wait) {
                fail("connecting", &e);
                continue;
            }
            ids.push((id, ip));
        }
        let Some(ev) = ch.get_event_timeout(Duration::from_millis(20)) else { continue };
        let peer = ids.iter().find(|(i, _)| i.same(&ev.id)).map(|(_, ip)| *ip);
        let forget = |ids: &mut Vec<(CmId, Ipv4Addr)>| ids.retain(|(i, _)| !i.same(&ev.id));
        let r: softrdma::Result<()> = match ev.kind {
            CmEventKind::AddrResolved => ev.id.resolve_route(wait),
            CmEventKind::RouteResolved => {
                ev.id.create_qp(&me.pd, &builder, &me.send_cq, &me.recv_cq).and_then(|_| {
                    ev.id.connect(&ConnParam { private_data: mine.clone(), ..ConnParam::default() })
                })
            }
            CmEventKind::ConnectRequest => {
                let pd = &ev.param.private_data;
                match pd.get(..4).map(|b| Ipv4Addr::new(b[0], b[1], b[2], b[3])) {
                    Some(ip) if me.subnet(ip) => {
                        ids.push((ev.id.clone(), ip));
                        ev.id.create_qp(&me.pd, &builder, &me.send_cq, &me.recv_cq).and_then(|_| {
                            ev.id.accept(&ConnParam { private_data: mine.clone(), ..ConnParam::default() })
                        })
                    }
                    _ => ev.id.reject(b"not an IPoIB peer of this subnet"),
                }
            }
            CmEventKind::Established => {
                if let (Some(ip), Some(qp)) = (peer, ev.id.qp()) {
                    // A neighbour's first connection, or one replacing a connection that
                    // failed (a peer that went away without a DREQ and came back).
                    let mut rc = me.rc.lock().unwrap_or_else(|p| p.into_inner());
                    let alive = rc.get(&ip).is_some_and(|q| q.state() == softrdma::QpState::Rts);
                    if !alive {
                        rc.insert(ip, qp);
                    }
                    drop(rc);
                    add(&me.c.connections, 1);
                    me.release(ip);
                }
                Ok(())
            }
            CmEventKind::Disconnected => {
                if let (Some(ip), Some(qp)) = (peer, ev.id.qp()) {
                    let mut rc = me.rc.lock().unwrap_or_else(|p| p.into_inner());
                    if rc.get(&ip).is_some_and(|q| Arc::ptr_eq(q, &qp)) {
                        rc.remove(&ip);
                        // Another connection to the same neighbour (both sides connected
                        // at once) takes over.
                        let other = ids
                            .iter()
                            .filter(|(i, n)| *n == ip && !i.same(&ev.id))
                            .filter_map(|(i, _)| i.qp())
                            .find(|q| q.state() == softrdma::QpState::Rts);
                        if let Some(q) = other {
                            rc.insert(ip, q);
                        }
                    }
                }
                forget(&mut ids);
                Ok(())
            }
            CmEventKind::Rejected
            | CmEventKind::Unreachable
            | CmEventKind::ConnectError
            | CmEventKind::AddrError
            | CmEventKind::RouteError => {
                fail("a connection failed", &ev.kind.name());
                forget(&mut ids);
                Ok(())
            }
            _ => Ok(()),
        };
        if let Err(e) = r {
            fail("connection", &e);
            forget(&mut ids);
        }
    }
}
