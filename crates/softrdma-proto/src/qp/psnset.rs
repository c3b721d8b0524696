//! A fixed-size bitmap of PSNs counted from a base: what selective recovery's SACKs carry
//! and what the requester remembers of them.

/// PSNs a SACK can describe past its first missing one, and the span of PSNs a softrdma
/// requester keeps outstanding towards a peer that sends SACKs (see
/// `QueuePair::set_selective`): four times the congestion window's cap, so that a hole
/// being repaired does not hold the window shut for the repair's round trip.
pub const SACK_SPAN: u32 = 512;

const WORDS: usize = SACK_SPAN as usize / 64;

/// Bit `i` stands for the PSN `base + i` of whoever holds it; `i < SACK_SPAN`.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub(super) struct PsnBits([u64; WORDS]);

impl PsnBits {
    /// The SACK payload's size in bytes.
    pub(super) const BYTES: usize = WORDS * 8;

    pub(super) fn get(&self, i: u32) -> bool {
        i < SACK_SPAN && self.0[i as usize / 64] & (1 << (i % 64)) != 0
    }

    pub(super) fn set(&mut self, i: u32) {
        if i < SACK_SPAN {
            self.0[i as usize / 64] |= 1 << (i % 64);
        }
    }

    /// Sets the bits `from .. from + n` (those within the span).
    pub(super) fn set_range(&mut self, from: u32, n: u32) {
        let end = from.saturating_add(n).min(SACK_SPAN);
        let mut i = from;
        while i < end {
            let w = i as usize / 64;
            let lo = i % 64;
            let hi = (end - (w as u32) * 64).min(64);
            let mask = if hi - lo == 64 { u64::MAX } else { ((1u64 << (hi - lo)) - 1) << lo };
            self.0[w] |= mask;
            i = (w as u32 + 1) * 64;
        }
    }

    /// Drops the first `d` bits: bit `i + d` becomes bit `i` (the base moved on by `d`).
    pub(super) fn shift_down(&mut self, d: u32) {
        if d >= SACK_SPAN {
            *self = PsnBits::default();
            return;
        }
        let (words, bits) = (d as usize / 64, d % 64);
        for k in 0..WORDS {
            let lo = self.0.get(k + words).copied().unwrap_or(0);
            let hi = self.0.get(k + words + 1).copied().unwrap_or(0);
            self.0[k] = if bits == 0 { lo } else { lo >> bits | hi << (64 - bits) };
        }
    }

    /// Follows a base that moved by `d` PSNs: forward, the bits shift down; backward
    /// (the base was reset), they are cleared.
    pub(super) fn move_base(&mut self, d: i32) {
        if d > 0 {
            self.shift_down(d as u32);
        } else if d < 0 {
            *self = PsnBits::default();
        }
    }

    /// How many bits below `n` are set.
    pub(super) fn count_below(&self, n: u32) -> u32 {
        let n = n.min(SACK_SPAN);
        let full = n as usize / 64;
        let mut c: u32 = self.0[..full].iter().map(|w| w.count_ones()).sum();
        if n % 64 != 0 {
            c += (self.0[full] & ((1u64 << (n % 64)) - 1)).count_ones();
        }
        c
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }

    /// The set bits, lowest first.
    pub(super) fn ones(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().enumerate().flat_map(|(w, &word)| {
            let mut rest = word;
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let i = rest.trailing_zeros();
                rest &= rest - 1;
                Some(w as u32 * 64 + i)
            })
        })
    }

    pub(super) fn to_le_bytes(self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        for (chunk, w) in out.chunks_exact_mut(8).zip(self.0) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    pub(super) fn from_le_bytes(b: &[u8; Self::BYTES]) -> PsnBits {
        let mut out = PsnBits::default();
        for (w, chunk) in out.0.iter_mut().zip(b.chunks_exact(8)) {
            *w = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same operations on a plain set of integers.
    fn model(bits: &PsnBits) -> Vec<u32> {
        (0..SACK_SPAN).filter(|&i| bits.get(i)).collect()
    }

    #[test]
    fn ranges_shifts_and_counts_agree_with_a_plain_set() {
        let mut seed = 0x1234_5678_9ABC_DEF0u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let mut b = PsnBits::default();
            let mut m = std::collections::BTreeSet::new();
            for _ in 0..4 {
                let (from, n) = ((next() % 600) as u32, (next() % 200) as u32);
                b.set_range(from, n);
                m.extend((from..from + n).filter(|&i| i < SACK_SPAN));
                let one = (next() % 520) as u32;
                b.set(one);
                if one < SACK_SPAN {
                    m.insert(one);
                }
            }
            assert_eq!(model(&b), m.iter().copied().collect::<Vec<_>>());
            assert_eq!(b.ones().collect::<Vec<_>>(), m.iter().copied().collect::<Vec<_>>());
            let n = (next() % 530) as u32;
            assert_eq!(b.count_below(n), m.iter().filter(|&&i| i < n).count() as u32);
            let d = (next() % 530) as u32;
            let mut s = b;
            s.shift_down(d);
            let shifted: Vec<u32> = m.iter().filter(|&&i| i >= d).map(|&i| i - d).collect();
            assert_eq!(model(&s), shifted, "shift by {d}");
            assert_eq!(PsnBits::from_le_bytes(&b.to_le_bytes()), b);
            assert_eq!(b.is_empty(), m.is_empty());
        }
    }
}
