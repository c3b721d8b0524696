//! Flush Extended Transport Header, 4 bytes (IBTA 1.5 FLUSH): placement type and
//! selectivity.

use super::{be, fixed_view, Result};

fixed_view!(
    /// A view of a FETH.
    Feth,
    4,
    "FETH"
);

impl<T: AsRef<[u8]>> Feth<T> {
    /// The whole 32-bit word.
    pub fn raw(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Feth<T> {
    /// Sets the whole 32-bit word.
    pub fn set_raw(&mut self, v: u32) {
        be::put_u32(self.buffer.as_mut(), 0, v);
    }
}

/// The meaning of a FETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct FethRepr {
    /// Placement type, bits 3..0 (1 global visibility, 2 persistence).
    pub placement_type: u8,
    /// Selectivity level, bits 5..4 (0 memory range, 1 whole region).
    pub selectivity: u8,
}

impl FethRepr {
    /// Reads a FETH; reserved bits are ignored.
    pub fn parse<T: AsRef<[u8]>>(h: &Feth<T>) -> Result<FethRepr> {
        let v = h.raw();
        Ok(FethRepr { placement_type: (v & 0xF) as u8, selectivity: ((v >> 4) & 0x3) as u8 })
    }
    /// Writes a FETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Feth<T>) {
        h.set_raw(u32::from(self.placement_type & 0xF) | (u32::from(self.selectivity & 0x3) << 4));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_bytes() {
        let bytes = [0x00, 0x00, 0x00, 0x12];
        let r = FethRepr::parse(&Feth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(r, FethRepr { placement_type: 2, selectivity: 1 });
        let mut out = [0u8; 4];
        r.emit(&mut Feth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
    }
}
