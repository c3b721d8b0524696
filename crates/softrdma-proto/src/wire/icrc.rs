//! The RoCEv2 invariant CRC (`roce-wire.md` §5).
//!
//! The ICRC is CRC-32 (zlib's) over eight 0xFF bytes, the IP header, the UDP header and the
//! whole UDP payload up to the ICRC, with the fields routers may change forced to ones:
//! IPv4 TOS, TTL and header checksum; IPv6 traffic class, flow label and hop limit; the
//! UDP checksum; BTH byte 4 (FECN, BECN). It is written least-significant byte first.
//!
//! # The IPv4 Identification problem
//!
//! The ICRC covers the IPv4 *Identification* field and the DF flag, and a process reading a
//! UDP socket never sees either. This module offers two checks:
//!
//! - [`verify`], **exact**: the caller knows the whole IP header. That is the case for a
//!   capture file, and for traffic between softrdma endpoints, because softrdma sends from
//!   an unconnected socket with `IP_PMTUDISC_DO`, for which Linux puts DF and
//!   Identification 0 on every datagram (measured on Linux 6.18 with a capture: every
//!   datagram ID 0 and DF, on loopback and veth). Kernel UDP GSO numbers the segments of
//!   one send 0, 1, 2, …; a softrdma sender therefore computes the ICRC of every packet it
//!   sends to a softrdma peer as if the ID were 0 (the *canonical* form), whatever GSO does,
//!   so that the receiver can check all 32 bits. For a peer that checks against the real
//!   header (Linux rxe, RoCE NICs), segment `i` of a GSO send is computed with ID `i`.
//! - [`solve_ipv4_ident`], **ID-agnostic**, for foreign senders, whose IDs come from their
//!   kernel's generator: it finds the Identification and DF values, if any, that make the
//!   CRC match. CRC-32 is linear over GF(2), so the CRC of the packet is an affine function
//!   of those 17 bits; the solver computes the CRC once with the bits zero and then checks,
//!   with a little polynomial arithmetic, whether the difference lies in the 17-dimensional
//!   space the bits can reach. A random corruption passes with probability 2^17 / 2^32 =
//!   **2^-15** (about 3 in 100,000) instead of 2^-32: the check keeps 15 of its 32 bits.
//!   CRC-32 detects every burst of 32 bits or fewer, so the 17 bits map to distinct CRC
//!   differences and the solution, when there is one, is unique.
//!
//! IPv4 options are not supported (rxe sends none and assumes a 20-byte header).

use core::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};

/// Length of the invariant CRC that ends every packet.
pub const ICRC_LEN: usize = 4;

/// The IP and UDP fields that an ICRC covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Encap {
    /// Network layer addresses and, for IPv4, the fields a socket does not show.
    pub ip: IpFields,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port.
    pub dst_port: u16,
}

/// The covered fields of the IP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpFields {
    /// IPv4 with a 20-byte header.
    V4 {
        /// Source address.
        src: Ipv4Addr,
        /// Destination address.
        dst: Ipv4Addr,
        /// The Identification field.
        ident: u16,
        /// The Don't Fragment flag.
        dont_fragment: bool,
    },
    /// IPv6 without extension headers.
    V6 {
        /// Source address.
        src: Ipv6Addr,
        /// Destination address.
        dst: Ipv6Addr,
    },
}

impl Encap {
    /// The encapsulation of a datagram from `src` to `dst` as softrdma sends it: for IPv4,
    /// DF set and Identification 0 (the canonical form). `None` if the address families
    /// differ.
    pub fn new(src: SocketAddr, dst: SocketAddr) -> Option<Encap> {
        let ip = match (src, dst) {
            (SocketAddr::V4(s), SocketAddr::V4(d)) => {
                IpFields::V4 { src: *s.ip(), dst: *d.ip(), ident: 0, dont_fragment: true }
            }
            (SocketAddr::V6(s), SocketAddr::V6(d)) => IpFields::V6 { src: *s.ip(), dst: *d.ip() },
            _ => return None,
        };
        Some(Encap { ip, src_port: src.port(), dst_port: dst.port() })
    }

    /// The same encapsulation with another IPv4 Identification and DF (no effect on IPv6).
    #[must_use]
    pub fn with_ipv4_ident(mut self, new_ident: u16, df: bool) -> Encap {
        if let IpFields::V4 { ident, dont_fragment, .. } = &mut self.ip {
            *ident = new_ident;
            *dont_fragment = df;
        }
        self
    }
}

/// An incremental ICRC computation, for packets whose payload is gathered from several
/// buffers.
#[derive(Debug, Clone)]
pub struct IcrcHasher {
    crc: crc32fast::Hasher,
}

impl IcrcHasher {
    /// Starts an ICRC over the pseudo-LRH and the masked IP and UDP headers of a datagram
    /// whose UDP payload (ICRC included) is `udp_payload_len` bytes long.
    pub fn new(encap: &Encap, udp_payload_len: usize) -> IcrcHasher {
        IcrcHasher { crc: crc32fast::Hasher::new_with_initial(pseudo_crc(encap, udp_payload_len)) }
    }

    /// [`Self::new`] followed by [`Self::update_bth`].
    pub fn with_bth(encap: &Encap, udp_payload_len: usize, bth: &[u8; 12]) -> IcrcHasher {
        let mut h = IcrcHasher::new(encap, udp_payload_len);
        h.update_bth(bth);
        h
    }

    /// Adds the BTH, with byte 4 (FECN, BECN, reserved) masked.
    pub fn update_bth(&mut self, bth: &[u8; 12]) {
        let mut m = *bth;
        m[4] = 0xFF;
        self.crc.update(&m);
    }

    /// Adds bytes after the BTH: extension headers, payload, pad.
    pub fn update(&mut self, bytes: &[u8]) {
        self.crc.update(bytes);
    }

    /// The ICRC value; it goes on the wire as `to_le_bytes()`.
    pub fn finish(self) -> u32 {
        self.crc.finalize()
    }
}

/// The pseudo-LRH, the masked IP header and the masked UDP header, at most this long.
const PRE_MAX: usize = 8 + 40 + 8;
/// Their length for IPv4 and for IPv6.
const PRE_V4: usize = 8 + 20 + 8;
const PRE_V6: usize = PRE_MAX;
/// Where the fields that change from packet to packet of one flow start in them (each
/// two bytes): IPv4's total length, Identification and UDP length; IPv6's payload length
/// and UDP length.
const V4_IP_LEN: usize = 8 + 2;
const V4_IDENT: usize = 8 + 4;
const V4_UDP_LEN: usize = 8 + 20 + 4;
const V6_IP_LEN: usize = 8 + 4;
const V6_UDP_LEN: usize = 8 + 40 + 4;

/// The CRC of the pseudo-headers of a datagram of `encap` whose UDP payload is
/// `udp_payload_len` bytes long, as a CRC to resume from.
///
/// Only the two length fields (and, in a GSO train to a foreign peer, the IPv4
/// Identification) change from packet to packet of one flow, and the CRC of messages of
/// one length is affine in their bits: `crc(a ^ b) = crc(a) ^ raw(b)`, `raw` being the
/// CRC register without its initial and final inversions. So the CRC of the
/// pseudo-headers is that of the flow's pseudo-headers with those fields zero (kept in a
/// small per-thread cache) XOR the raw CRC each of their bytes adds at its place (a table
/// per byte position, built at compile time): a few lookups instead of 36 or 56 bytes of
/// CRC for every packet sent and received.
fn pseudo_crc(encap: &Encap, udp_payload_len: usize) -> u32 {
    let udp_len = (8 + udp_payload_len) as u16;
    let (ip_len, t, ident) = match encap.ip {
        IpFields::V4 { ident, dont_fragment, .. } => {
            // The Identification too: a GSO train to a foreign peer numbers its segments.
            let [hi, lo] = ident.to_be_bytes();
            let key = encap.with_ipv4_ident(0, dont_fragment);
            let ident = IDENT_V4[0][usize::from(hi)] ^ IDENT_V4[1][usize::from(lo)];
            (udp_len.wrapping_add(20), &LEN_V4, zero_length_crc(&key) ^ ident)
        }
        IpFields::V6 { .. } => (udp_len, &LEN_V6, zero_length_crc(encap)),
    };
    let [ip_hi, ip_lo] = ip_len.to_be_bytes();
    let [udp_hi, udp_lo] = udp_len.to_be_bytes();
    ident
        ^ t[0][usize::from(ip_hi)]
        ^ t[1][usize::from(ip_lo)]
        ^ t[2][usize::from(udp_hi)]
        ^ t[3][usize::from(udp_lo)]
}

/// The CRC of `encap`'s pseudo-headers with both length fields zero (and, for IPv4, the
/// Identification its caller zeroed), from a per-thread cache of the last few
/// encapsulations (a busy thread sends to and receives from a few peers at a time).
fn zero_length_crc(encap: &Encap) -> u32 {
    const WAYS: usize = 4;
    /// The flows and their CRCs, and the way to replace next.
    type Ways = ([Option<(Encap, u32)>; WAYS], usize);
    std::thread_local! {
        static CACHE: core::cell::RefCell<Ways> = const { core::cell::RefCell::new(([None; WAYS], 0)) };
    }
    let compute = || {
        let mut pre = [0xFFu8; PRE_MAX];
        let end = pseudo_headers(encap, 0, &mut pre);
        // pseudo_headers wrote lengths for an empty payload; zero them.
        let (ip, udp) = match encap.ip {
            IpFields::V4 { .. } => (V4_IP_LEN, V4_UDP_LEN),
            IpFields::V6 { .. } => (V6_IP_LEN, V6_UDP_LEN),
        };
        pre[ip..ip + 2].fill(0);
        pre[udp..udp + 2].fill(0);
        crc32fast::hash(&pre[..end])
    };
    CACHE
        .try_with(|c| {
            let Ok(mut c) = c.try_borrow_mut() else { return compute() };
            let (ways, next) = &mut *c;
            if let Some((_, crc)) = ways.iter().flatten().find(|(e, _)| e == encap) {
                return *crc;
            }
            let crc = compute();
            ways[*next] = Some((*encap, crc));
            *next = (*next + 1) % WAYS;
            crc
        })
        .unwrap_or_else(|_| compute())
}

/// `LEN_V4[i][v]`: the raw CRC that byte value `v` adds at the `i`-th length byte of
/// IPv4's pseudo-headers (IP total length high and low, UDP length high and low).
static LEN_V4: [[u32; 256]; 4] = len_tables(PRE_V4, [V4_IP_LEN, V4_IP_LEN + 1, V4_UDP_LEN, V4_UDP_LEN + 1]);
/// The same for IPv6's (payload length, UDP length).
static LEN_V6: [[u32; 256]; 4] = len_tables(PRE_V6, [V6_IP_LEN, V6_IP_LEN + 1, V6_UDP_LEN, V6_UDP_LEN + 1]);
/// The same for the IPv4 Identification, high and low byte.
static IDENT_V4: [[u32; 256]; 2] = len_tables(PRE_V4, [V4_IDENT, V4_IDENT + 1]);

/// For each byte position `at` in a message `n` bytes long, the raw CRC of every byte
/// value there with zeros everywhere else (linear in the value: built from its bits).
const fn len_tables<const K: usize>(n: usize, at: [usize; K]) -> [[u32; 256]; K] {
    let mut t = [[0u32; 256]; K];
    let mut i = 0;
    while i < K {
        let mut bit = [0u32; 8];
        let mut b = 0;
        while b < 8 {
            bit[b] = gf::raw_crc_byte_then_zeros(1 << b, n - at[i] - 1);
            b += 1;
        }
        let mut v: usize = 1;
        while v < 256 {
            let low = v.trailing_zeros() as usize;
            t[i][v] = t[i][v & (v - 1)] ^ bit[low];
            v += 1;
        }
        i += 1;
    }
    t
}

/// Writes the pseudo-LRH and the masked IP and UDP headers into `pre` (filled with 0xFF)
/// and returns their length (a flow's first packet, and the tests, compute their CRC).
fn pseudo_headers(encap: &Encap, udp_payload_len: usize, pre: &mut [u8; PRE_MAX]) -> usize {
    let udp_len = (8 + udp_payload_len) as u16;
    let ip_len = match encap.ip {
        IpFields::V4 { src, dst, ident, dont_fragment } => {
            let total = udp_len.wrapping_add(20).to_be_bytes();
            let id = ident.to_be_bytes();
            let flags = if dont_fragment { 0x40 } else { 0 };
            let h = &mut pre[8..28];
            h[..12].copy_from_slice(&[
                0x45, 0xFF, total[0], total[1], id[0], id[1], flags, 0, 0xFF, 17, 0xFF, 0xFF,
            ]);
            h[12..16].copy_from_slice(&src.octets());
            h[16..20].copy_from_slice(&dst.octets());
            20
        }
        IpFields::V6 { src, dst } => {
            let plen = udp_len.to_be_bytes();
            let h = &mut pre[8..48];
            h[..8].copy_from_slice(&[0x6F, 0xFF, 0xFF, 0xFF, plen[0], plen[1], 17, 0xFF]);
            h[8..24].copy_from_slice(&src.octets());
            h[24..40].copy_from_slice(&dst.octets());
            40
        }
    };
    let (s, d, l) = (encap.src_port.to_be_bytes(), encap.dst_port.to_be_bytes(), udp_len.to_be_bytes());
    let end = 8 + ip_len + 8;
    pre[8 + ip_len..end].copy_from_slice(&[s[0], s[1], d[0], d[1], l[0], l[1], 0xFF, 0xFF]);
    end
}

/// The ICRC of a packet: `without_icrc` is the UDP payload up to (not including) the ICRC
/// and must hold at least a BTH; a shorter slice yields a CRC that matches nothing.
pub fn compute(encap: &Encap, without_icrc: &[u8]) -> u32 {
    let len = without_icrc.len() + ICRC_LEN;
    match without_icrc.split_first_chunk::<12>() {
        Some((bth, rest)) => {
            let mut h = IcrcHasher::with_bth(encap, len, bth);
            h.update(rest);
            h.finish()
        }
        None => {
            let mut h = IcrcHasher::new(encap, len);
            h.update(without_icrc);
            h.finish()
        }
    }
}

fn split_icrc(udp_payload: &[u8]) -> Option<(&[u8], u32)> {
    let (body, t) = udp_payload.split_last_chunk::<4>()?;
    (body.len() >= 12).then(|| (body, u32::from_le_bytes(*t)))
}

/// Exact check of the ICRC at the end of `udp_payload`, all of whose IP fields are known.
pub fn verify(encap: &Encap, udp_payload: &[u8]) -> bool {
    split_icrc(udp_payload).is_some_and(|(body, icrc)| compute(encap, body) == icrc)
}

/// Moves the ICRC at the end of `udp_payload` from the encapsulation `old` to `new` (a
/// relay that changes the addresses and ports). The CRC is linear, so the change is the
/// same whatever the body holds: a packet damaged before the relay stays damaged after it,
/// and a sound one becomes sound for `new`. Returns false if the payload is too short.
pub fn repatch(old: &Encap, new: &Encap, udp_payload: &mut [u8]) -> bool {
    let Some((body, _)) = split_icrc(udp_payload) else { return false };
    let delta = compute(old, body) ^ compute(new, body);
    let n = udp_payload.len();
    let icrc =
        u32::from_le_bytes([udp_payload[n - 4], udp_payload[n - 3], udp_payload[n - 2], udp_payload[n - 1]]);
    udp_payload[n - 4..].copy_from_slice(&(icrc ^ delta).to_le_bytes());
    true
}

/// The IPv4 fields a receiver could not see, recovered by [`solve_ipv4_ident`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Ident {
    /// Identification.
    pub ident: u16,
    /// Don't Fragment.
    pub dont_fragment: bool,
}

/// ID-agnostic check for an IPv4 datagram from `src` to `dst`: the Identification and DF
/// values that make the ICRC at the end of `udp_payload` match, or `None` if none do.
/// Accepts a corrupt packet with probability 2^-15 (see the module docs).
pub fn solve_ipv4_ident(src: SocketAddrV4, dst: SocketAddrV4, udp_payload: &[u8]) -> Option<Ipv4Ident> {
    let (body, icrc) = split_icrc(udp_payload)?;
    let encap = Encap {
        ip: IpFields::V4 { src: *src.ip(), dst: *dst.ip(), ident: 0, dont_fragment: false },
        src_port: src.port(),
        dst_port: dst.port(),
    };
    // Init and final XOR cancel in the difference of two CRCs of equal length, leaving the
    // raw CRC of the difference: the unknown bits, followed by `after` bytes.
    let diff = compute(&encap, body) ^ icrc;
    let after = 8 + 20 + 8 + body.len() - IDENT_REGION_END;
    let at_region = gf::mul(gf::x_pow_neg_8n(after as u64), diff);
    let bits = gf::IDENT_BASIS.solve(at_region)?;
    Some(Ipv4Ident { ident: bits as u16, dont_fragment: bits & (1 << 16) != 0 })
}

/// The unknown bits (Identification, flags) are bytes 4..8 of the IPv4 header, which start
/// 8 bytes into the ICRC buffer; this is where they end.
const IDENT_REGION_END: usize = 8 + 8;

/// Arithmetic in GF(2)[x] / P(x) for the reflected CRC-32 polynomial, enough to move a CRC
/// difference across a run of bytes in either direction.
mod gf {
    /// The reflected CRC-32 polynomial (0x04C11DB7 bit-reversed).
    const POLY: u32 = 0xEDB8_8320;
    /// The polynomial 1 in the reflected representation (bit 31 is x^0).
    const ONE: u32 = 0x8000_0000;
    /// x^-1 mod P. With P = x^32 + p(x) and p(0) = 1, x * (x^31 + (p - 1)/x) = 1 mod P;
    /// in the normal representation that is 0x80000000 | (0x04C11DB7 >> 1).
    const X_INV: u32 = (0x8000_0000u32 | (0x04C1_1DB7 >> 1)).reverse_bits();

    /// a * b mod P.
    pub(super) const fn mul(a: u32, mut b: u32) -> u32 {
        let mut product = 0;
        let mut m = ONE;
        while m != 0 {
            if a & m != 0 {
                product ^= b;
            }
            b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
            m >>= 1;
        }
        product
    }

    /// `X_INV_8_POW2[i]` = x^(-8 * 2^i) mod P.
    const X_INV_8_POW2: [u32; 64] = {
        let mut t = [0u32; 64];
        let mut v = X_INV;
        let mut i = 0;
        while i < 3 {
            v = mul(v, v);
            i += 1;
        }
        let mut i = 0;
        while i < 64 {
            t[i] = v;
            v = mul(v, v);
            i += 1;
        }
        t
    };

    /// x^(-8n) mod P: undoes the effect of `n` bytes following a CRC difference.
    pub(super) fn x_pow_neg_8n(mut n: u64) -> u32 {
        let mut r = ONE;
        let mut i = 0;
        while n != 0 {
            if n & 1 != 0 {
                r = mul(r, X_INV_8_POW2[i]);
            }
            n >>= 1;
            i += 1;
        }
        r
    }

    /// The raw CRC register after one byte `v` followed by `zeros` zero bytes.
    pub(super) const fn raw_crc_byte_then_zeros(v: u8, zeros: usize) -> u32 {
        let mut crc = v as u32;
        let mut k = 0;
        while k < 8 * (zeros + 1) {
            crc = if crc & 1 != 0 { (crc >> 1) ^ POLY } else { crc >> 1 };
            k += 1;
        }
        crc
    }

    /// The raw (zero-init, no final XOR) CRC register after `bytes`.
    const fn raw_crc(bytes: &[u8]) -> u32 {
        let mut crc = 0u32;
        let mut i = 0;
        while i < bytes.len() {
            crc ^= bytes[i] as u32;
            let mut k = 0;
            while k < 8 {
                crc = if crc & 1 != 0 { (crc >> 1) ^ POLY } else { crc >> 1 };
                k += 1;
            }
            i += 1;
        }
        crc
    }

    /// A basis in echelon form (slot = leading bit) of the CRC differences that a set of
    /// unknown bits can cause, each with the combination of unknowns that produces it.
    pub(super) struct Basis {
        vec: [u32; 32],
        combo: [u32; 32],
    }

    impl Basis {
        const fn insert(&mut self, mut v: u32, mut combo: u32) {
            let mut p = 32;
            while p > 0 {
                p -= 1;
                if v & (1 << p) != 0 {
                    if self.vec[p] == 0 {
                        self.vec[p] = v;
                        self.combo[p] = combo;
                        return;
                    }
                    v ^= self.vec[p];
                    combo ^= self.combo[p];
                }
            }
        }

        /// The combination of unknowns that produces `v`, if there is one.
        pub(super) fn solve(&self, mut v: u32) -> Option<u32> {
            let mut combo = 0;
            for p in (0..32).rev() {
                if v & (1 << p) != 0 && self.vec[p] != 0 {
                    v ^= self.vec[p];
                    combo ^= self.combo[p];
                }
            }
            (v == 0).then_some(combo)
        }
    }

    /// The 16 Identification bits (unknowns 0–15) and DF (unknown 16), as raw CRCs of
    /// IPv4 header bytes 4..8.
    pub(super) const IDENT_BASIS: Basis = {
        let mut b = Basis { vec: [0; 32], combo: [0; 32] };
        let mut bit = 0;
        while bit < 16 {
            let id = 1u16 << bit;
            b.insert(raw_crc(&[(id >> 8) as u8, id as u8, 0, 0]), 1 << bit);
            bit += 1;
        }
        b.insert(raw_crc(&[0, 0, 0x40, 0]), 1 << 16);
        b
    };

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn inverse_of_x() {
            assert_eq!(mul(X_INV, 0x4000_0000), ONE);
            assert_eq!(mul(ONE, 0x1234_5678), 0x1234_5678);
        }

        #[test]
        fn ident_bits_are_independent() {
            let rank = IDENT_BASIS.vec.iter().filter(|&&v| v != 0).count();
            assert_eq!(rank, 17);
        }

        #[test]
        fn shifting_back_undoes_trailing_zero_bytes() {
            let d = raw_crc(&[0, 0x12, 0x40, 0]);
            let mut with_tail = vec![0, 0x12, 0x40, 0];
            with_tail.extend(std::iter::repeat_n(0, 1000));
            assert_eq!(mul(x_pow_neg_8n(1000), raw_crc(&with_tail)), d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CRC of the pseudo-headers computed byte by byte, as the definition says.
    fn pseudo_crc_slow(encap: &Encap, udp_payload_len: usize) -> u32 {
        let mut pre = [0xFFu8; PRE_MAX];
        let end = pseudo_headers(encap, udp_payload_len, &mut pre);
        crc32fast::hash(&pre[..end])
    }

    proptest::proptest! {
        /// The table form of the pseudo-headers' CRC equals the CRC of the bytes, for
        /// either family, every length and more flows than the per-thread cache holds
        /// (each case cycles through six).
        #[test]
        fn pseudo_header_crc_from_tables_is_the_crc_of_the_bytes(
            v4: [([u8; 4], [u8; 4], u16, u16, bool); 3],
            v6: [([u8; 16], [u8; 16], u16); 3],
            lens: [u16; 6],
        ) {
            let mut encaps: Vec<Encap> = v4
                .iter()
                .map(|&(s, d, ident, port, df)| Encap {
                    ip: IpFields::V4 { src: s.into(), dst: d.into(), ident, dont_fragment: df },
                    src_port: port,
                    dst_port: 4791,
                })
                .collect();
            encaps.extend(v6.iter().map(|&(s, d, port)| Encap {
                ip: IpFields::V6 { src: s.into(), dst: d.into() },
                src_port: 4791,
                dst_port: port,
            }));
            for round in 0..2 {
                for (e, &len) in encaps.iter().zip(&lens) {
                    let len = usize::from(len) + round;
                    proptest::prop_assert_eq!(pseudo_crc(e, len), pseudo_crc_slow(e, len));
                }
            }
        }
    }

    /// Spec vector V1: a CNP captured from a ConnectX-4 Lx, as the whole IPv4 packet.
    const V1: [u8; 60] = [
        0x45, 0xc2, 0x00, 0x3c, 0x71, 0x8c, 0x40, 0x00, 0x40, 0x11, 0x91, 0x61, 0x0a, 0x00, 0x11, 0x01, 0x0a,
        0x00, 0x12, 0x01, //
        0x00, 0x00, 0x12, 0xb7, 0x00, 0x28, 0x00, 0x00, //
        0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18, 0x00, 0x00, 0x00, 0x00, //
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, //
        0x82, 0xfd, 0x00, 0x2a,
    ];

    /// Spec vector V2: UC SEND_ONLY from scapy's test suite, as the whole IPv4 packet.
    const V2: [u8; 64] = [
        0x45, 0x01, 0x00, 0x40, 0x04, 0x78, 0x40, 0x00, 0x40, 0x11, 0xb4, 0xd5, 0xc0, 0xa8, 0x00, 0x07, 0xc0,
        0xa8, 0x00, 0x07, //
        0xc0, 0x00, 0x12, 0xb7, 0x00, 0x2c, 0xac, 0xa2, //
        0x24, 0x60, 0xff, 0xff, 0x00, 0x00, 0x00, 0xd3, 0x00, 0xcf, 0x17, 0x10, //
        0x46, 0x30, 0x81, 0x8b, 0xe2, 0x89, 0x35, 0xd9, 0x0e, 0x9a, 0x95, 0x50, 0x54, 0x01, 0xbe, 0x88, 0x5e,
        0x50, 0x00, 0x00, //
        0x78, 0xf3, 0x53, 0xf3,
    ];

    fn encap_of(pkt: &[u8]) -> Encap {
        let ip = |o: usize| Ipv4Addr::new(pkt[o], pkt[o + 1], pkt[o + 2], pkt[o + 3]);
        Encap {
            ip: IpFields::V4 {
                src: ip(12),
                dst: ip(16),
                ident: u16::from_be_bytes([pkt[4], pkt[5]]),
                dont_fragment: pkt[6] & 0x40 != 0,
            },
            src_port: u16::from_be_bytes([pkt[20], pkt[21]]),
            dst_port: u16::from_be_bytes([pkt[22], pkt[23]]),
        }
    }

    #[test]
    fn spec_vectors_exact() {
        assert_eq!(compute(&encap_of(&V1), &V1[28..56]), 0x2A00_FD82);
        assert_eq!(compute(&encap_of(&V2), &V2[28..60]), 0xF353_F378);
        assert!(verify(&encap_of(&V1), &V1[28..]));
        assert!(verify(&encap_of(&V2), &V2[28..]));
    }

    #[test]
    fn masked_fields_do_not_matter() {
        // TOS, TTL and checksums are not in Encap at all; FECN/BECN are masked in the BTH.
        let mut p = V2;
        p[32] ^= 0xC0;
        assert!(verify(&encap_of(&V2), &p[28..]));
    }

    fn sock(pkt: &[u8], ip: usize, port: usize) -> SocketAddrV4 {
        SocketAddrV4::new(
            Ipv4Addr::new(pkt[ip], pkt[ip + 1], pkt[ip + 2], pkt[ip + 3]),
            u16::from_be_bytes([pkt[port], pkt[port + 1]]),
        )
    }

    #[test]
    fn solver_recovers_ident_of_spec_vectors() {
        let got = solve_ipv4_ident(sock(&V1, 12, 20), sock(&V1, 16, 22), &V1[28..]);
        assert_eq!(got, Some(Ipv4Ident { ident: 0x718c, dont_fragment: true }));
        let got = solve_ipv4_ident(sock(&V2, 12, 20), sock(&V2, 16, 22), &V2[28..]);
        assert_eq!(got, Some(Ipv4Ident { ident: 0x0478, dont_fragment: true }));
    }

    #[test]
    fn solver_rejects_corruption() {
        let mut p = V2;
        p[45] ^= 0x01;
        assert_eq!(solve_ipv4_ident(sock(&p, 12, 20), sock(&p, 16, 22), &p[28..]), None);
        assert!(!verify(&encap_of(&p), &p[28..]));
        // A wrong address is not an unknown: it must fail too.
        assert_eq!(
            solve_ipv4_ident(
                SocketAddrV4::new(Ipv4Addr::new(192, 168, 0, 8), 0xc000),
                sock(&V2, 16, 22),
                &V2[28..]
            ),
            None
        );
    }

    #[test]
    fn repatch_moves_good_packets_and_keeps_bad_ones_bad() {
        let old = encap_of(&V2);
        let new = Encap::new("10.9.9.9:1234".parse().unwrap(), "10.8.8.8:4791".parse().unwrap()).unwrap();
        let mut good = V2[28..].to_vec();
        assert!(repatch(&old, &new, &mut good));
        assert!(verify(&new, &good) && !verify(&old, &good));
        let mut bad = V2[28..].to_vec();
        bad[20] ^= 0x10;
        assert!(repatch(&old, &new, &mut bad));
        assert!(!verify(&new, &bad), "corruption before the relay is not hidden");
        assert!(!repatch(&old, &new, &mut [0u8; 3]));
    }

    #[test]
    fn too_short_never_verifies() {
        let e = encap_of(&V2);
        assert!(!verify(&e, &[]));
        assert!(!verify(&e, &V2[28..40]));
        assert_eq!(solve_ipv4_ident(sock(&V2, 12, 20), sock(&V2, 16, 22), &[1, 2, 3]), None);
    }
}
