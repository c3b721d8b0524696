//! Built-in packet capture: every RoCEv2 datagram a process sends and receives, written to a
//! pcapng file that `softrdma decode`, tshark and Wireshark open.
//!
//! `SOFTRDMA_PCAP=FILE` turns it on for the whole process (every device it opens, Rust
//! programs and the drop-in libraries alike; `%p` in FILE becomes the process ID, for runs
//! of several processes); [`crate::Context::capture_to`] for one device.
//! The link type is raw IP (LINKTYPE_RAW): each packet gets the IPv4 or IPv6 and UDP headers
//! the wire carries — IPv4 Identification 0 and DF as softrdma sends (received packets get
//! the same, the kernel hiding the real ones), the TOS byte, UDP checksum 0 over IPv4 and
//! the real one over IPv6 — so the ICRCs of softrdma's packets check in the capture. A GSO
//! train is written as the datagrams it becomes on the wire; a request and the ACK
//! bundled into its datagram (`softrdma_proto::wire::bundle`) as two datagrams, the two
//! packets the peer handles, so that tools that know only the IBTA's framing check both.
//! The file is bounded: writing stops at `SOFTRDMA_PCAP_MAX` bytes (default 64 MiB), with
//! one line on standard error.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use softrdma_proto::wire::ip::{Ipv4Repr, Ipv6Repr, UdpRepr, PROTO_UDP};

/// The environment variable naming the capture file.
pub const PCAP_ENV: &str = "SOFTRDMA_PCAP";
/// The environment variable bounding the capture file's size, in bytes.
pub const PCAP_MAX_ENV: &str = "SOFTRDMA_PCAP_MAX";
const DEFAULT_MAX: u64 = 64 << 20;

/// A pcapng file being written.
#[derive(Debug)]
pub(crate) struct Capture {
    out: BufWriter<File>,
    written: u64,
    max: u64,
    full: bool,
}

/// A capture shared by the engines that write to it.
pub(crate) type SharedCapture = Arc<Mutex<Capture>>;

impl Capture {
    /// Creates `path` (truncating it) and writes the section and interface headers.
    pub(crate) fn create(path: &Path, max: u64) -> std::io::Result<Capture> {
        let mut c = Capture { out: BufWriter::new(File::create(path)?), written: 0, max, full: false };
        // Section Header Block: byte-order magic, version 1.0, section length unknown.
        let mut shb = Vec::new();
        shb.extend_from_slice(&0x1A2B_3C4Du32.to_le_bytes());
        shb.extend_from_slice(&1u16.to_le_bytes());
        shb.extend_from_slice(&0u16.to_le_bytes());
        shb.extend_from_slice(&(-1i64).to_le_bytes());
        c.block(0x0A0D_0D0A, &shb)?;
        // Interface Description Block: LINKTYPE_RAW (101), no snapshot limit.
        let mut idb = Vec::new();
        idb.extend_from_slice(&101u16.to_le_bytes());
        idb.extend_from_slice(&0u16.to_le_bytes());
        idb.extend_from_slice(&0u32.to_le_bytes());
        c.block(1, &idb)?;
        c.out.flush()?;
        Ok(c)
    }

    fn block(&mut self, kind: u32, body: &[u8]) -> std::io::Result<()> {
        let pad = (4 - body.len() % 4) % 4;
        let len = (12 + body.len() + pad) as u32;
        self.out.write_all(&kind.to_le_bytes())?;
        self.out.write_all(&len.to_le_bytes())?;
        self.out.write_all(body)?;
        self.out.write_all(&[0; 3][..pad])?;
        self.out.write_all(&len.to_le_bytes())?;
        self.written += u64::from(len);
        Ok(())
    }

    /// Writes one datagram (`roce`: the UDP payload) from `src` to `dst` with IP TOS `tos`.
    pub(crate) fn packet(&mut self, src: SocketAddr, dst: SocketAddr, tos: u8, roce: &[u8]) {
        if let Some((request, ack)) = softrdma_proto::wire::bundle::split(roce) {
            self.packet(src, dst, tos, request);
            self.packet(src, dst, tos, ack);
            return;
        }
        if self.full {
            return;
        }
        let Some(ip) = ip_datagram(src, dst, tos, roce) else { return };
        if self.written + ip.len() as u64 + 64 > self.max {
            self.full = true;
            eprintln!(
                "softrdma: capture full ({} bytes, {PCAP_MAX_ENV}); no more packets written",
                self.written
            );
            let _ = self.out.flush();
            return;
        }
        let us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        let mut epb = Vec::with_capacity(20 + ip.len());
        epb.extend_from_slice(&0u32.to_le_bytes());
        epb.extend_from_slice(&((us >> 32) as u32).to_le_bytes());
        epb.extend_from_slice(&(us as u32).to_le_bytes());
        epb.extend_from_slice(&(ip.len() as u32).to_le_bytes());
        epb.extend_from_slice(&(ip.len() as u32).to_le_bytes());
        epb.extend_from_slice(&ip);
        if self.block(6, &epb).is_err() {
            self.full = true;
        }
    }

    /// Pushes what is buffered to the file.
    pub(crate) fn flush(&mut self) {
        let _ = self.out.flush();
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// The IP datagram carrying `roce` as the wire would, or `None` for mixed families.
fn ip_datagram(src: SocketAddr, dst: SocketAddr, tos: u8, roce: &[u8]) -> Option<Vec<u8>> {
    let udp_len = u16::try_from(8 + roce.len()).ok()?;
    let mut udp = UdpRepr { src_port: src.port(), dst_port: dst.port(), length: udp_len, checksum: 0 };
    let mut out;
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let ip = Ipv4Repr::canonical(s, d, tos, udp_len)?;
            out = vec![0u8; 28 + roce.len()];
            ip.emit((&mut out[..20]).try_into().ok()?);
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let ip = Ipv6Repr {
                src: s,
                dst: d,
                traffic_class: tos,
                flow_label: 0,
                payload_len: udp_len,
                next_header: PROTO_UDP,
                hop_limit: 64,
            };
            out = vec![0u8; 48 + roce.len()];
            ip.emit((&mut out[..40]).try_into().ok()?);
            // IPv6 has no zero checksum; IPv4's stays 0, as RoCEv2 sends it.
            udp.checksum = udp.checksum_for(src.ip(), dst.ip(), roce);
        }
        _ => return None,
    }
    let at = out.len() - roce.len() - 8;
    udp.emit((&mut out[at..at + 8]).try_into().ok()?);
    out[at + 8..].copy_from_slice(roce);
    Some(out)
}

/// The process-wide capture `SOFTRDMA_PCAP` asks for, opened once (an error is printed
/// once and capture stays off).
pub(crate) fn from_env() -> Option<SharedCapture> {
    static CAPTURE: OnceLock<Option<SharedCapture>> = OnceLock::new();
    CAPTURE
        .get_or_init(|| {
            let path = std::env::var(PCAP_ENV).ok()?;
            // `%p`: the process ID, so that the processes of one run (a server and its
            // client, a parent and the children it starts) write files of their own.
            let path = path.replace("%p", &std::process::id().to_string());
            let max = std::env::var(PCAP_MAX_ENV).ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_MAX);
            match Capture::create(Path::new(&path), max) {
                Ok(c) => Some(Arc::new(Mutex::new(c))),
                Err(e) => {
                    eprintln!("softrdma: {PCAP_ENV}={}: {e}; no capture", Path::new(&path).display());
                    None
                }
            }
        })
        .clone()
}
