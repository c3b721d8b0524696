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

/// A work request's scatter/gather list: what `ibv_send_wr`'s `sg_list` and `num_sge`
/// say. Up to [`SgList::INLINE`] entries are held in the list itself, so that posting a
/// work request with one or two entries allocates nothing; longer lists go to the heap.
/// It dereferences to a slice of [`Sge`]s; build one with [`sgl!`](crate::sgl), from an
/// array, a `Vec` or an iterator.
///
/// ```
/// use softrdma_proto::{qp::Sge, sgl, Lkey, SgList};
/// let a = Sge { addr: 0x1000, length: 64, lkey: Lkey(7) };
/// let b = Sge { addr: 0x2000, length: 16, lkey: Lkey(7) };
/// let list: SgList = sgl![a, b];
/// assert_eq!(&list[..], &[a, b]);
/// assert_eq!(list, SgList::from(vec![a, b]));
/// assert!(sgl![].is_empty());
/// ```
#[derive(Clone)]
pub struct SgList(SgRepr);

#[derive(Clone)]
enum SgRepr {
    Inline { len: u8, sges: [Sge; SgList::INLINE] },
    Heap(Vec<Sge>),
}

impl SgList {
    /// Entries held without an allocation.
    pub const INLINE: usize = 2;
    const EMPTY: Sge = Sge { addr: 0, length: 0, lkey: Lkey(0) };

    /// An empty list.
    pub const fn new() -> SgList {
        SgList(SgRepr::Inline { len: 0, sges: [Self::EMPTY; Self::INLINE] })
    }

    /// Empties the list.
    pub fn clear(&mut self) {
        *self = SgList::new();
    }

    /// Appends an entry (moving the list to the heap past [`Self::INLINE`] entries).
    pub fn push(&mut self, sge: Sge) {
        match &mut self.0 {
            SgRepr::Inline { len, sges } if usize::from(*len) < Self::INLINE => {
                sges[usize::from(*len)] = sge;
                *len += 1;
            }
            SgRepr::Inline { len, sges } => {
                let mut v = Vec::with_capacity(usize::from(*len) * 2);
                v.extend_from_slice(&sges[..usize::from(*len)]);
                v.push(sge);
                self.0 = SgRepr::Heap(v);
            }
            SgRepr::Heap(v) => v.push(sge),
        }
    }
}

impl Default for SgList {
    fn default() -> SgList {
        SgList::new()
    }
}

impl core::ops::Deref for SgList {
    type Target = [Sge];
    fn deref(&self) -> &[Sge] {
        match &self.0 {
            SgRepr::Inline { len, sges } => &sges[..usize::from(*len)],
            SgRepr::Heap(v) => v,
        }
    }
}

impl core::ops::DerefMut for SgList {
    fn deref_mut(&mut self) -> &mut [Sge] {
        match &mut self.0 {
            SgRepr::Inline { len, sges } => &mut sges[..usize::from(*len)],
            SgRepr::Heap(v) => v,
        }
    }
}

impl core::fmt::Debug for SgList {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq for SgList {
    fn eq(&self, other: &SgList) -> bool {
        self[..] == other[..]
    }
}

impl Eq for SgList {}

impl PartialEq<[Sge]> for SgList {
    fn eq(&self, other: &[Sge]) -> bool {
        self[..] == *other
    }
}

impl<const N: usize> PartialEq<[Sge; N]> for SgList {
    fn eq(&self, other: &[Sge; N]) -> bool {
        self[..] == other[..]
    }
}

impl PartialEq<Vec<Sge>> for SgList {
    fn eq(&self, other: &Vec<Sge>) -> bool {
        self[..] == other[..]
    }
}

impl Extend<Sge> for SgList {
    fn extend<I: IntoIterator<Item = Sge>>(&mut self, iter: I) {
        for sge in iter {
            self.push(sge);
        }
    }
}

impl FromIterator<Sge> for SgList {
    fn from_iter<I: IntoIterator<Item = Sge>>(iter: I) -> SgList {
        let iter = iter.into_iter();
        if iter.size_hint().0 > Self::INLINE {
            // Known to be long: one allocation, as `collect::<Vec<_>>` makes.
            return SgList(SgRepr::Heap(iter.collect()));
        }
        let mut list = SgList::new();
        for sge in iter {
            list.push(sge);
        }
        list
    }
}

impl<const N: usize> From<[Sge; N]> for SgList {
    fn from(sges: [Sge; N]) -> SgList {
        if N <= Self::INLINE {
            // Written in place: `sgl![sge]` is on every post's path.
            let mut inline = [Self::EMPTY; Self::INLINE];
            inline[..N].copy_from_slice(&sges);
            SgList(SgRepr::Inline { len: N as u8, sges: inline })
        } else {
            SgList(SgRepr::Heap(sges.to_vec()))
        }
    }
}

impl From<Vec<Sge>> for SgList {
    fn from(v: Vec<Sge>) -> SgList {
        if v.len() <= Self::INLINE {
            v.into_iter().collect()
        } else {
            SgList(SgRepr::Heap(v))
        }
    }
}

impl From<&[Sge]> for SgList {
    fn from(s: &[Sge]) -> SgList {
        if s.len() > Self::INLINE {
            SgList(SgRepr::Heap(s.to_vec()))
        } else {
            s.iter().copied().collect()
        }
    }
}

impl<'a> IntoIterator for &'a SgList {
    type Item = &'a Sge;
    type IntoIter = core::slice::Iter<'a, Sge>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Builds an [`SgList`] from its entries, as `vec!` builds a `Vec`: `sgl![]`,
/// `sgl![mr.sge(0, 64)?]`, `sgl![a, b, c]`.
#[macro_export]
macro_rules! sgl {
    ($($sge:expr),* $(,)?) => {
        <$crate::SgList as ::core::convert::From<[_; _]>>::from([$($sge),*])
    };
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
    pub sg_list: SgList,
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
    pub sg_list: SgList,
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

#[cfg(test)]
mod tests {
    use super::{SgList, Sge};
    use crate::Lkey;

    fn sge(k: u64) -> Sge {
        Sge { addr: k * 0x100, length: k as u32, lkey: Lkey(k as u32) }
    }

    #[test]
    fn a_scatter_gather_list_keeps_its_entries_in_order_inline_and_on_the_heap() {
        let all: Vec<Sge> = (1..=5).map(sge).collect();
        let mut list = SgList::new();
        for (n, s) in all.iter().enumerate() {
            list.push(*s);
            assert_eq!(&list[..], &all[..=n], "after {} pushes", n + 1);
        }
        // Built any way, the same entries make equal lists, whatever holds them.
        assert_eq!(list, SgList::from(all.clone()));
        assert_eq!(list, all.iter().copied().collect::<SgList>());
        assert_eq!(SgList::from([sge(1), sge(2)]), SgList::from(vec![sge(1), sge(2)]));
        assert_ne!(SgList::from([sge(1), sge(2)]), SgList::from([sge(1)]));
        assert_eq!(crate::sgl![sge(1), sge(2), sge(3)], SgList::from(&all[..3]));
        // Entries can be changed in place (a key fixed up after the list was built).
        list[4].lkey = Lkey(99);
        assert_eq!(list[4].lkey, Lkey(99));
        // Compared with what it was built from, and grown from an iterator.
        assert_eq!(crate::sgl![sge(1)], [sge(1)]);
        assert_eq!(SgList::from(&all[..4]), all[..4].to_vec());
        let four = SgList::from(&all[..4]);
        assert!(four == all[..4]);
        let mut grown = crate::sgl![sge(1)];
        grown.extend(all[1..].iter().copied());
        assert_eq!(grown, all);
        list.clear();
        assert!(list.is_empty());
        assert_eq!(format!("{:?}", crate::sgl![sge(1)]), format!("{:?}", [sge(1)]));
    }
}
