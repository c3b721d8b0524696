//! The cost of one operation must not depend on how many QPs exist. This benchmark runs a
//! SEND ping-pong (8 bytes on loopback, each device busy-polled by a thread of its own)
//! while N other connected QPs sit idle on each device, for N = 0, 1,000 and 10,000 (or
//! the counts given), and prints the time per round trip and its ratio to N = 0.
//!
//! ```sh
//! cargo run --release -p idle-qps                  # N = 0, 1000, 10000; 20,000 round trips each
//! cargo run --release -p idle-qps -- 50000 0 30000 # round trips, then the counts
//! ```
//!
//! Each count is measured three times in turn (0, 1000, 10000, 0, 1000, ...) and the best
//! of each is reported, so that a burst of noise on the machine does not land on one count.

use std::net::IpAddr;
use std::time::Instant;

use softrdma::{
    Access, CompletionQueue, ConnectOptions, Context, EndpointInfo, MemoryRegion, QpBuilder, QueuePair,
    RecvWr, SendFlags, SendOp, SendWr, WcStatus,
};

struct Side {
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn wait(cq: &CompletionQueue) -> softrdma::WorkCompletion {
    loop {
        if let Some(wc) = cq.poll_one() {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            return wc;
        }
    }
}

/// One side of the ping-pong, on a thread of its own that busy-polls its device: `iters`
/// SENDs of 8 bytes and as many receives, the first side sending first.
fn play(me: &Side, iters: usize, first: bool) {
    let send = |i: usize| {
        let sg_list = softrdma::sgl![me.mr.sge(64, 8).unwrap()];
        let flags = SendFlags { signaled: i % 64 == 63, ..Default::default() };
        me.qp.post_send(SendWr { wr_id: 1, op: SendOp::Send, sg_list, flags, ud: None }).unwrap();
    };
    let recv = || {
        while wait(&me.cq).opcode != softrdma::WcOpcode::Recv {}
        me.qp.post_recv(RecvWr { wr_id: 0, sg_list: softrdma::sgl![me.mr.sge(0, 64).unwrap()] }).unwrap();
    };
    for i in 0..iters {
        if first {
            send(i);
            recv();
        } else {
            recv();
            send(i);
        }
    }
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numbers")).collect();
    let iters = args.first().copied().unwrap_or(20_000);
    let counts: Vec<usize> = if args.len() > 1 { args[1..].to_vec() } else { vec![0, 1_000, 10_000] };
    let a = Context::open_port(IpAddr::from([127, 0, 30, 1]), 0).expect("open 127.0.30.1");
    let b = Context::open_port(IpAddr::from([127, 0, 30, 2]), 0).expect("open 127.0.30.2");
    let side = |c: &Context| {
        let pd = c.alloc_pd();
        let cq = c.create_cq(256, None).unwrap();
        let p = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
        let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
        (pd, cq, p, mr)
    };
    let (pda, cqa, pa, mra) = side(&a);
    let (pdb, cqb, pb, mrb) = side(&b);
    let (ea, eb) = (pa.endpoint(), pb.endpoint());
    let opts = ConnectOptions::default();
    let sa = Side { cq: cqa, qp: pa.handshake(&eb, &opts).unwrap(), mr: mra };
    let sb = Side { cq: cqb, qp: pb.handshake(&ea, &opts).unwrap(), mr: mrb };
    for s in [&sa, &sb] {
        s.qp.post_recv(RecvWr { wr_id: 0, sg_list: softrdma::sgl![s.mr.sge(0, 64).unwrap()] }).unwrap();
    }

    // Idle QPs, connected (RTS) to a peer that never speaks: they hold no timers and no work.
    let idle_cq = |c: &Context| c.create_cq(16, None).unwrap();
    let (icqa, icqb) = (idle_cq(&a), idle_cq(&b));
    let mut idle: Vec<QueuePair> = Vec::new();
    let grow = |idle: &mut Vec<QueuePair>, n: usize| {
        while idle.len() < 2 * n {
            for (pd, cq, peer) in [(&pda, &icqa, &b), (&pdb, &icqb, &a)] {
                let p = pd.prepare_qp(&QpBuilder::rc(), cq, cq).unwrap();
                let fake =
                    EndpointInfo { addr: peer.local_addr(), qpn: 0xFF_FFF0, psn: 0, mtu: 1024, region: None };
                idle.push(p.handshake(&fake, &opts).unwrap());
            }
        }
        idle.truncate(2 * n);
    };

    let round = |iters: usize| {
        let start = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| play(&sb, iters, false));
            play(&sa, iters, true);
        });
        start.elapsed().as_secs_f64() * 1e6 / iters as f64
    };
    round(iters / 10); // warm up
    let mut best = vec![f64::MAX; counts.len()];
    for _ in 0..3 {
        for (k, &n) in counts.iter().enumerate() {
            grow(&mut idle, n);
            best[k] = best[k].min(round(iters));
        }
    }
    println!("| idle QPs per device | µs per round trip | ratio to {} idle |", counts[0]);
    println!("|---:|---:|---:|");
    for (k, &n) in counts.iter().enumerate() {
        println!("| {n} | {:.2} | {:.3} |", best[k], best[k] / best[0]);
    }
    let worst = best.iter().map(|b| b / best[0]).fold(0.0, f64::max);
    println!("flat within {:.1} %", (worst - 1.0).max(0.0) * 100.0);
}
