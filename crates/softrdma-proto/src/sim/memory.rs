//! Registered memory for the simulator: regions backed by plain vectors.
//!
//! [`SimMemory`] implements [`Memory`] with the same checks a real HCA makes (key,
//! protection domain, access rights, bounds, atomic alignment) so that simulated queue
//! pairs hit the same errors they would against the runtime's registered buffers. Keys are
//! drawn from a seeded [`Rng`]: unpredictable like real ones, yet reproducible.
//!
//! This module owns the regions, their keys and a log of successful writes that tests use
//! to see exactly what the transport touched. It does no I/O and never panics on any
//! address, length or key.

use core::fmt;
use std::collections::BTreeMap;

use super::rng::Rng;
use crate::memory::{Access, AtomicOp, MemError, MemKey, Memory, PdId, Segment};
use crate::{Lkey, Rkey};

/// Why [`SimMemory::register`] refused a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// REMOTE_WRITE or REMOTE_ATOMIC without LOCAL_WRITE (`ibv_reg_mr` returns `EINVAL`).
    #[error("remote write or atomic access requires local write access")]
    RemoteWriteWithoutLocalWrite,
    /// `addr + len` does not fit in the 64-bit address space.
    #[error("region end overflows the address space")]
    AddressOverflow,
}

/// One record of the write log: the region's lkey, the start address and the length of a
/// successful [`Memory::write`] or [`Memory::atomic`] (8 bytes).
pub type WriteRecord = (Lkey, u64, usize);

/// A fault [`SimMemory`] can be told to commit once (see [`SimMemory::inject`]), so that
/// tests can show that the workload checker sees it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemFault {
    /// A FetchAdd is executed twice (returning the first result).
    FetchAddTwice,
    /// A write also changes the byte before its start.
    WriteOutside,
    /// A write has its last byte flipped (as if corrupted after the ICRC check).
    CorruptPayload,
}

/// A registered region.
#[derive(Debug)]
struct Region {
    pd: PdId,
    addr: u64,
    access: Access,
    rkey: Rkey,
    bytes: Vec<u8>,
}

impl Region {
    /// The offset of `[addr, addr + len)` within the region, or `OutOfBounds`. Ranges of
    /// length 0 are accepted anywhere.
    fn offset(&self, addr: u64, len: u64) -> Result<usize, MemError> {
        if len == 0 {
            return Ok(0);
        }
        let offset = addr.checked_sub(self.addr).ok_or(MemError::OutOfBounds)?;
        let end = offset.checked_add(len).ok_or(MemError::OutOfBounds)?;
        if end > self.bytes.len() as u64 {
            return Err(MemError::OutOfBounds);
        }
        Ok(offset as usize)
    }
}

/// Simulated registered memory: regions of zero-filled vectors addressed by virtual
/// address, named by random lkeys and rkeys.
pub struct SimMemory {
    rng: Rng,
    /// Regions by lkey.
    regions: BTreeMap<u32, Region>,
    /// Lkey of each region by rkey.
    by_rkey: BTreeMap<u32, u32>,
    writes: Vec<WriteRecord>,
    /// The fault to commit, and how many more candidates to let pass first.
    fault: Option<(MemFault, u32)>,
}

impl fmt::Debug for SimMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The region contents would drown everything else.
        let regions: Vec<_> = self
            .regions
            .iter()
            .map(|(&lkey, r)| (Lkey(lkey), r.rkey, r.pd, r.addr, r.bytes.len(), r.access))
            .collect();
        f.debug_struct("SimMemory").field("regions", &regions).field("writes", &self.writes.len()).finish()
    }
}

impl SimMemory {
    /// Empty memory whose keys are drawn from a generator seeded with `seed`.
    pub fn new(seed: u64) -> SimMemory {
        SimMemory {
            rng: Rng::new(seed),
            regions: BTreeMap::new(),
            by_rkey: BTreeMap::new(),
            writes: Vec::new(),
            fault: None,
        }
    }

    /// Registers a zero-filled region covering virtual addresses `[addr, addr + len)` in
    /// domain `pd` and returns its keys: random, nonzero, distinct from each other and from
    /// every key of a region still registered.
    pub fn register(
        &mut self,
        pd: PdId,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<(Lkey, Rkey), RegisterError> {
        let needs_local_write = Access::REMOTE_WRITE.bits() | Access::REMOTE_ATOMIC.bits();
        if access.bits() & needs_local_write != 0 && !access.contains(Access::LOCAL_WRITE) {
            return Err(RegisterError::RemoteWriteWithoutLocalWrite);
        }
        addr.checked_add(len as u64).ok_or(RegisterError::AddressOverflow)?;
        let lkey = self.fresh_key(None);
        let rkey = self.fresh_key(Some(lkey));
        self.regions.insert(lkey, Region { pd, addr, access, rkey: Rkey(rkey), bytes: vec![0; len] });
        self.by_rkey.insert(rkey, lkey);
        Ok((Lkey(lkey), Rkey(rkey)))
    }

    /// A random key that is nonzero, not `other` and not in use as an lkey or an rkey.
    fn fresh_key(&mut self, other: Option<u32>) -> u32 {
        loop {
            let key = self.rng.next_u32();
            if key != 0
                && Some(key) != other
                && !self.regions.contains_key(&key)
                && !self.by_rkey.contains_key(&key)
            {
                return key;
            }
        }
    }

    /// Deregisters the region of `lkey`; its lkey and rkey stop working at once. Returns
    /// whether such a region existed.
    pub fn deregister(&mut self, lkey: Lkey) -> bool {
        match self.regions.remove(&lkey.0) {
            Some(region) => {
                self.by_rkey.remove(&region.rkey.0);
                true
            }
            None => false,
        }
    }

    /// The contents of the region of `lkey`, for tests to inspect.
    pub fn bytes(&self, lkey: Lkey) -> Option<&[u8]> {
        self.regions.get(&lkey.0).map(|r| r.bytes.as_slice())
    }

    /// The contents of the region of `lkey`, for tests to fill. Writes made this way are not
    /// logged.
    pub fn bytes_mut(&mut self, lkey: Lkey) -> Option<&mut [u8]> {
        self.regions.get_mut(&lkey.0).map(|r| r.bytes.as_mut_slice())
    }

    /// The start address of the region of `lkey`.
    pub fn region_addr(&self, lkey: Lkey) -> Option<u64> {
        self.regions.get(&lkey.0).map(|r| r.addr)
    }

    /// Every successful [`Memory::write`] and [`Memory::atomic`] since the last
    /// [`clear_write_log`](SimMemory::clear_write_log), oldest first.
    pub fn writes(&self) -> &[WriteRecord] {
        &self.writes
    }

    /// Empties the write log.
    pub fn clear_write_log(&mut self) {
        self.writes.clear();
    }

    /// The lkey of the region `key` names.
    fn lkey_of(&self, key: MemKey) -> Result<u32, MemError> {
        match key {
            MemKey::Local(lkey) if self.regions.contains_key(&lkey.0) => Ok(lkey.0),
            MemKey::Remote(rkey) => self.by_rkey.get(&rkey.0).copied().ok_or(MemError::BadKey),
            MemKey::Local(_) => Err(MemError::BadKey),
        }
    }

    /// Checks key, domain, rights and bounds; returns the region's lkey and the offset.
    fn resolve(
        &self,
        pd: PdId,
        key: MemKey,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<(u32, usize), MemError> {
        let lkey = self.lkey_of(key)?;
        let region = &self.regions[&lkey];
        if region.pd != pd {
            return Err(MemError::WrongPd);
        }
        if !region.access.contains(access) {
            return Err(MemError::NoAccess);
        }
        Ok((lkey, region.offset(addr, len)?))
    }

    /// Region for an lkey returned by `resolve`.
    fn region_mut(&mut self, lkey: u32) -> &mut Region {
        self.regions.get_mut(&lkey).expect("resolve returned a registered lkey")
    }
}

impl SimMemory {
    /// Commits `fault` once, on its `nth` occasion (1: the first FetchAdd or non-empty
    /// write from now on). For tests of the checkers only.
    #[doc(hidden)]
    pub fn inject(&mut self, fault: MemFault, nth: u32) {
        self.fault = Some((fault, nth.max(1)));
    }

    /// Whether the injected fault is `kind` and this occasion is its turn.
    fn fires(&mut self, kind: MemFault) -> bool {
        match self.fault {
            Some((f, n)) if f == kind => {
                self.fault = if n <= 1 { None } else { Some((f, n - 1)) };
                n <= 1
            }
            _ => false,
        }
    }

    /// After a successful write of `data` at `offset` of region `lkey`: the injected
    /// write faults.
    fn commit_write_fault(&mut self, lkey: u32, offset: usize, addr: u64, data: &[u8]) {
        if offset > 0 && self.fires(MemFault::WriteOutside) {
            self.region_mut(lkey).bytes[offset - 1] ^= 0xFF;
            self.writes.push((Lkey(lkey), addr - 1, 1));
        }
        if self.fires(MemFault::CorruptPayload) {
            self.region_mut(lkey).bytes[offset + data.len() - 1] ^= 0x01;
        }
    }
}

impl Memory for SimMemory {
    /// Local read needs no right (`Access::NONE` only validates key and domain). Bounds are
    /// not checked for `len == 0`.
    fn check(&self, pd: PdId, key: MemKey, addr: u64, len: u64, access: Access) -> Result<(), MemError> {
        self.resolve(pd, key, addr, len, access).map(|_| ())
    }

    /// Calls `f` once with the whole segment. A remote key needs REMOTE_READ (the responder
    /// of an RDMA READ); a local key needs no right.
    fn gather(&self, pd: PdId, seg: &Segment, f: &mut dyn FnMut(&[u8])) -> Result<(), MemError> {
        let len = u64::from(seg.len);
        let (lkey, offset) = self.resolve(pd, seg.key, seg.addr, len, seg.key.read_access())?;
        let bytes = &self.regions[&lkey].bytes;
        f(bytes.get(offset..offset + seg.len as usize).unwrap_or(&[]));
        Ok(())
    }

    fn write(
        &mut self,
        pd: PdId,
        key: MemKey,
        addr: u64,
        data: &[u8],
        access: Access,
    ) -> Result<(), MemError> {
        let (lkey, offset) = self.resolve(pd, key, addr, data.len() as u64, access)?;
        if !data.is_empty() {
            self.region_mut(lkey).bytes[offset..offset + data.len()].copy_from_slice(data);
        }
        self.writes.push((Lkey(lkey), addr, data.len()));
        if self.fault.is_some() && !data.is_empty() {
            self.commit_write_fault(lkey, offset, addr, data);
        }
        Ok(())
    }

    /// Checks, in order: key, domain, rights (REMOTE_ATOMIC for a remote key, LOCAL_WRITE
    /// for a local one), 8-byte alignment, bounds.
    fn atomic(&mut self, pd: PdId, key: MemKey, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        let access = key.atomic_access();
        // Key, domain and rights first: a bad key must not leak alignment information.
        self.resolve(pd, key, addr, 0, access)?;
        if addr & 7 != 0 {
            return Err(MemError::Misaligned);
        }
        let (lkey, offset) = self.resolve(pd, key, addr, 8, access)?;
        let target = &mut self.region_mut(lkey).bytes[offset..offset + 8];
        let old = u64::from_ne_bytes(target.try_into().expect("8-byte range"));
        target.copy_from_slice(&op.apply(old).to_ne_bytes());
        self.writes.push((Lkey(lkey), addr, 8));
        if matches!(op, AtomicOp::FetchAdd { .. }) && self.fires(MemFault::FetchAddTwice) {
            let target = &mut self.region_mut(lkey).bytes[offset..offset + 8];
            let now = u64::from_ne_bytes(target.try_into().expect("8-byte range"));
            target.copy_from_slice(&op.apply(now).to_ne_bytes());
        }
        Ok(old)
    }

    /// Invalidating a memory region's rkey frees the region: both keys die at once.
    fn invalidate(&mut self, pd: PdId, rkey: Rkey) -> Result<(), MemError> {
        let (lkey, _) = self.resolve(pd, MemKey::Remote(rkey), 0, 0, Access::NONE)?;
        self.deregister(Lkey(lkey));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::read_segment;

    const PD: PdId = PdId(1);
    const BASE: u64 = 0x1000;
    const ALL: Access = Access::from_bits(0x0F);

    fn mem_with(access: Access) -> (SimMemory, Lkey, Rkey) {
        let mut m = SimMemory::new(1);
        let (l, r) = m.register(PD, BASE, 64, access).unwrap();
        m.bytes_mut(l).unwrap().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        (m, l, r)
    }

    fn snapshot(m: &SimMemory, l: Lkey) -> Vec<u8> {
        m.bytes(l).unwrap().to_vec()
    }

    #[test]
    fn keys_are_random_distinct_and_nonzero() {
        let mut m = SimMemory::new(99);
        let mut keys = Vec::new();
        for i in 0..32 {
            let (l, r) = m.register(PD, i * 0x1000, 16, Access::NONE).unwrap();
            assert_ne!(l.0, 0);
            assert_ne!(r.0, 0);
            assert_ne!(l.0, r.0);
            keys.push(l.0);
            keys.push(r.0);
        }
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), keys.len(), "keys repeat");
        // Not a counter: consecutive keys are far apart.
        let close = keys.windows(2).filter(|w| w[0].abs_diff(w[1]) < 256).count();
        assert_eq!(close, 0, "{keys:x?}");
        // Same seed, same keys.
        let mut again = SimMemory::new(99);
        assert_eq!(again.register(PD, 0, 16, Access::NONE).unwrap(), (Lkey(keys[0]), Rkey(keys[1])));
    }

    #[test]
    fn register_validates_access_and_range() {
        let mut m = SimMemory::new(1);
        assert_eq!(
            m.register(PD, 0, 8, Access::REMOTE_WRITE),
            Err(RegisterError::RemoteWriteWithoutLocalWrite)
        );
        assert_eq!(
            m.register(PD, 0, 8, Access::REMOTE_ATOMIC | Access::REMOTE_READ),
            Err(RegisterError::RemoteWriteWithoutLocalWrite)
        );
        assert!(m.register(PD, 0, 8, Access::REMOTE_READ).is_ok());
        assert_eq!(m.register(PD, u64::MAX - 3, 8, ALL), Err(RegisterError::AddressOverflow));
        let (l, _) = m.register(PD, u64::MAX - 8, 8, ALL).unwrap();
        assert_eq!(m.region_addr(l), Some(u64::MAX - 8));
        assert_eq!(m.bytes(l), Some(&[0u8; 8][..]));
    }

    #[test]
    fn read_write_roundtrip_and_log() {
        let (mut m, l, r) = mem_with(ALL);
        m.write(PD, MemKey::Remote(r), BASE + 4, &[0xAA; 4], Access::REMOTE_WRITE).unwrap();
        m.write(PD, MemKey::Local(l), BASE + 60, &[0xBB; 4], Access::LOCAL_WRITE).unwrap();
        let seg = Segment { key: MemKey::Remote(r), addr: BASE + 2, len: 8 };
        assert_eq!(read_segment(&m, PD, &seg).unwrap(), [2, 3, 0xAA, 0xAA, 0xAA, 0xAA, 8, 9]);
        assert_eq!(m.writes(), &[(l, BASE + 4, 4), (l, BASE + 60, 4)]);
        m.clear_write_log();
        assert!(m.writes().is_empty());
        // Whole region, and zero-length ranges anywhere.
        assert!(m.check(PD, MemKey::Local(l), BASE, 64, Access::NONE).is_ok());
        assert!(m.check(PD, MemKey::Local(l), u64::MAX, 0, Access::NONE).is_ok());
        let empty = Segment { key: MemKey::Local(l), addr: 0, len: 0 };
        assert_eq!(read_segment(&m, PD, &empty).unwrap(), []);
    }

    #[test]
    fn refused_accesses_leave_memory_untouched() {
        let (mut m, l, r) = mem_with(Access::LOCAL_WRITE | Access::REMOTE_READ);
        let (other, _) = m.register(PD, BASE, 64, ALL).unwrap();
        m.deregister(other);
        let before = snapshot(&m, l);
        let data = [0xEE; 8];
        let lw = Access::LOCAL_WRITE;
        let cases: [(PdId, MemKey, u64, usize, Access, MemError); 10] = [
            (PdId(2), MemKey::Local(l), BASE, 8, lw, MemError::WrongPd),
            (PD, MemKey::Local(other), BASE, 8, lw, MemError::BadKey),
            (PD, MemKey::Remote(Rkey(l.0)), BASE, 8, lw, MemError::BadKey),
            (PD, MemKey::Remote(r), BASE, 8, Access::REMOTE_WRITE, MemError::NoAccess),
            (PD, MemKey::Local(l), BASE + 60, 8, lw, MemError::OutOfBounds),
            (PD, MemKey::Local(l), BASE - 1, 8, lw, MemError::OutOfBounds),
            (PD, MemKey::Local(l), u64::MAX, 8, lw, MemError::OutOfBounds),
            (PD, MemKey::Local(l), u64::MAX - 3, 8, lw, MemError::OutOfBounds),
            (PD, MemKey::Local(l), 0, 8, lw, MemError::OutOfBounds),
            (PdId(2), MemKey::Local(l), BASE, 0, lw, MemError::WrongPd),
        ];
        for (pd, key, addr, len, access, err) in cases {
            assert_eq!(m.check(pd, key, addr, len as u64, access), Err(err), "{key:?} {addr:#x}");
            assert_eq!(m.write(pd, key, addr, &data[..len], access), Err(err), "{key:?} {addr:#x}");
        }
        assert_eq!(m.check(PD, MemKey::Local(l), BASE, u64::MAX, Access::NONE), Err(MemError::OutOfBounds));
        // Remote keys need REMOTE_READ to gather; this region has it, a write-only one not.
        let seg = Segment { key: MemKey::Remote(r), addr: BASE + 64, len: 1 };
        assert_eq!(read_segment(&m, PD, &seg), Err(MemError::OutOfBounds));
        let (_, wr) = m.register(PD, 0, 8, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
        let seg = Segment { key: MemKey::Remote(wr), addr: 0, len: 8 };
        assert_eq!(read_segment(&m, PD, &seg), Err(MemError::NoAccess));
        // Atomics: no REMOTE_ATOMIC right.
        let add = AtomicOp::FetchAdd { add: 1 };
        assert_eq!(m.atomic(PD, MemKey::Remote(r), BASE, add), Err(MemError::NoAccess));
        assert_eq!(snapshot(&m, l), before);
        assert!(m.writes().is_empty());
    }

    #[test]
    fn deregister_kills_both_keys() {
        let (mut m, l, r) = mem_with(ALL);
        assert!(m.deregister(l));
        assert!(!m.deregister(l));
        assert_eq!(m.check(PD, MemKey::Local(l), BASE, 1, Access::NONE), Err(MemError::BadKey));
        assert_eq!(m.check(PD, MemKey::Remote(r), BASE, 1, Access::NONE), Err(MemError::BadKey));
        assert_eq!(m.bytes(l), None);
        assert_eq!(m.region_addr(l), None);
    }

    #[test]
    fn atomics() {
        let (mut m, l, r) = mem_with(ALL);
        let key = MemKey::Remote(r);
        let start = u64::from_ne_bytes(m.bytes(l).unwrap()[8..16].try_into().unwrap());
        let cas = |compare, swap| AtomicOp::CompareSwap { compare, swap };
        // Mismatch: returns the old value, stores nothing.
        assert_eq!(m.atomic(PD, key, BASE + 8, cas(start + 1, 7)), Ok(start));
        assert_eq!(m.atomic(PD, key, BASE + 8, cas(start, 7)), Ok(start));
        assert_eq!(m.atomic(PD, key, BASE + 8, AtomicOp::FetchAdd { add: u64::MAX }), Ok(7));
        assert_eq!(m.atomic(PD, MemKey::Local(l), BASE + 8, AtomicOp::FetchAdd { add: 2 }), Ok(6));
        assert_eq!(&m.bytes(l).unwrap()[8..16], &8u64.to_ne_bytes());
        assert_eq!(m.writes().len(), 4);

        let before = snapshot(&m, l);
        let add = AtomicOp::FetchAdd { add: 1 };
        assert_eq!(m.atomic(PD, key, BASE + 4, add), Err(MemError::Misaligned));
        assert_eq!(m.atomic(PD, key, BASE + 64, add), Err(MemError::OutOfBounds));
        assert_eq!(m.atomic(PD, key, u64::MAX - 7, add), Err(MemError::OutOfBounds));
        assert_eq!(m.atomic(PD, key, u64::MAX, add), Err(MemError::Misaligned));
        assert_eq!(m.atomic(PdId(3), key, BASE, add), Err(MemError::WrongPd));
        // A local key needs LOCAL_WRITE.
        let (ro, _) = m.register(PD, BASE, 8, Access::REMOTE_READ).unwrap();
        assert_eq!(m.atomic(PD, MemKey::Local(ro), BASE, add), Err(MemError::NoAccess));
        assert_eq!(snapshot(&m, l), before);
        assert_eq!(m.bytes(ro).unwrap(), &[0; 8]);
        assert_eq!(m.writes().len(), 4);
    }
}
