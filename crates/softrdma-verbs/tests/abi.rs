//! The C entry points called as a C program calls them (the data path through
//! `context->ops`, as verbs.h's inline functions do), in one process: a loopback RC
//! connection between two QPs of one context, and the error answers rdma-core gives —
//! NULL arguments, a QP in RESET, an unknown lkey, a full queue, an illegal transition.

use std::ffi::{c_int, c_void, CStr};
use std::ptr;
use std::time::{Duration, Instant};

use softrdma_verbs::abi::*;

extern "C" {
    fn ibv_get_device_list(n: *mut c_int) -> *mut *mut ibv_device;
    fn ibv_free_device_list(l: *mut *mut ibv_device);
    fn ibv_get_device_name(d: *mut ibv_device) -> *const std::ffi::c_char;
    fn ibv_open_device(d: *mut ibv_device) -> *mut ibv_context;
    fn ibv_close_device(c: *mut ibv_context) -> c_int;
    fn ibv_query_port(c: *mut ibv_context, port: u8, a: *mut ibv_port_attr) -> c_int;
    fn ibv_query_gid(c: *mut ibv_context, port: u8, idx: c_int, gid: *mut [u8; 16]) -> c_int;
    fn ibv_alloc_pd(c: *mut ibv_context) -> *mut ibv_pd;
    fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int;
    fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr;
    fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int;
    fn ibv_create_cq(
        c: *mut ibv_context,
        cqe: c_int,
        ctx: *mut c_void,
        ch: *mut c_void,
        v: c_int,
    ) -> *mut ibv_cq;
    fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int;
    fn ibv_create_qp(pd: *mut ibv_pd, a: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    fn ibv_modify_qp(qp: *mut ibv_qp, a: *mut ibv_qp_attr, mask: c_int) -> c_int;
    fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int;
    fn ibv_wc_status_str(s: c_int) -> *const std::ffi::c_char;
    fn ibv_create_comp_channel(c: *mut ibv_context) -> *mut ibv_comp_channel;
    fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int;
    fn ibv_get_cq_event(ch: *mut ibv_comp_channel, cq: *mut *mut ibv_cq, ctx: *mut *mut c_void) -> c_int;
    fn ibv_ack_cq_events(cq: *mut ibv_cq, n: u32);
}

const STATE: c_int = 1;
const ACCESS: c_int = 1 << 3;
const PKEY: c_int = 1 << 4;
const PORT: c_int = 1 << 5;
const AV: c_int = 1 << 7;
const PATH_MTU: c_int = 1 << 8;
const TIMEOUT: c_int = 1 << 9;
const RETRY: c_int = 1 << 10;
const RNR_RETRY: c_int = 1 << 11;
const RQ_PSN: c_int = 1 << 12;
const MAX_RD: c_int = 1 << 13;
const MIN_RNR: c_int = 1 << 15;
const SQ_PSN: c_int = 1 << 16;
const MAX_DEST_RD: c_int = 1 << 17;
const DEST_QPN: c_int = 1 << 20;

fn errno() -> c_int {
    // SAFETY: the thread's errno.
    unsafe { *libc::__errno_location() }
}

struct Fixture {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
}

unsafe fn open() -> Fixture {
    let mut n = 0;
    let list = unsafe { ibv_get_device_list(&mut n) };
    assert!(n >= 1 && !list.is_null());
    let dev = unsafe { *list };
    let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }.to_str().unwrap().to_string();
    assert!(name.starts_with("srdma_"), "{name}");
    let ctx = unsafe { ibv_open_device(dev) };
    unsafe { ibv_free_device_list(list) };
    assert!(!ctx.is_null(), "open: errno {}", errno());
    let pd = unsafe { ibv_alloc_pd(ctx) };
    let cq = unsafe { ibv_create_cq(ctx, 64, ptr::null_mut(), ptr::null_mut(), 0) };
    assert!(!pd.is_null() && !cq.is_null());
    Fixture { ctx, pd, cq }
}

unsafe fn rc_qp(f: &Fixture, send_wr: u32) -> *mut ibv_qp {
    let cap = ibv_qp_cap {
        max_send_wr: send_wr,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    unsafe { rc_qp_with(f, cap) }
}

/// An RC QP of `cap` on the fixture's CQ.
unsafe fn rc_qp_with(f: &Fixture, cap: ibv_qp_cap) -> *mut ibv_qp {
    let mut init = ibv_qp_init_attr {
        qp_context: ptr::null_mut(),
        send_cq: f.cq,
        recv_cq: f.cq,
        srq: ptr::null_mut(),
        cap,
        qp_type: IBV_QPT_RC,
        sq_sig_all: 0,
    };
    let qp = unsafe { ibv_create_qp(f.pd, &mut init) };
    assert!(!qp.is_null(), "create_qp: errno {}", errno());
    assert_eq!(unsafe { (*qp).state }, 0, "born in RESET");
    qp
}

/// RESET → INIT → RTR → RTS towards `peer_qpn` at this context's own GID 0.
unsafe fn connect(f: &Fixture, qp: *mut ibv_qp, peer_qpn: u32) {
    let mut gid = [0u8; 16];
    assert_eq!(unsafe { ibv_query_gid(f.ctx, 1, 0, &mut gid) }, 0);
    let mut a = ibv_qp_attr { qp_state: 1, port_num: 1, qp_access_flags: 0xF, ..Default::default() };
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, STATE | PKEY | PORT | ACCESS) }, 0);
    let mut a = ibv_qp_attr {
        qp_state: 2,
        path_mtu: 3,
        dest_qp_num: peer_qpn,
        rq_psn: 0,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ..Default::default()
    };
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = ibv_gid { raw: gid };
    a.ah_attr.port_num = 1;
    let rtr = STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD | MIN_RNR;
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, rtr) }, 0);
    let mut a = ibv_qp_attr {
        qp_state: 3,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        sq_psn: 0,
        max_rd_atomic: 1,
        ..Default::default()
    };
    assert_eq!(
        unsafe { ibv_modify_qp(qp, &mut a, STATE | TIMEOUT | RETRY | RNR_RETRY | SQ_PSN | MAX_RD) },
        0
    );
    assert_eq!(unsafe { (*qp).state }, 3);
}

/// What `ibv_post_send` compiles to: a call through the context's ops.
unsafe fn post_send(qp: *mut ibv_qp, wr: &mut ibv_send_wr) -> (c_int, *mut ibv_send_wr) {
    let mut bad = ptr::null_mut();
    let f = unsafe { (*(*qp).context).ops.post_send.unwrap() };
    (unsafe { f(qp, wr, &mut bad) }, bad)
}

unsafe fn post_recv(qp: *mut ibv_qp, wr: &mut ibv_recv_wr) -> c_int {
    let mut bad = ptr::null_mut();
    let f = unsafe { (*(*qp).context).ops.post_recv.unwrap() };
    unsafe { f(qp, wr, &mut bad) }
}

/// Polls through ops until `n` completions arrive (bounded).
unsafe fn poll(cq: *mut ibv_cq, n: usize) -> Vec<ibv_wc> {
    let f = unsafe { (*(*cq).context).ops.poll_cq.unwrap() };
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.len() < n {
        assert!(Instant::now() < deadline, "timed out with {} of {n} completions", out.len());
        let mut wc = [ibv_wc::default(); 4];
        let got = unsafe { f(cq, 4, wc.as_mut_ptr()) };
        assert!(got >= 0);
        out.extend_from_slice(&wc[..got as usize]);
    }
    out
}

fn send_wr(wr_id: u64, sge: &mut ibv_sge, opcode: c_int) -> ibv_send_wr {
    ibv_send_wr {
        wr_id,
        next: ptr::null_mut(),
        sg_list: sge,
        num_sge: 1,
        opcode,
        send_flags: IBV_SEND_SIGNALED,
        imm_data: 0,
        wr: ibv_send_wr_wr { rdma: ibv_rdma { remote_addr: 0, rkey: 0 } },
        _rest: [0; 7],
    }
}

#[test]
fn send_and_write_land_in_the_programs_own_memory() {
    unsafe {
        let f = open();
        let mut port: ibv_port_attr = std::mem::zeroed();
        assert_eq!(ibv_query_port(f.ctx, 1, &mut port), 0);
        assert_eq!((port.state, port.link_layer), (4, 2));
        assert_eq!(ibv_query_port(f.ctx, 2, &mut port), libc::EINVAL);

        let (a, b) = (rc_qp(&f, 16), rc_qp(&f, 16));
        connect(&f, a, (*b).qp_num);
        connect(&f, b, (*a).qp_num);

        let mut src = vec![0u8; 4096];
        let mut dst = vec![0u8; 4096];
        for (k, x) in src.iter_mut().enumerate() {
            *x = (k * 7 + 3) as u8;
        }
        let mr_src = ibv_reg_mr(f.pd, src.as_mut_ptr().cast(), src.len(), 0x1);
        let mr_dst = ibv_reg_mr(f.pd, dst.as_mut_ptr().cast(), dst.len(), 0x1 | 0x2);
        assert!(!mr_src.is_null() && !mr_dst.is_null());
        assert_eq!((*mr_dst).addr, dst.as_mut_ptr().cast());

        // SEND into a posted receive.
        let mut rsge = ibv_sge { addr: dst.as_ptr() as u64, length: 1000, lkey: (*mr_dst).lkey };
        let mut rwr = ibv_recv_wr { wr_id: 7, next: ptr::null_mut(), sg_list: &mut rsge, num_sge: 1 };
        assert_eq!(post_recv(b, &mut rwr), 0);
        let mut sge = ibv_sge { addr: src.as_ptr() as u64, length: 1000, lkey: (*mr_src).lkey };
        let mut wr = send_wr(1, &mut sge, IBV_WR_SEND);
        assert_eq!(post_send(a, &mut wr).0, 0);
        let wcs = poll(f.cq, 2);
        let recv = wcs.iter().find(|w| w.wr_id == 7).expect("receive completion");
        assert_eq!(
            (recv.status, recv.opcode, recv.byte_len, recv.qp_num),
            (0, IBV_WC_RECV, 1000, (*b).qp_num)
        );
        assert_eq!(&dst[..1000], &src[..1000]);

        // RDMA WRITE: the bytes appear in the target's own vector, no call made on its side.
        let mut sge = ibv_sge { addr: src.as_ptr() as u64, length: 4096, lkey: (*mr_src).lkey };
        let mut wr = send_wr(2, &mut sge, IBV_WR_RDMA_WRITE);
        wr.wr.rdma = ibv_rdma { remote_addr: dst.as_ptr() as u64, rkey: (*mr_dst).rkey };
        assert_eq!(post_send(a, &mut wr).0, 0);
        let wc = poll(f.cq, 1)[0];
        assert_eq!((wc.wr_id, wc.status, wc.opcode), (2, 0, IBV_WC_RDMA_WRITE));
        assert_eq!(dst, src);

        // An unknown lkey is an error completion (local protection), not a crash.
        let mut sge = ibv_sge { addr: src.as_ptr() as u64, length: 8, lkey: 0xdead_beef };
        let mut wr = send_wr(3, &mut sge, IBV_WR_RDMA_WRITE);
        wr.wr.rdma = ibv_rdma { remote_addr: dst.as_ptr() as u64, rkey: (*mr_dst).rkey };
        assert_eq!(post_send(a, &mut wr).0, 0);
        let wc = poll(f.cq, 1)[0];
        let status = CStr::from_ptr(ibv_wc_status_str(wc.status)).to_str().unwrap();
        assert_eq!((wc.wr_id, wc.status, status), (3, 4, "local protection error"));

        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_dereg_mr(mr_src), 0);
        assert_eq!(ibv_dereg_mr(mr_dst), 0);
        assert_eq!(ibv_destroy_cq(f.cq), 0);
        assert_eq!(ibv_dealloc_pd(f.pd), 0);
        assert_eq!(ibv_close_device(f.ctx), 0);
    }
}

#[test]
fn errors_are_answered_as_rdma_core_answers_them() {
    unsafe {
        let f = open();
        // NULL where rdma-core checks for it.
        assert!(ibv_alloc_pd(ptr::null_mut()).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert!(ibv_reg_mr(ptr::null_mut(), ptr::null_mut(), 8, 0).is_null());
        assert!(ibv_create_cq(f.ctx, 0, ptr::null_mut(), ptr::null_mut(), 0).is_null());
        assert!(ibv_create_qp(f.pd, ptr::null_mut()).is_null());
        assert!(ibv_get_device_name(ptr::null_mut()).is_null());

        // Posting to a QP in RESET fails with the WR named in bad_wr, and nothing completes.
        let qp = rc_qp(&f, 2);
        let mut buf = [0u8; 64];
        let mr = ibv_reg_mr(f.pd, buf.as_mut_ptr().cast(), 64, 1);
        let mut sge = ibv_sge { addr: buf.as_ptr() as u64, length: 8, lkey: (*mr).lkey };
        let mut wr = send_wr(9, &mut sge, IBV_WR_SEND);
        let (r, bad) = post_send(qp, &mut wr);
        assert_eq!(r, libc::EINVAL);
        assert_eq!(bad, &mut wr as *mut ibv_send_wr);
        let mut wc = [ibv_wc::default(); 1];
        assert_eq!((*f.ctx).ops.poll_cq.unwrap()(f.cq, 1, wc.as_mut_ptr()), 0);

        // An illegal transition (RESET → RTS) is refused and changes nothing.
        let mut a = ibv_qp_attr { qp_state: 3, ..Default::default() };
        assert_eq!(ibv_modify_qp(qp, &mut a, STATE), libc::EINVAL);
        assert_eq!((*qp).state, 0);
        // Connected to a QP that does not exist, so what it sends stays outstanding.
        connect(&f, qp, 0xABCDE);
        // An unknown opcode is refused.
        let mut wr = send_wr(10, &mut sge, 42);
        assert_eq!(post_send(qp, &mut wr).0, libc::EINVAL);

        // A full send queue: the third of three WRs on a 2-deep queue is refused with ENOMEM.
        let mut w3 = send_wr(13, &mut sge, IBV_WR_RDMA_WRITE);
        let mut w2 = send_wr(12, &mut sge, IBV_WR_RDMA_WRITE);
        let mut w1 = send_wr(11, &mut sge, IBV_WR_RDMA_WRITE);
        for w in [&mut w1, &mut w2, &mut w3] {
            w.wr.rdma = ibv_rdma { remote_addr: 1 << 40, rkey: 0x1234 };
        }
        w2.next = &mut w3;
        w1.next = &mut w2;
        let (r, bad) = post_send(qp, &mut w1);
        assert_eq!(r, libc::ENOMEM);
        assert_eq!(bad, &mut w3 as *mut ibv_send_wr);
        ibv_destroy_qp(qp);
        ibv_dereg_mr(mr);
        ibv_close_device(f.ctx);
    }
}

/// One SGE for each of the first `n` bytes of `src`.
fn byte_sges(src: &[u8], lkey: u32, n: usize) -> Vec<ibv_sge> {
    (0..n).map(|k| ibv_sge { addr: src.as_ptr() as u64 + k as u64, length: 1, lkey }).collect()
}

/// A linked list of `n` one-byte RDMA WRITEs, the `k`th (wr_id `first_id + k`) from
/// `sges[k]` to `dst[k]`; those in `signaled` signaled. The list points into `sges` and
/// into its own buffer, which moving the Vec does not move.
fn byte_writes(
    first_id: u64,
    sges: &mut [ibv_sge],
    n: usize,
    dst: &[u8],
    rkey: u32,
    signaled: &[usize],
) -> Vec<ibv_send_wr> {
    let mut wrs: Vec<ibv_send_wr> = (0..n)
        .map(|k| {
            let mut w = send_wr(first_id + k as u64, &mut sges[k], IBV_WR_RDMA_WRITE);
            w.wr.rdma = ibv_rdma { remote_addr: dst.as_ptr() as u64 + k as u64, rkey };
            w.send_flags = if signaled.contains(&k) { IBV_SEND_SIGNALED } else { 0 };
            w
        })
        .collect();
    for k in (0..n - 1).rev() {
        wrs[k].next = &mut wrs[k + 1];
    }
    wrs
}

#[test]
fn a_list_of_wrs_is_posted_in_order_and_the_first_refused_is_named() {
    unsafe {
        let f = open();
        let cap = ibv_qp_cap {
            max_send_wr: 128,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 16,
        };
        let (a, b) = (rc_qp_with(&f, cap), rc_qp_with(&f, cap));
        connect(&f, a, (*b).qp_num);
        connect(&f, b, (*a).qp_num);
        let mut src: Vec<u8> = (0..128).map(|k| k as u8 ^ 0x5A).collect();
        let mut dst = vec![0u8; 128];
        let mr_src = ibv_reg_mr(f.pd, src.as_mut_ptr().cast(), src.len(), 0x1);
        let mr_dst = ibv_reg_mr(f.pd, dst.as_mut_ptr().cast(), dst.len(), 0x1 | 0x2);
        // 100 one-byte WRITEs in one list (longer than a run of the library's batching),
        // the 51st inline from the stack; only it and the last are signaled; every one in
        // the order of the list.
        let n = 100;
        let inline_byte = [0xC3u8; 1];
        let mut sges = byte_sges(&src, (*mr_src).lkey, n);
        sges[50] = ibv_sge { addr: inline_byte.as_ptr() as u64, length: 1, lkey: 0 };
        let mut wrs = byte_writes(0, &mut sges, n, &dst, (*mr_dst).rkey, &[50, n - 1]);
        wrs[50].send_flags |= 8; // IBV_SEND_INLINE
                                 // It overwrites the byte its predecessor wrote: it must land after it.
        wrs[50].wr.rdma.remote_addr -= 1;
        let (r, bad) = post_send(a, &mut wrs[0]);
        assert_eq!((r, bad), (0, ptr::null_mut()));
        let wcs = poll(f.cq, 2);
        assert_eq!([(wcs[0].wr_id, wcs[0].status), (wcs[1].wr_id, wcs[1].status)], [(50, 0), (99, 0)]);
        let mut want = src[..n].to_vec();
        (want[49], want[50]) = (0xC3, 0);
        assert_eq!(&dst[..n], &want[..]);

        // A list whose third WR has an unknown opcode: the first two are posted, the third
        // is named in bad_wr, the fourth is not posted.
        dst.fill(0);
        let mut wrs = byte_writes(200, &mut sges, 4, &dst, (*mr_dst).rkey, &[1]);
        wrs[2].opcode = 42;
        let (r, bad) = post_send(a, &mut wrs[0]);
        assert_eq!((r, bad), (libc::EINVAL, &mut wrs[2] as *mut ibv_send_wr));
        let wc = poll(f.cq, 1)[0];
        assert_eq!((wc.wr_id, wc.status), (201, 0));
        // The fourth would have landed by the time the second's completion came (one QP,
        // in order): it was not posted.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(&dst[..4], &[src[0], src[1], 0, 0]);
        let mut none = [ibv_wc::default(); 1];
        assert_eq!((*f.ctx).ops.poll_cq.unwrap()(f.cq, 1, none.as_mut_ptr()), 0);

        // A list of 80 whose 71st the engine refuses (two SGEs on a QP that takes one), in
        // the list's second run: the first 70 are posted, the 71st is named, none after it.
        dst.fill(0);
        let mut sges = byte_sges(&src, (*mr_src).lkey, 81);
        let mut wrs = byte_writes(300, &mut sges, 80, &dst, (*mr_dst).rkey, &[69]);
        wrs[70].num_sge = 2;
        let (r, bad) = post_send(a, &mut wrs[0]);
        assert_eq!((r, bad), (libc::EINVAL, &mut wrs[70] as *mut ibv_send_wr));
        let wc = poll(f.cq, 1)[0];
        assert_eq!((wc.wr_id, wc.status), (369, 0));
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(&dst[..70], &src[..70]);
        assert_eq!(&dst[70..80], &[0; 10]);
        assert_eq!((*f.ctx).ops.poll_cq.unwrap()(f.cq, 1, none.as_mut_ptr()), 0);
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_dereg_mr(mr_src), 0);
        assert_eq!(ibv_dereg_mr(mr_dst), 0);
        ibv_close_device(f.ctx);
    }
}

#[test]
fn inline_sends_carry_the_bytes_of_unregistered_memory_as_they_were_at_post() {
    unsafe {
        let f = open();
        let cap = ibv_qp_cap {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        let qps = [rc_qp_with(&f, cap), rc_qp_with(&f, cap)];
        let (a, b) = (qps[0], qps[1]);
        connect(&f, a, (*b).qp_num);
        connect(&f, b, (*a).qp_num);
        let mut dst = vec![0u8; 256];
        let mr_dst = ibv_reg_mr(f.pd, dst.as_mut_ptr().cast(), dst.len(), 0x1);
        for round in 0..3u8 {
            let mut rsge = ibv_sge { addr: dst.as_ptr() as u64, length: 256, lkey: (*mr_dst).lkey };
            let mut rwr = ibv_recv_wr {
                wr_id: 70 + u64::from(round),
                next: ptr::null_mut(),
                sg_list: &mut rsge,
                num_sge: 1,
            };
            assert_eq!(post_recv(b, &mut rwr), 0);
            // Two pieces from memory no MR covers, with lkeys that name nothing: inline data
            // is taken at the post, and the program may change it at once.
            let mut first = [round.wrapping_mul(3).wrapping_add(1); 20];
            let mut second: Vec<u8> = (0..30).map(|k| k ^ round).collect();
            let mut sges = [
                ibv_sge { addr: first.as_ptr() as u64, length: 20, lkey: 0xdead },
                ibv_sge { addr: second.as_ptr() as u64, length: 30, lkey: 0xbeef },
            ];
            let mut wr = send_wr(10 + u64::from(round), &mut sges[0], IBV_WR_SEND);
            wr.num_sge = 2;
            wr.send_flags |= 8; // IBV_SEND_INLINE
            assert_eq!(post_send(a, &mut wr).0, 0);
            let mut want = first.to_vec();
            want.extend_from_slice(&second);
            first.fill(0xEE);
            second.fill(0xEE);
            let wcs = poll(f.cq, 2);
            let recv = wcs.iter().find(|w| w.wr_id == 70 + u64::from(round)).expect("receive completion");
            assert_eq!((recv.status, recv.byte_len), (0, 50));
            assert_eq!(&dst[..50], &want[..], "round {round}");
        }
        // More than the QP's inline limit is refused at the post.
        let big = [0u8; 65];
        let mut sge = ibv_sge { addr: big.as_ptr() as u64, length: 65, lkey: 0 };
        let mut wr = send_wr(99, &mut sge, IBV_WR_SEND);
        wr.send_flags |= 8;
        assert_eq!(post_send(a, &mut wr).0, libc::EINVAL);
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_dereg_mr(mr_dst), 0);
        assert_eq!(ibv_destroy_cq(f.cq), 0);
        assert_eq!(ibv_dealloc_pd(f.pd), 0);
        assert_eq!(ibv_close_device(f.ctx), 0);
    }
}

#[test]
fn a_completion_channel_destroyed_under_a_waiting_thread_leaves_later_channels_alone() {
    // The completion-channel twin of rdma_get_cm_event's case (tests/rdmacm.rs): a thread
    // still waits in ibv_get_cq_event when the program destroys the channel. It must
    // neither wake into freed memory nor take the events of a channel made later in the
    // freed one's place.
    // SAFETY: the C API used as documented, but for the destroy under a waiting thread,
    // which is what this tests.
    unsafe {
        let f = open();
        let ch1 = ibv_create_comp_channel(f.ctx);
        assert!(!ch1.is_null());
        let ch1_addr = ch1 as usize;
        let _waiter = std::thread::spawn(move || {
            let (mut cq, mut cq_ctx) = (ptr::null_mut(), ptr::null_mut());
            // No CQ ever reports to the first channel: this waits for good.
            ibv_get_cq_event(ch1_addr as *mut ibv_comp_channel, &mut cq, &mut cq_ctx);
        });
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(ibv_destroy_comp_channel(ch1), 0);
        // A new channel, likely in the freed one's memory, with a CQ armed on it.
        let ch2 = ibv_create_comp_channel(f.ctx);
        assert!(!ch2.is_null());
        let cq = ibv_create_cq(f.ctx, 16, 0x5eed as *mut c_void, ch2.cast(), 0);
        assert!(!cq.is_null());
        assert_eq!((*f.ctx).ops.req_notify_cq.unwrap()(cq, 0), 0);
        let g = Fixture { ctx: f.ctx, pd: f.pd, cq };
        let (a, b) = (rc_qp(&g, 4), rc_qp(&g, 4));
        connect(&g, a, (*b).qp_num);
        connect(&g, b, (*a).qp_num);
        let mut buf = vec![0u8; 64];
        let mr = ibv_reg_mr(f.pd, buf.as_mut_ptr().cast(), buf.len(), 1);
        let mut rsge = ibv_sge { addr: buf.as_ptr() as u64 + 32, length: 32, lkey: (*mr).lkey };
        let mut rwr = ibv_recv_wr { wr_id: 1, next: ptr::null_mut(), sg_list: &mut rsge, num_sge: 1 };
        assert_eq!(post_recv(b, &mut rwr), 0);
        let mut sge = ibv_sge { addr: buf.as_ptr() as u64, length: 8, lkey: (*mr).lkey };
        let mut wr = send_wr(2, &mut sge, IBV_WR_SEND);
        assert_eq!(post_send(a, &mut wr).0, 0);
        // Past the waiting thread's one-second turn, then the event must still be there.
        std::thread::sleep(Duration::from_millis(1500));
        let fd = (*ch2).fd;
        let flags = libc::fcntl(fd, libc::F_GETFL);
        assert_eq!(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK), 0);
        let (mut got, mut got_ctx) = (ptr::null_mut(), ptr::null_mut());
        assert_eq!(
            ibv_get_cq_event(ch2, &mut got, &mut got_ctx),
            0,
            "the completion's event was taken: errno {}",
            errno()
        );
        assert_eq!((got, got_ctx as usize), (cq, 0x5eed));
        ibv_ack_cq_events(cq, 1);
        assert_eq!(poll(cq, 2).len(), 2);
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_destroy_comp_channel(ch2), 0);
        assert_eq!(ibv_destroy_cq(f.cq), 0);
        assert_eq!(ibv_dealloc_pd(f.pd), 0);
        assert_eq!(ibv_close_device(f.ctx), 0);
    }
}
