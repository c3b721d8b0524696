//! rsockets: librdmacm's socket-like calls (`rsocket`, `rbind`, `rlisten`, `raccept`,
//! `rconnect`, `rsend`/`rrecv`, `rpoll`, `riomap`/`riowrite`, ...) over softrdma's
//! connection manager and RC queue pairs, so that rdma-core's `rstream` and `riostream`
//! and Debian's `librspreload.so` (which turns an unmodified socket program's calls into
//! these) run on softrdma.
//!
//! **Design.** Each rsocket is an rdma_cm ID on an event channel of its own; the channel's
//! file descriptor is the rsocket's number, as in rdma-core. A connection is one RC QP
//! (TCP port space, so an rsocket listener on port P takes rdma_cm port P) with:
//! - [`RECV_BUFS`] receive buffers of [`CHUNK`] bytes and [`SEND_SLOTS`] send buffers of
//!   the same size, in one registered region; data is copied into a send buffer and goes
//!   as one SEND (with immediate) per chunk, and is copied out of the receive buffer by
//!   `rrecv`, which then re-posts it;
//! - credit-based flow control: a sender has one credit per receive buffer the peer keeps
//!   for data (all but [`RESERVE`] of them), spends one per data message, and gets them
//!   back in the immediate data of the peer's messages (a message of its own, without
//!   data, once half the window is owed); the reserve takes the messages without data
//!   (credits, end of stream, `riomap` announcements), and RNR retries cover what a
//!   burst of those could still outrun;
//! - end of stream (`rshutdown`, `rclose`) as a message without data behind the data, so
//!   the peer reads everything first; `rclose` waits (at most 2 s) for its data to be
//!   delivered before the DREQ;
//! - `riomap` registers the caller's buffer for remote writes and announces (offset,
//!   address, rkey, length) to the peer; `riowrite` is an RDMA WRITE into the peer's
//!   announced buffer.
//!
//! The wire protocol is softrdma's own (connection private data begins with `SRRS`):
//! rsockets of rdma-core speak another one, so an rsocket here talks to rsockets of
//! softrdma only. Progress (completions, CM events) is made inside the calls, as in
//! rdma-core; `rpoll` sleeps on the CM channel and a completion channel per connection.
//! Stream sockets only (`SOCK_DGRAM` rsockets are refused with ENOTSUP, so the preload
//! library falls back to a kernel socket).

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use softrdma::cm::{CmEvent, CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use softrdma::{
    Access, CompletionChannel, CompletionQueue, MemoryRegion, ProtectionDomain, QpBuilder, QpCaps, QueuePair,
    RecvWr, Rkey, SendFlags, SendOp, SendWr, WcStatus, WorkCompletion,
};

use super::{lock, read_sockaddr, write_sockaddr};
use crate::abi::sockaddr_storage;
use crate::{guard, set_errno};

/// Bytes per message and per buffer.
pub const CHUNK: usize = 64 << 10;
/// Receive buffers per connection.
pub const RECV_BUFS: usize = 32;
/// Send buffers per connection.
pub const SEND_SLOTS: usize = 16;
/// Receive buffers kept for messages without data.
pub const RESERVE: usize = 4;
/// Send queue depth: data, writes and messages without data.
const SQ_DEPTH: usize = SEND_SLOTS + 16;
/// Immediate data: credits returned in the low 16 bits, and the kind of a message
/// without data.
const IMM_CREDITS: u32 = 0xFFFF;
const IMM_FIN: u32 = 1 << 31;
const IMM_IOMAP: u32 = 1 << 30;
/// wr_ids: a receive's is its buffer's index; a send's is `SEND_WR` plus its send
/// buffer's index, or [`NO_SLOT`] for a send without data.
const SEND_WR: u64 = 1 << 32;
const NO_SLOT: u64 = u64::MAX;
/// The private data of a connection: magic and version.
const HELLO: &[u8; 5] = b"SRRS\x01";
/// `SOL_RDMA` and its options, from `<rdma/rsocket.h>`.
const SOL_RDMA: c_int = 0x10000;
const RDMA_SQSIZE: c_int = 0;
const RDMA_RQSIZE: c_int = 1;
const RDMA_INLINE: c_int = 2;
const RDMA_IOMAPSIZE: c_int = 3;
const RDMA_ROUTE: c_int = 4;
/// `sizeof(struct tcp_info)` in Linux 6.1's uapi header.
const TCP_INFO_LEN: usize = 232;

/// A mapping the peer announced with `riomap`.
#[derive(Clone, Copy)]
struct IoMap {
    offset: u64,
    addr: u64,
    rkey: Rkey,
    len: u64,
}

/// A connected QP and its buffers.
struct Conn {
    qp: Arc<QueuePair>,
    cq: CompletionQueue,
    chan: CompletionChannel,
    /// Receive buffers, then send buffers.
    mr: MemoryRegion,
    pd: ProtectionDomain,
    /// Received data not yet read: (buffer, offset read so far, length).
    ready: VecDeque<(usize, usize, usize)>,
    free_slots: Vec<usize>,
    /// Work requests on the send queue.
    sq_used: usize,
    /// Data messages the peer can still take.
    credits: usize,
    /// Receive buffers re-posted since credits were last returned.
    owed: usize,
    fin_sent: bool,
    fin_received: bool,
    /// The connection broke (a failed completion, or the peer disconnected).
    broken: bool,
    /// Our buffers mapped for the peer's writes (`riomap`).
    mapped: Vec<(u64, MemoryRegion)>,
    /// The peer's mapped buffers.
    peer_maps: Vec<IoMap>,
}

enum Phase {
    Fresh,
    Listening,
    /// Waiting for ESTABLISHED.
    Connecting(Conn),
    Connected(Conn),
    /// Connection failed or ended with this errno; reads return 0 after end of stream.
    Failed(c_int),
}

struct Inner {
    id: CmId,
    phase: Phase,
    nonblocking: bool,
    /// Connection requests waiting for `raccept`.
    pending: VecDeque<CmEvent>,
    /// A deferred error for SO_ERROR (a nonblocking connect's outcome).
    so_error: c_int,
    shut_rd: bool,
    /// Options as set, for `rgetsockopt`.
    opts: HashMap<(c_int, c_int), c_int>,
}

/// One rsocket.
struct Rs {
    ch: EventChannel,
    family: c_int,
    inner: Mutex<Inner>,
}

fn table() -> &'static Mutex<HashMap<RawFd, Arc<Rs>>> {
    static T: OnceLock<Mutex<HashMap<RawFd, Arc<Rs>>>> = OnceLock::new();
    T.get_or_init(Default::default)
}

fn get(fd: c_int) -> Result<Arc<Rs>, c_int> {
    lock(table()).get(&fd).cloned().ok_or(libc::EBADF)
}

fn rt_errno(e: softrdma::Error) -> c_int {
    e.errno()
}

impl Conn {
    fn new(id: &CmId) -> Result<Conn, c_int> {
        let ctx = id.context().ok_or(libc::ENODEV)?;
        let pd = ctx.alloc_pd();
        let chan = ctx.create_channel().map_err(rt_errno)?;
        let cq = ctx.create_cq(RECV_BUFS + SQ_DEPTH + 8, Some(&chan)).map_err(rt_errno)?;
        let mr = pd.register((RECV_BUFS + SEND_SLOTS) * CHUNK, Access::LOCAL_WRITE).map_err(rt_errno)?;
        let caps = QpCaps {
            max_send_wr: SQ_DEPTH as u32,
            max_recv_wr: RECV_BUFS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            ..QpCaps::default()
        };
        let qp = id.create_qp(&pd, &QpBuilder::rc().caps(caps), &cq, &cq).map_err(rt_errno)?;
        let c = Conn {
            qp,
            cq,
            chan,
            mr,
            pd,
            ready: VecDeque::new(),
            free_slots: (0..SEND_SLOTS).rev().collect(),
            sq_used: 0,
            credits: RECV_BUFS - RESERVE,
            owed: 0,
            fin_sent: false,
            fin_received: false,
            broken: false,
            mapped: Vec::new(),
            peer_maps: Vec::new(),
        };
        for b in 0..RECV_BUFS {
            c.post_recv(b)?;
        }
        Ok(c)
    }

    fn post_recv(&self, buf: usize) -> Result<(), c_int> {
        let sge = self.mr.sge(buf * CHUNK, CHUNK).map_err(rt_errno)?;
        self.qp.post_recv(RecvWr { wr_id: buf as u64, sg_list: softrdma::sgl![sge] }).map_err(rt_errno)
    }

    fn slot_offset(slot: usize) -> usize {
        (RECV_BUFS + slot) * CHUNK
    }

    /// Takes every completion waiting; how many there were.
    fn progress(&mut self) -> usize {
        let mut wcs = [softrdma::EMPTY_WC; 32];
        let mut total = 0;
        loop {
            let n = self.cq.poll(&mut wcs);
            for wc in &wcs[..n] {
                self.on_completion(wc);
            }
            total += n;
            if n < wcs.len() {
                return total;
            }
        }
    }

    fn on_completion(&mut self, wc: &WorkCompletion) {
        // Told apart by wr_id: a failed completion's opcode is undefined.
        let send = wc.wr_id >= SEND_WR;
        if send {
            self.sq_used = self.sq_used.saturating_sub(1);
            if wc.wr_id != NO_SLOT {
                self.free_slots.push((wc.wr_id - SEND_WR) as usize);
            }
        }
        if wc.status != WcStatus::Success {
            self.broken = true;
            return;
        }
        if send {
            return;
        }
        let buf = wc.wr_id as usize;
        let imm = wc.imm_data.unwrap_or(0);
        self.credits += (imm & IMM_CREDITS) as usize;
        if imm & IMM_IOMAP != 0 && wc.byte_len as usize >= 28 {
            let mut m = [0u8; 28];
            if self.mr.read(buf * CHUNK, &mut m).is_ok() {
                let u64_at = |k: usize| u64::from_be_bytes(m[k..k + 8].try_into().unwrap_or_default());
                let rkey = u32::from_be_bytes(m[24..28].try_into().unwrap_or_default());
                self.peer_maps.push(IoMap {
                    offset: u64_at(0),
                    addr: u64_at(8),
                    len: u64_at(16),
                    rkey: Rkey(rkey),
                });
            }
        } else if imm & IMM_FIN != 0 {
            self.fin_received = true;
        } else if wc.byte_len > 0 {
            self.ready.push_back((buf, 0, wc.byte_len as usize));
            return;
        }
        // A message without data: its buffer goes straight back.
        if self.post_recv(buf).is_err() {
            self.broken = true;
        }
    }

    /// Returns the credits owed, piggybacked on nothing: a message without data.
    fn return_credits(&mut self) {
        if self.owed >= (RECV_BUFS - RESERVE) / 2 && self.sq_used < SQ_DEPTH && !self.broken {
            let owed = self.owed as u32;
            if self.post(None, SendOp::SendWithImm(owed), 0).is_ok() {
                self.owed = 0;
            }
        }
    }

    /// Posts a signaled send: from send buffer `slot` (its first `len` bytes), or without
    /// data.
    fn post(&mut self, slot: Option<usize>, op: SendOp, len: usize) -> Result<(), c_int> {
        let sg_list = match slot {
            None => softrdma::SgList::new(),
            Some(k) => softrdma::sgl![self.mr.sge(Self::slot_offset(k), len).map_err(rt_errno)?],
        };
        let wr = SendWr {
            wr_id: slot.map_or(NO_SLOT, |k| SEND_WR + k as u64),
            op,
            sg_list,
            flags: SendFlags { signaled: true, ..Default::default() },
            ud: None,
        };
        self.qp.post_send(wr).map_err(rt_errno)?;
        self.sq_used += 1;
        Ok(())
    }

    fn can_send(&self) -> bool {
        !self.broken
            && !self.fin_sent
            && self.credits > 0
            && !self.free_slots.is_empty()
            && self.sq_used < SQ_DEPTH
    }

    /// Sends what fits of `data` now; the number of bytes taken.
    fn send_some(&mut self, data: &[u8]) -> Result<usize, c_int> {
        let mut done = 0;
        while done < data.len() && self.can_send() {
            let n = (data.len() - done).min(CHUNK);
            let slot = self.free_slots.pop().unwrap_or_default();
            if let Err(e) = self.mr.write(Self::slot_offset(slot), &data[done..done + n]) {
                self.free_slots.push(slot);
                return Err(rt_errno(e));
            }
            let owed = std::mem::take(&mut self.owed) as u32;
            if let Err(e) = self.post(Some(slot), SendOp::SendWithImm(owed), n) {
                self.free_slots.push(slot);
                self.owed += owed as usize;
                return Err(e);
            }
            self.credits -= 1;
            done += n;
        }
        Ok(done)
    }

    /// Copies received data into `out`; the number of bytes (0: nothing waiting).
    fn recv_some(&mut self, out: &mut [u8], peek: bool) -> Result<usize, c_int> {
        let mut done = 0;
        let mut k = 0;
        while done < out.len() {
            let Some(&(buf, off, len)) = self.ready.get(k) else { break };
            let n = (len - off).min(out.len() - done);
            self.mr.read(buf * CHUNK + off, &mut out[done..done + n]).map_err(rt_errno)?;
            done += n;
            if peek {
                k += 1;
            } else if off + n == len {
                self.ready.pop_front();
                self.post_recv(buf)?;
                self.owed += 1;
            } else if let Some(head) = self.ready.front_mut() {
                head.1 += n;
            }
        }
        if !peek {
            self.return_credits();
        }
        Ok(done)
    }

    fn eof(&self) -> bool {
        self.ready.is_empty() && (self.fin_received || self.broken)
    }

    /// Arms the CQ; false if completions arrived meanwhile (progress instead of sleeping).
    fn arm(&mut self) -> bool {
        if self.cq.req_notify(false).is_err() {
            return false;
        }
        self.progress() == 0
    }

    fn drain_channel(&self) {
        while self.chan.try_get_event().is_some() {
            self.chan.ack_events(1);
        }
    }
}

impl Inner {
    fn conn(&mut self) -> Option<&mut Conn> {
        match &mut self.phase {
            Phase::Connected(c) | Phase::Connecting(c) => Some(c),
            _ => None,
        }
    }

    /// Takes CM events and completions: the socket's state is current afterwards.
    fn progress(&mut self, ch: &EventChannel) {
        while let Some(ev) = ch.try_get_event() {
            self.on_event(ev);
        }
        if let Some(c) = self.conn() {
            c.drain_channel();
            c.progress();
        }
    }

    fn on_event(&mut self, ev: CmEvent) {
        match ev.kind {
            CmEventKind::ConnectRequest if matches!(self.phase, Phase::Listening) => {
                if ev.param.private_data.starts_with(HELLO) {
                    self.pending.push_back(ev);
                } else {
                    let _ = ev.id.reject(&[]);
                }
            }
            CmEventKind::Established => {
                if let Phase::Connecting(_) = self.phase {
                    if let Phase::Connecting(c) = std::mem::replace(&mut self.phase, Phase::Fresh) {
                        self.phase = Phase::Connected(c);
                    }
                }
            }
            CmEventKind::Rejected | CmEventKind::Unreachable | CmEventKind::ConnectError => {
                if let Phase::Connecting(_) = self.phase {
                    let e =
                        if ev.kind == CmEventKind::Rejected { libc::ECONNREFUSED } else { libc::ETIMEDOUT };
                    self.phase = Phase::Failed(e);
                    self.so_error = e;
                }
            }
            CmEventKind::Disconnected | CmEventKind::DeviceRemoval => {
                if let Some(c) = self.conn() {
                    c.broken = true;
                }
            }
            _ => {}
        }
    }

    /// poll(2) events of the socket now.
    fn revents(&self) -> i16 {
        match &self.phase {
            Phase::Fresh => libc::POLLOUT | libc::POLLHUP,
            Phase::Listening => {
                if self.pending.is_empty() {
                    0
                } else {
                    libc::POLLIN
                }
            }
            Phase::Connecting(_) => 0,
            Phase::Connected(c) => {
                let mut r = 0;
                if !c.ready.is_empty() || c.eof() || self.shut_rd {
                    r |= libc::POLLIN;
                }
                if c.can_send() {
                    r |= libc::POLLOUT;
                }
                if c.broken {
                    r |= libc::POLLHUP;
                }
                r
            }
            Phase::Failed(_) => libc::POLLIN | libc::POLLOUT | libc::POLLERR | libc::POLLHUP,
        }
    }
}

impl Rs {
    /// Runs `op` until it stops answering EAGAIN: at once when non-blocking (or
    /// `dontwait`), else sleeping on the socket's channels between tries.
    fn wait_for<T>(
        &self,
        dontwait: bool,
        mut op: impl FnMut(&mut Inner) -> Result<T, c_int>,
    ) -> Result<T, c_int> {
        loop {
            let mut g = lock(&self.inner);
            g.progress(&self.ch);
            match op(&mut g) {
                Err(libc::EAGAIN) if !(dontwait || g.nonblocking) => {}
                r => return r,
            }
            let armed = g.conn().is_none_or(Conn::arm);
            let cq_fd = g.conn().map(|c| c.chan.as_raw_fd());
            drop(g);
            if armed {
                let mut fds = vec![libc::pollfd { fd: self.ch.fd(), events: libc::POLLIN, revents: 0 }];
                if let Some(fd) = cq_fd {
                    fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                }
                // SAFETY: fds is a valid array of its length.
                unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1000) };
            }
        }
    }
}

/// A call's outcome after moving `n` bytes: a socket reports what it moved, and an
/// error only when nothing moved.
fn partial(r: Result<(), c_int>, n: usize) -> Result<usize, c_int> {
    match r {
        Err(e) if n == 0 => Err(e),
        _ => Ok(n),
    }
}

/// Runs an rsocket call: the errno on failure, a panic turned into EIO.
fn call<T>(fail: T, f: impl FnOnce() -> Result<T, c_int>) -> T {
    match guard(Err(libc::EIO), f) {
        Ok(v) => v,
        Err(e) => {
            set_errno(e);
            fail
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn rsocket(domain: c_int, ty: c_int, _protocol: c_int) -> c_int {
    call(-1, || {
        if domain != libc::AF_INET && domain != libc::AF_INET6 {
            return Err(libc::EAFNOSUPPORT);
        }
        if ty & 0xf != libc::SOCK_STREAM {
            return Err(libc::ENOTSUP);
        }
        let ch = EventChannel::new().map_err(rt_errno)?;
        let id = CmId::new(&ch, PortSpace::Tcp);
        let fd = ch.fd();
        let inner = Inner {
            id,
            phase: Phase::Fresh,
            nonblocking: ty & libc::SOCK_NONBLOCK != 0,
            pending: VecDeque::new(),
            so_error: 0,
            shut_rd: false,
            opts: HashMap::new(),
        };
        lock(table()).insert(fd, Arc::new(Rs { ch, family: domain, inner: Mutex::new(inner) }));
        Ok(fd)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rbind(s: c_int, addr: *const libc::sockaddr, _len: libc::socklen_t) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        // SAFETY: the caller's address of its family's size.
        let a = unsafe { read_sockaddr(addr) }.ok_or(libc::EAFNOSUPPORT)?;
        lock(&rs.inner).id.bind_addr(a).map_err(rt_errno)?;
        Ok(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rlisten(s: c_int, backlog: c_int) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        let mut g = lock(&rs.inner);
        g.id.listen(backlog.clamp(1, 1024) as usize).map_err(rt_errno)?;
        g.phase = Phase::Listening;
        Ok(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn raccept(s: c_int, addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        let ev = rs.wait_for(false, |g| {
            if !matches!(g.phase, Phase::Listening) {
                return Err(libc::EINVAL);
            }
            g.pending.pop_front().ok_or(libc::EAGAIN)
        })?;
        let ch = EventChannel::new().map_err(rt_errno)?;
        ev.id.migrate(&ch);
        let conn = match Conn::new(&ev.id) {
            Ok(c) => c,
            Err(e) => {
                let _ = ev.id.reject(&[]);
                return Err(e);
            }
        };
        let param = ConnParam {
            private_data: HELLO.to_vec(),
            rnr_retry_count: 7,
            retry_count: 7,
            ..ConnParam::default()
        };
        ev.id.accept(&param).map_err(rt_errno)?;
        let fd = ch.fd();
        let peer = ev.id.peer_addr();
        let inner = Inner {
            id: ev.id,
            phase: Phase::Connected(conn),
            nonblocking: false,
            pending: VecDeque::new(),
            so_error: 0,
            shut_rd: false,
            opts: HashMap::new(),
        };
        lock(table()).insert(fd, Arc::new(Rs { ch, family: rs.family, inner: Mutex::new(inner) }));
        if let Some(p) = peer {
            // SAFETY: the caller's buffer and length, if given.
            unsafe { out_addr(p, addr, len) };
        }
        Ok(fd)
    })
}

/// Writes `a` to a caller's (address, length) pair, truncated to its length.
unsafe fn out_addr(a: SocketAddr, addr: *mut libc::sockaddr, len: *mut libc::socklen_t) {
    if addr.is_null() || len.is_null() {
        return;
    }
    let mut st = sockaddr_storage { bytes: [0; 128] };
    write_sockaddr(&mut st, a);
    let size = if a.is_ipv4() { size_of::<libc::sockaddr_in>() } else { size_of::<libc::sockaddr_in6>() };
    // SAFETY: the caller's buffer holds *len bytes; we write at most that many.
    unsafe {
        let n = size.min(*len as usize);
        std::ptr::copy_nonoverlapping(st.bytes.as_ptr(), addr.cast::<u8>(), n);
        *len = size as libc::socklen_t;
    }
}

#[no_mangle]
pub unsafe extern "C" fn rconnect(s: c_int, addr: *const libc::sockaddr, _len: libc::socklen_t) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        // SAFETY: the caller's address of its family's size.
        let dst = unsafe { read_sockaddr(addr) }.ok_or(libc::EAFNOSUPPORT)?;
        {
            let mut g = lock(&rs.inner);
            match g.phase {
                Phase::Fresh => {}
                Phase::Connecting(_) => return Err(libc::EALREADY),
                Phase::Connected(_) => return Err(libc::EISCONN),
                _ => return Err(libc::EINVAL),
            }
            let src = g.id.local_addr().map(|a| a.ip()).filter(|ip| !ip.is_unspecified());
            g.id.resolve_addr(src, dst, Duration::from_secs(2)).map_err(rt_errno)?;
            expect(&rs.ch, CmEventKind::AddrResolved)?;
            g.id.resolve_route(Duration::from_secs(2)).map_err(rt_errno)?;
            expect(&rs.ch, CmEventKind::RouteResolved)?;
            let conn = Conn::new(&g.id)?;
            let param = ConnParam {
                private_data: HELLO.to_vec(),
                rnr_retry_count: 7,
                retry_count: 7,
                ..ConnParam::default()
            };
            g.id.connect(&param).map_err(rt_errno)?;
            g.phase = Phase::Connecting(conn);
            if g.nonblocking {
                return Err(libc::EINPROGRESS);
            }
        }
        // The outcome is reported here, so SO_ERROR has nothing left to tell.
        rs.wait_for(false, |g| match g.phase {
            Phase::Connected(_) => Ok(0),
            Phase::Failed(e) => {
                g.so_error = 0;
                Err(e)
            }
            _ => Err(libc::EAGAIN),
        })
    })
}

/// The next event of a resolution, which must be `want`.
fn expect(ch: &EventChannel, want: CmEventKind) -> Result<(), c_int> {
    match ch.get_event_timeout(Duration::from_secs(5)) {
        Some(ev) if ev.kind == want => Ok(()),
        Some(_) => Err(libc::EHOSTUNREACH),
        None => Err(libc::ETIMEDOUT),
    }
}

const MSG_PEEK: c_int = libc::MSG_PEEK;
const MSG_DONTWAIT: c_int = libc::MSG_DONTWAIT;
const MSG_WAITALL: c_int = libc::MSG_WAITALL;

fn do_send(s: c_int, data: &[u8], flags: c_int) -> Result<isize, c_int> {
    let rs = get(s)?;
    let mut sent = 0usize;
    let dontwait = flags & MSG_DONTWAIT != 0;
    // Blocking: everything is queued before returning, as a TCP socket does.
    let r = rs.wait_for(dontwait, |g| {
        let Phase::Connected(c) = &mut g.phase else {
            return Err(if matches!(g.phase, Phase::Connecting(_)) { libc::EAGAIN } else { libc::ENOTCONN });
        };
        if c.fin_sent {
            return Err(libc::EPIPE);
        }
        if c.broken {
            return Err(libc::ECONNRESET);
        }
        sent += c.send_some(&data[sent..])?;
        if sent == data.len() || (sent > 0 && (dontwait || g.nonblocking)) {
            Ok(())
        } else {
            Err(libc::EAGAIN)
        }
    });
    partial(r, sent).map(|n| n as isize)
}

fn do_recv(s: c_int, out: &mut [u8], flags: c_int) -> Result<isize, c_int> {
    let rs = get(s)?;
    if out.is_empty() {
        return Ok(0);
    }
    let mut got = 0usize;
    let waitall = flags & MSG_WAITALL != 0 && flags & MSG_PEEK == 0;
    let r = rs.wait_for(flags & MSG_DONTWAIT != 0, |g| {
        let shut_rd = g.shut_rd;
        let Phase::Connected(c) = &mut g.phase else {
            return match g.phase {
                Phase::Connecting(_) => Err(libc::EAGAIN),
                Phase::Failed(_) => Ok(()),
                _ => Err(libc::ENOTCONN),
            };
        };
        got += c.recv_some(&mut out[got..], flags & MSG_PEEK != 0)?;
        if got == out.len() || c.eof() || shut_rd || (got > 0 && !waitall) {
            Ok(())
        } else {
            Err(libc::EAGAIN)
        }
    });
    partial(r, got).map(|n| n as isize)
}

/// A byte slice of the caller's buffer, empty for a null pointer.
unsafe fn slice<'a>(buf: *const c_void, len: usize) -> &'a [u8] {
    if buf.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: the caller's buffer of len bytes.
        unsafe { std::slice::from_raw_parts(buf.cast(), len) }
    }
}

unsafe fn slice_mut<'a>(buf: *mut c_void, len: usize) -> &'a mut [u8] {
    if buf.is_null() || len == 0 {
        &mut []
    } else {
        // SAFETY: the caller's buffer of len bytes.
        unsafe { std::slice::from_raw_parts_mut(buf.cast(), len) }
    }
}

#[no_mangle]
pub unsafe extern "C" fn rsend(s: c_int, buf: *const c_void, len: usize, flags: c_int) -> isize {
    // SAFETY: the caller's buffer.
    call(-1, || do_send(s, unsafe { slice(buf, len) }, flags))
}

#[no_mangle]
pub unsafe extern "C" fn rsendto(
    s: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    _dst: *const libc::sockaddr,
    _dstlen: libc::socklen_t,
) -> isize {
    // SAFETY: forwarded; a connected stream ignores the address, as TCP does.
    unsafe { rsend(s, buf, len, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn rwrite(s: c_int, buf: *const c_void, count: usize) -> isize {
    // SAFETY: forwarded.
    unsafe { rsend(s, buf, count, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn rrecv(s: c_int, buf: *mut c_void, len: usize, flags: c_int) -> isize {
    // SAFETY: the caller's buffer.
    call(-1, || do_recv(s, unsafe { slice_mut(buf, len) }, flags))
}

#[no_mangle]
pub unsafe extern "C" fn rrecvfrom(
    s: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    src: *mut libc::sockaddr,
    srclen: *mut libc::socklen_t,
) -> isize {
    // SAFETY: forwarded.
    let n = unsafe { rrecv(s, buf, len, flags) };
    if n >= 0 {
        // SAFETY: the caller's address buffer, if any.
        unsafe { rgetpeername(s, src, srclen) };
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn rread(s: c_int, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: forwarded.
    unsafe { rrecv(s, buf, count, 0) }
}

/// The caller's iovecs, gathered or scattered one after the other.
unsafe fn iovecs<'a>(iov: *const libc::iovec, n: c_int) -> &'a [libc::iovec] {
    if iov.is_null() || n <= 0 {
        &[]
    } else {
        // SAFETY: the caller's array of n iovecs.
        unsafe { std::slice::from_raw_parts(iov, n as usize) }
    }
}

#[no_mangle]
pub unsafe extern "C" fn rwritev(s: c_int, iov: *const libc::iovec, iovcnt: c_int) -> isize {
    // SAFETY: the caller's iovecs.
    unsafe { send_iov(s, iovecs(iov, iovcnt), 0) }
}

/// Sends a list of buffers in order, each straight from the caller's memory: stops at the
/// first that does not go out whole (non-blocking), and fails only when nothing went.
unsafe fn send_iov(s: c_int, v: &[libc::iovec], flags: c_int) -> isize {
    call(-1, || {
        let mut total = 0usize;
        for i in v {
            // SAFETY: the caller's buffer of iov_len bytes.
            let data = unsafe { slice(i.iov_base, i.iov_len) };
            let n = match do_send(s, data, flags) {
                Ok(n) => n as usize,
                Err(e) => return partial(Err(e), total).map(|n| n as isize),
            };
            total += n;
            if n < data.len() {
                break;
            }
        }
        Ok(total as isize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rsendmsg(s: c_int, msg: *const libc::msghdr, flags: c_int) -> isize {
    if msg.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller's message and its iovecs.
    unsafe { send_iov(s, iovecs((*msg).msg_iov, (*msg).msg_iovlen as c_int), flags) }
}

/// Receives into a list of buffers: one receive into a bounce buffer of their total size.
unsafe fn recv_iov(s: c_int, v: &[libc::iovec], flags: c_int) -> isize {
    let total: usize = v.iter().map(|i| i.iov_len).sum();
    let mut tmp = vec![0u8; total];
    let n = call(-1, || do_recv(s, &mut tmp, flags));
    if n > 0 {
        let mut at = 0usize;
        for i in v {
            let k = i.iov_len.min(n as usize - at);
            // SAFETY: the caller's buffer of iov_len >= k bytes.
            unsafe { slice_mut(i.iov_base, k) }.copy_from_slice(&tmp[at..at + k]);
            at += k;
        }
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn rreadv(s: c_int, iov: *const libc::iovec, iovcnt: c_int) -> isize {
    // SAFETY: the caller's iovecs.
    unsafe { recv_iov(s, iovecs(iov, iovcnt), 0) }
}

#[no_mangle]
pub unsafe extern "C" fn rrecvmsg(s: c_int, msg: *mut libc::msghdr, flags: c_int) -> isize {
    if msg.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller's message and its iovecs.
    unsafe { recv_iov(s, iovecs((*msg).msg_iov, (*msg).msg_iovlen as c_int), flags) }
}

/// Sends the end of stream once, if connected.
fn send_fin(g: &mut Inner) {
    if let Some(c) = g.conn() {
        if !c.fin_sent
            && !c.broken
            && c.sq_used < SQ_DEPTH
            && c.post(None, SendOp::SendWithImm(IMM_FIN), 0).is_ok()
        {
            c.fin_sent = true;
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn rshutdown(s: c_int, how: c_int) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        let mut g = lock(&rs.inner);
        g.progress(&rs.ch);
        if !matches!(g.phase, Phase::Connected(_)) {
            return Err(libc::ENOTCONN);
        }
        if how == libc::SHUT_RD || how == libc::SHUT_RDWR {
            g.shut_rd = true;
        }
        if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
            send_fin(&mut g);
        }
        Ok(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rclose(s: c_int) -> c_int {
    call(-1, || {
        let rs = lock(table()).remove(&s).ok_or(libc::EBADF)?;
        // Data already queued is delivered before the connection goes: wait (boundedly)
        // until every send completed, end the stream, then disconnect.
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut g = lock(&rs.inner);
        send_fin(&mut g);
        while let Some(c) = g.conn() {
            c.progress();
            if c.sq_used == 0 || c.broken || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        if g.conn().is_some() {
            let _ = g.id.disconnect();
        }
        g.id.destroy();
        g.pending.clear();
        Ok(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rpoll(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int) -> c_int {
    if nfds > 0 && fds.is_null() {
        set_errno(libc::EFAULT);
        return -1;
    }
    // SAFETY: the caller's array of nfds entries.
    let fds = unsafe { std::slice::from_raw_parts_mut(fds, nfds as usize) };
    call(-1, || poll_loop(fds, timeout))
}

fn poll_loop(fds: &mut [libc::pollfd], timeout: c_int) -> Result<c_int, c_int> {
    let socks: Vec<Option<Arc<Rs>>> = {
        let t = lock(table());
        fds.iter().map(|p| t.get(&p.fd).cloned()).collect()
    };
    if socks.iter().all(Option::is_none) {
        // SAFETY: the caller's array.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        return if r < 0 {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL))
        } else {
            Ok(r)
        };
    }
    let deadline = (timeout >= 0).then(|| Instant::now() + Duration::from_millis(timeout as u64));
    loop {
        // The rsockets' state, and the kernel's for the other descriptors, without waiting.
        let mut sys: Vec<libc::pollfd> = Vec::new();
        let mut ready = 0;
        for (p, rs) in fds.iter_mut().zip(&socks) {
            p.revents = 0;
            match rs {
                Some(rs) => {
                    let mut g = lock(&rs.inner);
                    g.progress(&rs.ch);
                    let always = libc::POLLERR | libc::POLLHUP;
                    p.revents = g.revents() & (p.events | always);
                }
                None if p.fd >= 0 => sys.push(libc::pollfd { fd: p.fd, events: p.events, revents: 0 }),
                None => {}
            }
        }
        if !sys.is_empty() {
            // SAFETY: a valid array of its length.
            unsafe { libc::poll(sys.as_mut_ptr(), sys.len() as libc::nfds_t, 0) };
            let mut k = 0;
            for (p, rs) in fds.iter_mut().zip(&socks) {
                if rs.is_none() && p.fd >= 0 {
                    p.revents = sys[k].revents;
                    k += 1;
                }
            }
        }
        ready += fds.iter().filter(|p| p.revents != 0).count();
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if ready > 0 || left == Some(Duration::ZERO) {
            return Ok(ready as c_int);
        }
        // Sleep on every channel: CM events, armed CQs, and the other descriptors.
        let mut wait: Vec<libc::pollfd> = sys.iter().map(|p| libc::pollfd { revents: 0, ..*p }).collect();
        let mut armed = true;
        for rs in socks.iter().flatten() {
            wait.push(libc::pollfd { fd: rs.ch.fd(), events: libc::POLLIN, revents: 0 });
            let mut g = lock(&rs.inner);
            if let Some(c) = g.conn() {
                armed &= c.arm();
                wait.push(libc::pollfd { fd: c.chan.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            }
        }
        if armed {
            let ms = left.map_or(1000, |l| l.as_millis().clamp(1, 1000) as c_int);
            // SAFETY: a valid array of its length.
            unsafe { libc::poll(wait.as_mut_ptr(), wait.len() as libc::nfds_t, ms) };
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn rselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    let mut polls = Vec::new();
    for fd in 0..nfds.clamp(0, libc::FD_SETSIZE as c_int) {
        let mut events = 0;
        // SAFETY: the caller's sets, if given.
        unsafe {
            if !readfds.is_null() && libc::FD_ISSET(fd, readfds) {
                events |= libc::POLLIN;
            }
            if !writefds.is_null() && libc::FD_ISSET(fd, writefds) {
                events |= libc::POLLOUT;
            }
            if !exceptfds.is_null() && libc::FD_ISSET(fd, exceptfds) {
                events |= libc::POLLPRI;
            }
        }
        if events != 0 {
            polls.push(libc::pollfd { fd, events, revents: 0 });
        }
    }
    let ms = if timeout.is_null() {
        -1
    } else {
        // SAFETY: the caller's timeval.
        let t = unsafe { *timeout };
        (t.tv_sec.saturating_mul(1000) + t.tv_usec / 1000).clamp(0, c_int::MAX as i64) as c_int
    };
    // SAFETY: our own array.
    let n = unsafe { rpoll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, ms) };
    if n < 0 {
        return n;
    }
    let mut count = 0;
    // SAFETY: the caller's sets, if given.
    unsafe {
        for set in [readfds, writefds, exceptfds] {
            if !set.is_null() {
                libc::FD_ZERO(set);
            }
        }
        for p in &polls {
            let hit = |mask: i16| p.revents & (mask | libc::POLLERR | libc::POLLHUP) != 0;
            if !readfds.is_null() && p.events & libc::POLLIN != 0 && hit(libc::POLLIN) {
                libc::FD_SET(p.fd, readfds);
                count += 1;
            }
            if !writefds.is_null() && p.events & libc::POLLOUT != 0 && hit(libc::POLLOUT) {
                libc::FD_SET(p.fd, writefds);
                count += 1;
            }
            if !exceptfds.is_null() && p.events & libc::POLLPRI != 0 && p.revents & libc::POLLPRI != 0 {
                libc::FD_SET(p.fd, exceptfds);
                count += 1;
            }
        }
    }
    count
}

#[no_mangle]
pub unsafe extern "C" fn rgetpeername(
    s: c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        let a = lock(&rs.inner).id.peer_addr().ok_or(libc::ENOTCONN)?;
        // SAFETY: the caller's buffer.
        unsafe { out_addr(a, addr, len) };
        Ok(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rgetsockname(
    s: c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        let g = lock(&rs.inner);
        let unspecified = if rs.family == libc::AF_INET6 { "[::]:0" } else { "0.0.0.0:0" };
        let a = g.id.local_addr().unwrap_or_else(|| unspecified.parse().expect("an address"));
        // SAFETY: the caller's buffer.
        unsafe { out_addr(a, addr, len) };
        Ok(0)
    })
}

/// The options `rsetsockopt` takes: SOL_SOCKET's and IPPROTO_TCP's that a TCP program
/// sets (recorded and reported back; the transport has its own buffers), and SOL_RDMA's
/// (queue sizes, inline size, iomap size, route: accepted, the sizes are fixed).
fn known_option(level: c_int, name: c_int) -> bool {
    match level {
        libc::SOL_SOCKET => matches!(
            name,
            libc::SO_REUSEADDR
                | libc::SO_KEEPALIVE
                | libc::SO_SNDBUF
                | libc::SO_RCVBUF
                | libc::SO_LINGER
                | libc::SO_OOBINLINE
                | libc::SO_REUSEPORT
                | libc::SO_SNDTIMEO
                | libc::SO_RCVTIMEO
                | libc::SO_PRIORITY
        ),
        libc::IPPROTO_TCP => matches!(
            name,
            libc::TCP_NODELAY
                | libc::TCP_KEEPIDLE
                | libc::TCP_KEEPINTVL
                | libc::TCP_KEEPCNT
                | libc::TCP_MAXSEG
                | libc::TCP_CONGESTION
                | libc::TCP_USER_TIMEOUT
        ),
        libc::IPPROTO_IPV6 => name == libc::IPV6_V6ONLY,
        SOL_RDMA => matches!(name, RDMA_SQSIZE | RDMA_RQSIZE | RDMA_INLINE | RDMA_IOMAPSIZE | RDMA_ROUTE),
        _ => false,
    }
}

#[no_mangle]
pub unsafe extern "C" fn rsetsockopt(
    s: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: libc::socklen_t,
) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        if !known_option(level, name) {
            return Err(libc::ENOPROTOOPT);
        }
        let v = if !val.is_null() && len as usize >= size_of::<c_int>() {
            // SAFETY: the caller's value of at least an int.
            unsafe { std::ptr::read_unaligned(val.cast::<c_int>()) }
        } else {
            0
        };
        lock(&rs.inner).opts.insert((level, name), v);
        Ok(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rgetsockopt(
    s: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut libc::socklen_t,
) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        if val.is_null() || len.is_null() {
            return Err(libc::EFAULT);
        }
        let mut g = lock(&rs.inner);
        g.progress(&rs.ch);
        if (level, name) == (libc::IPPROTO_TCP, libc::TCP_INFO) {
            // No TCP underneath: a zeroed `struct tcp_info` in state ESTABLISHED (1), so
            // that programs reading retransmissions or RTT (iperf3) find no garbage.
            // SAFETY: the caller's buffer of *len bytes; at most that many are written.
            unsafe {
                let n = (*len as usize).min(TCP_INFO_LEN);
                std::ptr::write_bytes(val.cast::<u8>(), 0, n);
                if n > 0 && matches!(g.phase, Phase::Connected(_)) {
                    *val.cast::<u8>() = 1;
                }
                *len = n as libc::socklen_t;
            }
            return Ok(0);
        }
        let v: c_int = match (level, name) {
            (libc::SOL_SOCKET, libc::SO_ERROR) => std::mem::take(&mut g.so_error),
            (libc::SOL_SOCKET, libc::SO_TYPE) => libc::SOCK_STREAM,
            (libc::SOL_SOCKET, libc::SO_DOMAIN) => rs.family,
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => (SEND_SLOTS * CHUNK) as c_int,
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => (RECV_BUFS * CHUNK) as c_int,
            (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => CHUNK as c_int,
            (l, n) if known_option(l, n) => g.opts.get(&(l, n)).copied().unwrap_or(0),
            _ => return Err(libc::ENOPROTOOPT),
        };
        // SAFETY: the caller's buffer of *len bytes; an int is written if it fits.
        unsafe {
            if (*len as usize) < size_of::<c_int>() {
                return Err(libc::EINVAL);
            }
            std::ptr::write_unaligned(val.cast::<c_int>(), v);
            *len = size_of::<c_int>() as libc::socklen_t;
        }
        Ok(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn rfcntl(s: c_int, cmd: c_int, arg: c_int) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        let mut g = lock(&rs.inner);
        match cmd {
            libc::F_GETFL => Ok(libc::O_RDWR | if g.nonblocking { libc::O_NONBLOCK } else { 0 }),
            libc::F_SETFL => {
                g.nonblocking = arg & libc::O_NONBLOCK != 0;
                Ok(0)
            }
            _ => Err(libc::ENOTSUP),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn riomap(
    s: c_int,
    buf: *mut c_void,
    len: usize,
    prot: c_int,
    _flags: c_int,
    offset: libc::off_t,
) -> libc::off_t {
    call(-1, || {
        let rs = get(s)?;
        if buf.is_null() || len == 0 || prot & libc::PROT_WRITE == 0 {
            return Err(libc::EINVAL);
        }
        let offset = if offset == -1 { buf as u64 } else { offset as u64 };
        let mut g = lock(&rs.inner);
        g.progress(&rs.ch);
        let Phase::Connected(c) = &mut g.phase else { return Err(libc::ENOTCONN) };
        // SAFETY: the caller keeps `buf` valid and mapped until riounmap, as riomap requires.
        let mr = unsafe { c.pd.register_raw(buf.cast(), len, Access::LOCAL_WRITE | Access::REMOTE_WRITE) }
            .map_err(rt_errno)?;
        let slot = c.free_slots.pop().ok_or(libc::ENOMEM)?;
        let mut m = [0u8; 28];
        m[..8].copy_from_slice(&offset.to_be_bytes());
        m[8..16].copy_from_slice(&mr.addr().to_be_bytes());
        m[16..24].copy_from_slice(&(len as u64).to_be_bytes());
        m[24..].copy_from_slice(&mr.rkey().0.to_be_bytes());
        c.mr.write(Conn::slot_offset(slot), &m).map_err(rt_errno)?;
        if let Err(e) = c.post(Some(slot), SendOp::SendWithImm(IMM_IOMAP), m.len()) {
            c.free_slots.push(slot);
            return Err(e);
        }
        c.mapped.push((offset, mr));
        Ok(offset as libc::off_t)
    })
}

#[no_mangle]
pub unsafe extern "C" fn riounmap(s: c_int, buf: *mut c_void, _len: usize) -> c_int {
    call(-1, || {
        let rs = get(s)?;
        let mut g = lock(&rs.inner);
        let c = g.conn().ok_or(libc::ENOTCONN)?;
        let before = c.mapped.len();
        c.mapped.retain(|(_, mr)| mr.addr() != buf as u64);
        if c.mapped.len() == before {
            return Err(libc::EINVAL);
        }
        Ok(0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn riowrite(
    s: c_int,
    buf: *const c_void,
    count: usize,
    offset: libc::off_t,
    flags: c_int,
) -> usize {
    // SAFETY: the caller's buffer.
    let data = unsafe { slice(buf, count) };
    call(usize::MAX, || {
        let rs = get(s)?;
        let mut done = 0usize;
        let r = rs.wait_for(flags & MSG_DONTWAIT != 0, |g| {
            let Phase::Connected(c) = &mut g.phase else { return Err(libc::ENOTCONN) };
            if c.broken {
                return Err(libc::ECONNRESET);
            }
            while done < data.len() {
                let at = offset as u64 + done as u64;
                let Some(m) = c.peer_maps.iter().find(|m| at >= m.offset && at < m.offset + m.len).copied()
                else {
                    // The peer's riomap may still be on its way.
                    return Err(libc::EAGAIN);
                };
                if c.free_slots.is_empty() || c.sq_used >= SQ_DEPTH {
                    return Err(libc::EAGAIN);
                }
                let n = (data.len() - done).min(CHUNK).min((m.offset + m.len - at) as usize);
                let slot = c.free_slots.pop().unwrap_or_default();
                c.mr.write(Conn::slot_offset(slot), &data[done..done + n]).map_err(rt_errno)?;
                let op = SendOp::Write { remote_addr: m.addr + (at - m.offset), rkey: m.rkey };
                if let Err(e) = c.post(Some(slot), op, n) {
                    c.free_slots.push(slot);
                    return Err(e);
                }
                done += n;
            }
            Ok(())
        });
        partial(r, done)
    })
}
