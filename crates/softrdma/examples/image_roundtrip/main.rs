//! The image round trip: a client sends a picture to a server, the server processes it
//! (Gaussian blur, Sobel edges or grayscale, with the `image` crate) and sends the result
//! back; the client checks it against the same processing done locally and writes a PNG.
//!
//! ```text
//! cargo run --release --example image_roundtrip                      # both variants, two local processes
//! cargo run --release --example image_roundtrip -- --task edges --size 4096x4096
//! cargo run --release --example image_roundtrip -- --server 10.0.0.1:7471         # host A
//! cargo run --release --example image_roundtrip -- --connect 10.0.0.1:7471 --input me.png  # host B
//! ```
//!
//! Built on the connection manager's convenience layer ([`softrdma::cm::Ep`]) and the
//! managed layer ([`softrdma::managed`]): registered typed buffers that travel with their
//! operations. Two ways to move the pixels:
//!
//! - `send`: SEND/RECV. The client announces the picture, the server posts a receive of
//!   that size and says "ready", the client SENDs it; the result comes back the same way.
//! - `write-imm`: RDMA WRITE with immediate. The server's "ready" carries the address and
//!   R_Key of a buffer it registered for the picture; the client WRITEs into it, and the
//!   immediate data (a receive completion at the server) says it is there. The result goes
//!   back into a buffer the client advertised in its request.

mod imaging;

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use imaging::Task;
use softrdma::cm::{getaddrinfo, AddrHints, ConnParam, Ep};
use softrdma::managed::{Buffer, CompletionPoller, Connection, Op, Pending, Pod, WaitMode, Zeroable};
use softrdma::{Access, QpBuilder, QpCaps, RemoteRegion};

const MAGIC: u32 = 0x494d_4731; // "IMG1"
/// The largest picture a server accepts (width x height x 4 bytes).
const MAX_BYTES: u64 = 1 << 30;
/// How long each side waits for each step of the other.
const STEP: Duration = Duration::from_secs(60);
const DEFAULT_PORT: u16 = 7471;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Variant {
    /// SEND/RECV both ways.
    Send,
    /// RDMA WRITE with immediate into buffers the peer advertised.
    WriteImm,
    /// One round trip of each.
    Both,
}

#[derive(Parser, Debug)]
#[command(about = "Send a picture to a server over softrdma, get it back processed, and check it")]
struct Args {
    /// Run the server, listening on ADDRESS[:PORT].
    #[arg(long, value_name = "ADDRESS[:PORT]", conflicts_with = "connect")]
    server: Option<String>,
    /// Serve this many clients, then exit (0: serve until killed).
    #[arg(long, default_value_t = 0)]
    clients: u32,
    /// Run the client against the server at ADDRESS[:PORT].
    #[arg(long, value_name = "ADDRESS[:PORT]")]
    connect: Option<String>,
    /// The client's local address.
    #[arg(long)]
    bind: Option<IpAddr>,
    /// What the server does to the picture.
    #[arg(long, value_enum, default_value = "blur")]
    task: Task,
    /// The Gaussian blur's sigma.
    #[arg(long, default_value_t = 2.0)]
    sigma: f32,
    /// How the pixels travel.
    #[arg(long, value_enum, default_value = "both")]
    variant: Variant,
    /// The picture to send (PNG, JPEG-less build: PNG only); default: the one shipped
    /// beside this example.
    #[arg(long, conflicts_with = "size")]
    input: Option<PathBuf>,
    /// Send a generated picture of WIDTHxHEIGHT pixels instead (e.g. 4096x4096: 64 MiB).
    #[arg(long, value_parser = parse_size)]
    size: Option<(u32, u32)>,
    /// Where to write the result (default: the temporary directory).
    #[arg(long)]
    output: Option<PathBuf>,
}

fn parse_size(s: &str) -> Result<(u32, u32), String> {
    let (w, h) = s.split_once('x').ok_or("WIDTHxHEIGHT, e.g. 4096x4096")?;
    let (w, h): (u32, u32) = (w.parse().map_err(|e| format!("{e}"))?, h.parse().map_err(|e| format!("{e}"))?);
    if w == 0 || h == 0 || u64::from(w) * u64::from(h) * 4 > MAX_BYTES {
        return Err(format!("between 1x1 and {} bytes of RGBA", MAX_BYTES));
    }
    Ok((w, h))
}

/// The client's announcement.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Pod, Zeroable)]
struct Request {
    magic: u32,
    task: u32,
    width: u32,
    height: u32,
    sigma: f32,
    /// 1: the result comes back with RDMA WRITE with immediate into `reply`.
    write_imm: u32,
    reply_addr: u64,
    reply_len: u64,
    reply_rkey: u32,
    _pad: u32,
}

/// The server's go-ahead: where to WRITE the picture (write-imm), or just "posted".
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Pod, Zeroable)]
struct Ready {
    addr: u64,
    len: u64,
    rkey: u32,
    /// 0: go ahead; otherwise why not (1 bad request, 2 too large, 3 no memory).
    status: u32,
}

/// The server's report after a SEND result (write-imm carries it in the immediate).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Pod, Zeroable)]
struct Reply {
    process_us: u32,
    status: u32,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    let args = Args::parse();
    let result = if let Some(at) = &args.server {
        serve(at, args.clients)
    } else if let Some(at) = &args.connect {
        let variants = match args.variant {
            Variant::Both => vec![Variant::Send, Variant::WriteImm],
            v => vec![v],
        };
        variants.into_iter().try_for_each(|v| client(&args, at, v, args.bind))
    } else {
        local(&args)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("image_roundtrip: {e}");
            ExitCode::FAILURE
        }
    }
}

fn socket_addr(s: &str) -> Result<SocketAddr, BoxError> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    Ok(SocketAddr::new(
        s.parse::<IpAddr>().map_err(|_| format!("{s:?} is not ADDRESS[:PORT]"))?,
        DEFAULT_PORT,
    ))
}

/// No `--server` or `--connect`: a server process on one loopback address, this process
/// as the client on another.
fn local(args: &Args) -> Result<(), BoxError> {
    let n = 2 + (std::process::id() % 200) as u8;
    let server_ip = IpAddr::from([127, 0, 33, n]);
    let client_ip = IpAddr::from([127, 0, 34, n]);
    let at = SocketAddr::new(server_ip, DEFAULT_PORT).to_string();
    let rounds = if args.variant == Variant::Both { 2 } else { 1 };
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--server", &at, "--clients", &rounds.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    // Wait for the server's "listening" line (bounded by the server exiting).
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    if !line.starts_with("listening") {
        let _ = child.kill();
        return Err(format!("the server did not start: {line:?}").into());
    }
    print!("server: {line}");
    let variants = match args.variant {
        Variant::Both => vec![Variant::Send, Variant::WriteImm],
        v => vec![v],
    };
    let outcome = variants.into_iter().try_for_each(|v| client(args, &at, v, Some(client_ip)));
    if outcome.is_err() {
        let _ = child.kill();
    }
    let deadline = Instant::now() + STEP;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err("the server did not exit".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    outcome?;
    if !status.success() {
        return Err(format!("the server failed: {status}").into());
    }
    Ok(())
}

/// A connection's managed resources.
struct Link {
    ep: Ep,
    pd: softrdma::ProtectionDomain,
    conn: Connection,
}

fn make_link(mut ep: Ep) -> Result<Link, BoxError> {
    let ctx = ep.id().context().ok_or("the CM ID has no device")?;
    let pd = ctx.alloc_pd();
    let poller = CompletionPoller::new(&ctx, 16, WaitMode::Event)?;
    let caps = QpCaps { max_send_wr: 8, max_recv_wr: 8, ..QpCaps::default() };
    let builder = QpBuilder::rc().caps(caps).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let qp = ep.create_qp(&pd, &builder, poller.cq(), poller.cq())?;
    let conn = Connection::new(qp, &poller)?;
    Ok(Link { ep, pd, conn })
}

fn wait<T: Pod>(p: Pending<T>, what: &str) -> Result<softrdma::managed::Done<T>, BoxError> {
    let done = p.wait_timeout(STEP).map_err(|_| format!("{what}: no completion in {STEP:?}"))?;
    done.check().map_err(|e| format!("{what}: {e}").into())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn client(args: &Args, at: &str, variant: Variant, bind: Option<IpAddr>) -> Result<(), BoxError> {
    // The picture, as RGBA bytes.
    let img = match (&args.input, args.size) {
        (_, Some((w, h))) => imaging::mandelbrot(w, h),
        (Some(p), None) => image::open(p).map_err(|e| format!("{}: {e}", p.display()))?.to_rgba8(),
        (None, None) => image::load_from_memory(include_bytes!("input.png"))?.to_rgba8(),
    };
    let (width, height) = img.dimensions();
    let pixels = img.into_raw();
    let out_len = width as usize * height as usize * args.task.out_channels();

    // Setup: resolve, create the endpoint, CQ (poller) and QP, register memory, connect.
    let dst = socket_addr(at)?;
    let hints = AddrHints { src: bind, ..AddrHints::default() };
    let info = getaddrinfo(Some(&dst.ip().to_string()), Some(&dst.port().to_string()), &hints)?;
    let link = make_link(Ep::create(&info[0], None, None)?)?;
    let Link { mut ep, pd, conn } = link;
    let write_imm = variant == Variant::WriteImm;
    let reply_access =
        if write_imm { Access::LOCAL_WRITE | Access::REMOTE_WRITE } else { Access::LOCAL_WRITE };
    let result = Buffer::<u8>::with_access(&pd, out_len, reply_access)?;
    let reply_at = result.remote().unwrap_or(RemoteRegion { addr: 0, len: 0, rkey: 0 });
    let ready = conn.recv(Buffer::<Ready>::new(&pd, 1)?)?;
    ep.connect(&ConnParam { rnr_retry_count: 7, ..ConnParam::default() })?;

    // Use: announce, get the go-ahead, move the pixels, get the result.
    let request = Request {
        magic: MAGIC,
        task: args.task.code(),
        width,
        height,
        sigma: args.sigma,
        write_imm: u32::from(write_imm),
        reply_addr: reply_at.addr,
        reply_len: reply_at.len,
        reply_rkey: reply_at.rkey,
        _pad: 0,
    };
    let t0 = Instant::now();
    wait(conn.send(Buffer::from_slice(&pd, &[request])?)?, "sending the request")?;
    let go = wait(ready, "waiting for the server")?.buffer.get(0).ok_or("an empty go-ahead")?;
    if go.status != 0 {
        return Err(format!("the server refused the picture (status {})", go.status).into());
    }
    let picture = Buffer::from_slice(&pd, &pixels)?;
    let t_registered = t0.elapsed();
    let t1 = Instant::now();
    let (bytes, up, process_us) = if write_imm {
        let arrival = conn.recv(Buffer::<u8>::new(&pd, 0)?)?;
        let to = RemoteRegion { addr: go.addr, len: go.len, rkey: go.rkey };
        wait(conn.post(Op::WriteWithImm(to, 1), picture)?, "writing the picture")?;
        let up = t1.elapsed();
        // The immediate says the result is in `result`, and how long the server took.
        let imm = wait(arrival, "waiting for the result")?.imm().ok_or("no immediate with the result")?;
        (result.to_vec(), up, imm)
    } else {
        let back = conn.recv(result)?;
        let report = conn.recv(Buffer::<Reply>::new(&pd, 1)?)?;
        wait(conn.send(picture)?, "sending the picture")?;
        let up = t1.elapsed();
        let got = wait(back, "receiving the result")?;
        let rep = wait(report, "receiving the report")?.buffer.get(0).ok_or("an empty report")?;
        if rep.status != 0 {
            return Err(format!("the server failed (status {})", rep.status).into());
        }
        (got.buffer.to_vec(), up, rep.process_us)
    };
    let total = t1.elapsed();
    if bytes.len() != out_len {
        return Err(format!("a result of {} bytes, {out_len} expected", bytes.len()).into());
    }
    let times = Times { setup: t_registered, up, total, process_us };
    finish(args, variant, (width, height), &pixels, bytes, times, ep)
}

/// What the client measured.
struct Times {
    /// Connection to go-ahead, with the picture's registration.
    setup: Duration,
    /// The picture's transfer, until its completion (the server's ACK).
    up: Duration,
    /// From the transfer's start to the result's arrival.
    total: Duration,
    /// The server's processing, as it reported it.
    process_us: u32,
}

fn finish(
    args: &Args,
    variant: Variant,
    (width, height): (u32, u32),
    pixels: &[u8],
    got: Vec<u8>,
    times: Times,
    ep: Ep,
) -> Result<(), BoxError> {
    let Times { setup, up, total, process_us } = times;
    // Break-down: disconnect; the buffers, QP, CQ and PD go as they are dropped.
    ep.disconnect()?;
    drop(ep);
    let t = Instant::now();
    let want =
        imaging::process(args.task, args.sigma, width, height, pixels.to_vec()).ok_or("bad dimensions")?;
    let local = t.elapsed();
    if got != want {
        let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        return Err(
            format!("the result differs from local processing in {wrong} of {} bytes", want.len()).into()
        );
    }
    let name = format!("softrdma-roundtrip-{:?}-{:?}.png", args.task, variant).to_lowercase();
    let path = args.output.clone().unwrap_or_else(|| std::env::temp_dir().join(name));
    imaging::save(args.task, width, height, got, &path)?;
    println!(
        "{variant:?}: {width}x{height} {task:?}: picture {:.1} MiB up in {:.2} ms ({:.0} MiB/s), server processing {:.2} ms, \
         result {:.1} MiB, round trip {:.2} ms (request and registration {:.2} ms); \
         matches local processing ({:.2} ms); wrote {}",
        mib(pixels.len()),
        up.as_secs_f64() * 1e3,
        mib(pixels.len()) / up.as_secs_f64(),
        f64::from(process_us) / 1e3,
        mib(want.len()),
        total.as_secs_f64() * 1e3,
        setup.as_secs_f64() * 1e3,
        local.as_secs_f64() * 1e3,
        path.display(),
        task = args.task,
    );
    Ok(())
}

fn serve(at: &str, clients: u32) -> Result<(), BoxError> {
    let at = socket_addr(at)?;
    let hints = AddrHints { passive: true, ..AddrHints::default() };
    let info = getaddrinfo(Some(&at.ip().to_string()), Some(&at.port().to_string()), &hints)?;
    let listener = Ep::create(&info[0], None, None)?;
    listener.listen(8)?;
    println!("listening on {at}");
    use std::io::Write;
    std::io::stdout().flush()?;
    let (mut served, mut failed) = (0, 0);
    while clients == 0 || served < clients {
        let ep = listener.get_request()?;
        served += 1;
        // The agent: one client at a time; a bad client gets an error line, and the
        // server goes on with the next.
        if let Err(e) = agent(ep) {
            eprintln!("image_roundtrip server: client {served}: {e}");
            failed += 1;
        }
    }
    match failed {
        0 => Ok(()),
        n => Err(format!("{n} of {served} clients failed").into()),
    }
}

fn agent(ep: Ep) -> Result<(), BoxError> {
    let Link { mut ep, pd, conn } = make_link(ep)?;
    let request = conn.recv(Buffer::<Request>::new(&pd, 1)?)?;
    ep.accept(&ConnParam { rnr_retry_count: 7, ..ConnParam::default() })?;
    let got = wait(request, "waiting for the request")?;
    let req = got.buffer.get(0).filter(|r| r.magic == MAGIC).ok_or("not a request")?;
    let refuse = |status: u32| -> Result<(), BoxError> {
        wait(conn.send(Buffer::from_slice(&pd, &[Ready { status, ..Ready::default() }])?)?, "refusing")?;
        Err(format!("refused the request (status {status}): {req:?}").into())
    };
    let Some(task) = Task::from_code(req.task) else { return refuse(1) };
    let in_len = u64::from(req.width) * u64::from(req.height) * 4;
    let out_len = in_len / 4 * task.out_channels() as u64;
    if in_len == 0 || in_len > MAX_BYTES || !(0.0..=100.0).contains(&req.sigma) {
        return refuse(2);
    }
    let write_imm = req.write_imm == 1;
    if write_imm && req.reply_len < out_len {
        return refuse(1);
    }
    let access = if write_imm { Access::LOCAL_WRITE | Access::REMOTE_WRITE } else { Access::LOCAL_WRITE };
    let Ok(input) = Buffer::<u8>::with_access(&pd, in_len as usize, access) else { return refuse(3) };
    // Post where the picture lands, then say go.
    let (arrival, ready, written) = if write_imm {
        let at = input.remote().expect("registered with remote write");
        let ready = Ready { addr: at.addr, len: at.len, rkey: at.rkey, status: 0 };
        (conn.recv(Buffer::<u8>::new(&pd, 0)?)?, ready, Some(input))
    } else {
        (conn.recv(input)?, Ready::default(), None)
    };
    wait(conn.send(Buffer::from_slice(&pd, &[ready])?)?, "sending the go-ahead")?;
    let landed = wait(arrival, "waiting for the picture")?;
    let pixels = match written {
        Some(input) => input.to_vec(),
        None => landed.buffer.to_vec(),
    };
    if pixels.len() as u64 != in_len {
        return Err(format!("a picture of {} bytes, {in_len} announced", pixels.len()).into());
    }
    let t = Instant::now();
    let out = imaging::process(task, req.sigma, req.width, req.height, pixels).ok_or("bad dimensions")?;
    let process_us = t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
    let result = Buffer::from_slice(&pd, &out)?;
    if write_imm {
        let to = RemoteRegion { addr: req.reply_addr, len: req.reply_len, rkey: req.reply_rkey };
        wait(conn.post(Op::WriteWithImm(to, process_us), result)?, "writing the result")?;
    } else {
        wait(conn.send(result)?, "sending the result")?;
        wait(conn.send(Buffer::from_slice(&pd, &[Reply { process_us, status: 0 }])?)?, "sending the report")?;
    }
    // Stay until the client has disconnected (its receives are done by then).
    let deadline = Instant::now() + STEP;
    while !ep.peer_disconnected() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}
