//! softrdma: RDMA verbs in user space, over UDP (RoCEv2).
//!
//! The verbs objects as Rust values: open a [`Context`] on a local address, allocate a
//! [`ProtectionDomain`], register [`MemoryRegion`]s, create [`CompletionQueue`]s (and a
//! [`CompletionChannel`] for event mode), create a QP, connect it with the peer's
//! [`EndpointInfo`] exchanged over any channel, post work requests and poll completions.
//! Work-completion failures are statuses in completions; API misuse is an [`Error`].
//!
//! ```no_run
//! use softrdma::{Access, Context, QpBuilder, ConnectOptions, SendWr, SendOp, SendFlags};
//! # fn exchange(_: softrdma::EndpointInfo) -> softrdma::EndpointInfo { unimplemented!() }
//! let ctx = Context::open("127.0.0.2".parse().unwrap())?;
//! let pd = ctx.alloc_pd();
//! let mr = pd.register(4096, Access::LOCAL_WRITE)?;
//! let cq = ctx.create_cq(64, None)?;
//! let prepared = pd.prepare_qp(&QpBuilder::rc(), &cq, &cq)?;
//! let remote = exchange(prepared.endpoint());
//! let qp = prepared.handshake(&remote, &ConnectOptions::default())?;
//! qp.post_send(SendWr {
//!     wr_id: 1,
//!     op: SendOp::Send,
//!     sg_list: softrdma::sgl![mr.sge(0, 4096)?],
//!     flags: SendFlags { signaled: true, ..Default::default() },
//!     ud: None,
//! })?;
//! let wc = cq.wait_one();
//! # Ok::<(), softrdma::Error>(())
//! ```

#![warn(missing_docs, unreachable_pub)]

/// Marks a point of the receive-to-send path ([`stages`]); nothing without the
/// `stage-probe` feature.
macro_rules! stage {
    ($s:ident) => {
        #[cfg(feature = "stage-probe")]
        crate::stages::mark(crate::stages::Stage::$s);
    };
}

/// Records an event of the process's timeline ([`timeline`]); nothing without the
/// `timeline` feature.
macro_rules! timeline {
    ($e:ident, $count:expr) => {
        #[cfg(feature = "timeline")]
        crate::timeline::record(crate::timeline::Event::$e, ($count) as u64);
    };
}

mod ah;
mod capture;
pub mod cm;
mod context;
mod cq;
mod device;
mod engine;
mod error;
mod introspect;
mod link;
pub mod managed;
pub mod mcast;
mod memory;
mod pd;
mod qp;
#[cfg(feature = "stage-probe")]
mod stages;
mod sys;
#[cfg(feature = "timeline")]
mod timeline;

pub use ah::{AddressHandle, AhAttr};
pub use capture::{PCAP_ENV, PCAP_MAX_ENV};
pub use context::Context;
pub use cq::{completion_clock_ns, CompletionChannel, CompletionQueue, CqOptions, NextCompletion, EMPTY_WC};
pub use device::{
    addr_of_gid, bind_env, default_port, devices, find_device, gid_of, AtomicCap, Device, DeviceAttr,
    GidEntry, GidType, LinkLayer, PortAttr, PortState, BIND_ENV, DEVICE_CAP_FLAGS, GIDS_ENV, MAX_CQE,
    MAX_INLINE, MAX_MR, MAX_MR_SIZE, MAX_QP, MAX_QP_RD_ATOM, MAX_QP_WR, MAX_SGE, PORT_CAP_IP_BASED_GIDS,
    PORT_ENV,
};
pub use engine::{AsyncEvent, EventWake, IoStats};
pub use error::{Error, Result};
pub use introspect::{socket_dir as res_socket_dir, RES_ENV};
pub use link::MemoryNetwork;
pub use pd::{MemoryRegion, ProtectionDomain, RemoteRegion};
pub use qp::{
    ConnectOptions, EndpointInfo, PreparedQp, QpBuilder, QpInitAttr, QueuePair, SharedReceiveQueue,
};
pub use softrdma_proto as proto;
pub use softrdma_proto::memory::Access;
pub use softrdma_proto::qp::{
    Mtu, QpAttr, QpAttrMask, QpCaps, QpState, QpStats, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge,
    UdDest, WcOpcode, WcStatus, WorkCompletion,
};
pub use softrdma_proto::{sgl, Lkey, Psn, Qkey, Qpn, Rkey, SgList};

/// The environment variable that turns on softrdma's log (an `EnvFilter` string, e.g.
/// `SOFTRDMA_LOG=debug` or `SOFTRDMA_LOG=softrdma_proto=debug`): QP state changes, NAKs
/// sent and received with their reasons, failed work requests, ACK timeouts, and packets
/// dropped with their cause, each with the QPN and the peer, on standard error. Off, it
/// costs one relaxed load per event site. A program that installs its own `tracing`
/// subscriber gets the same events through it, whatever this variable says.
pub const LOG_ENV: &str = "SOFTRDMA_LOG";

/// Installs the stderr log `SOFTRDMA_LOG` asks for, once per process (not if the program
/// installed a subscriber of its own).
pub(crate) fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(spec) = std::env::var(LOG_ENV) else { return };
        let filter = match tracing_subscriber::EnvFilter::try_new(&spec) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("softrdma: {LOG_ENV}={spec:?} is not a valid filter ({e}); logging off");
                return;
            }
        };
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(true)
            .try_init();
    });
}

/// 64 unpredictable bits: the standard library's hash of nothing under a fresh random key
/// (drawn from the operating system once per thread, then stepped), for starting PSNs, QPN
/// and CM keys. Not for long-term secrets.
pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new().build_hasher().finish()
}

/// The README's Rust examples, compiled (and, but for those that need a remote peer, run)
/// by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeExamples;
