// A send in flight may not see its buffer change: a borrow kept across the post does
// not compile.
use softrdma::managed::{Buffer, Connection};

fn change_while_sending(conn: &Connection, mut buf: Buffer<u8>) {
    let view = &mut buf;
    let _pending = conn.send(buf).unwrap();
    view.set(0, 1).unwrap();
}

fn main() {}
