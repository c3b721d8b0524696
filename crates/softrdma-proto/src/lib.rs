//! softrdma's protocol crate: RoCEv2 wire formats and, in later modules, the sans-IO RDMA
//! transport (queue pair state machines, connection manager).
//!
//! Nothing here touches a socket, a thread or a clock. The [`wire`] module parses and emits
//! the bytes that Linux rxe and RoCE NICs put on UDP port 4791, and every parser of
//! untrusted input returns an error instead of panicking.

#![warn(missing_docs, unreachable_pub)]

mod types;
pub mod wire;

pub use types::{Lkey, Psn, Qkey, Qpn, Rkey, MASK_24};
