//! Work requests and work completions: what users post and what they poll.

use core::net::SocketAddr;

use crate::{Lkey, Qkey, Qpn, Rkey};

/// One scatter/gather entry: `length` bytes at `addr` in the region named by `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sge {
    /// Start address in the region's address space.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region.
    pub lkey: Lkey,
}

/// The operation of a send work request (`ibv_wr_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendOp {
    /// SEND: consumes a receive WQE at the peer.
    Send,
    /// SEND with 32 bits of immediate data.
    SendWithImm(u32),
    /// SEND that invalidates an R_Key at the peer.
    SendWithInv(Rkey),
    /// RDMA WRITE to the peer's memory.
    Write {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: Rkey,
    },
    /// RDMA WRITE with immediate data, which consumes a receive WQE at the peer.
    WriteWithImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: Rkey,
        /// Immediate data.
        imm: u32,
    },
    /// RDMA READ from the peer's memory into the local scatter list.
    Read {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: Rkey,
    },
    /// Atomic compare-and-swap of the u64 at the remote address; the old value lands in the
    /// first 8 bytes of the scatter list.
    CompareSwap {
        /// Remote address, 8-byte aligned.
        remote_addr: u64,
        /// Remote key.
        rkey: Rkey,
        /// Expected value.
        compare: u64,
        /// Value stored on a match.
        swap: u64,
    },
    /// Atomic fetch-and-add of the u64 at the remote address.
    FetchAdd {
        /// Remote address, 8-byte aligned.
        remote_addr: u64,
        /// Remote key.
        rkey: Rkey,
        /// Addend.
        add: u64,
    },
}

impl SendOp {
    /// Whether the operation is a READ or an atomic (limited by `max_rd_atomic`).
    pub fn is_read_or_atomic(&self) -> bool {
        matches!(self, SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }
    /// Whether the operation is an atomic.
    pub fn is_atomic(&self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }
    /// The completion opcode of the operation.
    pub fn wc_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_) => WcOpcode::Send,
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompareSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }
}

/// Flags of a send work request (`ibv_send_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SendFlags {
    /// Produce a completion on success (errors always produce one).
    pub signaled: bool,
    /// Ask for a solicited event at the receiver.
    pub solicited: bool,
    /// Wait for earlier READs and atomics to complete before starting.
    pub fence: bool,
    /// Copy the data when the request is posted, so its buffers may be reused at once.
    pub inline: bool,
}

/// The destination of a UD send: an address handle plus the remote QP and Q_Key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdDest {
    /// The peer's IP address and UDP port.
    pub addr: SocketAddr,
    /// The peer's QP.
    pub qpn: Qpn,
    /// The Q_Key to put in the DETH.
    pub qkey: Qkey,
    /// The traffic class (IP TOS byte: DSCP and ECN) the datagram carries.
    pub traffic_class: u8,
}

/// A send work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local data: gathered for SEND/WRITE, scattered into for READ and atomics.
    pub sg_list: Vec<Sge>,
    /// Flags.
    pub flags: SendFlags,
    /// Destination, for UD QPs only.
    pub ud: Option<UdDest>,
}

/// A receive work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where incoming data lands.
    pub sg_list: Vec<Sge>,
}

/// The status of a work completion (`ibv_wc_status`; the values are verbs').
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// The work request completed.
    Success = 0,
    /// A receive buffer was too small for the message, or a message too long for the
    /// port (the responder NAKs invalid request).
    LocLenErr = 1,
    /// A local QP error: the work request could not be carried out (e.g. a UD message
    /// longer than the MTU).
    LocQpOpErr = 2,
    /// A local protection error: an lkey that does not exist, of another PD, without
    /// LOCAL_WRITE where data lands, or out of its region's bounds.
    LocProtErr = 4,
    /// The QP went to ERROR before this work request completed; nothing is known of it.
    WrFlushErr = 5,
    /// A response the requester cannot take (wrong size, a NAK in a READ response's place).
    BadRespErr = 7,
    /// A local access error (a SEND_WITH_INVALIDATE that could not invalidate).
    LocAccessErr = 8,
    /// The peer NAKed invalid request: an opcode its QP does not allow (no remote rights on
    /// the QP), a misaligned atomic, a message longer than its receive buffer.
    RemInvReqErr = 9,
    /// The peer NAKed remote access error: an R_Key that does not exist, of another PD,
    /// without the right, or a range out of the region's bounds.
    RemAccessErr = 10,
    /// The peer NAKed remote operational error: it could not carry out a valid request.
    RemOpErr = 11,
    /// No ACK came after `retry_cnt` retransmissions: the peer is gone or unreachable.
    RetryExcErr = 12,
    /// The peer answered receiver-not-ready `rnr_retry` times: it posts no receives.
    RnrRetryExcErr = 13,
    /// The peer NAKed invalid RD request (more READs or atomics than it allows).
    RemInvRdReqErr = 15,
    /// Anything else.
    GeneralErr = 21,
}

impl WcStatus {
    /// Whether the work request completed.
    pub const fn is_success(self) -> bool {
        matches!(self, WcStatus::Success)
    }

    /// What `ibv_wc_status_str` prints for it.
    pub const fn as_str(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::LocLenErr => "local length error",
            WcStatus::LocQpOpErr => "local QP operation error",
            WcStatus::LocProtErr => "local protection error",
            WcStatus::WrFlushErr => "Work Request Flushed Error",
            WcStatus::BadRespErr => "bad response error",
            WcStatus::LocAccessErr => "local access error",
            WcStatus::RemInvReqErr => "remote invalid request error",
            WcStatus::RemAccessErr => "remote access error",
            WcStatus::RemOpErr => "remote operation error",
            WcStatus::RetryExcErr => "transport retry counter exceeded",
            WcStatus::RnrRetryExcErr => "RNR retry counter exceeded",
            WcStatus::RemInvRdReqErr => "remote invalid RD request",
            WcStatus::GeneralErr => "general error",
        }
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The opcode of a work completion (`ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum WcOpcode {
    Send,
    RdmaWrite,
    RdmaRead,
    CompareSwap,
    FetchAdd,
    Recv,
    RecvRdmaWithImm,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkCompletion {
    /// The work request's `wr_id`.
    pub wr_id: u64,
    /// Success or the error.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes received (receives), or read (READ); 0 otherwise.
    pub byte_len: u32,
    /// Immediate data, if the message carried some.
    pub imm_data: Option<u32>,
    /// The R_Key a SEND_WITH_INVALIDATE invalidated.
    pub invalidated_rkey: Option<Rkey>,
    /// The local QP.
    pub qp_num: Qpn,
    /// The sender's QP (receives).
    pub src_qp: Qpn,
    /// The sender's address (receives).
    pub src: Option<SocketAddr>,
    /// A UD receive: the buffer starts with the 40-byte GRH area.
    pub grh: bool,
    /// The message asked for a solicited event.
    pub solicited: bool,
}
