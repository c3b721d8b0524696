//! Datagram Extended Transport Header, 8 bytes: the Q_Key and source QP of a UD packet.

use super::{be, fixed_view, Result};
use crate::{Qkey, Qpn};

fixed_view!(
    /// A view of a DETH.
    Deth,
    8,
    "DETH"
);

impl<T: AsRef<[u8]>> Deth<T> {
    /// Queue key, checked against the receiving QP's.
    pub fn qkey(&self) -> Qkey {
        Qkey(be::u32_at(self.buffer.as_ref(), 0))
    }
    /// Source QP.
    pub fn src_qp(&self) -> Qpn {
        Qpn::new(be::u24_at(self.buffer.as_ref(), 5))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Deth<T> {
    /// Sets the Q_Key.
    pub fn set_qkey(&mut self, k: Qkey) {
        be::put_u32(self.buffer.as_mut(), 0, k.get());
    }
    /// Sets the source QP and clears the reserved byte before it.
    pub fn set_src_qp(&mut self, q: Qpn) {
        self.buffer.as_mut()[4] = 0;
        be::put_u24(self.buffer.as_mut(), 5, q.get());
    }
}

/// The meaning of a DETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DethRepr {
    /// Queue key.
    pub qkey: Qkey,
    /// Source QP.
    pub src_qp: Qpn,
}

impl DethRepr {
    /// Reads a DETH; the reserved byte is ignored.
    pub fn parse<T: AsRef<[u8]>>(h: &Deth<T>) -> Result<DethRepr> {
        Ok(DethRepr { qkey: h.qkey(), src_qp: h.src_qp() })
    }
    /// Writes a DETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Deth<T>) {
        h.set_qkey(self.qkey);
        h.set_src_qp(self.src_qp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_gsi_deth() {
        // Every CM MAD: Q_Key 0x80010000, source QP 1.
        let bytes = [0x80, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01];
        let r = DethRepr::parse(&Deth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(r, DethRepr { qkey: Qkey::GSI, src_qp: Qpn::GSI });
        let mut out = [0xFFu8; 8];
        r.emit(&mut Deth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert!(Deth::new_checked(&bytes[..7]).is_err());
    }
}
