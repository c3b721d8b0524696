//! Two devices in one process, on 127.0.0.2 and 127.0.0.3, over real UDP sockets.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use softrdma::{
    Access, CompletionQueue, ConnectOptions, Context, QpBuilder, QueuePair, RecvWr, SendFlags, SendOp,
    SendWr, WcOpcode, WcStatus, WorkCompletion,
};

fn ctx(last: u8) -> Context {
    Context::open_port(IpAddr::from([127, 0, 0, last]), 0).expect("open loopback device")
}

fn wait(cq: &CompletionQueue) -> WorkCompletion {
    let start = Instant::now();
    loop {
        if let Some(wc) = cq.poll_one() {
            return wc;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "no completion");
        std::thread::yield_now();
    }
}

struct Side {
    ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: softrdma::MemoryRegion,
}

fn pair(a: u8, b: u8, access: Access) -> (Side, Side) {
    let (ca, cb) = (ctx(a), ctx(b));
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let mut sides = Vec::new();
    let mut prepared = Vec::new();
    for c in [&ca, &cb] {
        let pd = c.alloc_pd();
        let cq = c.create_cq(256, None).unwrap();
        let p = pd.create_qp(&QpBuilder::rc().access(access), &cq, &cq).unwrap();
        let mr = pd.register(1 << 20, all).unwrap();
        prepared.push((c.clone(), cq, p, mr));
    }
    let ia = prepared[0].2.endpoint();
    let ib = prepared[1].2.endpoint();
    for (i, (c, cq, p, mr)) in prepared.into_iter().enumerate() {
        let remote = if i == 0 { ib } else { ia };
        let qp = p.handshake(&remote, &ConnectOptions::default()).unwrap();
        sides.push(Side { ctx: c, cq, qp, mr });
    }
    let b = sides.pop().unwrap();
    (sides.pop().unwrap(), b)
}

fn signaled() -> SendFlags {
    SendFlags { signaled: true, ..Default::default() }
}

#[test]
fn send_recv_many_sizes() {
    let (a, b) = pair(2, 3, Access::NONE);
    for (i, len) in [0usize, 1, 1023, 1024, 1025, 4096, 100_000].into_iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|k| (k * 31 + i) as u8).collect();
        a.mr.write(0, &data).unwrap();
        b.qp.post_recv(RecvWr { wr_id: i as u64, sg_list: vec![b.mr.sge(0, 200_000).unwrap()] }).unwrap();
        a.qp.post_send(SendWr {
            wr_id: 100 + i as u64,
            op: SendOp::SendWithImm(i as u32),
            sg_list: vec![a.mr.sge(0, len).unwrap()],
            flags: signaled(),
            ud: None,
        })
        .unwrap();
        let s = wait(&a.cq);
        let r = wait(&b.cq);
        assert_eq!((s.wr_id, s.status), (100 + i as u64, WcStatus::Success));
        assert_eq!(
            (r.wr_id, r.status, r.byte_len as usize, r.imm_data),
            (i as u64, WcStatus::Success, len, Some(i as u32))
        );
        let mut got = vec![0u8; len];
        b.mr.read(0, &mut got).unwrap();
        assert_eq!(got, data, "{len} bytes");
    }
}

#[test]
fn one_sided_operations_need_nothing_from_the_passive_side() {
    let (a, b) = pair(4, 5, Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC);
    // From here on, `b` makes no verbs call: its progress thread does the work.
    let remote = b.mr.remote();
    let data: Vec<u8> = (0..300_000).map(|k| (k % 253) as u8).collect();
    a.mr.write(0, &data[..200_000]).unwrap();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write { remote_addr: remote.addr + 1000, rkey: softrdma::Rkey(remote.rkey) },
        sg_list: vec![a.mr.sge(0, 200_000).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    assert_eq!(wait(&a.cq).status, WcStatus::Success);
    a.qp.post_send(SendWr {
        wr_id: 2,
        op: SendOp::Read { remote_addr: remote.addr + 1000, rkey: softrdma::Rkey(remote.rkey) },
        sg_list: vec![a.mr.sge(500_000, 200_000).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    let wc = wait(&a.cq);
    assert_eq!((wc.status, wc.opcode, wc.byte_len), (WcStatus::Success, WcOpcode::RdmaRead, 200_000));
    let mut back = vec![0u8; 200_000];
    a.mr.read(500_000, &mut back).unwrap();
    assert_eq!(back, data[..200_000]);
    for k in 0..10u64 {
        a.qp.post_send(SendWr {
            wr_id: 10 + k,
            op: SendOp::FetchAdd { remote_addr: remote.addr + 8, rkey: softrdma::Rkey(remote.rkey), add: 5 },
            sg_list: vec![a.mr.sge(800_000 + 8 * k as usize, 8).unwrap()],
            flags: signaled(),
            ud: None,
        })
        .unwrap();
    }
    for _ in 0..10 {
        assert_eq!(wait(&a.cq).status, WcStatus::Success);
    }
    let mut word = [0u8; 8];
    b.mr.read(8, &mut word).unwrap();
    assert_eq!(u64::from_ne_bytes(word), 50);
    let mut got = vec![0u8; 200_000];
    b.mr.read(1000, &mut got).unwrap();
    assert_eq!(got, data[..200_000]);
    drop(b.ctx);
}

#[test]
fn bad_rkey_is_an_error_completion_not_a_crash() {
    let (a, b) = pair(6, 7, Access::REMOTE_WRITE);
    let remote = b.mr.remote();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write { remote_addr: remote.addr, rkey: softrdma::Rkey(remote.rkey ^ 1) },
        sg_list: vec![a.mr.sge(0, 64).unwrap()],
        flags: signaled(),
        ud: None,
    })
    .unwrap();
    assert_eq!(wait(&a.cq).status, WcStatus::RemAccessErr);
}

#[test]
fn address_in_use_is_a_clear_error() {
    let c = ctx(8);
    let port = c.local_addr().port();
    // The same address and port in this process is shared, not an error...
    let again = Context::open_port(IpAddr::from([127, 0, 0, 8]), port).unwrap();
    assert_eq!(again.local_addr(), c.local_addr());
    // ...but a socket of someone else on it is.
    let other = std::net::UdpSocket::bind("127.0.0.9:0").unwrap();
    let port = other.local_addr().unwrap().port();
    let err = Context::open_port(IpAddr::from([127, 0, 0, 9]), port).unwrap_err();
    assert!(matches!(err, softrdma::Error::AddressInUse { .. }));
    assert!(err.to_string().contains("127.0.0.2"), "the message says how to choose another address: {err}");
}
