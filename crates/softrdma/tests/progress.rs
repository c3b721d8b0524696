//! The progress thread as the NIC of a one-sided target: while traffic flows and no
//! application thread polls, it keeps polling the link instead of sleeping between
//! requests (a wake-up from idle costs tens of microseconds on a VM, more than the READ
//! itself). One test in a process of its own, so that no other test's threads compete.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use softrdma::{Access, ConnectOptions, Context, QpBuilder, Rkey, SendFlags, SendOp, SendWr, WcStatus};

mod threads;
use threads::{open_with_thread, sleeps};

#[test]
fn a_read_targets_progress_thread_stays_awake_between_back_to_back_reads() {
    // The target device's progress thread: one shard, whatever SOFTRDMA_SHARDS says.
    let (target, progress) =
        open_with_thread(|| Context::open_sharded(IpAddr::from([127, 0, 0, 44]), 0, 1).unwrap());
    let client = Context::open_port(IpAddr::from([127, 0, 0, 45]), 0).unwrap();

    let mut prepared = Vec::new();
    for c in [&target, &client] {
        let pd = c.alloc_pd();
        let cq = c.create_cq(64, None).unwrap();
        let p = pd.prepare_qp(&QpBuilder::rc().access(Access::REMOTE_READ), &cq, &cq).unwrap();
        let mr = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_READ).unwrap();
        prepared.push((cq, p, mr));
    }
    let (et, ec) = (prepared[0].1.endpoint(), prepared[1].1.endpoint());
    let (ccq, cp, cmr) = prepared.pop().unwrap();
    let (_tcq, tp, tmr) = prepared.pop().unwrap();
    let _tqp = tp.handshake(&ec, &ConnectOptions::default()).unwrap();
    let cqp = cp.handshake(&et, &ConnectOptions::default()).unwrap();
    let remote = tmr.remote();

    // The client busy-polls each READ; nobody on the target side polls or waits.
    let read = |k: u64| {
        tmr.write(0, &k.to_le_bytes()).unwrap();
        cqp.post_send(SendWr {
            wr_id: k,
            op: SendOp::Read { remote_addr: remote.addr, rkey: Rkey(remote.rkey) },
            sg_list: softrdma::sgl![cmr.sge(0, 8).unwrap()],
            flags: SendFlags { signaled: true, ..Default::default() },
            ud: None,
        })
        .unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        let wc = loop {
            if let Some(wc) = ccq.poll_one() {
                break wc;
            }
            assert!(Instant::now() < until, "READ {k} did not complete");
        };
        assert_eq!((wc.wr_id, wc.status), (k, WcStatus::Success));
        let mut got = [0u8; 8];
        cmr.read(0, &mut got).unwrap();
        assert_eq!(u64::from_le_bytes(got), k, "READ {k} brought the target's bytes");
    };
    for k in 0..300 {
        read(k);
    }
    // Asleep between READs, it would sleep once per READ at least. READs are back to
    // back only while the client runs: on a machine busy with other work, a try may have
    // its client descheduled for longer than the target's spin, so up to five tries.
    let reads = 3000;
    let mut tries = vec![];
    for t in 0..5 {
        let slept_before = sleeps(progress);
        for k in 0..reads {
            read(1000 + t * reads + k);
        }
        let slept = sleeps(progress) - slept_before;
        eprintln!("the target's progress thread slept {slept} times in {reads} READs");
        tries.push(slept);
        if slept < reads / 2 {
            return;
        }
    }
    panic!("the target's progress thread slept {tries:?} times in five tries of {reads} back-to-back READs");
}
