//! The fast path allocates nothing: a ping-pong's work requests carry their
//! scatter/gather entries inline (`SgList`), and the runtime keeps what it needs between
//! messages. Counted with a global allocator, in a process of its own.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use softrdma::{Access, ConnectOptions, Context, QpBuilder, RecvWr, SendFlags, SendOp, SendWr, WcStatus};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator, counting calls.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn a_ping_pong_allocates_nothing() {
    let ctx = |last: u8| Context::open_port(IpAddr::from([127, 0, 0, last]), 0).unwrap();
    let (ca, cb) = (ctx(30), ctx(31));
    let mut sides = Vec::new();
    for c in [&ca, &cb] {
        let pd = c.alloc_pd();
        let cq = c.create_cq(64, None).unwrap();
        let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
        let qp = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
        sides.push((cq, mr, qp));
    }
    let (ea, eb) = (sides[0].2.endpoint(), sides[1].2.endpoint());
    let (b, a) = (sides.pop().unwrap(), sides.pop().unwrap());
    let qa = a.2.handshake(&eb, &ConnectOptions::default()).unwrap();
    let qb = b.2.handshake(&ea, &ConnectOptions::default()).unwrap();
    let wait = |cq: &softrdma::CompletionQueue| {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(wc) = cq.poll_one() {
                assert_eq!(wc.status, WcStatus::Success);
                return wc;
            }
            assert!(Instant::now() < until, "no completion");
        }
    };
    let send = |qp: &softrdma::QueuePair, mr: &softrdma::MemoryRegion, id| {
        let wr = SendWr {
            wr_id: id,
            op: SendOp::Send,
            sg_list: softrdma::sgl![mr.sge(0, 64).unwrap()],
            flags: SendFlags { signaled: true, ..Default::default() },
            ud: None,
        };
        qp.post_send(wr).unwrap();
    };
    let recv = |qp: &softrdma::QueuePair, mr: &softrdma::MemoryRegion, id| {
        qp.post_recv(RecvWr { wr_id: id, sg_list: softrdma::sgl![mr.sge(1024, 64).unwrap()] }).unwrap();
    };
    let round = |k: u64| {
        recv(&qb, &b.1, k);
        recv(&qa, &a.1, k);
        send(&qa, &a.1, k);
        // B: the ping's receive, then the pong; A: its send's and the pong's completions.
        assert_eq!(wait(&b.0).wr_id, k);
        send(&qb, &b.1, k);
        for _ in 0..2 {
            assert_eq!(wait(&a.0).wr_id, k);
        }
        assert_eq!(wait(&b.0).wr_id, k);
    };
    // Warm up: queues, batches and maps reach their working sizes.
    for k in 0..500 {
        round(k);
    }
    let rounds = 3000;
    let before = ALLOCS.load(Ordering::Relaxed);
    for k in 0..rounds {
        round(500 + k);
    }
    let per_round = (ALLOCS.load(Ordering::Relaxed) - before) as f64 / rounds as f64;
    eprintln!("{per_round:.3} allocations per round trip");
    // Four work requests per round (two receives, two sends), none of which allocates; a
    // little room for the progress threads' rare bookkeeping.
    assert!(per_round < 0.5, "{per_round:.2} allocations per round trip, where there should be none");
}
