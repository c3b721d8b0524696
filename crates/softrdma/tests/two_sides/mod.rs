//! What the tests over two local devices share: a device on a loopback address, a
//! connected RC pair with a registered region each, and a bounded wait for a completion.

#![allow(dead_code)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use softrdma::{
    Access, CompletionQueue, ConnectOptions, Context, QpBuilder, QueuePair, RemoteRegion, Rkey, SendFlags,
    SendOp, SendWr, WcStatus, WorkCompletion,
};

pub fn ctx(last: u8) -> Context {
    Context::open_port(IpAddr::from([127, 0, 0, last]), 0).expect("open loopback device")
}

/// The next completion, busy-polled; fails after 20 s without one.
pub fn wait(cq: &CompletionQueue) -> WorkCompletion {
    let start = Instant::now();
    loop {
        if let Some(wc) = cq.poll_one() {
            return wc;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "no completion");
        std::thread::yield_now();
    }
}

/// One end of a connected pair.
pub struct Side {
    pub ctx: Context,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    pub mr: softrdma::MemoryRegion,
}

/// Devices on 127.0.0.`a` and .`b`, each with a CQ, an RC QP granting `access` and a 1 MiB
/// region open to every access, connected to each other.
pub fn pair(a: u8, b: u8, access: Access) -> (Side, Side) {
    pair_of(a, b, &QpBuilder::rc().access(access))
}

/// [`pair`] with QPs that `builder` makes (UC, say).
pub fn pair_of(a: u8, b: u8, builder: &QpBuilder) -> (Side, Side) {
    let (ca, cb) = (ctx(a), ctx(b));
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let mut sides = Vec::new();
    let mut prepared = Vec::new();
    for c in [&ca, &cb] {
        let pd = c.alloc_pd();
        let cq = c.create_cq(256, None).unwrap();
        let p = pd.prepare_qp(builder, &cq, &cq).unwrap();
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

pub fn signaled() -> SendFlags {
    SendFlags { signaled: true, ..Default::default() }
}

/// One 8-byte READ of `remote` into the start of `side`'s region, busy-polled to its
/// successful completion: on the target, only its progress thread works.
pub fn read_8(side: &Side, remote: &RemoteRegion, wr_id: u64) {
    side.qp
        .post_send(SendWr {
            wr_id,
            op: SendOp::Read { remote_addr: remote.addr, rkey: Rkey(remote.rkey) },
            sg_list: softrdma::sgl![side.mr.sge(0, 8).unwrap()],
            flags: signaled(),
            ud: None,
        })
        .unwrap();
    assert_eq!(wait(&side.cq).status, WcStatus::Success);
}
