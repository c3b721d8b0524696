//! Status tools: `softrdma devices`, `devinfo`, `stat` and `link`, laid out like
//! `ibv_devices`, `ibv_devinfo`, `ibstat` and `ibdev2netdev`, so that their output reads (and
//! greps) like a real RDMA stack's.
//!
//! They never open a [`softrdma::Context`]: that binds the device's UDP port, which another
//! process may hold. They only render what the library's [`Device::attr`],
//! [`Device::port_attr`] and [`Device::gids`] return — the same values
//! `Context::query_device`, `query_port` and `query_gid` give.
//!
//! Identity values, chosen so that no tool mistakes a softrdma device for real hardware
//! (perftest, for one, changes behaviour on known vendor and part IDs):
//! * vendor_id 0x0000 and vendor_part_id 0: not assigned to any RDMA vendor; Linux rxe is
//!   0xffffff, Mellanox 0x02c9, Broadcom 0x14e4. hw_ver 0x0, fw_ver the crate version.
//! * transport `InfiniBand (0)` and link layer Ethernet, as rxe and RoCE NICs report.
//! * sys_image_guid = node_guid; port GUID = the low 64 bits of GID 0 (as `ibstat` derives it
//!   for RoCE ports from the GID table).
//! * Rate and active width/speed: mapped from the interface's Ethernet speed
//!   (`/sys/class/net/IF/speed`) the way the kernel's `ib_get_eth_speed` does for rxe; an
//!   interface without a speed (loopback, most virtual NICs) counts as 1000 Mb/s, like rxe,
//!   which gives 1X SDR, `Rate: 2.5`. softrdma does not shape its traffic to it.
//! * Capability mask / port_cap_flags 0x04000000: IsIPBasedGIDs only (no SM, no CM MADs).

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::{IpAddr, Ipv6Addr};

use serde::Serialize;
use softrdma::Device;

/// Arguments of `softrdma devices`.
#[derive(Debug, clap::Args)]
pub struct DevicesArgs {}

/// Arguments of `softrdma devinfo`.
#[derive(Debug, clap::Args)]
pub struct DevinfoArgs {
    /// Only this device: its name or any local address (default: all devices).
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,
    /// Only this port (devices have one port, number 1).
    #[arg(short = 'i', long = "ib-port", value_parser = clap::value_parser!(u8).range(1..))]
    pub port: Option<u8>,
    /// Print only the device names.
    #[arg(short = 'l', long)]
    pub list: bool,
    /// Print all attributes: device limits, port details and the GID table.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Print a JSON array of devices with every field, for scripts.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `softrdma stat`.
#[derive(Debug, clap::Args)]
pub struct StatArgs {
    /// Only this device: its name or any local address.
    pub device: Option<String>,
    /// Only this port (with a device).
    pub port: Option<u8>,
    /// List the device names only.
    #[arg(short = 'l', long = "list_of_cas")]
    pub list: bool,
    /// List the port GUIDs only.
    #[arg(short = 'p', long = "port_list")]
    pub ports: bool,
}

/// Arguments of `softrdma link`.
#[derive(Debug, clap::Args)]
pub struct LinkArgs {}

const DEVICE_CAP_NAMES: [(u32, &str); 3] =
    [(1 << 10, "PORT_ACTIVE_EVENT"), (1 << 11, "SYS_IMAGE_GUID"), (1 << 12, "RC_RNR_NAK_GEN")];

/// What `ibv_query_device` would say.
#[derive(Debug, Serialize)]
struct Limits {
    max_mr_size: u64,
    page_size_cap: u64,
    max_qp: u32,
    max_qp_wr: u32,
    device_cap_flags: u32,
    max_sge: u32,
    max_sge_rd: u32,
    max_cq: u32,
    max_cqe: u32,
    max_mr: u32,
    max_pd: u32,
    max_qp_rd_atom: u32,
    max_ee_rd_atom: u32,
    max_res_rd_atom: u32,
    max_qp_init_rd_atom: u32,
    max_ee_init_rd_atom: u32,
    atomic_cap: &'static str,
    max_ee: u32,
    max_rdd: u32,
    max_mw: u32,
    max_raw_ipv6_qp: u32,
    max_raw_ethy_qp: u32,
    max_mcast_grp: u32,
    max_mcast_qp_attach: u32,
    max_total_mcast_qp_attach: u32,
    max_ah: u32,
    max_fmr: u32,
    max_srq: u32,
    max_srq_wr: u32,
    max_srq_sge: u32,
    max_pkeys: u32,
    local_ca_ack_delay: u8,
    max_inline_data: u32,
    num_comp_vectors: u32,
}

impl Limits {
    fn of(a: &softrdma::DeviceAttr) -> Limits {
        Limits {
            max_mr_size: a.max_mr_size,
            page_size_cap: a.page_size_cap,
            max_qp: a.max_qp,
            max_qp_wr: a.max_qp_wr,
            device_cap_flags: a.device_cap_flags,
            max_sge: a.max_sge,
            max_sge_rd: a.max_sge_rd,
            max_cq: a.max_cq,
            max_cqe: a.max_cqe,
            max_mr: a.max_mr,
            max_pd: a.max_pd,
            max_qp_rd_atom: a.max_qp_rd_atom,
            max_ee_rd_atom: a.max_ee_rd_atom,
            max_res_rd_atom: a.max_res_rd_atom,
            max_qp_init_rd_atom: a.max_qp_init_rd_atom,
            max_ee_init_rd_atom: a.max_ee_init_rd_atom,
            atomic_cap: match a.atomic_cap {
                softrdma::AtomicCap::None => "ATOMIC_NONE",
                softrdma::AtomicCap::Hca => "ATOMIC_HCA",
                softrdma::AtomicCap::Glob => "ATOMIC_GLOB",
            },
            max_ee: a.max_ee,
            max_rdd: a.max_rdd,
            max_mw: a.max_mw,
            max_raw_ipv6_qp: a.max_raw_ipv6_qp,
            max_raw_ethy_qp: a.max_raw_ethy_qp,
            max_mcast_grp: a.max_mcast_grp,
            max_mcast_qp_attach: a.max_mcast_qp_attach,
            max_total_mcast_qp_attach: a.max_total_mcast_qp_attach,
            max_ah: a.max_ah,
            max_fmr: a.max_fmr,
            max_srq: a.max_srq,
            max_srq_wr: a.max_srq_wr,
            max_srq_sge: a.max_srq_sge,
            max_pkeys: u32::from(a.max_pkeys),
            local_ca_ack_delay: a.local_ca_ack_delay,
            max_inline_data: a.max_inline_data,
            num_comp_vectors: 1,
        }
    }
}

/// One GID table entry.
#[derive(Debug, Serialize)]
struct Gid {
    index: u32,
    gid: String,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// What `ibv_query_port` would say about port 1.
#[derive(Debug, Serialize)]
struct Port {
    port: u8,
    state: &'static str,
    state_num: u8,
    max_mtu: u32,
    max_mtu_num: u8,
    active_mtu: u32,
    active_mtu_num: u8,
    sm_lid: u16,
    port_lid: u16,
    port_lmc: u8,
    link_layer: &'static str,
    max_msg_sz: u64,
    port_cap_flags: u32,
    port_cap_flags2: u16,
    max_vl_num: u8,
    bad_pkey_cntr: u32,
    qkey_viol_cntr: u32,
    sm_sl: u8,
    pkey_tbl_len: u16,
    gid_tbl_len: u32,
    subnet_timeout: u8,
    init_type_reply: u8,
    active_width: &'static str,
    active_width_num: u8,
    active_speed: &'static str,
    active_speed_num: u16,
    /// Gb/s, as `ibstat` prints it.
    rate: f64,
    phys_state: &'static str,
    phys_state_num: u8,
    port_guid: String,
    gids: Vec<Gid>,
}

/// Everything the tools print about one device.
#[derive(Debug, Serialize)]
struct Info {
    hca_id: String,
    address: IpAddr,
    netdev: String,
    transport: &'static str,
    transport_num: u8,
    fw_ver: &'static str,
    node_guid: String,
    sys_image_guid: String,
    vendor_id: u32,
    vendor_part_id: u32,
    hw_ver: u32,
    phys_port_cnt: u8,
    #[serde(flatten)]
    limits: Limits,
    ports: Vec<Port>,
    #[serde(skip)]
    guid: u64,
    #[serde(skip)]
    up: bool,
}

/// `ibv_port_attr`'s active width as `ibv_devinfo` prints it (before the `X`).
fn width_str(width: u8) -> &'static str {
    match width {
        1 => "1",
        2 => "4",
        4 => "8",
        8 => "12",
        16 => "2",
        _ => "invalid width",
    }
}

/// `ibv_port_attr`'s active speed as `ibv_devinfo` prints it.
fn speed_str(speed: u16) -> &'static str {
    match speed {
        1 => "2.5 Gbps",
        2 => "5.0 Gbps",
        4 | 8 => "10.0 Gbps",
        16 => "14.0 Gbps",
        32 => "25.0 Gbps",
        64 => "50.0 Gbps",
        128 => "100.0 Gbps",
        256 => "200.0 Gbps",
        _ => "invalid speed",
    }
}

/// `ibv_devinfo`'s GUID form: four groups of four hex digits.
fn guid_str(guid: u64) -> String {
    format!(
        "{:04x}:{:04x}:{:04x}:{:04x}",
        guid >> 48,
        (guid >> 32) & 0xffff,
        (guid >> 16) & 0xffff,
        guid & 0xffff
    )
}

impl Info {
    fn of(d: &Device) -> Info {
        let a = d.attr();
        let p = d.port_attr();
        let gid = d.gids.first().map_or([0; 16], |g| g.gid);
        let port_guid = u64::from_be_bytes(gid[8..].try_into().unwrap_or_default());
        let active = p.state == softrdma::PortState::Active;
        let port = Port {
            port: 1,
            state: if active { "PORT_ACTIVE" } else { "PORT_DOWN" },
            state_num: p.state as u8,
            max_mtu: p.max_mtu.bytes(),
            max_mtu_num: p.max_mtu as u8,
            active_mtu: p.active_mtu.bytes(),
            active_mtu_num: p.active_mtu as u8,
            sm_lid: p.sm_lid,
            port_lid: p.lid,
            port_lmc: p.lmc,
            link_layer: "Ethernet",
            max_msg_sz: p.max_msg_sz,
            port_cap_flags: p.port_cap_flags,
            port_cap_flags2: p.port_cap_flags2,
            max_vl_num: p.max_vl_num,
            bad_pkey_cntr: p.bad_pkey_cntr,
            qkey_viol_cntr: p.qkey_viol_cntr,
            sm_sl: p.sm_sl,
            pkey_tbl_len: p.pkey_tbl_len,
            gid_tbl_len: p.gid_tbl_len,
            subnet_timeout: p.subnet_timeout,
            init_type_reply: p.init_type_reply,
            active_width: width_str(p.active_width),
            active_width_num: p.active_width,
            active_speed: speed_str(p.active_speed),
            active_speed_num: p.active_speed,
            rate: p.rate_gbps,
            phys_state: if p.phys_state == 5 { "LINK_UP" } else { "DISABLED" },
            phys_state_num: p.phys_state,
            port_guid: format!("0x{port_guid:016x}"),
            gids: d
                .gids
                .iter()
                .map(|g| Gid { index: g.index, gid: Ipv6Addr::from(g.gid).to_string(), kind: "RoCE v2" })
                .collect(),
        };
        Info {
            hca_id: d.name.clone(),
            address: d.addr,
            netdev: d.netdev.clone(),
            transport: "InfiniBand",
            transport_num: 0,
            fw_ver: env!("CARGO_PKG_VERSION"),
            node_guid: guid_str(a.node_guid),
            sys_image_guid: guid_str(a.sys_image_guid),
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            hw_ver: a.hw_ver,
            phys_port_cnt: a.phys_port_cnt,
            limits: Limits::of(&a),
            ports: vec![port],
            guid: a.node_guid,
            up: active,
        }
    }

    /// The `ibv_devinfo` block, ending with a blank line after each port.
    fn devinfo(&self, port: Option<u8>, verbose: bool) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "hca_id:\t{}", self.hca_id);
        let _ = writeln!(o, "\ttransport:\t\t\t{} ({})", self.transport, self.transport_num);
        let _ = writeln!(o, "\tfw_ver:\t\t\t\t{}", self.fw_ver);
        let _ = writeln!(o, "\tnode_guid:\t\t\t{}", self.node_guid);
        let _ = writeln!(o, "\tsys_image_guid:\t\t\t{}", self.sys_image_guid);
        let _ = writeln!(o, "\tvendor_id:\t\t\t0x{:04x}", self.vendor_id);
        let _ = writeln!(o, "\tvendor_part_id:\t\t\t{}", self.vendor_part_id);
        let _ = writeln!(o, "\thw_ver:\t\t\t\t0x{:X}", self.hw_ver);
        let _ = writeln!(o, "\tphys_port_cnt:\t\t\t{}", self.phys_port_cnt);
        if verbose {
            self.limits_text(&mut o);
        }
        for p in self.ports.iter().filter(|p| port.unwrap_or(p.port) == p.port) {
            let _ = writeln!(o, "\t\tport:\t{}", p.port);
            let _ = writeln!(o, "\t\t\tstate:\t\t\t{} ({})", p.state, p.state_num);
            let _ = writeln!(o, "\t\t\tmax_mtu:\t\t{} ({})", p.max_mtu, p.max_mtu_num);
            let _ = writeln!(o, "\t\t\tactive_mtu:\t\t{} ({})", p.active_mtu, p.active_mtu_num);
            let _ = writeln!(o, "\t\t\tsm_lid:\t\t\t{}", p.sm_lid);
            let _ = writeln!(o, "\t\t\tport_lid:\t\t{}", p.port_lid);
            let _ = writeln!(o, "\t\t\tport_lmc:\t\t0x{:02x}", p.port_lmc);
            let _ = writeln!(o, "\t\t\tlink_layer:\t\t{}", p.link_layer);
            if verbose {
                let _ = writeln!(o, "\t\t\tmax_msg_sz:\t\t0x{:x}", p.max_msg_sz);
                let _ = writeln!(o, "\t\t\tport_cap_flags:\t\t0x{:08x}", p.port_cap_flags);
                let _ = writeln!(o, "\t\t\tport_cap_flags2:\t0x{:04x}", p.port_cap_flags2);
                let _ = writeln!(o, "\t\t\tmax_vl_num:\t\t{} ({})", p.max_vl_num, p.max_vl_num);
                let _ = writeln!(o, "\t\t\tbad_pkey_cntr:\t\t0x{:x}", p.bad_pkey_cntr);
                let _ = writeln!(o, "\t\t\tqkey_viol_cntr:\t\t0x{:x}", p.qkey_viol_cntr);
                let _ = writeln!(o, "\t\t\tsm_sl:\t\t\t{}", p.sm_sl);
                let _ = writeln!(o, "\t\t\tpkey_tbl_len:\t\t{}", p.pkey_tbl_len);
                let _ = writeln!(o, "\t\t\tgid_tbl_len:\t\t{}", p.gid_tbl_len);
                let _ = writeln!(o, "\t\t\tsubnet_timeout:\t\t{}", p.subnet_timeout);
                let _ = writeln!(o, "\t\t\tinit_type_reply:\t{}", p.init_type_reply);
                let _ = writeln!(o, "\t\t\tactive_width:\t\t{}X ({})", p.active_width, p.active_width_num);
                let _ = writeln!(o, "\t\t\tactive_speed:\t\t{} ({})", p.active_speed, p.active_speed_num);
                let _ = writeln!(o, "\t\t\tphys_state:\t\t{} ({})", p.phys_state, p.phys_state_num);
                for g in &p.gids {
                    let _ = writeln!(o, "\t\t\tGID[{:3}]:\t\t{}, {}", g.index, g.gid, g.kind);
                }
            }
            o.push('\n');
        }
        o
    }

    /// The device attributes `ibv_devinfo -v` adds, in its order.
    fn limits_text(&self, o: &mut String) {
        let l = &self.limits;
        let _ = writeln!(o, "\tmax_mr_size:\t\t\t0x{:x}", l.max_mr_size);
        let _ = writeln!(o, "\tpage_size_cap:\t\t\t0x{:x}", l.page_size_cap);
        let _ = writeln!(o, "\tmax_qp:\t\t\t\t{}", l.max_qp);
        let _ = writeln!(o, "\tmax_qp_wr:\t\t\t{}", l.max_qp_wr);
        let _ = writeln!(o, "\tdevice_cap_flags:\t\t0x{:08x}", l.device_cap_flags);
        for (bit, name) in DEVICE_CAP_NAMES {
            if l.device_cap_flags & bit != 0 {
                let _ = writeln!(o, "\t\t\t\t\t{name}");
            }
        }
        let rows: [(&str, &str, u32); 10] = [
            ("max_sge", "\t\t\t", l.max_sge),
            ("max_sge_rd", "\t\t\t", l.max_sge_rd),
            ("max_cq", "\t\t\t\t", l.max_cq),
            ("max_cqe", "\t\t\t", l.max_cqe),
            ("max_mr", "\t\t\t\t", l.max_mr),
            ("max_pd", "\t\t\t\t", l.max_pd),
            ("max_qp_rd_atom", "\t\t\t", l.max_qp_rd_atom),
            ("max_ee_rd_atom", "\t\t\t", l.max_ee_rd_atom),
            ("max_res_rd_atom", "\t\t", l.max_res_rd_atom),
            ("max_qp_init_rd_atom", "\t\t", l.max_qp_init_rd_atom),
        ];
        for (name, tabs, v) in rows {
            let _ = writeln!(o, "\t{name}:{tabs}{v}");
        }
        let _ = writeln!(o, "\tmax_ee_init_rd_atom:\t\t{}", l.max_ee_init_rd_atom);
        let _ = writeln!(o, "\tatomic_cap:\t\t\t{} (1)", l.atomic_cap);
        let rows: [(&str, &str, u32); 15] = [
            ("max_ee", "\t\t\t\t", l.max_ee),
            ("max_rdd", "\t\t\t", l.max_rdd),
            ("max_mw", "\t\t\t\t", l.max_mw),
            ("max_raw_ipv6_qp", "\t\t", l.max_raw_ipv6_qp),
            ("max_raw_ethy_qp", "\t\t", l.max_raw_ethy_qp),
            ("max_mcast_grp", "\t\t\t", l.max_mcast_grp),
            ("max_mcast_qp_attach", "\t\t", l.max_mcast_qp_attach),
            ("max_total_mcast_qp_attach", "\t", l.max_total_mcast_qp_attach),
            ("max_ah", "\t\t\t\t", l.max_ah),
            ("max_fmr", "\t\t\t", l.max_fmr),
            ("max_srq", "\t\t\t", l.max_srq),
            ("max_srq_wr", "\t\t\t", l.max_srq_wr),
            ("max_srq_sge", "\t\t\t", l.max_srq_sge),
            ("max_pkeys", "\t\t\t", l.max_pkeys),
            ("local_ca_ack_delay", "\t\t", u32::from(l.local_ca_ack_delay)),
        ];
        for (name, tabs, v) in rows {
            let _ = writeln!(o, "\t{name}:{tabs}{v}");
        }
        o.push_str("\tgeneral_odp_caps:\n");
        for t in ["rc", "uc", "ud", "xrc"] {
            let _ = writeln!(o, "\t{t}_odp_caps:\n\t\t\t\t\tNO SUPPORT");
        }
        o.push_str("\tcompletion_timestamp_mask not supported\n");
        o.push_str("\tcore clock not supported\n");
        let _ = writeln!(o, "\tdevice_cap_flags_ex:\t\t0x{:X}", l.device_cap_flags);
        o.push_str("\ttso_caps:\n\t\tmax_tso:\t\t\t0\n");
        o.push_str("\trss_caps:\n");
        o.push_str("\t\tmax_rwq_indirection_tables:\t\t\t0\n");
        o.push_str("\t\tmax_rwq_indirection_table_size:\t\t\t0\n");
        o.push_str("\t\trx_hash_function:\t\t\t\t0x0\n");
        o.push_str("\t\trx_hash_fields_mask:\t\t\t\t0x0\n");
        o.push_str("\tmax_wq_type_rq:\t\t\t0\n");
        o.push_str("\tpacket_pacing_caps:\n\t\tqp_rate_limit_min:\t0kbps\n\t\tqp_rate_limit_max:\t0kbps\n");
        o.push_str("\ttag matching not supported\n");
        let _ = writeln!(o, "\tnum_comp_vectors:\t\t{}", l.num_comp_vectors);
    }

    /// The `ibstat` CA header.
    fn stat_header(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "CA '{}'", self.hca_id);
        o.push_str("\tCA type: softrdma\n");
        let _ = writeln!(o, "\tNumber of ports: {}", self.phys_port_cnt);
        let _ = writeln!(o, "\tFirmware version: {}", self.fw_ver);
        let _ = writeln!(o, "\tHardware version: {}", self.hw_ver);
        let _ = writeln!(o, "\tNode GUID: 0x{:016x}", self.guid);
        let _ = writeln!(o, "\tSystem image GUID: 0x{:016x}", self.guid);
        o
    }

    /// An `ibstat` port block; `alone` (a port asked for by number) drops the indentation.
    fn stat_port(p: &Port, alone: bool) -> String {
        let (hdr, pre) = if alone { ("", "") } else { ("\t", "\t\t") };
        let state = if p.state_num == 4 { "Active" } else { "Down" };
        let phys = if p.phys_state_num == 5 { "LinkUp" } else { "Disabled" };
        let mut o = String::new();
        let _ = writeln!(o, "{hdr}Port {}:", p.port);
        let _ = writeln!(o, "{pre}State: {state}");
        let _ = writeln!(o, "{pre}Physical state: {phys}");
        let _ = writeln!(o, "{pre}Rate: {}", p.rate);
        let _ = writeln!(o, "{pre}Base lid: {}", p.port_lid);
        let _ = writeln!(o, "{pre}LMC: {}", p.port_lmc);
        let _ = writeln!(o, "{pre}SM lid: {}", p.sm_lid);
        let _ = writeln!(o, "{pre}Capability mask: 0x{:08x}", p.port_cap_flags);
        let _ = writeln!(o, "{pre}Port GUID: {}", p.port_guid);
        let _ = writeln!(o, "{pre}Link layer: {}", p.link_layer);
        o
    }
}

/// Writes the output; a closed pipe (`| head`) is not an error worth a panic.
fn emit(out: &str) {
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
}

/// All devices, or the one named (by name or address).
fn select(cmd: &str, which: Option<&str>) -> Result<Vec<Device>, i32> {
    let found = match which {
        Some(name) => softrdma::find_device(name).map(|d| vec![d]),
        None => softrdma::devices(),
    };
    match found {
        Ok(v) if v.is_empty() => {
            eprintln!("softrdma {cmd}: no RDMA devices found");
            Err(1)
        }
        Ok(v) => Ok(v),
        Err(e) => {
            eprintln!("softrdma {cmd}: {e}");
            Err(1)
        }
    }
}

/// `ibv_devices`: the device names and node GUIDs.
pub fn devices(_: &DevicesArgs) -> i32 {
    let devs = match softrdma::devices() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("softrdma devices: {e}");
            return 1;
        }
    };
    let mut o = String::new();
    let _ = writeln!(o, "    {:<16}\t   node GUID", "device");
    let _ = writeln!(o, "    {:<16}\t----------------", "------");
    for d in &devs {
        let _ = writeln!(o, "    {:<16}\t{:016x}", d.name, d.node_guid);
    }
    emit(&o);
    0
}

/// `ibv_devinfo`: devices, their port, and with -v their limits and GIDs.
pub fn devinfo(args: &DevinfoArgs) -> i32 {
    let devs = match select("devinfo", args.device.as_deref()) {
        Ok(v) => v,
        Err(code) => return code,
    };
    if args.list {
        let n = devs.len();
        let mut o = format!("{n} HCA{} found:\n", if n == 1 { "" } else { "s" });
        for d in &devs {
            let _ = writeln!(o, "\t{}", d.name);
        }
        o.push('\n');
        emit(&o);
        return 0;
    }
    if let Some(p) = args.port.filter(|&p| p != 1) {
        eprintln!("softrdma devinfo: invalid port {p} requested: devices have one port, 1");
        return 1;
    }
    let infos: Vec<Info> = devs.iter().map(Info::of).collect();
    if args.json {
        match serde_json::to_string_pretty(&infos) {
            Ok(s) => emit(&(s + "\n")),
            Err(e) => {
                eprintln!("softrdma devinfo: {e}");
                return 1;
            }
        }
        return 0;
    }
    let out: String = infos.iter().map(|i| i.devinfo(args.port, args.verbose)).collect();
    emit(&out);
    0
}

/// `ibstat`: each CA and its port's state.
pub fn stat(args: &StatArgs) -> i32 {
    let devs = match select("stat", args.device.as_deref()) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let infos: Vec<Info> = devs.iter().map(Info::of).collect();
    let mut o = String::new();
    if args.ports {
        for i in &infos {
            for p in &i.ports {
                let _ = writeln!(o, "{}", p.port_guid);
            }
        }
    } else if args.list {
        for i in &infos {
            let _ = writeln!(o, "{}", i.hca_id);
        }
    } else if let (Some(n), Some(i)) = (args.port, infos.first()) {
        let Some(p) = i.ports.iter().find(|p| p.port == n) else {
            eprintln!("softrdma stat: CA '{}' has no port number {n} - max ({})", i.hca_id, i.phys_port_cnt);
            return 1;
        };
        let _ = writeln!(o, "CA: '{}'", i.hca_id);
        o.push_str(&Info::stat_port(p, true));
    } else {
        for i in &infos {
            o.push_str(&i.stat_header());
            for p in &i.ports {
                o.push_str(&Info::stat_port(p, false));
            }
        }
    }
    emit(&o);
    0
}

/// `ibdev2netdev`: which interface each device is on, and whether it is up.
pub fn link(_: &LinkArgs) -> i32 {
    let devs = match select("link", None) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let mut o = String::new();
    for i in devs.iter().map(Info::of) {
        let state = if i.up { "Up" } else { "Down" };
        let _ = writeln!(o, "{} port 1 ==> {} ({state})", i.hca_id, i.netdev);
    }
    emit(&o);
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guid_groups() {
        assert_eq!(guid_str(0x0200_0000_7f00_0001), "0200:0000:7f00:0001");
    }

    #[test]
    fn width_and_speed_names() {
        assert_eq!((width_str(2), width_str(16), width_str(3)), ("4", "2", "invalid width"));
        assert_eq!((speed_str(8), speed_str(32)), ("10.0 Gbps", "25.0 Gbps"));
    }
}
