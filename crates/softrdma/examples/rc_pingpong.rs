//! RC ping-pong between two threads, each with its own device: 127.0.0.2 and 127.0.0.3.
//!
//! `cargo run --release --example rc_pingpong [ITERS] [SIZE]`
//!
//! Each side opens a device, registers a buffer, creates a CQ and an RC QP, and publishes
//! its endpoint as a JSON string — in a real program it would cross a TCP connection, a
//! file or a command line. Then the client sends, the server echoes, and both check.

use std::sync::mpsc;
use std::thread;
use std::time::Instant;

use softrdma::{
    Access, ConnectOptions, Context, EndpointInfo, QpBuilder, RecvWr, SendFlags, SendOp, SendWr, WcOpcode,
    WcStatus,
};

fn side(
    addr: &str,
    iters: u32,
    size: usize,
    client: bool,
    tx: mpsc::Sender<String>,
    rx: mpsc::Receiver<String>,
) {
    let ctx = Context::open_port(addr.parse().unwrap(), 0).expect("open device");
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(16, None).unwrap();
    let send_buf = pd.register(size, Access::NONE).unwrap();
    let recv_buf = pd.register(size, Access::LOCAL_WRITE).unwrap();
    let prepared = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
    let post_recv = |qp: &dyn Fn(RecvWr)| {
        qp(RecvWr { wr_id: 0, sg_list: softrdma::sgl![recv_buf.sge(0, size).unwrap()] })
    };
    post_recv(&|wr| prepared.post_recv(wr).unwrap());

    // Out of band: send our endpoint, receive theirs.
    tx.send(serde_json::to_string(&prepared.endpoint()).unwrap()).unwrap();
    let theirs: EndpointInfo = serde_json::from_str(&rx.recv().unwrap()).unwrap();
    let qp = prepared.handshake(&theirs, &ConnectOptions::default()).unwrap();

    let send = |i: u32| {
        send_buf.write(0, &vec![i as u8; size]).unwrap();
        let flags = SendFlags { signaled: true, ..Default::default() };
        qp.post_send(SendWr {
            wr_id: 1,
            op: SendOp::Send,
            sg_list: softrdma::sgl![send_buf.sge(0, size).unwrap()],
            flags,
            ud: None,
        })
        .unwrap();
    };
    let start = Instant::now();
    for i in 0..iters {
        if client {
            send(i);
        }
        // Wait for the message (and our own send's completion), in whatever order.
        let mut got_recv = false;
        let mut got_send = !client;
        while !(got_recv && got_send) {
            let wc = cq.wait_one();
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            match wc.opcode {
                WcOpcode::Recv => got_recv = true,
                _ => got_send = true,
            }
        }
        let mut data = vec![0u8; size];
        recv_buf.read(0, &mut data).unwrap();
        assert!(data.iter().all(|&b| b == i as u8), "message {i} corrupted");
        post_recv(&|wr| qp.post_recv(wr).unwrap());
        if !client {
            send(i);
            assert_eq!(cq.wait_one().status, WcStatus::Success);
        }
    }
    if client {
        let us = start.elapsed().as_secs_f64() * 1e6 / f64::from(iters);
        println!("{iters} round trips of {size} bytes, {us:.1} µs each");
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let iters: u32 = args.next().map_or(1000, |a| a.parse().expect("ITERS"));
    let size: usize = args.next().map_or(4096, |a| a.parse().expect("SIZE"));
    let (to_server, server_in) = mpsc::channel();
    let (to_client, client_in) = mpsc::channel();
    let server = thread::spawn(move || side("127.0.0.2", iters, size, false, to_client, server_in));
    side("127.0.0.3", iters, size, true, to_server, client_in);
    server.join().unwrap();
}
