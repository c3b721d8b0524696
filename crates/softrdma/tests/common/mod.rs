//! What the attack tests share: packets with every header an opcode needs, and a small
//! seeded generator.

#![allow(dead_code)]

use softrdma::proto::wire::PacketRepr;
use softrdma::proto::wire::{
    AethRepr, AethSyndrome, AtomicAckEthRepr, AtomicEthRepr, DethRepr, FethRepr, HeaderKind as K, IethRepr,
    ImmDtRepr, Opcode, PayloadRule, RethRepr,
};
use softrdma::{Qkey, Qpn, Rkey};

/// A payload length the opcode allows.
pub fn payload_for(op: Opcode) -> usize {
    match op.payload() {
        PayloadRule::None => 0,
        PayloadRule::Exactly(n) => n,
        _ => 16,
    }
}

/// Fills every extension header an opcode needs with something plausible, and sets a
/// payload length it allows; an AETH gets `syndrome`.
pub fn fill_headers_with(r: &mut PacketRepr, syndrome: AethSyndrome) {
    let op = r.bth.opcode;
    let h = op.headers();
    r.payload_len = payload_for(op);
    if h.contains(K::Deth) {
        r.ext.deth = Some(DethRepr { qkey: Qkey(1), src_qp: Qpn::new(9) });
    }
    if h.contains(K::Feth) {
        r.ext.feth = Some(FethRepr { placement_type: 1, selectivity: 0 });
    }
    if h.contains(K::Reth) {
        r.ext.reth = Some(RethRepr { va: 0, rkey: Rkey(1), dma_len: r.payload_len as u32 });
    }
    if h.contains(K::AtomicEth) {
        r.ext.atomic_eth = Some(AtomicEthRepr { va: 0, rkey: Rkey(1), swap_add: 0, compare: 0 });
    }
    if h.contains(K::Aeth) {
        r.ext.aeth = Some(AethRepr { syndrome, msn: 0 });
    }
    if h.contains(K::AtomicAckEth) {
        r.ext.atomic_ack_eth = Some(AtomicAckEthRepr { orig: 0 });
    }
    if h.contains(K::ImmDt) {
        r.ext.immdt = Some(ImmDtRepr { value: 0 });
    }
    if h.contains(K::Ieth) {
        r.ext.ieth = Some(IethRepr { rkey: Rkey(1) });
    }
}

/// [`fill_headers_with`] an ACK syndrome.
pub fn fill_headers(r: &mut PacketRepr) {
    fill_headers_with(r, AethSyndrome::ACK);
}

/// xorshift64*: reproducible noise for attacks.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
