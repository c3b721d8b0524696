//! softrdma: RDMA verbs in user space over UDP (RoCEv2).
//!
//! This crate will hold what users call: devices, protection domains, memory regions,
//! completion queues and channels, queue pairs, and the progress engine that moves packets
//! between UDP sockets and the sans-IO transport in [`proto`]. For now it re-exports the
//! protocol crate, whose wire layer is complete.

#![warn(missing_docs, unreachable_pub)]

pub use softrdma_proto as proto;
