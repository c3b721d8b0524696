//! ACK Extended Transport Header, 4 bytes: syndrome and MSN (`roce-wire.md` §4).
//!
//! The syndrome's top bit is 0; bits 6..5 give the type and bits 4..0 its value: an ACK
//! with a credit code, an RNR NAK with a timer code, or a NAK with an error code.

use super::{be, fixed_view, Error, Result};
use core::fmt;

fixed_view!(
    /// A view of an AETH.
    Aeth,
    4,
    "AETH"
);

impl<T: AsRef<[u8]>> Aeth<T> {
    /// The raw syndrome byte.
    pub fn syndrome_raw(&self) -> u8 {
        self.buffer.as_ref()[0]
    }
    /// The 24-bit message sequence number.
    pub fn msn(&self) -> u32 {
        be::u24_at(self.buffer.as_ref(), 1)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Aeth<T> {
    /// Sets the syndrome byte.
    pub fn set_syndrome_raw(&mut self, s: u8) {
        self.buffer.as_mut()[0] = s;
    }
    /// Sets the MSN (low 24 bits).
    pub fn set_msn(&mut self, msn: u32) {
        be::put_u24(self.buffer.as_mut(), 1, msn & crate::types::MASK_24);
    }
}

/// The credit code that means "no credit information" (rxe sends it in every ACK).
pub const CREDITS_INVALID: u8 = 31;

/// Receive WQEs available for credit codes 0–30.
const CREDIT_TABLE: [u16; 31] = [
    0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
    4096, 6144, 8192, 12288, 16384, 24576, 32768,
];

/// Minimum RNR wait in microseconds for timer codes 0–31 (code 0 is the longest).
const RNR_TIMER_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120, 7680,
    10240, 15360, 20480, 30720, 40960, 61440, 81920, 122_880, 163_840, 245_760, 327_680, 491_520,
];

/// A NAK code (syndrome type 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum NakCode {
    /// 0: PSN sequence error; the requester goes back N.
    PsnSequenceError,
    /// 1: invalid request.
    InvalidRequest,
    /// 2: remote access error.
    RemoteAccessError,
    /// 3: remote operational error.
    RemoteOperationalError,
    /// 4: invalid RD request.
    InvalidRdRequest,
    /// 5–31: reserved; rxe treats them as a remote operational error.
    Reserved(u8),
}

impl core::fmt::Display for NakCode {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            NakCode::PsnSequenceError => f.write_str("PSN sequence error"),
            NakCode::InvalidRequest => f.write_str("invalid request"),
            NakCode::RemoteAccessError => f.write_str("remote access error"),
            NakCode::RemoteOperationalError => f.write_str("remote operational error"),
            NakCode::InvalidRdRequest => f.write_str("invalid RD request"),
            NakCode::Reserved(c) => write!(f, "reserved NAK code {c}"),
        }
    }
}

impl NakCode {
    /// The 5-bit value.
    pub const fn code(self) -> u8 {
        match self {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
            NakCode::Reserved(c) => c & 0x1F,
        }
    }

    /// The NAK code for a 5-bit value.
    pub const fn from_code(c: u8) -> NakCode {
        match c & 0x1F {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::InvalidRdRequest,
            c => NakCode::Reserved(c),
        }
    }

    /// A short name for tools.
    pub const fn name(self) -> &'static str {
        match self {
            NakCode::PsnSequenceError => "PSN_SEQ_ERR",
            NakCode::InvalidRequest => "INV_REQ",
            NakCode::RemoteAccessError => "REM_ACCESS_ERR",
            NakCode::RemoteOperationalError => "REM_OP_ERR",
            NakCode::InvalidRdRequest => "INV_RD_REQ",
            NakCode::Reserved(_) => "RESERVED",
        }
    }
}

/// The meaning of an AETH syndrome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum AethSyndrome {
    /// Positive acknowledgement with a 5-bit credit code (31 = no credit information).
    Ack {
        /// Credit code, 0–31.
        credit_code: u8,
    },
    /// Receiver not ready; retry after the timer code's wait.
    RnrNak {
        /// RNR timer code, 0–31.
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
    /// Type 2 (0x40–0x5F), reserved; rxe fails the WQE.
    Reserved(u8),
}

impl AethSyndrome {
    /// An ACK without credit information, as rxe and softrdma send.
    pub const ACK: AethSyndrome = AethSyndrome::Ack { credit_code: CREDITS_INVALID };

    /// Decodes a syndrome byte; the top bit must be 0.
    pub fn from_byte(s: u8) -> Result<AethSyndrome> {
        if s & 0x80 != 0 {
            return Err(Error::BadField { header: "AETH", reason: "syndrome bit 7 is set" });
        }
        let v = s & 0x1F;
        Ok(match (s >> 5) & 0x3 {
            0 => AethSyndrome::Ack { credit_code: v },
            1 => AethSyndrome::RnrNak { timer: v },
            2 => AethSyndrome::Reserved(v),
            _ => AethSyndrome::Nak(NakCode::from_code(v)),
        })
    }

    /// The syndrome byte.
    pub const fn to_byte(self) -> u8 {
        match self {
            AethSyndrome::Ack { credit_code } => credit_code & 0x1F,
            AethSyndrome::RnrNak { timer } => 0x20 | (timer & 0x1F),
            AethSyndrome::Reserved(v) => 0x40 | (v & 0x1F),
            AethSyndrome::Nak(code) => 0x60 | code.code(),
        }
    }

    /// For an ACK, the number of receive WQEs its credit code announces; `None` for code 31
    /// (no information) and for anything that is not an ACK.
    pub fn credits(self) -> Option<u16> {
        match self {
            AethSyndrome::Ack { credit_code } => CREDIT_TABLE.get(credit_code as usize).copied(),
            _ => None,
        }
    }

    /// For an RNR NAK, the minimum wait in microseconds before the retry.
    pub fn rnr_wait_us(self) -> Option<u32> {
        match self {
            AethSyndrome::RnrNak { timer } => Some(rnr_timer_us(timer)),
            _ => None,
        }
    }
}

/// The minimum wait, in microseconds, that an RNR timer code (0–31) asks for.
pub fn rnr_timer_us(code: u8) -> u32 {
    RNR_TIMER_US[(code & 0x1F) as usize]
}

/// The largest credit code whose credit count does not exceed `wqes`.
pub fn credit_code_for(wqes: u32) -> u8 {
    CREDIT_TABLE.iter().rposition(|&c| u32::from(c) <= wqes).unwrap_or(0) as u8
}

impl fmt::Display for AethSyndrome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            AethSyndrome::Ack { credit_code: CREDITS_INVALID } => f.write_str("ACK"),
            AethSyndrome::Ack { credit_code } => {
                write!(f, "ACK credits={}", CREDIT_TABLE[credit_code as usize])
            }
            AethSyndrome::RnrNak { timer } => write!(f, "RNR_NAK timer={timer}"),
            AethSyndrome::Nak(c) => write!(f, "NAK {}", c.name()),
            AethSyndrome::Reserved(v) => write!(f, "RESERVED({:#04x})", 0x40 | v),
        }
    }
}

/// The meaning of an AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct AethRepr {
    /// Syndrome.
    pub syndrome: AethSyndrome,
    /// Message sequence number, 24 bits.
    pub msn: u32,
}

impl AethRepr {
    /// Reads an AETH; fails if syndrome bit 7 is set.
    pub fn parse<T: AsRef<[u8]>>(h: &Aeth<T>) -> Result<AethRepr> {
        Ok(AethRepr { syndrome: AethSyndrome::from_byte(h.syndrome_raw())?, msn: h.msn() })
    }
    /// Writes an AETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Aeth<T>) {
        h.set_syndrome_raw(self.syndrome.to_byte());
        h.set_msn(self.msn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_ack_from_rxe() {
        // rxe ACKs carry syndrome 0x1F (no credits) and the MSN.
        let bytes = [0x1f, 0x00, 0x00, 0x05];
        let r = AethRepr::parse(&Aeth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(r, AethRepr { syndrome: AethSyndrome::ACK, msn: 5 });
        assert_eq!(r.syndrome.credits(), None);
        let mut out = [0u8; 4];
        r.emit(&mut Aeth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
    }

    #[test]
    fn every_syndrome_round_trips() {
        for s in 0u8..0x80 {
            let syn = AethSyndrome::from_byte(s).unwrap();
            assert_eq!(syn.to_byte(), s);
        }
        for s in 0x80u8..=0xFF {
            assert!(AethSyndrome::from_byte(s).is_err());
        }
    }

    #[test]
    fn nak_codes() {
        let cases = [
            (0x60, NakCode::PsnSequenceError),
            (0x61, NakCode::InvalidRequest),
            (0x62, NakCode::RemoteAccessError),
            (0x63, NakCode::RemoteOperationalError),
            (0x64, NakCode::InvalidRdRequest),
            (0x65, NakCode::Reserved(5)),
            (0x7F, NakCode::Reserved(31)),
        ];
        for (byte, code) in cases {
            assert_eq!(AethSyndrome::from_byte(byte).unwrap(), AethSyndrome::Nak(code));
        }
        assert_eq!(AethSyndrome::from_byte(0x45).unwrap(), AethSyndrome::Reserved(5));
    }

    #[test]
    fn credit_table() {
        let credits: Vec<Option<u16>> =
            (0..32).map(|c| AethSyndrome::Ack { credit_code: c }.credits()).collect();
        assert_eq!(credits[0], Some(0));
        assert_eq!(credits[5], Some(6));
        assert_eq!(credits[15], Some(192));
        assert_eq!(credits[16], Some(256));
        assert_eq!(credits[25], Some(6144));
        assert_eq!(credits[30], Some(32768));
        assert_eq!(credits[31], None);
        assert!(credits[..31].windows(2).all(|w| w[0] < w[1]));
        assert_eq!(credit_code_for(0), 0);
        assert_eq!(credit_code_for(7), 5);
        assert_eq!(credit_code_for(1 << 20), 30);
    }

    #[test]
    fn rnr_timer_table() {
        let syn = AethSyndrome::from_byte(0x20).unwrap();
        assert_eq!(syn, AethSyndrome::RnrNak { timer: 0 });
        assert_eq!(syn.rnr_wait_us(), Some(655_360), "code 0 is the longest wait");
        assert_eq!(rnr_timer_us(1), 10);
        assert_eq!(rnr_timer_us(12), 640);
        assert_eq!(rnr_timer_us(25), 61_440, "not rxe's 61410 typo");
        assert_eq!(rnr_timer_us(31), 491_520);
        assert!(RNR_TIMER_US[1..].windows(2).all(|w| w[0] < w[1]));
        assert_eq!(AethSyndrome::ACK.rnr_wait_us(), None);
    }

    #[test]
    fn msn_is_24_bits() {
        let mut out = [0u8; 4];
        AethRepr { syndrome: AethSyndrome::Nak(NakCode::InvalidRequest), msn: 0xFF12_3456 }
            .emit(&mut Aeth::new_unchecked(&mut out[..]));
        assert_eq!(out, [0x61, 0x12, 0x34, 0x56]);
    }
}
