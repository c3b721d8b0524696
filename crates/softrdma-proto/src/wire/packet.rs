//! A whole RoCEv2 UDP payload: BTH, the opcode's extension headers, payload, pad and ICRC.
//!
//! [`Packet`] validates the structure once in `new_checked` (everything that can be known
//! without the IP header or a queue pair's state) so that its accessors cannot fail.
//! [`PacketRepr`] is the owned meaning of the headers; the payload stays where it is, so
//! a sender can write headers into one buffer and gather the payload from elsewhere.
//!
//! What is checked here: length, opcode, TVer, pad count against the bytes present,
//! payload presence (none for ACKs, READ requests, atomics, FLUSH; 8 bytes for
//! ATOMIC_WRITE), the AETH syndrome's top bit. What is not: the ICRC (needs the IP and UDP
//! headers, see [`super::icrc`]), P_Key, Q_Key and PMTU-dependent lengths (a queue pair's
//! business).

use super::{
    check_len, icrc, icrc::ICRC_LEN, Aeth, AethRepr, AtomicAckEth, AtomicAckEthRepr, AtomicEth,
    AtomicEthRepr, Bth, BthRepr, Cnp, Deth, DethRepr, Error, Feth, FethRepr, HeaderKind, Ieth, IethRepr,
    ImmDt, ImmDtRepr, Opcode, PayloadRule, Result, Reth, RethRepr,
};

/// The PadCnt for a payload of `len` bytes: the bytes needed to reach a multiple of 4.
pub const fn pad_count(len: usize) -> u8 {
    (len.wrapping_neg() & 3) as u8
}

/// A structurally valid RoCEv2 packet (a UDP payload).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
    opcode: Opcode,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Validates `buffer` as a RoCEv2 UDP payload, reporting the first malformation found.
    pub fn new_checked(buffer: T) -> Result<Packet<T>> {
        let b = buffer.as_ref();
        check_len("BTH", b, Bth::<&[u8]>::LEN)?;
        let bth = Bth::new_unchecked(b);
        let opcode = Opcode::new(bth.opcode_raw()).ok_or(Error::UnknownOpcode(bth.opcode_raw()))?;
        if bth.tver() != 0 {
            return Err(Error::BadTransportVersion(bth.tver()));
        }
        let header_len = Bth::<&[u8]>::LEN + opcode.headers().len();
        check_len("packet headers and ICRC", b, header_len + ICRC_LEN)?;
        let rest = b.len() - header_len - ICRC_LEN;
        let pad = bth.pad_count();
        if usize::from(pad) > rest {
            return Err(Error::BadPadCount { pad, len: rest });
        }
        let payload_len = rest - usize::from(pad);
        match opcode.payload() {
            PayloadRule::None if rest != 0 => {
                return Err(Error::UnexpectedPayload { opcode, len: rest });
            }
            PayloadRule::Exactly(n) if payload_len != n => {
                return Err(Error::BadPayloadLength { opcode, expected: n, len: payload_len });
            }
            _ => {}
        }
        if let Some(off) = opcode.headers().offset_of(HeaderKind::Aeth) {
            AethRepr::parse(&Aeth::new_unchecked(&b[Bth::<&[u8]>::LEN + off..]))?;
        }
        Ok(Packet { buffer, opcode })
    }

    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// All the bytes, ICRC included.
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The BTH.
    pub fn bth(&self) -> Bth<&[u8]> {
        Bth::new_unchecked(&self.as_bytes()[..Bth::<&[u8]>::LEN])
    }

    /// Length of the BTH plus extension headers.
    pub fn header_len(&self) -> usize {
        Bth::<&[u8]>::LEN + self.opcode.headers().len()
    }

    fn ext(&self, kind: HeaderKind) -> Option<&[u8]> {
        let off = Bth::<&[u8]>::LEN + self.opcode.headers().offset_of(kind)?;
        Some(&self.as_bytes()[off..off + kind.len()])
    }

    /// The DETH, for UD packets.
    pub fn deth(&self) -> Option<Deth<&[u8]>> {
        self.ext(HeaderKind::Deth).map(Deth::new_unchecked)
    }
    /// The FETH, for FLUSH.
    pub fn feth(&self) -> Option<Feth<&[u8]>> {
        self.ext(HeaderKind::Feth).map(Feth::new_unchecked)
    }
    /// The RETH, for WRITE FIRST/ONLY, READ requests, FLUSH and ATOMIC_WRITE.
    pub fn reth(&self) -> Option<Reth<&[u8]>> {
        self.ext(HeaderKind::Reth).map(Reth::new_unchecked)
    }
    /// The AtomicETH, for CmpSwap and FetchAdd.
    pub fn atomic_eth(&self) -> Option<AtomicEth<&[u8]>> {
        self.ext(HeaderKind::AtomicEth).map(AtomicEth::new_unchecked)
    }
    /// The AETH, for ACKs and read responses except MIDDLE.
    pub fn aeth(&self) -> Option<Aeth<&[u8]>> {
        self.ext(HeaderKind::Aeth).map(Aeth::new_unchecked)
    }
    /// The AtomicAckETH, for ATOMIC_ACKNOWLEDGE.
    pub fn atomic_ack_eth(&self) -> Option<AtomicAckEth<&[u8]>> {
        self.ext(HeaderKind::AtomicAckEth).map(AtomicAckEth::new_unchecked)
    }
    /// The immediate data, for the *_WITH_IMMEDIATE opcodes.
    pub fn immdt(&self) -> Option<ImmDt<&[u8]>> {
        self.ext(HeaderKind::ImmDt).map(ImmDt::new_unchecked)
    }
    /// The IETH, for SEND_*_WITH_INVALIDATE.
    pub fn ieth(&self) -> Option<Ieth<&[u8]>> {
        self.ext(HeaderKind::Ieth).map(Ieth::new_unchecked)
    }
    /// The reserved block of a CNP.
    pub fn cnp(&self) -> Option<Cnp<&[u8]>> {
        self.ext(HeaderKind::CnpReserved).map(Cnp::new_unchecked)
    }

    /// The pad count from the BTH.
    pub fn pad_count(&self) -> u8 {
        self.bth().pad_count()
    }

    /// The payload, without pad.
    pub fn payload(&self) -> &[u8] {
        let b = self.as_bytes();
        let end = b.len() - ICRC_LEN - usize::from(self.pad_count());
        &b[self.header_len()..end]
    }

    /// The ICRC as sent (its four bytes read little-endian, `roce-wire.md` §5.2).
    pub fn icrc(&self) -> u32 {
        let b = self.as_bytes();
        let t = &b[b.len() - ICRC_LEN..];
        u32::from_le_bytes([t[0], t[1], t[2], t[3]])
    }

    /// Everything the ICRC follows: headers, payload and pad.
    pub fn without_icrc(&self) -> &[u8] {
        let b = self.as_bytes();
        &b[..b.len() - ICRC_LEN]
    }
}

/// The extension headers of a packet; exactly those its opcode calls for are `Some`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[allow(missing_docs)]
pub struct ExtHeaders {
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub deth: Option<DethRepr>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub feth: Option<FethRepr>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub reth: Option<RethRepr>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub atomic_eth: Option<AtomicEthRepr>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub aeth: Option<AethRepr>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub atomic_ack_eth: Option<AtomicAckEthRepr>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub immdt: Option<ImmDtRepr>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub ieth: Option<IethRepr>,
}

impl ExtHeaders {
    fn has(&self, kind: HeaderKind) -> bool {
        match kind {
            HeaderKind::Deth => self.deth.is_some(),
            HeaderKind::Feth => self.feth.is_some(),
            HeaderKind::Reth => self.reth.is_some(),
            HeaderKind::AtomicEth => self.atomic_eth.is_some(),
            HeaderKind::Aeth => self.aeth.is_some(),
            HeaderKind::AtomicAckEth => self.atomic_ack_eth.is_some(),
            HeaderKind::ImmDt => self.immdt.is_some(),
            HeaderKind::Ieth => self.ieth.is_some(),
            // Always zero; nothing to carry, so whatever the opcode wants.
            HeaderKind::CnpReserved => false,
        }
    }
}

/// The owned meaning of a packet's headers, plus the length of its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PacketRepr {
    /// The BTH. On emit, its `pad_count` is replaced by the one `payload_len` needs.
    pub bth: BthRepr,
    /// The extension headers.
    pub ext: ExtHeaders,
    /// Payload bytes, without pad.
    pub payload_len: usize,
}

impl PacketRepr {
    /// A packet of `bth.opcode` with no extension headers filled in yet.
    pub fn new(bth: BthRepr, payload_len: usize) -> PacketRepr {
        PacketRepr { bth, ext: ExtHeaders::default(), payload_len }
    }

    /// Reads every header of a validated packet.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<PacketRepr> {
        Ok(PacketRepr {
            bth: BthRepr::parse(&p.bth())?,
            ext: ExtHeaders {
                deth: p.deth().map(|h| DethRepr::parse(&h)).transpose()?,
                feth: p.feth().map(|h| FethRepr::parse(&h)).transpose()?,
                reth: p.reth().map(|h| RethRepr::parse(&h)).transpose()?,
                atomic_eth: p.atomic_eth().map(|h| AtomicEthRepr::parse(&h)).transpose()?,
                aeth: p.aeth().map(|h| AethRepr::parse(&h)).transpose()?,
                atomic_ack_eth: p.atomic_ack_eth().map(|h| AtomicAckEthRepr::parse(&h)).transpose()?,
                immdt: p.immdt().map(|h| ImmDtRepr::parse(&h)).transpose()?,
                ieth: p.ieth().map(|h| IethRepr::parse(&h)).transpose()?,
            },
            payload_len: p.payload().len(),
        })
    }

    /// Length of the BTH and extension headers.
    pub fn header_len(&self) -> usize {
        Bth::<&[u8]>::LEN + self.bth.opcode.headers().len()
    }

    /// Length of the whole UDP payload: headers, payload, pad and ICRC.
    pub fn total_len(&self) -> usize {
        self.header_len() + self.payload_len + usize::from(pad_count(self.payload_len)) + ICRC_LEN
    }

    fn check(&self) -> Result<()> {
        let opcode = self.bth.opcode;
        let wanted = opcode.headers();
        for kind in super::HeaderKind::ORDER {
            if kind != HeaderKind::CnpReserved && wanted.contains(kind) != self.ext.has(kind) {
                let reason = if wanted.contains(kind) {
                    "an extension header it needs is missing"
                } else {
                    "it has an extension header the opcode does not carry"
                };
                return Err(Error::Inconsistent { opcode, reason });
            }
        }
        match opcode.payload() {
            PayloadRule::None if self.payload_len != 0 => {
                Err(Error::Inconsistent { opcode, reason: "the opcode carries no payload" })
            }
            PayloadRule::Exactly(n) if self.payload_len != n => {
                Err(Error::Inconsistent { opcode, reason: "wrong payload length for the opcode" })
            }
            _ => Ok(()),
        }
    }

    /// Writes the BTH (with PadCnt set for `payload_len`) and the extension headers at the
    /// start of `buf`; returns [`Self::header_len`]. The payload, pad and ICRC are the
    /// caller's: see [`Self::emit`] for a whole packet, or [`icrc::IcrcHasher`] to compute
    /// the ICRC over payload gathered from several places.
    pub fn emit_headers(&self, buf: &mut [u8]) -> Result<usize> {
        self.check()?;
        let len = self.header_len();
        if buf.len() < len {
            return Err(Error::BufferTooSmall { need: len, have: buf.len() });
        }
        let mut bth = self.bth;
        bth.pad_count = pad_count(self.payload_len);
        bth.emit(&mut Bth::new_unchecked(&mut buf[..Bth::<&[u8]>::LEN]));
        let headers = self.bth.opcode.headers();
        for kind in headers.iter() {
            let off = Bth::<&[u8]>::LEN + headers.offset_of(kind).unwrap_or(0);
            let h = &mut buf[off..off + kind.len()];
            let e = &self.ext;
            match kind {
                HeaderKind::Deth => e.deth.map(|r| r.emit(&mut Deth::new_unchecked(h))),
                HeaderKind::Feth => e.feth.map(|r| r.emit(&mut Feth::new_unchecked(h))),
                HeaderKind::Reth => e.reth.map(|r| r.emit(&mut Reth::new_unchecked(h))),
                HeaderKind::AtomicEth => e.atomic_eth.map(|r| r.emit(&mut AtomicEth::new_unchecked(h))),
                HeaderKind::Aeth => e.aeth.map(|r| r.emit(&mut Aeth::new_unchecked(h))),
                HeaderKind::AtomicAckEth => {
                    e.atomic_ack_eth.map(|r| r.emit(&mut AtomicAckEth::new_unchecked(h)))
                }
                HeaderKind::ImmDt => e.immdt.map(|r| r.emit(&mut ImmDt::new_unchecked(h))),
                HeaderKind::Ieth => e.ieth.map(|r| r.emit(&mut Ieth::new_unchecked(h))),
                HeaderKind::CnpReserved => {
                    h.fill(0);
                    None
                }
            };
        }
        Ok(len)
    }

    /// Writes the whole packet into `buf`: headers, `payload`, zero pad and the ICRC for
    /// the given encapsulation. Returns [`Self::total_len`].
    pub fn emit(&self, buf: &mut [u8], payload: &[u8], encap: &icrc::Encap) -> Result<usize> {
        if payload.len() != self.payload_len {
            return Err(Error::Inconsistent {
                opcode: self.bth.opcode,
                reason: "payload length differs from payload_len",
            });
        }
        let total = self.total_len();
        self.check()?;
        if buf.len() < total {
            return Err(Error::BufferTooSmall { need: total, have: buf.len() });
        }
        let h = self.emit_headers(buf)?;
        buf[h..h + payload.len()].copy_from_slice(payload);
        let end = total - ICRC_LEN;
        buf[h + payload.len()..end].fill(0);
        let crc = icrc::compute(encap, &buf[..end]);
        buf[end..total].copy_from_slice(&crc.to_le_bytes());
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{AethSyndrome, Operation};
    use crate::{Psn, Qkey, Qpn, Rkey};

    /// Spec vector V2 as a UDP payload (after the 28 bytes of IPv4 and UDP headers).
    const V2_UDP_PAYLOAD: [u8; 36] = [
        0x24, 0x60, 0xff, 0xff, 0x00, 0x00, 0x00, 0xd3, 0x00, 0xcf, 0x17, 0x10, //
        0x46, 0x30, 0x81, 0x8b, 0xe2, 0x89, 0x35, 0xd9, 0x0e, 0x9a, 0x95, 0x50, 0x54, 0x01, 0xbe, 0x88, 0x5e,
        0x50, 0x00, 0x00, //
        0x78, 0xf3, 0x53, 0xf3,
    ];

    #[test]
    fn parse_v2_payload_pad_and_icrc() {
        let p = Packet::new_checked(&V2_UDP_PAYLOAD[..]).unwrap();
        assert_eq!(p.opcode().code(), 0x24);
        assert_eq!(p.payload().len(), 18);
        assert_eq!(p.pad_count(), 2);
        assert_eq!(p.icrc(), 0xF353_F378);
        let r = PacketRepr::parse(&p).unwrap();
        assert_eq!(r.payload_len, 18);
        assert_eq!(r.total_len(), V2_UDP_PAYLOAD.len());
    }

    #[test]
    fn malformations_are_typed_errors() {
        let ack = |extra: &[u8]| {
            let mut v = vec![0x11, 0, 0xff, 0xff, 0, 0, 0, 0x11, 0, 0, 0, 1, 0x1f, 0, 0, 1];
            v.extend_from_slice(extra);
            v
        };
        assert!(Packet::new_checked(ack(&[0; 4])).is_ok());
        assert!(matches!(Packet::new_checked(ack(&[0; 3])), Err(Error::Truncated { .. })));
        assert!(matches!(Packet::new_checked(&[0x04u8; 5][..]), Err(Error::Truncated { what: "BTH", .. })));
        assert!(matches!(
            Packet::new_checked(ack(&[1, 2, 3, 4, 5, 6, 7, 8])),
            Err(Error::UnexpectedPayload { len: 4, .. })
        ));
        let mut bad_aeth = ack(&[0; 4]);
        bad_aeth[12] = 0x80;
        assert!(matches!(Packet::new_checked(bad_aeth), Err(Error::BadField { header: "AETH", .. })));
        // SEND_ONLY with PadCnt 3 but only 2 bytes before the ICRC.
        let send = [0x04, 0x30, 0xff, 0xff, 0, 0, 0, 0x11, 0, 0, 0, 1, 0xAA, 0xBB, 0, 0, 0, 0];
        assert_eq!(Packet::new_checked(&send[..]).err(), Some(Error::BadPadCount { pad: 3, len: 2 }));
        let mut unknown = send;
        unknown[0] = 0x68;
        assert_eq!(Packet::new_checked(&unknown[..]).err(), Some(Error::UnknownOpcode(0x68)));
        let mut tver = send;
        tver[1] = 0x01;
        assert_eq!(Packet::new_checked(&tver[..]).err(), Some(Error::BadTransportVersion(1)));
        // ATOMIC_WRITE with 4 payload bytes.
        let mut aw = vec![0x1D, 0, 0xff, 0xff, 0, 0, 0, 0x11, 0, 0, 0, 1];
        aw.extend_from_slice(&[0; 16 + 4 + 4]);
        assert!(matches!(Packet::new_checked(aw), Err(Error::BadPayloadLength { expected: 8, len: 4, .. })));
    }

    fn sample(opcode: Opcode, payload_len: usize) -> PacketRepr {
        let mut r = PacketRepr::new(BthRepr::new(opcode, Qpn::new(0x12), Psn::new(0xFFFFFE)), payload_len);
        let h = opcode.headers();
        let e = &mut r.ext;
        if h.contains(HeaderKind::Deth) {
            e.deth = Some(DethRepr { qkey: Qkey(0x11111111), src_qp: Qpn::new(0x33) });
        }
        if h.contains(HeaderKind::Reth) {
            e.reth = Some(RethRepr { va: 0x1000, rkey: Rkey(0x1234), dma_len: payload_len as u32 });
        }
        if h.contains(HeaderKind::Feth) {
            e.feth = Some(FethRepr { placement_type: 1, selectivity: 0 });
        }
        if h.contains(HeaderKind::AtomicEth) {
            e.atomic_eth = Some(AtomicEthRepr { va: 0x2000, rkey: Rkey(9), swap_add: 5, compare: 6 });
        }
        if h.contains(HeaderKind::Aeth) {
            e.aeth = Some(AethRepr { syndrome: AethSyndrome::ACK, msn: 7 });
        }
        if h.contains(HeaderKind::AtomicAckEth) {
            e.atomic_ack_eth = Some(AtomicAckEthRepr { orig: 42 });
        }
        if h.contains(HeaderKind::ImmDt) {
            e.immdt = Some(ImmDtRepr { value: 0xCAFE });
        }
        if h.contains(HeaderKind::Ieth) {
            e.ieth = Some(IethRepr { rkey: Rkey(0x77) });
        }
        r
    }

    #[test]
    fn emit_then_parse_every_opcode() {
        let encap =
            icrc::Encap::new("10.0.0.1:49152".parse().unwrap(), "10.0.0.2:4791".parse().unwrap()).unwrap();
        for opcode in Opcode::all() {
            let len = match opcode.payload() {
                PayloadRule::None => 0,
                PayloadRule::Exactly(n) => n,
                _ => 13,
            };
            let payload: Vec<u8> = (0..len as u8).collect();
            let r = sample(opcode, len);
            let mut buf = [0xEEu8; 128];
            let n = r.emit(&mut buf, &payload, &encap).unwrap();
            assert_eq!(n, r.total_len());
            let p = Packet::new_checked(&buf[..n]).unwrap();
            assert_eq!(
                PacketRepr::parse(&p).unwrap(),
                PacketRepr { bth: BthRepr { pad_count: pad_count(len), ..r.bth }, ..r }
            );
            assert_eq!(p.payload(), &payload[..]);
            assert!(icrc::verify(&encap, p.as_bytes()), "{opcode}");
        }
    }

    #[test]
    fn emit_rejects_inconsistent_reprs() {
        let write = Opcode::from_parts(crate::wire::Transport::Rc, Operation::RdmaWriteOnly).unwrap();
        let mut r = sample(write, 4);
        r.ext.reth = None;
        let mut buf = [0u8; 64];
        assert!(matches!(r.emit_headers(&mut buf), Err(Error::Inconsistent { .. })));
        let mut r = sample(write, 4);
        r.ext.immdt = Some(ImmDtRepr { value: 1 });
        assert!(matches!(r.emit_headers(&mut buf), Err(Error::Inconsistent { .. })));
        let ack = sample(Opcode::new(0x11).unwrap(), 4);
        assert!(matches!(ack.emit_headers(&mut buf), Err(Error::Inconsistent { .. })));
        let r = sample(write, 4);
        assert!(matches!(r.emit_headers(&mut buf[..20]), Err(Error::BufferTooSmall { need: 28, have: 20 })));
    }

    #[test]
    fn pad_counts() {
        assert_eq!([pad_count(0), pad_count(1), pad_count(2), pad_count(3), pad_count(4)], [0, 3, 2, 1, 0]);
        assert_eq!(pad_count(1023), 1);
    }
}
