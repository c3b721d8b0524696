//! Reading capture files: pcap (either byte order, micro- or nanosecond) and pcapng, one
//! record at a time through the `pcap-parser` crate, and peeling the link layer down to
//! the IP packet. A file of any size is read in bounded memory ([`MAX_RECORD`]).
//!
//! Link types: Ethernet (with any number of 802.1Q/802.1ad tags), Linux cooked v1 and v2,
//! raw IP (101, 228, 229, and 12/14 as some systems number it) and BSD loopback (0, 108).

use std::io::Read;

use pcap_parser::nom;
use pcap_parser::pcapng::Block;
use pcap_parser::{
    parse_block_be, parse_block_le, parse_pcap_frame, parse_pcap_frame_be, parse_pcap_header, PcapError,
};

/// One captured frame.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// 1-based position in the file, as Wireshark numbers frames.
    pub number: usize,
    /// The link type of the interface that captured it.
    pub linktype: i32,
    /// The captured bytes.
    pub data: &'a [u8],
}

/// What is wrong with a capture file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureError(pub String);

impl std::fmt::Display for CaptureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn describe<I>(e: nom::Err<PcapError<I>>, offset: impl std::fmt::Display) -> CaptureError {
    let what = match e {
        nom::Err::Incomplete(_) => "file ends in the middle of a record (truncated capture?)".to_string(),
        nom::Err::Error(pe) | nom::Err::Failure(pe) => match pe {
            PcapError::Incomplete(_) | PcapError::UnexpectedEof | PcapError::Eof => {
                "file ends in the middle of a record (truncated capture?)".to_string()
            }
            PcapError::HeaderNotRecognized => "not a pcap or pcapng file".to_string(),
            PcapError::NomError(_, kind) => format!("malformed record ({kind:?})"),
            PcapError::OwnedNomError(_, kind) => format!("malformed record ({kind:?})"),
            _ => "unreadable record".to_string(),
        },
    };
    CaptureError(format!("{what} at byte offset {offset}"))
}

/// The largest record (pcap record or pcapng block, headers included) a capture may
/// hold: far above any frame (Wireshark's limit is 256 KiB), and the most memory reading a
/// capture takes. A longer one is refused as damage, not read.
pub const MAX_RECORD: usize = 1 << 20;

/// Calls `f` for every frame of the capture in `bytes`, in file order. Frames before a
/// malformed record are delivered before the error is returned.
#[cfg(test)]
pub fn for_each_frame(bytes: &[u8], f: impl FnMut(Frame<'_>)) -> Result<(), CaptureError> {
    read_frames(bytes, f)
}

/// Calls `f` for every frame of the capture `input` streams, in file order, holding one
/// record at a time (at most [`MAX_RECORD`] bytes). Frames before a malformed record are
/// delivered before the error is returned.
pub fn read_frames(input: impl Read, mut f: impl FnMut(Frame<'_>)) -> Result<(), CaptureError> {
    let mut r = Records { input, offset: 0, buf: Vec::new() };
    let got = r.fill(0, 4)?;
    if got < 4 {
        return Err(CaptureError("not a pcap or pcapng file (too short)".into()));
    }
    if r.buf[..4] == [0x0A, 0x0D, 0x0D, 0x0A] {
        return pcapng_frames(&mut r, &mut f);
    }
    r.fill(4, 24)?;
    let (_, header) = parse_pcap_header(&r.buf).map_err(|e| match e {
        nom::Err::Error(PcapError::HeaderNotRecognized)
        | nom::Err::Failure(PcapError::HeaderNotRecognized) => {
            CaptureError("not a pcap or pcapng file".into())
        }
        e => describe(e, 0),
    })?;
    r.consume();
    let linktype = header.network.0;
    let big_endian = header.is_bigendian();
    let mut number = 0;
    loop {
        let offset = r.offset;
        match r.fill(0, 16)? {
            0 => return Ok(()),
            16 => {}
            _ => return Err(r.truncated()),
        }
        let field = [r.buf[8], r.buf[9], r.buf[10], r.buf[11]];
        let caplen = if big_endian { u32::from_be_bytes(field) } else { u32::from_le_bytes(field) };
        let len = r.record_len(16, caplen, "captured length")?;
        if r.fill(16, len)? < len {
            return Err(r.truncated());
        }
        let parsed = if big_endian { parse_pcap_frame_be(&r.buf) } else { parse_pcap_frame(&r.buf) };
        let (_, block) = parsed.map_err(|e| describe(e, offset))?;
        number += 1;
        f(Frame { number, linktype, data: block.data });
        r.consume();
    }
}

/// The records of a capture being read: the current one in `buf`, `offset` the file's
/// byte offset where it starts.
struct Records<R> {
    input: R,
    offset: u64,
    buf: Vec<u8>,
}

impl<R: Read> Records<R> {
    /// Reads the record on from byte `from` until it holds `to` bytes or the input ends;
    /// returns how many it holds.
    fn fill(&mut self, from: usize, to: usize) -> Result<usize, CaptureError> {
        self.buf.truncate(from);
        let want = (to - from) as u64;
        let got = self.input.by_ref().take(want).read_to_end(&mut self.buf).map_err(|e| {
            CaptureError(format!("reading at byte offset {}: {e}", self.offset + from as u64))
        })?;
        Ok(from + got)
    }

    /// Past the record in `buf`.
    fn consume(&mut self) {
        self.offset += self.buf.len() as u64;
        self.buf.clear();
    }

    /// The bytes of a record of `header` bytes and the `claimed` length its `field`
    /// gives, if a record may be that long.
    fn record_len(&self, header: u64, claimed: u32, field: &str) -> Result<usize, CaptureError> {
        match usize::try_from(header + u64::from(claimed)) {
            Ok(n) if n <= MAX_RECORD => Ok(n),
            _ => Err(CaptureError(format!(
                "{field} {claimed} at byte offset {} is more than the {MAX_RECORD} bytes a record may have (a damaged capture?)",
                self.offset
            ))),
        }
    }

    fn truncated(&self) -> CaptureError {
        CaptureError(format!(
            "file ends in the middle of a record (truncated capture?) at byte offset {}",
            self.offset
        ))
    }
}

fn pcapng_frames<R: Read>(r: &mut Records<R>, f: &mut impl FnMut(Frame<'_>)) -> Result<(), CaptureError> {
    let mut big_endian = false;
    let mut linktypes: Vec<i32> = Vec::new();
    let mut number = 0;
    loop {
        let offset = r.offset;
        // The block type and length; a section header announces its own byte order after.
        let have = r.buf.len();
        match r.fill(have, 8)? {
            0 => return Ok(()),
            8 => {}
            _ => return Err(r.truncated()),
        }
        let is_shb = r.buf[..4] == [0x0A, 0x0D, 0x0D, 0x0A];
        if is_shb {
            if r.fill(8, 12)? < 12 {
                return Err(r.truncated());
            }
            big_endian = r.buf[8..12] == [0x1A, 0x2B, 0x3C, 0x4D];
        }
        let field = [r.buf[4], r.buf[5], r.buf[6], r.buf[7]];
        let total = if big_endian { u32::from_be_bytes(field) } else { u32::from_le_bytes(field) };
        let len = r.record_len(0, total, "block length")?;
        if len < r.buf.len() {
            return Err(CaptureError(format!("block of {total} bytes at byte offset {offset} is too short")));
        }
        let have = r.buf.len();
        if r.fill(have, len)? < len {
            return Err(r.truncated());
        }
        let parsed = if is_shb {
            pcap_parser::parse_sectionheaderblock(&r.buf).map(|(r, b)| (r, Block::SectionHeader(b)))
        } else if big_endian {
            parse_block_be(&r.buf)
        } else {
            parse_block_le(&r.buf)
        };
        let (_, block) = parsed.map_err(|e| describe(e, offset))?;
        match block {
            Block::SectionHeader(shb) => {
                big_endian = shb.big_endian();
                linktypes.clear();
            }
            Block::InterfaceDescription(idb) => linktypes.push(idb.linktype.0),
            Block::EnhancedPacket(epb) => {
                let linktype = *linktypes.get(epb.if_id as usize).ok_or_else(|| {
                    CaptureError(format!(
                        "packet for undeclared interface {} at byte offset {offset}",
                        epb.if_id
                    ))
                })?;
                let len = (epb.caplen as usize).min(epb.data.len());
                number += 1;
                f(Frame { number, linktype, data: &epb.data[..len] });
            }
            Block::SimplePacket(spb) => {
                let linktype = *linktypes.first().ok_or_else(|| {
                    CaptureError(format!("packet before any interface at byte offset {offset}"))
                })?;
                let len = (spb.origlen as usize).min(spb.data.len());
                number += 1;
                f(Frame { number, linktype, data: &spb.data[..len] });
            }
            _ => {}
        }
        r.consume();
    }
}

/// The network layer of a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum L3<'a> {
    /// An IPv4 or IPv6 packet (the version nibble tells which).
    Ip(&'a [u8]),
    /// Anything else (ARP, LLDP, an unknown link type), with a short description.
    Other(String),
}

const ETH_IPV4: u16 = 0x0800;
const ETH_IPV6: u16 = 0x86DD;

fn by_ethertype(ethertype: u16, payload: &[u8]) -> L3<'_> {
    match ethertype {
        ETH_IPV4 | ETH_IPV6 => L3::Ip(payload),
        0x0806 => L3::Other("ARP".into()),
        t => L3::Other(format!("ethertype {t:#06x}")),
    }
}

fn truncated(what: &str) -> L3<'static> {
    L3::Other(format!("truncated {what} header"))
}

/// Strips the link layer of `frame`.
pub fn network_layer<'a>(frame: &Frame<'a>) -> L3<'a> {
    let d = frame.data;
    let be16 = |at: usize| u16::from_be_bytes([d[at], d[at + 1]]);
    match frame.linktype {
        1 => {
            if d.len() < 14 {
                return truncated("Ethernet");
            }
            let mut at = 12;
            let mut ethertype = be16(at);
            while matches!(ethertype, 0x8100 | 0x88A8 | 0x9100) {
                at += 4;
                if d.len() < at + 2 {
                    return truncated("VLAN");
                }
                ethertype = be16(at);
            }
            by_ethertype(ethertype, &d[at + 2..])
        }
        113 => {
            if d.len() < 16 {
                return truncated("Linux cooked");
            }
            by_ethertype(be16(14), &d[16..])
        }
        276 => {
            if d.len() < 20 {
                return truncated("Linux cooked v2");
            }
            by_ethertype(be16(0), &d[20..])
        }
        101 | 12 | 14 | 228 | 229 => L3::Ip(d),
        0 | 108 => {
            if d.len() < 4 {
                return truncated("loopback");
            }
            // The address family, in the capturing host's byte order (0) or big-endian (108).
            let le = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
            let be = u32::from_be_bytes([d[0], d[1], d[2], d[3]]);
            if [le, be].iter().any(|af| matches!(af, 2 | 10 | 24 | 28 | 30)) {
                L3::Ip(&d[4..])
            } else {
                L3::Other("loopback, not IP".into())
            }
        }
        t => L3::Other(format!("unsupported link type {t}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(linktype: i32, data: &[u8]) -> Frame<'_> {
        Frame { number: 1, linktype, data }
    }

    #[test]
    fn link_layers() {
        let ip = [0x45u8, 0, 0, 20];
        let mut eth = vec![0u8; 12];
        eth.extend_from_slice(&[0x81, 0x00, 0, 5, 0x08, 0x00]);
        eth.extend_from_slice(&ip);
        assert_eq!(network_layer(&frame(1, &eth)), L3::Ip(&ip));
        let mut sll = vec![0u8; 14];
        sll.extend_from_slice(&[0x86, 0xDD]);
        sll.extend_from_slice(&ip);
        assert_eq!(network_layer(&frame(113, &sll)), L3::Ip(&ip));
        let mut sll2 = vec![0x08, 0x00];
        sll2.extend_from_slice(&[0u8; 18]);
        sll2.extend_from_slice(&ip);
        assert_eq!(network_layer(&frame(276, &sll2)), L3::Ip(&ip));
        assert_eq!(network_layer(&frame(101, &ip)), L3::Ip(&ip));
        let mut arp = vec![0u8; 12];
        arp.extend_from_slice(&[0x08, 0x06, 1, 2]);
        assert_eq!(network_layer(&frame(1, &arp)), L3::Other("ARP".into()));
        for cut in 0..14 {
            assert!(matches!(network_layer(&frame(1, &eth[..cut])), L3::Other(_)));
        }
    }

    #[test]
    fn broken_files_are_errors() {
        assert!(for_each_frame(b"", |_| {}).is_err());
        assert!(for_each_frame(b"hello world, not a capture", |_| {}).is_err());
        let good =
            std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/rxe/rping.pcap")).unwrap();
        let mut n = 0;
        for_each_frame(&good, |_| n += 1).unwrap();
        assert!(n > 0);
        let mut m = 0;
        let err = for_each_frame(&good[..good.len() - 3], |_| m += 1).unwrap_err();
        assert!(err.0.contains("truncated"), "{err}");
        assert_eq!(m, n - 1, "frames before the damage are still delivered");
    }
}
