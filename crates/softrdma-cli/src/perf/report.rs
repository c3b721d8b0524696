//! perftest's output: the header, the table (or JSON lines) of results.

use std::net::IpAddr;

use softrdma::RemoteRegion;

use super::args::{self, Conn, PerfArgs};
use super::run::Measured;
use super::setup::Session;

/// perftest's rule between the parts of its output.
pub(super) const LINE: &str =
    "---------------------------------------------------------------------------------------";

/// The table's column headings (none with `--json`, whose lines replace the table).
pub(super) fn columns(args: &PerfArgs) {
    if args.json {
        // The table is replaced by JSON lines.
    } else if args.test.is_bw() {
        let unit = if args.report_gbits { "Gb/sec" } else { "MiB/sec" };
        println!(" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]");
    } else {
        println!(
            " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
        );
    }
}

/// One row of the table, or one JSON line.
pub(super) fn print_result(args: &PerfArgs, size: usize, m: &Measured, cpu: Option<(f64, f64)>) {
    if args.test.is_bw() {
        let scale = |bps: f64| if args.report_gbits { bps * 8.0 / 1e9 } else { bps / (1 << 20) as f64 };
        let rate = m.bw_avg / size.max(1) as f64 / 1e6;
        if args.json {
            let j = serde_json::json!({"test": args.test.name(), "bytes": size, "iterations": m.iters,
                "bw_peak": scale(m.bw_peak), "bw_average": scale(m.bw_avg), "msg_rate_mpps": rate,
                "unit": if args.report_gbits { "Gb/sec" } else { "MiB/sec" },
                "cpu_user_pct": cpu.map(|c| c.0), "cpu_sys_pct": cpu.map(|c| c.1)});
            println!("{j}");
        } else {
            println!(
                " {:<10} {:<10}       {:<10.2}         {:<10.2}        {:.6}",
                size,
                m.iters,
                scale(m.bw_peak),
                scale(m.bw_avg),
                rate
            );
        }
    } else {
        let mut v = m.lat.clone();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let pick = |q: f64| {
            v.get(((v.len() as f64 * q).ceil() as usize).saturating_sub(1).min(v.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0)
        };
        // `+ 0.0`: an empty sum is -0.0, which would print as "-0.00".
        let avg = v.iter().sum::<f64>() / n + 0.0;
        let sd = (v.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n).sqrt() + 0.0;
        let (min, max, typ) =
            (v.first().copied().unwrap_or(0.0), v.last().copied().unwrap_or(0.0), pick(0.5));
        if args.json {
            let j = serde_json::json!({"test": args.test.name(), "bytes": size, "iterations": m.iters,
                "t_min": min, "t_max": max, "t_typical": typ, "t_avg": avg, "t_stdev": sd,
                "p99": pick(0.99), "p99_9": pick(0.999),
                "cpu_user_pct": cpu.map(|c| c.0), "cpu_sys_pct": cpu.map(|c| c.1)});
            println!("{j}");
        } else {
            println!(
                " {:<7} {:<10}   {:<10.2}     {:<10.2}   {:<10.2}       {:<10.2}     {:<10.2}     {:<10.2}             {:.2}",
                size, m.iters, min, max, typ, avg, sd, pick(0.99), pick(0.999)
            );
        }
    }
    if let (Some((u, s)), false, true) = (cpu, args.json, args.cpu_util) {
        println!(" CPU: user {u:.1}% sys {s:.1}% of elapsed");
    }
}

impl Session<'_> {
    /// perftest's header: the test, its settings, and both sides' QPs.
    pub(super) fn header(&self) {
        if self.args.json {
            return;
        }
        let a = self.args;
        let d = self.ctx.device();
        println!("{LINE}");
        println!("                    {}", a.test.title());
        println!(" Dual-port       : OFF\t\tDevice         : {}", d.name);
        println!(" Number of qps   : {}\t\tTransport type : IB", a.qps);
        let conn = if a.connection == Conn::Ud { "UD" } else { "RC" };
        println!(" Connection type : {conn}\t\tUsing SRQ      : OFF");
        if self.client || !a.test.is_bw() {
            println!(" TX depth        : {}", if a.test.is_bw() { a.tx_depth } else { 1 });
        }
        if a.test.is_bw() {
            println!(" CQ Moderation   : {}", args::cq_mod(a));
        }
        println!(" Mtu             : {}[B]", self.mine[0].mtu);
        println!(" Link type       : Ethernet");
        println!(" GID index       : {}", d.gid_index);
        println!(" Max inline data : {}[B]", a.inline);
        let (cm, method) = if a.rdma_cm { ("ON", "rdma_cm") } else { ("OFF", "Ethernet") };
        println!(" rdma_cm QPs\t : {cm}");
        println!(" Data ex. method : {method}");
        println!("{LINE}");
        let gid =
            |a: IpAddr| softrdma::gid_of(a).iter().map(|b| format!("{b:02}")).collect::<Vec<_>>().join(":");
        let ends = self.mine.iter().map(|e| ("local", e)).chain(self.theirs.iter().map(|e| ("remote", e)));
        for (which, e) in ends {
            let r = e.region.unwrap_or(RemoteRegion { addr: 0, len: 0, rkey: 0 });
            if a.test.is_send() {
                println!(" {which} address: LID 0000 QPN {:#06x} PSN {:#08x}", e.qpn, e.psn);
            } else {
                println!(
                    " {which} address: LID 0000 QPN {:#06x} PSN {:#08x} RKey {:#08x} VAddr {:#016x}",
                    e.qpn, e.psn, r.rkey, r.addr
                );
            }
            println!(" GID: {}", gid(e.addr.ip()));
        }
        println!("{LINE}");
    }
}
