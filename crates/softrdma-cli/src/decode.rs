//! `softrdma decode`: print the RoCEv2 packets in capture files, one line each, with an
//! ICRC verdict, and a summary.
//!
//! Each UDP datagram to port 4791 lands in exactly one bucket: *malformed* (the RoCEv2
//! headers do not parse), else *icrc-bad* or *icrc-ok* (exact check against the captured
//! IP header). Every other frame is skipped and counted apart.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Serialize;
use softrdma_proto::wire::{self, icrc, ip, mad, Packet, PacketRepr, ROCEV2_PORT};
use softrdma_proto::Qpn;

use crate::capture::{self, L3};

/// Arguments of `softrdma decode`.
#[derive(Debug, clap::Args)]
pub struct DecodeArgs {
    /// pcap or pcapng files.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// One JSON object per line (packets, then a summary) instead of text.
    #[arg(long)]
    pub json: bool,
    /// The UDP port RoCEv2 traffic goes to (repeat for several): 4791 unless given; a
    /// process's `SOFTRDMA_PORT`, or the ports of contexts opened on port 0, which a
    /// `SOFTRDMA_PCAP` capture holds.
    #[arg(long = "udp-port", value_name = "PORT")]
    pub udp_ports: Vec<u16>,
}

/// Counts over all files.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// RoCEv2 packets (UDP to port 4791).
    pub packets: u64,
    /// Packets whose ICRC matched.
    pub icrc_ok: u64,
    /// Packets that parsed but whose ICRC did not match.
    pub icrc_bad: u64,
    /// Packets whose RoCEv2 headers did not parse.
    pub malformed: u64,
    /// Frames that were not RoCEv2 at all.
    pub other: u64,
}

#[derive(Serialize)]
struct JsonPacket<'a> {
    file: &'a str,
    frame: usize,
    src: SocketAddr,
    dst: SocketAddr,
    #[serde(skip_serializing_if = "Option::is_none")]
    opcode: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    headers: Option<PacketRepr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cm: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    icrc: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    malformed: Option<String>,
    /// Zero bytes a softrdma peer put before the ICRC (`wire::fill`), not counted in the
    /// headers' payload length.
    #[serde(skip_serializing_if = "Option::is_none")]
    filler: Option<usize>,
}

/// The outcome of decoding one datagram.
enum Verdict {
    Ok,
    Bad,
    Malformed(wire::Error),
}

/// Runs the command; returns the process exit status.
pub fn run(args: &DecodeArgs) -> i32 {
    let mut summary = Summary::default();
    let mut unreadable = false;
    let many = args.files.len() > 1;
    let mut out = String::new();
    for path in &args.files {
        let name = path.display().to_string();
        // Streamed, one record at a time: a capture of any size (or /dev/zero) is read in
        // bounded memory.
        let file = match std::fs::File::open(path) {
            Ok(f) => std::io::BufReader::new(f),
            Err(e) => {
                eprintln!("softrdma decode: {name}: {e}");
                unreadable = true;
                continue;
            }
        };
        if many && !args.json {
            println!("==> {name} <==");
        }
        let result = capture::read_frames(file, |frame| {
            out.clear();
            decode_frame(&name, &frame, args, &mut summary, &mut out);
            if !out.is_empty() {
                println!("{out}");
            }
        });
        if let Err(e) = result {
            eprintln!("softrdma decode: {name}: {e}");
            unreadable = true;
        }
    }
    if args.json {
        #[derive(Serialize)]
        struct Last {
            summary: Summary,
        }
        println!("{}", serde_json::to_string(&Last { summary }).unwrap_or_default());
    } else {
        println!(
            "{} packets, {} icrc-ok, {} icrc-bad, {} malformed",
            summary.packets, summary.icrc_ok, summary.icrc_bad, summary.malformed
        );
        println!("{} other frames skipped", summary.other);
    }
    if unreadable {
        2
    } else if summary.icrc_bad + summary.malformed > 0 {
        1
    } else {
        0
    }
}

fn decode_frame(
    file: &str,
    frame: &capture::Frame<'_>,
    args: &DecodeArgs,
    s: &mut Summary,
    out: &mut String,
) {
    let json = args.json;
    let ports: &[u16] = if args.udp_ports.is_empty() { &[ROCEV2_PORT] } else { &args.udp_ports };
    let L3::Ip(ip_bytes) = capture::network_layer(frame) else {
        s.other += 1;
        return;
    };
    let dgram = match ip::parse_ip_udp(ip_bytes) {
        Ok(ip::IpContent::Udp(d)) => d,
        Err(wire::Error::Truncated { .. }) if cut_short_roce(ip_bytes, ports) => {
            // The capture kept only part of a RoCEv2 packet (snap length): it cannot be
            // checked, and skipping it silently would hide it.
            s.packets += 1;
            s.malformed += 1;
            if json {
                let j = serde_json::json!({ "file": file, "frame": frame.number, "malformed": SNAPPED });
                out.push_str(&j.to_string());
            } else {
                let _ = write!(out, "{:>5} MALFORMED: {SNAPPED}", frame.number);
            }
            return;
        }
        _ => {
            s.other += 1;
            return;
        }
    };
    if !ports.contains(&dgram.udp.dst_port) {
        s.other += 1;
        return;
    }
    let src = SocketAddr::new(dgram.ip.src(), dgram.udp.src_port);
    let dst = SocketAddr::new(dgram.ip.dst(), dgram.udp.dst_port);
    let encap = dgram.encap();
    let at = Where { file, frame: frame.number, src, dst, encap: &encap };
    // A request with the ACK that softrdma bundles into its datagram (between softrdma
    // peers): the two packets, each checked as if it had come alone.
    if let Some((request, ack)) = wire::bundle::split(dgram.payload) {
        decode_packet(&at, request, json, s, out);
        out.push('\n');
        decode_packet(&at, ack, json, s, out);
        return;
    }
    decode_packet(&at, dgram.payload, json, s, out);
}

/// Where a packet was found: its file, frame, addresses and encapsulation.
struct Where<'a> {
    file: &'a str,
    frame: usize,
    src: SocketAddr,
    dst: SocketAddr,
    encap: &'a icrc::Encap,
}

/// Decodes one packet (a datagram's payload, or one packet of a bundle).
fn decode_packet(at: &Where<'_>, payload: &[u8], json: bool, s: &mut Summary, out: &mut String) {
    let Where { file, frame: number, src, dst, encap } = *at;
    s.packets += 1;
    // Filler that softrdma puts before the ICRC between softrdma peers (`wire::fill`) is
    // read past; the ICRC covers it.
    let stripped = wire::fill::strip(payload);
    let filler = stripped.ok().map(|b| payload.len() - b.len()).filter(|&n| n > 0);
    let parsed = match stripped {
        Ok(b) => Packet::new_checked(b).and_then(|p| Ok((PacketRepr::parse(&p)?, p))),
        // Malformed, as softrdma's receiver takes it.
        Err(_) => Err(wire::Error::BadField {
            header: "BTH",
            reason: "filler flagged that is not zero or has no room",
        }),
    };
    let verdict = match &parsed {
        Err(e) => Verdict::Malformed(e.clone()),
        Ok(_) if icrc::verify(encap, payload) => Verdict::Ok,
        Ok(_) => Verdict::Bad,
    };
    match verdict {
        Verdict::Ok => s.icrc_ok += 1,
        Verdict::Bad => s.icrc_bad += 1,
        Verdict::Malformed(_) => s.malformed += 1,
    }
    let cm = parsed.as_ref().ok().and_then(|(_, p)| cm_message(p));
    if json {
        let (repr, pkt) = match &parsed {
            Ok((r, p)) => (Some(*r), Some(p)),
            Err(_) => (None, None),
        };
        let j = JsonPacket {
            file,
            frame: number,
            src,
            dst,
            opcode: pkt.map(|p| p.opcode().code()),
            name: pkt.map(|p| p.opcode().to_string()),
            headers: repr,
            cm,
            icrc: match verdict {
                Verdict::Ok => Some("ok"),
                Verdict::Bad => Some("bad"),
                Verdict::Malformed(_) => None,
            },
            malformed: match &verdict {
                Verdict::Malformed(e) => Some(e.to_string()),
                _ => None,
            },
            filler,
        };
        // Serializing plain data into a String cannot fail.
        out.push_str(&serde_json::to_string(&j).unwrap_or_default());
        return;
    }
    let _ = write!(out, "{number:>5} {src} > {dst} ");
    match (&parsed, &verdict) {
        (Ok((repr, p)), _) => {
            text_line(out, repr, p);
            if let Some(m) = cm {
                let _ = write!(out, " cm={m}");
            }
            if let Some(n) = filler {
                let _ = write!(out, " filler={n}");
            }
            out.push_str(if matches!(verdict, Verdict::Ok) { " icrc=ok" } else { " icrc=BAD" });
        }
        (Err(_), Verdict::Malformed(e)) => {
            let _ = write!(out, "MALFORMED: {e}");
        }
        (Err(_), _) => {}
    }
}

const SNAPPED: &str = "RoCEv2 packet cut short by the capture (snap length)";

/// Whether a truncated IP packet is visibly a UDP datagram to a RoCEv2 port.
fn cut_short_roce(b: &[u8], ports: &[u16]) -> bool {
    let port_at = match b.first().map(|v| v >> 4) {
        Some(4) if b.len() >= 20 && b[9] == ip::PROTO_UDP => usize::from(b[0] & 0xF) * 4 + 2,
        Some(6) if b.len() >= 40 && b[6] == ip::PROTO_UDP => 42,
        _ => return false,
    };
    b.get(port_at..port_at + 2).is_some_and(|p| ports.contains(&u16::from_be_bytes([p[0], p[1]])))
}

/// The CM message type of a MAD on QP1, if this is one.
fn cm_message(p: &Packet<&[u8]>) -> Option<&'static str> {
    if p.bth().dest_qp() != Qpn::GSI || p.deth().is_none() {
        return None;
    }
    mad::MadHeader::parse(p.payload()).ok()?.cm_message()
}

fn text_line(out: &mut String, r: &PacketRepr, p: &Packet<&[u8]>) {
    let b = &r.bth;
    let _ = write!(out, "{} qpn={} psn={} ack={}", b.opcode, b.dest_qp, b.psn, u8::from(b.ack_req));
    if b.solicited {
        out.push_str(" se=1");
    }
    if b.mig_req {
        out.push_str(" m=1");
    }
    if b.fecn || b.becn {
        let _ = write!(out, " fecn={} becn={}", u8::from(b.fecn), u8::from(b.becn));
    }
    if b.pkey != wire::DEFAULT_PKEY {
        let _ = write!(out, " pkey={:#06x}", b.pkey);
    }
    let e = &r.ext;
    if let Some(h) = e.deth {
        let _ = write!(out, " qkey={} src_qp={}", h.qkey, h.src_qp);
    }
    if let Some(h) = e.feth {
        let _ = write!(out, " placement={} selectivity={}", h.placement_type, h.selectivity);
    }
    if let Some(h) = e.reth {
        let _ = write!(out, " va={:#x} rkey={} dma_len={}", h.va, h.rkey, h.dma_len);
    }
    if let Some(h) = e.atomic_eth {
        let _ = write!(
            out,
            " va={:#x} rkey={} swap_add={:#x} compare={:#x}",
            h.va, h.rkey, h.swap_add, h.compare
        );
    }
    if let Some(h) = e.aeth {
        let _ = write!(out, " aeth={} msn={}", h.syndrome, h.msn);
    }
    if let Some(h) = e.atomic_ack_eth {
        let _ = write!(out, " orig={:#x}", h.orig);
    }
    if let Some(h) = e.immdt {
        let _ = write!(out, " imm={:#010x}", h.value);
    }
    if let Some(h) = e.ieth {
        let _ = write!(out, " inv_rkey={}", h.rkey);
    }
    let _ = write!(out, " len={}", p.payload().len());
    if p.pad_count() != 0 {
        let _ = write!(out, " pad={}", p.pad_count());
    }
}
