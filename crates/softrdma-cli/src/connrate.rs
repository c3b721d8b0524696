//! `softrdma connrate`: connection setup rate and latency through the connection manager,
//! beside TCP `connect()` on the same addresses, in one run.
//!
//! The server listens with rdma_cm (an RC QP per connection, accepted as rping does) and
//! with a TCP socket on the same port number. The client makes `-n` connections one after
//! another, then `--concurrent` at once, first through the CM (resolve, route, QP, connect,
//! ESTABLISHED; then disconnect) and then over TCP (connect; then close), and prints the
//! rates (everything an application pays: ID, resolution, QP, handshake), the latency
//! percentiles (client: `connect` to ESTABLISHED against TCP's `connect`) and the ratios. The server reports its
//! side (CONNECT_REQUEST to ESTABLISHED) on stdout when the client is done.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::cmatose::{Fail, STEP};
use softrdma::cm::{CmEventKind, CmId, ConnParam, EventChannel, PortSpace};
use softrdma::{Access, QpBuilder, QpCaps};

/// Arguments of `softrdma connrate`.
#[derive(Debug, clap::Args)]
pub struct ConnrateArgs {
    /// Run as the server, listening on this address.
    #[arg(long, conflicts_with = "server")]
    pub listen: Option<IpAddr>,
    /// The server's address (client).
    pub server: Option<IpAddr>,
    /// The client's source address.
    #[arg(short = 'b')]
    pub bind: Option<IpAddr>,
    /// rdma_cm port, and the TCP port of the baseline.
    #[arg(short = 'p', default_value_t = 7300)]
    pub port: u16,
    /// Sequential connections.
    #[arg(short = 'n', default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub sequential: u32,
    /// Concurrent connections.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub concurrent: u32,
}

pub fn run(a: &ConnrateArgs) -> i32 {
    let r = match (a.listen, a.server) {
        (Some(l), None) => server(a, l),
        (None, Some(s)) => client(a, s),
        _ => Err("give --listen ADDR (server) or the server's address (client)".into()),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("connrate: {e}");
            1
        }
    }
}

/// Percentiles of latencies, in microseconds.
fn pct(v: &mut [Duration]) -> String {
    v.sort_unstable();
    let at = |p: f64| v.get(((v.len() - 1) as f64 * p) as usize).map_or(0.0, |d| d.as_secs_f64() * 1e6);
    format!("p50 {:.0} µs, p99 {:.0} µs", at(0.5), at(0.99))
}

fn qp_for(id: &CmId) -> Result<(softrdma::CompletionQueue, std::sync::Arc<softrdma::QueuePair>), Fail> {
    let ctx = id.context().ok_or("the CM ID has no device")?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4, None)?;
    let caps =
        QpCaps { max_send_wr: 2, max_recv_wr: 2, max_send_sge: 1, max_recv_sge: 1, ..QpCaps::default() };
    let qp = id.create_qp(&pd, &QpBuilder::rc().caps(caps).access(Access::NONE), &cq, &cq)?;
    Ok((cq, qp))
}

fn server(a: &ConnrateArgs, addr: IpAddr) -> Result<(), Fail> {
    let ch = EventChannel::new()?;
    let listener = CmId::new(&ch, PortSpace::Tcp);
    listener.bind_addr(SocketAddr::new(addr, a.port))?;
    listener.listen(4096)?;
    let tcp = TcpListener::bind(SocketAddr::new(addr, a.port))?;
    // TCP: accept and close until the client's last connection says "done".
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for s in tcp.incoming() {
            let Ok(mut s) = s else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            let mut b = [0u8; 4];
            if s.read(&mut b).is_ok_and(|n| n == 4) && &b == b"done" {
                let _ = done_tx.send(());
                return;
            }
        }
    });
    let mut lat = Vec::new();
    let mut conns = Vec::new();
    loop {
        let Some(ev) = ch.get_event_timeout(Duration::from_secs(120)) else { break };
        match ev.kind {
            CmEventKind::ConnectRequest => {
                if ev.param.private_data.first() == Some(&0xFF) {
                    // The client's farewell.
                    ev.id.reject(&[])?;
                    break;
                }
                let t = Instant::now();
                let res = qp_for(&ev.id)?;
                ev.id.accept(&ConnParam::default())?;
                conns.push((ev.id.clone(), res, t));
            }
            CmEventKind::Established => {
                if let Some((_, _, t)) = conns.iter().find(|(id, _, _)| id.same(&ev.id)) {
                    lat.push(t.elapsed());
                }
            }
            CmEventKind::Disconnected => {
                conns.retain(|(id, _, _)| !id.same(&ev.id));
            }
            _ => {}
        }
    }
    // The client says done over TCP after its last CM connection; a client that never
    // does is not waited for long.
    let _ = done_rx.recv_timeout(Duration::from_secs(10));
    println!("server: {} CM connections, CONNECT_REQUEST to ESTABLISHED {}", lat.len(), pct(&mut lat));
    Ok(())
}

/// A connection the client holds: its ID and its QP.
struct Setup {
    id: CmId,
    _res: (softrdma::CompletionQueue, std::sync::Arc<softrdma::QueuePair>),
}

fn client(a: &ConnrateArgs, server: IpAddr) -> Result<(), Fail> {
    let dst = SocketAddr::new(server, a.port);
    let ch = EventChannel::new()?;
    let wait = |want: CmEventKind| -> Result<softrdma::cm::CmEvent, Fail> {
        let ev = ch.get_event_timeout(STEP).ok_or_else(|| format!("no {want} within 30 s"))?;
        if ev.kind != want {
            return Err(format!("{} (status {}) while waiting for {want}", ev.kind, ev.status).into());
        }
        Ok(ev)
    };
    // Sequential CM connections.
    let mut cm_lat = Vec::new();
    let start = Instant::now();
    for _ in 0..a.sequential {
        let id = CmId::new(&ch, PortSpace::Tcp);
        id.resolve_addr(a.bind, dst, STEP)?;
        wait(CmEventKind::AddrResolved)?;
        id.resolve_route(STEP)?;
        wait(CmEventKind::RouteResolved)?;
        let res = qp_for(&id)?;
        let t = Instant::now();
        id.connect(&ConnParam::default())?;
        wait(CmEventKind::Established)?;
        cm_lat.push(t.elapsed());
        id.disconnect()?;
        wait(CmEventKind::Disconnected)?;
        drop(Setup { id, _res: res });
    }
    let cm_seq = start.elapsed();
    // Concurrent CM connections.
    let start = Instant::now();
    let ids: Vec<CmId> = (0..a.concurrent).map(|_| CmId::new(&ch, PortSpace::Tcp)).collect();
    for id in &ids {
        id.resolve_addr(a.bind, dst, STEP)?;
    }
    let mut setups = Vec::new();
    let mut up = 0;
    while up < a.concurrent {
        let ev = ch.get_event_timeout(STEP).ok_or("stalled connecting concurrently")?;
        match ev.kind {
            CmEventKind::AddrResolved => ev.id.resolve_route(STEP)?,
            CmEventKind::RouteResolved => {
                let res = qp_for(&ev.id)?;
                ev.id.connect(&ConnParam::default())?;
                setups.push(Setup { id: ev.id.clone(), _res: res });
            }
            CmEventKind::Established => up += 1,
            k => return Err(format!("{k} (status {}) while connecting concurrently", ev.status).into()),
        }
    }
    let cm_conc = start.elapsed();
    for s in &setups {
        s.id.disconnect()?;
    }
    let mut down = 0;
    while down < a.concurrent {
        let ev = ch.get_event_timeout(STEP).ok_or("stalled disconnecting")?;
        if ev.kind == CmEventKind::Disconnected {
            down += 1;
        }
    }
    drop(setups);
    drop(ids);

    // TCP, sequential and concurrent, on the same addresses.
    let local = a.bind.map(|b| SocketAddr::new(b, 0));
    let tcp_connect = || -> Result<TcpStream, Fail> {
        let sock = socket2::Socket::new(socket2::Domain::for_address(dst), socket2::Type::STREAM, None)?;
        if let Some(l) = local {
            // The port is picked at connect() time, as for an unbound socket: without
            // this, bind() searches the ephemeral range past every TIME_WAIT and TCP
            // would look slower than it is.
            let one: libc::c_int = 1;
            // SAFETY: sets an int option on a socket we own, from a valid int.
            unsafe {
                libc::setsockopt(
                    std::os::fd::AsRawFd::as_raw_fd(&sock),
                    libc::IPPROTO_IP,
                    libc::IP_BIND_ADDRESS_NO_PORT,
                    (&one as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            sock.bind(&l.into())?;
        }
        sock.connect(&dst.into())?;
        Ok(sock.into())
    };
    let mut tcp_lat = Vec::new();
    let start = Instant::now();
    for _ in 0..a.sequential {
        let t = Instant::now();
        let s = tcp_connect()?;
        tcp_lat.push(t.elapsed());
        drop(s);
    }
    let tcp_seq = start.elapsed();
    let start = Instant::now();
    let socks: Vec<TcpStream> = (0..a.concurrent).map(|_| tcp_connect()).collect::<Result<_, _>>()?;
    let tcp_conc = start.elapsed();
    drop(socks);
    tcp_connect()?.write_all(b"done")?;
    // Tell the CM side we are done: a request it recognises and rejects.
    let bye = CmId::new(&ch, PortSpace::Tcp);
    bye.resolve_addr(a.bind, dst, STEP)?;
    wait(CmEventKind::AddrResolved)?;
    bye.resolve_route(STEP)?;
    wait(CmEventKind::RouteResolved)?;
    bye.connect(&ConnParam { private_data: vec![0xFF], ..Default::default() })?;
    let _ = ch.get_event_timeout(Duration::from_secs(5));

    let rate = |n: u32, d: Duration| f64::from(n) / d.as_secs_f64();
    let (cs, ts) = (rate(a.sequential, cm_seq), rate(a.sequential, tcp_seq));
    let (cc, tc) = (rate(a.concurrent, cm_conc), rate(a.concurrent, tcp_conc));
    println!("connection setup, {} sequential and {} concurrent, to {server}:", a.sequential, a.concurrent);
    println!("  rdma_cm sequential: {cs:>9.0} conn/s  client {}", pct(&mut cm_lat));
    println!("  TCP     sequential: {ts:>9.0} conn/s  client {}", pct(&mut tcp_lat));
    println!("  rdma_cm concurrent: {cc:>9.0} conn/s  ({:.1} ms for all)", cm_conc.as_secs_f64() * 1e3);
    println!("  TCP     concurrent: {tc:>9.0} conn/s  ({:.1} ms for all)", tcp_conc.as_secs_f64() * 1e3);
    println!("ratio rdma_cm/TCP: sequential {:.3}, concurrent {:.3}", cs / ts, cc / tc);
    Ok(())
}
