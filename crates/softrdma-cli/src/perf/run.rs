//! The run loops of the eight benchmarks, client and server side, and what they measure.

use std::time::{Duration, Instant};

use serde::Serialize;
use softrdma::{
    QueuePair, RemoteRegion, Rkey, SendFlags, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

use super::args::{self, Conn, Test};
use super::perftest::Ctrl;
use super::setup::Session;
use super::Fail;

/// The client's measurements for one size.
#[derive(Debug, Clone, Serialize, serde::Deserialize, Default)]
pub(super) struct Measured {
    pub(super) iters: u64,
    /// BW tests: bytes per second, average and peak.
    pub(super) bw_avg: f64,
    pub(super) bw_peak: f64,
    /// Latency tests: microseconds.
    pub(super) lat: Vec<f64>,
}

/// User and system CPU seconds of this process.
pub(super) fn cpu_times() -> Option<(f64, f64)> {
    // SAFETY: getrusage fills the rusage we pass; all-zero is a valid initial value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return None;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    Some((t(ru.ru_utime), t(ru.ru_stime)))
}

impl Session<'_> {
    /// Which of our QPs a completion belongs to.
    fn lane(&self, wc: &WorkCompletion) -> Result<usize, Fail> {
        self.qps.iter().position(|q| q.qpn() == wc.qp_num).ok_or_else(|| "completion of an unknown QP".into())
    }

    /// The next completion (an error completion is an error), busy-polled or, with a
    /// channel, waited for; fails after 30 s without one.
    fn wait(&self) -> Result<WorkCompletion, Fail> {
        let wait_limit = || Instant::now() + Duration::from_secs(30);
        // The deadline from the first clock read, 256 polls in: a completion that is there
        // at once (most of them, in a ping-pong) costs no clock read.
        let mut deadline = None;
        let mut polls = 0u64;
        loop {
            polls += 1;
            if let Some(wc) = self.cq.poll_one() {
                if wc.status != WcStatus::Success {
                    let e = format!("completion with error: {:?} ({:?})", wc.status, wc.opcode);
                    return Err(crate::pingpong::with_oversize_hint(e, &self.ctx));
                }
                return Ok(wc);
            }
            // The clock every 256 empty polls, not every one: a busy-polling loop is
            // mostly empty polls, and a clock read costs as much as one.
            if polls % 256 == 0 && Instant::now() > *deadline.get_or_insert_with(wait_limit) {
                return Err("timed out waiting for a completion".into());
            }
            if let Some(ch) = &self.channel {
                self.cq.req_notify(false).map_err(|e| e.to_string())?;
                if let Some(wc) = self.cq.poll_one() {
                    return if wc.status == WcStatus::Success {
                        Ok(wc)
                    } else {
                        Err(crate::pingpong::with_oversize_hint(format!("{:?}", wc.status), &self.ctx))
                    };
                }
                // Bounded, so that a lost message ends the run with an error, not a hang.
                if ch
                    .get_event_timeout(
                        deadline.get_or_insert_with(wait_limit).saturating_duration_since(Instant::now()),
                    )
                    .map_err(|e| e.to_string())?
                    .is_some()
                {
                    ch.ack_events(1);
                }
            }
        }
    }

    fn qp(&self, q: usize) -> Result<&QueuePair, Fail> {
        self.qps.get(q).map(|q| &**q).ok_or_else(|| "not connected".into())
    }

    fn op(&self, size: usize) -> SendOp {
        let r = self.remote.unwrap_or(RemoteRegion { addr: 0, len: 0, rkey: 0 });
        // The target the peer advertised (for softrdma, apart from the buffer it sends from).
        let (remote_addr, rkey) = (r.addr, Rkey(r.rkey));
        match self.args.test {
            Test::SendLat | Test::SendBw => SendOp::Send,
            Test::WriteLat | Test::WriteBw => SendOp::Write { remote_addr, rkey },
            Test::ReadLat | Test::ReadBw => SendOp::Read { remote_addr, rkey },
            Test::AtomicLat | Test::AtomicBw => {
                let _ = size;
                SendOp::FetchAdd { remote_addr, rkey, add: 1 }
            }
        }
    }

    fn wr(&self, q: usize, size: usize, wr_id: u64, signaled: bool) -> Result<SendWr, Fail> {
        let sge = self.mr.sge(self.local, size).map_err(|e| e.to_string())?;
        let one_sided_in =
            matches!(self.args.test, Test::ReadLat | Test::ReadBw) || self.args.test.is_atomic();
        let inline = (size as u32) <= self.args.inline && !one_sided_in;
        let flags = SendFlags { signaled, inline, ..SendFlags::default() };
        Ok(SendWr {
            wr_id,
            op: self.op(size),
            sg_list: softrdma::sgl![sge],
            flags,
            ud: self.ud_dests.get(q).copied(),
        })
    }

    /// Posts on QP `q`.
    fn post(&self, q: usize, size: usize, wr_id: u64, signaled: bool) -> Result<(), Fail> {
        let wr = self.wr(q, size, wr_id, signaled)?;
        self.qp(q)?.post_send(wr).map_err(|e| e.to_string())
    }

    fn iters(&self) -> u64 {
        self.args.iters.unwrap_or(if self.args.test.is_bw() { 5000 } else { 1000 })
    }

    pub(super) fn run_client(&mut self, size: usize) -> Result<Measured, Fail> {
        if self.args.test.is_bw() {
            self.client_bw(size)
        } else {
            self.client_lat(size)
        }
    }

    /// The bandwidth tests: every QP keeps up to `-t` WRs in flight and runs `-n` of them
    /// (or posts until `-D` seconds are over).
    fn client_bw(&mut self, size: usize) -> Result<Measured, Fail> {
        let iters = self.iters();
        // -D is at most limits::MAX_DURATION, which any clock can add.
        let deadline = self.args.duration.and_then(|d| Instant::now().checked_add(d));
        let depth = u64::from(self.args.tx_depth.max(1));
        let cq_mod = args::cq_mod(self.args);
        let nq = self.qps.len();
        // Per QP: WRs posted, completed, and covered by a signaled WR.
        let (mut posted, mut done, mut signaled_to) = (vec![0u64; nq], vec![0u64; nq], vec![0u64; nq]);
        // Signal every cq_mod-th WR, and the last one.
        let signaled = |p: u64| (p + 1) % cq_mod == 0 || (deadline.is_none() && p + 1 == iters);
        // Each QP's WR, made once, as perftest makes its WRs before the run: a post only
        // numbers and flags a copy.
        let templates = (0..nq).map(|q| self.wr(q, size, 0, false)).collect::<Result<Vec<_>, _>>()?;
        let mut marks = Vec::new();
        let start = Instant::now();
        loop {
            let time_left = deadline.is_none_or(|t| Instant::now() < t);
            let mut finished = true;
            for q in 0..nq {
                let more = time_left && (deadline.is_some() || posted[q] < iters);
                // Post as many as the depth allows in one call (one system call for all).
                // (A QP's closing signaled WR may take it one past the depth: saturating.)
                let room = depth.saturating_sub(posted[q] - done[q]);
                let n = if !more {
                    0
                } else if deadline.is_some() {
                    room
                } else {
                    room.min(iters - posted[q])
                };
                if n > 0 {
                    let first = posted[q];
                    let wrs = (first..first + n).map(|p| {
                        let mut wr = templates[q].clone();
                        wr.wr_id = p;
                        wr.flags.signaled = signaled(p);
                        wr
                    });
                    self.qp(q)?.post_send_many(wrs).map_err(|(_, e)| e.to_string())?;
                    posted[q] += n;
                    if let Some(p) = (first..first + n).rev().find(|&p| signaled(p)) {
                        signaled_to[q] = p + 1;
                    }
                }
                if !more && signaled_to[q] < posted[q] {
                    // The run ended off a cq_mod boundary: one signaled WR covers the rest.
                    self.post(q, size, posted[q], true)?;
                    posted[q] += 1;
                    signaled_to[q] = posted[q];
                }
                finished &= !more && done[q] == posted[q];
            }
            if finished {
                break;
            }
            let wc = self.wait()?;
            let q = self.lane(&wc)?;
            done[q] = done[q].max((wc.wr_id + 1).min(posted[q]));
            marks.push((done.iter().sum(), start.elapsed().as_secs_f64()));
        }
        let total = start.elapsed().as_secs_f64();
        let all: u64 = done.iter().sum();
        let bytes = size as f64 * all as f64;
        let peak = peak(&marks, size).max(bytes / total);
        // perftest reports the iterations of one QP and the bandwidth of all.
        Ok(Measured { iters: all / nq as u64, bw_avg: bytes / total, bw_peak: peak, lat: Vec::new() })
    }

    fn client_lat(&mut self, size: usize) -> Result<Measured, Fail> {
        let iters = self.iters();
        if self.args.test == Test::WriteLat {
            // As perftest: the server writes first and the client answers; a round trip is
            // the time between two arrivals.
            let mut laps = Lap::default();
            for i in 0..iters {
                self.wait_mark(size, i)?;
                laps.lap();
                self.write_mark(size, i)?;
            }
            return Ok(Measured { iters, lat: laps.0, ..Measured::default() });
        }
        // -n is bounded (args::check); the samples grow as they come past the first 2^20.
        let mut lat = Vec::with_capacity(iters.min(1 << 20) as usize);
        for i in 0..iters {
            let t = Instant::now();
            if self.args.test == Test::SendLat {
                self.post(0, size, i, true)?;
                self.wait_kind(WcOpcode::Recv)?;
                self.post_recv(0)?;
                lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            } else {
                self.post(0, size, i, true)?;
                self.wait()?;
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok(Measured { iters, bw_avg: 0.0, bw_peak: 0.0, lat })
    }

    /// Waits for a completion of `kind`, taking any others (our sends) on the way.
    fn wait_kind(&self, kind: WcOpcode) -> Result<(), Fail> {
        loop {
            if self.wait()?.opcode == kind {
                return Ok(());
            }
        }
    }

    /// write_lat: writes iteration `i` into the peer's buffer; its last byte changes last.
    fn write_mark(&self, size: usize, i: u64) -> Result<(), Fail> {
        let mut msg = vec![(i % 251) as u8; size.max(1)];
        msg[size.max(1) - 1] = mark(i);
        self.mr.write(self.local, &msg[..size.max(1)]).map_err(|e| e.to_string())?;
        self.post(0, size.max(1), i, true)?;
        self.wait_kind(WcOpcode::RdmaWrite)
    }

    /// write_lat: spins on the last byte of our buffer until the peer's write `i` (from 0)
    /// landed.
    fn wait_mark(&self, size: usize, i: u64) -> Result<(), Fail> {
        let local = self.local + self.buf + size.max(1) - 1;
        let want = mark(i);
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut b = [0u8];
        loop {
            self.mr.read(local, &mut b).map_err(|e| e.to_string())?;
            if b[0] == want {
                return Ok(());
            }
            // Polling the CQ drives the engine, like a busy-polling perftest would.
            let _ = self.cq.poll_one();
            if Instant::now() > deadline {
                return Err("timed out waiting for the peer's write".into());
            }
        }
    }

    pub(super) fn run_server(&mut self, size: usize, ctrl: &mut Ctrl) -> Result<Measured, Fail> {
        let iters = self.iters();
        match self.args.test {
            // The server's latency is half the time between two arrivals (a round trip).
            Test::SendLat => {
                let mut lat = Lap::default();
                for i in 0..iters {
                    self.wait_kind(WcOpcode::Recv)?;
                    lat.lap();
                    self.post_recv(0)?;
                    self.post(0, size, i, true)?;
                }
                return Ok(Measured { iters, lat: lat.0, ..Measured::default() });
            }
            Test::WriteLat => {
                let mut lat = Lap::default();
                for i in 0..iters {
                    self.write_mark(size, i)?;
                    self.wait_mark(size, i)?;
                    lat.lap();
                }
                return Ok(Measured { iters, lat: lat.0, ..Measured::default() });
            }
            // RC delivers every message: count them (sleeping on the channel with -e).
            Test::SendBw if self.args.duration.is_none() && self.args.connection == Conn::Rc => {
                let mut got = Received::default();
                while got.n < iters.saturating_mul(self.qps.len() as u64) {
                    let wc = self.wait()?;
                    if wc.opcode == WcOpcode::Recv {
                        got.one();
                        self.post_recv(self.lane(&wc)?)?;
                    }
                }
                return Ok(got.measured(size, self.qps.len()));
            }
            // A duration run, or UD, which drops what finds no receive posted: receive
            // until the client's results arrive.
            Test::SendBw => {
                let mut got = Received::default();
                // The control channel is a system call away: looked at every 64th empty
                // poll, not every one (a look per empty poll was 13 % of this thread's
                // time in the 2-byte rate test, and an arrival waited for it to return).
                let mut empty = 0u32;
                loop {
                    if let Some(wc) = self.cq.poll_one() {
                        if wc.opcode == WcOpcode::Recv {
                            got.one();
                            self.post_recv(self.lane(&wc)?)?;
                        }
                        continue;
                    }
                    empty = empty.wrapping_add(1);
                    if empty % 64 == 0 && ctrl.message_waiting()? {
                        break;
                    }
                }
                return Ok(got.measured(size, self.qps.len()));
            }
            // One-sided tests: the server has nothing to do; its progress thread answers.
            _ => {}
        }
        Ok(Measured::default())
    }
}

/// send_bw's server: messages received, and when.
#[derive(Default)]
struct Received {
    n: u64,
    start: Option<Instant>,
    /// (count, seconds since the first) every 128 messages, for the peak.
    marks: Vec<(u64, f64)>,
    /// The arrivals timed last, and when (the clock is read for each of the first 128,
    /// then for every 128th: at millions of messages a second a read per message costs).
    last: (u64, f64),
}

impl Received {
    fn one(&mut self) {
        let start = *self.start.get_or_insert_with(Instant::now);
        self.n += 1;
        if self.n <= 128 || self.n % 128 == 0 {
            self.last = (self.n, start.elapsed().as_secs_f64());
        }
        if self.n % 128 == 0 {
            self.marks.push(self.last);
        }
    }

    /// Bandwidth from the first arrival to the last timed.
    fn measured(&self, size: usize, qps: usize) -> Measured {
        let (n, t) = self.last;
        let avg = if t > 0.0 { (n * size as u64) as f64 / t } else { 0.0 };
        let peak = peak(&self.marks, size).max(avg);
        Measured { iters: self.n / qps.max(1) as u64, bw_avg: avg, bw_peak: peak, lat: Vec::new() }
    }
}

/// Half-intervals between successive calls, in microseconds.
#[derive(Default)]
struct Lap(Vec<f64>, Option<Instant>);

impl Lap {
    fn lap(&mut self) {
        let now = Instant::now();
        if let Some(prev) = self.1.replace(now) {
            self.0.push((now - prev).as_secs_f64() * 1e6 / 2.0);
        }
    }
}

/// The best bandwidth over ten equal slices of the run.
fn peak(marks: &[(u64, f64)], size: usize) -> f64 {
    let Some(&(_, t)) = marks.last() else { return 0.0 };
    let mut best: f64 = 0.0;
    let mut prev = (0u64, 0f64);
    for &(done, at) in marks {
        // Whole slices only: a short one at the end (a burst of completions) says nothing.
        if at - prev.1 >= t / 10.0 {
            best = best.max((done - prev.0) as f64 * size as f64 / (at - prev.1));
            prev = (done, at);
        }
    }
    best
}

/// The last byte of write_lat's `i`-th write (from 0): the write's number from 1, modulo
/// 256, as perftest's `(char)++scnt` (a peer counting another way stops at the first
/// value where the two differ: with values 1 to 251, at the 252nd write).
fn mark(i: u64) -> u8 {
    (i.wrapping_add(1) % 256) as u8
}

#[cfg(test)]
mod tests {
    #[test]
    fn write_lat_marks_count_as_perftests_do() {
        let marks: Vec<u8> =
            [0u64, 1, 250, 251, 254, 255, 256, 511].iter().map(|&i| super::mark(i)).collect();
        assert_eq!(marks, [1, 2, 251, 252, 255, 0, 1, 0]);
    }
}
