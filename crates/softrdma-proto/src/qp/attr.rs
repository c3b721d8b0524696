//! QP types, states, attributes and the rules of `modify` (`ibv_modify_qp`).

use core::net::SocketAddr;

use crate::memory::Access;
use crate::{Psn, Qkey, Qpn};

/// The transport service of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    /// Reliable Connected.
    Rc,
    /// Unreliable Connected.
    Uc,
    /// Unreliable Datagram.
    Ud,
}

/// QP states (`ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created or reset: nothing can be posted or received.
    Reset,
    /// Receives may be posted; nothing moves.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained: no new send WQE starts.
    Sqd,
    /// Send queue error (UC, UD): receives still work.
    Sqe,
    /// Error: every WQE is flushed, nothing moves.
    Error,
}

/// Path MTU (`ibv_mtu`): payload bytes per packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

/// The bytes a device keeps between its path MTU and its link's MTU ([`Mtu::for_link`])
/// for the IP, UDP and RoCE headers (rdma_cm subtracts 96, rxe 80; we take 96).
pub const PMTU_HEADROOM: usize = 96;

impl Mtu {
    /// Payload bytes per packet.
    pub const fn bytes(self) -> u32 {
        128 << (self as u32)
    }
    /// From the `ibv_mtu` enum value 1–5.
    pub const fn from_enum(v: u8) -> Option<Mtu> {
        Some(match v {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => return None,
        })
    }
    /// The largest MTU whose packets fit a link of `link_mtu` bytes, [`PMTU_HEADROOM`]
    /// below it.
    pub fn for_link(link_mtu: u32) -> Option<Mtu> {
        [Mtu::Mtu4096, Mtu::Mtu2048, Mtu::Mtu1024, Mtu::Mtu512, Mtu::Mtu256]
            .into_iter()
            .find(|m| (m.bytes() as usize) + PMTU_HEADROOM <= link_mtu as usize)
    }
}

/// Attributes for [`super::QueuePair::modify`]: `Some` fields are the attribute mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttr {
    /// New state.
    pub state: Option<QpState>,
    /// P_Key table index; only 0 exists.
    pub pkey_index: Option<u16>,
    /// Port; only 1 exists.
    pub port: Option<u8>,
    /// Remote access the QP allows (REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC).
    pub access_flags: Option<Access>,
    /// UD Q_Key.
    pub qkey: Option<Qkey>,
    /// Path MTU (RC, UC).
    pub path_mtu: Option<Mtu>,
    /// The peer's address (IP and UDP port): the address vector (RC, UC).
    pub remote: Option<SocketAddr>,
    /// The address vector's traffic class (IP TOS byte); part of the AV attribute.
    pub traffic_class: Option<u8>,
    /// The peer's QP (RC, UC).
    pub dest_qpn: Option<Qpn>,
    /// First PSN expected from the peer.
    pub rq_psn: Option<Psn>,
    /// First PSN to send.
    pub sq_psn: Option<Psn>,
    /// READs and atomics this QP may have outstanding (initiator depth).
    pub max_rd_atomic: Option<u8>,
    /// READs and atomics the peer may have outstanding here (responder resources).
    pub max_dest_rd_atomic: Option<u8>,
    /// RNR timer code (0–31) this QP asks peers to wait.
    pub min_rnr_timer: Option<u8>,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout; 0 means no timeout.
    pub timeout: Option<u8>,
    /// Retries after a timeout (0–7; 7 is seven, not infinite).
    pub retry_cnt: Option<u8>,
    /// Retries after an RNR NAK (0–7; 7 means infinite).
    pub rnr_retry: Option<u8>,
}

/// `ibv_qp_attr_mask`: which attributes of an `ibv_modify_qp` call are meant, with
/// rdma-core's bit values. [`QpAttr`] carries its mask in its `Option`s; this type is for
/// callers that hold attributes and a mask apart, as the C API does
/// ([`QpAttr::masked`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct QpAttrMask(pub u32);

impl QpAttrMask {
    /// `IBV_QP_STATE`.
    pub const STATE: QpAttrMask = QpAttrMask(1 << 0);
    /// `IBV_QP_CUR_STATE`.
    pub const CUR_STATE: QpAttrMask = QpAttrMask(1 << 1);
    /// `IBV_QP_EN_SQD_ASYNC_NOTIFY`.
    pub const EN_SQD_ASYNC_NOTIFY: QpAttrMask = QpAttrMask(1 << 2);
    /// `IBV_QP_ACCESS_FLAGS`.
    pub const ACCESS_FLAGS: QpAttrMask = QpAttrMask(1 << 3);
    /// `IBV_QP_PKEY_INDEX`.
    pub const PKEY_INDEX: QpAttrMask = QpAttrMask(1 << 4);
    /// `IBV_QP_PORT`.
    pub const PORT: QpAttrMask = QpAttrMask(1 << 5);
    /// `IBV_QP_QKEY`.
    pub const QKEY: QpAttrMask = QpAttrMask(1 << 6);
    /// `IBV_QP_AV`.
    pub const AV: QpAttrMask = QpAttrMask(1 << 7);
    /// `IBV_QP_PATH_MTU`.
    pub const PATH_MTU: QpAttrMask = QpAttrMask(1 << 8);
    /// `IBV_QP_TIMEOUT`.
    pub const TIMEOUT: QpAttrMask = QpAttrMask(1 << 9);
    /// `IBV_QP_RETRY_CNT`.
    pub const RETRY_CNT: QpAttrMask = QpAttrMask(1 << 10);
    /// `IBV_QP_RNR_RETRY`.
    pub const RNR_RETRY: QpAttrMask = QpAttrMask(1 << 11);
    /// `IBV_QP_RQ_PSN`.
    pub const RQ_PSN: QpAttrMask = QpAttrMask(1 << 12);
    /// `IBV_QP_MAX_QP_RD_ATOMIC`.
    pub const MAX_QP_RD_ATOMIC: QpAttrMask = QpAttrMask(1 << 13);
    /// `IBV_QP_ALT_PATH` (automatic path migration; not supported).
    pub const ALT_PATH: QpAttrMask = QpAttrMask(1 << 14);
    /// `IBV_QP_MIN_RNR_TIMER`.
    pub const MIN_RNR_TIMER: QpAttrMask = QpAttrMask(1 << 15);
    /// `IBV_QP_SQ_PSN`.
    pub const SQ_PSN: QpAttrMask = QpAttrMask(1 << 16);
    /// `IBV_QP_MAX_DEST_RD_ATOMIC`.
    pub const MAX_DEST_RD_ATOMIC: QpAttrMask = QpAttrMask(1 << 17);
    /// `IBV_QP_PATH_MIG_STATE` (not supported).
    pub const PATH_MIG_STATE: QpAttrMask = QpAttrMask(1 << 18);
    /// `IBV_QP_CAP` (resizing queues; not supported).
    pub const CAP: QpAttrMask = QpAttrMask(1 << 19);
    /// `IBV_QP_DEST_QPN`.
    pub const DEST_QPN: QpAttrMask = QpAttrMask(1 << 20);
    /// `IBV_QP_RATE_LIMIT` (not supported).
    pub const RATE_LIMIT: QpAttrMask = QpAttrMask(1 << 25);

    /// Whether every bit of `other` is set.
    pub const fn contains(self, other: QpAttrMask) -> bool {
        self.0 & other.0 == other.0
    }
}

impl core::ops::BitOr for QpAttrMask {
    type Output = QpAttrMask;
    fn bitor(self, rhs: QpAttrMask) -> QpAttrMask {
        QpAttrMask(self.0 | rhs.0)
    }
}

impl QpAttr {
    /// The `ibv_qp_attr_mask` of the attributes set.
    pub fn attr_mask(&self) -> QpAttrMask {
        let pairs = [
            (self.state.is_some(), QpAttrMask::STATE),
            (self.pkey_index.is_some(), QpAttrMask::PKEY_INDEX),
            (self.port.is_some(), QpAttrMask::PORT),
            (self.access_flags.is_some(), QpAttrMask::ACCESS_FLAGS),
            (self.qkey.is_some(), QpAttrMask::QKEY),
            (self.path_mtu.is_some(), QpAttrMask::PATH_MTU),
            (self.remote.is_some() || self.traffic_class.is_some(), QpAttrMask::AV),
            (self.dest_qpn.is_some(), QpAttrMask::DEST_QPN),
            (self.rq_psn.is_some(), QpAttrMask::RQ_PSN),
            (self.sq_psn.is_some(), QpAttrMask::SQ_PSN),
            (self.max_rd_atomic.is_some(), QpAttrMask::MAX_QP_RD_ATOMIC),
            (self.max_dest_rd_atomic.is_some(), QpAttrMask::MAX_DEST_RD_ATOMIC),
            (self.min_rnr_timer.is_some(), QpAttrMask::MIN_RNR_TIMER),
            (self.timeout.is_some(), QpAttrMask::TIMEOUT),
            (self.retry_cnt.is_some(), QpAttrMask::RETRY_CNT),
            (self.rnr_retry.is_some(), QpAttrMask::RNR_RETRY),
        ];
        pairs.iter().filter(|(on, _)| *on).fold(QpAttrMask(0), |m, (_, b)| m | *b)
    }

    /// The attributes `mask` names, as `ibv_modify_qp` reads them: fields outside the mask
    /// are dropped. Fails if the mask names an attribute `self` does not hold, or one
    /// softrdma does not support (alternate paths, path migration, resizing, rate limits;
    /// `CUR_STATE` and `EN_SQD_ASYNC_NOTIFY` are accepted and ignored).
    pub fn masked(&self, mask: QpAttrMask) -> Result<QpAttr, ModifyError> {
        let unsupported = [
            (QpAttrMask::ALT_PATH, "alt_path"),
            (QpAttrMask::PATH_MIG_STATE, "path_mig_state"),
            (QpAttrMask::CAP, "cap"),
            (QpAttrMask::RATE_LIMIT, "rate_limit"),
        ];
        for (bit, name) in unsupported {
            if mask.contains(bit) {
                return Err(ModifyError::Unsupported(name));
            }
        }
        let known = self.attr_mask().0 | QpAttrMask::CUR_STATE.0 | QpAttrMask::EN_SQD_ASYNC_NOTIFY.0;
        let all = ((1u32 << 21) - 1) | QpAttrMask::RATE_LIMIT.0;
        if mask.0 & !all != 0 {
            return Err(ModifyError::OutOfRange("attr_mask"));
        }
        let pick = |bit: QpAttrMask| mask.contains(bit);
        let out = QpAttr {
            state: self.state.filter(|_| pick(QpAttrMask::STATE)),
            pkey_index: self.pkey_index.filter(|_| pick(QpAttrMask::PKEY_INDEX)),
            port: self.port.filter(|_| pick(QpAttrMask::PORT)),
            access_flags: self.access_flags.filter(|_| pick(QpAttrMask::ACCESS_FLAGS)),
            qkey: self.qkey.filter(|_| pick(QpAttrMask::QKEY)),
            path_mtu: self.path_mtu.filter(|_| pick(QpAttrMask::PATH_MTU)),
            remote: self.remote.filter(|_| pick(QpAttrMask::AV)),
            traffic_class: self.traffic_class.filter(|_| pick(QpAttrMask::AV)),
            dest_qpn: self.dest_qpn.filter(|_| pick(QpAttrMask::DEST_QPN)),
            rq_psn: self.rq_psn.filter(|_| pick(QpAttrMask::RQ_PSN)),
            sq_psn: self.sq_psn.filter(|_| pick(QpAttrMask::SQ_PSN)),
            max_rd_atomic: self.max_rd_atomic.filter(|_| pick(QpAttrMask::MAX_QP_RD_ATOMIC)),
            max_dest_rd_atomic: self.max_dest_rd_atomic.filter(|_| pick(QpAttrMask::MAX_DEST_RD_ATOMIC)),
            min_rnr_timer: self.min_rnr_timer.filter(|_| pick(QpAttrMask::MIN_RNR_TIMER)),
            timeout: self.timeout.filter(|_| pick(QpAttrMask::TIMEOUT)),
            retry_cnt: self.retry_cnt.filter(|_| pick(QpAttrMask::RETRY_CNT)),
            rnr_retry: self.rnr_retry.filter(|_| pick(QpAttrMask::RNR_RETRY)),
        };
        let missing = mask.0 & !known & !(QpAttrMask::CUR_STATE.0 | QpAttrMask::EN_SQD_ASYNC_NOTIFY.0);
        if missing != 0 {
            return Err(ModifyError::Missing(mask_name(missing.trailing_zeros())));
        }
        Ok(out)
    }
}

fn mask_name(bit: u32) -> &'static str {
    const NAMES: [&str; 21] = [
        "state",
        "cur_state",
        "en_sqd_async_notify",
        "access_flags",
        "pkey_index",
        "port",
        "qkey",
        "av",
        "path_mtu",
        "timeout",
        "retry_cnt",
        "rnr_retry",
        "rq_psn",
        "max_rd_atomic",
        "alt_path",
        "min_rnr_timer",
        "sq_psn",
        "max_dest_rd_atomic",
        "path_mig_state",
        "cap",
        "dest_qpn",
    ];
    NAMES.get(bit as usize).copied().unwrap_or("rate_limit")
}

/// Why `modify` refused; nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModifyError {
    /// The transition is not allowed for this QP type.
    #[error("cannot move a {qp_type:?} QP from {from:?} to {to:?}")]
    InvalidTransition {
        /// The QP's type.
        qp_type: QpType,
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// A required attribute is missing.
    #[error("attribute {0} is required for this transition")]
    Missing(&'static str),
    /// An attribute that this transition does not take was given.
    #[error("attribute {0} is not allowed in this transition")]
    NotAllowed(&'static str),
    /// An attribute's value is out of range.
    #[error("attribute {0} is out of range")]
    OutOfRange(&'static str),
    /// An attribute verbs defines that softrdma does not implement.
    #[error("attribute {0} is not supported")]
    Unsupported(&'static str),
}

/// Attribute names, in the order of the fields of [`QpAttr`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mask(u32);

impl Mask {
    pub(crate) const PKEY: Mask = Mask(1 << 0);
    pub(crate) const PORT: Mask = Mask(1 << 1);
    pub(crate) const ACCESS: Mask = Mask(1 << 2);
    pub(crate) const QKEY: Mask = Mask(1 << 3);
    pub(crate) const MTU: Mask = Mask(1 << 4);
    pub(crate) const AV: Mask = Mask(1 << 5);
    pub(crate) const DEST_QPN: Mask = Mask(1 << 6);
    pub(crate) const RQ_PSN: Mask = Mask(1 << 7);
    pub(crate) const SQ_PSN: Mask = Mask(1 << 8);
    pub(crate) const MAX_RD: Mask = Mask(1 << 9);
    pub(crate) const MAX_DEST_RD: Mask = Mask(1 << 10);
    pub(crate) const MIN_RNR: Mask = Mask(1 << 11);
    pub(crate) const TIMEOUT: Mask = Mask(1 << 12);
    pub(crate) const RETRY: Mask = Mask(1 << 13);
    pub(crate) const RNR_RETRY: Mask = Mask(1 << 14);
    const NAMES: [&'static str; 15] = [
        "pkey_index",
        "port",
        "access_flags",
        "qkey",
        "path_mtu",
        "remote",
        "dest_qpn",
        "rq_psn",
        "sq_psn",
        "max_rd_atomic",
        "max_dest_rd_atomic",
        "min_rnr_timer",
        "timeout",
        "retry_cnt",
        "rnr_retry",
    ];
    const fn or(self, o: Mask) -> Mask {
        Mask(self.0 | o.0)
    }
    const EMPTY: Mask = Mask(0);

    fn first_name(self) -> &'static str {
        Self::NAMES[self.0.trailing_zeros() as usize]
    }
}

impl QpAttr {
    pub(crate) fn mask(&self) -> Mask {
        let mut m = Mask::EMPTY;
        let set = |on: bool, bit: Mask, m: &mut Mask| {
            if on {
                *m = m.or(bit);
            }
        };
        set(self.pkey_index.is_some(), Mask::PKEY, &mut m);
        set(self.port.is_some(), Mask::PORT, &mut m);
        set(self.access_flags.is_some(), Mask::ACCESS, &mut m);
        set(self.qkey.is_some(), Mask::QKEY, &mut m);
        set(self.path_mtu.is_some(), Mask::MTU, &mut m);
        set(self.remote.is_some() || self.traffic_class.is_some(), Mask::AV, &mut m);
        set(self.dest_qpn.is_some(), Mask::DEST_QPN, &mut m);
        set(self.rq_psn.is_some(), Mask::RQ_PSN, &mut m);
        set(self.sq_psn.is_some(), Mask::SQ_PSN, &mut m);
        set(self.max_rd_atomic.is_some(), Mask::MAX_RD, &mut m);
        set(self.max_dest_rd_atomic.is_some(), Mask::MAX_DEST_RD, &mut m);
        set(self.min_rnr_timer.is_some(), Mask::MIN_RNR, &mut m);
        set(self.timeout.is_some(), Mask::TIMEOUT, &mut m);
        set(self.retry_cnt.is_some(), Mask::RETRY, &mut m);
        set(self.rnr_retry.is_some(), Mask::RNR_RETRY, &mut m);
        m
    }
}

/// Checks a transition against `ibv_modify_qp`'s table of required and optional attributes.
pub(crate) fn check_transition(
    qp_type: QpType,
    from: QpState,
    to: QpState,
    attr: &QpAttr,
    max_rd_atomic_limit: u8,
) -> Result<(), ModifyError> {
    use QpState::*;
    use QpType::*;
    let m = |ms: &[Mask]| ms.iter().fold(Mask::EMPTY, |a, b| a.or(*b));
    let connected = qp_type != Ud;
    let key = if connected { Mask::ACCESS } else { Mask::QKEY };
    let (required, optional) = match (from, to) {
        (_, Reset) | (_, Error) => (Mask::EMPTY, Mask::EMPTY),
        (Reset, Init) => (m(&[Mask::PKEY, Mask::PORT, key]), Mask::EMPTY),
        (Init, Init) => (Mask::EMPTY, m(&[Mask::PKEY, Mask::PORT, key])),
        (Init, Rtr) => match qp_type {
            Rc => (
                m(&[Mask::AV, Mask::MTU, Mask::DEST_QPN, Mask::RQ_PSN, Mask::MAX_DEST_RD, Mask::MIN_RNR]),
                m(&[Mask::ACCESS, Mask::PKEY]),
            ),
            Uc => (m(&[Mask::AV, Mask::MTU, Mask::DEST_QPN, Mask::RQ_PSN]), m(&[Mask::ACCESS, Mask::PKEY])),
            Ud => (Mask::EMPTY, m(&[Mask::QKEY, Mask::PKEY])),
        },
        (Rtr, Rts) => match qp_type {
            Rc => (
                m(&[Mask::SQ_PSN, Mask::TIMEOUT, Mask::RETRY, Mask::RNR_RETRY, Mask::MAX_RD]),
                m(&[Mask::ACCESS, Mask::MIN_RNR]),
            ),
            Uc => (m(&[Mask::SQ_PSN]), m(&[Mask::ACCESS])),
            Ud => (m(&[Mask::SQ_PSN]), m(&[Mask::QKEY])),
        },
        (Rts, Rts) | (Sqd, Rts) | (Sqe, Rts) => {
            if from == Sqe && qp_type == Rc {
                return Err(ModifyError::InvalidTransition { qp_type, from, to });
            }
            (Mask::EMPTY, m(&[key, Mask::MIN_RNR]))
        }
        (Rts, Sqd) | (Sqd, Sqd) => (Mask::EMPTY, Mask::EMPTY),
        _ => return Err(ModifyError::InvalidTransition { qp_type, from, to }),
    };
    if attr.traffic_class.is_some() && attr.remote.is_none() {
        // An address vector is a whole: its traffic class alone names no peer.
        return Err(ModifyError::Missing("remote"));
    }
    let given = attr.mask();
    let missing = Mask(required.0 & !given.0);
    if missing.0 != 0 {
        return Err(ModifyError::Missing(missing.first_name()));
    }
    let extra = Mask(given.0 & !(required.0 | optional.0));
    if extra.0 != 0 {
        return Err(ModifyError::NotAllowed(extra.first_name()));
    }
    let range = |v: Option<u8>, max: u8, name| match v {
        Some(v) if v > max => Err(ModifyError::OutOfRange(name)),
        _ => Ok(()),
    };
    range(attr.retry_cnt, 7, "retry_cnt")?;
    range(attr.rnr_retry, 7, "rnr_retry")?;
    range(attr.timeout, 31, "timeout")?;
    range(attr.min_rnr_timer, 31, "min_rnr_timer")?;
    range(attr.max_rd_atomic, max_rd_atomic_limit, "max_rd_atomic")?;
    range(attr.max_dest_rd_atomic, max_rd_atomic_limit, "max_dest_rd_atomic")?;
    range(attr.port.map(|p| p.wrapping_sub(1)), 0, "port")?;
    if attr.pkey_index.is_some_and(|i| i != 0) {
        return Err(ModifyError::OutOfRange("pkey_index"));
    }
    if attr.qkey.is_some_and(|q| q.is_controlled()) {
        // Controlled Q_Keys are privileged (CAP_NET_RAW in Linux); QP1 is set up internally.
        return Err(ModifyError::OutOfRange("qkey"));
    }
    Ok(())
}
