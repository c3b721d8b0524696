//! What the ICRC of one packet costs, sent or checked, by body size (BTH onwards): the
//! loop alternates two flows (a ping-pong's two directions), as a busy thread does. Then
//! what the copy of a full packet's payload costs (4 KiB from a 64 KiB region walked as a
//! stream's sender walks it, into a 256 KiB buffer of packets), the copy the sender makes
//! to hash the bytes it sends and the receiver makes to place them. The last line gives
//! the figures as JSON (`bench/compare.sh` reads it for the floors of issue 14's targets).
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
    let mut json = Vec::new();
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
        json.push(format!("\"icrc_{len}_ns\": {per:.1}"));
    }
    let region = vec![0x5au8; 64 << 10];
    let mut packets = vec![0u8; 256 << 10];
    let n = 1_000_000;
    let start = Instant::now();
    for i in 0..n {
        let from = (i % 16) * 4096;
        let to = (i % 64) * 4096;
        packets[to..to + 4096].copy_from_slice(std::hint::black_box(&region[from..from + 4096]));
        std::hint::black_box(&packets);
    }
    let per = start.elapsed().as_nanos() as f64 / n as f64;
    println!("copy of a 4096-byte payload: {per:.1} ns");
    json.push(format!("\"copy_4096_ns\": {per:.1}"));
    println!("{{{}}}", json.join(", "));
}
