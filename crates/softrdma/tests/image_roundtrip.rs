//! The image round trip example as users run it: real processes, real sockets, the result
//! checked by the example against local processing and here against the PNG it wrote;
//! and its server facing clients that send garbage or ask for too much.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod examples_support;
use examples_support::{run_bounded, KillOnDrop};

fn example() -> PathBuf {
    examples_support::example("image_roundtrip")
}

use softrdma::cm::{getaddrinfo, AddrHints, ConnParam, Ep, EpQp};
use softrdma::WcStatus;

#[test]
fn the_image_round_trip_runs_with_no_setup_and_checks_its_result() {
    let out_dir = std::env::temp_dir().join(format!("softrdma-image-test-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    for (task, channels) in [("blur", 4u8), ("edges", 1)] {
        let out = out_dir.join(format!("{task}.png"));
        let mut c = Command::new(example());
        c.args(["--task", task, "--variant", "both", "--output"]).arg(&out);
        let o = run_bounded(c, Duration::from_secs(120));
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
        // Both variants ran and each checked its result against local processing.
        assert_eq!(stdout.matches("matches local processing").count(), 2, "{stdout}");
        assert!(stdout.contains("Send: 640x400") && stdout.contains("WriteImm: 640x400"), "{stdout}");
        let img = image::open(&out).unwrap();
        assert_eq!((img.width(), img.height(), img.color().channel_count()), (640, 400, channels));
        // Not a blank picture: the shipped scene has edges and colours.
        let bytes = img.as_bytes();
        let distinct: std::collections::HashSet<_> = bytes.iter().collect();
        assert!(distinct.len() > 50, "{task}: {} distinct byte values", distinct.len());
    }
    std::fs::remove_dir_all(&out_dir).unwrap();
}

/// A client of the example's server, speaking its protocol by hand.
fn raw_client(server: &str, src: [u8; 4], request: &[u8]) -> Option<(WcStatus, Vec<u8>)> {
    let hints = AddrHints { src: Some(src.into()), ..AddrHints::default() };
    let (ip, port) = server.split_once(':').unwrap();
    let info = getaddrinfo(Some(ip), Some(port), &hints).unwrap();
    let mut ep = Ep::create(&info[0], None, Some(&EpQp::default())).unwrap();
    let reply = ep.reg_msgs(64).unwrap();
    ep.post_recv(1, &reply, 0, 64).unwrap();
    ep.connect(&ConnParam { rnr_retry_count: 7, ..ConnParam::default() }).unwrap();
    let msg = ep.reg_msgs(request.len()).unwrap();
    msg.write(0, request).unwrap();
    let flags = softrdma::SendFlags { signaled: true, ..Default::default() };
    ep.post_send(2, &msg, 0, request.len(), flags).unwrap();
    assert_eq!(ep.get_send_comp_timeout(Duration::from_secs(10)).unwrap().status, WcStatus::Success);
    let got = ep
        .get_recv_comp_timeout(Duration::from_secs(2))
        .ok()
        .map(|wc| (wc.status, reply.to_vec()[..wc.byte_len as usize].to_vec()));
    ep.disconnect().unwrap();
    got
}

fn request(magic: u32, task: u32, width: u32, height: u32) -> Vec<u8> {
    let mut r = vec![0u8; 48];
    r[0..4].copy_from_slice(&magic.to_le_bytes());
    r[4..8].copy_from_slice(&task.to_le_bytes());
    r[8..12].copy_from_slice(&width.to_le_bytes());
    r[12..16].copy_from_slice(&height.to_le_bytes());
    r[16..20].copy_from_slice(&2.0f32.to_le_bytes());
    r
}

#[test]
fn the_server_refuses_bad_clients_and_serves_the_next() {
    let server = "127.0.35.1:7471";
    let mut s = KillOnDrop(
        Command::new(example())
            .args(["--server", server, "--clients", "4"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let s = &mut s.0;
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(s.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.starts_with("listening"), "{line}");

    // Garbage: the server closes the connection without an answer (the receive flushes).
    let (status, ready) = raw_client(server, [127, 0, 35, 2], &[0xFF; 48]).expect("the connection ends");
    assert_eq!((status, ready.len()), (WcStatus::WrFlushErr, 0));
    // A picture of 100000 x 100000 pixels (40 GB): refused with status 2.
    let (status, ready) =
        raw_client(server, [127, 0, 35, 3], &request(0x494d_4731, 1, 100_000, 100_000)).unwrap();
    assert_eq!(status, WcStatus::Success);
    assert_eq!(u32::from_le_bytes(ready[20..24].try_into().unwrap()), 2, "status 2: too large");
    // An unknown task: status 1.
    let (_, ready) = raw_client(server, [127, 0, 35, 4], &request(0x494d_4731, 9, 10, 10)).unwrap();
    assert_eq!(u32::from_le_bytes(ready[20..24].try_into().unwrap()), 1, "status 1: bad request");
    // A real client is served after all that.
    let mut c = Command::new(example());
    c.args(["--connect", server, "--bind", "127.0.35.5", "--variant", "send", "--task", "gray"]);
    c.args(["--output"])
        .arg(std::env::temp_dir().join(format!("softrdma-image-gray-{}.png", std::process::id())));
    let o = run_bounded(c, Duration::from_secs(60));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("matches local processing"));

    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = s.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the server did not exit after four clients");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut s.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "three clients failed: the server says so in its status");
    assert!(err.contains("client 1: not a request"), "{err}");
    assert!(err.contains("client 2: refused the request (status 2)"), "{err}");
    assert!(err.contains("client 3: refused the request (status 1)"), "{err}");
    assert!(err.contains("3 of 4 clients failed"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
