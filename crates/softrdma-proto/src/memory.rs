//! The narrow interface through which the transport reaches registered memory.
//!
//! Queue pairs never hold a pointer or a slice of user memory. Every access names a region
//! by key and an address range, and the implementation checks the key, the protection
//! domain, the access rights and the bounds before it copies a byte. The runtime implements
//! this over real registered buffers (with the volatile-copy contract remote-writable memory
//! needs); the simulator implements it over plain vectors.

use core::fmt;
use core::ops::BitOr;

use crate::{Lkey, Rkey};

/// Access rights of a memory region (`ibv_access_flags`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No rights beyond local read, which every region has.
    pub const NONE: Access = Access(0);
    /// The local HCA may write: receive buffers, READ destinations, atomic results.
    pub const LOCAL_WRITE: Access = Access(0x01);
    /// Peers may RDMA WRITE.
    pub const REMOTE_WRITE: Access = Access(0x02);
    /// Peers may RDMA READ.
    pub const REMOTE_READ: Access = Access(0x04);
    /// Peers may run atomics.
    pub const REMOTE_ATOMIC: Access = Access(0x08);

    /// The raw `ibv_access_flags` bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// From raw bits; unknown bits are kept.
    pub const fn from_bits(bits: u32) -> Access {
        Access(bits)
    }
    /// Whether every right in `other` is in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names =
            [(0x01, "LOCAL_WRITE"), (0x02, "REMOTE_WRITE"), (0x04, "REMOTE_READ"), (0x08, "REMOTE_ATOMIC")];
        let set: Vec<&str> = names.iter().filter(|(b, _)| self.0 & b != 0).map(|(_, n)| *n).collect();
        write!(f, "Access({})", if set.is_empty() { "NONE".to_string() } else { set.join("|") })
    }
}

/// A protection domain, by number. Keys only work within their own domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct PdId(pub u32);

/// A key naming a region: an lkey in local work requests, an rkey in remote ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKey {
    /// Local key, from a scatter/gather entry.
    Local(Lkey),
    /// Remote key, from a RETH or AtomicETH.
    Remote(Rkey),
}

impl MemKey {
    /// The right reading through this key takes: none for a local key (the owner reads
    /// its own memory), REMOTE_READ for a remote one (the responder of an RDMA READ).
    pub fn read_access(self) -> Access {
        match self {
            MemKey::Local(_) => Access::NONE,
            MemKey::Remote(_) => Access::REMOTE_READ,
        }
    }

    /// The right an atomic through this key takes: LOCAL_WRITE for a local key (the
    /// requester stores the old value), REMOTE_ATOMIC for a remote one.
    pub fn atomic_access(self) -> Access {
        match self {
            MemKey::Local(_) => Access::LOCAL_WRITE,
            MemKey::Remote(_) => Access::REMOTE_ATOMIC,
        }
    }
}

/// Why an access was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MemError {
    /// No region has this key (never had, or deregistered).
    #[error("no memory region with this key")]
    BadKey,
    /// The region belongs to another protection domain.
    #[error("memory region belongs to another protection domain")]
    WrongPd,
    /// The region does not grant the access asked for.
    #[error("memory region does not grant this access")]
    NoAccess,
    /// The range is not inside the region.
    #[error("range outside the memory region")]
    OutOfBounds,
    /// An atomic target is not 8-byte aligned.
    #[error("atomic target not 8-byte aligned")]
    Misaligned,
}

/// An atomic operation on one native-endian u64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AtomicOp {
    /// If the value equals `compare`, store `swap`.
    CompareSwap {
        /// Value expected at the target.
        compare: u64,
        /// Value stored on a match.
        swap: u64,
    },
    /// Add `add`, wrapping.
    FetchAdd {
        /// Addend.
        add: u64,
    },
}

impl AtomicOp {
    /// The value the operation leaves where `old` was.
    pub fn apply(self, old: u64) -> u64 {
        match self {
            AtomicOp::CompareSwap { compare, swap } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
            AtomicOp::FetchAdd { add } => old.wrapping_add(add),
        }
    }
}

/// A contiguous range of registered memory: what a packet's payload is gathered from or
/// scattered to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    /// The region.
    pub key: MemKey,
    /// Start address (in the region's address space).
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
}

/// The segments of a packet's payload. Nearly every packet has one (a work request with
/// one scatter/gather entry, a READ response), kept inline: building and sending a packet
/// allocates nothing; more go to the heap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Segments {
    /// No payload.
    #[default]
    Empty,
    /// One segment.
    One(Segment),
    /// Two or more.
    Many(Vec<Segment>),
}

impl Segments {
    /// Appends `seg`.
    #[inline]
    pub fn push(&mut self, seg: Segment) {
        match self {
            Segments::Empty => *self = Segments::One(seg),
            Segments::One(first) => *self = Segments::Many(vec![*first, seg]),
            Segments::Many(v) => v.push(seg),
        }
    }

    /// The segments, in order.
    pub fn as_slice(&self) -> &[Segment] {
        match self {
            Segments::Empty => &[],
            Segments::One(seg) => std::slice::from_ref(seg),
            Segments::Many(v) => v,
        }
    }
}

impl std::ops::Deref for Segments {
    type Target = [Segment];
    fn deref(&self) -> &[Segment] {
        self.as_slice()
    }
}

impl<'a> IntoIterator for &'a Segments {
    type Item = &'a Segment;
    type IntoIter = std::slice::Iter<'a, Segment>;
    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// Registered memory as the transport sees it.
///
/// Every method validates the key against `pd`, the rights and the bounds itself; a
/// failure leaves memory untouched. `len == 0` ranges are always valid for a valid key.
pub trait Memory {
    /// Checks that `[addr, addr + len)` is inside the region `key` of domain `pd` and that
    /// the region grants `access`.
    fn check(&self, pd: PdId, key: MemKey, addr: u64, len: u64, access: Access) -> Result<(), MemError>;

    /// Calls `f` with the bytes of `seg`, in order, in one or more pieces (the ICRC and the
    /// gather of a send read memory this way, without copying it out first).
    fn gather(&self, pd: PdId, seg: &Segment, f: &mut dyn FnMut(&[u8])) -> Result<(), MemError>;

    /// Copies the bytes of `seg` into `dst`, which is `seg.len` bytes long (a packet built
    /// whole in one buffer). The default goes through [`Memory::gather`]; a memory that can
    /// copy straight into `dst` saves a copy.
    fn copy_out(&self, pd: PdId, seg: &Segment, dst: &mut [u8]) -> Result<(), MemError> {
        let mut at = 0;
        self.gather(pd, seg, &mut |b| {
            let n = b.len().min(dst.len() - at);
            dst[at..at + n].copy_from_slice(&b[..n]);
            at += n;
        })
    }

    /// Copies `data` to `addr` in region `key`, which must grant `access`.
    fn write(
        &mut self,
        pd: PdId,
        key: MemKey,
        addr: u64,
        data: &[u8],
        access: Access,
    ) -> Result<(), MemError>;

    /// Runs an atomic on the 8-byte-aligned u64 at `addr` and returns the previous value.
    fn atomic(&mut self, pd: PdId, key: MemKey, addr: u64, op: AtomicOp) -> Result<u64, MemError>;

    /// Invalidates the remote key `rkey` of domain `pd` (SEND_WITH_INVALIDATE): from now on
    /// it names nothing.
    fn invalidate(&mut self, pd: PdId, rkey: Rkey) -> Result<(), MemError>;
}

/// Reads a segment into a vector (tests and small copies).
pub fn read_segment<M: Memory + ?Sized>(mem: &M, pd: PdId, seg: &Segment) -> Result<Vec<u8>, MemError> {
    let mut v = Vec::with_capacity(seg.len as usize);
    mem.gather(pd, seg, &mut |b| v.extend_from_slice(b))?;
    Ok(v)
}
