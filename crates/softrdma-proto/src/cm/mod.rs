//! The communication manager (IBTA vol. 1 ch. 12) as rdma_cm uses it over RoCE: its
//! messages ([`msg`]), carried as 256-byte MADs on QP1, and rdma_cm's service IDs and
//! private-data header ([`rdma_cm`]). The connection state machines build on these.

pub mod msg;
pub mod rdma_cm;

pub use msg::{
    CmMad, CmMsg, CmParseError, CmPath, Dreq, Ids, IdsAndData, Mra, MsgKind, Rej, RejReason, Rep, Req,
    SidrRep, SidrReq,
};
pub use rdma_cm::{parse_service_id, service_id, CmaHeader, PortSpace};
