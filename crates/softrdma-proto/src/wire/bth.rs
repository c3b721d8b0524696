//! Base Transport Header, 12 bytes, the start of every RoCEv2 UDP payload (`roce-wire.md` §2).

use super::{be, fixed_view, Error, Opcode, Result};
use crate::{Psn, Qpn};

mod field {
    pub(super) const OPCODE: usize = 0;
    /// SE 0x80, M 0x40, PadCnt 0x30, TVer 0x0F.
    pub(super) const FLAGS: usize = 1;
    pub(super) const PKEY: usize = 2;
    /// FECN 0x80, BECN 0x40, reserved 0x3F.
    pub(super) const CONG: usize = 4;
    pub(super) const DEST_QP: usize = 5;
    /// AckReq 0x80, reserved 0x7F.
    pub(super) const ACK_REQ: usize = 8;
    pub(super) const PSN: usize = 9;
}

/// The default (full-member) partition key, which rxe always sends.
pub const DEFAULT_PKEY: u16 = 0xFFFF;

fixed_view!(
    /// A view of a BTH.
    Bth,
    12,
    "BTH"
);

impl<T: AsRef<[u8]>> Bth<T> {
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    /// The raw opcode byte (may not be a known [`Opcode`]).
    pub fn opcode_raw(&self) -> u8 {
        self.b()[field::OPCODE]
    }
    /// Solicited event.
    pub fn solicited(&self) -> bool {
        self.b()[field::FLAGS] & 0x80 != 0
    }
    /// MigReq (path migration), 0 from rxe.
    pub fn mig_req(&self) -> bool {
        self.b()[field::FLAGS] & 0x40 != 0
    }
    /// Number of pad bytes before the ICRC, 0–3.
    pub fn pad_count(&self) -> u8 {
        (self.b()[field::FLAGS] >> 4) & 0x3
    }
    /// Transport header version; 0 is the only one defined.
    pub fn tver(&self) -> u8 {
        self.b()[field::FLAGS] & 0x0F
    }
    /// Partition key.
    pub fn pkey(&self) -> u16 {
        be::u16_at(self.b(), field::PKEY)
    }
    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        self.b()[field::CONG] & 0x80 != 0
    }
    /// Backward explicit congestion notification (set in a CNP).
    pub fn becn(&self) -> bool {
        self.b()[field::CONG] & 0x40 != 0
    }
    /// The six reserved bits after FECN and BECN.
    pub fn reserved_cong(&self) -> u8 {
        self.b()[field::CONG] & 0x3F
    }
    /// Destination QP.
    pub fn dest_qp(&self) -> Qpn {
        Qpn::new(be::u24_at(self.b(), field::DEST_QP))
    }
    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        self.b()[field::ACK_REQ] & 0x80 != 0
    }
    /// Packet sequence number.
    pub fn psn(&self) -> Psn {
        Psn::new(be::u24_at(self.b(), field::PSN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Bth<T> {
    fn bm(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
    fn set_bit(&mut self, at: usize, mask: u8, on: bool) {
        let b = &mut self.bm()[at];
        *b = if on { *b | mask } else { *b & !mask };
    }
    /// Sets the opcode.
    pub fn set_opcode(&mut self, op: Opcode) {
        self.bm()[field::OPCODE] = op.code();
    }
    /// Sets SE.
    pub fn set_solicited(&mut self, on: bool) {
        self.set_bit(field::FLAGS, 0x80, on);
    }
    /// Sets M.
    pub fn set_mig_req(&mut self, on: bool) {
        self.set_bit(field::FLAGS, 0x40, on);
    }
    /// Sets PadCnt (the low two bits of `pad`).
    pub fn set_pad_count(&mut self, pad: u8) {
        let b = &mut self.bm()[field::FLAGS];
        *b = (*b & !0x30) | ((pad & 0x3) << 4);
    }
    /// Sets TVer (the low four bits of `tver`).
    pub fn set_tver(&mut self, tver: u8) {
        let b = &mut self.bm()[field::FLAGS];
        *b = (*b & 0xF0) | (tver & 0x0F);
    }
    /// Sets the P_Key.
    pub fn set_pkey(&mut self, pkey: u16) {
        be::put_u16(self.bm(), field::PKEY, pkey);
    }
    /// Sets FECN and BECN and clears the reserved bits.
    pub fn set_congestion(&mut self, fecn: bool, becn: bool) {
        self.bm()[field::CONG] = (u8::from(fecn) << 7) | (u8::from(becn) << 6);
    }
    /// Sets the destination QP.
    pub fn set_dest_qp(&mut self, qpn: Qpn) {
        be::put_u24(self.bm(), field::DEST_QP, qpn.get());
    }
    /// Sets AckReq and clears the reserved bits after it.
    pub fn set_ack_req(&mut self, on: bool) {
        self.bm()[field::ACK_REQ] = u8::from(on) << 7;
    }
    /// Sets the PSN.
    pub fn set_psn(&mut self, psn: Psn) {
        be::put_u24(self.bm(), field::PSN, psn.get());
    }
}

/// The meaning of a BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct BthRepr {
    /// Opcode.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// MigReq; softrdma, like rxe, sends 0.
    pub mig_req: bool,
    /// Pad bytes before the ICRC. [`super::PacketRepr::emit`] computes it from the payload.
    pub pad_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// FECN.
    pub fecn: bool,
    /// BECN.
    pub becn: bool,
    /// Destination QP.
    pub dest_qp: Qpn,
    /// AckReq.
    pub ack_req: bool,
    /// PSN.
    pub psn: Psn,
}

impl BthRepr {
    /// A BTH with the defaults softrdma sends: P_Key 0xFFFF, every flag clear.
    pub fn new(opcode: Opcode, dest_qp: Qpn, psn: Psn) -> BthRepr {
        BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp,
            ack_req: false,
            psn,
        }
    }

    /// Parses a BTH: the opcode must be known and TVer 0. Reserved bits are ignored.
    pub fn parse<T: AsRef<[u8]>>(bth: &Bth<T>) -> Result<BthRepr> {
        let opcode = Opcode::new(bth.opcode_raw()).ok_or(Error::UnknownOpcode(bth.opcode_raw()))?;
        if bth.tver() != 0 {
            return Err(Error::BadTransportVersion(bth.tver()));
        }
        Ok(BthRepr {
            opcode,
            solicited: bth.solicited(),
            mig_req: bth.mig_req(),
            pad_count: bth.pad_count(),
            pkey: bth.pkey(),
            fecn: bth.fecn(),
            becn: bth.becn(),
            dest_qp: bth.dest_qp(),
            ack_req: bth.ack_req(),
            psn: bth.psn(),
        })
    }

    /// Writes every field, reserved bits as zero and TVer 0.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, bth: &mut Bth<T>) {
        bth.set_opcode(self.opcode);
        bth.bm()[field::FLAGS] = 0;
        bth.set_solicited(self.solicited);
        bth.set_mig_req(self.mig_req);
        bth.set_pad_count(self.pad_count);
        bth.set_pkey(self.pkey);
        bth.set_congestion(self.fecn, self.becn);
        bth.set_dest_qp(self.dest_qp);
        bth.set_ack_req(self.ack_req);
        bth.set_psn(self.psn);
    }
}

/// Whether two P_Keys match (`pkey_match`): equal, nonzero low 15 bits, and at least one
/// full member (bit 15).
pub fn pkey_match(a: u16, b: u16) -> bool {
    let (la, lb) = (a & 0x7FFF, b & 0x7FFF);
    la != 0 && la == lb && (a | b) & 0x8000 != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The BTH of spec vector V2: UC SEND_ONLY, M=1, PadCnt=2, QP 211, PSN 0xCF1710.
    const V2: [u8; 12] = [0x24, 0x60, 0xff, 0xff, 0x00, 0x00, 0x00, 0xd3, 0x00, 0xcf, 0x17, 0x10];

    #[test]
    fn parse_golden_v2() {
        let r = BthRepr::parse(&Bth::new_checked(&V2[..]).unwrap()).unwrap();
        assert_eq!(r.opcode.code(), 0x24);
        assert!(!r.solicited && r.mig_req && !r.fecn && !r.becn && !r.ack_req);
        assert_eq!((r.pad_count, r.pkey), (2, 0xFFFF));
        assert_eq!((r.dest_qp, r.psn), (Qpn::new(211), Psn::new(0xCF1710)));
    }

    #[test]
    fn every_field_lands_in_its_bits() {
        let r = BthRepr {
            opcode: Opcode::new(0x0A).unwrap(),
            solicited: true,
            mig_req: false,
            pad_count: 3,
            pkey: 0x7FFF,
            fecn: true,
            becn: false,
            dest_qp: Qpn::new(0xABCDEF),
            ack_req: true,
            psn: Psn::new(0x123456),
        };
        let mut buf = [0xEEu8; 12];
        r.emit(&mut Bth::new_unchecked(&mut buf[..]));
        assert_eq!(buf, [0x0A, 0xB0, 0x7F, 0xFF, 0x80, 0xAB, 0xCD, 0xEF, 0x80, 0x12, 0x34, 0x56]);
        assert_eq!(BthRepr::parse(&Bth::new_unchecked(&buf[..])).unwrap(), r);

        let cnp = BthRepr {
            becn: true,
            fecn: false,
            ..BthRepr::new(Opcode::new(0x81).unwrap(), Qpn::new(0x118), Psn::new(0))
        };
        cnp.emit(&mut Bth::new_unchecked(&mut buf[..]));
        assert_eq!(buf, [0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18, 0, 0, 0, 0]);
    }

    #[test]
    fn rejects_short_unknown_and_bad_version() {
        assert!(matches!(Bth::new_checked(&V2[..11]), Err(Error::Truncated { need: 12, have: 11, .. })));
        let mut b = V2;
        b[0] = 0x15;
        assert_eq!(BthRepr::parse(&Bth::new_unchecked(&b[..])), Err(Error::UnknownOpcode(0x15)));
        let mut b = V2;
        b[1] |= 0x01;
        assert_eq!(BthRepr::parse(&Bth::new_unchecked(&b[..])), Err(Error::BadTransportVersion(1)));
    }

    #[test]
    fn reserved_bits_are_ignored_on_parse() {
        let mut b = V2;
        b[4] |= 0x3F;
        b[8] |= 0x7F;
        let v = Bth::new_unchecked(&b[..]);
        assert_eq!(v.reserved_cong(), 0x3F);
        let r = BthRepr::parse(&v).unwrap();
        assert_eq!((r.dest_qp.get(), r.psn.get(), r.ack_req), (211, 0xCF1710, false));
    }

    #[test]
    fn pkey_matching() {
        assert!(pkey_match(0xFFFF, 0xFFFF));
        assert!(pkey_match(0xFFFF, 0x7FFF));
        assert!(!pkey_match(0x7FFF, 0x7FFF), "two limited members do not match");
        assert!(!pkey_match(0x8000, 0x8000), "the invalid P_Key");
        assert!(!pkey_match(0xFFFF, 0xFFFE));
    }
}
