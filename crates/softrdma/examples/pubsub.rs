//! Publish/subscribe over multicast UD, as the OFA tutorial (seed 003) describes it: a
//! publisher keeps a small repository and posts each update to a multicast group;
//! subscribers join at any time, keep several receives posted and re-post each as it
//! completes, apply the updates, and leave when they like. Nobody tells anyone else.
//!
//! ```text
//! cargo run --release --example pubsub            # a publisher and three subscribers, the report
//! cargo run --release --example pubsub -- subscriber --group 239.1.2.3 --bind 10.0.0.2
//! cargo run --release --example pubsub -- publisher --group 239.1.2.3 --bind 10.0.0.1 --updates 1000
//! ```
//!
//! Setup is rdma_cm's (a UD ID resolved to the group from the member's address, its QP,
//! `join_multicast` and the JOIN event, whose UD parameters address the group); the data
//! path is the managed layer's (`Connection::recv_stream` keeps the receives posted).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use softrdma::cm::{CmEventKind, CmId, EventChannel, PortSpace, UDP_QKEY};
use softrdma::managed::{Buffer, BufferPool, CompletionPoller, Connection, Op, Pod, WaitMode, Zeroable};
use softrdma::{Access, QpBuilder, QpCaps, UdDest};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One update, as it travels.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Pod, Zeroable)]
struct Update {
    seq: u64,
    value: u64,
    key: u32,
    /// 0: an update; 1: the publisher is done.
    end: u32,
}

/// A UD receive buffer: the 40-byte GRH area, then the update.
const SLOT: usize = 40 + size_of::<Update>();

#[derive(Parser, Debug)]
#[command(about = "Publish/subscribe over softrdma multicast")]
struct Args {
    #[command(subcommand)]
    role: Option<Role>,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// Post updates of a repository to the group.
    Publisher {
        #[arg(long)]
        group: IpAddr,
        #[arg(long)]
        bind: IpAddr,
        /// Updates to post.
        #[arg(long, default_value_t = 300)]
        updates: u64,
        /// Keys in the repository.
        #[arg(long, default_value_t = 16)]
        keys: u32,
        /// Pause between updates, in microseconds.
        #[arg(long, default_value_t = 3000)]
        interval_us: u64,
    },
    /// Join the group, apply updates, leave.
    Subscriber {
        #[arg(long)]
        group: IpAddr,
        #[arg(long)]
        bind: IpAddr,
        /// A name for the report.
        #[arg(long, default_value = "subscriber")]
        name: String,
        /// Leave after this many updates (default: stay until the publisher is done).
        #[arg(long)]
        leave_after: Option<u64>,
        /// Receives kept posted.
        #[arg(long, default_value_t = 4)]
        receives: usize,
    },
}

fn main() -> ExitCode {
    let r = match Args::parse().role {
        Some(Role::Publisher { group, bind, updates, keys, interval_us }) => {
            publisher(group, bind, updates, keys.max(1), Duration::from_micros(interval_us))
        }
        Some(Role::Subscriber { group, bind, name, leave_after, receives }) => {
            subscriber(group, bind, &name, leave_after, receives.max(2))
        }
        None => demo(),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pubsub: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A member's setup: a UD ID on `bind`, its QP on a poller's CQ, receives posted by
/// `before_join`, then the join; returns what sends to the group take.
struct Member {
    id: CmId,
    _ch: EventChannel,
    pd: softrdma::ProtectionDomain,
    conn: Connection,
    to_group: UdDest,
}

fn member(
    group: IpAddr,
    bind: IpAddr,
    before_join: impl FnOnce(&Connection, &softrdma::ProtectionDomain) -> Result<(), BoxError>,
) -> Result<Member, BoxError> {
    let ch = EventChannel::new()?;
    let id = CmId::new(&ch, PortSpace::Udp);
    let wait = Duration::from_secs(5);
    id.resolve_addr(Some(bind), SocketAddr::new(group, 0), wait)?;
    let ev = ch.get_event_timeout(wait).ok_or("no ADDR_RESOLVED")?;
    if ev.kind != CmEventKind::AddrResolved {
        return Err(format!("resolving {group} from {bind}: {}", ev.kind.name()).into());
    }
    let ctx = id.context().ok_or("no device")?;
    let pd = ctx.alloc_pd();
    let poller = CompletionPoller::new(&ctx, 256, WaitMode::Event)?;
    let caps = QpCaps { max_send_wr: 16, max_recv_wr: 64, ..QpCaps::default() };
    let qp = id.create_qp(&pd, &QpBuilder::ud(UDP_QKEY).caps(caps), poller.cq(), poller.cq())?;
    let conn = Connection::new(qp, &poller)?;
    before_join(&conn, &pd)?;
    id.join_multicast(group)?;
    let ev = ch.get_event_timeout(wait).ok_or("no MULTICAST_JOIN")?;
    let ud = match (ev.kind, ev.ud) {
        (CmEventKind::MulticastJoin, Some(ud)) => ud,
        (kind, _) => return Err(format!("joining {group}: {} (status {})", kind.name(), ev.status).into()),
    };
    let to_group = UdDest { addr: ud.addr, qpn: ud.qpn, qkey: ud.qkey, traffic_class: 0 };
    Ok(Member { id, _ch: ch, pd, conn, to_group })
}

fn checksum(repo: &BTreeMap<u32, u64>) -> u64 {
    repo.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, (k, v)| {
        (h ^ (u64::from(*k) << 32 ^ v)).wrapping_mul(0x100_0000_01b3)
    })
}

fn publisher(
    group: IpAddr,
    bind: IpAddr,
    updates: u64,
    keys: u32,
    interval: Duration,
) -> Result<(), BoxError> {
    let m = member(group, bind, |_, _| Ok(()))?;
    // Send buffers are registered once and reused: each comes back with its completion.
    let pool = BufferPool::<Update>::new(&m.pd, 8, 1, Access::LOCAL_WRITE)?;
    let mut repo = BTreeMap::new();
    let post = |u: Update| -> Result<(), BoxError> {
        let mut b = pool.take_timeout(Duration::from_secs(5))?;
        b.copy_from(&[u])?;
        m.conn
            .post(Op::SendTo(m.to_group), b)?
            .wait_timeout(Duration::from_secs(5))
            .map_err(|_| "no send completion")?
            .check()?;
        Ok(())
    };
    for seq in 1..=updates {
        let key = (seq % u64::from(keys)) as u32;
        let value = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 16;
        repo.insert(key, value);
        post(Update { seq, value, key, end: 0 })?;
        std::thread::sleep(interval);
    }
    // "Done", a few times: a subscriber without a receive posted at that moment loses it.
    for _ in 0..3 {
        post(Update { seq: updates + 1, end: 1, ..Update::default() })?;
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("{}", serde_json::json!({"role": "publisher", "updates": updates, "checksum": checksum(&repo)}));
    drop(m.id);
    Ok(())
}

fn subscriber(
    group: IpAddr,
    bind: IpAddr,
    name: &str,
    leave_after: Option<u64>,
    receives: usize,
) -> Result<(), BoxError> {
    let mut stream = None;
    let m = member(group, bind, |conn, pd| {
        // Receives are posted before the join: nothing the group sends afterwards is lost.
        let bufs =
            (0..receives).map(|_| Buffer::<u8>::new(pd, SLOT)).collect::<softrdma::Result<Vec<_>>>()?;
        stream = Some(conn.recv_stream(bufs)?);
        Ok(())
    })?;
    let stream = stream.ok_or("no stream")?;
    println!("joined {group}");
    std::io::stdout().flush()?;
    let mut repo = BTreeMap::new();
    let (mut first, mut last, mut received, mut gaps) = (None, 0u64, 0u64, 0u64);
    let mut left_early = false;
    let mut ended = false;
    while let Some(done) = stream.next_timeout(Duration::from_secs(10)) {
        if done.status() != softrdma::WcStatus::Success {
            return Err(format!("a receive failed: {}", done.status()).into());
        }
        let mut u = [Update::default()];
        let bytes = done.buffer.to_vec();
        bytemuck_copy(&bytes[40..], &mut u);
        stream.repost(done.buffer)?;
        let u = u[0];
        if u.end == 1 {
            ended = true;
            break;
        }
        if u.seq <= last {
            continue; // not expected on one path, but harmless
        }
        if first.is_some() && u.seq != last + 1 {
            gaps += u.seq - last - 1;
        }
        first.get_or_insert(u.seq);
        last = u.seq;
        received += 1;
        repo.insert(u.key, u.value);
        if leave_after.is_some_and(|n| received >= n) {
            m.id.leave_multicast(group)?;
            left_early = true;
            break;
        }
    }
    if !ended && !left_early {
        return Err("the publisher went quiet for 10 s without saying it was done".into());
    }
    let report = serde_json::json!({
        "role": "subscriber", "name": name, "first": first, "last": last, "received": received,
        "gaps": gaps, "left_early": left_early, "checksum": checksum(&repo),
    });
    println!("{report}");
    Ok(())
}

fn bytemuck_copy(from: &[u8], to: &mut [Update]) {
    let n = std::mem::size_of_val(to).min(from.len());
    softrdma::managed::bytemuck::cast_slice_mut::<Update, u8>(to)[..n].copy_from_slice(&from[..n]);
}

/// Starts this program in a role; returns the child with its stdout lines.
fn spawn(args: &[String]) -> Result<(Child, std::io::Lines<BufReader<std::process::ChildStdout>>), BoxError> {
    let mut child = Command::new(std::env::current_exe()?).args(args).stdout(Stdio::piped()).spawn()?;
    let out = BufReader::new(child.stdout.take().ok_or("no pipe")?).lines();
    Ok((child, out))
}

/// The seed's scenario on one host: subscribers A (from the start to the end), B (joins
/// late) and C (leaves early), and the publisher, each a process of its own.
fn demo() -> Result<(), BoxError> {
    let n = 2 + (std::process::id() % 200) as u8;
    let group = IpAddr::from([239, 44, 0, n]);
    let ip = |k: u8| IpAddr::from([127, 44, n, k]);
    let (updates, interval_us) = (300u64, 3000u64);
    let sub = |name: &str, k: u8, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> =
            ["subscriber", "--group", &group.to_string(), "--bind", &ip(k).to_string(), "--name", name]
                .map(String::from)
                .into();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let mut children = Vec::new();
    let mut joined = |args: Vec<String>| -> Result<(), BoxError> {
        let (c, mut lines) = spawn(&args)?;
        let line = lines.next().transpose()?.unwrap_or_default();
        if !line.starts_with("joined") {
            return Err(format!("{}: {line:?}", args[6]).into());
        }
        children.push((args[6].clone(), c, lines));
        Ok(())
    };
    let leave_after = (updates / 3).to_string();
    joined(sub("A (whole run)", 2, &[]))?;
    joined(sub("C (leaves early)", 4, &["--leave-after", &leave_after]))?;
    let t0 = Instant::now();
    let publisher: Vec<String> = [
        "publisher",
        "--group",
        &group.to_string(),
        "--bind",
        &ip(1).to_string(),
        "--updates",
        &updates.to_string(),
        "--interval-us",
        &interval_us.to_string(),
    ]
    .map(String::from)
    .into();
    let (pc, plines) = spawn(&publisher)?;
    // B joins a third of the way in.
    std::thread::sleep(Duration::from_micros(updates * interval_us / 3));
    joined(sub("B (joins late)", 3, &[]))?;
    let mut reports = Vec::new();
    children.push(("publisher".to_string(), pc, plines));
    for (name, mut c, lines) in children {
        let last = lines.map_while(Result::ok).last().unwrap_or_default();
        let status = c.wait()?;
        if !status.success() {
            return Err(format!("{name} failed ({status})").into());
        }
        reports.push(
            serde_json::from_str::<serde_json::Value>(&last).map_err(|e| format!("{name}: {e}: {last:?}"))?,
        );
    }
    println!(
        "{} updates to {group} over {:.1} s; what each member saw:",
        updates,
        t0.elapsed().as_secs_f64()
    );
    let published =
        reports.iter().find(|r| r["role"] == "publisher").ok_or("no publisher report")?["checksum"].clone();
    for r in &reports {
        println!("{r}");
    }
    let full = reports.iter().find(|r| r["name"] == "A (whole run)").ok_or("no report from A")?;
    if full["received"] != updates || full["gaps"] != 0 || full["checksum"] != published {
        return Err("subscriber A missed updates or ended with another repository".into());
    }
    println!("A's repository matches the publisher's.");
    Ok(())
}
