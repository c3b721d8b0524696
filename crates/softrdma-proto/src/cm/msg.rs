//! The connection manager's messages (IBTA vol. 1 §12.6): REQ, MRA, REJ, REP, RTU, DREQ,
//! DREP, SIDR_REQ and SIDR_REP, each a 256-byte MAD on QP1 (the common header, then 232
//! bytes of message). Offsets below are from the start of the message, after the header.
//!
//! Parsing keeps every field, ECE vendor bytes and whole private-data areas included, so
//! that `emit(parse(mad)) == mad` for any well-formed MAD (the tests check it on every CM
//! message captured from Linux). Reserved bits are written as zero.

use crate::wire::mad::{MadHeader, MAD_LEN, MGMT_CLASS_CM};
use crate::wire::{be, Error as WireError};

/// The CM's class version (IBTA 1.2 and later).
pub const CM_CLASS_VERSION: u8 = 2;
/// The MAD method of every CM message (Send).
pub const METHOD_SEND: u8 = 0x03;

/// Attribute IDs of the CM messages.
#[allow(missing_docs)]
pub mod attr {
    pub const REQ: u16 = 0x0010;
    pub const MRA: u16 = 0x0011;
    pub const REJ: u16 = 0x0012;
    pub const REP: u16 = 0x0013;
    pub const RTU: u16 = 0x0014;
    pub const DREQ: u16 = 0x0015;
    pub const DREP: u16 = 0x0016;
    pub const SIDR_REQ: u16 = 0x0017;
    pub const SIDR_REP: u16 = 0x0018;
}

/// Bytes of message after the common header.
const BODY: usize = MAD_LEN - MadHeader::LEN;

/// Why a MAD is not a CM message softrdma understands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmParseError {
    /// Shorter than a MAD.
    #[error(transparent)]
    Truncated(#[from] WireError),
    /// Not the CM's management class.
    #[error("management class {0:#04x} is not the CM's (0x07)")]
    NotCm(u8),
    /// Base version other than 1.
    #[error("MAD base version {0}, expected 1")]
    BaseVersion(u8),
    /// Class version other than 2 (a REQ gets REJ reason 31).
    #[error("CM class version {0}, expected 2")]
    ClassVersion(u8),
    /// A method other than Send.
    #[error("CM method {0:#04x}, expected 0x03 (Send)")]
    Method(u8),
    /// An attribute the CM does not handle (ClassPortInfo, LAP, APR, unknown).
    #[error("CM attribute {0:#06x} not handled")]
    Attribute(u16),
}

/// The value of the bits of `mask` in `byte`, shifted down.
fn bits(byte: u8, mask: u8) -> u8 {
    (byte & mask) >> mask.trailing_zeros()
}

/// `value` placed in the bits of `mask` (excess bits dropped).
fn put_bits(value: u8, mask: u8) -> u8 {
    (value << mask.trailing_zeros()) & mask
}

/// A private-data area of `len` bytes from `b[at..]`.
fn area(b: &[u8], at: usize, len: usize) -> Vec<u8> {
    b[at..at + len].to_vec()
}

/// Writes `data` (at most `len` bytes; the rest zero) at `b[at..]`.
fn put_area(b: &mut [u8], at: usize, len: usize, data: &[u8]) {
    let n = data.len().min(len);
    b[at..at + n].copy_from_slice(&data[..n]);
}

/// A path as the REQ describes it (44 bytes: primary at 52, alternate at 96).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct CmPath {
    /// Local port LID (0xFFFF, permissive, on RoCE).
    pub local_lid: u16,
    /// Remote port LID.
    pub remote_lid: u16,
    /// Local port GID (IPv4-mapped for IPv4).
    pub local_gid: [u8; 16],
    /// Remote port GID.
    pub remote_gid: [u8; 16],
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Packet rate (6 bits).
    pub packet_rate: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Service level (4 bits).
    pub sl: u8,
    /// Subnet local.
    pub subnet_local: bool,
    /// Local ACK timeout (5 bits).
    pub local_ack_timeout: u8,
}

impl CmPath {
    const LEN: usize = 44;

    fn parse(b: &[u8]) -> CmPath {
        let mut local_gid = [0u8; 16];
        let mut remote_gid = [0u8; 16];
        local_gid.copy_from_slice(&b[4..20]);
        remote_gid.copy_from_slice(&b[20..36]);
        CmPath {
            local_lid: be::u16_at(b, 0),
            remote_lid: be::u16_at(b, 2),
            local_gid,
            remote_gid,
            flow_label: be::u32_at(b, 36) >> 12,
            packet_rate: bits(b[39], 0x3F),
            traffic_class: b[40],
            hop_limit: b[41],
            sl: bits(b[42], 0xF0),
            subnet_local: b[42] & 0x08 != 0,
            local_ack_timeout: bits(b[43], 0xF8),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        be::put_u16(b, 0, self.local_lid);
        be::put_u16(b, 2, self.remote_lid);
        b[4..20].copy_from_slice(&self.local_gid);
        b[20..36].copy_from_slice(&self.remote_gid);
        be::put_u32(b, 36, (self.flow_label & 0xF_FFFF) << 12);
        b[39] |= put_bits(self.packet_rate, 0x3F);
        b[40] = self.traffic_class;
        b[41] = self.hop_limit;
        b[42] = put_bits(self.sl, 0xF0) | if self.subnet_local { 0x08 } else { 0 };
        b[43] = put_bits(self.local_ack_timeout, 0xF8);
    }

    fn is_zero(&self) -> bool {
        *self == CmPath::default()
    }
}

/// REQ: the active side asks for a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Req {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// ECE vendor ID (bytes 5–7), 0 without ECE.
    pub ece_vendor_id: u32,
    /// The service asked for (rdma_cm: port space and port).
    pub service_id: u64,
    /// The sender's CA GUID.
    pub local_ca_guid: u64,
    /// Q_Key (RD only).
    pub local_qkey: u32,
    /// The sender's QP.
    pub local_qpn: u32,
    /// RDMA READs/atomics the sender accepts at once as responder.
    pub responder_resources: u8,
    /// RDMA READs/atomics the sender issues at once.
    pub initiator_depth: u8,
    /// Remote CM response timeout (5 bits, 4.096 µs × 2^t).
    pub remote_cm_response_timeout: u8,
    /// Transport service type (2 bits: 0 RC, 1 UC, 3 XRC).
    pub transport_type: u8,
    /// End-to-end flow control.
    pub e2e_flow_control: bool,
    /// The PSN the sender expects first (24 bits).
    pub starting_psn: u32,
    /// Local CM response timeout (5 bits).
    pub local_cm_response_timeout: u8,
    /// Transport retry count (3 bits).
    pub retry_count: u8,
    /// P_Key.
    pub pkey: u16,
    /// Path MTU (4 bits, `ibv_mtu` numbering).
    pub path_mtu: u8,
    /// RDC exists.
    pub rdc_exists: bool,
    /// RNR retry count (3 bits; 7 is infinite).
    pub rnr_retry_count: u8,
    /// Max CM retries (4 bits).
    pub max_cm_retries: u8,
    /// The sender's QP has an SRQ.
    pub srq: bool,
    /// Extended transport type (3 bits).
    pub extended_transport_type: u8,
    /// Primary path.
    pub primary_path: CmPath,
    /// Alternate path, if any.
    pub alternate_path: Option<CmPath>,
    /// Private data, 92 bytes (rdma_cm: its 36-byte header, then the user's).
    pub private_data: Vec<u8>,
}

impl Req {
    /// Bytes of private data a REQ carries.
    pub const PRIVATE_DATA_LEN: usize = 92;

    fn parse(b: &[u8]) -> Req {
        let alt = CmPath::parse(&b[96..96 + CmPath::LEN]);
        Req {
            local_comm_id: be::u32_at(b, 0),
            ece_vendor_id: be::u24_at(b, 5),
            service_id: be::u64_at(b, 8),
            local_ca_guid: be::u64_at(b, 16),
            local_qkey: be::u32_at(b, 28),
            local_qpn: be::u24_at(b, 32),
            responder_resources: b[35],
            initiator_depth: b[39],
            remote_cm_response_timeout: bits(b[43], 0xF8),
            transport_type: bits(b[43], 0x06),
            e2e_flow_control: b[43] & 0x01 != 0,
            starting_psn: be::u24_at(b, 44),
            local_cm_response_timeout: bits(b[47], 0xF8),
            retry_count: bits(b[47], 0x07),
            pkey: be::u16_at(b, 48),
            path_mtu: bits(b[50], 0xF0),
            rdc_exists: b[50] & 0x08 != 0,
            rnr_retry_count: bits(b[50], 0x07),
            max_cm_retries: bits(b[51], 0xF0),
            srq: b[51] & 0x08 != 0,
            extended_transport_type: bits(b[51], 0x07),
            primary_path: CmPath::parse(&b[52..52 + CmPath::LEN]),
            alternate_path: (!alt.is_zero()).then_some(alt),
            private_data: area(b, 140, Self::PRIVATE_DATA_LEN),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        be::put_u32(b, 0, self.local_comm_id);
        be::put_u24(b, 5, self.ece_vendor_id);
        be::put_u64(b, 8, self.service_id);
        be::put_u64(b, 16, self.local_ca_guid);
        be::put_u32(b, 28, self.local_qkey);
        be::put_u24(b, 32, self.local_qpn);
        b[35] = self.responder_resources;
        b[39] = self.initiator_depth;
        b[43] = put_bits(self.remote_cm_response_timeout, 0xF8)
            | put_bits(self.transport_type, 0x06)
            | u8::from(self.e2e_flow_control);
        be::put_u24(b, 44, self.starting_psn);
        b[47] = put_bits(self.local_cm_response_timeout, 0xF8) | put_bits(self.retry_count, 0x07);
        be::put_u16(b, 48, self.pkey);
        b[50] = put_bits(self.path_mtu, 0xF0)
            | if self.rdc_exists { 0x08 } else { 0 }
            | put_bits(self.rnr_retry_count, 0x07);
        b[51] = put_bits(self.max_cm_retries, 0xF0)
            | if self.srq { 0x08 } else { 0 }
            | put_bits(self.extended_transport_type, 0x07);
        self.primary_path.emit(&mut b[52..52 + CmPath::LEN]);
        if let Some(alt) = &self.alternate_path {
            alt.emit(&mut b[96..96 + CmPath::LEN]);
        }
        put_area(b, 140, Self::PRIVATE_DATA_LEN, &self.private_data);
    }
}

/// REP: the passive side accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rep {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The REQ's local communication ID.
    pub remote_comm_id: u32,
    /// Q_Key (RD only).
    pub local_qkey: u32,
    /// The sender's QP.
    pub local_qpn: u32,
    /// Local EECN (RD only).
    pub local_eecn: u32,
    /// The PSN the sender expects first.
    pub starting_psn: u32,
    /// ECE vendor ID (bytes 15, 19 and 23), 0 without ECE.
    pub ece_vendor_id: u32,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Target ACK delay (5 bits).
    pub target_ack_delay: u8,
    /// Failover accepted (2 bits).
    pub failover_accepted: u8,
    /// End-to-end flow control.
    pub e2e_flow_control: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// The sender's QP has an SRQ.
    pub srq: bool,
    /// The sender's CA GUID.
    pub local_ca_guid: u64,
    /// Private data, 196 bytes.
    pub private_data: Vec<u8>,
}

impl Rep {
    /// Bytes of private data a REP carries.
    pub const PRIVATE_DATA_LEN: usize = 196;

    fn parse(b: &[u8]) -> Rep {
        Rep {
            local_comm_id: be::u32_at(b, 0),
            remote_comm_id: be::u32_at(b, 4),
            local_qkey: be::u32_at(b, 8),
            local_qpn: be::u24_at(b, 12),
            local_eecn: be::u24_at(b, 16),
            starting_psn: be::u24_at(b, 20),
            ece_vendor_id: u32::from(b[15]) << 16 | u32::from(b[19]) << 8 | u32::from(b[23]),
            responder_resources: b[24],
            initiator_depth: b[25],
            target_ack_delay: bits(b[26], 0xF8),
            failover_accepted: bits(b[26], 0x06),
            e2e_flow_control: b[26] & 0x01 != 0,
            rnr_retry_count: bits(b[27], 0xE0),
            srq: b[27] & 0x10 != 0,
            local_ca_guid: be::u64_at(b, 28),
            private_data: area(b, 36, Self::PRIVATE_DATA_LEN),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        be::put_u32(b, 0, self.local_comm_id);
        be::put_u32(b, 4, self.remote_comm_id);
        be::put_u32(b, 8, self.local_qkey);
        be::put_u24(b, 12, self.local_qpn);
        be::put_u24(b, 16, self.local_eecn);
        be::put_u24(b, 20, self.starting_psn);
        let v = self.ece_vendor_id.to_be_bytes();
        (b[15], b[19], b[23]) = (v[1], v[2], v[3]);
        b[24] = self.responder_resources;
        b[25] = self.initiator_depth;
        b[26] = put_bits(self.target_ack_delay, 0xF8)
            | put_bits(self.failover_accepted, 0x06)
            | u8::from(self.e2e_flow_control);
        b[27] = put_bits(self.rnr_retry_count, 0xE0) | if self.srq { 0x10 } else { 0 };
        be::put_u64(b, 28, self.local_ca_guid);
        put_area(b, 36, Self::PRIVATE_DATA_LEN, &self.private_data);
    }
}

/// The two communication IDs most messages start with, and their private data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The receiver's communication ID.
    pub remote_comm_id: u32,
}

impl Ids {
    fn parse(b: &[u8]) -> Ids {
        Ids { local_comm_id: be::u32_at(b, 0), remote_comm_id: be::u32_at(b, 4) }
    }
    fn emit(&self, b: &mut [u8]) {
        be::put_u32(b, 0, self.local_comm_id);
        be::put_u32(b, 4, self.remote_comm_id);
    }
}

/// Which message a REJ or MRA answers (2 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgKind {
    /// The REQ.
    Req,
    /// The REP.
    Rep,
    /// Another message (LAP).
    Other,
    /// The reserved value 3.
    Reserved,
}

impl MsgKind {
    fn from_bits(v: u8) -> MsgKind {
        match v {
            0 => MsgKind::Req,
            1 => MsgKind::Rep,
            2 => MsgKind::Other,
            _ => MsgKind::Reserved,
        }
    }
    fn bits(self) -> u8 {
        match self {
            MsgKind::Req => 0,
            MsgKind::Rep => 1,
            MsgKind::Other => 2,
            MsgKind::Reserved => 3,
        }
    }
}

/// REJ: a refusal, with a reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rej {
    /// Communication IDs (the remote one is 0 when a REQ is rejected before an ID exists).
    pub ids: Ids,
    /// The message rejected.
    pub rejected: MsgKind,
    /// Length of the additional rejection information (7 bits).
    pub ari_length: u8,
    /// The reason ([`RejReason`] names the common ones).
    pub reason: u16,
    /// Additional rejection information, 72 bytes.
    pub ari: Vec<u8>,
    /// Private data, 148 bytes (`rdma_reject`'s).
    pub private_data: Vec<u8>,
}

impl Rej {
    /// Bytes of private data a REJ carries.
    pub const PRIVATE_DATA_LEN: usize = 148;

    fn parse(b: &[u8]) -> Rej {
        Rej {
            ids: Ids::parse(b),
            rejected: MsgKind::from_bits(bits(b[8], 0xC0)),
            ari_length: bits(b[9], 0xFE),
            reason: be::u16_at(b, 10),
            ari: area(b, 12, 72),
            private_data: area(b, 84, Self::PRIVATE_DATA_LEN),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        self.ids.emit(b);
        b[8] = put_bits(self.rejected.bits(), 0xC0);
        b[9] = put_bits(self.ari_length, 0xFE);
        be::put_u16(b, 10, self.reason);
        put_area(b, 12, 72, &self.ari);
        put_area(b, 84, Self::PRIVATE_DATA_LEN, &self.private_data);
    }
}

/// The REJ reasons softrdma sends or names (IBTA Table 112).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
#[allow(missing_docs)]
pub enum RejReason {
    NoQp = 1,
    NoResources = 3,
    Timeout = 4,
    InvalidCommId = 6,
    InvalidServiceId = 8,
    InvalidTransportType = 9,
    StaleConnection = 10,
    InvalidMtu = 26,
    InsufficientRespResources = 27,
    ConsumerDefined = 28,
    InvalidRnrRetry = 29,
    DuplicateLocalCommId = 30,
    InvalidClassVersion = 31,
}

/// MRA: "message received, more time needed".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mra {
    /// Communication IDs.
    pub ids: Ids,
    /// The message acknowledged.
    pub mraed: MsgKind,
    /// How long the sender needs (5 bits, 4.096 µs × 2^t).
    pub service_timeout: u8,
    /// Private data, 222 bytes.
    pub private_data: Vec<u8>,
}

impl Mra {
    fn parse(b: &[u8]) -> Mra {
        Mra {
            ids: Ids::parse(b),
            mraed: MsgKind::from_bits(bits(b[8], 0xC0)),
            service_timeout: bits(b[9], 0xF8),
            private_data: area(b, 10, 222),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        self.ids.emit(b);
        b[8] = put_bits(self.mraed.bits(), 0xC0);
        b[9] = put_bits(self.service_timeout, 0xF8);
        put_area(b, 10, 222, &self.private_data);
    }
}

/// RTU, DREP: two IDs and 224 bytes of private data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdsAndData {
    /// Communication IDs.
    pub ids: Ids,
    /// Private data, 224 bytes.
    pub private_data: Vec<u8>,
}

impl IdsAndData {
    /// Bytes of private data an RTU or DREP carries.
    pub const PRIVATE_DATA_LEN: usize = 224;

    fn parse(b: &[u8]) -> IdsAndData {
        IdsAndData { ids: Ids::parse(b), private_data: area(b, 8, Self::PRIVATE_DATA_LEN) }
    }

    fn emit(&self, b: &mut [u8]) {
        self.ids.emit(b);
        put_area(b, 8, Self::PRIVATE_DATA_LEN, &self.private_data);
    }
}

/// DREQ: a disconnection request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dreq {
    /// Communication IDs.
    pub ids: Ids,
    /// The receiver's QP (24 bits).
    pub remote_qpn: u32,
    /// Private data, 220 bytes.
    pub private_data: Vec<u8>,
}

impl Dreq {
    fn parse(b: &[u8]) -> Dreq {
        Dreq { ids: Ids::parse(b), remote_qpn: be::u24_at(b, 8), private_data: area(b, 12, 220) }
    }

    fn emit(&self, b: &mut [u8]) {
        self.ids.emit(b);
        be::put_u24(b, 8, self.remote_qpn);
        put_area(b, 12, 220, &self.private_data);
    }
}

/// SIDR_REQ: a UD service lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrReq {
    /// The request's ID.
    pub request_id: u32,
    /// P_Key.
    pub pkey: u16,
    /// The service looked up.
    pub service_id: u64,
    /// Private data, 216 bytes (rdma_cm: its header first).
    pub private_data: Vec<u8>,
}

impl SidrReq {
    /// Bytes of private data a SIDR_REQ carries.
    pub const PRIVATE_DATA_LEN: usize = 216;

    fn parse(b: &[u8]) -> SidrReq {
        SidrReq {
            request_id: be::u32_at(b, 0),
            pkey: be::u16_at(b, 4),
            service_id: be::u64_at(b, 8),
            private_data: area(b, 16, Self::PRIVATE_DATA_LEN),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        be::put_u32(b, 0, self.request_id);
        be::put_u16(b, 4, self.pkey);
        be::put_u64(b, 8, self.service_id);
        put_area(b, 16, Self::PRIVATE_DATA_LEN, &self.private_data);
    }
}

/// SIDR_REP: the answer to a SIDR_REQ: the service's UD QP and Q_Key, or a status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrRep {
    /// The SIDR_REQ's ID.
    pub request_id: u32,
    /// 0 valid; 1 service ID not supported; 2 rejected by the service; 3 no QP; 4
    /// redirect; 5 class version not supported.
    pub status: u8,
    /// Length of the additional information.
    pub info_length: u8,
    /// ECE vendor ID (bytes 6–7 and 11).
    pub ece_vendor_id: u32,
    /// The service's QP (24 bits).
    pub qpn: u32,
    /// The service ID.
    pub service_id: u64,
    /// The service's Q_Key.
    pub qkey: u32,
    /// Additional information, 72 bytes.
    pub info: Vec<u8>,
    /// Private data, 136 bytes.
    pub private_data: Vec<u8>,
}

impl SidrRep {
    /// Bytes of private data a SIDR_REP carries.
    pub const PRIVATE_DATA_LEN: usize = 136;

    fn parse(b: &[u8]) -> SidrRep {
        SidrRep {
            request_id: be::u32_at(b, 0),
            status: b[4],
            info_length: b[5],
            ece_vendor_id: u32::from(be::u16_at(b, 6)) << 8 | u32::from(b[11]),
            qpn: be::u24_at(b, 8),
            service_id: be::u64_at(b, 12),
            qkey: be::u32_at(b, 20),
            info: area(b, 24, 72),
            private_data: area(b, 96, Self::PRIVATE_DATA_LEN),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        be::put_u32(b, 0, self.request_id);
        b[4] = self.status;
        b[5] = self.info_length;
        be::put_u16(b, 6, (self.ece_vendor_id >> 8) as u16);
        be::put_u24(b, 8, self.qpn);
        b[11] = self.ece_vendor_id as u8;
        be::put_u64(b, 12, self.service_id);
        be::put_u32(b, 20, self.qkey);
        put_area(b, 24, 72, &self.info);
        put_area(b, 96, Self::PRIVATE_DATA_LEN, &self.private_data);
    }
}

/// A CM message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum CmMsg {
    Req(Req),
    Mra(Mra),
    Rej(Rej),
    Rep(Rep),
    Rtu(IdsAndData),
    Dreq(Dreq),
    Drep(IdsAndData),
    SidrReq(SidrReq),
    SidrRep(SidrRep),
}

impl CmMsg {
    /// The message's attribute ID.
    pub fn attribute_id(&self) -> u16 {
        match self {
            CmMsg::Req(_) => attr::REQ,
            CmMsg::Mra(_) => attr::MRA,
            CmMsg::Rej(_) => attr::REJ,
            CmMsg::Rep(_) => attr::REP,
            CmMsg::Rtu(_) => attr::RTU,
            CmMsg::Dreq(_) => attr::DREQ,
            CmMsg::Drep(_) => attr::DREP,
            CmMsg::SidrReq(_) => attr::SIDR_REQ,
            CmMsg::SidrRep(_) => attr::SIDR_REP,
        }
    }

    /// The message's name (`REQ`, `REP`, ...).
    pub fn name(&self) -> &'static str {
        crate::wire::mad::cm_attribute_name(self.attribute_id()).unwrap_or("?")
    }
}

/// A CM MAD: the transaction ID and attribute modifier of its header, and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmMad {
    /// Transaction ID: the REQ's, echoed by every message of the same exchange.
    pub transaction_id: u64,
    /// Attribute modifier (ECE options; 0 otherwise).
    pub attribute_modifier: u32,
    /// The message.
    pub msg: CmMsg,
}

impl CmMad {
    /// A MAD with attribute modifier 0.
    pub fn new(transaction_id: u64, msg: CmMsg) -> CmMad {
        CmMad { transaction_id, attribute_modifier: 0, msg }
    }

    /// Parses the 256-byte MAD at the start of `mad` (a GSI payload).
    pub fn parse(mad: &[u8]) -> Result<CmMad, CmParseError> {
        crate::wire::check_len("CM MAD", mad, MAD_LEN)?;
        let h = MadHeader::parse(mad)?;
        if h.mgmt_class != MGMT_CLASS_CM {
            return Err(CmParseError::NotCm(h.mgmt_class));
        }
        if h.base_version != 1 {
            return Err(CmParseError::BaseVersion(h.base_version));
        }
        if h.class_version != CM_CLASS_VERSION {
            return Err(CmParseError::ClassVersion(h.class_version));
        }
        if h.method != METHOD_SEND {
            return Err(CmParseError::Method(h.method));
        }
        let b = &mad[MadHeader::LEN..MAD_LEN];
        let msg = match h.attribute_id {
            attr::REQ => CmMsg::Req(Req::parse(b)),
            attr::MRA => CmMsg::Mra(Mra::parse(b)),
            attr::REJ => CmMsg::Rej(Rej::parse(b)),
            attr::REP => CmMsg::Rep(Rep::parse(b)),
            attr::RTU => CmMsg::Rtu(IdsAndData::parse(b)),
            attr::DREQ => CmMsg::Dreq(Dreq::parse(b)),
            attr::DREP => CmMsg::Drep(IdsAndData::parse(b)),
            attr::SIDR_REQ => CmMsg::SidrReq(SidrReq::parse(b)),
            attr::SIDR_REP => CmMsg::SidrRep(SidrRep::parse(b)),
            other => return Err(CmParseError::Attribute(other)),
        };
        Ok(CmMad { transaction_id: h.transaction_id, attribute_modifier: h.attribute_modifier, msg })
    }

    /// The 256-byte MAD. Private data longer than its area is cut to the area (callers
    /// check lengths before they build a message).
    pub fn emit(&self) -> [u8; MAD_LEN] {
        let mut out = [0u8; MAD_LEN];
        let h = MadHeader {
            base_version: 1,
            mgmt_class: MGMT_CLASS_CM,
            class_version: CM_CLASS_VERSION,
            method: METHOD_SEND,
            status: 0,
            class_specific: 0,
            transaction_id: self.transaction_id,
            attribute_id: self.msg.attribute_id(),
            attribute_modifier: self.attribute_modifier,
        };
        let mut head = [0u8; MadHeader::LEN];
        h.emit(&mut head);
        out[..MadHeader::LEN].copy_from_slice(&head);
        let b = &mut out[MadHeader::LEN..];
        debug_assert_eq!(b.len(), BODY);
        match &self.msg {
            CmMsg::Req(m) => m.emit(b),
            CmMsg::Mra(m) => m.emit(b),
            CmMsg::Rej(m) => m.emit(b),
            CmMsg::Rep(m) => m.emit(b),
            CmMsg::Rtu(m) | CmMsg::Drep(m) => m.emit(b),
            CmMsg::Dreq(m) => m.emit(b),
            CmMsg::SidrReq(m) => m.emit(b),
            CmMsg::SidrRep(m) => m.emit(b),
        }
        out
    }
}
