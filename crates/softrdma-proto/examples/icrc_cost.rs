//! What the ICRC of one packet costs, sent or checked, by body size (BTH onwards): the
//! loop alternates two flows (a ping-pong's two directions), as a busy thread does.
//!
//! ```text
//! cargo run --release -p softrdma-proto --example icrc_cost
//! ```

use std::net::SocketAddr;
use std::time::Instant;

use softrdma_proto::wire::icrc::{compute, Encap};

fn main() {
    let a: SocketAddr = "127.0.0.2:4791".parse().expect("address");
    let b: SocketAddr = "127.0.0.3:4791".parse().expect("address");
    let flows = [Encap::new(a, b).expect("IPv4"), Encap::new(b, a).expect("IPv4")];
    // An ACK, an 8-byte SEND, a 40-byte SEND with immediate, a full 4 KiB packet.
    for len in [16usize, 28, 60, 4108] {
        let body = vec![0x5au8; len];
        let n = 4_000_000 / (1 + len / 64);
        let start = Instant::now();
        let mut x = 0u32;
        for i in 0..n {
            x = x.wrapping_add(compute(&flows[i % 2], std::hint::black_box(&body)));
        }
        let per = start.elapsed().as_nanos() as f64 / n as f64;
        println!("ICRC of a {len}-byte body: {per:.1} ns ({x:08x})");
    }
}
