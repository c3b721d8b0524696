//! Invalidate Extended Transport Header, 4 bytes: the R_Key a SEND_WITH_INVALIDATE
//! invalidates at the responder.

use super::{be, fixed_view, Result};
use crate::Rkey;

fixed_view!(
    /// A view of an IETH.
    Ieth,
    4,
    "IETH"
);

impl<T: AsRef<[u8]>> Ieth<T> {
    /// The R_Key to invalidate.
    pub fn rkey(&self) -> Rkey {
        Rkey(be::u32_at(self.buffer.as_ref(), 0))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ieth<T> {
    /// Sets the R_Key to invalidate.
    pub fn set_rkey(&mut self, k: Rkey) {
        be::put_u32(self.buffer.as_mut(), 0, k.get());
    }
}

/// The meaning of an IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct IethRepr {
    /// The R_Key to invalidate.
    pub rkey: Rkey,
}

impl IethRepr {
    /// Reads an IETH.
    pub fn parse<T: AsRef<[u8]>>(h: &Ieth<T>) -> Result<IethRepr> {
        Ok(IethRepr { rkey: h.rkey() })
    }
    /// Writes an IETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Ieth<T>) {
        h.set_rkey(self.rkey);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_bytes() {
        let bytes = [0x00, 0x01, 0x02, 0x9a];
        let r = IethRepr::parse(&Ieth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(r.rkey, Rkey(0x0001_029a));
        let mut out = [0u8; 4];
        r.emit(&mut Ieth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert!(Ieth::new_checked(&bytes[..3]).is_err());
    }
}
