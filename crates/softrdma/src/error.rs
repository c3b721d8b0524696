//! Errors of the verbs API. Work-completion failures are not errors: they are statuses in
//! completions. These are API misuse and system failures, each mapping onto the errno a C
//! verbs call would return.

use std::io;
use std::net::SocketAddr;

use softrdma_proto::qp::{ModifyError, PostError};

/// An error from a verbs call; nothing was changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The UDP port is taken: another process (or Linux rxe) has this address and port.
    #[error(
        "{addr} is already in use: give this process another loopback address (any of 127.0.0.0/8, \
         e.g. 127.0.0.2) or another UDP port (SOFTRDMA_PORT=4792, or Context::open_port)"
    )]
    AddressInUse {
        /// The address and port that could not be bound.
        addr: SocketAddr,
    },
    /// The address is not one of this host's.
    #[error("{0} is not an address of this host")]
    NoSuchDevice(std::net::IpAddr),
    /// No device matches the name or address given.
    #[error("no RDMA device named {0:?} (see `softrdma devices`)")]
    UnknownDevice(String),
    /// An argument is out of range or inconsistent.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// An access flag verbs defines that softrdma does not implement.
    #[error("access flag {0} is not supported by softrdma")]
    UnsupportedAccess(&'static str),
    /// A device limit would be exceeded.
    #[error("device limit reached: {0}")]
    Limit(&'static str),
    /// The QP refused a state change.
    #[error(transparent)]
    Modify(#[from] ModifyError),
    /// The QP refused a work request.
    #[error(transparent)]
    Post(#[from] PostError),
    /// The object belongs to another device or protection domain.
    #[error("object belongs to another device or protection domain")]
    Mismatch,
    /// The connection manager refused the call.
    #[error(transparent)]
    Cm(#[from] softrdma_proto::cm::CmError),
    /// A connection-manager call in the wrong state of its ID.
    #[error("not allowed now: {0}")]
    CmState(&'static str),
    /// A connection or resolution a blocking call waited for ended with another event
    /// (`status` is the event's: a REJ reason, or a negative errno).
    #[error("the connection manager reported {event} (status {status})")]
    CmFailed {
        /// The event's rdma_cm name, e.g. `RDMA_CM_EVENT_REJECTED`.
        event: &'static str,
        /// Its status.
        status: i32,
    },
    /// The memory for a region could not be allocated.
    #[error("cannot allocate {bytes} bytes for a memory region")]
    OutOfMemory {
        /// The size asked for.
        bytes: usize,
    },
    /// The group's MTU, set by its first member, is larger than this device's active
    /// MTU: the device cannot join while the group has members.
    #[error("cannot join {group}: its MTU is {group_mtu} (set by its first member), this device's is {device_mtu}")]
    GroupMtu {
        /// The group.
        group: std::net::IpAddr,
        /// The group's MTU in bytes.
        group_mtu: u32,
        /// This device's active MTU in bytes.
        device_mtu: u32,
    },
    /// A multicast attach or detach was refused.
    #[error(transparent)]
    Mcast(#[from] softrdma_proto::endpoint::McastError),
    /// A work request completed with an error status (from
    /// [`crate::managed::Done::check`]).
    #[error("work request failed: {0}")]
    Failed(softrdma_proto::qp::WcStatus),
    /// A blocking call's time ran out.
    #[error("timed out: {0}")]
    TimedOut(&'static str),
    /// A system call failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl Error {
    /// The errno a C verbs call would report.
    pub fn errno(&self) -> i32 {
        match self {
            Error::AddressInUse { .. } => libc::EADDRINUSE,
            Error::NoSuchDevice(_) | Error::UnknownDevice(_) => libc::ENODEV,
            Error::InvalidArgument(_) | Error::Modify(_) | Error::Mismatch => libc::EINVAL,
            Error::UnsupportedAccess(_) => libc::EOPNOTSUPP,
            Error::Limit(_) | Error::OutOfMemory { .. } => libc::ENOMEM,
            Error::Post(PostError::QueueFull) => libc::ENOMEM,
            Error::Post(_) => libc::EINVAL,
            Error::Cm(softrdma_proto::cm::CmError::InUse) => libc::EADDRINUSE,
            Error::Cm(softrdma_proto::cm::CmError::PrivateDataTooLong { .. }) => libc::EINVAL,
            Error::Cm(_) | Error::CmState(_) => libc::EINVAL,
            Error::CmFailed { event, .. } => match *event {
                "RDMA_CM_EVENT_REJECTED" => libc::ECONNREFUSED,
                "RDMA_CM_EVENT_UNREACHABLE" => libc::ETIMEDOUT,
                "RDMA_CM_EVENT_ADDR_ERROR" | "RDMA_CM_EVENT_ROUTE_ERROR" => libc::EADDRNOTAVAIL,
                _ => libc::ECONNRESET,
            },
            Error::TimedOut(_) => libc::ETIMEDOUT,
            Error::Failed(_) => libc::EIO,
            Error::Mcast(softrdma_proto::endpoint::McastError::TooMany) => libc::ENOMEM,
            Error::Mcast(_) | Error::GroupMtu { .. } => libc::EINVAL,
            Error::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

/// Result of a verbs call.
pub type Result<T> = std::result::Result<T, Error>;
