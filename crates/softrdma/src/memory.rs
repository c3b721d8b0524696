//! Registered memory and the registry through which the transport reaches it.
//!
//! A region's bytes live in 8-byte atomic words. The network (the progress engine) and the
//! application never touch them through a `&[u8]`: only with atomic loads and stores, or,
//! on x86-64, with `rep movsb` in inline assembly (the bulk copies of
//! [`MrInner::read`] and [`MrInner::write`], a packet's payload in one instruction instead
//! of a loop of word stores). An asm block is opaque to the compiler, which assumes nothing
//! about the bytes it moves, so no optimisation can rest on a value a racing thread changes;
//! and the hardware defines what racing accesses do (x86-TSO: every byte access is atomic,
//! and `rep movsb` moves bytes). So a peer's RDMA WRITE landing while the application reads
//! is a race on values, never undefined behaviour: the application may see old bytes, new
//! bytes or a mix, exactly as with a hardware NIC, and is told when to look by a
//! completion. A packet's bytes land with its last byte last, after a store fence (the
//! word loop elsewhere: in ascending order, then a release fence), so a program spinning
//! on the last byte (perftest's write_lat) sees the rest when it sees that.
//!
//! The engine reaches regions only through the [`Registry`], under the engine lock; a
//! region dropped by the application leaves the registry under that same lock, so memory
//! is never freed while a packet is being built from it or written into it.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use softrdma_proto::memory::{Access, AtomicOp, MemError, MemKey, Memory, PdId, Segment};
use softrdma_proto::{Lkey, Rkey};

/// Where a region's bytes are.
#[derive(Debug)]
enum Storage {
    /// Owned by the region, as atomic words.
    Owned(Box<[AtomicU64]>),
    /// A caller's range, registered with `unsafe` (the C ABI's `ibv_reg_mr`): copied with
    /// plain memory copies; the caller's contract keeps it valid.
    Raw(*mut u8),
}

/// The storage and identity of one memory region.
#[derive(Debug)]
pub(crate) struct MrInner {
    storage: Storage,
    len: usize,
    pub(crate) pd: PdId,
    pub(crate) access: Access,
    pub(crate) lkey: Lkey,
    pub(crate) rkey: Rkey,
    /// A peer's SEND with Invalidate killed its keys: on every shard of a sharded device,
    /// each of which has it in its own registry, not only on the one that took the SEND.
    invalidated: std::sync::atomic::AtomicBool,
}

// SAFETY: an owned region is atomics only; a raw region's pointer is only dereferenced
// under the contract of `ProtectionDomain::register_raw`, which makes the range valid for
// reads and writes from any thread while it is registered.
unsafe impl Send for MrInner {}
// SAFETY: as above; every access goes through atomics or the raw contract.
unsafe impl Sync for MrInner {}

impl MrInner {
    /// The region's first address: where its bytes really are, as in verbs.
    pub(crate) fn addr(&self) -> u64 {
        match &self.storage {
            Storage::Owned(w) => w.as_ptr() as u64,
            Storage::Raw(p) => *p as u64,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn words(&self) -> Option<&[AtomicU64]> {
        match &self.storage {
            Storage::Owned(w) => Some(w),
            Storage::Raw(_) => None,
        }
    }

    /// Copies `out.len()` bytes from byte offset `off` (in bounds: checked by callers).
    pub(crate) fn read(&self, off: usize, out: &mut [u8]) {
        let Some(words) = self.words() else {
            // SAFETY: [off, off + len) is inside the registered range (callers check),
            // which the register_raw contract keeps valid for reads.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr(off), out.as_mut_ptr(), out.len()) };
            return;
        };
        fence(Ordering::Acquire);
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: [off, off + len) is inside the region (callers check), whose words
            // live as long as `self`; `out` is a distinct, writable buffer; the bytes are
            // read through the words' UnsafeCells, by the asm block (see the module docs).
            unsafe { movsb(out.as_mut_ptr(), byte_ptr(words, off), out.len()) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        self.read_words(words, off, out);
    }

    /// [`Self::read`] into a buffer that need not be initialised; returns it, filled.
    pub(crate) fn read_uninit<'b>(&self, off: usize, out: &'b mut [std::mem::MaybeUninit<u8>]) -> &'b [u8] {
        let len = out.len();
        match self.words() {
            None => {
                // SAFETY: [off, off + len) is inside the registered range (callers check),
                // which the register_raw contract keeps valid for reads; `out` is a distinct
                // buffer of len writable bytes.
                unsafe { std::ptr::copy_nonoverlapping(self.ptr(off), out.as_mut_ptr().cast::<u8>(), len) };
            }
            #[cfg(target_arch = "x86_64")]
            Some(words) => {
                fence(Ordering::Acquire);
                // SAFETY: as in `read`.
                unsafe { movsb(out.as_mut_ptr().cast::<u8>(), byte_ptr(words, off), len) };
            }
            #[cfg(not(target_arch = "x86_64"))]
            Some(words) => {
                out.fill(std::mem::MaybeUninit::new(0));
                // SAFETY: every byte of `out` was just initialised.
                let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), len) };
                fence(Ordering::Acquire);
                self.read_words(words, off, bytes);
            }
        }
        // SAFETY: every byte of `out` was written above (u8 has no invalid values); the
        // pointer is taken from `out` after those writes.
        unsafe { std::slice::from_raw_parts(out.as_ptr().cast::<u8>(), len) }
    }

    /// [`Self::read`] by atomic words: a partial first word, then whole words (8-byte
    /// copies the compiler turns into single moves), then a partial last word.
    #[cfg_attr(target_arch = "x86_64", allow(dead_code))]
    fn read_words(&self, words: &[AtomicU64], off: usize, out: &mut [u8]) {
        let head = ((8 - off % 8) % 8).min(out.len());
        let (first, rest) = out.split_at_mut(head);
        if !first.is_empty() {
            let bytes = words[off / 8].load(Ordering::Relaxed).to_ne_bytes();
            first.copy_from_slice(&bytes[off % 8..off % 8 + first.len()]);
        }
        let w0 = (off + head) / 8;
        let whole = rest.len() / 8;
        let mut chunks = rest.chunks_exact_mut(8);
        for (k, chunk) in (&mut chunks).enumerate() {
            let v: &mut [u8; 8] = chunk.try_into().expect("chunks of 8");
            *v = words[w0 + k].load(Ordering::Relaxed).to_ne_bytes();
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let bytes = words[w0 + whole].load(Ordering::Relaxed).to_ne_bytes();
            let n = tail.len();
            tail.copy_from_slice(&bytes[..n]);
        }
    }

    /// Copies `data` to byte offset `off`, in ascending order, then fences.
    pub(crate) fn write(&self, off: usize, data: &[u8]) {
        let Some(words) = self.words() else {
            // The last byte goes last, on its own, after a release fence: a program may spin
            // on it (perftest's write_lat does), and a memcpy is free to store the tail
            // first.
            let Some((&last, body)) = data.split_last() else { return };
            let dst = self.ptr(off) as *mut u8;
            // SAFETY: in bounds (callers check); the register_raw contract keeps the range
            // valid for writes from any thread.
            unsafe { std::ptr::copy_nonoverlapping(body.as_ptr(), dst, body.len()) };
            fence(Ordering::Release);
            // SAFETY: as above; AtomicU8 has u8's layout and any address is aligned for it.
            unsafe { std::sync::atomic::AtomicU8::from_ptr(dst.add(body.len())) }
                .store(last, Ordering::Release);
            return;
        };
        #[cfg(target_arch = "x86_64")]
        {
            let Some((&last, body)) = data.split_last() else { return };
            let dst = byte_ptr(words, off);
            // SAFETY: [off, off + len) is inside the region (callers check); the words are
            // UnsafeCells, written here by the asm blocks only (see the module docs); `data`
            // is a distinct buffer. The fence orders the body's stores (a fast string
            // operation may store out of order) before the last byte's.
            unsafe {
                movsb(dst, body.as_ptr(), body.len());
                std::arch::asm!("sfence", options(nostack, preserves_flags));
                movsb(dst.add(body.len()), &last, 1);
            }
            fence(Ordering::Release);
        }
        #[cfg(not(target_arch = "x86_64"))]
        self.write_words(words, off, data);
    }

    /// [`Self::write`] by atomic words, in ascending order, then a release fence.
    #[cfg_attr(target_arch = "x86_64", allow(dead_code))]
    fn write_words(&self, words: &[AtomicU64], off: usize, data: &[u8]) {
        let merge = |word: &AtomicU64, at: usize, bytes: &[u8]| {
            let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                let mut v = old.to_ne_bytes();
                v[at..at + bytes.len()].copy_from_slice(bytes);
                Some(u64::from_ne_bytes(v))
            });
        };
        let head = ((8 - off % 8) % 8).min(data.len());
        let (first, rest) = data.split_at(head);
        if !first.is_empty() {
            merge(&words[off / 8], off % 8, first);
        }
        let w0 = (off + head) / 8;
        let mut chunks = rest.chunks_exact(8);
        for (k, chunk) in (&mut chunks).enumerate() {
            let v: [u8; 8] = chunk.try_into().expect("chunks of 8");
            words[w0 + k].store(u64::from_ne_bytes(v), Ordering::Relaxed);
        }
        let tail = chunks.remainder();
        if !tail.is_empty() {
            merge(&words[w0 + rest.len() / 8], 0, tail);
        }
        fence(Ordering::Release);
    }

    /// Runs an atomic on the 8-byte-aligned word at byte offset `off`.
    fn atomic(&self, off: usize, op: AtomicOp) -> u64 {
        let raw;
        let word = match self.words() {
            Some(words) => &words[off / 8],
            None => {
                // SAFETY: the address is 8-byte aligned and in bounds (callers check), and
                // the register_raw contract keeps it valid; AtomicU64 has u64's layout.
                raw = unsafe { AtomicU64::from_ptr(self.ptr(off) as *mut u64) };
                raw
            }
        };
        let r = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| Some(op.apply(old)));
        match r {
            Ok(old) | Err(old) => old,
        }
    }

    /// The raw address of byte `off`, for handing a range to the kernel.
    pub(crate) fn ptr(&self, off: usize) -> *const u8 {
        (self.addr() as *const u8).wrapping_add(off)
    }

    /// Offset of `[addr, addr + len)` in the region, if it lies inside.
    fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let off = addr.checked_sub(self.addr())?;
        (off.checked_add(len)? <= self.len as u64).then_some(off as usize)
    }
}

/// The address of byte `off` of `words`, writable: the words are UnsafeCells.
#[cfg(target_arch = "x86_64")]
fn byte_ptr(words: &[AtomicU64], off: usize) -> *mut u8 {
    words.as_ptr().cast::<u8>().cast_mut().wrapping_add(off)
}

/// Copies `n` bytes from `src` to `dst` with `rep movsb` (one instruction the CPU runs at
/// its widest, as `memcpy` does for large copies).
///
/// # Safety
///
/// `src` must be valid for reads and `dst` for writes of `n` bytes, the two ranges must not
/// overlap, and `dst` may not be memory the compiler assumes unchanging for the length of
/// the call (behind a `&` to non-`UnsafeCell` bytes); `src` need only be readable.
#[cfg(target_arch = "x86_64")]
unsafe fn movsb(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the caller's contract; the direction flag is clear (the ABI guarantees it
    // at every call and asm block), so the copy ascends; rep movsb leaves flags alone.
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") n => _,
            inout("rdi") dst => _,
            inout("rsi") src => _,
            options(nostack, preserves_flags),
        );
    }
}

/// `n` zeroed atomic words, or `None` if the allocator refuses: a failed allocation is an
/// error for the caller, not an abort. The zeroed allocation leaves untouched pages to the
/// kernel's lazily zeroed mappings, so a large region costs memory only as it is used.
fn zeroed_words(n: usize) -> Option<Box<[AtomicU64]>> {
    let layout = std::alloc::Layout::array::<AtomicU64>(n).ok()?;
    // SAFETY: `layout` has a nonzero size (n >= 1 words of 8 bytes).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<AtomicU64>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` is a fresh allocation of `layout` = n AtomicU64s from the global
    // allocator, all bytes zero, which is a valid AtomicU64 (0); the Box frees it with the
    // same layout.
    Some(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n)) })
}

/// The hasher of the maps by key (see [`Registry`]) and of the engine's completion routes
/// by QP number: a key times a 64-bit odd constant, which spreads its bits over the high
/// half the table looks at first.
#[derive(Debug, Default)]
pub(crate) struct KeyHash(u64);

pub(crate) type KeyHashing = std::hash::BuildHasherDefault<KeyHash>;

impl std::hash::Hasher for KeyHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, k: u32) {
        self.0 = (self.0 ^ u64::from(k)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Every registered region of a device, by key.
///
/// Keys are the standard library's randomly keyed hash (SipHash-1-3 today) of a counter,
/// under a 128-bit key the standard library draws from
/// the operating system's random source: a keyed pseudo-random function, so seeing some
/// keys tells nothing about others. An attacker must guess 32 bits: with R regions
/// registered, a guessed R_Key hits one with probability R / 2^32 — and must also name
/// an address inside it, in the right protection domain, with the right access.
///
/// The maps by key hash a key with one multiplication ([`KeyHash`]) rather than SipHash
/// (a lookup on every packet): the keys are already pseudo-random and chosen here, so
/// no one can make them collide, and a looked-up key that is not there costs a probe
/// like any other.
#[derive(Debug)]
pub(crate) struct Registry {
    by_lkey: HashMap<u32, Arc<MrInner>, KeyHashing>,
    by_rkey: HashMap<u32, u32, KeyHashing>,
    keygen: std::collections::hash_map::RandomState,
    counter: u64,
}

impl Registry {
    /// Every region, for introspection: keys, length, access and domain, by lkey.
    pub(crate) fn list(&self) -> Vec<crate::introspect::MrRes> {
        let mut v: Vec<_> = self
            .by_lkey
            .values()
            .map(|m| crate::introspect::MrRes {
                lkey: m.lkey.0,
                rkey: m.rkey.0,
                len: m.len,
                access: format!("{:?}", m.access)
                    .trim_start_matches("Access(")
                    .trim_end_matches(')')
                    .to_string(),
                pd: m.pd.0,
            })
            .collect();
        v.sort_by_key(|m| m.lkey);
        v
    }

    pub(crate) fn new() -> Registry {
        Registry {
            by_lkey: HashMap::default(),
            by_rkey: HashMap::default(),
            keygen: std::collections::hash_map::RandomState::new(),
            counter: 0,
        }
    }

    fn fresh_key(&mut self) -> u32 {
        loop {
            self.counter += 1;
            let k = self.keygen.hash_one(self.counter) as u32;
            if k != 0 && !self.by_lkey.contains_key(&k) && !self.by_rkey.contains_key(&k) {
                return k;
            }
        }
    }

    /// Registers a zeroed region of `len` bytes, or says the memory cannot be had.
    pub(crate) fn register(&mut self, pd: PdId, len: usize, access: Access) -> crate::Result<Arc<MrInner>> {
        let words = zeroed_words(len.div_ceil(8).max(1)).ok_or(crate::Error::OutOfMemory { bytes: len })?;
        Ok(self.insert(Storage::Owned(words), len, pd, access))
    }

    /// Registers a caller's range.
    ///
    /// # Safety
    ///
    /// See [`crate::ProtectionDomain::register_raw`].
    pub(crate) unsafe fn register_raw(
        &mut self,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Arc<MrInner> {
        self.insert(Storage::Raw(ptr), len, pd, access)
    }

    fn insert(&mut self, storage: Storage, len: usize, pd: PdId, access: Access) -> Arc<MrInner> {
        let lkey = self.fresh_key();
        let rkey = self.fresh_key();
        let mr = Arc::new(MrInner {
            storage,
            len,
            pd,
            access,
            lkey: Lkey(lkey),
            rkey: Rkey(rkey),
            invalidated: std::sync::atomic::AtomicBool::new(false),
        });
        self.by_lkey.insert(lkey, mr.clone());
        self.by_rkey.insert(rkey, lkey);
        mr
    }

    /// Enters a region another shard of the device registered, under its keys (which that
    /// shard chose; shards other than 0 never choose keys of their own).
    pub(crate) fn adopt(&mut self, mr: &Arc<MrInner>) {
        self.by_rkey.insert(mr.rkey.0, mr.lkey.0);
        self.by_lkey.insert(mr.lkey.0, mr.clone());
    }

    /// Removes a region; its keys die at once.
    pub(crate) fn deregister(&mut self, lkey: Lkey) {
        if let Some(mr) = self.by_lkey.remove(&lkey.0) {
            self.by_rkey.remove(&mr.rkey.0);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.by_lkey.len()
    }

    fn lookup(&self, pd: PdId, key: MemKey, access: Access) -> Result<&Arc<MrInner>, MemError> {
        let lkey = match key {
            MemKey::Local(l) => l.0,
            MemKey::Remote(r) => *self.by_rkey.get(&r.0).ok_or(MemError::BadKey)?,
        };
        let mr = self.by_lkey.get(&lkey).ok_or(MemError::BadKey)?;
        if mr.invalidated.load(Ordering::Acquire) {
            return Err(MemError::BadKey);
        }
        if mr.pd != pd {
            return Err(MemError::WrongPd);
        }
        if !mr.access.contains(access) {
            return Err(MemError::NoAccess);
        }
        Ok(mr)
    }

    fn resolve(
        &self,
        pd: PdId,
        key: MemKey,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<(&Arc<MrInner>, usize), MemError> {
        let mr = self.lookup(pd, key, access)?;
        if len == 0 {
            return Ok((mr, 0));
        }
        let off = mr.offset_of(addr, len).ok_or(MemError::OutOfBounds)?;
        Ok((mr, off))
    }

    /// The raw address and length of a segment, for a gather by the kernel. The pointer is
    /// valid while the registry lock is held.
    pub(crate) fn raw(&self, pd: PdId, seg: &Segment) -> Option<(*const u8, usize)> {
        let access = seg.key.read_access();
        let (mr, off) = self.resolve(pd, seg.key, seg.addr, u64::from(seg.len), access).ok()?;
        Some((mr.ptr(off), seg.len as usize))
    }
}

impl Memory for Registry {
    fn check(&self, pd: PdId, key: MemKey, addr: u64, len: u64, access: Access) -> Result<(), MemError> {
        self.resolve(pd, key, addr, len, access).map(|_| ())
    }

    fn gather(&self, pd: PdId, seg: &Segment, f: &mut dyn FnMut(&[u8])) -> Result<(), MemError> {
        let (mr, off) = self.resolve(pd, seg.key, seg.addr, u64::from(seg.len), seg.key.read_access())?;
        // Not zeroed first (4 KiB per packet sent): every byte handed on is copied in.
        let mut chunk = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
        let mut done = 0usize;
        let len = seg.len as usize;
        while done < len {
            let n = (len - done).min(chunk.len());
            f(mr.read_uninit(off + done, &mut chunk[..n]));
            done += n;
        }
        Ok(())
    }

    fn copy_out(&self, pd: PdId, seg: &Segment, dst: &mut [u8]) -> Result<(), MemError> {
        let (mr, off) = self.resolve(pd, seg.key, seg.addr, u64::from(seg.len), seg.key.read_access())?;
        let n = (seg.len as usize).min(dst.len());
        mr.read(off, &mut dst[..n]);
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
        let (mr, off) = self.resolve(pd, key, addr, data.len() as u64, access)?;
        mr.write(off, data);
        Ok(())
    }

    fn atomic(&mut self, pd: PdId, key: MemKey, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        let access = key.atomic_access();
        self.lookup(pd, key, access)?;
        if addr % 8 != 0 {
            return Err(MemError::Misaligned);
        }
        let (mr, off) = self.resolve(pd, key, addr, 8, access)?;
        Ok(mr.atomic(off, op))
    }

    fn invalidate(&mut self, pd: PdId, rkey: Rkey) -> Result<(), MemError> {
        let mr = self.lookup(pd, MemKey::Remote(rkey), Access::NONE)?;
        mr.invalidated.store(true, Ordering::Release);
        let lkey = mr.lkey;
        self.deregister(lkey);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes with `write` and reads back with `read` at every offset and length of a
    /// 64-byte region, against a byte array.
    fn copies_match_a_byte_array(
        write: impl Fn(&MrInner, usize, &[u8]),
        read: impl Fn(&MrInner, usize, &mut [u8]),
    ) {
        let mut reg = Registry::new();
        let mr = reg.register(PdId(1), 64, Access::LOCAL_WRITE).unwrap();
        let mut model = vec![0u8; 64];
        let mut k = 0u8;
        for off in 0..24 {
            for len in 0..40 {
                let data: Vec<u8> = (0..len).map(|i| k.wrapping_add(i as u8)).collect();
                k = k.wrapping_add(37);
                write(&mr, off, &data);
                model[off..off + len].copy_from_slice(&data);
                let mut all = vec![0u8; 64];
                read(&mr, 0, &mut all);
                assert_eq!(all, model, "write of {len} at {off}");
                let mut part = vec![0u8; len];
                read(&mr, off, &mut part);
                assert_eq!(part, data, "read of {len} at {off}");
            }
        }
    }

    #[test]
    fn region_copies_match_a_byte_array_at_every_offset_and_length() {
        copies_match_a_byte_array(|m, o, d| m.write(o, d), |m, o, d| m.read(o, d));
    }

    #[test]
    fn reads_into_uninitialised_buffers_match_a_byte_array() {
        copies_match_a_byte_array(
            |m, o, d| m.write(o, d),
            |m, o, d| {
                let mut u = vec![std::mem::MaybeUninit::uninit(); d.len()];
                d.copy_from_slice(m.read_uninit(o, &mut u));
            },
        );
    }

    #[test]
    fn word_copies_match_a_byte_array_at_every_offset_and_length() {
        copies_match_a_byte_array(
            |m, o, d| m.write_words(m.words().unwrap(), o, d),
            |m, o, d| m.read_words(m.words().unwrap(), o, d),
        );
    }
}
