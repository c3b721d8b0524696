//! A peer process killed and restarted on the same address and port: the survivor's other
//! connections are not disturbed, its connection to the dead process fails cleanly
//! (RETRY_EXC_ERR), the stale QP's packets do not disturb the new connection to the new
//! process, and that new connection works.

use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use softrdma::{
    Access, CompletionQueue, ConnectOptions, Context, EndpointInfo, MemoryRegion, ProtectionDomain,
    QpBuilder, QueuePair, RecvWr, Rkey, SendFlags, SendOp, SendWr, WcStatus, WorkCompletion,
};

const BIN: &str = env!("CARGO_BIN_EXE_softrdma");
const SIZE: usize = 65536;

struct Server {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    info: EndpointInfo,
}

fn start(port: u16) -> Server {
    let mut child = Command::new(BIN)
        .args([
            "memserver",
            "--bind",
            "127.0.10.2",
            "--udp-port",
            &port.to_string(),
            "--size",
            &SIZE.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    Server { child, stdin, stdout, info: serde_json::from_str(line.trim()).unwrap() }
}

fn connect(pd: &ProtectionDomain, cq: &CompletionQueue, s: &mut Server) -> QueuePair {
    let p = pd.prepare_qp(&QpBuilder::rc(), cq, cq).unwrap();
    writeln!(s.stdin.as_mut().unwrap(), "{}", serde_json::to_string(&p.endpoint()).unwrap()).unwrap();
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
    qp.post_send(SendWr { wr_id, op, sg_list: vec![mr.sge(0, SIZE).unwrap()], flags, ud: None }).unwrap();
}

#[test]
fn a_restarted_peer_does_not_confuse_the_survivor() {
    let port = 23_000 + (std::process::id() % 10_000) as u16;
    let survivor = Context::open_port(IpAddr::from([127, 0, 10, 3]), 0).unwrap();
    let pd = survivor.alloc_pd();
    let cq_m = survivor.create_cq(64, None).unwrap();
    let mr = pd.register(SIZE, Access::LOCAL_WRITE).unwrap();
    mr.write(0, &[0x5A; SIZE]).unwrap();

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
        qo.post_recv(RecvWr { wr_id: round, sg_list: vec![dst.sge(0, 64).unwrap()] }).unwrap();
        let flags = SendFlags { signaled: true, ..Default::default() };
        ql.post_send(SendWr {
            wr_id: round,
            op: SendOp::Send,
            sg_list: vec![mr.sge(0, 64).unwrap()],
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
    first.child.kill().unwrap();
    first.child.wait().unwrap();
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
    write(&new, &mr, &second.info, 3);
    assert_eq!(wait(&cq_n).status, WcStatus::Success);
    drop(second.stdin.take());
    let mut report = String::new();
    second.stdout.read_line(&mut report).unwrap();
    second.child.wait().unwrap();
    let v: serde_json::Value = serde_json::from_str(report.trim()).unwrap();
    assert_eq!(v["crc32"], crc32fast::hash(&[0x5A; SIZE]), "the new process got exactly the new WRITE");
    ping();
}
