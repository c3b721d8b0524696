//! `SOFTRDMA_LOG` and `SOFTRDMA_PCAP`: a process that does a WRITE with a wrong R_Key logs,
//! on standard error, the responder's refusal and its reason, the NAK on both sides and the
//! failed work request, each with its QPN; and its capture holds the WRITE and the NAK, as
//! IP datagrams whose ICRCs check. The process is this test binary run again, so that the
//! log and the capture (set up once per process) start from nothing.

use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use softrdma::proto::wire::{icrc, AethSyndrome, NakCode, Operation, Packet};
use softrdma::{
    Access, ConnectOptions, Context, QpBuilder, Rkey, SendFlags, SendOp, SendWr, WcStatus, LOG_ENV, PCAP_ENV,
};

#[test]
fn the_log_names_a_nak_and_its_reason() {
    let exe = std::env::current_exe().unwrap();
    let pcap = std::env::temp_dir().join(format!("softrdma-log-{}.pcapng", std::process::id()));
    let mut child = Command::new(exe)
        .args(["--exact", "bad_write_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(LOG_ENV, "debug")
        .env(PCAP_ENV, &pcap)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).unwrap();
        s
    });
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the child did not finish in 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = reader.join().unwrap();
    assert!(status.success(), "child failed: {log}");
    for want in [
        "memory access refused reason=no memory region with this key",
        "NAK sent; the QP goes to ERROR",
        "nak=remote access error",
        "NAK received",
        "work request failed",
        "status=remote access error",
        "QP to ERROR",
        "qpn=0x",
    ] {
        assert!(log.contains(want), "{want:?} is not in the log:\n{log}");
    }

    // The capture: every packet an IPv4/UDP datagram with a good ICRC; the WRITE one way,
    // the NAK remote access error the other.
    let bytes = std::fs::read(&pcap).unwrap();
    let _ = std::fs::remove_file(&pcap);
    let packets = pcapng_packets(&bytes);
    let (mut write, mut nak) = (false, false);
    for ip in &packets {
        assert_eq!(ip[0] >> 4, 4, "an IPv4 datagram");
        let src: std::net::SocketAddr = (ipv4(&ip[12..16]), u16::from_be_bytes([ip[20], ip[21]])).into();
        let dst: std::net::SocketAddr = (ipv4(&ip[16..20]), u16::from_be_bytes([ip[22], ip[23]])).into();
        let roce = &ip[28..];
        assert!(icrc::verify(&icrc::Encap::new(src, dst).unwrap(), roce), "ICRC of a captured packet");
        let p = Packet::new_checked(roce).unwrap();
        write |= p.opcode().operation() == Operation::RdmaWriteOnly;
        let syn = p.aeth().and_then(|a| AethSyndrome::from_byte(a.syndrome_raw()).ok());
        nak |= syn == Some(AethSyndrome::Nak(NakCode::RemoteAccessError));
    }
    assert!(packets.len() >= 2 && write && nak, "{} packets, WRITE {write}, NAK {nak}", packets.len());
}

fn ipv4(b: &[u8]) -> std::net::IpAddr {
    std::net::IpAddr::from([b[0], b[1], b[2], b[3]])
}

/// The packet data of every Enhanced Packet Block of a little-endian pcapng file.
fn pcapng_packets(b: &[u8]) -> Vec<Vec<u8>> {
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    assert_eq!(u32_at(0), 0x0A0D_0D0A, "a pcapng section header");
    let mut out = Vec::new();
    let mut at = 0;
    while at + 12 <= b.len() {
        let (kind, len) = (u32_at(at), u32_at(at + 4) as usize);
        assert!(len >= 12 && at + len <= b.len(), "block at {at}");
        if kind == 6 {
            let caplen = u32_at(at + 20) as usize;
            out.push(b[at + 28..at + 28 + caplen].to_vec());
        }
        at += len;
    }
    out
}

/// The process the test above runs: one WRITE with an R_Key one off the real one.
#[test]
#[ignore = "run by the_log_names_a_nak_and_its_reason, in a process of its own"]
fn bad_write_child() {
    let open = |ip: [u8; 4]| Context::open_port(IpAddr::from(ip), 0).unwrap();
    let (ca, cb) = (open([127, 0, 8, 2]), open([127, 0, 8, 3]));
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (cqa, cqb) = (ca.create_cq(16, None).unwrap(), cb.create_cq(16, None).unwrap());
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let qa = pa.prepare_qp(&QpBuilder::rc().access(all), &cqa, &cqa).unwrap();
    let qb = pb.prepare_qp(&QpBuilder::rc().access(all), &cqb, &cqb).unwrap();
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    let qa = qa.handshake(&eb, &ConnectOptions::default()).unwrap();
    let _qb = qb.handshake(&ea, &ConnectOptions::default()).unwrap();
    let src = pa.register(64, Access::NONE).unwrap();
    let dst = pb.register(64, all).unwrap();
    let r = dst.remote();
    qa.post_send(SendWr {
        wr_id: 7,
        op: SendOp::Write { remote_addr: r.addr, rkey: Rkey(r.rkey ^ 1) },
        sg_list: softrdma::sgl![src.sge(0, 64).unwrap()],
        flags: SendFlags { signaled: true, ..Default::default() },
        ud: None,
    })
    .unwrap();
    let wc = cqa.wait_one_timeout(Duration::from_secs(20)).expect("a completion");
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert_eq!(wc.status.to_string(), "remote access error");
}
