//! `softrdma perf`: perftest's benchmarks (`ib_send_bw`, `ib_write_lat`, ...) on softrdma,
//! with perftest's option names, its connection exchange and its output.
//!
//! The server runs without a host; the client connects to it on TCP port 18515 (`-p`).
//! The exchange follows perftest's framing: a 16-byte version string, the cycle buffer and
//! cache line sizes (4 bytes each), the MTU (2 bytes), then one 108-byte
//! `lid:out_reads:qpn:psn:rkey:vaddr:gid:srqn:` message each way, repeated as a barrier.
//! perftest's messages carry no UDP port: both sides use the device port (4791, or
//! `SOFTRDMA_PORT`). After the run the client sends its results as one more line, so
//! the server can print the same table.
//!
//! Bandwidth tests: the client keeps `-t` operations in flight (signaling every
//! `CQ_MOD`th) and reports peak and average MiB/s and the message rate; the peak is the
//! best of ten equal slices of the run. Latency tests report one-way latency (half a round
//! trip) for SEND and WRITE ping-pongs, and the whole operation for READ and atomics, as
//! perftest does: min, max, typical (median), average, standard deviation and the 99%
//! and 99.9% percentiles. `--local` runs the server as a second process on loopback, so
//! one command needs no set-up.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

pub use args::PerfArgs;
use run::cpu_times;
use setup::Session;

use crate::limits;

mod args;
mod cm;
mod perftest;
mod report;
mod run;
mod setup;

type Fail = String;

/// Operations between signaled ones in BW tests (perftest's CQ moderation; lowered to
/// `-t` when that is smaller, [`args::cq_mod`]).
const CQ_MOD: u64 = 100;
/// The cycle buffer size of perftest's exchange.
const CYCLE_BUFFER: usize = 4096;

/// Runs the command; returns the process exit status.
pub fn run(args: &PerfArgs) -> i32 {
    if let Err(e) = args::check(args) {
        eprintln!("softrdma perf: {e}");
        return limits::USAGE;
    }
    match perf(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("softrdma perf: {e}");
            1
        }
    }
}

fn perf(args: &PerfArgs) -> Result<(), Fail> {
    if args.local {
        return local(args);
    }
    if let (_, Some(warning)) = args::mtu(args, args::device(args)?.active_mtu()) {
        eprintln!("softrdma perf: {warning}");
    }
    // With -R the control connection comes first: its device is the benchmark's.
    let (ctx, control) = if args.rdma_cm {
        perftest::announce(args);
        let c = cm::Control::connect(args)?;
        (c.context()?, Some(c))
    } else {
        (setup::open(args)?, None)
    };
    let sizes = args::sizes(args, args::mtu(args, ctx.device().active_mtu()).0.bytes() as usize)?;
    let max = *sizes.iter().max().unwrap_or(&8);
    let mut s = Session::new(args, ctx, max)?;
    let mut stream = s.exchange(control)?;
    s.header();
    report::columns(args);
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    for (k, &size) in sizes.iter().enumerate() {
        if tty && sizes.len() > 1 {
            eprint!("\r[{}/{}] {} bytes ", k + 1, sizes.len(), size);
        }
        s.barrier(&mut stream)?;
        let cpu0 = cpu_times();
        let t0 = Instant::now();
        let result = if s.client { s.run_client(size)? } else { s.run_server(size, &mut stream)? };
        let elapsed = t0.elapsed().as_secs_f64();
        let cpu = cpu_times().map(|c| (c.0 - cpu0.map_or(0.0, |z| z.0), c.1 - cpu0.map_or(0.0, |z| z.1)));
        // One-sided BW tests: the client's numbers are the results, and it tells the server
        // the way perftest does. send_bw and the latency tests: each side reports what it
        // measured.
        let one_sided_bw = args.test.is_bw() && !args.test.is_send();
        let result = if one_sided_bw { s.report(&mut stream, size, result)? } else { result };
        if s.client || !result.lat.is_empty() || args.test.is_bw() {
            report::print_result(
                args,
                size,
                &result,
                cpu.map(|(u, s)| (100.0 * u / elapsed, 100.0 * s / elapsed)),
            );
        }
    }
    s.goodbye(&mut stream)?;
    if tty && sizes.len() > 1 {
        eprintln!();
    }
    if !args.json {
        println!("{}", report::LINE);
    }
    Ok(())
}

/// Spawns the server as a second process and runs the client against it. When the server
/// fails, the client has nothing to wait for: the process ends at once with the server's
/// error.
fn local(args: &PerfArgs) -> Result<(), Fail> {
    let (srv, cli) = local_addrs(args.device.as_deref())?;
    // Ports another run may hold: the exchange's TCP port (-p, or a free one) and, unless
    // SOFTRDMA_PORT says, the devices' UDP port (one the kernel picks, free on both
    // addresses, so that runs started together do not meet on 4791).
    let port = match args.port {
        Some(p) => p,
        None => free_tcp_port(srv).ok_or("no free TCP port on the server's address")?,
    };
    let udp = match std::env::var(softrdma::PORT_ENV) {
        Ok(p) => p,
        Err(_) => {
            let p = free_udp_port(srv, cli).ok_or("no UDP port is free on both loopback addresses")?;
            // Single-threaded here: no device is open yet.
            std::env::set_var(softrdma::PORT_ENV, p.to_string());
            p.to_string()
        }
    };
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.arg("perf").arg(args.test.name()).args(["-d", &srv.to_string(), "-p", &port.to_string()]);
    cmd.env(softrdma::PORT_ENV, &udp);
    cmd.args(args::server_flags(args)).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut server = cmd.spawn().map_err(|e| e.to_string())?;
    let pid = server.id();
    // Set once the server is reaped: its pid may then name another process.
    let reaped = Arc::new(Mutex::new(false));
    let client_done = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let done = client_done.clone();
    let reaped_by_waiter = reaped.clone();
    std::thread::spawn(move || {
        // The server's stderr ends when it does; what it says is kept (bounded).
        let mut err = Vec::new();
        if let Some(e) = server.stderr.take() {
            let mut e = e;
            let _ = e.by_ref().take(MAX_SERVER_ERR).read_to_end(&mut err);
            let _ = std::io::copy(&mut e, &mut std::io::sink());
        }
        let err = String::from_utf8_lossy(&err).trim().to_string();
        let status = {
            let mut reaped = reaped_by_waiter.lock().unwrap_or_else(|p| p.into_inner());
            *reaped = true;
            server.wait()
        };
        if let Ok(st) = &status {
            if !st.success() && !done.load(Ordering::SeqCst) {
                eprintln!("softrdma perf: server failed: {err}");
                std::process::exit(1);
            }
        }
        let _ = tx.send((status, err));
    });
    let client = PerfArgs {
        local: false,
        device: Some(cli.to_string()),
        // The server's device address: the exchange's listener and the connection manager
        // (-R) are there.
        host: Some(srv.to_string()),
        port: Some(port),
        ..args::clone_args(args)
    };
    let r = perf(&client);
    client_done.store(true, Ordering::SeqCst);
    if r.is_err() {
        kill(pid, &reaped);
    }
    let Ok((status, err)) = rx.recv_timeout(SERVER_EXIT) else {
        kill(pid, &reaped);
        r?;
        return Err(format!("the server did not exit within {} s of the run", SERVER_EXIT.as_secs()));
    };
    let status = status.map_err(|e| e.to_string())?;
    // A server that exited by itself (not by our kill) has the error that matters.
    if status.code().is_some_and(|c| c != 0) {
        return Err(format!("server failed: {err}"));
    }
    r
}

/// The server's and the client's addresses of a `--local` run: 127.0.0.2 and .3, or with
/// `-d ADDR` (an IPv4 loopback address) ADDR and the next address.
fn local_addrs(device: Option<&str>) -> Result<(std::net::Ipv4Addr, std::net::Ipv4Addr), Fail> {
    let srv = match device {
        None => std::net::Ipv4Addr::new(127, 0, 0, 2),
        Some(d) => match d.parse::<std::net::Ipv4Addr>() {
            Ok(a) if a.is_loopback() && a.octets()[3] < 254 => a,
            _ => {
                return Err(format!(
                "--local -d {d}: takes an IPv4 loopback address (the server's; the client takes the next)"
            ))
            }
        },
    };
    let [a, b, c, d] = srv.octets();
    Ok((srv, std::net::Ipv4Addr::new(a, b, c, d + 1)))
}

/// A TCP port free at `ip`, picked by the kernel.
fn free_tcp_port(ip: std::net::Ipv4Addr) -> Option<u16> {
    std::net::TcpListener::bind((ip, 0)).and_then(|l| l.local_addr()).ok().map(|a| a.port())
}

/// A UDP port free on both addresses, picked by the kernel.
fn free_udp_port(a: std::net::Ipv4Addr, b: std::net::Ipv4Addr) -> Option<u16> {
    let free =
        |p: u16| std::net::UdpSocket::bind((a, p)).is_ok() && std::net::UdpSocket::bind((b, p)).is_ok();
    (0..32).find_map(|_| {
        let p = std::net::UdpSocket::bind((a, 0)).ok()?.local_addr().ok()?.port();
        free(p).then_some(p)
    })
}

/// What is kept of the server's stderr.
const MAX_SERVER_ERR: u64 = 64 << 10;
/// How long the server may take to exit after the client's run.
const SERVER_EXIT: Duration = Duration::from_secs(30);

/// Ends our server child unless it has been reaped (its pid is its own until then).
fn kill(pid: u32, reaped: &Mutex<bool>) {
    let reaped = reaped.lock().unwrap_or_else(|p| p.into_inner());
    if let (false, Ok(pid)) = (*reaped, libc::pid_t::try_from(pid)) {
        // SAFETY: a signal to our own child, which has not been reaped.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}
