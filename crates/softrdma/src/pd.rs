//! Protection domains and memory regions.

use std::sync::Arc;

use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::Sge;
use softrdma_proto::{Lkey, Rkey};

use crate::device::{ContextInner, MAX_MR};
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
        let access = check_access(access)?;
        let inner = self.ctx.engine.register(self.id, len, access, MAX_MR as usize)?;
        Ok(self.adopted(inner))
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
        let access = check_access(access)?;
        if ptr.is_null() && len > 0 {
            return Err(Error::InvalidArgument("null address"));
        }
        // SAFETY: forwarded from this function's contract.
        let inner = unsafe { self.ctx.engine.register_raw(self.id, ptr, len, access, MAX_MR as usize)? };
        Ok(self.adopted(inner))
    }

    /// A region shard 0 registered, entered in the device's other shards under the same
    /// keys (their QPs reach it as shard 0's do).
    fn adopted(&self, inner: Arc<MrInner>) -> MemoryRegion {
        for e in self.ctx.shards.iter().skip(1) {
            e.adopt(&inner);
        }
        MemoryRegion { inner, pd: self.clone() }
    }

    /// Registers a region holding a copy of `data`.
    pub fn register_with(&self, data: &[u8], access: Access) -> Result<MemoryRegion> {
        let mr = self.register(data.len(), access)?;
        mr.write(0, data)?;
        Ok(mr)
    }
}

/// Every `ibv_access_flags` bit rdma-core 44 defines, with what softrdma does with it.
const ACCESS_FLAGS: [(u32, &str, AccessSupport); 11] = [
    (1 << 0, "IBV_ACCESS_LOCAL_WRITE", AccessSupport::Honoured),
    (1 << 1, "IBV_ACCESS_REMOTE_WRITE", AccessSupport::Honoured),
    (1 << 2, "IBV_ACCESS_REMOTE_READ", AccessSupport::Honoured),
    (1 << 3, "IBV_ACCESS_REMOTE_ATOMIC", AccessSupport::Honoured),
    (1 << 4, "IBV_ACCESS_MW_BIND", AccessSupport::Refused),
    (1 << 5, "IBV_ACCESS_ZERO_BASED", AccessSupport::Refused),
    // Nothing is pinned: every region already behaves as on-demand paging promises.
    (1 << 6, "IBV_ACCESS_ON_DEMAND", AccessSupport::Satisfied),
    // A hint about the pages behind the range; nothing to do.
    (1 << 7, "IBV_ACCESS_HUGETLB", AccessSupport::Satisfied),
    (1 << 8, "IBV_ACCESS_FLUSH_GLOBAL", AccessSupport::Refused),
    (1 << 9, "IBV_ACCESS_FLUSH_PERSISTENT", AccessSupport::Refused),
    // The first optional flag: softrdma writes in order anyway.
    (1 << 20, "IBV_ACCESS_RELAXED_ORDERING", AccessSupport::Satisfied),
];

/// `IBV_ACCESS_OPTIONAL_RANGE`: flags a provider may ignore (bits 20 to 29).
const ACCESS_OPTIONAL_RANGE: u32 = 0x3FF0_0000;

#[derive(Clone, Copy, PartialEq, Eq)]
enum AccessSupport {
    /// Implemented.
    Honoured,
    /// Accepted: softrdma already behaves as the flag asks.
    Satisfied,
    /// Defined by verbs but not implemented: refused with an error naming it.
    Refused,
}

/// Checks a region's access flags as `ibv_reg_mr` does and returns the rights softrdma
/// acts on: every bit rdma-core defines is recognised, optional ones are ignored,
/// unimplemented ones are refused by name, unknown ones are refused; REMOTE_WRITE and
/// REMOTE_ATOMIC need LOCAL_WRITE.
pub(crate) fn check_access(access: Access) -> Result<Access> {
    let rights = check_access_bits(access)?;
    let remote_write = Access::REMOTE_WRITE.bits() | Access::REMOTE_ATOMIC.bits();
    if rights.bits() & remote_write != 0 && !access.contains(Access::LOCAL_WRITE) {
        return Err(Error::InvalidArgument("remote write or atomic access needs local write"));
    }
    Ok(rights)
}

/// Checks the bits of access flags (a QP's, or a region's) and returns the rights
/// softrdma acts on.
pub(crate) fn check_access_bits(access: Access) -> Result<Access> {
    let bits = access.bits();
    for (bit, name, support) in ACCESS_FLAGS {
        if bits & bit != 0 && support == AccessSupport::Refused {
            return Err(Error::UnsupportedAccess(name));
        }
    }
    let known = ACCESS_FLAGS.iter().fold(ACCESS_OPTIONAL_RANGE, |m, (b, _, _)| m | b);
    if bits & !known != 0 {
        return Err(Error::InvalidArgument("unknown access flags"));
    }
    Ok(Access::from_bits(bits & 0x0F))
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
        // Every shard forgets it before the drop returns: no engine reaches it after.
        for e in &self.pd.ctx.shards {
            e.deregister(self.inner.lkey);
        }
    }
}
