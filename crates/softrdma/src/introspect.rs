//! Live introspection, as `rdma res show` does for the kernel's devices: every process that
//! opens a softrdma device answers on a Unix socket of its own with its devices, QPs
//! (type, state, peer, PSNs, queued work requests, CQs, counters), completion queues
//! (completions queued, size) and memory regions (length, keys, access), as one line of
//! JSON. `softrdma res` asks every such process of the user.
//!
//! The sockets live in `$XDG_RUNTIME_DIR/softrdma/` (else `/tmp/softrdma-UID/`), a
//! directory only the user can enter (mode 0700, checked to be the user's own), one
//! `PID.sock` per process. Nothing runs at exit (a library cannot rely on it), so the
//! socket of a process that ended stays until `softrdma res` finds nothing listening on it
//! and removes it. `SOFTRDMA_RES=off` turns it
//! off for a process. Nothing but the snapshot is ever read or written on the socket.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use serde::Serialize;

use crate::engine::Engine;

/// The environment variable that turns the introspection socket off (`off`).
pub const RES_ENV: &str = "SOFTRDMA_RES";

/// The directory of the user's introspection sockets.
pub fn socket_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("softrdma"),
        // SAFETY: getuid cannot fail.
        _ => PathBuf::from(format!("/tmp/softrdma-{}", unsafe { libc::getuid() })),
    }
}

/// One process's answer.
#[derive(Debug, Serialize)]
pub(crate) struct ProcessRes {
    pid: u32,
    comm: String,
    devices: Vec<DeviceRes>,
}

/// One opened device.
#[derive(Debug, Serialize)]
pub(crate) struct DeviceRes {
    pub(crate) name: String,
    pub(crate) addr: String,
    pub(crate) qps: Vec<QpRes>,
    pub(crate) cqs: Vec<CqRes>,
    pub(crate) mrs: Vec<MrRes>,
    pub(crate) packets_received: u64,
    pub(crate) icrc_errors: u64,
    pub(crate) malformed: u64,
    pub(crate) unknown_qp: u64,
    pub(crate) pkey_violations: u64,
    /// Datagrams that carried a request and its ACK (`softrdma_proto::wire::bundle`).
    pub(crate) bundles: u64,
    /// The link's send calls (a `sendmmsg` each, or one per source port when QPs send
    /// from ports of their own), the packets they carried and the GSO trains among them,
    /// and the receive calls that returned datagrams (`IoStats`): packets per call say
    /// whether a program's posts leave in batches.
    pub(crate) send_calls: u64,
    pub(crate) packets_sent: u64,
    pub(crate) gso_trains: u64,
    pub(crate) recv_calls: u64,
}

/// One QP.
#[derive(Debug, Serialize)]
pub(crate) struct QpRes {
    pub(crate) qpn: u32,
    pub(crate) r#type: String,
    pub(crate) state: String,
    pub(crate) peer: Option<String>,
    pub(crate) dest_qpn: Option<u32>,
    pub(crate) sq_psn: Option<u32>,
    pub(crate) rq_psn: Option<u32>,
    pub(crate) send_queue: usize,
    pub(crate) recv_queue: usize,
    pub(crate) send_cq: Option<u32>,
    pub(crate) recv_cq: Option<u32>,
    pub(crate) packets_sent: u64,
    pub(crate) retransmits: u64,
    pub(crate) timeouts: u64,
    pub(crate) probes: u64,
    pub(crate) sacks_sent: u64,
    pub(crate) sacks_received: u64,
    pub(crate) held: u64,
    pub(crate) dropped: u64,
    pub(crate) duplicates: u64,
    /// Positive ACKs sent in the datagram of a request.
    pub(crate) acks_bundled: u64,
}

/// One completion queue.
#[derive(Debug, Serialize)]
pub(crate) struct CqRes {
    pub(crate) id: u32,
    pub(crate) queued: usize,
    pub(crate) size: usize,
}

/// One memory region.
#[derive(Debug, Serialize)]
pub(crate) struct MrRes {
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) len: usize,
    pub(crate) access: String,
    pub(crate) pd: u32,
}

struct Registry {
    engines: Vec<(String, Weak<Engine>)>,
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Registry { engines: Vec::new() }))
}

/// Lists `engine` (of device `name`) in this process's answer, and starts the socket with
/// the first device.
pub(crate) fn register(engine: &Arc<Engine>, name: &str) {
    let mut r = registry().lock().unwrap_or_else(|p| p.into_inner());
    r.engines.retain(|(_, e)| e.strong_count() > 0);
    r.engines.push((name.to_string(), Arc::downgrade(engine)));
    drop(r);
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(start);
}

/// The snapshot of this process, whose name (`/proc/self/comm`) is `comm`.
fn snapshot(comm: &str) -> ProcessRes {
    let engines: Vec<(String, Arc<Engine>)> = {
        let r = registry().lock().unwrap_or_else(|p| p.into_inner());
        r.engines.iter().filter_map(|(n, e)| e.upgrade().map(|e| (n.clone(), e))).collect()
    };
    ProcessRes {
        pid: std::process::id(),
        comm: comm.to_string(),
        devices: engines.iter().map(|(name, e)| e.resources(name)).collect(),
    }
}

/// [`socket_dir`], created if need be, if it is a directory of this user's that no one
/// else may enter.
pub(crate) fn private_dir() -> Option<PathBuf> {
    let dir = socket_dir();
    let ok = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).is_ok()
        && std::fs::metadata(&dir).is_ok_and(|m| {
            // SAFETY: getuid cannot fail.
            m.is_dir() && m.uid() == unsafe { libc::getuid() } && m.permissions().mode() & 0o077 == 0
        });
    ok.then_some(dir)
}

/// Opens the socket and serves it from a thread of its own; any failure leaves the process
/// without one (and says so once).
fn start() {
    if std::env::var(RES_ENV).is_ok_and(|v| v == "off" || v == "0") {
        return;
    }
    let Some(dir) = private_dir() else {
        eprintln!(
            "softrdma: {} is not a private directory of this user; no introspection socket",
            socket_dir().display()
        );
        return;
    };
    let path = dir.join(format!("{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let Ok(listener) = UnixListener::bind(&path) else { return };
    let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
    // Read here, in the application's call that opened the first device: the serving
    // thread opens no file of its own, only the connections `softrdma stat` makes (the
    // README's "Guests in other programs").
    let comm = std::fs::read_to_string("/proc/self/comm").unwrap_or_default().trim().to_string();
    let _ = crate::sys::spawn_quiet("softrdma-res".into(), move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_write_timeout(Some(std::time::Duration::from_secs(2)));
            let mut line = serde_json::to_vec(&snapshot(&comm)).unwrap_or_default();
            line.push(b'\n');
            let _ = conn.write_all(&line);
        }
    });
}
