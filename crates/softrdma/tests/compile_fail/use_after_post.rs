// A buffer posted for a receive belongs to the operation until its completion: reading it
// in the meantime does not compile.
use softrdma::managed::{Buffer, Connection};

fn read_while_receiving(conn: &Connection, buf: Buffer<u32>) -> Vec<u32> {
    let _pending = conn.recv(buf).unwrap();
    buf.to_vec()
}

fn main() {}
