//! Protection domains and memory regions.

use std::sync::Arc;

use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::Sge;
use softrdma_proto::{Lkey, Rkey};

use crate::context::{ContextInner, MAX_MR};
use crate::memory::MrInner;
use crate::{Error, Result};

/// A protection domain: memory and QPs of one domain can only reach each other.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    pub(crate) ctx: Arc<ContextInner>,
    pub(crate) id: PdId,
}

impl ProtectionDomain {
    pub(crate) fn new(ctx: Arc<ContextInner>, id: PdId) -> ProtectionDomain {
        ProtectionDomain { ctx, id }
    }

    /// Registers a new zeroed region of `len` bytes that the region owns.
    ///
    /// REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE, as with `ibv_reg_mr`.
    pub fn register(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        check_access(access)?;
        let mut core = self.ctx.shared.lock();
        if core.mem.len() >= MAX_MR as usize {
            return Err(Error::Limit("max_mr"));
        }
        let inner = core.mem.register(self.id, len, access);
        Ok(MemoryRegion { inner, pd: self.clone() })
    }

    /// Registers memory the caller owns (what `ibv_reg_mr` does), for the C ABI and for
    /// buffers that must stay where they are.
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + len)` must be valid for reads and writes from any thread until the
    /// returned region is dropped, and must not be accessed through Rust references while
    /// it is registered (the network may write it at any time the access flags allow; use
    /// raw pointers or volatile accesses). Dropping the region ends the registration.
    pub unsafe fn register_raw(&self, ptr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion> {
        check_access(access)?;
        if ptr.is_null() && len > 0 {
            return Err(Error::InvalidArgument("null address"));
        }
        let mut core = self.ctx.shared.lock();
        if core.mem.len() >= MAX_MR as usize {
            return Err(Error::Limit("max_mr"));
        }
        // SAFETY: forwarded from this function's contract.
        let inner = unsafe { core.mem.register_raw(self.id, ptr, len, access) };
        Ok(MemoryRegion { inner, pd: self.clone() })
    }

    /// Registers a region holding a copy of `data`.
    pub fn register_with(&self, data: &[u8], access: Access) -> Result<MemoryRegion> {
        let mr = self.register(data.len(), access)?;
        mr.write(0, data)?;
        Ok(mr)
    }
}

fn check_access(access: Access) -> Result<()> {
    let remote_write = Access::REMOTE_WRITE.bits() | Access::REMOTE_ATOMIC.bits();
    if access.bits() & remote_write != 0 && !access.contains(Access::LOCAL_WRITE) {
        return Err(Error::InvalidArgument("remote write or atomic access needs local write"));
    }
    if access.bits() & !0x0F != 0 {
        return Err(Error::InvalidArgument("unknown access flags"));
    }
    Ok(())
}

/// A registered memory region (`ibv_mr`): bytes it owns, or a caller's range registered
/// with [`ProtectionDomain::register_raw`].
///
/// The bytes are shared with the network: a peer may write them at any time the access
/// flags allow. They are therefore never lent out as `&[u8]`; [`Self::read`] and
/// [`Self::write`] copy with atomic word accesses, so concurrent network writes can give
/// torn values but never undefined behaviour. Dropping the region deregisters it at once:
/// work requests still using it fail with a protection error, and the memory is freed
/// only after the engine can no longer touch it.
#[derive(Debug)]
pub struct MemoryRegion {
    inner: Arc<MrInner>,
    pd: ProtectionDomain,
}

/// What a peer needs to reach a region: its address, length and R_Key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RemoteRegion {
    /// First address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl MemoryRegion {
    /// The region's first address (its real virtual address, as verbs has it).
    pub fn addr(&self) -> u64 {
        self.inner.addr()
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len() == 0
    }
    /// Local key.
    pub fn lkey(&self) -> Lkey {
        self.inner.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> Rkey {
        self.inner.rkey
    }
    /// Access rights.
    pub fn access(&self) -> Access {
        self.inner.access
    }
    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    fn range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.inner.len() => Ok(()),
            _ => Err(Error::InvalidArgument("range outside the memory region")),
        }
    }

    /// Copies bytes out of the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.range(offset, out.len())?;
        self.inner.read(offset, out);
        Ok(())
    }

    /// Copies bytes into the region.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.range(offset, data.len())?;
        self.inner.write(offset, data);
        Ok(())
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.inner.len()];
        self.inner.read(0, &mut v);
        v
    }

    /// The scatter/gather entry for `len` bytes at `offset`.
    pub fn sge(&self, offset: usize, len: usize) -> Result<Sge> {
        self.range(offset, len)?;
        let length = u32::try_from(len).map_err(|_| Error::InvalidArgument("SGE longer than 4 GiB"))?;
        Ok(Sge { addr: self.addr() + offset as u64, length, lkey: self.lkey() })
    }

    /// The description a peer needs for RDMA to this region.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion { addr: self.addr(), len: self.len() as u64, rkey: self.rkey().0 }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        self.pd.ctx.shared.lock().mem.deregister(self.inner.lkey);
    }
}
