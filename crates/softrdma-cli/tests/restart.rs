//! A peer process killed and restarted on the same address and port: the survivor's other
//! connections are not disturbed, its connection to the dead process fails cleanly
//! (RETRY_EXC_ERR), the stale QP's packets do not disturb the new connection to the new
//! process, and that new connection works.

use std::io::Write;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use softrdma::{
    Access, CompletionQueue, ConnectOptions, Context, EndpointInfo, MemoryRegion, ProtectionDomain,
    QpBuilder, QueuePair, RecvWr, Rkey, SendFlags, SendOp, SendWr, WcStatus, WorkCompletion,
};

mod common;
use common::{softrdma, text, Proc};

const SIZE: usize = 65536;

struct Server {
    proc: Proc,
    info: EndpointInfo,
}

/// A memserver on `port`, once it has bound it (it prints its endpoint then).
fn start(port: u16) -> Server {
    let mut proc = Proc::start_piped(
        softrdma(["memserver", "--bind", "127.0.10.2", "--udp-port", &port.to_string()])
            .args(["--size", &SIZE.to_string()]),
        Duration::from_secs(60),
    );
    let line = proc.line();
    Server { info: serde_json::from_str(line.trim()).unwrap(), proc }
}

fn connect(pd: &ProtectionDomain, cq: &CompletionQueue, s: &mut Server) -> QueuePair {
    let p = pd.prepare_qp(&QpBuilder::rc(), cq, cq).unwrap();
    writeln!(s.proc.stdin(), "{}", serde_json::to_string(&p.endpoint()).unwrap()).unwrap();
    p.handshake(&s.info, &ConnectOptions { timeout: 12, retry_cnt: 3, ..ConnectOptions::default() }).unwrap()
}

fn wait(cq: &CompletionQueue) -> WorkCompletion {
    let t = Instant::now();
    loop {
        if let Some(wc) = cq.poll_one() {
            return wc;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no completion");
        std::thread::yield_now();
    }
}

fn write(qp: &QueuePair, mr: &MemoryRegion, s: &EndpointInfo, wr_id: u64) {
    let r = s.region.unwrap();
    let op = SendOp::Write { remote_addr: r.addr, rkey: Rkey(r.rkey) };
    let flags = SendFlags { signaled: true, ..Default::default() };
    qp.post_send(SendWr { wr_id, op, sg_list: softrdma::sgl![mr.sge(0, SIZE).unwrap()], flags, ud: None })
        .unwrap();
}

#[test]
fn a_restarted_peer_does_not_confuse_the_survivor() {
    let port = 23_000 + (std::process::id() % 10_000) as u16;
    let survivor = Context::open_port(IpAddr::from([127, 0, 10, 3]), 0).unwrap();
    let pd = survivor.alloc_pd();
    let cq_m = survivor.create_cq(64, None).unwrap();
    // What the QP to the first process writes (also after that process is gone), and what
    // the QP to the second writes: different bytes, so that the second process's memory
    // tells which WRITE landed.
    let (stale_bytes, new_bytes) = ([0xA5; SIZE], [0x5A; SIZE]);
    let mr = pd.register(SIZE, Access::LOCAL_WRITE).unwrap();
    mr.write(0, &stale_bytes).unwrap();
    let new_mr = pd.register(SIZE, Access::LOCAL_WRITE).unwrap();
    new_mr.write(0, &new_bytes).unwrap();

    // A legitimate peer in this process, to ping throughout.
    let other = Context::open_port(IpAddr::from([127, 0, 10, 4]), 0).unwrap();
    let opd = other.alloc_pd();
    let (cq_l, cq_o) = (survivor.create_cq(64, None).unwrap(), other.create_cq(64, None).unwrap());
    let (pl, po) = (
        pd.prepare_qp(&QpBuilder::rc(), &cq_l, &cq_l).unwrap(),
        opd.prepare_qp(&QpBuilder::rc(), &cq_o, &cq_o).unwrap(),
    );
    let (el, eo) = (pl.endpoint(), po.endpoint());
    let ql = pl.handshake(&eo, &ConnectOptions::default()).unwrap();
    let qo = po.handshake(&el, &ConnectOptions::default()).unwrap();
    let dst = opd.register(64, Access::LOCAL_WRITE).unwrap();
    let mut round = 0u64;
    let mut ping = || {
        round += 1;
        qo.post_recv(RecvWr { wr_id: round, sg_list: softrdma::sgl![dst.sge(0, 64).unwrap()] }).unwrap();
        let flags = SendFlags { signaled: true, ..Default::default() };
        ql.post_send(SendWr {
            wr_id: round,
            op: SendOp::Send,
            sg_list: softrdma::sgl![mr.sge(0, 64).unwrap()],
            flags,
            ud: None,
        })
        .unwrap();
        assert_eq!(wait(&cq_l).status, WcStatus::Success);
        assert_eq!(wait(&cq_o).wr_id, round);
    };
    ping();

    let mut first = start(port);
    let old = connect(&pd, &cq_m, &mut first);
    write(&old, &mr, &first.info, 1);
    assert_eq!(wait(&cq_m).status, WcStatus::Success);
    ping();

    // Kill it, and start a new one on the same address and port.
    let (running, _) = first.proc.stop();
    assert!(running, "the first process served until killed");
    let mut second = start(port);
    let cq_n = survivor.create_cq(64, None).unwrap();
    let new = connect(&pd, &cq_n, &mut second);
    // The stale QP keeps sending to the address; the new process has nothing for it.
    write(&old, &mr, &first.info, 2);
    ping();
    let wc = wait(&cq_m);
    assert_eq!(wc.status, WcStatus::RetryExcErr, "the connection to the dead process fails cleanly");
    ping();
    // The new connection works.
    write(&new, &new_mr, &second.info, 3);
    assert_eq!(wait(&cq_n).status, WcStatus::Success);
    second.proc.close_stdin();
    let report = second.proc.line();
    let out = second.proc.wait();
    assert_eq!(out.status.code(), Some(0), "the second process: {}", text(&out));
    let v: serde_json::Value = serde_json::from_str(report.trim()).unwrap();
    assert_eq!(v["len"], SIZE, "{report}");
    assert_ne!(v["crc32"], crc32fast::hash(&stale_bytes), "the stale WRITE landed in the new process");
    assert_eq!(v["crc32"], crc32fast::hash(&new_bytes), "the new process got exactly the new WRITE");
    ping();
}
