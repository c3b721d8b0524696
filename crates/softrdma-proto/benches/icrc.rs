//! ICRC cost against its baseline, side by side in one run: plain zlib CRC-32 (crc32fast)
//! over the same number of bytes is the floor any ICRC implementation sits on.
//!
//! `cargo bench -p softrdma-proto --bench icrc` prints a markdown table of ns per packet
//! and the ratio to the baseline, for the exact check and the ID-agnostic solver.

use std::hint::black_box;
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use softrdma_proto::wire::{icrc, BthRepr, Opcode, PacketRepr};
use softrdma_proto::{Psn, Qpn};

/// Median ns per call of `f` over several timed batches.
fn time(mut f: impl FnMut() -> u64) -> f64 {
    let mut batch = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..batch {
            black_box(f());
        }
        if t.elapsed() > Duration::from_millis(20) {
            break;
        }
        batch *= 2;
    }
    let mut samples: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..batch {
                black_box(f());
            }
            t.elapsed().as_nanos() as f64 / batch as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn main() {
    let src: SocketAddrV4 = "10.0.0.1:49152".parse().unwrap();
    let dst: SocketAddrV4 = "10.0.0.2:4791".parse().unwrap();
    let encap = icrc::Encap::new(src.into(), dst.into()).unwrap();
    println!("| payload | crc32fast (baseline) | exact ICRC | ratio | ID-agnostic solver | ratio |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for payload_len in [0usize, 64, 1024, 4096] {
        let op = Opcode::new(0x04).unwrap();
        let repr = PacketRepr::new(BthRepr::new(op, Qpn::new(0x11), Psn::new(1)), payload_len);
        let payload: Vec<u8> = (0..payload_len).map(|i| i as u8).collect();
        let mut pkt = vec![0u8; repr.total_len()];
        repr.emit(&mut pkt, &payload, &encap).unwrap();
        // The ICRC covers 8 + 20 + 8 bytes of pseudo headers plus the packet minus its ICRC.
        let covered = vec![0x5Au8; 36 + pkt.len() - 4];
        let base = time(|| u64::from(crc32fast::hash(black_box(&covered))));
        let exact = time(|| u64::from(icrc::verify(&encap, black_box(&pkt))));
        let solve =
            time(|| icrc::solve_ipv4_ident(src, dst, black_box(&pkt)).map_or(0, |i| u64::from(i.ident)));
        println!(
            "| {payload_len} B | {base:.0} ns | {exact:.0} ns | {:.2} | {solve:.0} ns | {:.2} |",
            exact / base,
            solve / base
        );
    }
}
