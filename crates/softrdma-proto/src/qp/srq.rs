//! Shared receive queues: one pool of receive WQEs that several QPs draw from.
//!
//! An SRQ belongs to an endpoint, not to a QP, so the QP is handed its SRQ with each packet
//! ([`super::QueuePair::handle_packet`]). A QP in ERROR flushes only its own receive WQEs:
//! those in the SRQ stay for the other QPs.

use std::collections::VecDeque;

use super::{PostError, RecvWqe, RecvWr};

/// Identifies an SRQ within an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SrqId(pub u32);

/// A shared receive queue.
#[derive(Debug)]
pub struct Srq {
    wqes: VecDeque<RecvWqe>,
    max_wr: u32,
    max_sge: u32,
}

impl std::fmt::Debug for RecvWqe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvWqe").field("wr_id", &self.wr_id).field("len", &self.len).finish()
    }
}

impl Srq {
    /// An empty SRQ holding up to `max_wr` WQEs of up to `max_sge` entries.
    pub fn new(max_wr: u32, max_sge: u32) -> Srq {
        Srq { wqes: VecDeque::new(), max_wr, max_sge }
    }

    /// Posts a receive WR.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        if wr.sg_list.len() > self.max_sge as usize {
            return Err(PostError::TooManySge);
        }
        if self.wqes.len() >= self.max_wr as usize {
            return Err(PostError::QueueFull);
        }
        let len = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
        self.wqes.push_back(RecvWqe { wr_id: wr.wr_id, sgl: wr.sg_list, len });
        Ok(())
    }

    /// WQEs posted and not yet consumed.
    pub fn len(&self) -> usize {
        self.wqes.len()
    }

    /// Whether no WQE is posted.
    pub fn is_empty(&self) -> bool {
        self.wqes.is_empty()
    }

    pub(super) fn take(&mut self) -> Option<RecvWqe> {
        self.wqes.pop_front()
    }

    pub(super) fn put_back(&mut self, wqe: RecvWqe) {
        self.wqes.push_front(wqe);
    }
}
