//! `softrdma sim`: a mixed RC workload between two simulated endpoints over an impaired
//! network, every byte and completion checked.

use std::time::{Duration, Instant};

use softrdma_proto::qp::Mtu;
use softrdma_proto::sim::{run_workload, ConnectParams, Impairments, WorkloadConfig};

use crate::limits;

/// Most operations one run takes.
const MAX_OPS: u64 = 1_000_000_000;

/// Arguments of `softrdma sim`.
#[derive(Debug, clap::Args)]
pub struct SimArgs {
    /// Operations to run (SEND, WRITE, READ, atomics, with and without immediate data):
    /// 1 to 10^9.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=MAX_OPS))]
    pub ops: u64,
    /// Datagrams lost, in percent.
    #[arg(long, default_value_t = 0.0, value_parser = limits::percent)]
    pub loss: f64,
    /// Datagrams duplicated, in percent.
    #[arg(long, default_value_t = 0.0, value_parser = limits::percent)]
    pub dup: f64,
    /// Datagrams delayed past later ones, in percent.
    #[arg(long, default_value_t = 0.0, value_parser = limits::percent)]
    pub reorder: f64,
    /// Datagrams with flipped bits, in percent (the ICRC must catch every one).
    #[arg(long, default_value_t = 0.0, value_parser = limits::percent)]
    pub corrupt: f64,
    /// Seed of the workload and of the network's impairments.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Operations in flight at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub depth: u16,
    /// Largest message in bytes.
    #[arg(long, default_value_t = 65536, value_parser = clap::value_parser!(u32).range(8..=(1 << 24)))]
    pub max_size: u32,
    /// Path MTU: 256, 512, 1024, 2048 or 4096.
    #[arg(short = 'm', long, default_value_t = 1024, value_parser = mtu)]
    pub mtu: u32,
    /// Recover from loss by go-back-N only, as towards Linux rxe (default: selective
    /// recovery, as between softrdma peers).
    #[arg(long)]
    pub go_back_n: bool,
}

fn mtu(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(v @ (256 | 512 | 1024 | 2048 | 4096)) => Ok(v),
        _ => Err(format!("{s:?} is not one of 256, 512, 1024, 2048, 4096")),
    }
}

/// Refuses a network that delivers nothing: no operation could complete, and the run
/// would only count how its retries ran out.
fn check(args: &SimArgs) -> Result<(), String> {
    for (flag, v) in [("--loss", args.loss), ("--corrupt", args.corrupt)] {
        if v >= 100.0 {
            return Err(format!(
                "{flag} {v}: no datagram would arrive intact, so no operation could complete"
            ));
        }
    }
    Ok(())
}

/// Runs the command; returns the process exit status.
pub fn run(args: &SimArgs) -> i32 {
    if let Err(e) = check(args) {
        eprintln!("softrdma sim: {e}");
        return limits::USAGE;
    }
    let mtu = match args.mtu {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    };
    let cfg = WorkloadConfig {
        ops: args.ops,
        seed: args.seed,
        impairments: Impairments::from_percent(args.loss, args.dup, args.reorder, args.corrupt),
        depth: usize::from(args.depth),
        max_size: args.max_size as usize,
        params: ConnectParams { mtu, selective: !args.go_back_n, ..ConnectParams::default() },
        time_limit: Duration::from_secs(24 * 3600),
    };
    let start = Instant::now();
    let r = run_workload(cfg);
    let wall = start.elapsed();
    for p in &r.problems {
        eprintln!("error: {p}");
    }
    println!("network: {}", r.net);
    let q = r.requester;
    println!(
        "requester: packets={} retransmits={} timeouts={} probes={} seq-naks={} sacks={} rnr-naks={}",
        q.packets_sent,
        q.retransmits,
        q.timeouts,
        q.probes,
        q.seq_naks_received,
        q.sacks_received,
        q.rnr_naks_received
    );
    let a = r.responder;
    println!("responder: duplicates={} held={} sacks={}", a.duplicates, a.held, a.sacks_sent);
    println!(
        "ops={} completed={} data-errors={} status-errors={} bytes={} virtual-time={:.4}s wall={:.3}s",
        r.ops,
        r.completed,
        r.data_errors,
        r.status_errors,
        r.bytes,
        r.virtual_time.as_secs_f64(),
        wall.as_secs_f64()
    );
    i32::from(r.data_errors + r.status_errors > 0 || r.completed != args.ops)
}
