//! The C structures of `<infiniband/verbs.h>` (rdma-core 44, x86_64/aarch64 LP64) that the
//! library reads or writes, field for field. `tests/layout.rs` compiles C against the real
//! header and checks every size and offset named here.
//!
//! Fields the library never touches are kept as reserved bytes of the right size, so the
//! layouts stay exact without naming what softrdma does not implement.

#![allow(non_camel_case_types, missing_docs, missing_debug_implementations)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `pthread_mutex_t` (40 bytes on glibc LP64); all-zero is `PTHREAD_MUTEX_INITIALIZER`.
pub type pthread_mutex_t = [u64; 5];
/// `pthread_cond_t` (48 bytes); all-zero is `PTHREAD_COND_INITIALIZER`.
pub type pthread_cond_t = [u64; 6];

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

#[repr(C)]
pub struct ibv_device {
    pub _ops: [*mut c_void; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

pub type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyCq = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
pub type PostSrqRecv = unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type PostSend = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecv = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`: the five operations applications call through inline
/// functions; the other 27 slots are compatibility entries rdma-core leaves NULL.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat: [*mut c_void; 11],
    pub poll_cq: Option<PollCq>,
    pub req_notify_cq: Option<ReqNotifyCq>,
    pub _compat2: [*mut c_void; 7],
    pub post_srq_recv: Option<PostSrqRecv>,
    pub _compat3: [*mut c_void; 4],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
    pub _compat4: [*mut c_void; 5],
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

#[repr(C)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr` (52 bytes; the exported `ibv_query_port@IBVERBS_1.1` writes only
/// the first 48, `_compat_ibv_port_attr`, when the caller's header predates the last field).
#[repr(C)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// What `struct ibv_cq_ex` adds after its `ibv_cq` (128 bytes): the current completion's
/// status and `wr_id`, and the polling functions. `tests/layout.rs` checks `128 + offset`.
#[repr(C)]
pub struct ibv_cq_ex_tail {
    pub comp_mask: u32,
    pub status: c_int,
    pub wr_id: u64,
    pub start_poll: Option<unsafe extern "C" fn(*mut ibv_cq, *mut ibv_poll_cq_attr) -> c_int>,
    pub next_poll: Option<unsafe extern "C" fn(*mut ibv_cq) -> c_int>,
    pub end_poll: Option<unsafe extern "C" fn(*mut ibv_cq)>,
    pub read_opcode: Option<unsafe extern "C" fn(*mut ibv_cq) -> c_int>,
    pub read_vendor_err: Option<unsafe extern "C" fn(*mut ibv_cq) -> u32>,
    pub read_byte_len: Option<unsafe extern "C" fn(*mut ibv_cq) -> u32>,
    pub read_imm_data: Option<unsafe extern "C" fn(*mut ibv_cq) -> u32>,
    pub read_qp_num: Option<unsafe extern "C" fn(*mut ibv_cq) -> u32>,
    pub read_src_qp: Option<unsafe extern "C" fn(*mut ibv_cq) -> u32>,
    pub read_wc_flags: Option<unsafe extern "C" fn(*mut ibv_cq) -> c_uint>,
    pub read_slid: Option<unsafe extern "C" fn(*mut ibv_cq) -> u32>,
    pub read_sl: Option<unsafe extern "C" fn(*mut ibv_cq) -> u8>,
    pub read_dlid_path_bits: Option<unsafe extern "C" fn(*mut ibv_cq) -> u8>,
    pub read_completion_ts: Option<unsafe extern "C" fn(*mut ibv_cq) -> u64>,
    pub read_cvlan: *mut c_void,
    pub read_flow_tag: *mut c_void,
    pub read_tm_info: *mut c_void,
    pub read_completion_wallclock_ns: Option<unsafe extern "C" fn(*mut ibv_cq) -> u64>,
}

#[repr(C)]
pub struct ibv_poll_cq_attr {
    pub comp_mask: u32,
}

#[repr(C)]
pub struct ibv_cq_init_attr_ex {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut ibv_comp_channel,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut ibv_pd,
}

#[repr(C)]
pub struct ibv_odp_caps {
    pub general_caps: u64,
    pub rc_odp_caps: u32,
    pub uc_odp_caps: u32,
    pub ud_odp_caps: u32,
}

/// The start of `struct ibv_device_attr_ex`, up to the fields the library fills; the rest
/// of the caller's `attr_size` bytes is zeroed.
#[repr(C)]
pub struct ibv_device_attr_ex_head {
    pub orig_attr: ibv_device_attr,
    pub comp_mask: u32,
    pub odp_caps: ibv_odp_caps,
    pub completion_timestamp_mask: u64,
    pub hca_core_clock: u64,
    pub device_cap_flags_ex: u64,
}

#[repr(C)]
pub struct ibv_values_ex {
    pub comp_mask: u32,
    pub raw_clock: libc::timespec,
}

#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

/// What `struct ibv_qp_ex` adds after its `ibv_qp` (which is 160 bytes, 8-aligned): the
/// `ibv_wr_*` posting interface. `tests/layout.rs` checks `160 + offset` against the header.
#[repr(C)]
pub struct ibv_qp_ex_tail {
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: c_uint,
    pub wr_atomic_cmp_swp: Option<unsafe extern "C" fn(*mut ibv_qp, u32, u64, u64, u64)>,
    pub wr_atomic_fetch_add: Option<unsafe extern "C" fn(*mut ibv_qp, u32, u64, u64)>,
    pub wr_bind_mw: *mut c_void,
    pub wr_local_inv: *mut c_void,
    pub wr_rdma_read: Option<unsafe extern "C" fn(*mut ibv_qp, u32, u64)>,
    pub wr_rdma_write: Option<unsafe extern "C" fn(*mut ibv_qp, u32, u64)>,
    pub wr_rdma_write_imm: Option<unsafe extern "C" fn(*mut ibv_qp, u32, u64, u32)>,
    pub wr_send: Option<unsafe extern "C" fn(*mut ibv_qp)>,
    pub wr_send_imm: Option<unsafe extern "C" fn(*mut ibv_qp, u32)>,
    pub wr_send_inv: *mut c_void,
    pub wr_send_tso: *mut c_void,
    pub wr_set_ud_addr: Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_ah, u32, u32)>,
    pub wr_set_xrc_srqn: *mut c_void,
    pub wr_set_inline_data: Option<unsafe extern "C" fn(*mut ibv_qp, *mut c_void, usize)>,
    pub wr_set_inline_data_list: Option<unsafe extern "C" fn(*mut ibv_qp, usize, *const ibv_data_buf)>,
    pub wr_set_sge: Option<unsafe extern "C" fn(*mut ibv_qp, u32, u64, u32)>,
    pub wr_set_sge_list: Option<unsafe extern "C" fn(*mut ibv_qp, usize, *const ibv_sge)>,
    pub wr_start: Option<unsafe extern "C" fn(*mut ibv_qp)>,
    pub wr_complete: Option<unsafe extern "C" fn(*mut ibv_qp) -> c_int>,
    pub wr_abort: Option<unsafe extern "C" fn(*mut ibv_qp)>,
    pub wr_atomic_write: *mut c_void,
}

#[repr(C)]
pub struct ibv_data_buf {
    pub addr: *mut c_void,
    pub length: usize,
}

#[repr(C)]
pub struct ibv_qp_init_attr_ex {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut c_void,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    pub rx_hash_conf: [u64; 3],
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}

pub const IBV_QP_INIT_ATTR_PD: u32 = 1 << 0;
pub const IBV_QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;

#[repr(C)]
pub struct ibv_ah {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ud {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

#[repr(C)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_rdma,
    pub atomic: ibv_atomic,
    pub ud: ibv_ud,
}

#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    /// `imm_data` (network order) or `invalidate_rkey`.
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    /// `qp_type.xrc.remote_srqn`, then `bind_mw` / `tso` (unused here).
    pub _rest: [u64; 7],
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (network order) or `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// `union ibv_gid`: 16 bytes, aligned as its `global` view's two `__be64`s.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

#[repr(C)]
pub struct ibv_async_event {
    /// The CQ, QP, SRQ or WQ pointer, or the port number, by event type.
    pub element: *mut c_void,
    pub event_type: c_int,
}

// Enumerations (values from verbs.h).
pub const IBV_NODE_CA: c_int = 1;
pub const IBV_TRANSPORT_IB: c_int = 0;

pub const IBV_QPT_RC: c_int = 2;
pub const IBV_QPT_UC: c_int = 3;
pub const IBV_QPT_UD: c_int = 4;

pub const IBV_WR_RDMA_WRITE: c_int = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_int = 1;
pub const IBV_WR_SEND: c_int = 2;
pub const IBV_WR_SEND_WITH_IMM: c_int = 3;
pub const IBV_WR_RDMA_READ: c_int = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: c_int = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: c_int = 6;
pub const IBV_WR_SEND_WITH_INV: c_int = 9;

pub const IBV_SEND_FENCE: c_uint = 1;
pub const IBV_SEND_SIGNALED: c_uint = 2;
pub const IBV_SEND_SOLICITED: c_uint = 4;
pub const IBV_SEND_INLINE: c_uint = 8;

pub const IBV_WC_SEND: c_int = 0;
pub const IBV_WC_RDMA_WRITE: c_int = 1;
pub const IBV_WC_RDMA_READ: c_int = 2;
pub const IBV_WC_COMP_SWAP: c_int = 3;
pub const IBV_WC_FETCH_ADD: c_int = 4;
pub const IBV_WC_RECV: c_int = 128;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_int = 129;

pub const IBV_WC_GRH: c_uint = 1;
pub const IBV_WC_WITH_IMM: c_uint = 2;
pub const IBV_WC_WITH_INV: c_uint = 8;

pub const IBV_EVENT_CQ_ERR: c_int = 0;
pub const IBV_EVENT_QP_FATAL: c_int = 1;
pub const IBV_EVENT_PORT_ACTIVE: c_int = 9;
pub const IBV_EVENT_QP_LAST_WQE_REACHED: c_int = 16;

pub const IBV_WC_EX_WITH_BYTE_LEN: u64 = 1 << 0;
pub const IBV_WC_EX_WITH_IMM: u64 = 1 << 1;
pub const IBV_WC_EX_WITH_QP_NUM: u64 = 1 << 2;
pub const IBV_WC_EX_WITH_SRC_QP: u64 = 1 << 3;
pub const IBV_WC_EX_WITH_SLID: u64 = 1 << 4;
pub const IBV_WC_EX_WITH_SL: u64 = 1 << 5;
pub const IBV_WC_EX_WITH_DLID_PATH_BITS: u64 = 1 << 6;
pub const IBV_WC_EX_WITH_COMPLETION_TIMESTAMP: u64 = 1 << 7;
pub const IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK: u64 = 1 << 11;
/// The `wc_flags` `create_cq_ex` accepts: the standard fields and both timestamps.
pub const SUPPORTED_WC_EX_FLAGS: u64 = IBV_WC_EX_WITH_BYTE_LEN
    | IBV_WC_EX_WITH_IMM
    | IBV_WC_EX_WITH_QP_NUM
    | IBV_WC_EX_WITH_SRC_QP
    | IBV_WC_EX_WITH_SLID
    | IBV_WC_EX_WITH_SL
    | IBV_WC_EX_WITH_DLID_PATH_BITS
    | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP
    | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK;
pub const IBV_CQ_INIT_ATTR_MASK_FLAGS: u32 = 1 << 0;
pub const IBV_CQ_INIT_ATTR_MASK_PD: u32 = 1 << 1;
pub const IBV_CREATE_CQ_ATTR_SINGLE_THREADED: u32 = 1 << 0;
pub const IBV_VALUES_MASK_RAW_CLOCK: u32 = 1 << 0;

pub const IBV_GID_TYPE_ROCE_V2: u32 = 2;
/// `IBV_GID_TYPE_SYSFS_ROCE_V2`, what `ibv_query_gid_type` reports.
pub const IBV_GID_TYPE_SYSFS_ROCE_V2: c_int = 1;

// ---- librdmacm (`<rdma/rdma_cma.h>`, `<rdma/rdma_verbs.h>`) --------------------------------

#[repr(C)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

/// `struct rdma_ib_addr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct rdma_ib_addr {
    pub sgid: ibv_gid,
    pub dgid: ibv_gid,
    pub pkey: u16,
}

/// `struct sockaddr_storage`: 128 bytes, 8-aligned.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct sockaddr_storage {
    pub bytes: [u8; 128],
}

impl Default for sockaddr_storage {
    fn default() -> Self {
        sockaddr_storage { bytes: [0; 128] }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct rdma_addr {
    pub src_addr: sockaddr_storage,
    pub dst_addr: sockaddr_storage,
    pub ibaddr: rdma_ib_addr,
}

#[repr(C)]
pub struct rdma_route {
    pub addr: rdma_addr,
    pub path_rec: *mut ibv_sa_path_rec,
    pub num_paths: c_int,
}

/// `struct ibv_sa_path_rec` (64 bytes): the GIDs lead; the rest stays zero.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_sa_path_rec {
    pub dgid: ibv_gid,
    pub sgid: ibv_gid,
    pub rest: [u8; 32],
}

#[repr(C)]
pub struct rdma_cm_id {
    pub verbs: *mut ibv_context,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut ibv_qp,
    pub route: rdma_route,
    pub ps: c_int,
    pub port_num: u8,
    pub event: *mut rdma_cm_event,
    pub send_cq_channel: *mut ibv_comp_channel,
    pub send_cq: *mut ibv_cq,
    pub recv_cq_channel: *mut ibv_comp_channel,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub pd: *mut ibv_pd,
    pub qp_type: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_ud_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub ah_attr: ibv_ah_attr,
    pub qp_num: u32,
    pub qkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union rdma_event_param {
    pub conn: rdma_conn_param,
    pub ud: rdma_ud_param,
}

#[repr(C)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    pub event: c_int,
    pub status: c_int,
    pub param: rdma_event_param,
}

#[repr(C)]
pub struct rdma_addrinfo {
    pub ai_flags: c_int,
    pub ai_family: c_int,
    pub ai_qp_type: c_int,
    pub ai_port_space: c_int,
    pub ai_src_len: libc::socklen_t,
    pub ai_dst_len: libc::socklen_t,
    pub ai_src_addr: *mut libc::sockaddr,
    pub ai_dst_addr: *mut libc::sockaddr,
    pub ai_src_canonname: *mut c_char,
    pub ai_dst_canonname: *mut c_char,
    pub ai_route_len: usize,
    pub ai_route: *mut c_void,
    pub ai_connect_len: usize,
    pub ai_connect: *mut c_void,
    pub ai_next: *mut rdma_addrinfo,
}

pub const RAI_PASSIVE: c_int = 1;
pub const RAI_NUMERICHOST: c_int = 2;
pub const RDMA_PS_IPOIB: c_int = 0x0002;
pub const RDMA_PS_TCP: c_int = 0x0106;
pub const RDMA_PS_UDP: c_int = 0x0111;
pub const RDMA_PS_IB: c_int = 0x013F;
pub const RDMA_OPTION_ID: c_int = 0;
pub const RDMA_OPTION_ID_TOS: c_int = 0;
pub const RDMA_OPTION_ID_REUSEADDR: c_int = 1;
pub const RDMA_OPTION_ID_AFONLY: c_int = 2;
pub const RDMA_OPTION_ID_ACK_TIMEOUT: c_int = 3;
pub const RDMA_OPTION_IB: c_int = 1;
pub const RDMA_OPTION_IB_PATH: c_int = 1;
/// `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH`: "the device's maximum".
pub const RDMA_MAX_DEPTH: u8 = 0xFF;
