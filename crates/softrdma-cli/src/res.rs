//! `softrdma res`: the devices, QPs and memory regions of every running softrdma process of
//! this user, as `rdma res show` lists the kernel's. Each process answers on its own Unix
//! socket (see the runtime's introspection module); a process that does not answer within
//! 2 s is reported and skipped, and a socket whose process is gone is removed.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use serde_json::Value;

/// Arguments of `softrdma res`.
#[derive(Debug, clap::Args)]
pub struct ResArgs {
    /// One JSON array of the processes instead of the table.
    #[arg(short = 'j', long)]
    pub json: bool,
    /// Only this process.
    #[arg(long)]
    pub pid: Option<u32>,
}

/// Longest answer read from one process.
const MAX_ANSWER: u64 = 16 << 20;

/// Asks every process; prints what they answer.
pub fn run(args: &ResArgs) -> i32 {
    let dir = softrdma::res_socket_dir();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        if args.json {
            println!("[]");
        } else {
            println!("no softrdma process ({} does not exist)", dir.display());
        }
        return 0;
    };
    let mut procs = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let Some(pid) = path.file_stem().and_then(|s| s.to_str()).and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if path.extension().is_none_or(|x| x != "sock") || args.pid.is_some_and(|p| p != pid) {
            continue;
        }
        // SAFETY: signal 0 only checks that the process exists.
        let alive = libc::pid_t::try_from(pid).is_ok_and(|p| unsafe { libc::kill(p, 0) } == 0);
        if !alive {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        match ask(&path) {
            Ok(v) => procs.push(v),
            // Nothing listens: the process that made it ended (its pid now names another).
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                let _ = std::fs::remove_file(&path);
            }
            Err(e) => eprintln!("softrdma res: process {pid}: {e}"),
        }
    }
    procs.sort_by_key(|p| p["pid"].as_u64());
    if args.json {
        println!("{}", Value::Array(procs));
    } else if procs.is_empty() {
        println!("no softrdma process");
    } else {
        for p in &procs {
            print_process(p);
        }
    }
    0
}

fn ask(path: &std::path::Path) -> std::io::Result<Value> {
    let s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut buf = Vec::new();
    s.take(MAX_ANSWER).read_to_end(&mut buf)?;
    serde_json::from_slice(&buf)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unreadable answer: {e}")))
}

fn hex(v: &Value) -> String {
    v.as_u64().map_or("-".into(), |n| format!("{n:#08x}"))
}

fn print_process(p: &Value) {
    let empty = Vec::new();
    for d in p["devices"].as_array().unwrap_or(&empty) {
        println!(
            "pid {} {} dev {} {}: received {} icrc-errors {} malformed {} unknown-qp {} pkey {} bundles {} sent {} in {} send calls ({} trains), {} receive calls",
            p["pid"],
            p["comm"].as_str().unwrap_or("?"),
            d["name"].as_str().unwrap_or("?"),
            d["addr"].as_str().unwrap_or("?"),
            d["packets_received"],
            d["icrc_errors"],
            d["malformed"],
            d["unknown_qp"],
            d["pkey_violations"],
            d["bundles"],
            d["packets_sent"],
            d["send_calls"],
            d["gso_trains"],
            d["recv_calls"],
        );
        for q in d["qps"].as_array().unwrap_or(&empty) {
            println!(
                "  qp {} {} {} peer {} dqpn {} sq-psn {} rq-psn {} sq {} rq {} cq {}/{} sent {} retrans {} timeouts {} dropped {} acks-bundled {}",
                hex(&q["qpn"]),
                q["type"].as_str().unwrap_or("?"),
                q["state"].as_str().unwrap_or("?"),
                q["peer"].as_str().unwrap_or("-"),
                hex(&q["dest_qpn"]),
                hex(&q["sq_psn"]),
                hex(&q["rq_psn"]),
                q["send_queue"],
                q["recv_queue"],
                q["send_cq"],
                q["recv_cq"],
                q["packets_sent"],
                q["retransmits"],
                q["timeouts"],
                q["dropped"],
                q["acks_bundled"],
            );
        }
        for c in d["cqs"].as_array().unwrap_or(&empty) {
            println!("  cq {} queued {} size {}", c["id"], c["queued"], c["size"]);
        }
        for m in d["mrs"].as_array().unwrap_or(&empty) {
            println!(
                "  mr lkey {} rkey {} len {} pd {} access {}",
                hex(&m["lkey"]),
                hex(&m["rkey"]),
                m["len"],
                m["pd"],
                m["access"].as_str().unwrap_or("?"),
            );
        }
    }
}
