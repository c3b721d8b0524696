//! RDMA Extended Transport Header, 16 bytes: the remote address of a WRITE, READ or FLUSH.

use super::{be, fixed_view, Result};
use crate::Rkey;

fixed_view!(
    /// A view of a RETH.
    Reth,
    16,
    "RETH"
);

impl<T: AsRef<[u8]>> Reth<T> {
    /// Remote virtual address.
    pub fn va(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), 0)
    }
    /// Remote key of the target region.
    pub fn rkey(&self) -> Rkey {
        Rkey(be::u32_at(self.buffer.as_ref(), 8))
    }
    /// Total length of the whole message in bytes (not of this packet).
    pub fn dma_len(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), 12)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Reth<T> {
    /// Sets the virtual address.
    pub fn set_va(&mut self, va: u64) {
        be::put_u64(self.buffer.as_mut(), 0, va);
    }
    /// Sets the R_Key.
    pub fn set_rkey(&mut self, rkey: Rkey) {
        be::put_u32(self.buffer.as_mut(), 8, rkey.get());
    }
    /// Sets the DMA length.
    pub fn set_dma_len(&mut self, len: u32) {
        be::put_u32(self.buffer.as_mut(), 12, len);
    }
}

/// The meaning of a RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct RethRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: Rkey,
    /// Total message length.
    pub dma_len: u32,
}

impl RethRepr {
    /// Reads a RETH.
    pub fn parse<T: AsRef<[u8]>>(h: &Reth<T>) -> Result<RethRepr> {
        Ok(RethRepr { va: h.va(), rkey: h.rkey(), dma_len: h.dma_len() })
    }
    /// Writes a RETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Reth<T>) {
        h.set_va(self.va);
        h.set_rkey(self.rkey);
        h.set_dma_len(self.dma_len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOLDEN: [u8; 16] = [
        0x00, 0x00, 0x7f, 0x12, 0x34, 0x56, 0x78, 0x00, // VA
        0x00, 0x00, 0x12, 0x9a, // R_Key
        0x00, 0x00, 0x27, 0x10, // 10000 bytes
    ];

    #[test]
    fn golden_bytes() {
        let r = RethRepr::parse(&Reth::new_checked(&GOLDEN[..]).unwrap()).unwrap();
        assert_eq!(r, RethRepr { va: 0x7f12_3456_7800, rkey: Rkey(0x129a), dma_len: 10000 });
        let mut out = [0u8; 16];
        r.emit(&mut Reth::new_unchecked(&mut out[..]));
        assert_eq!(out, GOLDEN);
        assert!(Reth::new_checked(&GOLDEN[..15]).is_err());
    }
}
