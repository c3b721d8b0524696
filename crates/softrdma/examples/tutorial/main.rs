//! The OFA tutorial's ping-pongs (seed 003) on softrdma.
//!
//! ```text
//! cargo run --release --example tutorial                  # all four, server in a second process, the table
//! cargo run --release --example tutorial -- server 10.0.0.1:7472
//! cargo run --release --example tutorial -- client 10.0.0.1:7472 write-read [ITERS] [SIZE]
//! ```
//!
//! The code of the ping-pongs is in `pingpong.rs`, step by step as the tutorial numbers
//! its steps; `softrdma tutorial` runs the same code.

mod pingpong;

use std::net::SocketAddr;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match argv.as_slice() {
        [] => pingpong::run_all(&std::env::current_exe().expect("own path"), &["server"], 20_000, 64),
        ["server", at] => at.parse::<SocketAddr>().map_err(Into::into).and_then(|a| pingpong::listener(a, 0)),
        ["client", at, variant, rest @ ..] => (|| {
            let at: SocketAddr = at.parse()?;
            let v = pingpong::Variant::parse(variant)
                .ok_or("variants: send-recv-busy, send-recv-notify, write-read, write-read-unsignaled")?;
            let iters = rest.first().map(|s| s.parse()).transpose()?.unwrap_or(20_000);
            let size = rest.get(1).map(|s| s.parse()).transpose()?.unwrap_or(64);
            let o = pingpong::client(at, None, v, iters, size)?;
            pingpong::print_table(&[o]);
            Ok(())
        })(),
        _ => Err("usage: tutorial [server ADDR:PORT | client ADDR:PORT VARIANT [ITERS] [SIZE]]".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tutorial: {e}");
            ExitCode::FAILURE
        }
    }
}
