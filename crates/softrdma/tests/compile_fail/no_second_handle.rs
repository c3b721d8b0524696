// There is one handle to a registered buffer: it cannot be cloned to keep a copy while
// the original is in flight.
use softrdma::managed::{Buffer, Connection};

fn keep_a_copy(conn: &Connection, buf: Buffer<u8>) {
    let copy = buf.clone();
    let _pending = conn.send(buf).unwrap();
    drop(copy);
}

fn main() {}
