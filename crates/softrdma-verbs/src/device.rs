//! Devices and contexts: `ibv_get_device_list`, `ibv_open_device`, the queries, the async
//! event fd, and the sysfs directory `ibdev_path` points to.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::IpAddr;
use std::ptr;
use std::sync::OnceLock;

use softrdma::{Context, Device, GidType};

use crate::abi::*;
use crate::{nonblocking, set_errno, Ctx};

/// Names the address a process uses: its device is listed first, with that address as
/// GID 0 (programs exchange only GIDs, so two processes on one host need two addresses).
pub const BIND_ENV: &str = softrdma::BIND_ENV;
/// Mark every QP's peer as foreign (Linux rxe, a RoCE NIC): ICRCs are checked as a
/// kernel-built packet needs (see `QueuePair::set_foreign_peer`).
pub const FOREIGN_ENV: &str = "SOFTRDMA_FOREIGN";
/// Where the per-device sysfs files are written (default: `$XDG_RUNTIME_DIR` or the
/// temporary directory, under `softrdma-sysfs-<uid>`).
pub const SYSFS_ENV: &str = "SOFTRDMA_SYSFS";

/// A device's `ibv_device.dev_name`, the entry programs such as UCX look for under
/// `/dev/infiniband` (`softrdma exec` provides it).
pub fn dev_name(device: &str) -> String {
    format!("uverbs_{device}")
}

/// One listed device: the `ibv_device` programs see, and what it describes.
pub(crate) struct Dev {
    pub(crate) ibv: ibv_device,
    pub(crate) desc: Device,
}

// SAFETY: the raw pointers in `ibv_device` are always null; the value is never mutated
// after the list is built.
unsafe impl Send for Dev {}
// SAFETY: as above.
unsafe impl Sync for Dev {}

fn copy_str(dst: &mut [c_char], s: &str) {
    let room = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(room)) {
        *d = b as c_char;
    }
}

/// The host's devices, as `softrdma devices` lists them, the bound address's first. Built
/// once per process: `ibv_device` pointers stay valid for the process's life, as
/// rdma-core's do.
pub(crate) fn devices() -> &'static [Dev] {
    static LIST: OnceLock<Vec<Dev>> = OnceLock::new();
    LIST.get_or_init(|| {
        let mut descs = softrdma::devices().unwrap_or_default();
        if let Some(bind) = std::env::var(BIND_ENV).ok().and_then(|b| b.trim().parse::<IpAddr>().ok()) {
            match softrdma::find_device(&bind.to_string()) {
                Ok(d) => {
                    descs.retain(|x| x.name != d.name);
                    descs.insert(0, d.with_gid0(bind));
                }
                Err(e) => eprintln!("softrdma: {BIND_ENV}={bind}: {e}"),
            }
        }
        let sysfs = sysfs_root();
        descs
            .into_iter()
            .map(|desc| {
                // SAFETY: ibv_device is plain data (integers, arrays, null pointers).
                let mut ibv: ibv_device = unsafe { std::mem::zeroed() };
                ibv.node_type = IBV_NODE_CA;
                ibv.transport_type = IBV_TRANSPORT_IB;
                copy_str(&mut ibv.name, &desc.name);
                copy_str(&mut ibv.dev_name, &dev_name(&desc.name));
                if let Some(root) = &sysfs {
                    let dir = write_sysfs(root, &desc);
                    copy_str(&mut ibv.ibdev_path, &dir);
                    copy_str(&mut ibv.dev_path, &dir);
                }
                Dev { ibv, desc }
            })
            .collect()
    })
}

fn sysfs_root() -> Option<std::path::PathBuf> {
    if let Ok(p) = std::env::var(SYSFS_ENV) {
        return Some(p.into());
    }
    let base = std::env::var_os("XDG_RUNTIME_DIR").map(Into::into).unwrap_or_else(std::env::temp_dir);
    // SAFETY: getuid has no preconditions.
    Some(base.join(format!("softrdma-sysfs-{}", unsafe { libc::getuid() })))
}

/// Writes the files programs read under a device's sysfs directory (`ibv_devinfo`'s
/// `fw_ver` and `node_desc`, the port's GID types and netdevs as UCX reads them) and
/// returns the directory. Failures leave the files missing, which readers tolerate.
fn write_sysfs(root: &std::path::Path, d: &Device) -> String {
    let dir = root.join(&d.name);
    let port = dir.join("ports/1");
    let attr = d.attr();
    let mut files: Vec<(std::path::PathBuf, String)> = vec![
        (dir.join("fw_ver"), attr.fw_ver.clone()),
        (dir.join("node_desc"), format!("softrdma {}", d.netdev)),
        (dir.join("node_type"), "1: CA".into()),
        (dir.join("node_guid"), guid_str(d.node_guid)),
        (dir.join("sys_image_guid"), guid_str(d.node_guid)),
        (port.join("link_layer"), "Ethernet".into()),
        (port.join("state"), if d.up { "4: ACTIVE" } else { "1: DOWN" }.into()),
        (port.join("phys_state"), if d.up { "5: LinkUp" } else { "3: Disabled" }.into()),
    ];
    for g in &d.gids {
        let gid = g.gid.chunks(2).map(|c| format!("{:02x}{:02x}", c[0], c[1])).collect::<Vec<_>>().join(":");
        files.push((port.join(format!("gids/{}", g.index)), gid));
        let ty = match g.gid_type {
            GidType::RoceV2 => "RoCE v2",
        };
        files.push((port.join(format!("gid_attrs/types/{}", g.index)), ty.into()));
        files.push((port.join(format!("gid_attrs/ndevs/{}", g.index)), d.netdev.clone()));
    }
    for (path, text) in files {
        if let Some(parent) = path.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::write(&path, format!("{text}\n"));
    }
    dir.to_string_lossy().into_owned()
}

fn guid_str(g: u64) -> String {
    let b = g.to_be_bytes();
    format!(
        "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
    )
}

pub(crate) fn dev_of(device: *mut ibv_device) -> Option<&'static Dev> {
    devices().iter().find(|d| ptr::eq(&d.ibv, device))
}

// ---- Device list ---------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device {
    let devs = devices();
    // SAFETY: calloc of a small array; checked below.
    let list = unsafe { libc::calloc(devs.len() + 1, std::mem::size_of::<*mut ibv_device>()) }
        as *mut *mut ibv_device;
    if list.is_null() {
        set_errno(libc::ENOMEM);
        return ptr::null_mut();
    }
    for (k, d) in devs.iter().enumerate() {
        // SAFETY: k < len + 1 slots; the devices live for the process.
        unsafe { *list.add(k) = &d.ibv as *const ibv_device as *mut ibv_device };
    }
    if !num_devices.is_null() {
        // SAFETY: the caller passes a valid int pointer or NULL.
        unsafe { *num_devices = devs.len() as c_int };
    }
    list
}

#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: the list came from ibv_get_device_list's calloc.
    unsafe { libc::free(list.cast()) };
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    match dev_of(device) {
        Some(d) => d.ibv.name.as_ptr(),
        None => ptr::null(),
    }
}

/// The node GUID in network byte order (`__be64`).
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_guid(device: *mut ibv_device) -> u64 {
    dev_of(device).map_or(0, |d| d.desc.node_guid.to_be())
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_index(device: *mut ibv_device) -> c_int {
    devices().iter().position(|d| ptr::eq(&d.ibv, device)).map_or(-1, |k| k as c_int)
}

/// Reads `dir/file` into `buf` (NUL-terminated, trailing newline removed); returns the
/// length, or -1 with errno.
#[no_mangle]
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: NUL-terminated strings from the caller.
    let (d, f) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
    let path = std::path::Path::new(&*d.to_string_lossy()).join(&*f.to_string_lossy());
    match std::fs::read(&path) {
        Ok(mut bytes) => {
            if bytes.last() == Some(&b'\n') {
                bytes.pop();
            }
            let n = bytes.len().min(size - 1);
            // SAFETY: buf has `size` bytes; we write n + 1 <= size.
            unsafe {
                ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
            n as c_int
        }
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

// ---- Contexts ------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    let Some(dev) = dev_of(device) else {
        set_errno(libc::ENODEV);
        return ptr::null_mut();
    };
    let rt = match Context::open_device(dev.desc.clone(), softrdma::default_port()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("softrdma: cannot open {}: {e}", dev.desc.name);
            set_errno(e.errno());
            return ptr::null_mut();
        }
    };
    let foreign = std::env::var(FOREIGN_ENV).is_ok_and(|v| v != "0" && !v.is_empty());
    Ctx::open(device, rt, foreign)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    if context.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the context came from ibv_open_device.
    unsafe { Ctx::free(context) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(context: *mut ibv_context, out: *mut ibv_device_attr) -> c_int {
    if context.is_null() || out.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a context from ibv_open_device; out points to an ibv_device_attr.
    let (ctx, out) = unsafe { (Ctx::from_ibv(context), &mut *out) };
    fill_device_attr(ctx.rt.device(), out);
    0
}

/// `verbs_context.query_device_ex`: the basic attributes, completion timestamps (a 1 GHz
/// clock, full 64-bit mask), no on-demand paging; the rest of `attr_size` is zeroed.
pub(crate) unsafe extern "C" fn query_device_ex(
    context: *mut ibv_context,
    input: *const c_void,
    attr: *mut ibv_device_attr_ex_head,
    attr_size: usize,
) -> c_int {
    // `struct ibv_query_device_ex_input` is one u32, comp_mask; none is defined.
    // SAFETY: the caller's input, if any.
    if context.is_null() || attr.is_null() || (!input.is_null() && unsafe { *input.cast::<u32>() } != 0) {
        return libc::EINVAL;
    }
    if attr_size < std::mem::size_of::<ibv_device_attr>() {
        return libc::EINVAL;
    }
    // SAFETY: attr has attr_size writable bytes.
    unsafe { ptr::write_bytes(attr.cast::<u8>(), 0, attr_size) };
    // SAFETY: a context from ibv_open_device; attr as above.
    let ctx = unsafe { Ctx::from_ibv(context) };
    // SAFETY: orig_attr is at offset 0, within attr_size.
    fill_device_attr(ctx.rt.device(), unsafe { &mut (*attr).orig_attr });
    let fits = |end: usize| end <= attr_size;
    use std::mem::offset_of;
    if fits(offset_of!(ibv_device_attr_ex_head, hca_core_clock) + 8) {
        // SAFETY: within attr_size, checked above.
        unsafe {
            (*attr).completion_timestamp_mask = u64::MAX;
            (*attr).hca_core_clock = 1_000_000; // kHz: timestamps count nanoseconds
        }
    }
    0
}

pub(crate) fn fill_device_attr(d: &Device, out: &mut ibv_device_attr) {
    let a = d.attr();
    // SAFETY: plain data.
    *out = unsafe { std::mem::zeroed() };
    copy_str(&mut out.fw_ver, &a.fw_ver);
    out.node_guid = a.node_guid.to_be();
    out.sys_image_guid = a.sys_image_guid.to_be();
    out.max_mr_size = a.max_mr_size;
    out.page_size_cap = a.page_size_cap;
    out.vendor_id = a.vendor_id;
    out.vendor_part_id = a.vendor_part_id;
    out.hw_ver = a.hw_ver;
    out.max_qp = a.max_qp as c_int;
    out.max_qp_wr = a.max_qp_wr as c_int;
    out.device_cap_flags = a.device_cap_flags;
    out.max_sge = a.max_sge as c_int;
    out.max_sge_rd = a.max_sge_rd as c_int;
    out.max_cq = a.max_cq as c_int;
    out.max_cqe = a.max_cqe as c_int;
    out.max_mr = a.max_mr as c_int;
    out.max_pd = a.max_pd as c_int;
    out.max_qp_rd_atom = a.max_qp_rd_atom as c_int;
    out.max_res_rd_atom = a.max_res_rd_atom as c_int;
    out.max_qp_init_rd_atom = a.max_qp_init_rd_atom as c_int;
    out.atomic_cap = a.atomic_cap as c_int;
    out.max_mcast_grp = a.max_mcast_grp as c_int;
    out.max_mcast_qp_attach = a.max_mcast_qp_attach as c_int;
    out.max_total_mcast_qp_attach = a.max_total_mcast_qp_attach as c_int;
    out.max_ah = a.max_ah as c_int;
    out.max_srq = a.max_srq as c_int;
    out.max_srq_wr = a.max_srq_wr as c_int;
    out.max_srq_sge = a.max_srq_sge as c_int;
    out.max_pkeys = a.max_pkeys;
    out.local_ca_ack_delay = a.local_ca_ack_delay;
    out.phys_port_cnt = a.phys_port_cnt;
}

/// `ibv_query_port@IBVERBS_1.1`. Callers built against rdma-core 44 headers pass a
/// 52-byte `ibv_port_attr` after zeroing it (the inline `ibv_query_port` does); older
/// callers' structure ends 4 bytes earlier, so only the first 48 bytes are written.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(
    context: *mut ibv_context,
    port: u8,
    out: *mut ibv_port_attr,
) -> c_int {
    if context.is_null() || out.is_null() {
        return libc::EINVAL;
    }
    if port != 1 {
        return libc::EINVAL;
    }
    // SAFETY: a context from ibv_open_device.
    let ctx = unsafe { Ctx::from_ibv(context) };
    let full = port_attr(ctx.rt.device());
    // SAFETY: out has at least 48 bytes (the compat layout); copy those.
    unsafe { ptr::copy_nonoverlapping((&full as *const ibv_port_attr).cast::<u8>(), out.cast::<u8>(), 48) };
    0
}

pub(crate) fn port_attr(d: &Device) -> ibv_port_attr {
    let p = d.port_attr();
    // SAFETY: plain data.
    let mut o: ibv_port_attr = unsafe { std::mem::zeroed() };
    o.state = p.state as c_int;
    o.max_mtu = p.max_mtu as c_int;
    o.active_mtu = p.active_mtu as c_int;
    o.gid_tbl_len = p.gid_tbl_len as c_int;
    o.port_cap_flags = p.port_cap_flags;
    o.max_msg_sz = p.max_msg_sz.min(u64::from(u32::MAX)) as u32;
    o.bad_pkey_cntr = p.bad_pkey_cntr;
    o.qkey_viol_cntr = p.qkey_viol_cntr;
    o.pkey_tbl_len = p.pkey_tbl_len;
    o.lid = p.lid;
    o.sm_lid = p.sm_lid;
    o.lmc = p.lmc;
    o.max_vl_num = p.max_vl_num;
    o.subnet_timeout = p.subnet_timeout;
    o.active_width = p.active_width;
    o.active_speed = p.active_speed.min(255) as u8;
    o.phys_state = p.phys_state;
    o.link_layer = p.link_layer as u8;
    o.port_cap_flags2 = p.port_cap_flags2;
    o
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(
    context: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut [u8; 16],
) -> c_int {
    if context.is_null() || gid.is_null() || port != 1 || index < 0 {
        return -1;
    }
    // SAFETY: a context from ibv_open_device.
    let ctx = unsafe { Ctx::from_ibv(context) };
    match ctx.rt.device().gids.get(index as usize) {
        Some(g) => {
            // SAFETY: gid points to 16 bytes.
            unsafe { *gid = g.gid };
            0
        }
        None => -1,
    }
}

/// `_ibv_query_gid_ex@IBVERBS_1.11`, behind the inline `ibv_query_gid_ex`.
#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    if context.is_null() || entry.is_null() || flags != 0 || entry_size < std::mem::size_of::<ibv_gid_entry>()
    {
        return libc::EINVAL;
    }
    if port != 1 {
        return libc::EINVAL;
    }
    // SAFETY: a context from ibv_open_device.
    let ctx = unsafe { Ctx::from_ibv(context) };
    let d = ctx.rt.device();
    let Some(g) = d.gids.get(index as usize) else { return libc::ENODATA };
    let ifindex = std::ffi::CString::new(d.netdev.clone())
        // SAFETY: a NUL-terminated name.
        .map(|n| unsafe { libc::if_nametoindex(n.as_ptr()) })
        .unwrap_or(0);
    // SAFETY: entry points to an ibv_gid_entry (size checked).
    unsafe {
        *entry = ibv_gid_entry {
            gid: ibv_gid { raw: g.gid },
            gid_index: index,
            port_num: port,
            gid_type: IBV_GID_TYPE_ROCE_V2,
            ndev_ifindex: ifindex,
        }
    };
    0
}

/// `ibv_query_gid_type@IBVERBS_PRIVATE_34`, which `ibv_devinfo -v` calls for each GID.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(
    context: *mut ibv_context,
    port: u8,
    index: u32,
    ty: *mut c_int,
) -> c_int {
    if context.is_null() || ty.is_null() || port != 1 {
        return libc::EINVAL;
    }
    // SAFETY: a context from ibv_open_device.
    let ctx = unsafe { Ctx::from_ibv(context) };
    if ctx.rt.device().gids.get(index as usize).is_none() {
        return libc::EINVAL;
    }
    // SAFETY: ty points to an int.
    unsafe { *ty = IBV_GID_TYPE_SYSFS_ROCE_V2 };
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(
    context: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    if context.is_null() || pkey.is_null() || port != 1 || index != 0 {
        return -1;
    }
    // SAFETY: pkey points to a u16; P_Keys are returned in network order, as rdma-core does.
    unsafe { *pkey = 0xFFFFu16.to_be() };
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_pkey_index(context: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    if context.is_null() || port != 1 {
        return -libc::EINVAL;
    }
    if u16::from_be(pkey) & 0x7FFF == 0x7FFF {
        0
    } else {
        -libc::ENOENT
    }
}

// ---- Async events --------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(
    context: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    if context.is_null() || event.is_null() {
        return -1;
    }
    // SAFETY: a context from ibv_open_device.
    let ctx = unsafe { Ctx::from_ibv(context) };
    loop {
        if let Some(ev) = ctx.rt.poll_async_event() {
            let (element, ty): (*mut c_void, c_int) = match ev {
                softrdma::AsyncEvent::PortActive => (ptr::without_provenance_mut(1), IBV_EVENT_PORT_ACTIVE), // port_num 1
                softrdma::AsyncEvent::CqError { cq } => (ctx.cqs.get(cq).cast(), IBV_EVENT_CQ_ERR),
                softrdma::AsyncEvent::QpFatal { qpn } => (ctx.qps.get(qpn).cast(), IBV_EVENT_QP_FATAL),
                softrdma::AsyncEvent::QpLastWqeReached { qpn } => {
                    (ctx.qps.get(qpn).cast(), IBV_EVENT_QP_LAST_WQE_REACHED)
                }
                _ => continue,
            };
            if element.is_null() {
                continue; // its object is gone
            }
            // SAFETY: event points to an ibv_async_event.
            unsafe { *event = ibv_async_event { element, event_type: ty } };
            return 0;
        }
        // Blocks, as rdma-core's does, unless the program made async_fd non-blocking (the
        // runtime's eventfd is non-blocking itself; the flag is the program's wish).
        if nonblocking(ctx.rt.async_fd()) {
            set_errno(libc::EAGAIN);
            return -1;
        }
        let mut pfd = libc::pollfd { fd: ctx.rt.async_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, 1000) };
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(_event: *mut ibv_async_event) {}

#[no_mangle]
pub unsafe extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    let s: &CStr = match event {
        0 => c"CQ error",
        1 => c"local work queue catastrophic error",
        2 => c"invalid request local work queue error",
        3 => c"local access violation work queue error",
        4 => c"communication established",
        5 => c"send queue drained",
        6 => c"path migrated",
        7 => c"path migration request error",
        8 => c"local catastrophic error",
        9 => c"port active",
        10 => c"port error",
        11 => c"LID change",
        12 => c"P_Key change",
        13 => c"SM change",
        14 => c"SRQ catastrophic error",
        15 => c"SRQ limit reached",
        16 => c"last WQE reached",
        17 => c"client reregistration",
        18 => c"GID table change",
        _ => c"unknown",
    };
    s.as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn ibv_fork_init() -> c_int {
    // Registered memory is the application's own; nothing is pinned, so fork is safe.
    0
}
