//! The lean event-mode hand-back (`SOFTRDMA_EVENT_WAKE=lean`): a thread that waits on a
//! completion channel watches the link itself, and when it returns with its event the
//! progress thread is not woken; it takes the link back only if no watcher is back within
//! the hand-back delay. In a process of its own, since the choice is read from the
//! environment when a device opens.
//!
//! `SOFTRDMA_EVENT_WAKE=warm cargo test --test event_wake` runs the same tests on the warm
//! hand-back: the first then fails (the progress threads wake for most messages), the
//! second passes.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use softrdma::{
    Access, CompletionChannel, CompletionQueue, ConnectOptions, Context, QpBuilder, RecvWr, Rkey, SendFlags,
    SendOp, SendWr, WcOpcode, WcStatus,
};

/// Sets the lean hand-back up (unless the environment chose) and runs the tests one at a
/// time: each finds its devices' progress threads among the process's threads.
fn lean() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    if std::env::var_os("SOFTRDMA_EVENT_WAKE").is_none() {
        std::env::set_var("SOFTRDMA_EVENT_WAKE", "lean");
    }
    guard
}

fn tasks() -> HashSet<u32> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

fn comm(tid: u32) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default()
}

/// The voluntary context switches of one of this process's threads: each time it slept.
fn sleeps(tid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:"));
    line.and_then(|l| l.split_whitespace().nth(1)?.parse().ok()).unwrap_or(0)
}

/// Opens a device and finds its progress thread (the thread its opening started, which
/// names itself once it runs).
fn open(last: u8) -> (Context, u32) {
    let before = tasks();
    let ctx = Context::open_port(IpAddr::from([127, 0, 0, last]), 0).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let named: Vec<u32> = tasks()
            .difference(&before)
            .copied()
            .filter(|&t| comm(t).starts_with("softrdma-") && !comm(t).starts_with("softrdma-res"))
            .collect();
        if let [t] = named[..] {
            return (ctx, t);
        }
        assert!(Instant::now() < until, "the device's progress thread: {named:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits on `ch` for a completion of `kind` on `cq`, taking others on the way.
fn wait(ch: &CompletionChannel, cq: &CompletionQueue, kind: WcOpcode) {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        while let Some(wc) = cq.poll_one() {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            if wc.opcode == kind {
                return;
            }
        }
        cq.req_notify(false).unwrap();
        if cq.poll_one().is_some_and(|wc| {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            wc.opcode == kind
        }) {
            return;
        }
        assert!(Instant::now() < until, "no {kind:?} completion");
        if ch.get_event_timeout(Duration::from_millis(100)).unwrap().is_some() {
            ch.ack_events(1);
        }
    }
}

#[test]
fn an_event_mode_ping_pong_leaves_the_progress_threads_asleep() {
    let _one = lean();
    let (ca, pa) = open(60);
    let (cb, pb) = open(61);
    let mut sides = Vec::new();
    for c in [&ca, &cb] {
        let ch = c.create_channel().unwrap();
        let pd = c.alloc_pd();
        let cq = c.create_cq(64, Some(&ch)).unwrap();
        let qp = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
        let mr = pd.register(64, Access::LOCAL_WRITE).unwrap();
        sides.push((ch, cq, qp, mr));
    }
    let (ea, eb) = (sides[0].2.endpoint(), sides[1].2.endpoint());
    let (chb, cqb, qb, mrb) = sides.pop().unwrap();
    let (cha, cqa, qa, mra) = sides.pop().unwrap();
    let qa = qa.handshake(&eb, &ConnectOptions::default()).unwrap();
    let qb = qb.handshake(&ea, &ConnectOptions::default()).unwrap();

    let rounds = 20000u64;
    let start = Arc::new(Barrier::new(2));
    let go = start.clone();
    let pong = std::thread::spawn(move || {
        for k in 0..rounds {
            qb.post_recv(RecvWr { wr_id: k, sg_list: softrdma::sgl![mrb.sge(0, 8).unwrap()] }).unwrap();
            if k == 0 {
                go.wait();
            }
            wait(&chb, &cqb, WcOpcode::Recv);
            let wr = SendWr {
                wr_id: k,
                op: SendOp::Send,
                sg_list: softrdma::sgl![mrb.sge(32, 8).unwrap()],
                flags: SendFlags { signaled: true, ..SendFlags::default() },
                ud: None,
            };
            qb.post_send(wr).unwrap();
        }
    });
    start.wait();
    let slept = (sleeps(pa), sleeps(pb));
    for k in 0..rounds {
        qa.post_recv(RecvWr { wr_id: k, sg_list: softrdma::sgl![mra.sge(0, 8).unwrap()] }).unwrap();
        let wr = SendWr {
            wr_id: k,
            op: SendOp::Send,
            sg_list: softrdma::sgl![mra.sge(32, 8).unwrap()],
            flags: SendFlags { signaled: true, ..SendFlags::default() },
            ud: None,
        };
        qa.post_send(wr).unwrap();
        wait(&cha, &cqa, WcOpcode::Recv);
    }
    pong.join().unwrap();
    let slept = (sleeps(pa) - slept.0, sleeps(pb) - slept.1);
    eprintln!("progress threads slept {slept:?} times in {rounds} round trips");
    // Warm, each thread wakes (and sleeps again) for most messages: ~0.6 per round trip
    // here. Lean, it sleeps through the ping-pong and wakes for its timers only; a
    // message whose thread is descheduled past the hand-back delay on a busy machine
    // costs one more.
    assert!(
        slept.0 < rounds / 10 && slept.1 < rounds / 10,
        "the progress threads slept {slept:?} times in {rounds} event-mode round trips"
    );
}

#[test]
fn a_watcher_that_leaves_for_good_hands_the_link_back() {
    let _one = lean();
    let (ct, _) = open(62);
    let (cc, _) = open(63);
    let (cht, pt, pc) = (ct.create_channel().unwrap(), ct.alloc_pd(), cc.alloc_pd());
    let cqt = ct.create_cq(64, Some(&cht)).unwrap();
    let cqc = cc.create_cq(256, None).unwrap();
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let qt = pt.prepare_qp(&QpBuilder::rc().access(access), &cqt, &cqt).unwrap();
    let qc = pc.prepare_qp(&QpBuilder::rc(), &cqc, &cqc).unwrap();
    let mrt = pt.register(4096, access).unwrap();
    let mrc = pc.register(4096, Access::LOCAL_WRITE).unwrap();
    let (et, ec) = (qt.endpoint(), qc.endpoint());
    let qt = qt.handshake(&ec, &ConnectOptions::default()).unwrap();
    let qc = qc.handshake(&et, &ConnectOptions::default()).unwrap();

    // The target waits for one SEND on its channel (watching the link), then returns and
    // never looks at the device again: the WRITEs that follow are served by its progress
    // thread alone, once the hand-back delay has passed.
    qt.post_recv(RecvWr { wr_id: 1, sg_list: softrdma::sgl![mrt.sge(0, 8).unwrap()] }).unwrap();
    let send = SendWr {
        wr_id: 0,
        op: SendOp::Send,
        sg_list: softrdma::sgl![mrc.sge(0, 8).unwrap()],
        flags: SendFlags { signaled: true, ..SendFlags::default() },
        ud: None,
    };
    qc.post_send(send).unwrap();
    wait(&cht, &cqt, WcOpcode::Recv);
    let remote = mrt.remote();
    for k in 1..=64u64 {
        mrc.write(0, &k.to_le_bytes()).unwrap();
        let wr = SendWr {
            wr_id: k,
            op: SendOp::Write { remote_addr: remote.addr + 8 * k, rkey: Rkey(remote.rkey) },
            sg_list: softrdma::sgl![mrc.sge(0, 8).unwrap()],
            flags: SendFlags { signaled: true, ..SendFlags::default() },
            ud: None,
        };
        qc.post_send(wr).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        let wc = loop {
            if let Some(wc) = cqc.poll_one() {
                if wc.opcode == WcOpcode::RdmaWrite {
                    break wc;
                }
                continue;
            }
            assert!(Instant::now() < until, "WRITE {k} was never acknowledged");
        };
        assert_eq!((wc.wr_id, wc.status), (k, WcStatus::Success));
        let mut got = [0u8; 8];
        mrt.read(8 * k as usize, &mut got).unwrap();
        assert_eq!(u64::from_le_bytes(got), k, "WRITE {k} landed");
    }
}
