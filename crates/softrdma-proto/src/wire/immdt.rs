//! Immediate data, 4 bytes, passed through opaque.
//!
//! `ibv_wc.imm_data` keeps network byte order, so the value is kept as the four wire bytes
//! read big-endian; a C ABI hands `value.to_be()` bytes back unchanged.

use super::{be, fixed_view, Result};

fixed_view!(
    /// A view of an ImmDt header.
    ImmDt,
    4,
    "ImmDt"
);

impl<T: AsRef<[u8]>> ImmDt<T> {
    /// The immediate value, read big-endian.
    pub fn value(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ImmDt<T> {
    /// Sets the immediate value, written big-endian.
    pub fn set_value(&mut self, v: u32) {
        be::put_u32(self.buffer.as_mut(), 0, v);
    }
}

/// The meaning of an ImmDt header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ImmDtRepr {
    /// The immediate value (big-endian on the wire).
    pub value: u32,
}

impl ImmDtRepr {
    /// Reads an ImmDt.
    pub fn parse<T: AsRef<[u8]>>(h: &ImmDt<T>) -> Result<ImmDtRepr> {
        Ok(ImmDtRepr { value: h.value() })
    }
    /// Writes an ImmDt.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut ImmDt<T>) {
        h.set_value(self.value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_bytes() {
        let bytes = [0x12, 0x34, 0x56, 0x78];
        let r = ImmDtRepr::parse(&ImmDt::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(r.value, 0x1234_5678);
        let mut out = [0u8; 4];
        r.emit(&mut ImmDt::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert!(ImmDt::new_checked(&bytes[..3]).is_err());
    }
}
