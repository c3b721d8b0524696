//! softrdma between real processes over loopback: the ping-pong in every mode, and
//! one-sided operations against a process that makes no verbs call.

use std::io::Write;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use softrdma::{
    Access, ConnectOptions, Context, EndpointInfo, QpBuilder, Rkey, SendFlags, SendOp, SendWr, WcStatus,
};

mod common;
use common::{output, softrdma, text, Proc};

/// How long any one process may run.
const LIMIT: Duration = Duration::from_secs(60);

/// Distinct TCP ports and loopback addresses for tests running in parallel.
static NEXT: AtomicU16 = AtomicU16::new(0);

fn pingpong(transport: &str, events: bool) {
    run_pingpong(transport, events, "4096", "2000", &[]);
}

fn run_pingpong(transport: &str, events: bool, size: &str, iters: &str, env: &[(&str, &str)]) {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tcp = (19_000 + std::process::id() % 20_000 + u32::from(n) * 7) as u16;
    let (srv_ip, cli_ip) = (format!("127.0.1.{}", 2 * n + 2), format!("127.0.1.{}", 2 * n + 3));
    let mut common = vec!["pingpong", "-n", iters, "-s", size, "--transport", transport, "-p"];
    let tcp_s = tcp.to_string();
    common.push(&tcp_s);
    if events {
        common.push("-e");
    }
    let server = Proc::start(softrdma(&common).args(["--bind", &srv_ip]).envs(env.iter().copied()), LIMIT);
    let client = output(
        softrdma(&common)
            // The server's exchange listens on its --bind address only.
            .args(["--bind", &cli_ip, &srv_ip])
            .envs(env.iter().copied()),
        LIMIT,
    );
    let server = server.wait();
    let show = text;
    assert!(client.status.success(), "client: {}", show(&client));
    assert!(server.status.success(), "server: {}", show(&server));
    let bytes = 2 * size.parse::<u64>().unwrap() * iters.parse::<u64>().unwrap();
    for out in [&client, &server] {
        let text = show(out);
        assert!(text.contains(&format!("{bytes} bytes in")), "{text}");
        assert!(text.contains(&format!("{iters} iters in")), "{text}");
    }
}

#[test]
fn pingpong_rc_large_messages_with_and_without_gso() {
    run_pingpong("rc", false, "200000", "200", &[]);
    run_pingpong("rc", false, "200000", "200", &[("SOFTRDMA_NO_GSO", "1")]);
}

#[test]
fn pingpong_rc_busy_poll() {
    pingpong("rc", false);
}

#[test]
fn pingpong_rc_event_mode() {
    pingpong("rc", true);
}

#[test]
fn pingpong_ud_busy_poll() {
    pingpong("ud", false);
}

#[test]
fn pingpong_ud_event_mode() {
    pingpong("ud", true);
}

#[test]
fn one_sided_operations_against_a_passive_process() {
    let size = 1 << 20;
    let mut server = Proc::start_piped(
        &mut softrdma(["memserver", "--bind", "127.0.2.2", "--size", &size.to_string()]),
        LIMIT,
    );
    let line = server.line();
    let theirs: EndpointInfo = serde_json::from_str(line.trim()).unwrap();
    let region = theirs.region.expect("memserver offers its region");

    let ctx = Context::open_port(IpAddr::from([127, 0, 2, 3]), 0).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let mr = pd.register(size, Access::LOCAL_WRITE).unwrap();
    let prepared = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq).unwrap();
    writeln!(server.stdin(), "{}", serde_json::to_string(&prepared.endpoint()).unwrap()).unwrap();
    let qp = prepared.handshake(&theirs, &ConnectOptions::default()).unwrap();
    let wait = || {
        let t = Instant::now();
        loop {
            if let Some(wc) = cq.poll_one() {
                return wc;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "no completion");
        }
    };
    let rkey = Rkey(region.rkey);
    let flags = SendFlags { signaled: true, ..Default::default() };

    // READ the server's initial pattern.
    qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Read { remote_addr: region.addr, rkey },
        sg_list: softrdma::sgl![mr.sge(0, size).unwrap()],
        flags,
        ud: None,
    })
    .unwrap();
    let wc = wait();
    assert_eq!((wc.status, wc.byte_len as usize), (WcStatus::Success, size));
    let expected: Vec<u8> = (0..size).map(|k| (k % 251) as u8).collect();
    assert_eq!(mr.to_vec(), expected);

    // WRITE new contents over the first half, then add with atomics to one word.
    let new: Vec<u8> = (0..size / 2).map(|k| (k * 7 % 256) as u8).collect();
    mr.write(0, &new).unwrap();
    qp.post_send(SendWr {
        wr_id: 2,
        op: SendOp::Write { remote_addr: region.addr, rkey },
        sg_list: softrdma::sgl![mr.sge(0, size / 2).unwrap()],
        flags,
        ud: None,
    })
    .unwrap();
    assert_eq!(wait().status, WcStatus::Success);
    let word = size - 8;
    let mut start = [0u8; 8];
    start.copy_from_slice(&expected[word..]);
    for k in 0..20u64 {
        qp.post_send(SendWr {
            wr_id: 3 + k,
            op: SendOp::FetchAdd { remote_addr: region.addr + word as u64, rkey, add: 1 },
            sg_list: softrdma::sgl![mr.sge(size - 64, 8).unwrap()],
            flags,
            ud: None,
        })
        .unwrap();
        assert_eq!(wait().status, WcStatus::Success);
    }
    let mut want = expected.clone();
    want[..size / 2].copy_from_slice(&new);
    want[word..].copy_from_slice(&(u64::from_ne_bytes(start) + 20).to_ne_bytes());

    // The passive side reports what its memory holds.
    server.close_stdin();
    let report = server.line();
    let o = server.wait();
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_str(report.trim()).unwrap();
    assert_eq!(v["len"], size);
    assert_eq!(v["crc32"], crc32fast::hash(&want));
}

/// The index of `ip`'s IPv4-mapped GID in `softrdma devinfo -v`'s table, run with `env`.
fn gid_index_of(ip: &str, env: &[(&str, &str)]) -> String {
    let out = output(softrdma(["devinfo", "-d", "srdma_lo", "-v"]).envs(env.iter().copied()), LIMIT);
    let out = String::from_utf8(out.stdout).unwrap();
    let line =
        out.lines().find(|l| l.contains(&format!("::ffff:{ip},"))).unwrap_or_else(|| panic!("{ip}: {out}"));
    let idx = line.split('[').nth(1).and_then(|r| r.split(']').next()).unwrap();
    idx.trim().to_string()
}

#[test]
fn pingpong_binds_the_gid_that_g_names() {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tcp = (19_000 + std::process::id() % 20_000 + u32::from(n) * 7).to_string();
    let (srv_ip, cli_ip) = (format!("127.0.2.{}", 2 * n + 2), format!("127.0.2.{}", 2 * n + 3));
    let gids = format!("{srv_ip},{cli_ip}");
    let env = [("SOFTRDMA_GIDS", gids.as_str())];
    let (srv_g, cli_g) = (gid_index_of(&srv_ip, &env), gid_index_of(&cli_ip, &env));
    assert_ne!(srv_g, "0");
    let common = ["pingpong", "-n", "50", "-s", "1024", "-p", &tcp];
    let server = Proc::start(softrdma(common).args(["-g", &srv_g]).envs(env), LIMIT);
    let client = output(softrdma(common).args(["-g", &cli_g, "127.0.0.1"]).envs(env), LIMIT);
    let server = server.wait();
    let (c, s) = (String::from_utf8_lossy(&client.stdout), String::from_utf8_lossy(&server.stdout));
    assert!(client.status.success() && server.status.success(), "{c}\n{s}");
    assert!(c.contains("local address:  QPN 0x") && c.contains(&format!("GID {cli_ip}:")), "{c}");
    assert!(s.contains(&format!("GID {srv_ip}:")), "{s}");
    // An index past the table is refused before anything is bound.
    let bad = output(softrdma(common).args(["-g", "200", "127.0.0.1"]).envs(env), LIMIT);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("GID"), "{}", String::from_utf8_lossy(&bad.stderr));
}
