//! The managed layer (`softrdma::managed`) over real sockets: buffers travel with their
//! operations and come back with their completions, pools recycle registrations,
//! unsignaled writes complete with the next signaled send, callbacks, futures and
//! receive streams all get their typed buffers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use softrdma::managed::{Buffer, BufferPool, CompletionPoller, Connection, Op, Pod, WaitMode, Zeroable};
use softrdma::{Access, ConnectOptions, Context, ProtectionDomain, QpBuilder, QpCaps, WcOpcode, WcStatus};

const WAIT: Duration = Duration::from_secs(10);

struct Side {
    pd: ProtectionDomain,
    poller: CompletionPoller,
    conn: Connection,
    _ctx: Context,
}

/// Two connected sides on 127.0.31.`a` and 127.0.31.`b`.
fn pair(a: u8, b: u8, mode: WaitMode, spawn_b: bool) -> (Side, Side) {
    let ctx = |x: u8| Context::open(std::net::IpAddr::from([127, 0, 31, x])).unwrap();
    let (ca, cb) = (ctx(a), ctx(b));
    let pa = CompletionPoller::new(&ca, 256, mode).unwrap();
    let pb = if spawn_b {
        CompletionPoller::spawn(&cb, 256).unwrap()
    } else {
        CompletionPoller::new(&cb, 256, mode).unwrap()
    };
    let (pda, pdb) = (ca.alloc_pd(), cb.alloc_pd());
    let caps = QpCaps { max_send_wr: 64, max_recv_wr: 64, ..QpCaps::default() };
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let builder = QpBuilder::rc().caps(caps).access(access);
    let qa = pda.prepare_qp(&builder, pa.cq(), pa.cq()).unwrap();
    let qb = pdb.prepare_qp(&builder, pb.cq(), pb.cq()).unwrap();
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    let opts = ConnectOptions { rnr_retry: 7, ..ConnectOptions::default() };
    let qa = Arc::new(qa.handshake(&eb, &opts).unwrap());
    let qb = Arc::new(qb.handshake(&ea, &opts).unwrap());
    (
        Side { conn: Connection::new(qa, &pa).unwrap(), pd: pda, poller: pa, _ctx: ca },
        Side { conn: Connection::new(qb, &pb).unwrap(), pd: pdb, poller: pb, _ctx: cb },
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
#[repr(C)]
struct Pixel {
    r: u8,
    g: u8,
    b: u8,
    a: u8,
    weight: f32,
}

#[test]
fn a_typed_buffer_goes_out_with_a_send_and_comes_back_with_its_completion() {
    for mode in [WaitMode::Busy, WaitMode::Event] {
        let (a, b) = pair(1, 2, mode, false);
        let pixels: Vec<Pixel> = (0..100u8)
            .map(|i| Pixel { r: i, g: i ^ 0x55, b: 255 - i, a: 7, weight: f32::from(i) * 0.5 })
            .collect();
        // The receive buffer is larger than the message: its length becomes what arrived.
        let incoming = b.conn.recv(Buffer::<Pixel>::new(&b.pd, 256).unwrap()).unwrap();
        let out = Buffer::from_slice(&a.pd, &pixels).unwrap();
        let sent = a.conn.send(out).unwrap();
        let got = incoming.wait_timeout(WAIT).expect("the receive completes").check().unwrap();
        assert_eq!(got.wc.opcode, WcOpcode::Recv);
        assert_eq!(got.buffer.len(), 100, "{mode:?}");
        assert_eq!(got.buffer.capacity(), 256);
        assert_eq!(got.buffer.to_vec(), pixels);
        assert_eq!(got.buffer.get(99), Some(pixels[99]));
        assert_eq!(got.buffer.get(100), None, "past the length");
        let sent = sent.wait_timeout(WAIT).expect("the send completes").check().unwrap();
        assert_eq!(sent.wc.opcode, WcOpcode::Send);
        // The sender has its buffer back, contents intact, and may use it again.
        let mut again = sent.buffer;
        assert_eq!(again.to_vec(), pixels);
        again.set(0, Pixel { r: 1, g: 2, b: 3, a: 4, weight: -1.0 }).unwrap();
        again.set_len(1).unwrap();
        let incoming = b.conn.recv(got.buffer).unwrap();
        a.conn.send(again).unwrap().wait_timeout(WAIT).unwrap().check().unwrap();
        let got = incoming.wait_timeout(WAIT).unwrap().check().unwrap();
        assert_eq!(got.buffer.to_vec(), [Pixel { r: 1, g: 2, b: 3, a: 4, weight: -1.0 }]);
        assert_eq!((a.poller.in_flight(), b.poller.in_flight(), a.poller.strays()), (0, 0, 0));
    }
}

#[test]
fn a_pool_hands_out_its_buffers_and_takes_them_back_when_dropped() {
    let ctx = Context::open([127, 0, 31, 3].into()).unwrap();
    let pd = ctx.alloc_pd();
    let pool = BufferPool::<u64>::new(&pd, 3, 512, Access::LOCAL_WRITE).unwrap();
    assert_eq!((pool.count(), pool.available(), pool.buffer_capacity()), (3, 3, 512));
    let regions_before = ctx.mr_count();
    let mut taken: Vec<_> = (0..3).map(|_| pool.take().expect("a free buffer")).collect();
    assert!(pool.take().is_none(), "all three are out");
    let t = Instant::now();
    assert!(pool.take_timeout(Duration::from_millis(50)).is_err());
    assert!(t.elapsed() >= Duration::from_millis(50));
    taken[0].copy_from(&[42; 16]).unwrap();
    assert_eq!(taken[0].len(), 16);
    assert!(taken[0].copy_from(&[0; 513]).is_err(), "beyond the capacity");
    // Another thread gives one back while this one waits.
    let back = taken.pop().unwrap();
    let giver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        drop(back);
    });
    let again = pool.take_timeout(WAIT).expect("the buffer given back");
    giver.join().unwrap();
    assert_eq!(again.len(), 512, "a buffer from the pool comes out at full length");
    drop(taken);
    drop(again);
    assert_eq!(pool.available(), 3);
    assert_eq!(ctx.mr_count(), regions_before, "nothing was registered or deregistered");
    // Contents are kept (the pool saves the registration, not a clearing pass).
    let mut all: Vec<_> = (0..3).map(|_| pool.take().unwrap()).collect();
    for (k, b) in all.iter_mut().enumerate() {
        b.set(0, 1000 + k as u64).unwrap();
    }
    drop(all);
    let again: Vec<_> = (0..3).map(|_| pool.take().unwrap()).collect();
    let mut marks: Vec<u64> = again.iter().map(|b| b.get(0).unwrap()).collect();
    drop(again);
    marks.sort();
    assert_eq!(marks, [1000, 1001, 1002]);
    // A pool dropped while a buffer is out: the buffer deregisters on its own.
    let out = pool.take().unwrap();
    drop(pool);
    drop(out);
    assert_eq!(ctx.mr_count(), regions_before - 3);
}

#[test]
fn pooled_buffers_come_back_to_the_pool_after_their_operations() {
    let (a, b) = pair(4, 5, WaitMode::Busy, false);
    let pool = BufferPool::<u8>::new(&b.pd, 4, 64, Access::LOCAL_WRITE).unwrap();
    // Four receives posted and their Pendings dropped: the buffers are in flight, not lost.
    for _ in 0..4 {
        drop(b.conn.recv(pool.take().unwrap()).unwrap());
    }
    assert_eq!((pool.available(), b.poller.in_flight()), (0, 4));
    for i in 0..4u8 {
        a.conn
            .send(Buffer::from_slice(&a.pd, &[i; 10]).unwrap())
            .unwrap()
            .wait_timeout(WAIT)
            .unwrap()
            .check()
            .unwrap();
    }
    let deadline = Instant::now() + WAIT;
    while pool.available() < 4 && Instant::now() < deadline {
        b.poller.wait_timeout(Duration::from_millis(10));
    }
    assert_eq!((pool.available(), b.poller.in_flight(), b.poller.dispatched()), (4, 0, 4));
}

#[test]
fn unsignaled_writes_complete_with_the_next_signaled_read_and_errors_complete_at_once() {
    let (a, b) = pair(6, 7, WaitMode::Event, false);
    let target = Buffer::<u32>::with_access(
        &b.pd,
        64,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )
    .unwrap();
    let remote = target.remote().expect("remote rights");
    assert_eq!(remote.len, 256);
    assert!(Buffer::<u32>::new(&b.pd, 4).unwrap().remote().is_none(), "no remote rights, no description");
    // The seed's fourth ping-pong: an unsignaled WRITE, then a signaled READ of it.
    let w =
        a.conn.post(Op::WriteUnsignaled(remote), Buffer::from_slice(&a.pd, &[7u32; 64]).unwrap()).unwrap();
    assert!(!w.is_done());
    let r = a.conn.read(Buffer::<u32>::new(&a.pd, 64).unwrap(), remote).unwrap();
    let read = r.wait_timeout(WAIT).unwrap().check().unwrap();
    assert_eq!(read.buffer.to_vec(), vec![7u32; 64], "the READ sees the WRITE before it");
    let w = w.try_take().expect("the READ's completion completed the unsignaled WRITE");
    assert_eq!((w.status(), w.wc.opcode), (WcStatus::Success, WcOpcode::RdmaWrite));
    assert_eq!(w.buffer.to_vec(), vec![7u32; 64]);
    assert_eq!(target.to_vec(), vec![7u32; 64]);
    assert_eq!(a.poller.in_flight(), 0);
    // An unsignaled WRITE with a wrong key completes at once, with its error.
    let bad = softrdma::RemoteRegion { rkey: remote.rkey ^ 0x100, ..remote };
    let w = a.conn.post(Op::WriteUnsignaled(bad), w.buffer).unwrap();
    let done = w.wait_timeout(WAIT).expect("an error completes an unsignaled WRITE");
    assert_eq!(done.status(), WcStatus::RemAccessErr);
    assert!(matches!(done.check(), Err(softrdma::Error::Failed(WcStatus::RemAccessErr))));
    assert_eq!(a.poller.in_flight(), 0);
}

#[test]
fn an_unsignaled_write_completes_when_the_signaled_send_after_it_fails() {
    let (a, b) = pair(19, 20, WaitMode::Event, false);
    let target = Buffer::<u8>::with_access(&b.pd, 16, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    let remote = target.remote().unwrap();
    // A good unsignaled WRITE, then a signaled one with a wrong key: the second fails and
    // takes the QP to ERROR; the first succeeded and has no completion of its own.
    let w = a.conn.post(Op::WriteUnsignaled(remote), Buffer::from_slice(&a.pd, &[5u8; 16]).unwrap()).unwrap();
    let bad = softrdma::RemoteRegion { rkey: remote.rkey ^ 0x100, ..remote };
    let f = a.conn.write(Buffer::from_slice(&a.pd, &[6u8; 16]).unwrap(), bad).unwrap();
    assert_eq!(f.wait_timeout(WAIT).unwrap().status(), WcStatus::RemAccessErr);
    let w = w.try_take().expect("the unsignaled WRITE before the failure is done");
    assert_eq!(w.status(), WcStatus::Success);
    assert_eq!(target.to_vec(), [5u8; 16]);
    assert_eq!(a.poller.in_flight(), 0);
}

#[test]
fn unsignaled_writes_from_several_threads_come_back_only_when_done() {
    let (a, b) = pair(21, 22, WaitMode::Busy, false);
    let target = Buffer::<u32>::with_access(&b.pd, 1024, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    let remote = target.remote().unwrap();
    let threads: Vec<_> = (0..4u32)
        .map(|k| {
            let (conn, pd) = (a.conn.clone(), a.pd.clone());
            std::thread::spawn(move || {
                for i in 0..50u32 {
                    let at = softrdma::RemoteRegion {
                        addr: remote.addr + u64::from(k * 256 + i % 64) * 4,
                        len: 4,
                        ..remote
                    };
                    let mut buf = Buffer::from_slice(&pd, &[k * 1000 + i]).unwrap();
                    let op = if i % 5 == 4 { Op::Write(at) } else { Op::WriteUnsignaled(at) };
                    loop {
                        match conn.post(op, buf) {
                            Ok(p) => {
                                if i % 5 == 4 {
                                    p.wait_timeout(WAIT).unwrap().check().unwrap();
                                }
                                break;
                            }
                            Err(r) => {
                                buf = r.buffer;
                                std::thread::yield_now();
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // A last signaled WRITE from this thread completes everything before it.
    a.conn
        .write(Buffer::from_slice(&a.pd, &[1u32]).unwrap(), remote)
        .unwrap()
        .wait_timeout(WAIT)
        .unwrap()
        .check()
        .unwrap();
    assert_eq!(a.poller.in_flight(), 0, "every unsignaled WRITE completed, none left behind");
}

#[test]
fn a_connection_refuses_a_qp_on_another_cq() {
    let ctx = Context::open([127, 0, 31, 18].into()).unwrap();
    let poller = CompletionPoller::new(&ctx, 16, WaitMode::Event).unwrap();
    let other = ctx.create_cq(16, None).unwrap();
    let pd = ctx.alloc_pd();
    let qp = Arc::new(pd.create_qp(&QpBuilder::rc(), &other, poller.cq()).unwrap());
    assert!(Connection::new(qp, &poller).is_err());
    let qp = Arc::new(pd.create_qp(&QpBuilder::rc(), poller.cq(), poller.cq()).unwrap());
    assert!(Connection::new(qp, &poller).is_ok());
}

#[test]
fn refused_posts_hand_the_buffer_back_untouched() {
    let (a, b) = pair(8, 9, WaitMode::Busy, false);
    let small = Buffer::<u8>::with_access(&b.pd, 8, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    let remote = small.remote().unwrap();
    let refused = a.conn.write(Buffer::from_slice(&a.pd, &[1u8; 9]).unwrap(), remote).unwrap_err();
    assert!(refused.to_string().contains("smaller"), "{refused}");
    assert_eq!(refused.buffer.to_vec(), [1u8; 9]);
    // A full send queue (64 WRs): the 65th post is refused and its buffer comes back. B's QP
    // in ERROR acknowledges nothing, so the queue stays full.
    let target = Buffer::<u8>::with_access(&b.pd, 1, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    let error = softrdma::QpAttr { state: Some(softrdma::QpState::Error), ..Default::default() };
    b.conn.qp().modify(&error).unwrap();
    let mut pending = Vec::new();
    let mut refused_full = None;
    for i in 0..200u8 {
        match a.conn.write(Buffer::from_slice(&a.pd, &[i]).unwrap(), target.remote().unwrap()) {
            Ok(p) => pending.push(p),
            Err(r) => {
                refused_full = Some((i, r));
                break;
            }
        }
    }
    let (i, r) = refused_full.expect("a queue of 64 fills");
    assert!(i >= 64, "refused only once the queue is full ({i})");
    assert!(matches!(r.error, softrdma::Error::Post(_)), "{:?}", r.error);
    assert_eq!(r.buffer.to_vec(), [i]);
    // A's QP in ERROR flushes them all; each buffer comes back.
    a.conn.qp().modify(&error).unwrap();
    for (k, p) in pending.into_iter().enumerate() {
        let d = p.wait_timeout(WAIT).unwrap();
        assert_eq!((d.status(), d.buffer.to_vec()), (WcStatus::WrFlushErr, vec![k as u8]));
    }
    assert_eq!(a.poller.in_flight(), 0);
}

#[test]
fn a_spawned_poller_runs_callbacks_with_typed_buffers() {
    let (a, b) = pair(10, 11, WaitMode::Event, true);
    let sums = Arc::new(Mutex::new(Vec::new()));
    let count = Arc::new(AtomicUsize::new(0));
    for _ in 0..8 {
        let (sums, count) = (sums.clone(), count.clone());
        b.conn
            .post_then(Op::Recv, Buffer::<u16>::new(&b.pd, 32).unwrap(), move |done| {
                assert_eq!(done.status(), WcStatus::Success);
                sums.lock()
                    .unwrap()
                    .push((done.imm(), done.buffer.to_vec().iter().map(|&x| u32::from(x)).sum::<u32>()));
                count.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    }
    for k in 0..8u16 {
        let buf = Buffer::from_slice(&a.pd, &[k; 32]).unwrap();
        a.conn
            .post(Op::SendWithImm(u32::from(k) + 100), buf)
            .unwrap()
            .wait_timeout(WAIT)
            .unwrap()
            .check()
            .unwrap();
    }
    let deadline = Instant::now() + WAIT;
    while count.load(Ordering::SeqCst) < 8 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let sums = sums.lock().unwrap().clone();
    let want: Vec<_> = (0..8u32).map(|k| (Some(k + 100), 32 * k)).collect();
    assert_eq!(sums, want, "each callback got its own buffer, in order, from the poller's thread");
}

struct ThreadWaker(std::thread::Thread);
impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// A minimal executor: polls the future, parks until woken.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    let deadline = Instant::now() + WAIT;
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        assert!(Instant::now() < deadline, "the future never completed");
        std::thread::park_timeout(Duration::from_millis(500));
    }
}

#[test]
fn pending_operations_and_receive_streams_are_futures() {
    let (a, b) = pair(12, 13, WaitMode::Event, false);
    let mut stream =
        b.conn.recv_stream((0..3).map(|_| Buffer::<u32>::new(&b.pd, 4).unwrap()).collect()).unwrap();
    assert_eq!(b.poller.in_flight(), 3, "three receives kept posted");
    let got = block_on(async {
        let mut got = Vec::new();
        for k in 0..10u32 {
            let sent = a.conn.send(Buffer::from_slice(&a.pd, &[k, k + 1]).unwrap()).unwrap().await;
            assert_eq!(sent.status(), WcStatus::Success);
            let done = std::future::poll_fn(|cx| {
                futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)
            })
            .await
            .expect("the stream does not end");
            got.push(done.buffer.to_vec());
            stream.repost(done.buffer).unwrap();
        }
        got
    });
    let want: Vec<Vec<u32>> = (0..10).map(|k| vec![k, k + 1]).collect();
    assert_eq!(got, want);
    // Blocking form: next_timeout, and nothing arrives when nothing is sent.
    assert!(stream.next_timeout(Duration::from_millis(30)).is_none());
    a.conn.send(Buffer::from_slice(&a.pd, &[9u32]).unwrap()).unwrap().wait_timeout(WAIT).unwrap();
    assert_eq!(stream.next_timeout(WAIT).unwrap().buffer.to_vec(), [9]);
}

#[test]
fn waiters_in_several_threads_each_get_their_own_completion() {
    let (a, b) = pair(14, 15, WaitMode::Event, false);
    let waiters: Vec<_> = (0..4u64)
        .map(|_| {
            let pending = b.conn.recv(Buffer::<u64>::new(&b.pd, 1).unwrap()).unwrap();
            std::thread::spawn(move || {
                pending.wait_timeout(WAIT).expect("each waiter completes").buffer.to_vec()[0]
            })
        })
        .collect();
    for k in 0..4u64 {
        a.conn.send(Buffer::from_slice(&a.pd, &[k * 11]).unwrap()).unwrap().wait_timeout(WAIT).unwrap();
    }
    let mut got: Vec<u64> = waiters.into_iter().map(|t| t.join().unwrap()).collect();
    got.sort();
    assert_eq!(got, [0, 11, 22, 33]);
}

#[test]
fn a_lost_peer_flushes_the_receives_and_returns_their_buffers() {
    let (a, b) = pair(16, 17, WaitMode::Event, false);
    let pool = BufferPool::<u8>::new(&b.pd, 2, 16, Access::LOCAL_WRITE).unwrap();
    let p1 = b.conn.recv(pool.take().unwrap()).unwrap();
    let p2 = b.conn.recv(pool.take().unwrap()).unwrap();
    drop(a);
    // The QP moved to ERROR flushes both receives.
    b.conn
        .qp()
        .modify(&softrdma::QpAttr { state: Some(softrdma::QpState::Error), ..Default::default() })
        .unwrap();
    for p in [p1, p2] {
        let d = p.wait_timeout(WAIT).expect("a flushed receive completes");
        assert_eq!(d.status(), WcStatus::WrFlushErr);
    }
    assert_eq!(pool.available(), 2, "both buffers went back to the pool");
}

#[test]
fn a_buffers_length_capacity_and_bounds() {
    let ctx = Context::open([127, 0, 31, 23].into()).unwrap();
    let pd = ctx.alloc_pd();
    let mut b = Buffer::<u32>::new(&pd, 8).unwrap();
    assert_eq!((b.len(), b.capacity(), b.byte_len(), b.is_empty()), (8, 8, 32, false));
    b.set_len(8).unwrap();
    assert!(b.set_len(9).is_err(), "past the capacity");
    b.set_len(3).unwrap();
    assert_eq!((b.len(), b.byte_len(), b.is_empty()), (3, 12, false));
    b.set_len(0).unwrap();
    assert!(b.is_empty());
    b.copy_from(&[9; 8]).unwrap();
    assert_eq!((b.len(), b.to_vec()), (8, vec![9; 8]), "exactly the capacity fits");
    assert!(b.copy_from(&[1; 9]).is_err());
    assert!(b.set(8, 1).is_err() && b.get(8).is_none());
    assert!(b.write(7, &[1, 2]).is_err(), "a write past the capacity");
    assert!(Buffer::<()>::new(&pd, 4).is_err(), "a zero-sized type");
    assert!(Buffer::<u64>::new(&pd, usize::MAX / 4).is_err(), "a size that overflows");
}

#[test]
fn a_poller_without_a_thread_dispatches_when_asked_and_counts_strays() {
    let (a, b) = pair(24, 25, WaitMode::Event, false);
    let got = Arc::new(AtomicUsize::new(0));
    for _ in 0..3 {
        let got = got.clone();
        b.conn
            .post_then(Op::Recv, Buffer::<u8>::new(&b.pd, 16).unwrap(), move |d| {
                assert_eq!(d.status(), WcStatus::Success);
                got.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    }
    for k in 0..3u8 {
        a.conn.send(Buffer::from_slice(&a.pd, &[k; 4]).unwrap()).unwrap().wait_timeout(WAIT).unwrap();
    }
    // Nothing runs the callbacks until someone dispatches: poll() takes what is there.
    let deadline = Instant::now() + WAIT;
    let mut polled = 0;
    while polled < 3 && Instant::now() < deadline {
        polled += b.poller.poll();
    }
    assert_eq!((polled, got.load(Ordering::SeqCst)), (3, 3));
    assert_eq!(b.poller.poll(), 0, "nothing left");
    // wait_timeout reports how many it dispatched: none within a short wait, then one.
    assert_eq!(b.poller.wait_timeout(Duration::from_millis(20)), 0);
    let one = b.conn.recv(Buffer::<u8>::new(&b.pd, 16).unwrap()).unwrap();
    a.conn.send(Buffer::from_slice(&a.pd, &[7u8]).unwrap()).unwrap().wait_timeout(WAIT).unwrap();
    assert_eq!(b.poller.wait_timeout(WAIT), 1);
    assert!(one.is_done());
    // A work request posted on the QP directly has no continuation: a stray.
    let mr = b.pd.register(16, Access::LOCAL_WRITE).unwrap();
    b.conn
        .qp()
        .post_recv(softrdma::RecvWr { wr_id: 777, sg_list: softrdma::sgl![mr.sge(0, 16).unwrap()] })
        .unwrap();
    a.conn.send(Buffer::from_slice(&a.pd, &[8u8]).unwrap()).unwrap().wait_timeout(WAIT).unwrap();
    assert_eq!(b.poller.wait_timeout(Duration::from_millis(500)), 0, "a stray runs nothing");
    assert_eq!(b.poller.strays(), 1);
}
