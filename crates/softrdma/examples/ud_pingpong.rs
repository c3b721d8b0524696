//! UD ping-pong between two threads, each with its own device: 127.0.0.4 and 127.0.0.5.
//!
//! `cargo run --release --example ud_pingpong [ITERS] [SIZE]`
//!
//! UD needs no connection: each QP is made ready on its own, and every send names its
//! destination (address, QPN, Q_Key). Every receive buffer starts with the 40-byte GRH
//! area, so the message lands at offset 40 and `byte_len` counts the 40 bytes too.

use std::sync::mpsc;
use std::thread;

use softrdma::{
    Access, Context, EndpointInfo, Qkey, QpBuilder, Qpn, RecvWr, SendFlags, SendOp, SendWr, UdDest, WcOpcode,
    WcStatus,
};

const QKEY: Qkey = Qkey(0x1111_1111);
const GRH: usize = 40;

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
    let recv_buf = pd.register(GRH + size, Access::LOCAL_WRITE).unwrap();
    let qp = pd.prepare_qp(&QpBuilder::ud(QKEY), &cq, &cq).unwrap();
    let me = qp.endpoint();
    let qp = qp.ready().unwrap();
    let post_recv = || {
        qp.post_recv(RecvWr { wr_id: 0, sg_list: softrdma::sgl![recv_buf.sge(0, GRH + size).unwrap()] })
            .unwrap()
    };
    post_recv();

    tx.send(serde_json::to_string(&me).unwrap()).unwrap();
    let peer: EndpointInfo = serde_json::from_str(&rx.recv().unwrap()).unwrap();
    let dest = UdDest { addr: peer.addr, qpn: Qpn::new(peer.qpn), qkey: QKEY, traffic_class: 0 };

    let send = |i: u32| {
        send_buf.write(0, &vec![i as u8; size]).unwrap();
        let flags = SendFlags { signaled: true, ..Default::default() };
        qp.post_send(SendWr {
            wr_id: 1,
            op: SendOp::Send,
            sg_list: softrdma::sgl![send_buf.sge(0, size).unwrap()],
            flags,
            ud: Some(dest),
        })
        .unwrap();
        assert_eq!(cq.wait_one().opcode, WcOpcode::Send);
    };
    for i in 0..iters {
        if client {
            send(i);
        }
        let wc = cq.wait_one();
        assert_eq!(
            (wc.status, wc.opcode, wc.byte_len as usize),
            (WcStatus::Success, WcOpcode::Recv, GRH + size)
        );
        assert_eq!(wc.src_qp, Qpn::new(peer.qpn));
        let mut data = vec![0u8; size];
        recv_buf.read(GRH, &mut data).unwrap();
        assert!(data.iter().all(|&b| b == i as u8), "message {i} corrupted");
        post_recv();
        if !client {
            send(i);
        }
    }
    if client {
        println!("{iters} UD round trips of {size} bytes checked");
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let iters: u32 = args.next().map_or(1000, |a| a.parse().expect("ITERS"));
    let size: usize = args.next().map_or(1024, |a| a.parse().expect("SIZE"));
    let (to_server, server_in) = mpsc::channel();
    let (to_client, client_in) = mpsc::channel();
    let server = thread::spawn(move || side("127.0.0.4", iters, size, false, to_client, server_in));
    side("127.0.0.5", iters, size, true, to_server, client_in);
    server.join().unwrap();
}
