//! A request and the ACK that rode with it in one datagram: softrdma's own framing, used
//! only between softrdma peers (never towards a foreign one).
//!
//! In a ping-pong each side's answer follows the request it acknowledges, so an RC QP
//! that owes its peer a positive ACK when it sends a request would send two packets: the
//! request, and the 20-byte ACK (BTH and AETH, no payload) right behind it. Sent as a GSO
//! train of two segments they already made one system call on each side, but the kernel's
//! segmentation path cost about 0.4 µs per message on loopback (a raw UDP ping-pong of
//! 56-byte datagrams: 2.30–2.35 µs one way; the same bytes as a 36-byte segment followed
//! by a 20-byte one: 2.72–2.79). So towards a softrdma peer the ACK is appended to the
//! request instead, and the pair travels as one plain datagram:
//!
//! ```text
//! | request: BTH (byte 8: 0x40 set), headers, payload, pad, ICRC | ACK: BTH, AETH, ICRC |
//! ```
//!
//! Each packet is exactly what it would be alone, its ICRC computed for a datagram of its
//! own length; the request's BTH carries [`BUNDLED_ACK`], the first of the seven bits
//! after AckReq that the IBTA reserves (senders zero them, receivers ignore them, and the
//! ICRC covers them, so a flipped flag fails the check). A QP bundles only towards a peer
//! whose requests carry [`SPLITS_BUNDLES`], the next reserved bit, which says that peer
//! splits bundles (every softrdma QP sets it on its requests to a softrdma peer; a build
//! older than bundles does not, and gets none). A receiver that sees the flag on
//! a datagram with an RC ACKNOWLEDGE opcode 20 bytes from the end, and whose first part
//! passes the exact ICRC check on its own, handles the two parts in order as two
//! datagrams (anything else that looks like one, a foreign sender's reserved bit set say,
//! is taken whole). A bundle's UDP payload is at most [`max_over_pmtu`] bytes over the
//! path MTU, which keeps the datagram within the link's MTU: the sender appends the ACK
//! only to a request that leaves room for it, and otherwise sends the two as before.

use super::{Opcode, Operation, Transport};
pub use crate::qp::PMTU_HEADROOM;

/// The flag in BTH byte 8 (AckReq and seven reserved bits) that says an ACK follows the
/// packet in the same datagram.
pub const BUNDLED_ACK: u8 = 0x40;
/// The flag in the same byte that says the sending QP splits bundles: set on every
/// request towards a softrdma peer, so that a QP bundles ACKs only towards a peer whose
/// requests carried it (a softrdma build older than bundles sets no reserved bit, and
/// would take a bundle whole and drop it on its ICRC). The second reserved bit after
/// AckReq; never sent to a foreign peer.
pub const SPLITS_BUNDLES: u8 = 0x20;
/// The offset of the byte that carries them.
pub const FLAG_BYTE: usize = 8;
/// The length of the ACK that rides along: BTH, AETH and ICRC.
pub const BUNDLED_ACK_LEN: usize = 12 + 4 + super::ICRC_LEN;

/// How far a bundle's UDP payload may exceed the path MTU, so that its datagram stays
/// within [`PMTU_HEADROOM`] of it: 68 bytes over IPv4 (20 bytes of IP header and 8 of
/// UDP), 48 over IPv6 (40 and 8). Every request packet is at most the path MTU plus 36
/// (BTH, RETH, immediate data, ICRC), so over IPv4 any last packet of a message takes its
/// ACK; over IPv6 a full SEND (plus 16) does, a full WRITE ONLY (plus 32) does not.
pub const fn max_over_pmtu(ipv6: bool) -> usize {
    PMTU_HEADROOM - if ipv6 { 48 } else { 28 }
}
/// The RC ACKNOWLEDGE opcode, which the last 20 bytes must start with.
const RC_ACKNOWLEDGE: u8 = match Opcode::from_parts(Transport::Rc, Operation::Acknowledge) {
    Some(o) => o.code(),
    None => panic!("RC ACKNOWLEDGE is in the opcode table"),
};
/// The shortest packet that can carry the flag: a BTH and an ICRC.
const MIN_FIRST: usize = 16;

/// Splits a datagram that carries a request and its bundled ACK into the two packets;
/// `None` for any other datagram (the flag clear, too short, or no ACK at the end). Says
/// nothing of validity: each part still needs its own checks.
pub fn split(datagram: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = datagram.len();
    if len < MIN_FIRST + BUNDLED_ACK_LEN || datagram[FLAG_BYTE] & BUNDLED_ACK == 0 {
        return None;
    }
    let (first, ack) = datagram.split_at(len - BUNDLED_ACK_LEN);
    (ack[0] == RC_ACKNOWLEDGE).then_some((first, ack))
}

/// [`split`], for changing the two packets in place (a relay that moves their ICRCs to
/// other addresses).
pub fn split_mut(datagram: &mut [u8]) -> Option<(&mut [u8], &mut [u8])> {
    let at = datagram.len() - split(datagram)?.1.len();
    Some(datagram.split_at_mut(at))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(len: usize, opcode: u8, byte8: u8) -> Vec<u8> {
        let mut p = vec![0u8; len];
        p[0] = opcode;
        p[FLAG_BYTE] = byte8;
        p
    }

    #[test]
    fn a_flagged_request_with_an_ack_at_its_end_splits_there() {
        let mut d = packet(24, 0x04, BUNDLED_ACK);
        d.extend(packet(20, RC_ACKNOWLEDGE, 0));
        let (first, ack) = split(&d).expect("a bundle");
        assert_eq!((first.len(), ack.len(), first[0], ack[0]), (24, 20, 0x04, RC_ACKNOWLEDGE));
    }

    #[test]
    fn anything_else_stays_whole() {
        // No flag (AckReq alone is not it).
        let mut d = packet(24, 0x04, 0x80);
        d.extend(packet(20, RC_ACKNOWLEDGE, 0));
        assert_eq!(split(&d), None);
        // The flag, but no ACK opcode where the ACK would start.
        let mut d = packet(24, 0x04, BUNDLED_ACK);
        d.extend(packet(20, 0x04, 0));
        assert_eq!(split(&d), None);
        // Too short to hold a packet and an ACK.
        let mut d = packet(15, 0x04, BUNDLED_ACK);
        d.extend(packet(20, RC_ACKNOWLEDGE, 0));
        assert_eq!(split(&d), None);
        assert_eq!(split(&[]), None);
    }

    #[test]
    fn the_shortest_bundle_splits_and_split_mut_splits_alike() {
        // A zero-length SEND (BTH and ICRC, 16 bytes) and its ACK: 36 bytes.
        let mut d = packet(16, 0x04, BUNDLED_ACK);
        d.extend(packet(20, RC_ACKNOWLEDGE, 0));
        assert_eq!(split(&d).map(|(a, b)| (a.len(), b.len())), Some((16, 20)));
        let (first, ack) = split_mut(&mut d).expect("a bundle");
        assert_eq!((first.len(), ack.len(), first[0], ack[0]), (16, 20, 0x04, RC_ACKNOWLEDGE));
        ack[1] = 0xEE;
        assert_eq!(d[17], 0xEE, "the halves are the datagram's own bytes");
        let mut plain = packet(40, 0x04, 0);
        assert_eq!(split_mut(&mut plain), None);
    }

    #[test]
    fn a_bundle_fits_the_link_of_the_path_mtu_a_device_picks() {
        use crate::qp::Mtu;
        // The tightest link for each path MTU, and some common ones: a bundle's datagram
        // (IPv6's 48 bytes of IP and UDP headers, the worst case) fits each.
        for m in [Mtu::Mtu256, Mtu::Mtu512, Mtu::Mtu1024, Mtu::Mtu2048, Mtu::Mtu4096] {
            let tightest = m.bytes() + PMTU_HEADROOM as u32;
            assert_eq!(Mtu::for_link(tightest), Some(m));
            for (ipv6, ip_udp) in [(false, 28), (true, 48)] {
                assert!(m.bytes() as usize + max_over_pmtu(ipv6) + ip_udp <= tightest as usize);
            }
        }
        for link in [1280u32, 1500, 4200, 9000, 65536] {
            let m = Mtu::for_link(link).expect("a path MTU");
            assert!(m.bytes() as usize + max_over_pmtu(true) + 48 <= link as usize, "{link}");
            assert!(m.bytes() as usize + max_over_pmtu(false) + 28 <= link as usize, "{link}");
        }
        // The longest request packet (BTH, RETH, immediate data, a full payload, ICRC) and
        // its ACK fit over IPv4, not over IPv6.
        assert!(36 + BUNDLED_ACK_LEN <= max_over_pmtu(false));
        assert!(36 + BUNDLED_ACK_LEN > max_over_pmtu(true));
    }
}
