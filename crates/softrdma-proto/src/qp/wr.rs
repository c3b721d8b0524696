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

/// The status of a work completion (`ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocProtErr = 4,
    WrFlushErr = 5,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    RemInvRdReqErr = 15,
    GeneralErr = 21,
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
