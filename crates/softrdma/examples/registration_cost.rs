//! What registering memory costs, against taking a registered buffer from a
//! [`softrdma::managed::BufferPool`] and giving it back: the figures behind the pool.
//!
//! `cargo run --release --example registration_cost`
//!
//! For each size: registering and deregistering a buffer, the same plus writing every
//! byte once (a new region's pages are mapped on first touch, so a fresh buffer pays that
//! on its first use, a pooled one has paid it already), and taking a buffer from a pool
//! and dropping it back.

use std::time::Instant;

use softrdma::managed::{Buffer, BufferPool};
use softrdma::{Access, Context};

fn per_op_us(n: u32, mut f: impl FnMut()) -> f64 {
    f(); // warm up
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed().as_secs_f64() * 1e6 / f64::from(n)
}

fn main() -> Result<(), softrdma::Error> {
    let ctx = Context::open_port("127.0.0.1".parse().unwrap(), 0)?;
    let pd = ctx.alloc_pd();
    println!(
        "{:>10} {:>16} {:>22} {:>14} {:>18}",
        "size", "register us", "register+touch us", "pool us", "pool saves (x)"
    );
    for size in [4096usize, 65536, 1 << 20, 16 << 20, 64 << 20] {
        let n = if size >= 16 << 20 { 20 } else { 2000 };
        let data = vec![0xA5u8; size];
        let reg = per_op_us(n, || drop(Buffer::<u8>::new(&pd, size).unwrap()));
        let touched = per_op_us(n, || {
            let mut b = Buffer::<u8>::new(&pd, size).unwrap();
            b.write(0, &data).unwrap();
        });
        let pool = BufferPool::<u8>::new(&pd, 1, size, Access::LOCAL_WRITE)?;
        let pooled = per_op_us(n, || {
            let mut b = pool.take().unwrap();
            b.write(0, &data).unwrap();
        });
        let human =
            if size >= 1 << 20 { format!("{} MiB", size >> 20) } else { format!("{} KiB", size >> 10) };
        println!("{human:>10} {reg:>16.2} {touched:>22.2} {pooled:>14.2} {:>18.1}", touched / pooled);
    }
    println!(
        "(pool us: take a registered buffer, write every byte, give it back; the write is in both columns)"
    );
    Ok(())
}
