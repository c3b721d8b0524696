//! Atomic Extended Transport Header, 28 bytes: the target and operands of a CmpSwap or
//! FetchAdd.

use super::{be, fixed_view, Result};
use crate::Rkey;

fixed_view!(
    /// A view of an AtomicETH.
    AtomicEth,
    28,
    "AtomicETH"
);

impl<T: AsRef<[u8]>> AtomicEth<T> {
    /// Remote virtual address (must be 8-byte aligned to be executed).
    pub fn va(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), 0)
    }
    /// Remote key.
    pub fn rkey(&self) -> Rkey {
        Rkey(be::u32_at(self.buffer.as_ref(), 8))
    }
    /// Swap value (CmpSwap) or addend (FetchAdd).
    pub fn swap_add(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), 12)
    }
    /// Compare value (CmpSwap; rxe sends 0 for FetchAdd).
    pub fn compare(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), 20)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicEth<T> {
    /// Sets the virtual address.
    pub fn set_va(&mut self, v: u64) {
        be::put_u64(self.buffer.as_mut(), 0, v);
    }
    /// Sets the R_Key.
    pub fn set_rkey(&mut self, k: Rkey) {
        be::put_u32(self.buffer.as_mut(), 8, k.get());
    }
    /// Sets the swap value or addend.
    pub fn set_swap_add(&mut self, v: u64) {
        be::put_u64(self.buffer.as_mut(), 12, v);
    }
    /// Sets the compare value.
    pub fn set_compare(&mut self, v: u64) {
        be::put_u64(self.buffer.as_mut(), 20, v);
    }
}

/// The meaning of an AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct AtomicEthRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: Rkey,
    /// Swap value or addend.
    pub swap_add: u64,
    /// Compare value.
    pub compare: u64,
}

impl AtomicEthRepr {
    /// Reads an AtomicETH.
    pub fn parse<T: AsRef<[u8]>>(h: &AtomicEth<T>) -> Result<AtomicEthRepr> {
        Ok(AtomicEthRepr { va: h.va(), rkey: h.rkey(), swap_add: h.swap_add(), compare: h.compare() })
    }
    /// Writes an AtomicETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut AtomicEth<T>) {
        h.set_va(self.va);
        h.set_rkey(self.rkey);
        h.set_swap_add(self.swap_add);
        h.set_compare(self.compare);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_bytes() {
        let bytes: [u8; 28] = [
            0x00, 0x00, 0x55, 0x55, 0x12, 0x34, 0x50, 0x08, // VA
            0xde, 0xad, 0xbe, 0xef, // R_Key
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, // add 1
            0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // compare
        ];
        let r = AtomicEthRepr::parse(&AtomicEth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(
            r,
            AtomicEthRepr {
                va: 0x5555_1234_5008,
                rkey: Rkey(0xdead_beef),
                swap_add: 1,
                compare: 0x1122_3344_5566_7788
            }
        );
        let mut out = [0u8; 28];
        r.emit(&mut AtomicEth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert!(AtomicEth::new_checked(&bytes[..27]).is_err());
    }
}
