//! The OFA tutorial's four ping-pongs, laid out as the tutorial lays them out: a client,
//! and on the server a listener that hands each connection to an agent; each program in
//! three phases (setup, use, break-down), each step numbered as the tutorial numbers it.
//!
//! | variant | client | agent |
//! |---|---|---|
//! | `send-recv-busy` | SEND ping, RECV pong, busy-polling | RECV ping, SEND pong, busy-polling |
//! | `send-recv-notify` | the same, waiting for notify | the same, waiting for notify |
//! | `write-read` | RDMA WRITE ping, wait; RDMA READ pong, wait | nothing (waits for "finished") |
//! | `write-read-unsignaled` | unsignaled WRITE, signaled READ, wait | nothing |
//!
//! Each side measures its own CPU time over the use phase from `getrusage`: the thread
//! that runs the program (what the tutorial measures; a NIC's work is not in it) and the
//! whole process, which here includes softrdma's progress thread doing that NIC's work.
//! This file is shared by the `tutorial` example and `softrdma tutorial`.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma::cm::{getaddrinfo, AddrHints, ConnParam, Ep};
use softrdma::{
    Access, CompletionChannel, CompletionQueue, MemoryRegion, QpBuilder, QpCaps, RemoteRegion, SendFlags,
    WcStatus, WorkCompletion,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long any one wait may take before the program gives up.
const STEP: Duration = Duration::from_secs(30);

/// The four ping-pongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// Signaled SEND/RECV, busy polling.
    SendRecvBusy,
    /// Signaled SEND/RECV, wait for notify.
    SendRecvNotify,
    /// Signaled RDMA WRITE then READ, wait for notify.
    WriteRead,
    /// Unsignaled RDMA WRITE then signaled READ, wait for notify.
    WriteReadUnsignaled,
}

impl Variant {
    pub const ALL: [Variant; 4] =
        [Variant::SendRecvBusy, Variant::SendRecvNotify, Variant::WriteRead, Variant::WriteReadUnsignaled];

    pub fn name(self) -> &'static str {
        match self {
            Variant::SendRecvBusy => "send-recv-busy",
            Variant::SendRecvNotify => "send-recv-notify",
            Variant::WriteRead => "write-read",
            Variant::WriteReadUnsignaled => "write-read-unsignaled",
        }
    }

    pub fn parse(s: &str) -> Option<Variant> {
        Variant::ALL.into_iter().find(|v| v.name() == s)
    }

    /// The tutorial's words for it.
    pub fn describe(self) -> &'static str {
        match self {
            Variant::SendRecvBusy => "signaled SEND/RECV with busy polling",
            Variant::SendRecvNotify => "signaled SEND/RECV with wait for notify",
            Variant::WriteRead => "signaled RDMA_WRITE/READ with wait for notify",
            Variant::WriteReadUnsignaled => "unsignaled RDMA_WRITE/READ with wait for notify",
        }
    }

    fn code(self) -> u8 {
        Variant::ALL.iter().position(|&v| v == self).unwrap_or(0) as u8
    }

    fn busy(self) -> bool {
        self == Variant::SendRecvBusy
    }

    fn one_sided(self) -> bool {
        matches!(self, Variant::WriteRead | Variant::WriteReadUnsignaled)
    }
}

/// CPU time over a use phase, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    /// The program's thread, user mode.
    pub user_us: u64,
    /// The program's thread, kernel mode.
    pub sys_us: u64,
    /// The whole process (with softrdma's progress thread), user mode.
    pub proc_user_us: u64,
    /// The whole process, kernel mode.
    pub proc_sys_us: u64,
    /// Wall-clock time of the use phase.
    pub elapsed_us: u64,
}

impl Usage {
    fn to_bytes(self) -> [u8; 40] {
        let mut b = [0u8; 40];
        for (i, v) in [self.user_us, self.sys_us, self.proc_user_us, self.proc_sys_us, self.elapsed_us]
            .into_iter()
            .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    fn from_bytes(b: &[u8]) -> Option<Usage> {
        let v = |i: usize| Some(u64::from_le_bytes(b.get(i * 8..i * 8 + 8)?.try_into().ok()?));
        Some(Usage {
            user_us: v(0)?,
            sys_us: v(1)?,
            proc_user_us: v(2)?,
            proc_sys_us: v(3)?,
            elapsed_us: v(4)?,
        })
    }

    fn pct(part: u64, whole: u64) -> f64 {
        if whole == 0 {
            0.0
        } else {
            100.0 * part as f64 / whole as f64
        }
    }

    pub fn user_pct(&self) -> f64 {
        Self::pct(self.user_us, self.elapsed_us)
    }

    pub fn sys_pct(&self) -> f64 {
        Self::pct(self.sys_us, self.elapsed_us)
    }

    pub fn proc_pct(&self) -> f64 {
        Self::pct(self.proc_user_us + self.proc_sys_us, self.elapsed_us)
    }
}

/// `getrusage` of the calling thread and of the process: (user, sys) each, in µs.
fn cpu_now() -> [(u64, u64); 2] {
    let get = |who| {
        // SAFETY: getrusage fills the struct it is given.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above; RUSAGE_THREAD and RUSAGE_SELF are valid for any thread.
        unsafe { libc::getrusage(who, &mut ru) };
        let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        (us(ru.ru_utime), us(ru.ru_stime))
    };
    [get(libc::RUSAGE_THREAD), get(libc::RUSAGE_SELF)]
}

/// Measures CPU time from its creation to [`Meter::stop`].
struct Meter {
    start: Instant,
    cpu: [(u64, u64); 2],
}

impl Meter {
    fn start() -> Meter {
        Meter { start: Instant::now(), cpu: cpu_now() }
    }

    fn stop(&self) -> Usage {
        let now = cpu_now();
        Usage {
            user_us: now[0].0 - self.cpu[0].0,
            sys_us: now[0].1 - self.cpu[0].1,
            proc_user_us: now[1].0 - self.cpu[1].0,
            proc_sys_us: now[1].1 - self.cpu[1].1,
            elapsed_us: self.start.elapsed().as_micros() as u64,
        }
    }
}

/// One client's run.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub variant: Variant,
    /// Round-trip time, µs.
    pub rtt_us: f64,
    pub client: Usage,
    pub server: Usage,
}

/// A CQ with its channel, waited on as the variant says.
struct Completions {
    cq: CompletionQueue,
    channel: CompletionChannel,
    busy: bool,
    /// Sleep without doing packet work (the one-sided agent, which does nothing).
    passive: bool,
}

impl Completions {
    /// The next completion: busy polling (tutorial: "busy polling to get completions"),
    /// or its nine-step "wait-for-notify" loop.
    fn next(&self) -> Result<WorkCompletion, BoxError> {
        let deadline = Instant::now() + STEP;
        loop {
            // 2. ibv_poll_cq() gets any completion in the CQ; 3. exit if found.
            if let Some(wc) = self.cq.poll_one() {
                return Ok(wc);
            }
            if Instant::now() > deadline {
                return Err("no completion in 30 s".into());
            }
            if self.busy {
                continue;
            }
            // 4. ibv_req_notify_cq() asks for an event on the next completion.
            self.cq.req_notify(false)?;
            // 5. ibv_poll_cq() gets any completion that came between 2 and 4.
            if let Some(wc) = self.cq.poll_one() {
                return Ok(wc);
            }
            // 7. ibv_get_cq_event() blocks until the CA sends the event. softrdma's plain
            //    form handles packets arriving meanwhile in this thread (one thread hop
            //    less); the passive form leaves them to the progress thread, which is
            //    the CA here, so that a passive side's thread does nothing at all.
            let left = deadline.saturating_duration_since(Instant::now());
            let event = if self.passive {
                self.channel.get_event_passive(left)?
            } else {
                self.channel.get_event_timeout(left)?
            };
            if event.is_some() {
                // 8. ibv_ack_cq_events() acknowledges it.
                self.channel.ack_events(1);
            }
        }
    }

    /// The next completion, which must be a success.
    fn next_ok(&self, what: &str) -> Result<WorkCompletion, BoxError> {
        let wc = self.next()?;
        if wc.status != WcStatus::Success {
            return Err(format!("{what}: {}", wc.status).into());
        }
        Ok(wc)
    }
}

/// What the client tells the agent in its connection request.
fn offer(variant: Variant, iters: u32, size: u32) -> Vec<u8> {
    [&[variant.code()][..], &iters.to_le_bytes(), &size.to_le_bytes()].concat()
}

/// Setup steps 4-5 and 7 of either side: a CQ with its channel, the QP, registered memory.
fn setup_endpoint(
    ep: &mut Ep,
    busy: bool,
    passive: bool,
    size: usize,
    access: Access,
) -> Result<(Completions, MemoryRegion), BoxError> {
    let ctx = ep.id().context().ok_or("the endpoint has no device")?;
    let pd = ctx.alloc_pd();
    // 4. create completion queue to get CA status (with a channel for notify).
    let channel = ctx.create_channel()?;
    let cq = ctx.create_cq(16, Some(&channel))?;
    // 5. create queue pair to give CA transfer metadata.
    let caps = QpCaps { max_send_wr: 8, max_recv_wr: 8, ..QpCaps::default() };
    let builder =
        QpBuilder::rc().caps(caps).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ);
    ep.create_qp(&pd, &builder, &cq, &cq)?;
    // 6-7. allocate user virtual memory and register it with the CA (rdma_reg_msgs):
    //      softrdma's registration allocates it.
    let mr = pd.register(size, access)?;
    Ok((Completions { cq, channel, busy, passive }, mr))
}

/// The client: connects, runs `iters` ping-pongs of `size` bytes, and returns both sides'
/// figures.
pub fn client(
    server: SocketAddr,
    src: Option<IpAddr>,
    variant: Variant,
    iters: u32,
    size: u32,
) -> Result<Outcome, BoxError> {
    // --- Setup phase ---
    // 1. process command-line options: the arguments.
    // 2. convert DNS name and port number (rdma_getaddrinfo).
    let hints = AddrHints { src, ..AddrHints::default() };
    let info = getaddrinfo(Some(&server.ip().to_string()), Some(&server.port().to_string()), &hints)?;
    // 3. create local end point (rdma_create_ep).
    let mut ep = Ep::create(&info[0], None, None)?;
    // 4-7. CQ, QP, memory: ping at 0, pong at `size`, the agent's report after them.
    let size = size.max(1) as usize;
    let (cq, mr) = setup_endpoint(&mut ep, variant.busy(), false, 2 * size + 64, Access::LOCAL_WRITE)?;
    let report_at = 2 * size;
    // 8. create connection with server (rdma_connect).
    ep.connect(&ConnParam {
        private_data: offer(variant, iters, size as u32),
        rnr_retry_count: 7,
        ..ConnParam::default()
    })?;
    let remote = if variant.one_sided() {
        let pd = &ep.peer_param().ok_or("no reply from the agent")?.private_data;
        let word = |i: usize| pd.get(i..i + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        let (addr, len, rkey) = (word(0), word(8), word(16));
        Some(RemoteRegion {
            addr: addr.ok_or("no region")?,
            len: len.ok_or("no region")?,
            rkey: rkey.ok_or("no region")? as u32,
        })
    } else {
        None
    };

    // --- Use phase ---
    let signaled = SendFlags { signaled: true, ..Default::default() };
    // 9. mark start time for statistics.
    let meter = Meter::start();
    // 10. start of transfer loop.
    for i in 0..iters {
        let ping = (i as u8).wrapping_mul(31).wrapping_add(7);
        mr.write(0, &vec![ping; size])?;
        match remote {
            None => {
                // 11. post receive to catch agent's pong data.
                ep.post_recv(u64::from(i), &mr, size, size)?;
                // 12. post send to start transfer of ping data to agent.
                ep.post_send(u64::from(i), &mr, 0, size, signaled)?;
                // 13. wait for both send and receive to complete.
                cq.next_ok("ping")?;
                cq.next_ok("pong")?;
            }
            Some(r) => {
                // RDMA_WRITE ping data into the agent's memory: signaled and waited for,
                // or unsignaled (the READ after it cannot finish before it).
                let flags = SendFlags { signaled: variant == Variant::WriteRead, ..Default::default() };
                ep.post_write(u64::from(i), &mr, 0, size, flags, &r)?;
                if variant == Variant::WriteRead {
                    cq.next_ok("RDMA_WRITE")?;
                }
                // RDMA_READ pong data back, and wait for it.
                ep.post_read(u64::from(i), &mr, size, size, signaled, &r)?;
                cq.next_ok("RDMA_READ")?;
            }
        }
        // 14. verify pong data equals ping data.
        let mut pong = vec![0u8; size];
        mr.read(size, &mut pong)?;
        if pong.iter().any(|&b| b != ping) {
            return Err(format!("round {i}: the pong is not the ping").into());
        }
        // 15. end of transfer loop.
    }
    // 16. mark stop time and print statistics (the caller prints).
    let usage = meter.stop();
    let rtt_us = usage.elapsed_us as f64 / f64::from(iters.max(1));
    // The agent's report comes after the loop (it waits, receiver not ready, until this
    // receive is posted).
    ep.post_recv(u64::MAX, &mr, report_at, 64)?;
    if remote.is_some() {
        // The agent cannot count what it did not see: tell it the loop is over.
        mr.write(0, &iters.to_le_bytes())?;
        ep.post_send(u64::MAX - 1, &mr, 0, 4, signaled)?;
        cq.next_ok("the finished message")?;
    }
    // The agent's own figures, sent after its use phase.
    let wc = loop {
        let wc = cq.next_ok("the agent's report")?;
        if wc.wr_id == u64::MAX {
            break wc;
        }
    };
    let mut report = vec![0u8; wc.byte_len as usize];
    mr.read(report_at, &mut report)?;
    let server = Usage::from_bytes(&report).ok_or("a short report")?;

    // --- Break-down phase ---
    // 17. break connection with server (rdma_disconnect); 18-23: deregistering memory,
    // destroying the QP, CQ and endpoint happen as `mr`, `cq` and `ep` are dropped.
    ep.disconnect()?;
    Ok(Outcome { variant, rtt_us, client: usage, server })
}

/// The listener: takes connection requests and hands each to an agent thread; serves
/// `clients` connections (0: forever). Prints one "listening" line first.
pub fn listener(at: SocketAddr, clients: u32) -> Result<(), BoxError> {
    // 1. process command-line options; 2. convert DNS name and port number.
    let hints = AddrHints { passive: true, ..AddrHints::default() };
    let info = getaddrinfo(Some(&at.ip().to_string()), Some(&at.port().to_string()), &hints)?;
    // 3. create local end point; 4-5. bind and listen (rdma_listen).
    let listener = Ep::create(&info[0], None, None)?;
    listener.listen(8)?;
    println!("listening on {at}");
    use std::io::Write;
    std::io::stdout().flush()?;
    let mut agents = Vec::new();
    // 6. start loop.
    let mut n = 0;
    while clients == 0 || n < clients {
        // 7. get connection request from client (rdma_get_request).
        let ep = listener.get_request()?;
        n += 1;
        // 8. hand connection over to agent. One agent at a time here, so that CPU
        //    figures are of one ping-pong only.
        let agent = std::thread::Builder::new().name(format!("agent-{n}")).spawn(move || agent(ep))?;
        agents.push(agent.join().map_err(|_| "an agent panicked")?);
        // 9. end loop.
    }
    // 10-11. destroy the endpoint, free the addresses: as they are dropped.
    agents.into_iter().collect::<Result<Vec<()>, BoxError>>()?;
    Ok(())
}

/// The agent: one client's connection, from accept to disconnect.
fn agent(mut ep: Ep) -> Result<(), BoxError> {
    // --- Setup phase ---
    // 1. make copy of listener's options: the client's offer.
    let offer = ep.peer_param().ok_or("a request without parameters")?.private_data.clone();
    if offer.len() < 9 {
        ep.reject(b"bad offer")?;
        return Err("a request without the tutorial's offer".into());
    }
    let variant = *Variant::ALL.get(usize::from(offer[0])).ok_or("an unknown variant")?;
    let iters = u32::from_le_bytes(offer[1..5].try_into()?);
    let size = u32::from_le_bytes(offer[5..9].try_into()?) as usize;
    if size == 0 || size > 64 << 20 {
        ep.reject(b"bad size")?;
        return Err("a size outside 1 B to 64 MiB".into());
    }
    // 2-5. CQ, QP, memory: the ping buffer (and the peer's target, one-sided), then room
    // for the finished message and the report.
    let access = if variant.one_sided() {
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
    } else {
        Access::LOCAL_WRITE
    };
    let (cq, mr) = setup_endpoint(&mut ep, variant.busy(), variant.one_sided(), size + 64, access)?;
    let ctl = size;
    // 6. post first receive (of ping data, or of the finished message).
    let first_len = if variant.one_sided() { 64 } else { size };
    ep.post_recv(0, &mr, if variant.one_sided() { ctl } else { 0 }, first_len)?;
    // Finalize connection with client (rdma_accept); a one-sided agent tells the
    // client where its buffer is.
    let private_data = if variant.one_sided() {
        let r = RemoteRegion { len: size as u64, ..mr.remote() };
        [r.addr.to_le_bytes(), r.len.to_le_bytes(), u64::from(r.rkey).to_le_bytes()].concat()
    } else {
        Vec::new()
    };
    ep.accept(&ConnParam { private_data, rnr_retry_count: 7, ..ConnParam::default() })?;

    // --- Use phase ---
    let signaled = SendFlags { signaled: true, ..Default::default() };
    // 8. mark start time for statistics.
    let meter = Meter::start();
    if variant.one_sided() {
        // The passive side does nothing: it waits for the client's "finished".
        let wc = cq.next_ok("the finished message")?;
        let mut count = [0u8; 4];
        mr.read(ctl, &mut count)?;
        if wc.byte_len != 4 || u32::from_le_bytes(count) != iters {
            return Err("a finished message with another count".into());
        }
    } else {
        // 9. start of transfer loop.
        for i in 0..iters {
            // 10. wait to receive ping data from client.
            cq.next_ok("ping")?;
            // 11. post next receive for ping data from client.
            if i + 1 < iters {
                ep.post_recv(u64::from(i) + 1, &mr, 0, size)?;
            }
            // 12. post send to start transfer of pong data to client (the ping, echoed).
            ep.post_send(u64::from(i), &mr, 0, size, signaled)?;
            // 13. wait for send to complete.
            cq.next_ok("pong")?;
            // 14. end of transfer loop.
        }
    }
    // 15. mark stop time and print statistics: sent to the client.
    let usage = meter.stop();
    mr.write(ctl, &usage.to_bytes())?;
    ep.post_send(u64::MAX, &mr, ctl, 40, signaled)?;
    cq.next_ok("the report")?;

    // --- Break-down phase ---
    // 16. break connection with client: wait for the client's disconnect, then
    // 17-21 deregister, destroy QP, CQ and endpoint as they are dropped.
    let deadline = Instant::now() + STEP;
    while !ep.peer_disconnected() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// The tutorial's summary: the four runs ranked by round-trip time, with CPU figures.
pub fn print_table(outcomes: &[Outcome]) {
    let mut rows: Vec<&Outcome> = outcomes.iter().collect();
    rows.sort_by(|a, b| a.rtt_us.total_cmp(&b.rtt_us));
    println!(
        "{:<48} {:>9} | {:>13} {:>8} {:>8} | {:>13} {:>8} {:>8}",
        "ping-pong (ranked by round-trip time)",
        "RTT us",
        "client user %",
        "kernel %",
        "process %",
        "server user %",
        "kernel %",
        "process %"
    );
    for o in rows {
        println!(
            "{:<48} {:>9.2} | {:>13.1} {:>8.1} {:>8.1} | {:>13.1} {:>8.1} {:>8.1}",
            o.variant.describe(),
            o.rtt_us,
            o.client.user_pct(),
            o.client.sys_pct(),
            o.client.proc_pct(),
            o.server.user_pct(),
            o.server.sys_pct(),
            o.server.proc_pct(),
        );
    }
    println!(
        "user % and kernel %: the program's thread, from getrusage(RUSAGE_THREAD), as a share of the use phase; \
         process %: the whole process (RUSAGE_SELF), including softrdma's progress thread, which does the \
         work a NIC does in hardware."
    );
}

/// Runs the four ping-pongs between this process (the client) and a server process
/// started as `program server_args... ADDR:PORT`, and prints the table.
pub fn run_all(
    program: &std::path::Path,
    server_args: &[&str],
    iters: u32,
    size: u32,
) -> Result<(), BoxError> {
    use std::io::BufRead;
    let n = 2 + (std::process::id() % 200) as u8;
    let at = SocketAddr::new(IpAddr::from([127, 0, 36, n]), 7472);
    let client_ip = IpAddr::from([127, 0, 37, n]);
    let mut child = std::process::Command::new(program)
        .args(server_args)
        .arg(at.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().ok_or("no pipe")?).read_line(&mut line)?;
    let outcome = if line.starts_with("listening") {
        println!("{iters} round trips of {size} bytes each, client on {client_ip}, server process on {at}\n");
        Variant::ALL
            .into_iter()
            .map(|v| client(at, Some(client_ip), v, iters, size))
            .collect::<Result<Vec<_>, _>>()
    } else {
        Err(format!("the server did not start: {line:?}").into())
    };
    let _ = child.kill();
    let _ = child.wait();
    print_table(&outcome?);
    Ok(())
}
