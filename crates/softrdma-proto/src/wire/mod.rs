//! RoCEv2 packet formats: typed views over bytes, owned representations, the opcode table,
//! the ICRC and the management datagrams.
//!
//! Every header follows the same pattern (after smoltcp's `wire` module):
//!
//! - a view `Header<T: AsRef<[u8]>>` over a byte buffer, made with `new_checked`, which
//!   validates the length once so that no accessor can panic afterwards; getters need
//!   `AsRef<[u8]>`, setters `AsMut<[u8]>`;
//! - an owned `HeaderRepr`, the meaning of the bytes, with `parse` (from a view) and
//!   `emit` (into a view).
//!
//! This module owns the byte layout and nothing else: no state, no I/O, no policy about
//! which packets a queue pair accepts. Every function that reads untrusted bytes returns
//! [`Error`] on malformed input and never panics.

mod aeth;
mod atomic_ack_eth;
mod atomic_eth;
mod bth;
pub mod bundle;
mod cnp;
mod deth;
mod feth;
pub mod fill;
pub mod icrc;
mod ieth;
mod immdt;
pub mod ip;
pub mod mad;
mod opcode;
mod packet;
mod reth;

pub use aeth::{credit_code_for, rnr_timer_us, Aeth, AethRepr, AethSyndrome, NakCode, CREDITS_INVALID};
pub use atomic_ack_eth::{AtomicAckEth, AtomicAckEthRepr};
pub use atomic_eth::{AtomicEth, AtomicEthRepr};
pub use bth::{pkey_match, Bth, BthRepr, DEFAULT_PKEY};
pub use cnp::Cnp;
pub use deth::{Deth, DethRepr};
pub use feth::{Feth, FethRepr};
pub use icrc::ICRC_LEN;
pub use ieth::{Ieth, IethRepr};
pub use immdt::{ImmDt, ImmDtRepr};
pub use opcode::{HeaderKind, HeaderSet, Opcode, Operation, PayloadRule, Position, Transport};
pub use packet::{pad_count, ExtHeaders, Packet, PacketRepr};
pub use reth::{Reth, RethRepr};

/// The UDP destination port of RoCEv2.
pub const ROCEV2_PORT: u16 = 4791;

/// A malformed or unsupported packet, header or capture record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The buffer ends before the header or packet does.
    #[error("truncated {what}: need {need} bytes, have {have}")]
    Truncated {
        /// Which header or structure was cut short.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// The BTH opcode is not one softrdma knows (RD, XRC, reserved and vendor opcodes).
    #[error("unknown or unsupported opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// The BTH transport header version is not 0.
    #[error("unsupported transport header version {0}")]
    BadTransportVersion(u8),
    /// Payload bytes follow an opcode that carries none.
    #[error("{opcode} carries no payload, but {len} bytes follow its headers")]
    UnexpectedPayload {
        /// The packet's opcode.
        opcode: Opcode,
        /// Bytes between the headers and the ICRC.
        len: usize,
    },
    /// The payload length does not fit the opcode (ATOMIC_WRITE carries exactly 8 bytes).
    #[error("{opcode} needs a {expected}-byte payload, got {len}")]
    BadPayloadLength {
        /// The packet's opcode.
        opcode: Opcode,
        /// The payload length the opcode requires.
        expected: usize,
        /// The payload length found.
        len: usize,
    },
    /// The BTH pad count is larger than the bytes between the headers and the ICRC.
    #[error("pad count {pad} exceeds the {len} bytes between the headers and the ICRC")]
    BadPadCount {
        /// The BTH PadCnt field.
        pad: u8,
        /// Bytes between the headers and the ICRC.
        len: usize,
    },
    /// A field holds a value its header does not allow.
    #[error("{header}: {reason}")]
    BadField {
        /// The header with the bad field.
        header: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// An owned representation cannot be emitted as asked (for example a RETH missing for
    /// an opcode that needs one); this is a caller bug, reported instead of a panic.
    #[error("cannot emit {opcode}: {reason}")]
    Inconsistent {
        /// The opcode being emitted.
        opcode: Opcode,
        /// What does not fit.
        reason: &'static str,
    },
    /// The destination buffer is too small for what is being emitted.
    #[error("buffer too small: need {need} bytes, have {have}")]
    BufferTooSmall {
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
}

/// Result of parsing or emitting wire data.
pub type Result<T> = core::result::Result<T, Error>;

/// Checks that `buf` holds at least `need` bytes of `what`.
pub(crate) fn check_len(what: &'static str, buf: &[u8], need: usize) -> Result<()> {
    if buf.len() < need {
        Err(Error::Truncated { what, need, have: buf.len() })
    } else {
        Ok(())
    }
}

/// Big-endian accessors on byte slices whose length was checked by `new_checked`.
///
/// Each takes a fixed-size window; callers only pass offsets inside the checked length.
pub(crate) mod be {
    pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_be_bytes([b[at], b[at + 1]])
    }
    pub(crate) fn u24_at(b: &[u8], at: usize) -> u32 {
        u32::from_be_bytes([0, b[at], b[at + 1], b[at + 2]])
    }
    pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
    }
    pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[at..at + 8]);
        u64::from_be_bytes(w)
    }
    pub(crate) fn put_u16(b: &mut [u8], at: usize, v: u16) {
        b[at..at + 2].copy_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn put_u24(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
    }
    pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_be_bytes());
    }
}

/// Defines the boilerplate of a fixed-length header view: the struct, `new_unchecked`,
/// `new_checked`, `into_inner` and the `LEN` constant.
macro_rules! fixed_view {
    ($(#[$doc:meta])* $name:ident, $len:expr, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Length of the header in bytes.
            pub const LEN: usize = $len;

            /// Wraps `buffer` without checking its length; accessors may then panic on a
            /// short buffer. Prefer [`Self::new_checked`] for untrusted bytes.
            pub const fn new_unchecked(buffer: T) -> Self {
                Self { buffer }
            }

            /// Wraps `buffer` after checking that it holds the whole header.
            pub fn new_checked(buffer: T) -> $crate::wire::Result<Self> {
                $crate::wire::check_len($what, buffer.as_ref(), $len)?;
                Ok(Self { buffer })
            }

            /// Returns the underlying buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}
pub(crate) use fixed_view;
