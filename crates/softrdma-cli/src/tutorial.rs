//! `softrdma tutorial`: the OFA tutorial's four ping-pongs (seed 003) between two
//! processes, ranked by round-trip time with each side's CPU use, as the tutorial's
//! summary slide ranks them. The ping-pongs' code is the `tutorial` example's.

use std::net::{IpAddr, SocketAddr};

#[path = "../../softrdma/examples/tutorial/pingpong.rs"]
#[allow(dead_code, unreachable_pub)]
mod pingpong;

/// Arguments of `softrdma tutorial`.
#[derive(Debug, clap::Args)]
pub struct TutorialArgs {
    /// Round trips per ping-pong.
    #[arg(short = 'n', long, default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    iters: u32,
    /// Bytes per ping and pong.
    #[arg(short, long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=(64 << 20)))]
    size: u32,
    /// Run only the server (listener and agents) on ADDRESS:PORT.
    #[arg(long, value_name = "ADDRESS:PORT", conflicts_with = "connect")]
    serve: Option<SocketAddr>,
    /// Run the client of one ping-pong against the server at ADDRESS:PORT.
    #[arg(long, value_name = "ADDRESS:PORT", requires = "variant")]
    connect: Option<SocketAddr>,
    /// The client's ping-pong: send-recv-busy, send-recv-notify, write-read,
    /// write-read-unsignaled.
    #[arg(long, value_parser = parse_variant)]
    variant: Option<pingpong::Variant>,
    /// The client's local address.
    #[arg(long)]
    bind: Option<IpAddr>,
}

fn parse_variant(s: &str) -> Result<pingpong::Variant, String> {
    pingpong::Variant::parse(s)
        .ok_or_else(|| "one of send-recv-busy, send-recv-notify, write-read, write-read-unsignaled".into())
}

pub fn run(a: &TutorialArgs) -> i32 {
    let r = match (a.serve, a.connect, a.variant) {
        (Some(at), _, _) => pingpong::listener(at, 0),
        (None, Some(at), Some(v)) => {
            pingpong::client(at, a.bind, v, a.iters, a.size).map(|o| pingpong::print_table(&[o]))
        }
        _ => std::env::current_exe()
            .map_err(Into::into)
            .and_then(|exe| pingpong::run_all(&exe, &["tutorial", "--serve"], a.iters, a.size)),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("tutorial: {e}");
            1
        }
    }
}
