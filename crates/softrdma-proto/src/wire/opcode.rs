//! The BTH opcode table for RC, UC, UD and CNP (`roce-wire.md` §3).
//!
//! An opcode is a transport base (RC 0x00, UC 0x20, UD 0x60, CNP 0x80) plus an operation.
//! The table says which extension headers follow the BTH, in which order, whether payload
//! may follow, and where the packet sits in its message. RD (0x40) and XRC (0xA0) are not
//! implemented by softrdma or rxe; their opcodes, like reserved ones, are unknown to
//! [`Opcode::new`]. One vendor opcode (IBTA 9.2: 0xC0-0xFF are manufacturer specific) is
//! softrdma's own: 0xC0, the selective acknowledgement of an RC responder (see
//! [`Operation::Sack`]), sent only to peers known to be softrdma.

use core::fmt;

/// The transport service an opcode belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum Transport {
    /// Reliable Connected.
    Rc,
    /// Unreliable Connected.
    Uc,
    /// Unreliable Datagram.
    Ud,
    /// RoCEv2 congestion notification packet.
    Cnp,
}

impl Transport {
    /// The short name used in tools: `RC`, `UC`, `UD` or `CNP`.
    pub const fn name(self) -> &'static str {
        match self {
            Transport::Rc => "RC",
            Transport::Uc => "UC",
            Transport::Ud => "UD",
            Transport::Cnp => "CNP",
        }
    }
}

/// The operation part of an opcode (its low five bits, for RC, UC and UD).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[allow(missing_docs)]
pub enum Operation {
    SendFirst,
    SendMiddle,
    SendLast,
    SendLastWithImmediate,
    SendOnly,
    SendOnlyWithImmediate,
    RdmaWriteFirst,
    RdmaWriteMiddle,
    RdmaWriteLast,
    RdmaWriteLastWithImmediate,
    RdmaWriteOnly,
    RdmaWriteOnlyWithImmediate,
    RdmaReadRequest,
    RdmaReadResponseFirst,
    RdmaReadResponseMiddle,
    RdmaReadResponseLast,
    RdmaReadResponseOnly,
    Acknowledge,
    AtomicAcknowledge,
    CompareSwap,
    FetchAdd,
    SendLastWithInvalidate,
    SendOnlyWithInvalidate,
    Flush,
    AtomicWrite,
    /// The congestion notification packet, the only CNP operation.
    Cnp,
    /// softrdma's selective acknowledgement (vendor opcode 0xC0, RC): the BTH's PSN is the
    /// first PSN the responder is missing (every earlier one was received), and the 64-byte
    /// payload is a little-endian bitmap of the 512 PSNs after it, bit `i` set when PSN
    /// `psn + 1 + i` was received and is held for execution. Sent only between softrdma
    /// peers (see `QueuePair::set_selective`); never to Linux rxe or a NIC.
    Sack,
}

/// One extension header that can follow the BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeaderKind {
    /// Datagram extended transport header (Q_Key, source QP), UD.
    Deth,
    /// Flush extended transport header (placement type, selectivity).
    Feth,
    /// RDMA extended transport header (VA, R_Key, DMA length).
    Reth,
    /// Atomic extended transport header (VA, R_Key, swap/add, compare).
    AtomicEth,
    /// ACK extended transport header (syndrome, MSN).
    Aeth,
    /// Atomic ACK extended transport header (original value).
    AtomicAckEth,
    /// Immediate data.
    ImmDt,
    /// Invalidate extended transport header (R_Key to invalidate).
    Ieth,
    /// The 16 reserved bytes of a CNP.
    CnpReserved,
}

impl HeaderKind {
    /// Every kind, in the order in which the headers follow the BTH.
    pub const ORDER: [HeaderKind; 9] = [
        HeaderKind::Deth,
        HeaderKind::Feth,
        HeaderKind::Reth,
        HeaderKind::AtomicEth,
        HeaderKind::Aeth,
        HeaderKind::AtomicAckEth,
        HeaderKind::ImmDt,
        HeaderKind::Ieth,
        HeaderKind::CnpReserved,
    ];

    /// The header's length in bytes (never zero, hence no `is_empty`).
    #[allow(clippy::len_without_is_empty)]
    pub const fn len(self) -> usize {
        match self {
            HeaderKind::Deth => 8,
            HeaderKind::Feth => 4,
            HeaderKind::Reth => 16,
            HeaderKind::AtomicEth => 28,
            HeaderKind::Aeth => 4,
            HeaderKind::AtomicAckEth => 8,
            HeaderKind::ImmDt => 4,
            HeaderKind::Ieth => 4,
            HeaderKind::CnpReserved => 16,
        }
    }

    const fn bit(self) -> u16 {
        1 << self as u16
    }
}

/// A set of extension headers; iterate it to get them in wire order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HeaderSet(u16);

impl HeaderSet {
    /// No extension header.
    pub const EMPTY: HeaderSet = HeaderSet(0);

    const fn of(kinds: &[HeaderKind]) -> HeaderSet {
        let mut bits = 0;
        let mut i = 0;
        while i < kinds.len() {
            bits |= kinds[i].bit();
            i += 1;
        }
        HeaderSet(bits)
    }

    /// Whether the set holds `kind`.
    pub const fn contains(self, kind: HeaderKind) -> bool {
        self.0 & kind.bit() != 0
    }

    /// Total length of the headers in the set.
    pub const fn len(self) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < HeaderKind::ORDER.len() {
            if self.contains(HeaderKind::ORDER[i]) {
                n += HeaderKind::ORDER[i].len();
            }
            i += 1;
        }
        n
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Offset of `kind` from the end of the BTH, if the set holds it.
    pub const fn offset_of(self, kind: HeaderKind) -> Option<usize> {
        if !self.contains(kind) {
            return None;
        }
        let mut off = 0;
        let mut i = 0;
        while i < HeaderKind::ORDER.len() {
            let k = HeaderKind::ORDER[i];
            if k as u16 == kind as u16 {
                break;
            }
            if self.contains(k) {
                off += k.len();
            }
            i += 1;
        }
        Some(off)
    }

    /// The headers in wire order.
    pub fn iter(self) -> impl Iterator<Item = HeaderKind> {
        HeaderKind::ORDER.into_iter().filter(move |k| self.contains(*k))
    }
}

impl fmt::Debug for HeaderSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

/// How much payload an opcode may carry, given the path MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadRule {
    /// No payload at all.
    None,
    /// Exactly one PMTU (FIRST and MIDDLE packets).
    Full,
    /// 1 to PMTU bytes (LAST packets).
    NonEmpty,
    /// 0 to PMTU bytes (ONLY packets).
    UpToMtu,
    /// Exactly this many bytes (ATOMIC_WRITE: 8).
    Exactly(usize),
}

/// Where a packet sits in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    /// The first of several packets.
    First,
    /// Neither first nor last.
    Middle,
    /// The last of several packets.
    Last,
    /// The whole message in one packet (also every ACK, request and CNP).
    Only,
}

/// A known BTH opcode. Only the values in the table can be constructed.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opcode(u8);

struct Entry {
    op: Operation,
    name: &'static str,
    headers: HeaderSet,
    payload: PayloadRule,
    position: Position,
}

const fn e(
    op: Operation,
    name: &'static str,
    headers: &[HeaderKind],
    payload: PayloadRule,
    position: Position,
) -> Option<Entry> {
    Some(Entry { op, name, headers: HeaderSet::of(headers), payload, position })
}

use HeaderKind as H;
use Operation as O;
use PayloadRule as P;
use Position as Pos;

/// RC operations by low five bits; UC uses entries 0x00–0x0B of the same table.
const OPS: [Option<Entry>; 32] = [
    e(O::SendFirst, "SEND_FIRST", &[], P::Full, Pos::First),
    e(O::SendMiddle, "SEND_MIDDLE", &[], P::Full, Pos::Middle),
    e(O::SendLast, "SEND_LAST", &[], P::NonEmpty, Pos::Last),
    e(O::SendLastWithImmediate, "SEND_LAST_WITH_IMMEDIATE", &[H::ImmDt], P::NonEmpty, Pos::Last),
    e(O::SendOnly, "SEND_ONLY", &[], P::UpToMtu, Pos::Only),
    e(O::SendOnlyWithImmediate, "SEND_ONLY_WITH_IMMEDIATE", &[H::ImmDt], P::UpToMtu, Pos::Only),
    e(O::RdmaWriteFirst, "RDMA_WRITE_FIRST", &[H::Reth], P::Full, Pos::First),
    e(O::RdmaWriteMiddle, "RDMA_WRITE_MIDDLE", &[], P::Full, Pos::Middle),
    e(O::RdmaWriteLast, "RDMA_WRITE_LAST", &[], P::NonEmpty, Pos::Last),
    e(O::RdmaWriteLastWithImmediate, "RDMA_WRITE_LAST_WITH_IMMEDIATE", &[H::ImmDt], P::NonEmpty, Pos::Last),
    e(O::RdmaWriteOnly, "RDMA_WRITE_ONLY", &[H::Reth], P::UpToMtu, Pos::Only),
    e(
        O::RdmaWriteOnlyWithImmediate,
        "RDMA_WRITE_ONLY_WITH_IMMEDIATE",
        &[H::Reth, H::ImmDt],
        P::UpToMtu,
        Pos::Only,
    ),
    e(O::RdmaReadRequest, "RDMA_READ_REQUEST", &[H::Reth], P::None, Pos::Only),
    e(O::RdmaReadResponseFirst, "RDMA_READ_RESPONSE_FIRST", &[H::Aeth], P::Full, Pos::First),
    e(O::RdmaReadResponseMiddle, "RDMA_READ_RESPONSE_MIDDLE", &[], P::Full, Pos::Middle),
    e(O::RdmaReadResponseLast, "RDMA_READ_RESPONSE_LAST", &[H::Aeth], P::NonEmpty, Pos::Last),
    e(O::RdmaReadResponseOnly, "RDMA_READ_RESPONSE_ONLY", &[H::Aeth], P::UpToMtu, Pos::Only),
    e(O::Acknowledge, "ACKNOWLEDGE", &[H::Aeth], P::None, Pos::Only),
    e(O::AtomicAcknowledge, "ATOMIC_ACKNOWLEDGE", &[H::Aeth, H::AtomicAckEth], P::None, Pos::Only),
    e(O::CompareSwap, "COMPARE_SWAP", &[H::AtomicEth], P::None, Pos::Only),
    e(O::FetchAdd, "FETCH_ADD", &[H::AtomicEth], P::None, Pos::Only),
    None,
    e(O::SendLastWithInvalidate, "SEND_LAST_WITH_INVALIDATE", &[H::Ieth], P::NonEmpty, Pos::Last),
    e(O::SendOnlyWithInvalidate, "SEND_ONLY_WITH_INVALIDATE", &[H::Ieth], P::UpToMtu, Pos::Only),
    None,
    None,
    None,
    None,
    e(O::Flush, "FLUSH", &[H::Feth, H::Reth], P::None, Pos::Only),
    e(O::AtomicWrite, "ATOMIC_WRITE", &[H::Reth], P::Exactly(8), Pos::Only),
    None,
    None,
];

const UD_SEND_ONLY: Option<Entry> = e(O::SendOnly, "SEND_ONLY", &[H::Deth], P::UpToMtu, Pos::Only);
const UD_SEND_ONLY_IMM: Option<Entry> =
    e(O::SendOnlyWithImmediate, "SEND_ONLY_WITH_IMMEDIATE", &[H::Deth, H::ImmDt], P::UpToMtu, Pos::Only);
const CNP: Option<Entry> = e(O::Cnp, "CNP", &[H::CnpReserved], P::None, Pos::Only);
const SACK: Option<Entry> = e(O::Sack, "SOFTRDMA_SACK", &[], P::Exactly(64), Pos::Only);

const fn lookup(code: u8) -> &'static Option<Entry> {
    match code {
        0x00..=0x1F => &OPS[code as usize],
        0x20..=0x2B => &OPS[(code - 0x20) as usize],
        0x64 => &UD_SEND_ONLY,
        0x65 => &UD_SEND_ONLY_IMM,
        0x81 => &CNP,
        0xC0 => &SACK,
        _ => &None,
    }
}

/// Not an opcode in the table: marks the holes of [`BY_PARTS`].
const NO_CODE: u8 = 0xFF;

/// The opcode of each transport and operation, indexed by their discriminants, built from
/// the table at compile time: a requester looks up an opcode for every packet it sends.
const BY_PARTS: [[u8; Operation::Sack as usize + 1]; Transport::Cnp as usize + 1] = {
    let mut t = [[NO_CODE; Operation::Sack as usize + 1]; Transport::Cnp as usize + 1];
    let mut code = 0;
    while code < NO_CODE {
        if let Some(e) = lookup(code) {
            t[Opcode(code).transport() as usize][e.op as usize] = code;
        }
        code += 1;
    }
    t
};

impl Opcode {
    /// `code` as an opcode, or `None` if it is not in the table.
    pub const fn new(code: u8) -> Option<Opcode> {
        if lookup(code).is_some() {
            Some(Opcode(code))
        } else {
            None
        }
    }

    const fn entry(self) -> &'static Entry {
        match lookup(self.0) {
            Some(e) => e,
            // `Opcode` values only come from `new`, which checked the table.
            None => unreachable!(),
        }
    }

    /// Every opcode in the table, in numeric order.
    pub fn all() -> impl Iterator<Item = Opcode> {
        (0..=u8::MAX).filter_map(Opcode::new)
    }

    /// The opcode byte.
    pub const fn code(self) -> u8 {
        self.0
    }

    /// The transport service.
    pub const fn transport(self) -> Transport {
        match self.0 {
            0x00..=0x1F => Transport::Rc,
            0x20..=0x3F => Transport::Uc,
            0x60..=0x7F => Transport::Ud,
            // softrdma's selective acknowledgement answers RC requests.
            0xC0 => Transport::Rc,
            _ => Transport::Cnp,
        }
    }

    /// The operation.
    pub const fn operation(self) -> Operation {
        self.entry().op
    }

    /// The operation's name as rdma-core and Wireshark spell it, e.g. `SEND_FIRST`.
    pub const fn name(self) -> &'static str {
        self.entry().name
    }

    /// The extension headers that follow the BTH.
    pub const fn headers(self) -> HeaderSet {
        self.entry().headers
    }

    /// How much payload the packet may carry.
    pub const fn payload(self) -> PayloadRule {
        self.entry().payload
    }

    /// Where the packet sits in its message.
    pub const fn position(self) -> Position {
        self.entry().position
    }

    /// The opcode for `op` on `transport`, if the table has one.
    pub const fn from_parts(transport: Transport, op: Operation) -> Option<Opcode> {
        match BY_PARTS[transport as usize][op as usize] {
            NO_CODE => None,
            code => Some(Opcode(code)),
        }
    }

    /// Whether this is a request (sent by a requester), rather than a response.
    pub const fn is_request(self) -> bool {
        !matches!(
            self.operation(),
            O::RdmaReadResponseFirst
                | O::RdmaReadResponseMiddle
                | O::RdmaReadResponseLast
                | O::RdmaReadResponseOnly
                | O::Acknowledge
                | O::AtomicAcknowledge
                | O::Cnp
                | O::Sack
        )
    }

    /// Whether the packet consumes a receive WQE at the responder (`roce-wire.md` §3).
    pub const fn consumes_recv_wqe(self) -> bool {
        matches!(
            self.operation(),
            O::SendFirst
                | O::SendOnly
                | O::SendOnlyWithImmediate
                | O::SendOnlyWithInvalidate
                | O::RdmaWriteLastWithImmediate
                | O::RdmaWriteOnlyWithImmediate
        )
    }
}

impl fmt::Debug for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Opcode({:#04x} {self})", self.0)
    }
}

/// `RC SEND_FIRST`, `UD SEND_ONLY_WITH_IMMEDIATE`, `CNP`.
impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.transport() {
            Transport::Cnp => f.write_str("CNP"),
            t => write!(f, "{} {}", t.name(), self.name()),
        }
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Opcode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_size_and_ranges() {
        let rc = Opcode::all().filter(|o| o.transport() == Transport::Rc).count();
        let uc = Opcode::all().filter(|o| o.transport() == Transport::Uc).count();
        let ud = Opcode::all().filter(|o| o.transport() == Transport::Ud).count();
        let cnp = Opcode::all().filter(|o| o.transport() == Transport::Cnp).count();
        assert_eq!((rc, uc, ud, cnp), (26, 12, 2, 1));
        for bad in [0x15, 0x18, 0x1B, 0x1E, 0x1F, 0x2C, 0x2C, 0x40, 0x4A, 0x60, 0x66, 0x80, 0xA0, 0xE0, 0xFF]
        {
            assert_eq!(Opcode::new(bad), None, "{bad:#x}");
        }
    }

    #[test]
    fn spot_checks_against_the_spec_table() {
        let o = Opcode::new(0x0B).unwrap();
        assert_eq!(o.to_string(), "RC RDMA_WRITE_ONLY_WITH_IMMEDIATE");
        assert_eq!(o.headers().iter().collect::<Vec<_>>(), [H::Reth, H::ImmDt]);
        assert_eq!(o.headers().len(), 20);
        assert_eq!(o.headers().offset_of(H::ImmDt), Some(16));
        assert_eq!(o.payload(), P::UpToMtu);

        let o = Opcode::new(0x12).unwrap();
        assert_eq!(o.name(), "ATOMIC_ACKNOWLEDGE");
        assert_eq!(o.headers().len(), 12);
        assert_eq!(o.headers().offset_of(H::AtomicAckEth), Some(4));
        assert!(!o.is_request());

        let o = Opcode::new(0x1C).unwrap();
        assert_eq!(o.headers().iter().collect::<Vec<_>>(), [H::Feth, H::Reth]);
        assert_eq!(o.headers().offset_of(H::Reth), Some(4));

        let o = Opcode::new(0x65).unwrap();
        assert_eq!(o.to_string(), "UD SEND_ONLY_WITH_IMMEDIATE");
        assert_eq!(o.headers().iter().collect::<Vec<_>>(), [H::Deth, H::ImmDt]);

        let o = Opcode::new(0x2B).unwrap();
        assert_eq!(o.to_string(), "UC RDMA_WRITE_ONLY_WITH_IMMEDIATE");
        assert_eq!(Opcode::new(0x0E).unwrap().headers(), HeaderSet::EMPTY);
        assert_eq!(Opcode::new(0x81).unwrap().to_string(), "CNP");
        assert_eq!(Opcode::new(0x81).unwrap().headers().len(), 16);
        assert_eq!(Opcode::new(0x1D).unwrap().payload(), P::Exactly(8));
        let sack = Opcode::new(0xC0).unwrap();
        assert_eq!(sack.to_string(), "RC SOFTRDMA_SACK");
        assert_eq!(
            (sack.payload(), sack.headers(), sack.is_request()),
            (P::Exactly(64), HeaderSet::EMPTY, false)
        );
    }

    #[test]
    fn positions_and_recv_wqe_consumers() {
        let pos = |c| Opcode::new(c).unwrap().position();
        assert_eq!(
            [pos(0x00), pos(0x01), pos(0x02), pos(0x04)],
            [Pos::First, Pos::Middle, Pos::Last, Pos::Only]
        );
        assert_eq!(
            [pos(0x0D), pos(0x0E), pos(0x0F), pos(0x10)],
            [Pos::First, Pos::Middle, Pos::Last, Pos::Only]
        );
        let consumers: Vec<u8> = Opcode::all().filter(|o| o.consumes_recv_wqe()).map(Opcode::code).collect();
        assert_eq!(consumers, [0x00, 0x04, 0x05, 0x09, 0x0B, 0x17, 0x20, 0x24, 0x25, 0x29, 0x2B, 0x64, 0x65]);
    }

    #[test]
    fn from_parts_round_trips() {
        for o in Opcode::all() {
            assert_eq!(Opcode::from_parts(o.transport(), o.operation()), Some(o));
        }
        // Every pair the table lacks is None, as a scan of the table finds.
        let ops: Vec<Operation> = Opcode::all().map(Opcode::operation).collect();
        for t in [Transport::Rc, Transport::Uc, Transport::Ud, Transport::Cnp] {
            for &op in &ops {
                let scan = Opcode::all().find(|o| o.transport() == t && o.operation() == op);
                assert_eq!(Opcode::from_parts(t, op), scan, "{t:?} {op:?}");
            }
        }
        assert_eq!(Opcode::from_parts(Transport::Ud, Operation::RdmaWriteOnly), None);
        assert_eq!(Opcode::from_parts(Transport::Uc, Operation::RdmaReadRequest), None);
        assert_eq!(Opcode::from_parts(Transport::Rc, Operation::Sack).map(Opcode::code), Some(0xC0));
    }
}
