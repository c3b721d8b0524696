//! Newtypes for the numbers RDMA puts on the wire.
//!
//! A PSN compared with `<` on a raw `u32` breaks at the 24-bit wrap; a QPN passed where a
//! key was meant corrupts memory. Each quantity gets its own type so the compiler keeps them
//! apart, and the 24-bit ones can only hold 24 bits.

use core::cmp::Ordering;
use core::fmt;

/// Mask of a 24-bit wire field (QPN, PSN, MSN, EECN).
pub const MASK_24: u32 = 0x00FF_FFFF;

/// A 24-bit packet sequence number with wrap-aware ordering.
///
/// Ordering follows the sign of the 24-bit difference (`roce-wire.md` §8.1): `b` is after
/// `a` when `b - a`, taken modulo 2^24, lies in `1..2^23`. Two PSNs exactly 2^23 apart are
/// incomparable (`partial_cmp` returns `None`), which is why `Psn` is `PartialOrd` only.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Psn(u32);

impl Psn {
    /// The largest PSN value.
    pub const MAX: Psn = Psn(MASK_24);

    /// Makes a PSN from the low 24 bits of `value`; the top 8 bits are discarded.
    pub const fn new(value: u32) -> Psn {
        Psn(value & MASK_24)
    }

    /// Makes a PSN, or `None` if `value` does not fit in 24 bits.
    pub const fn try_new(value: u32) -> Option<Psn> {
        if value <= MASK_24 {
            Some(Psn(value))
        } else {
            None
        }
    }

    /// The PSN as an integer in `0..2^24`.
    pub const fn get(self) -> u32 {
        self.0
    }

    /// `self + n`, modulo 2^24.
    #[must_use]
    pub const fn wrapping_add(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_add(n))
    }

    /// `self - n`, modulo 2^24.
    #[must_use]
    pub const fn wrapping_sub(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_sub(n))
    }

    /// The signed distance from `other` to `self` in `-2^23..2^23`: positive when `self`
    /// comes after `other`. This is rxe's `psn_compare`.
    pub const fn distance(self, other: Psn) -> i32 {
        ((self.0.wrapping_sub(other.0)) << 8) as i32 >> 8
    }
}

impl PartialOrd for Psn {
    fn partial_cmp(&self, other: &Psn) -> Option<Ordering> {
        let d = self.0.wrapping_sub(other.0) & MASK_24;
        match d {
            0 => Some(Ordering::Equal),
            0x80_0000 => None,
            d if d < 0x80_0000 => Some(Ordering::Greater),
            _ => Some(Ordering::Less),
        }
    }
}

impl core::ops::Add<u32> for Psn {
    type Output = Psn;
    fn add(self, n: u32) -> Psn {
        self.wrapping_add(n)
    }
}

impl core::ops::Sub<u32> for Psn {
    type Output = Psn;
    fn sub(self, n: u32) -> Psn {
        self.wrapping_sub(n)
    }
}

impl fmt::Debug for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psn({:#08x})", self.0)
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

/// A 24-bit queue pair number.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Qpn(u32);

impl Qpn {
    /// QP0, the subnet management QP; RoCE has none and drops packets for it.
    pub const SMI: Qpn = Qpn(0);
    /// QP1, the general services interface that carries management datagrams (CM).
    pub const GSI: Qpn = Qpn(1);
    /// The destination QPN of a multicast packet.
    pub const MULTICAST: Qpn = Qpn(MASK_24);

    /// Makes a QPN from the low 24 bits of `value`.
    pub const fn new(value: u32) -> Qpn {
        Qpn(value & MASK_24)
    }

    /// Makes a QPN, or `None` if `value` does not fit in 24 bits.
    pub const fn try_new(value: u32) -> Option<Qpn> {
        if value <= MASK_24 {
            Some(Qpn(value))
        } else {
            None
        }
    }

    /// The QPN as an integer in `0..2^24`.
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Debug for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Qpn({:#08x})", self.0)
    }
}

impl fmt::Display for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

macro_rules! key_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        #[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
        pub struct $name(pub u32);

        impl $name {
            /// The key as the 32-bit value that goes on the wire.
            pub const fn get(self) -> u32 {
                self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#010x})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#010x}", self.0)
            }
        }
    };
}

key_newtype!(
    /// A remote key: names a memory region in a RETH, AtomicETH or IETH.
    Rkey
);
key_newtype!(
    /// A local key: names a memory region in a local scatter/gather entry. Never on the wire.
    Lkey
);
key_newtype!(
    /// A UD queue key, carried in the DETH and checked by the receiving QP.
    Qkey
);

impl Qkey {
    /// The Q_Key of QP1 (GSI), which every management datagram carries.
    pub const GSI: Qkey = Qkey(0x8001_0000);

    /// Whether this is a controlled Q_Key (bit 31 set), which only privileged QPs may own.
    pub const fn is_controlled(self) -> bool {
        self.0 & 0x8000_0000 != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_masks_and_wraps() {
        assert_eq!(Psn::new(0x0123_4567).get(), 0x23_4567);
        assert_eq!(Psn::try_new(0x100_0000), None);
        assert_eq!(Psn::MAX + 1, Psn::new(0));
        assert_eq!(Psn::new(0) - 1, Psn::MAX);
    }

    #[test]
    fn psn_ordering_is_wrap_aware() {
        let a = Psn::new(0xFF_FFF0);
        let b = Psn::new(0x00_0010);
        assert!(b > a, "0x10 comes after 0xfffff0 across the wrap");
        assert!(a < b);
        assert_eq!(b.distance(a), 0x20);
        assert_eq!(a.distance(b), -0x20);
        assert_eq!(Psn::new(5).partial_cmp(&Psn::new(5)), Some(Ordering::Equal));
        // Half the space apart: neither before nor after.
        assert_eq!(Psn::new(0).partial_cmp(&Psn::new(0x80_0000)), None);
        assert_eq!(Psn::new(0x7F_FFFF).distance(Psn::new(0)), 0x7F_FFFF);
        assert_eq!(Psn::new(0x80_0001).distance(Psn::new(0)), -0x7F_FFFF);
    }

    #[test]
    fn qpn_and_keys() {
        assert_eq!(Qpn::new(0xAB12_3456).get(), 0x12_3456);
        assert_eq!(Qpn::try_new(0x100_0000), None);
        assert!(Qkey::GSI.is_controlled());
        assert!(!Qkey(0x0123_4567).is_controlled());
        assert_eq!(format!("{}", Rkey(0xABCD)), "0x0000abcd");
    }
}
