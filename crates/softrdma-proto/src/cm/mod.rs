//! The communication manager (IBTA vol. 1 ch. 12) as rdma_cm uses it over RoCE: its
//! messages ([`msg`]), carried as 256-byte MADs on QP1, and rdma_cm's service IDs and
//! private-data header ([`rdma_cm`]), and the state machines of a device's connections
//! ([`agent`]).

pub mod agent;
pub mod msg;
pub mod rdma_cm;

pub use agent::{cm_timeout, CmAgent, CmConfig, CmError, CmEvent, CmState, CmStats, CommId, MAX_UNCLAIMED};
pub use msg::{
    CmMad, CmMsg, CmParseError, CmPath, Dreq, Ids, IdsAndData, Mra, MsgKind, Rej, RejReason, Rep, Req,
    SidrRep, SidrReq,
};
pub use rdma_cm::{parse_service_id, service_id, CmaHeader, PortSpace};
