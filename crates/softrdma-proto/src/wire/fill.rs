//! Packets of one size: softrdma's own framing for the packets of a multi-packet message,
//! used only between softrdma peers (never towards a foreign one).
//!
//! A runtime hands the kernel a run of equal-sized packets as one GSO train (one datagram
//! to the socket layer, cut into segments below it), but a train's segments must all be
//! the size of its first, only the last may be shorter. The packets of a plain SEND stream
//! are (a full PMTU of payload and a BTH each), so its trains run across messages. An RDMA
//! WRITE's first packet carries a RETH, 16 bytes that its MIDDLE and LAST packets lack, a
//! READ response's FIRST and LAST carry an AETH that its MIDDLE packets lack, and a SEND
//! with immediate data ends with 4 bytes its other packets lack: every such message breaks
//! its train, and each break costs the kernel a datagram of its own on both sides (about
//! 2 µs on this project's machines: a 16 KiB `write_bw` moved half the bytes of a 16 KiB
//! `send_bw`). So towards a softrdma peer a full packet that lacks its message's longest
//! header is sent with that many zero bytes of filler, which makes it as long as the
//! message's longest packet:
//!
//! ```text
//! | BTH (byte 8: 0x08 set), headers, payload, pad | filler: zero bytes | ICRC |
//! ```
//!
//! The number of filler bytes follows from the opcode ([`len`]): 16 on a WRITE MIDDLE or
//! LAST (the RETH), 12 on a WRITE LAST with immediate (which carries 4 of its own), 4 on
//! a READ response MIDDLE (the AETH), 4 on the FIRST and MIDDLE packets of a SEND whose
//! LAST carries immediate data or an invalidate key. The ICRC covers the filler and the flag, a reserved
//! bit after AckReq (see [`crate::wire::bundle`] for the two before it). A receiver that
//! finds the flag on a packet whose exact ICRC check passed takes the filler off before
//! it reads the packet ([`strip`]); filler that is not zero, or a packet too short to hold
//! it, make the datagram malformed; on an opcode that takes no filler the flag stays a
//! reserved bit, ignored. A QP fills only towards a
//! peer whose packets carried [`TAKES_FILL`], the next reserved bit, which every softrdma
//! QP sets on what it sends to a softrdma peer (requests and answers alike: a WRITE stream's
//! receiver sends nothing but ACKs). A build older than this framing sets neither, and
//! gets no filler. A short last packet takes none: it ends its train anyway.

pub use super::bundle::FLAG_BYTE;
use super::{Opcode, Operation};

/// The flag in BTH byte 8 that says filler precedes the ICRC.
pub const FILLED: u8 = 0x08;
/// The flag in the same byte that says the sending QP takes filler off: set on every
/// packet of an RC or UC QP towards a softrdma peer.
pub const TAKES_FILL: u8 = 0x10;

/// The filler a full packet with opcode `op` takes to match its message's longest packet;
/// 0 for an opcode whose packets never take any. A SEND's FIRST and MIDDLE take it only in
/// a message whose LAST carries immediate data or an invalidate key: the sender knows, and
/// flags them; the receiver reads the flag.
pub fn len(op: Opcode) -> usize {
    match op.operation() {
        Operation::RdmaWriteLastWithImmediate => 12,
        Operation::RdmaWriteMiddle | Operation::RdmaWriteLast => 16,
        Operation::RdmaReadResponseMiddle => 4,
        // Only in a message whose LAST carries immediate data or an invalidate key.
        Operation::SendFirst | Operation::SendMiddle => 4,
        _ => 0,
    }
}

/// The filler a sender puts in a full packet with opcode `op` (see [`len`]):
/// `longer_last`, the packet's message ends with immediate data or an invalidate key,
/// which a plain SEND's FIRST and MIDDLE do not make up for.
pub fn to_send(op: Opcode, longer_last: bool) -> usize {
    match op.operation() {
        Operation::SendFirst | Operation::SendMiddle if !longer_last => 0,
        _ => len(op),
    }
}

/// The packet in `datagram` (one packet, not a bundle) without its filler, if it is flagged
/// for some; `Err` for a flagged packet that cannot carry it (too short to hold a BTH, the
/// filler and an ICRC, or filler that is not zero). On an opcode that takes no filler the
/// flag is a reserved bit, ignored. The ICRC at the end of what is returned is
/// meaningless: call this after the ICRC check, on the packet as it came.
pub fn strip(datagram: &[u8]) -> Result<&[u8], Malformed> {
    if datagram.get(FLAG_BYTE).is_none_or(|b| b & FILLED == 0) {
        return Ok(datagram);
    }
    let n = Opcode::new(datagram[0]).map_or(0, len);
    if n == 0 {
        return Ok(datagram);
    }
    let end = datagram.len();
    if end < 12 + n + super::ICRC_LEN {
        return Err(Malformed);
    }
    let filler = &datagram[end - super::ICRC_LEN - n..end - super::ICRC_LEN];
    if filler.iter().any(|&b| b != 0) {
        return Err(Malformed);
    }
    // Dropping the last n bytes leaves the payload and pad where they were, with the first
    // four bytes of filler where a reader expects the ICRC.
    Ok(&datagram[..end - n])
}

/// A packet flagged for filler that cannot carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Transport;

    fn code(t: Transport, op: Operation) -> Opcode {
        Opcode::from_parts(t, op).expect("in the table")
    }

    #[test]
    fn filler_makes_up_the_first_packets_extra_header_and_nothing_else() {
        use Operation::*;
        for t in [Transport::Rc, Transport::Uc] {
            assert_eq!(len(code(t, RdmaWriteMiddle)), 16);
            assert_eq!(len(code(t, RdmaWriteLast)), 16);
            assert_eq!(len(code(t, RdmaWriteLastWithImmediate)), 12);
            for op in [RdmaWriteFirst, RdmaWriteOnly, SendLast, SendLastWithImmediate, SendOnly] {
                assert_eq!(len(code(t, op)), 0, "{op:?}");
            }
            assert_eq!(len(code(t, SendFirst)), 4);
            assert_eq!(len(code(t, SendMiddle)), 4);
        }
        assert_eq!(len(code(Transport::Rc, RdmaReadResponseMiddle)), 4);
        for op in [RdmaReadResponseFirst, RdmaReadResponseLast, RdmaReadResponseOnly, Acknowledge] {
            assert_eq!(len(code(Transport::Rc, op)), 0, "{op:?}");
        }
    }

    /// A WRITE MIDDLE of `payload` bytes with 16 bytes of filler and an ICRC.
    fn middle(payload: usize, flags: u8, filler: u8) -> Vec<u8> {
        let mut p = vec![0u8; 12 + payload + 16 + 4];
        p[0] = code(Transport::Rc, Operation::RdmaWriteMiddle).code();
        p[FLAG_BYTE] = flags;
        for b in &mut p[12..12 + payload] {
            *b = 0xAB;
        }
        let end = p.len();
        p[end - 20..end - 4].fill(filler);
        p[end - 4..].copy_from_slice(&[1, 2, 3, 4]);
        p
    }

    #[test]
    fn a_flagged_packet_loses_its_filler_and_an_unflagged_one_keeps_every_byte() {
        let p = middle(256, FILLED | 0x80, 0);
        let s = strip(&p).expect("well formed");
        assert_eq!(s.len(), 12 + 256 + 4);
        assert!(s[12..12 + 256].iter().all(|&b| b == 0xAB), "the payload stays where it was");
        let plain = middle(256, TAKES_FILL, 0);
        assert_eq!(strip(&plain), Ok(&plain[..]));
        assert_eq!(strip(&[]), Ok(&[][..]));
    }

    #[test]
    fn filler_that_cannot_be_is_malformed() {
        // Not zero.
        assert_eq!(strip(&middle(256, FILLED, 7)), Err(Malformed));
        // Too short for a BTH, the filler and an ICRC.
        let p = middle(0, FILLED, 0);
        assert_eq!(strip(&p[..31]), Err(Malformed));
        assert_eq!(strip(&p).map(<[u8]>::len), Ok(16));
        // On an opcode that takes none, the flag is a reserved bit: the packet stays whole.
        let mut p = middle(256, FILLED, 0);
        p[0] = code(Transport::Rc, Operation::SendLast).code();
        assert_eq!(strip(&p), Ok(&p[..]));
    }
}
