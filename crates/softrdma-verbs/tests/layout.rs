//! Every structure of `softrdma_verbs::abi` against the real `<infiniband/verbs.h>`: a C
//! program compiled against Debian's libibverbs-dev prints the size of each structure and
//! the offset and size of each field the library reads or writes, and they must equal
//! Rust's. Without the header the test is skipped, unless CI is set.

use std::mem::{offset_of, size_of};
use std::process::Command;

use softrdma_verbs::abi::*;

/// The size of a field, from a projection closure.
fn field_size<T, F>(_: fn(&T) -> &F) -> usize {
    size_of::<F>()
}

/// (C expression naming the member, Rust offset, Rust size) or (struct, size).
enum Item {
    Size(&'static str, usize),
    Field(&'static str, &'static str, usize, usize),
}

macro_rules! layout {
    ($($ty:ident { $($f:ident),* $(,)? })*) => {{
        let mut v = Vec::new();
        $(
            v.push(Item::Size(stringify!($ty), size_of::<$ty>()));
            $( v.push(Item::Field(stringify!($ty), stringify!($f), offset_of!($ty, $f),
                field_size(|s: &$ty| &s.$f))); )*
        )*
        v
    }};
}

fn items() -> Vec<Item> {
    let mut v = layout! {
        ibv_device { node_type, transport_type, name, dev_name, dev_path, ibdev_path }
        ibv_context_ops { poll_cq, req_notify_cq, post_srq_recv, post_send, post_recv }
        ibv_context { device, ops, cmd_fd, async_fd, num_comp_vectors, mutex, abi_compat }
        ibv_device_attr {
            fw_ver, node_guid, sys_image_guid, max_mr_size, page_size_cap, vendor_id, vendor_part_id,
            hw_ver, max_qp, max_qp_wr, device_cap_flags, max_sge, max_sge_rd, max_cq, max_cqe, max_mr,
            max_pd, max_qp_rd_atom, max_ee_rd_atom, max_res_rd_atom, max_qp_init_rd_atom,
            max_ee_init_rd_atom, atomic_cap, max_ee, max_rdd, max_mw, max_raw_ipv6_qp, max_raw_ethy_qp,
            max_mcast_grp, max_mcast_qp_attach, max_total_mcast_qp_attach, max_ah, max_fmr,
            max_map_per_fmr, max_srq, max_srq_wr, max_srq_sge, max_pkeys, local_ca_ack_delay,
            phys_port_cnt,
        }
        ibv_port_attr {
            state, max_mtu, active_mtu, gid_tbl_len, port_cap_flags, max_msg_sz, bad_pkey_cntr,
            qkey_viol_cntr, pkey_tbl_len, lid, sm_lid, lmc, max_vl_num, sm_sl, subnet_timeout,
            init_type_reply, active_width, active_speed, phys_state, link_layer, flags, port_cap_flags2,
        }
        ibv_gid_entry { gid, gid_index, port_num, gid_type, ndev_ifindex }
        ibv_pd { context, handle }
        ibv_mr { context, pd, addr, length, handle, lkey, rkey }
        ibv_comp_channel { context, fd, refcnt }
        ibv_cq { context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed,
                 async_events_completed }
        ibv_srq { context, srq_context, pd, handle, mutex, cond, events_completed }
        ibv_qp { context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type, mutex,
                 cond, events_completed }
        ibv_ah { context, pd, handle }
        ibv_sge { addr, length, lkey }
        ibv_send_wr { wr_id, next, sg_list, num_sge, opcode, send_flags, imm_data, wr }
        ibv_recv_wr { wr_id, next, sg_list, num_sge }
        ibv_wc { wr_id, status, opcode, vendor_err, byte_len, imm_data, qp_num, src_qp, wc_flags,
                 pkey_index, slid, sl, dlid_path_bits }
        ibv_qp_cap { max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data }
        ibv_qp_init_attr { qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all }
        ibv_gid { raw }
        ibv_global_route { dgid, flow_label, sgid_index, hop_limit, traffic_class }
        ibv_ah_attr { grh, dlid, sl, src_path_bits, static_rate, is_global, port_num }
        ibv_qp_attr {
            qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn, dest_qp_num,
            qp_access_flags, cap, ah_attr, alt_ah_attr, pkey_index, alt_pkey_index, en_sqd_async_notify,
            sq_draining, max_rd_atomic, max_dest_rd_atomic, min_rnr_timer, port_num, timeout, retry_cnt,
            rnr_retry, alt_port_num, alt_timeout, rate_limit,
        }
        ibv_srq_attr { max_wr, max_sge, srq_limit }
        ibv_srq_init_attr { srq_context, attr }
        ibv_async_event { element, event_type }
        ibv_qp_init_attr_ex {
            qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all, comp_mask, pd, xrcd,
            create_flags, max_tso_header, rwq_ind_tbl, rx_hash_conf, source_qpn, send_ops_flags,
        }
        ibv_cq_init_attr_ex { cqe, cq_context, channel, comp_vector, wc_flags, comp_mask, flags, parent_domain }
        ibv_poll_cq_attr { comp_mask }
        ibv_data_buf { addr, length }
        ibv_values_ex { comp_mask, raw_clock }
    };
    // `ibv_qp_ex` and `ibv_cq_ex` are `ibv_qp` / `ibv_cq` followed by the tail the library
    // lays out after them; the head of `ibv_device_attr_ex` is checked field by field.
    macro_rules! tail {
        ($c:literal, $base:expr, $tail:ty { $($f:ident),* $(,)? }) => {
            let base = $base;
            $( v.push(Item::Field($c, stringify!($f), base + offset_of!($tail, $f),
                field_size(|t: &$tail| &t.$f))); )*
        };
    }
    v.push(Item::Size("ibv_qp_ex", size_of::<ibv_qp>() + size_of::<ibv_qp_ex_tail>()));
    tail!(
        "ibv_qp_ex",
        size_of::<ibv_qp>(),
        ibv_qp_ex_tail {
            comp_mask,
            wr_id,
            wr_flags,
            wr_atomic_cmp_swp,
            wr_atomic_fetch_add,
            wr_bind_mw,
            wr_local_inv,
            wr_rdma_read,
            wr_rdma_write,
            wr_rdma_write_imm,
            wr_send,
            wr_send_imm,
            wr_send_inv,
            wr_send_tso,
            wr_set_ud_addr,
            wr_set_xrc_srqn,
            wr_set_inline_data,
            wr_set_inline_data_list,
            wr_set_sge,
            wr_set_sge_list,
            wr_start,
            wr_complete,
            wr_abort,
            wr_atomic_write,
        }
    );
    v.push(Item::Size("ibv_cq_ex", size_of::<ibv_cq>() + size_of::<ibv_cq_ex_tail>()));
    tail!(
        "ibv_cq_ex",
        size_of::<ibv_cq>(),
        ibv_cq_ex_tail {
            comp_mask,
            status,
            wr_id,
            start_poll,
            next_poll,
            end_poll,
            read_opcode,
            read_vendor_err,
            read_byte_len,
            read_imm_data,
            read_qp_num,
            read_src_qp,
            read_wc_flags,
            read_slid,
            read_sl,
            read_dlid_path_bits,
            read_completion_ts,
            read_cvlan,
            read_flow_tag,
            read_tm_info,
            read_completion_wallclock_ns,
        }
    );
    tail!(
        "ibv_device_attr_ex",
        0,
        ibv_device_attr_ex_head {
            orig_attr,
            comp_mask,
            odp_caps,
            completion_timestamp_mask,
            hca_core_clock,
            device_cap_flags_ex,
        }
    );
    let odp = offset_of!(ibv_device_attr_ex_head, odp_caps);
    for (path, off) in [
        ("odp_caps.per_transport_caps.rc_odp_caps", offset_of!(ibv_odp_caps, rc_odp_caps)),
        ("odp_caps.per_transport_caps.uc_odp_caps", offset_of!(ibv_odp_caps, uc_odp_caps)),
        ("odp_caps.per_transport_caps.ud_odp_caps", offset_of!(ibv_odp_caps, ud_odp_caps)),
    ] {
        v.push(Item::Field("ibv_device_attr_ex", path, odp + off, 4));
    }
    // The work request's union members, as C names them.
    let wr = offset_of!(ibv_send_wr, wr);
    let nested = [
        ("wr.rdma.remote_addr", wr + offset_of!(ibv_rdma, remote_addr), 8),
        ("wr.rdma.rkey", wr + offset_of!(ibv_rdma, rkey), 4),
        ("wr.atomic.remote_addr", wr + offset_of!(ibv_atomic, remote_addr), 8),
        ("wr.atomic.compare_add", wr + offset_of!(ibv_atomic, compare_add), 8),
        ("wr.atomic.swap", wr + offset_of!(ibv_atomic, swap), 8),
        ("wr.atomic.rkey", wr + offset_of!(ibv_atomic, rkey), 4),
        ("wr.ud.ah", wr + offset_of!(ibv_ud, ah), 8),
        ("wr.ud.remote_qpn", wr + offset_of!(ibv_ud, remote_qpn), 4),
        ("wr.ud.remote_qkey", wr + offset_of!(ibv_ud, remote_qkey), 4),
    ];
    for (path, off, size) in nested {
        v.push(Item::Field("ibv_send_wr", path, off, size));
    }
    v
}

/// librdmacm's structures (`<rdma/rdma_cma.h>`): `rdma_cm_id` and the events are read by
/// programs directly and by `rdma_verbs.h`'s inline functions.
fn rdmacm_items() -> Vec<Item> {
    let mut v = layout! {
        rdma_event_channel { fd }
        rdma_ib_addr { sgid, dgid, pkey }
        rdma_route { addr, path_rec, num_paths }
        rdma_cm_id {
            verbs, channel, context, qp, route, ps, port_num, event, send_cq_channel, send_cq,
            recv_cq_channel, recv_cq, srq, pd, qp_type,
        }
        rdma_conn_param {
            private_data, private_data_len, responder_resources, initiator_depth, flow_control,
            retry_count, rnr_retry_count, srq, qp_num,
        }
        rdma_ud_param { private_data, private_data_len, ah_attr, qp_num, qkey }
        rdma_cm_event { id, listen_id, event, status, param }
        rdma_addrinfo {
            ai_flags, ai_family, ai_qp_type, ai_port_space, ai_src_len, ai_dst_len, ai_src_addr,
            ai_dst_addr, ai_src_canonname, ai_dst_canonname, ai_route_len, ai_route, ai_connect_len,
            ai_connect, ai_next,
        }
        ibv_sa_path_rec { dgid, sgid }
    };
    // The address unions, by their C member names.
    v.push(Item::Size("rdma_addr", size_of::<rdma_addr>()));
    v.push(Item::Field("rdma_addr", "src_storage", offset_of!(rdma_addr, src_addr), 128));
    v.push(Item::Field("rdma_addr", "dst_storage", offset_of!(rdma_addr, dst_addr), 128));
    v.push(Item::Field("rdma_addr", "addr.ibaddr", offset_of!(rdma_addr, ibaddr), size_of::<rdma_ib_addr>()));
    let route = offset_of!(rdma_cm_id, route);
    v.push(Item::Field("rdma_cm_id", "route.addr.src_storage", route + offset_of!(rdma_addr, src_addr), 128));
    v.push(Item::Field("rdma_cm_id", "route.addr.dst_storage", route + offset_of!(rdma_addr, dst_addr), 128));
    let param = offset_of!(rdma_cm_event, param);
    for (path, off, size) in [
        ("param.conn.private_data", offset_of!(rdma_conn_param, private_data), 8),
        ("param.conn.private_data_len", offset_of!(rdma_conn_param, private_data_len), 1),
        ("param.conn.qp_num", offset_of!(rdma_conn_param, qp_num), 4),
        ("param.ud.ah_attr", offset_of!(rdma_ud_param, ah_attr), size_of::<ibv_ah_attr>()),
        ("param.ud.qp_num", offset_of!(rdma_ud_param, qp_num), 4),
        ("param.ud.qkey", offset_of!(rdma_ud_param, qkey), 4),
    ] {
        v.push(Item::Field("rdma_cm_event", path, param + off, size));
    }
    v
}

/// `union` for the C unions mirrored as Rust structures, `struct` for the rest.
fn tag(name: &str) -> &'static str {
    if name == "ibv_gid" {
        "union"
    } else {
        "struct"
    }
}

#[test]
fn structures_match_the_real_header() {
    if !std::path::Path::new("/usr/include/infiniband/verbs.h").exists() {
        assert!(std::env::var_os("CI").is_none(), "CI needs libibverbs-dev for the layout test");
        eprintln!("skipped: /usr/include/infiniband/verbs.h missing (apt-get install libibverbs-dev)");
        return;
    }
    let mut items = items();
    let verbs_only = items.len();
    let cm_header = std::path::Path::new("/usr/include/rdma/rdma_cma.h").exists();
    if cm_header {
        items.extend(rdmacm_items());
    } else {
        assert!(std::env::var_os("CI").is_none(), "CI needs librdmacm-dev for the layout test");
        eprintln!("librdmacm's structures skipped: /usr/include/rdma/rdma_cma.h missing (apt-get install librdmacm-dev)");
    }
    let mut c = String::from(if cm_header { "#include <rdma/rdma_cma.h>\n" } else { "" });
    c.push_str(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\n\
         #define F(t, s, f) printf(\"%s.%s %zu %zu\\n\", #s, #f, offsetof(t s, f), sizeof(((t s *)0)->f))\n\
         int main(void) {\n",
    );
    for it in &items {
        match it {
            Item::Size(s, _) => c += &format!("printf(\"{s} %zu\\n\", sizeof({} {s}));\n", tag(s)),
            Item::Field(s, f, _, _) => c += &format!("F({}, {s}, {f});\n", tag(s)),
        }
    }
    c += "return 0; }\n";
    let dir = std::env::temp_dir().join(format!("softrdma-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("layout.c"), dir.join("layout"));
    std::fs::write(&src, c).unwrap();
    let cc = Command::new("cc").arg("-o").arg(&exe).arg(&src).output().expect("run cc");
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let out = Command::new(&exe).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let mut wrong = Vec::new();
    for it in &items {
        let line = lines.next().expect("a line per item");
        let got: Vec<&str> = line.split(' ').collect();
        let (name, want) = match it {
            Item::Size(s, n) => (s.to_string(), vec![n.to_string()]),
            Item::Field(s, f, off, size) => (format!("{s}.{f}"), vec![off.to_string(), size.to_string()]),
        };
        assert_eq!(got[0], name);
        if got[1..] != want.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            wrong.push(format!("{name}: C {:?}, Rust {want:?}", &got[1..]));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(wrong.is_empty(), "layouts differ:\n{}", wrong.join("\n"));
    assert!(verbs_only > 200, "{verbs_only} verbs items checked");
    assert!(
        !cm_header || items.len() > verbs_only + 60,
        "{} librdmacm items checked",
        items.len() - verbs_only
    );
}
