//! Atomic ACK Extended Transport Header, 8 bytes: the value the target held before the
//! atomic operation.

use super::{be, fixed_view, Result};

fixed_view!(
    /// A view of an AtomicAckETH.
    AtomicAckEth,
    8,
    "AtomicAckETH"
);

impl<T: AsRef<[u8]>> AtomicAckEth<T> {
    /// The original value at the target.
    pub fn orig(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicAckEth<T> {
    /// Sets the original value.
    pub fn set_orig(&mut self, v: u64) {
        be::put_u64(self.buffer.as_mut(), 0, v);
    }
}

/// The meaning of an AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct AtomicAckEthRepr {
    /// The original value at the target.
    pub orig: u64,
}

impl AtomicAckEthRepr {
    /// Reads an AtomicAckETH.
    pub fn parse<T: AsRef<[u8]>>(h: &AtomicAckEth<T>) -> Result<AtomicAckEthRepr> {
        Ok(AtomicAckEthRepr { orig: h.orig() })
    }
    /// Writes an AtomicAckETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut AtomicAckEth<T>) {
        h.set_orig(self.orig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_bytes() {
        let bytes = [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x2c];
        let r = AtomicAckEthRepr::parse(&AtomicAckEth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(r.orig, 300);
        let mut out = [0xFFu8; 8];
        r.emit(&mut AtomicAckEth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert!(AtomicAckEth::new_checked(&bytes[..7]).is_err());
    }
}
