//! softrdma's protocol crate: RoCEv2 wire formats and the sans-IO RDMA transport.
//!
//! Nothing here touches a socket, a thread or a clock.
//! - [`wire`] parses and emits the bytes that Linux rxe and RoCE NICs put on UDP port
//!   4791; every parser of untrusted input returns an error instead of panicking.
//! - [`qp`] is the RC, UC and UD transport: queue pairs as state machines that take work
//!   requests, packets and the time, and yield packets, completions and deadlines.
//! - [`cm`] is the communication manager's messages and rdma_cm's conventions.
//! - [`memory`] is the narrow interface through which the transport reaches registered
//!   memory; [`endpoint`] demultiplexes datagrams to the QPs of one address.
//! - [`sim`] drives endpoints over a seeded, impaired network on virtual time.

#![warn(missing_docs, unreachable_pub)]

pub mod cm;
pub mod endpoint;
pub mod memory;
pub mod qp;
pub mod sim;
mod types;
pub mod wire;

pub use qp::SgList;
pub use types::{Lkey, Psn, Qkey, Qpn, Rkey, MASK_24};
