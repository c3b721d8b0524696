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
use std::process::{Child, Command, Stdio};
use std::time::Instant;

pub use args::PerfArgs;
use run::cpu_times;
use setup::Session;

mod args;
mod cm;
mod perftest;
mod report;
mod run;
mod setup;

type Fail = String;

/// Operations between signaled ones in BW tests (perftest's CQ moderation).
const CQ_MOD: u64 = 100;
/// The cycle buffer size of perftest's exchange.
const CYCLE_BUFFER: usize = 4096;

/// Runs the command; returns the process exit status.
pub fn run(args: &PerfArgs) -> i32 {
    match perf(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("softrdma perf: {e}");
            1
        }
    }
}

fn perf(args: &PerfArgs) -> Result<(), Fail> {
    args::check(args)?;
    if args.local {
        return local(args);
    }
    // With -R the control connection comes first: its device is the benchmark's.
    let (ctx, control) = if args.rdma_cm {
        perftest::announce(args);
        let c = cm::Control::connect(args)?;
        (c.context()?, Some(c))
    } else {
        (setup::open(args)?, None)
    };
    let sizes = args::sizes(args, ctx.device().active_mtu().bytes() as usize)?;
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

/// Spawns the server as a second process and runs the client against it.
fn local(args: &PerfArgs) -> Result<(), Fail> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.arg("perf").arg(args.test.name()).args(["-d", "127.0.0.2", "-p", &args.port.to_string()]);
    cmd.args(args::server_flags(args)).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut server = ServerGuard(cmd.spawn().map_err(|e| e.to_string())?);
    let client = PerfArgs {
        local: false,
        device: Some("127.0.0.3".into()),
        // The server's device address: the connection manager (-R) reaches it there.
        host: Some("127.0.0.2".into()),
        ..args::clone_args(args)
    };
    let r = perf(&client);
    let status = server.0.wait().map_err(|e| e.to_string())?;
    let mut err = String::new();
    if let Some(mut e) = server.0.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    r?;
    if !status.success() {
        return Err(format!("server failed: {}", err.trim()));
    }
    Ok(())
}

struct ServerGuard(Child);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
