//! Opened contexts (`ibv_context`).
//!
//! Opening a device binds a UDP socket on its address, port 4791 unless `SOFTRDMA_PORT` or
//! [`Context::open_port`] says otherwise, and starts the device's progress thread. Opening
//! the same address and port twice in one process returns the same context.
//! [`Context::open_in`] opens a device on an in-process [`MemoryNetwork`] instead.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use softrdma_proto::memory::PdId;

use crate::cq::{CompletionChannel, CompletionQueue, CqOptions};
use crate::device::{default_port, find_device, ContextInner, Device, DeviceAttr, GidEntry, PortAttr};
use crate::engine::{AsyncEvent, Engine};
use crate::link::{Link, MemoryNetwork, UdpLink};
use crate::pd::ProtectionDomain;
use crate::Result;

/// The contexts this process has open, by bound address, each with its engine: a
/// context whose last handle is gone may still be closing (its progress thread being
/// joined, its socket not yet closed) while its engine lives.
/// The third part is gone once the context's sockets are closed (`UdpLink::open_guard`):
/// an entry stays until then, so that an open of the same address waits for the close.
type Opened = HashMap<SocketAddr, (Weak<ContextInner>, Weak<Engine>, Weak<()>)>;

fn opened() -> &'static Mutex<Opened> {
    static OPENED: OnceLock<Mutex<Opened>> = OnceLock::new();
    OPENED.get_or_init(Default::default)
}

/// How long opening an address waits for this process's previous context on it to
/// finish closing.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// Binds `want`. If this process's previous context on it was closing (its sockets are
/// closed by now, or [`CLOSE_WAIT`] passed), allow a moment more; a port still taken then is
/// someone else's.
fn bind_after_close(want: SocketAddr, closing: Option<Weak<()>>, shards: Shards) -> Result<Vec<UdpLink>> {
    let since = Instant::now();
    loop {
        match UdpLink::bind_shards(want, shards.count, shards.steer) {
            Err(e @ crate::Error::AddressInUse { .. }) => {
                let Some(sockets) = &closing else { return Err(e) };
                if sockets.strong_count() > 0 || since.elapsed() > Duration::from_millis(50) {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            r => return r,
        }
    }
}

/// Has the process, when it exits, send the ACKs its open devices still hold back (see
/// [`Engine::release_all_acks`]): a program that receives its last message and exits
/// without closing anything would otherwise leave its peer without the ACK of that
/// message, and the peer's send would end in RETRY_EXC_ERR. Registered once, with
/// `atexit`, so it runs on `exit` and on a return from `main` (not on `_exit` or a signal).
fn release_acks_at_exit() {
    extern "C" fn at_exit() {
        // Not in a forked child that opened nothing of its own: the devices it inherited
        // are not its to speak for.
        if EXIT_PID.load(std::sync::atomic::Ordering::Relaxed) != std::process::id() {
            return;
        }
        // Nothing may unwind out of an atexit handler; an exit goes on whatever happens.
        let _ = std::panic::catch_unwind(|| {
            // Never block the exit on a table some thread holds.
            let Ok(table) = opened().try_lock() else { return };
            let engines: Vec<Arc<Engine>> = table.values().filter_map(|(_, e, _)| e.upgrade()).collect();
            drop(table);
            for e in engines {
                e.release_all_acks();
            }
        });
    }
    // The process that opened a device last (a forked child that opens its own takes over).
    EXIT_PID.store(std::process::id(), std::sync::atomic::Ordering::Relaxed);
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a function with no arguments that touches only process-wide
        // state that lives as long as the process (the table, engines it keeps alive).
        unsafe { libc::atexit(at_exit) };
    });
}

/// The process whose devices the exit hook speaks for (see `release_acks_at_exit`).
static EXIT_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// How to shard a device being opened.
#[derive(Debug, Clone, Copy)]
struct Shards {
    count: usize,
    steer: bool,
    /// UDP source ports for RC and UC QPs, all shards together (see
    /// [`Context::open_source_ports`]); `None`: `SOFTRDMA_SOURCE_PORTS`, or one per shard.
    source_ports: Option<usize>,
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

    /// Opens a device found by name or address, binding its GID `gid_index` (what
    /// perftest's `-x` and the pingpongs' `-g` choose), on UDP `port` (0 picks one).
    pub fn open_gid(name_or_addr: &str, gid_index: u32, port: u16) -> Result<Context> {
        let d = find_device(name_or_addr)?.with_gid(gid_index)?;
        Context::open_device(d, port)
    }

    /// Opens the device of `addr`, binding UDP `port` (0 picks a free port).
    pub fn open_port(addr: IpAddr, port: u16) -> Result<Context> {
        Context::open_device(find_device(&addr.to_string())?, port)
    }

    /// Opens `device` as described: its GID `gid_index` (which must hold `addr`), on UDP
    /// `port` (0 picks one). For callers that edit a device's description first (see
    /// [`Device::with_gid0`]).
    pub fn open_device(device: Device, port: u16) -> Result<Context> {
        Context::open_with(
            device,
            port,
            Shards { count: crate::device::shards_env(), steer: true, source_ports: None },
        )
    }

    /// Opens the device of `addr` on UDP `port` (0 picks one) with `shards` shards: engines
    /// that each own a share of the device's RC and UC QPs, with a socket of their own on
    /// the device's address and port (one `SO_REUSEPORT` group, whose datagrams the kernel
    /// steers to the shard of their destination QP) and a progress thread of their own, so
    /// that QPs spread over cores. `shards` must be a power of two, at most 64; 1 is
    /// [`Context::open_port`]'s device. UD QPs, QPs on an SRQ and the connection manager
    /// stay on shard 0. `SOFTRDMA_SHARDS` sets the count for every device a process opens
    /// otherwise. Opening an address this process has open already returns that context,
    /// whatever its shards.
    pub fn open_sharded(addr: IpAddr, port: u16, shards: usize) -> Result<Context> {
        Context::open_shards(addr, port, Shards { count: shards, steer: true, source_ports: None })
    }

    /// [`Context::open_sharded`] whose RC and UC QPs send from `source_ports` UDP ports of
    /// their own (at most 64, shared out among the shards, one each at least; 0: from the
    /// device's port), picked by a hash of the QP number: RoCEv2's flow entropy (IBTA Annex
    /// A17.3.1), which switches and a receiving NIC hash to spread QPs over paths and
    /// receive queues, as Linux rxe and RoCE NICs give each QP a port of its own. Answers
    /// still come to the device's port. Without this call, `SOFTRDMA_SOURCE_PORTS` sets the
    /// number, and a sharded device sends from one port per shard, an unsharded one from
    /// its own port: QPs on different ports cannot share a GSO train or a `sendmmsg` call,
    /// which costs an unsharded device with many busy QPs (see the README's "Source
    /// ports"). Opening an address this process has open already returns that context,
    /// whatever its shards and source ports.
    pub fn open_source_ports(addr: IpAddr, port: u16, shards: usize, source_ports: usize) -> Result<Context> {
        Context::open_shards(
            addr,
            port,
            Shards {
                count: shards,
                steer: true,
                source_ports: Some(source_ports.min(crate::device::MAX_SOURCE_PORTS)),
            },
        )
    }

    /// [`Context::open_sharded`] without the kernel's steering program: the kernel spreads
    /// datagrams by its own hash and the shards hand each other what they were not meant to
    /// get. For tests of that hand-over (a GRO train that merged packets of several QPs
    /// takes the same path).
    #[doc(hidden)]
    pub fn open_sharded_unsteered(addr: IpAddr, port: u16, shards: usize) -> Result<Context> {
        Context::open_shards(addr, port, Shards { count: shards, steer: false, source_ports: None })
    }

    fn open_shards(addr: IpAddr, port: u16, shards: Shards) -> Result<Context> {
        if !shards.count.is_power_of_two() || shards.count > crate::device::MAX_SHARDS {
            return Err(crate::Error::InvalidArgument("shards must be a power of two, at most 64"));
        }
        Context::open_with(find_device(&addr.to_string())?, port, shards)
    }

    fn open_with(device: Device, port: u16, shards: Shards) -> Result<Context> {
        if device.gids.get(device.gid_index as usize).map(|g| g.addr) != Some(device.addr) {
            return Err(crate::Error::InvalidArgument("the device's address is not its GID gid_index"));
        }
        let want = SocketAddr::new(device.addr, port);
        let lookup = |table: &Opened| match table.get(&want) {
            Some((inner, _, sockets)) if port != 0 => match inner.upgrade() {
                Some(inner) => Ok(Context { inner }),
                None => Err(Some(sockets.clone())),
            },
            _ => Err(None),
        };
        // A previous context on this address still closing: wait for its sockets to close,
        // without the table (other opens go on meanwhile), then look again (another
        // thread may have opened, or closed, it since).
        let deadline = Instant::now() + CLOSE_WAIT;
        let (mut table, closing) = loop {
            let table = opened().lock().unwrap_or_else(|p| p.into_inner());
            match lookup(&table) {
                Ok(ctx) => return Ok(ctx),
                Err(Some(sockets)) if sockets.strong_count() > 0 && Instant::now() < deadline => {
                    drop(table);
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(closing) => break (table, closing),
            }
        };
        let mut links = bind_after_close(want, closing, shards)?;
        let ports =
            shards.source_ports.or_else(crate::device::source_ports_env).unwrap_or(match links.len() {
                1 => 0,
                n => n,
            });
        let each = ports.div_ceil(links.len());
        for link in &mut links {
            link.add_source_ports(each);
        }
        let local = links[0].local();
        let sockets = links[0].open_guard();
        let count = links.len() as u32;
        let mut engines: Vec<Engine> = Vec::with_capacity(links.len());
        for (k, link) in links.into_iter().enumerate() {
            let e = Engine::new_shard(Box::new(link), k as u32, count, engines.first())?;
            engines.push(e);
        }
        let inner = Arc::new(ContextInner::start(engines, device)?);
        // Entries go once their sockets are closed: an entry removed while its engine was
        // still dropping (its socket open) let an open of its address fail at once, where
        // it should have waited (seen when another thread opened another address then).
        table.retain(|_, (_, _, sockets)| sockets.strong_count() > 0);
        table.insert(local, (Arc::downgrade(&inner), Arc::downgrade(&inner.engine), sockets));
        release_acks_at_exit();
        Ok(Context { inner })
    }

    /// Opens a device at `addr` on an in-process [`MemoryNetwork`]: a whole runtime —
    /// progress thread, CQs, channels — whose packets cross the network's impairments
    /// instead of UDP sockets. Its device is named `srdma_mem_<address>` and has a
    /// 4096-byte MTU.
    pub fn open_in(net: &MemoryNetwork, addr: SocketAddr) -> Result<Context> {
        let link = net.attach(addr)?;
        let device = Device::in_memory(link.local().ip());
        Ok(Context { inner: Arc::new(ContextInner::start(vec![Engine::new(Box::new(link))?], device)?) })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The address and UDP port the device is bound to: what peers send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.engine.local()
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
        CompletionQueue::new(self.inner.clone(), cqe, channel, CqOptions::default())
    }

    /// [`Self::create_cq`] with options (completion timestamps).
    pub fn create_cq_with(
        &self,
        cqe: usize,
        channel: Option<&CompletionChannel>,
        opts: CqOptions,
    ) -> Result<CompletionQueue> {
        CompletionQueue::new(self.inner.clone(), cqe, channel, opts)
    }

    /// Creates a completion channel.
    pub fn create_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new(self.inner.clone())
    }

    /// The next asynchronous event, if any (CQ overrun, QP fatal, port active).
    pub fn poll_async_event(&self) -> Option<AsyncEvent> {
        self.inner.engine.pop_async_event()
    }

    /// A file descriptor that is readable while an asynchronous event waits for
    /// [`Self::poll_async_event`] (`ibv_context.async_fd`).
    pub fn async_fd(&self) -> std::os::fd::RawFd {
        self.inner.engine.async_fd()
    }

    /// Writes every RoCEv2 datagram this device sends and receives from now on to a new
    /// pcapng file at `path`, stopping at `max_bytes` (what `SOFTRDMA_PCAP` does for every
    /// device of the process; see the README's "Debugging").
    pub fn capture_to(&self, path: impl AsRef<std::path::Path>, max_bytes: u64) -> crate::Result<()> {
        let c = crate::capture::Capture::create(path.as_ref(), max_bytes)?;
        let c = std::sync::Arc::new(std::sync::Mutex::new(c));
        for e in &self.inner.shards {
            e.set_capture(Some(c.clone()));
        }
        Ok(())
    }

    /// Stops [`Self::capture_to`]'s capture (and `SOFTRDMA_PCAP`'s, for this device), and
    /// closes the file once no device writes to it.
    pub fn stop_capture(&self) {
        for e in &self.inner.shards {
            e.set_capture(None);
        }
    }

    /// How the link goes back to the progress thread when a thread that waited on a
    /// completion channel leaves with its event (see [`crate::EventWake`]; every shard).
    pub fn set_event_wake(&self, wake: crate::EventWake) {
        for e in &self.inner.shards {
            e.set_event_wake(wake);
        }
    }

    /// The device's [`crate::EventWake`].
    pub fn event_wake(&self) -> crate::EventWake {
        self.inner.shards[0].event_wake()
    }

    /// Socket-level counters (batches, GSO and GRO trains), all shards together.
    pub fn io_stats(&self) -> crate::engine::IoStats {
        let mut sum = crate::engine::IoStats::default();
        for s in self.shard_io_stats() {
            sum += s;
        }
        sum
    }

    /// Each shard's socket-level counters, shard 0 first (one entry unless the device is
    /// sharded: `SOFTRDMA_SHARDS`).
    pub fn shard_io_stats(&self) -> Vec<crate::engine::IoStats> {
        self.inner.shards.iter().map(|e| e.io_stats()).collect()
    }

    /// Datagrams the device refused before any QP saw them (ICRC, malformed, unknown QP,
    /// P_Key), all shards together.
    pub fn endpoint_stats(&self) -> softrdma_proto::endpoint::EndpointStats {
        let mut sum = softrdma_proto::endpoint::EndpointStats::default();
        for e in &self.inner.shards {
            sum += e.endpoint_stats();
        }
        sum
    }

    /// Regions registered on this device.
    pub fn mr_count(&self) -> usize {
        self.inner.engine.mr_count()
    }
}

impl Context {
    /// The port's attributes (`ibv_query_port`; the only port, number 1).
    pub fn query_port(&self) -> PortAttr {
        self.inner.device.port_attr()
    }

    /// P_Key `index` of the port (`ibv_query_pkey`): index 0 is 0xFFFF, the default
    /// partition with full membership.
    pub fn query_pkey(&self, index: u16) -> Option<u16> {
        self.inner.engine.pkey_table().get(usize::from(index)).copied()
    }

    /// GID `index` of the port: index 0 is the device's address.
    pub fn query_gid(&self, index: u32) -> Option<[u8; 16]> {
        self.inner.gid(index)
    }
}

impl Context {
    /// The device's attributes (`ibv_query_device`).
    pub fn query_device(&self) -> DeviceAttr {
        self.inner.device.attr()
    }

    /// The port's GID table (`ibv_query_gid_table`).
    pub fn gid_table(&self) -> &[GidEntry] {
        &self.inner.device.gids
    }
}
