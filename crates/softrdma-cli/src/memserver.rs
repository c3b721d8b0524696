//! `softrdma memserver`: exposes one memory region to a peer for one-sided RDMA (WRITE,
//! READ, atomics) and then stays passive — it makes no further verbs call while the peer
//! works on its memory; its progress thread answers everything.
//!
//! Protocol on stdin/stdout, one JSON line each way: it prints its [`EndpointInfo`] (with
//! the region), reads the peer's, connects, and waits for stdin to close. Then it prints
//! the region's CRC-32 and length, so that a test can check what landed without a verbs
//! call.

use std::io::Write;
use std::net::IpAddr;

use softrdma::{Access, ConnectOptions, Context, EndpointInfo, QpBuilder};

use crate::exchange;
use crate::limits;

/// Arguments of `softrdma memserver`.
#[derive(Debug, clap::Args)]
pub struct MemServerArgs {
    /// Local address of the device.
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: IpAddr,
    /// UDP port of the device (0 picks a free one).
    #[arg(long, default_value_t = 0)]
    pub udp_port: u16,
    /// Size of the region in bytes (1 to the device's max_mr_size, and no more than the
    /// memory available: the region is filled with a pattern).
    #[arg(long, default_value_t = 1 << 20)]
    pub size: usize,
}

/// Runs the command; returns the process exit status.
pub fn run(args: &MemServerArgs) -> i32 {
    if let Err(e) = check(args) {
        eprintln!("softrdma memserver: {e}");
        return limits::USAGE;
    }
    match serve(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("softrdma memserver: {e}");
            1
        }
    }
}

fn check(args: &MemServerArgs) -> Result<(), String> {
    if args.size == 0 {
        return Err("--size 0: the region needs at least one byte".into());
    }
    let attr = softrdma::find_device(&args.bind.to_string())
        .map_err(|e| format!("--bind {}: {e}", args.bind))?
        .attr();
    limits::check_regions(&format!("--size {}", args.size), &[limits::mul(args.size, 1)], &attr)
}

fn serve(args: &MemServerArgs) -> Result<(), String> {
    let ctx = Context::open_port(args.bind, args.udp_port).map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(16, None).map_err(|e| e.to_string())?;
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let mr = pd.register(args.size, access).map_err(|e| e.to_string())?;
    let pattern: Vec<u8> = (0..args.size).map(|k| (k % 251) as u8).collect();
    mr.write(0, &pattern).map_err(|e| e.to_string())?;
    let prepared = pd.prepare_qp(&QpBuilder::rc().access(access), &cq, &cq).map_err(|e| e.to_string())?;
    let mine = EndpointInfo { region: Some(mr.remote()), ..prepared.endpoint() };
    let theirs: EndpointInfo = exchange::stdio_swap(&mine).map_err(|e| e.about("bad endpoint"))?;
    exchange::same_family(mine.addr, theirs.addr)?;
    let _qp = prepared.handshake(&theirs, &ConnectOptions::default()).map_err(|e| e.to_string())?;
    // Passive from here on: no verbs call until the peer is done.
    exchange::wait_for_stdin_close().map_err(|e| e.to_string())?;
    let bytes = mr.to_vec();
    writeln!(std::io::stdout(), "{{\"crc32\":{},\"len\":{}}}", crc32fast::hash(&bytes), bytes.len())
        .map_err(|e| e.to_string())?;
    Ok(())
}
