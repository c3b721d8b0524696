//! `softrdma rping`: rdma_cm's ping test, with rping's options, output and exchange, so
//! that it runs against the real `rping` in either role.
//!
//! Per iteration the client fills its start buffer with `rdma-ping-N: ` and a rotating
//! run of letters, and SENDs its advertisement (address, rkey and length, 16 bytes in
//! network order); the server RDMA READs the buffer, SENDs a go-ahead, receives the
//! advertisement of the client's second buffer, RDMA WRITEs the data there and SENDs
//! again; the client then compares (`-V`) and prints (`-v`). Connection setup and teardown
//! go through the connection manager.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use crate::cmatose::{Fail, STEP};
use softrdma::cm::{CmEvent, CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use softrdma::{
    Access, CompletionQueue, MemoryRegion, ProtectionDomain, QpBuilder, QpCaps, QueuePair, RecvWr, Rkey,
    SendFlags, SendOp, SendWr, WcOpcode, WcStatus,
};

/// Arguments of `softrdma rping`.
#[derive(Debug, clap::Args)]
pub struct RpingArgs {
    /// Run as the server.
    #[arg(short = 's', conflicts_with = "client")]
    pub server: bool,
    /// Run as the client.
    #[arg(short = 'c')]
    pub client: bool,
    /// Address: the server's to listen on (default: every address), the client's to
    /// connect to.
    #[arg(short = 'a')]
    pub addr: Option<IpAddr>,
    /// The client's source address (default: the route's).
    #[arg(short = 'I')]
    pub source: Option<IpAddr>,
    /// rdma_cm port.
    #[arg(short = 'p', default_value_t = 7174)]
    pub port: u16,
    /// Iterations (default: until interrupted; the server: until the client leaves).
    #[arg(short = 'C')]
    pub count: Option<u64>,
    /// Size of the ping buffer in bytes.
    #[arg(short = 'S', default_value_t = 64, value_parser = clap::value_parser!(u32).range(MIN_SIZE..=MAX_SIZE))]
    pub size: u32,
    /// Print the ping data.
    #[arg(short = 'v')]
    pub verbose: bool,
    /// Validate the ping data.
    #[arg(short = 'V')]
    pub validate: bool,
    /// Debug output.
    #[arg(short = 'd')]
    pub debug: bool,
    /// Persistent server: serve clients one after another until interrupted.
    #[arg(short = 'P')]
    pub persistent: bool,
}

/// rping's smallest buffer: the longest `rdma-ping-N: ` and a NUL.
const MIN_SIZE: i64 = 26;
const MAX_SIZE: i64 = 64 << 20;
/// The advertisement: address, rkey, length.
const INFO: usize = 16;

pub fn run(a: &RpingArgs) -> i32 {
    if a.server == a.client {
        eprintln!("rping: choose -s (server) or -c (client)");
        return 2;
    }
    let r = if a.server { server(a) } else { client(a) };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("rping: {e}");
            1
        }
    }
}

/// The buffers and queues of one connection.
struct Conn {
    cq: CompletionQueue,
    qp: Arc<QueuePair>,
    recv: MemoryRegion,
    send: MemoryRegion,
    /// Client: the buffer the server reads; server: unused.
    start: MemoryRegion,
    /// Client: the buffer the server writes; server: the buffer it reads into.
    rdma: MemoryRegion,
    _pd: ProtectionDomain,
}

impl Conn {
    fn new(id: &CmId, size: usize) -> Result<Conn, Fail> {
        let ctx = id.context().ok_or("the CM ID has no device")?;
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(16, None)?;
        let remote = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        let recv = pd.register(INFO, Access::LOCAL_WRITE)?;
        let send = pd.register(INFO, Access::NONE)?;
        let start = pd.register(size, remote)?;
        let rdma = pd.register(size, remote)?;
        let caps =
            QpCaps { max_send_wr: 16, max_recv_wr: 2, max_send_sge: 1, max_recv_sge: 1, ..QpCaps::default() };
        let qp = id.create_qp(&pd, &QpBuilder::rc().caps(caps), &cq, &cq)?;
        let c = Conn { cq, qp, recv, send, start, rdma, _pd: pd };
        c.post_recv()?;
        Ok(c)
    }

    fn post_recv(&self) -> Result<(), Fail> {
        self.qp.post_recv(RecvWr { wr_id: 1, sg_list: softrdma::sgl![self.recv.sge(0, INFO)?] })?;
        Ok(())
    }

    fn post(&self, op: SendOp, mr: &MemoryRegion, len: usize) -> Result<(), Fail> {
        let wr = SendWr {
            wr_id: 2,
            op,
            sg_list: softrdma::sgl![mr.sge(0, len)?],
            flags: SendFlags { signaled: true, ..Default::default() },
            ud: None,
        };
        self.qp.post_send(wr)?;
        Ok(())
    }

    /// SENDs an advertisement of `mr`.
    fn advertise(&self, mr: &MemoryRegion) -> Result<(), Fail> {
        let mut info = [0u8; INFO];
        info[..8].copy_from_slice(&mr.addr().to_be_bytes());
        info[8..12].copy_from_slice(&mr.rkey().0.to_be_bytes());
        info[12..].copy_from_slice(&(mr.len() as u32).to_be_bytes());
        self.send.write(0, &info)?;
        self.post(SendOp::Send, &self.send, INFO)
    }

    /// Waits for a completion of `want`; other successful completions pass. `None` when
    /// the connection went away (flushed work requests).
    fn wait(&self, want: WcOpcode) -> Result<Option<()>, Fail> {
        loop {
            let wc = self.cq.wait_one_timeout(STEP).ok_or("no completion within 30 s")?;
            if wc.status == WcStatus::WrFlushErr {
                return Ok(None);
            }
            if wc.status != WcStatus::Success {
                return Err(format!("{:?} completion failed: {:?}", wc.opcode, wc.status).into());
            }
            if wc.opcode == want {
                return Ok(Some(()));
            }
        }
    }

    /// Waits for the peer's next message; returns its advertisement.
    fn receive(&self) -> Result<Option<(u64, u32, u32)>, Fail> {
        if self.wait(WcOpcode::Recv)?.is_none() {
            return Ok(None);
        }
        let mut info = [0u8; INFO];
        self.recv.read(0, &mut info)?;
        self.post_recv()?;
        let addr = u64::from_be_bytes(info[..8].try_into()?);
        let rkey = u32::from_be_bytes(info[8..12].try_into()?);
        let len = u32::from_be_bytes(info[12..].try_into()?);
        Ok(Some((addr, rkey, len)))
    }
}

/// The next event of `ch`, which must be `want`.
fn expect(ch: &EventChannel, want: CmEventKind, debug: bool) -> Result<CmEvent, Fail> {
    let ev = ch.get_event_timeout(STEP).ok_or_else(|| format!("no {want} within 30 s"))?;
    if debug {
        eprintln!("cma_event type {} cma_id {:?} status {}", ev.kind, ev.id.local_addr(), ev.status);
    }
    if ev.kind != want {
        return Err(format!("{} (status {}) while waiting for {want}", ev.kind, ev.status).into());
    }
    Ok(ev)
}

fn conn_param() -> ConnParam {
    ConnParam {
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        ..Default::default()
    }
}

/// rping's ping text: `rdma-ping-N: ` then letters from `first`, wrapping from 'z' to
/// 'A', NUL-terminated at the end of the buffer.
pub fn ping_text(n: u64, first: u8, size: usize) -> Vec<u8> {
    let mut b = format!("rdma-ping-{n}: ").into_bytes();
    b.truncate(size.saturating_sub(1));
    let mut c = first;
    while b.len() < size {
        b.push(c);
        c = if c >= b'z' { b'A' } else { c + 1 };
    }
    if let Some(last) = b.last_mut() {
        *last = 0;
    }
    b
}

fn text(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn client(a: &RpingArgs) -> Result<(), Fail> {
    let dst = a.addr.ok_or("the client needs the server's address (-a)")?;
    let ch = EventChannel::new()?;
    let id = CmId::new(&ch, PortSpace::Tcp);
    id.resolve_addr(a.source, SocketAddr::new(dst, a.port), Duration::from_secs(2))?;
    expect(&ch, CmEventKind::AddrResolved, a.debug)?;
    id.resolve_route(Duration::from_secs(2))?;
    expect(&ch, CmEventKind::RouteResolved, a.debug)?;
    let size = a.size as usize;
    let conn = Conn::new(&id, size)?;
    id.connect(&conn_param())?;
    expect(&ch, CmEventKind::Established, a.debug)?;
    let mut first = b'A';
    let mut n = 0u64;
    while a.count.is_none_or(|c| n < c) {
        let ping = ping_text(n, first, size);
        first = if first >= b'z' { b'A' } else { first + 1 };
        conn.start.write(0, &ping)?;
        conn.rdma.write(0, &vec![0; size])?;
        conn.advertise(&conn.start)?;
        // The server read the buffer and says go ahead.
        conn.receive()?.ok_or("the server went away")?;
        conn.advertise(&conn.rdma)?;
        // The server wrote the data back.
        conn.receive()?.ok_or("the server went away")?;
        let back = conn.rdma.to_vec();
        if a.validate && back != ping {
            return Err("data mismatch!".into());
        }
        if a.verbose {
            println!("ping data: {}", text(&back));
        }
        n += 1;
    }
    id.disconnect()?;
    expect(&ch, CmEventKind::Disconnected, a.debug)?;
    if a.debug {
        eprintln!("rping: {n} iterations");
    }
    Ok(())
}

fn server(a: &RpingArgs) -> Result<(), Fail> {
    let ch = EventChannel::new()?;
    let listener = CmId::new(&ch, PortSpace::Tcp);
    let addr = a.addr.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    listener.bind_addr(SocketAddr::new(addr, a.port))?;
    listener.listen(3)?;
    loop {
        let ev = loop {
            // A persistent server waits for clients indefinitely.
            if let Some(ev) = ch.get_event_timeout(STEP) {
                break ev;
            }
            if !a.persistent {
                return Err("no connection request within 30 s".into());
            }
        };
        if a.debug {
            eprintln!("cma_event type {} status {}", ev.kind, ev.status);
        }
        if ev.kind != CmEventKind::ConnectRequest {
            continue;
        }
        let child = ev.id.clone();
        let conn = Conn::new(&child, a.size as usize)?;
        child.accept(&conn_param())?;
        expect(&ch, CmEventKind::Established, a.debug)?;
        serve(a, &conn)?;
        // The client disconnects when it is done; a client that does not is disconnected.
        match ch.get_event_timeout(Duration::from_secs(5)) {
            Some(ev) if ev.kind == CmEventKind::Disconnected => {}
            _ => {
                child.disconnect()?;
                let _ = ch.get_event_timeout(Duration::from_secs(5));
            }
        }
        if !a.persistent {
            return Ok(());
        }
    }
}

/// The server's side of the iterations, until the count or until the client leaves.
fn serve(a: &RpingArgs, conn: &Conn) -> Result<(), Fail> {
    let mut n = 0u64;
    while a.count.is_none_or(|c| n < c) {
        let Some((addr, rkey, len)) = conn.receive()? else { return Ok(()) };
        let len = (len as usize).min(conn.rdma.len());
        conn.post(SendOp::Read { remote_addr: addr, rkey: Rkey(rkey) }, &conn.rdma, len)?;
        if conn.wait(WcOpcode::RdmaRead)?.is_none() {
            return Ok(());
        }
        let data = conn.rdma.to_vec();
        if a.verbose {
            println!("server ping data: {}", text(&data[..len]));
        }
        conn.post(SendOp::Send, &conn.send, INFO)?;
        let Some((addr, rkey, _)) = conn.receive()? else { return Ok(()) };
        let n_bytes = data[..len].iter().position(|&c| c == 0).map_or(len, |p| p + 1);
        conn.post(SendOp::Write { remote_addr: addr, rkey: Rkey(rkey) }, &conn.rdma, n_bytes)?;
        if conn.wait(WcOpcode::RdmaWrite)?.is_none() {
            return Ok(());
        }
        conn.post(SendOp::Send, &conn.send, INFO)?;
        n += 1;
    }
    // The last go-ahead has reached the client once it completes.
    conn.wait(WcOpcode::Send)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_text_is_rpings() {
        let t = ping_text(3, b'y', 20);
        assert_eq!(&t, b"rdma-ping-3: yzABCD\0");
        assert_eq!(ping_text(0, b'A', 26).len(), 26);
        assert_eq!(text(&t), "rdma-ping-3: yzABCD");
    }
}
