// The completion hands the buffer back once: a Pending is consumed by waiting.
use softrdma::managed::{Buffer, Connection};

fn wait_twice(conn: &Connection, buf: Buffer<u8>) {
    let pending = conn.send(buf).unwrap();
    let _first = pending.wait();
    let _second = pending.wait();
}

fn main() {}
