//! The `softrdma` command.

use clap::{Parser, Subcommand};

mod capture;
mod decode;
mod sim;

/// softrdma: RDMA (RoCEv2) in user space over UDP.
#[derive(Debug, Parser)]
#[command(name = "softrdma", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Decode the RoCEv2 packets in pcap/pcapng captures and check their ICRCs.
    ///
    /// Prints one line per packet to UDP port 4791 and a summary. Exit status: 0 when every
    /// packet is well-formed with a good ICRC, 1 when any is not, 2 when a file cannot be read.
    Decode(decode::DecodeArgs),
    /// Run a mixed RC workload between two simulated endpoints over an impaired network.
    ///
    /// Deterministic for a given seed: loss, duplication, reordering and corruption all come
    /// from it. Every byte and completion is checked; the last line reports
    /// `ops=N completed=N data-errors=0 status-errors=0 ...`, and any error exits 1.
    Sim(sim::SimArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Decode(args) => decode::run(&args),
        Command::Sim(args) => sim::run(&args),
    };
    std::process::exit(code);
}
