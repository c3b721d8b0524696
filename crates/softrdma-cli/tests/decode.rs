//! `softrdma decode` run as a process on real rxe captures, on the same packets in other
//! link layers and file formats, and on broken input.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

mod common;
use common::{output, softrdma, Proc};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn pcaps(dir: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pcap"))
        .collect();
    v.sort();
    v
}

fn decode(args: &[&Path], json: bool) -> Output {
    let mut cmd = softrdma(["decode"]);
    if json {
        cmd.arg("--json");
    }
    output(cmd.args(args), Duration::from_secs(60))
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn summary(o: &Output) -> (String, String) {
    let out = stdout(o);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines.len() >= 2, "output too short: {out}");
    (lines[lines.len() - 2].to_string(), lines[lines.len() - 1].to_string())
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("softrdma-decode-{}-{name}", std::process::id()))
}

#[test]
fn every_rxe_capture_decodes_clean() {
    let files = pcaps("testdata/rxe");
    let refs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let o = decode(&refs, false);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let (s, other) = summary(&o);
    assert_eq!(s, "3038 packets, 3038 icrc-ok, 0 icrc-bad, 0 malformed");
    assert_eq!(other, "525 other frames skipped");
    let out = stdout(&o);
    for needle in [
        "RC RDMA_WRITE_FIRST",
        "dma_len=10000",
        "RC RDMA_READ_RESPONSE_MIDDLE",
        "RC COMPARE_SWAP",
        "orig=0x",
        "imm=0x1234abcd",
        "UD SEND_ONLY_WITH_IMMEDIATE",
        "UC SEND_FIRST",
        "cm=REQ",
        "cm=DREP",
        "cm=SIDR_REQ",
        "qkey=0x80010000 src_qp=0x000001",
        "aeth=ACK msn=",
    ] {
        assert!(out.contains(needle), "missing {needle:?}");
    }
}

#[test]
fn ipv6_rxe_captures_decode_clean() {
    let files = pcaps("testdata/rxe-ipv6");
    let refs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let o = decode(&refs, false);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(summary(&o).0, "681 packets, 681 icrc-ok, 0 icrc-bad, 0 malformed");
    assert!(stdout(&o).contains("[fe80::5054:ff:fe77:a]:"));
}

#[test]
fn garbage_is_malformed_and_exit_status_is_1() {
    let o = decode(&[&root().join("testdata/rxe-misc/host_udp_reach.pcap")], false);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        summary(&o),
        ("6 packets, 2 icrc-ok, 0 icrc-bad, 4 malformed".into(), "8 other frames skipped".into())
    );
    assert_eq!(stdout(&o).matches("MALFORMED: unknown or unsupported opcode 0x68").count(), 4);
}

#[test]
fn one_flipped_byte_is_icrc_bad() {
    let mut bytes = std::fs::read(root().join("testdata/rxe/rc_pingpong.pcap")).unwrap();
    // Find the first RoCE payload by its UDP destination port and flip a payload byte.
    let at = bytes.windows(2).position(|w| w == [0x12, 0xb7]).unwrap() + 2 + 4 + 12 + 8;
    bytes[at] ^= 0x40;
    let path = tmp("flipped.pcap");
    std::fs::write(&path, &bytes).unwrap();
    let o = decode(&[&path], false);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(summary(&o).0, "50 packets, 49 icrc-ok, 1 icrc-bad, 0 malformed");
    assert!(stdout(&o).contains("icrc=BAD"));
}

#[test]
fn json_lines_agree_with_text() {
    let file = root().join("testdata/rxe/imm_send_write.pcap");
    let o = decode(&[&file], true);
    assert_eq!(o.status.code(), Some(0));
    let lines: Vec<serde_json::Value> =
        stdout(&o).lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect();
    let (last, packets) = lines.split_last().unwrap();
    assert_eq!(packets.len(), 21);
    assert_eq!(last["summary"]["packets"], 21);
    assert_eq!(last["summary"]["icrc_ok"], 21);
    assert!(packets.iter().all(|p| p["icrc"] == "ok"));
    let imm = packets.iter().find(|p| p["name"] == "RC SEND_ONLY_WITH_IMMEDIATE").unwrap();
    assert_eq!(imm["opcode"], 5);
    assert_eq!(imm["headers"]["ext"]["immdt"]["value"], 0x1234_abcd);
    assert!(packets.iter().any(|p| p["cm"] == "REQ"));
}

#[test]
fn pcapng_gives_the_same_packets() {
    for (ng, pcap) in [("rping.pcapng", "rxe/rping.pcap"), ("rping_ipv6.pcapng", "rxe-ipv6/rping_ipv6.pcap")]
    {
        let a = decode(&[&root().join("testdata/formats").join(ng)], false);
        let b = decode(&[&root().join("testdata").join(pcap)], false);
        assert_eq!(a.status.code(), Some(0));
        assert_eq!(stdout(&a), stdout(&b), "{ng}");
    }
}

/// Rewrites an Ethernet pcap with another link layer in front of each IP packet.
fn relink(src: &Path, linktype: u32, header: impl Fn(u16) -> Vec<u8>) -> Vec<u8> {
    let bytes = std::fs::read(src).unwrap();
    let mut out = bytes[..24].to_vec();
    out[20..24].copy_from_slice(&linktype.to_le_bytes());
    let mut at = 24;
    while at + 16 <= bytes.len() {
        let caplen = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        let frame = &bytes[at + 16..at + 16 + caplen];
        let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
        let mut rec = header(ethertype);
        rec.extend_from_slice(&frame[14..]);
        out.extend_from_slice(&bytes[at..at + 8]);
        out.extend_from_slice(&(rec.len() as u32).to_le_bytes());
        out.extend_from_slice(&(rec.len() as u32).to_le_bytes());
        out.extend_from_slice(&rec);
        at += 16 + caplen;
    }
    out
}

/// Makes a link-layer header for a given ethertype.
type LinkHeader = dyn Fn(u16) -> Vec<u8>;

#[test]
fn linux_cooked_and_raw_ip_link_layers() {
    let src = root().join("testdata/rxe/udaddy.pcap");
    let reference = summary(&decode(&[&src], false)).0;
    let sll = |t: u16| {
        let mut h = vec![0u8; 14];
        h.extend_from_slice(&t.to_be_bytes());
        h
    };
    let sll2 = |t: u16| {
        let mut h = t.to_be_bytes().to_vec();
        h.extend_from_slice(&[0u8; 18]);
        h
    };
    let raw = |_t: u16| Vec::new();
    let variants: [(&str, u32, &LinkHeader); 3] =
        [("sll", 113, &sll), ("sll2", 276, &sll2), ("raw", 101, &raw)];
    for (name, lt, f) in variants {
        let path = tmp(&format!("{name}.pcap"));
        std::fs::write(&path, relink(&src, lt, f)).unwrap();
        let o = decode(&[&path], false);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(o.status.code(), Some(0), "{name}");
        assert_eq!(summary(&o).0, reference, "{name}");
    }
}

#[test]
fn unreadable_files_exit_2_with_a_clear_message() {
    let good = std::fs::read(root().join("testdata/rxe/rping.pcap")).unwrap();
    let cases: [(&str, Vec<u8>, &str); 3] = [
        ("truncated.pcap", good[..good.len() - 7].to_vec(), "truncated"),
        ("garbage.pcap", b"this is not a capture file at all".to_vec(), "not a pcap or pcapng file"),
        ("empty.pcap", Vec::new(), "not a pcap or pcapng file"),
    ];
    for (name, bytes, msg) in cases {
        let path = tmp(name);
        std::fs::write(&path, bytes).unwrap();
        let o = decode(&[&path], false);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(o.status.code(), Some(2), "{name}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(msg), "{name}: {err}");
    }
    let o = decode(&[Path::new("/nonexistent/capture.pcap")], false);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("No such file"));
}

#[test]
fn packets_cut_by_the_snap_length_are_malformed_not_skipped() {
    // Rewrite every record of a capture to keep only its first 100 bytes.
    let bytes = std::fs::read(root().join("testdata/rxe/rdma_server_client.pcap")).unwrap();
    let mut out = bytes[..24].to_vec();
    let mut at = 24;
    while at + 16 <= bytes.len() {
        let caplen = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        let keep = caplen.min(100);
        out.extend_from_slice(&bytes[at..at + 8]);
        out.extend_from_slice(&(keep as u32).to_le_bytes());
        out.extend_from_slice(&bytes[at + 12..at + 16]);
        out.extend_from_slice(&bytes[at + 16..at + 16 + keep]);
        at += 16 + caplen;
    }
    let path = tmp("snapped.pcap");
    std::fs::write(&path, out).unwrap();
    let o = decode(&[&path], false);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(o.status.code(), Some(1));
    // The five 298-byte CM MADs lose their tail; the four short RC packets survive intact.
    assert_eq!(summary(&o).0, "9 packets, 4 icrc-ok, 0 icrc-bad, 5 malformed");
    assert!(stdout(&o).contains("cut short by the capture"));
}

#[test]
fn interop_captures_with_rxe_are_all_valid() {
    // Both softrdma's packets (ID 0) and rxe's (kernel IDs) in runs against Linux rxe.
    let files = pcaps("testdata/interop");
    assert_eq!(files.len(), 4);
    let refs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let o = decode(&refs, false);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(summary(&o).0, "1151 packets, 1151 icrc-ok, 0 icrc-bad, 0 malformed");
    let out = stdout(&o);
    assert!(out.contains("192.168.77.1:4791 > 192.168.77.11:4791 RC SEND_FIRST"), "softrdma's packets");
    assert!(
        out.contains("192.168.77.11:") && out.contains("> 192.168.77.1:4791 RC ACKNOWLEDGE"),
        "rxe's ACKs"
    );
}

#[test]
fn drop_in_library_captures_with_rxe_are_all_valid_both_ways() {
    // perftest and ibv_rc_pingpong on the drop-in libibverbs.so.1 against the same tools
    // on Linux rxe, each direction (testdata/interop-lib/README.md).
    let files = pcaps("testdata/interop-lib");
    assert_eq!(files.len(), 8);
    for f in &files {
        let o = decode(&[f.as_path()], false);
        assert_eq!(o.status.code(), Some(0), "{}", f.display());
        assert_eq!(summary(&o).0, "300 packets, 300 icrc-ok, 0 icrc-bad, 0 malformed", "{}", f.display());
        let out = stdout(&o);
        let name = f.file_name().unwrap().to_string_lossy();
        // Both ends speak: softrdma from 192.168.77.1:4791, rxe from a per-QP port.
        assert!(out.contains("192.168.77.1:4791 > 192.168.77.11:4791 RC "), "{name}: softrdma's packets");
        assert!(out.contains("> 192.168.77.1:4791 RC "), "{name}: rxe's packets");
        let (ours, theirs) = match &*name {
            "write_bw_vm_srv.pcap" => ("RC RDMA_WRITE_MIDDLE", "RC ACKNOWLEDGE"),
            "write_bw_host_srv.pcap" => ("RC ACKNOWLEDGE", "RC RDMA_WRITE_MIDDLE"),
            "read_bw_vm_srv.pcap" => ("RC RDMA_READ_REQUEST", "RC RDMA_READ_RESPONSE_MIDDLE"),
            "read_bw_host_srv.pcap" => ("RC RDMA_READ_RESPONSE_MIDDLE", "RC RDMA_READ_REQUEST"),
            n if n.starts_with("send_lat") => ("RC SEND_ONLY", "RC SEND_ONLY"),
            _ => ("RC SEND_FIRST", "RC SEND_FIRST"),
        };
        assert!(out.contains(&format!("192.168.77.1:4791 > 192.168.77.11:4791 {ours}")), "{name}: {ours}");
        assert!(
            out.lines().any(|l| l.contains("> 192.168.77.1:4791") && l.contains(theirs)),
            "{name}: rxe's {theirs}"
        );
    }
}

#[test]
fn multicast_captures_with_rxe_are_ud_sends_to_the_group() {
    // mckey on softrdma's drop-in libraries against mckey on Linux rxe, each side as the
    // sender (testdata/interop-mcast/README.md).
    let files = pcaps("testdata/interop-mcast");
    assert_eq!(files.len(), 2);
    for f in &files {
        let o = decode(&[f.as_path()], false);
        assert_eq!(o.status.code(), Some(0), "{}: every packet well formed, every ICRC ok", f.display());
        let out = stdout(&o);
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let (from, group) = if name.contains("host_sends") {
            ("192.168.77.1:4791 >", "> 239.77.1.1:4791")
        } else {
            ("192.168.77.11:", "> 239.77.1.2:4791")
        };
        let msgs: Vec<&str> = out.lines().filter(|l| l.contains(" UD ")).collect();
        assert_eq!(msgs.len(), 50, "{name}: mckey's 50 messages");
        for l in &msgs {
            assert!(l.contains(from) && l.contains(group), "{name}: sender and group: {l}");
            for field in
                ["SEND_ONLY_WITH_IMMEDIATE", "qpn=0xffffff", "qkey=0x01234567", "len=1000", "icrc=ok"]
            {
                assert!(l.contains(field), "{name}: {field}: {l}");
            }
        }
    }
}

#[test]
fn connection_manager_captures_with_rxe_name_every_cm_message_in_order() {
    // `softrdma rping`, `cmatose` and `udaddy` against rdmacm-utils' rping, ucmatose and
    // udaddy on Linux rxe, each side as server (testdata/interop-cm/README.md).
    let files = pcaps("testdata/interop-cm");
    assert_eq!(files.len(), 6);
    for f in &files {
        let o = decode(&[f.as_path()], false);
        assert_eq!(o.status.code(), Some(0), "{}: every packet well formed, every ICRC ok", f.display());
        let out = stdout(&o);
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        // Which CM messages each side sent (true: softrdma, at 192.168.77.1:4791).
        let us = "192.168.77.1:4791 > 192.168.77.11:4791";
        let cm: Vec<(bool, &str)> = out
            .lines()
            .filter_map(|l| Some((l.contains(us), l.split("cm=").nth(1)?.split_whitespace().next()?)))
            .collect();
        // The client is active in the handshake; rping's client and ucmatose's server
        // disconnect.
        let softrdma_client = name.ends_with("vm_srv.pcap");
        let (c, s) = (softrdma_client, !softrdma_client);
        if name.starts_with("udaddy") {
            // SIDR: one request and one answer per UD endpoint, then datagrams carrying
            // the sender's QP as immediate data.
            for (from, kind) in [(c, "SIDR_REQ"), (s, "SIDR_REP")] {
                assert_eq!(cm.iter().filter(|&&(f, k)| f == from && k == kind).count(), 10, "{name}: {kind}");
            }
            assert_eq!(cm.len(), 20, "{name}: {cm:?}");
            // rxe sends a UD QP's datagrams from a port of its own.
            let (from, to) = if c { (us, "") } else { ("192.168.77.11:", "> 192.168.77.1:4791") };
            let data =
                |l: &&str| l.contains(from) && l.contains(to) && l.contains("UD SEND_ONLY_WITH_IMMEDIATE");
            assert!(out.lines().any(|l| data(&l)), "{name}: the client's datagrams");
            continue;
        }
        let (conns, closer) = if name.starts_with("rping") { (1, c) } else { (10, s) };
        for (from, kind) in [(c, "REQ"), (s, "REP"), (c, "RTU"), (closer, "DREQ"), (!closer, "DREP")] {
            let n = cm.iter().filter(|&&(f, k)| f == from && k == kind).count();
            assert_eq!(n, conns, "{name}: {kind} from {}: {cm:?}", if from { "softrdma" } else { "rxe" });
        }
        assert_eq!(cm.len(), 5 * conns, "{name}: nothing else on QP1");
        // Each connection's handshake precedes the teardown.
        let last_rtu = cm.iter().rposition(|&(_, k)| k == "RTU").unwrap();
        let first_dreq = cm.iter().position(|&(_, k)| k == "DREQ").unwrap();
        assert!(last_rtu < first_dreq, "{name}");
        let ops: &[&str] = if name.starts_with("rping") {
            &["RC SEND_ONLY", "RC RDMA_READ_REQUEST", "RC RDMA_WRITE_ONLY"]
        } else {
            &["RC SEND_ONLY"]
        };
        for op in ops {
            assert!(out.contains(op), "{name}: {op}");
        }
    }
}

#[test]
fn rdma_cm_library_and_perf_r_captures_with_rxe_connect_through_the_cm_both_ways() {
    // Debian's rping, ucmatose and ib_send_bw -R on the drop-in librdmacm.so.1, and
    // `softrdma perf -R`, against the same tools on Linux rxe, each side as server
    // (testdata/interop-rdmacm/README.md).
    let files = pcaps("testdata/interop-rdmacm");
    assert_eq!(files.len(), 10);
    for f in &files {
        let o = decode(&[f.as_path()], false);
        assert_eq!(o.status.code(), Some(0), "{}", f.display());
        assert_eq!(summary(&o).0, "300 packets, 300 icrc-ok, 0 icrc-bad, 0 malformed", "{}", f.display());
        let out = stdout(&o);
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let us = "192.168.77.1:4791 > 192.168.77.11:4791";
        let host_server = name.contains("host_srv");
        // The client sends the REQs and RTUs, the server the REPs (and the REJ of a perftest
        // data connection that came before rxe listened again).
        let sent_by = |msg: &str, softrdma: bool| {
            out.lines().filter(|l| l.contains(&format!("cm={msg} ")) && l.contains(us) == softrdma).count()
        };
        let conns = match &*name {
            n if n.starts_with("rping") => 1,
            n if n.starts_with("ucmatose") => 4,
            _ => 2, // perftest -R: the exchange's connection and the benchmark's QP
        };
        assert_eq!(sent_by("REP", host_server), conns, "{name}: REPs from the server");
        assert_eq!(sent_by("RTU", !host_server), conns, "{name}: RTUs from the client");
        assert_eq!(
            sent_by("REQ", !host_server),
            conns + sent_by("REJ", host_server),
            "{name}: REQs, retried after a REJ"
        );
        // Data crossed both ways on RC QPs after the handshake.
        assert!(out.lines().any(|l| l.contains(us) && l.contains(" RC ")), "{name}: softrdma's RC packets");
        assert!(out.lines().any(|l| l.contains("> 192.168.77.1:4791 RC ")), "{name}: rxe's RC packets");
    }
}

/// Runs `softrdma decode` on `path` with `input` streamed to its stdin (for `/dev/stdin`),
/// killing it (and failing) after 20 s; returns its exit status, stderr and peak RSS in KiB.
fn decode_bounded(
    path: &str,
    input: impl FnOnce(std::process::ChildStdin) + Send + 'static,
) -> (i32, String, i64) {
    use std::os::unix::process::ExitStatusExt;
    let mut p = Proc::start_piped(&mut softrdma(["decode", path]), Duration::from_secs(20));
    let stdin = p.take_stdin();
    let writer = std::thread::spawn(move || input(stdin));
    let (o, rss) = p.end_rss().unwrap_or_else(|e| panic!("{e}"));
    // Killed or ended, the process no longer reads: the writer stops at a broken pipe.
    let _ = writer.join();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.signal().is_none(), "decode killed by signal {:?}: {err}", o.status.signal());
    (o.status.code().unwrap(), err, rss)
}

#[test]
fn a_capture_is_streamed_in_bounded_memory() {
    use std::io::Write;
    // A valid pcap of 96 MiB of 1000-byte non-RoCE frames, through a pipe: reading it
    // whole would take at least that much memory.
    let (code, err, rss_kib) = decode_bounded("/dev/stdin", |mut w| {
        let mut header = vec![0xd4, 0xc3, 0xb2, 0xa1, 2, 0, 4, 0];
        header.extend_from_slice(&[0; 8]);
        header.extend_from_slice(&65535u32.to_le_bytes());
        header.extend_from_slice(&1u32.to_le_bytes());
        let mut record = vec![0u8; 8];
        record.extend_from_slice(&1000u32.to_le_bytes());
        record.extend_from_slice(&1000u32.to_le_bytes());
        record.extend_from_slice(&[0u8; 1000]);
        let chunk: Vec<u8> = record.iter().copied().cycle().take(record.len() * 1024).collect();
        let _ = w.write_all(&header);
        for _ in 0..96 {
            if w.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    assert_eq!(code, 0, "{err}");
    assert!(rss_kib < 48 << 10, "decode grew to {rss_kib} KiB for a 96 MiB capture");
}

#[test]
fn dev_zero_and_absurd_record_lengths_are_refused_at_once() {
    // /dev/zero never ends: only its first bytes may be read.
    let (code, err, rss_kib) = decode_bounded("/dev/zero", drop);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a pcap or pcapng file"), "{err}");
    assert!(rss_kib < 48 << 10, "{rss_kib} KiB");
    // A pcap record and a pcapng block that claim 4 GiB, followed by endless zeros.
    let mut pcap = vec![0xd4, 0xc3, 0xb2, 0xa1, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    pcap.extend_from_slice(&65535u32.to_le_bytes());
    pcap.extend_from_slice(&1u32.to_le_bytes());
    pcap.extend_from_slice(&[0; 8]);
    pcap.extend_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
    pcap.extend_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
    let mut ng = vec![0x0A, 0x0D, 0x0D, 0x0A];
    ng.extend_from_slice(&28u32.to_le_bytes());
    ng.extend_from_slice(&[0x4D, 0x3C, 0x2B, 0x1A, 1, 0, 0, 0]);
    ng.extend_from_slice(&u64::MAX.to_le_bytes());
    ng.extend_from_slice(&28u32.to_le_bytes());
    ng.extend_from_slice(&6u32.to_le_bytes()); // an enhanced packet block
    ng.extend_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
    for (name, head, field, at) in [("pcap", pcap, "captured length", 24), ("pcapng", ng, "block length", 28)]
    {
        let (code, err, rss_kib) = decode_bounded("/dev/stdin", move |mut w| {
            use std::io::Write;
            let _ = w.write_all(&head);
            let zeros = vec![0u8; 1 << 20];
            // Until decode stops reading, or 256 MiB.
            for _ in 0..256 {
                if w.write_all(&zeros).is_err() {
                    return;
                }
            }
        });
        assert_eq!(code, 2, "{name}: {err}");
        let want = format!("{field} 4294967280 at byte offset {at} is more than the 1048576 bytes");
        assert!(err.contains(&want), "{name}: {err}");
        assert!(rss_kib < 48 << 10, "{name}: {rss_kib} KiB");
    }
}

/// `SOFTRDMA_PCAP=DIR/%p.pcapng`: a `perf --local` run (two processes) writes one capture
/// per process, which `softrdma decode` reads back: the WRITEs and their ACKs, every ICRC
/// right, from the client's and from the server's side, the filler of the WRITEs' MIDDLE
/// and LAST packets (`wire::fill`) read past and named.
#[test]
fn softrdma_pcap_captures_decode_with_good_icrcs() {
    let dir = std::env::temp_dir().join(format!("softrdma-pcap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = (20_000 + std::process::id() % 20_000).to_string();
    let udp = (port.parse::<u16>().unwrap() + 1).to_string();
    let run = output(
        softrdma(["perf", "write_bw", "--local", "-s", "16384", "-n", "300", "-p", &port])
            .env("SOFTRDMA_PCAP", dir.join("%p.pcapng"))
            .env("SOFTRDMA_PORT", &udp),
        Duration::from_secs(60),
    );
    assert!(run.status.success(), "{}", common::text(&run));
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 2, "one capture per process: {files:?}");
    for f in &files {
        let args = ["decode".as_ref(), "--udp-port".as_ref(), udp.as_ref(), f.as_os_str()];
        let d = output(&mut softrdma(args), Duration::from_secs(30));
        let text = common::text(&d);
        assert!(d.status.success(), "{text}");
        assert!(text.contains("RDMA_WRITE_FIRST") && text.contains("ACKNOWLEDGE"), "{text}");
        let middle = text.lines().find(|l| l.contains("RDMA_WRITE_MIDDLE") && l.contains("filler=16"));
        assert!(middle.is_some_and(|l| l.contains("icrc=ok")), "{text}");
        let summary = text.lines().rev().find(|l| l.contains("icrc-ok")).unwrap();
        assert!(
            summary.contains("0 icrc-bad, 0 malformed") && !summary.starts_with("0 packets"),
            "{summary}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A RoCEv2 packet for `encap`: `opcode` to QP 0x12, PSN `psn`, `payload`, the BTH's byte 8
/// ORed with `flags` before the ICRC is computed.
fn roce_packet(opcode: u8, psn: u32, payload: &[u8], aeth: bool, flags: u8, encap: &icrc::Encap) -> Vec<u8> {
    use softrdma_proto::wire::{AethRepr, AethSyndrome, BthRepr, Opcode, PacketRepr};
    let mut r = PacketRepr::new(
        BthRepr::new(
            Opcode::new(opcode).unwrap(),
            softrdma_proto::Qpn::new(0x12),
            softrdma_proto::Psn::new(psn),
        ),
        payload.len(),
    );
    if aeth {
        r.ext.aeth = Some(AethRepr { syndrome: AethSyndrome::ACK, msn: 1 });
    }
    let mut buf = vec![0u8; 256];
    let n = r.emit(&mut buf, payload, encap).unwrap();
    buf.truncate(n);
    buf[8] |= flags;
    let icrc = icrc::compute(encap, &buf[..n - 4]);
    buf[n - 4..].copy_from_slice(&icrc.to_le_bytes());
    buf
}

use softrdma_proto::wire::icrc;

#[test]
fn a_bundled_ack_decodes_as_the_two_packets_it_carries() {
    use softrdma_proto::wire::bundle::BUNDLED_ACK;
    let (src, dst) = ("10.0.0.1:4791".parse().unwrap(), "10.0.0.2:4791".parse().unwrap());
    let encap = icrc::Encap::new(src, dst).unwrap();
    // A SEND ONLY (0x04) that carries the ACK (0x11) of the peer's PSN 7.
    let bundle = |request_flags: u8| {
        let mut d = roce_packet(0x04, 3, b"12345678", false, request_flags, &encap);
        d.extend(roce_packet(0x11, 7, &[], true, 0, &encap));
        d
    };
    let datagram = |roce: &[u8]| ipv4_datagram(src, dst, roce);
    let path = tmp("bundle.pcap");
    std::fs::write(&path, raw_ip_pcap(&[datagram(&bundle(BUNDLED_ACK))])).unwrap();
    let o = decode(&[&path], false);
    let text = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert_eq!(summary(&o).0, "2 packets, 2 icrc-ok, 0 icrc-bad, 0 malformed", "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].contains("RC SEND_ONLY qpn=0x000012 psn=0x000003") && lines[0].contains("len=8 icrc=ok"),
        "{text}"
    );
    assert!(
        lines[1].contains("RC ACKNOWLEDGE qpn=0x000012 psn=0x000007") && lines[1].contains("icrc=ok"),
        "{text}"
    );
    // Without the flag, the same bytes are one SEND ONLY with 20 bytes too many for its
    // ICRC: decode does not guess.
    std::fs::write(&path, raw_ip_pcap(&[datagram(&bundle(0))])).unwrap();
    let o = decode(&[&path], false);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(summary(&o).0, "1 packets, 0 icrc-ok, 1 icrc-bad, 0 malformed", "{}", stdout(&o));
}

/// An IPv4 datagram from `src` to `dst` (port 4791) carrying `roce`.
fn ipv4_datagram(src: std::net::SocketAddr, dst: std::net::SocketAddr, roce: &[u8]) -> Vec<u8> {
    use softrdma_proto::wire::ip::{Ipv4Repr, UdpRepr};
    let udp_len = (8 + roce.len()) as u16;
    let (std::net::SocketAddr::V4(s), std::net::SocketAddr::V4(d)) = (src, dst) else { unreachable!() };
    let mut ip = vec![0u8; 28];
    Ipv4Repr::canonical(*s.ip(), *d.ip(), 2, udp_len).unwrap().emit((&mut ip[..20]).try_into().unwrap());
    let udp = UdpRepr { src_port: 4791, dst_port: 4791, length: udp_len, checksum: 0 };
    udp.emit((&mut ip[20..28]).try_into().unwrap());
    ip.extend_from_slice(roce);
    ip
}

/// A classic pcap of raw IP frames.
fn raw_ip_pcap(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for v in [0xA1B2_C3D4u32, 0x0004_0002, 0, 0, 65535, 101] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    // The second field packs version 2.4 as two u16s.
    out[4..8].copy_from_slice(&[2, 0, 4, 0]);
    for f in frames {
        for v in [0u32, 0, f.len() as u32, f.len() as u32] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(f);
    }
    out
}

#[test]
fn filler_is_read_past_and_filler_that_cannot_be_is_malformed() {
    use softrdma_proto::wire::fill::FILLED;
    let (src, dst) = ("10.0.0.1:4791".parse().unwrap(), "10.0.0.2:4791".parse().unwrap());
    let encap = icrc::Encap::new(src, dst).unwrap();
    // An RC WRITE MIDDLE (0x07) of 64 bytes with 16 bytes of filler, zero or not, its ICRC
    // made for the whole.
    let filled = |filler: u8| {
        let mut payload = vec![0x5Au8; 64];
        payload.extend([filler; 16]);
        roce_packet(0x07, 9, &payload, false, FILLED, &encap)
    };
    let path = tmp("filler.pcap");
    std::fs::write(&path, raw_ip_pcap(&[ipv4_datagram(src, dst, &filled(0))])).unwrap();
    let o = decode(&[&path], false);
    let text = stdout(&o);
    assert_eq!(summary(&o).0, "1 packets, 1 icrc-ok, 0 icrc-bad, 0 malformed", "{text}");
    assert!(text.contains("RDMA_WRITE_MIDDLE") && text.contains("len=64 filler=16 icrc=ok"), "{text}");
    std::fs::write(&path, raw_ip_pcap(&[ipv4_datagram(src, dst, &filled(1))])).unwrap();
    let o = decode(&[&path], false);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(summary(&o).0, "1 packets, 0 icrc-ok, 0 icrc-bad, 1 malformed", "{}", stdout(&o));
}
