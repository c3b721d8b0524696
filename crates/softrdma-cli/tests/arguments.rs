//! Every subcommand driven with hostile arguments — huge, zero, negative, NaN, infinite,
//! past 2^64, of the wrong IP family — must end by itself, without a signal (no abort) or
//! a panic; a usage error exits 2 with a message that names the argument.
//!
//! Every process runs at once, each killed (and the test failed) if it outlives its limit.

use std::io::Write;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

mod common;
use common::{softrdma, Proc};

/// How long any one process may run.
const LIMIT: Duration = Duration::from_secs(10);

static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

/// A TCP/UDP port no other case (or test binary running beside us) uses.
fn port() -> String {
    let n = NEXT_PORT.fetch_add(1, Ordering::Relaxed);
    (31_000 + (std::process::id() % 2_000) as u16 * 8 + n).to_string()
}

/// What a process did.
struct Ended {
    args: Vec<String>,
    status: ExitStatus,
    stderr: String,
}

impl Ended {
    fn what(&self) -> String {
        format!("softrdma {}: {:?}\n{}", self.args.join(" "), self.status, self.stderr)
    }

    /// Ended by itself, by no signal, without a panic.
    fn sane(&self) -> Result<(), String> {
        use std::os::unix::process::ExitStatusExt;
        if self.status.signal().is_some() {
            return Err(format!("killed by a signal: {}", self.what()));
        }
        if self.stderr.contains("panicked") {
            return Err(format!("panicked: {}", self.what()));
        }
        Ok(())
    }

    fn assert_sane(&self) {
        if let Err(e) = self.sane() {
            panic!("{e}");
        }
    }
}

/// A running process, killed if it outlives [`LIMIT`] (which fails the test).
struct Bounded {
    args: Vec<String>,
    proc: Proc,
}

fn spawn(args: &[&str], stdin: Option<String>) -> Bounded {
    let mut cmd = softrdma(args);
    cmd.env("SOFTRDMA_PORT", port());
    let proc = match stdin {
        None => Proc::start(&mut cmd, LIMIT),
        Some(text) => {
            // Kept open: a process that waits on stdin must not be ended by its closing.
            let mut p = Proc::start_piped(&mut cmd, LIMIT);
            let _ = p.stdin().write_all(text.as_bytes());
            p
        }
    };
    Bounded { args: args.iter().map(|s| s.to_string()).collect(), proc }
}

impl Bounded {
    /// Waits for the end, killing the process past [`LIMIT`]: `Err` with what it said then.
    fn end(self) -> Result<Ended, String> {
        let o = self.proc.end()?;
        Ok(Ended { args: self.args, status: o.status, stderr: String::from_utf8_lossy(&o.stderr).into() })
    }

    /// Waits until the server says `needle` (failing past [`LIMIT`]), then ends it, expected
    /// to be still waiting; returns whether it was, and what it said.
    fn stop_after(mut self, needle: &str) -> (bool, String) {
        self.proc.wait_for_stderr(needle);
        let (running, o) = self.proc.stop();
        (running, String::from_utf8_lossy(&o.stderr).into())
    }
}

/// Usage errors: (arguments, what stderr must name).
fn usage_cases() -> Vec<(Vec<String>, &'static str)> {
    let mut v: Vec<(Vec<&str>, &str)> = vec![
        // perf: sizes, counts, depths and durations.
        (vec!["perf", "write_bw", "-s", "1099511627776"], "-s 1099511627776"),
        (vec!["perf", "write_bw", "--local", "-s", "1099511627776"], "-s 1099511627776"),
        (vec!["perf", "write_bw", "-s", "18446744073709551616"], "--size"),
        (vec!["perf", "write_bw", "--size=-1"], "--size"),
        // Receives share one slot per QP as perftest's do: 64 QPs of 2 GiB messages need more
        // memory than any machine here has.
        (vec!["perf", "send_bw", "-s", "2147483648", "-q", "64"], "-s 2147483648"),
        (vec!["perf", "send_bw", "-c", "UD", "-s", "100000"], "-s 100000"),
        (vec!["perf", "write_bw", "-D", "inf"], "--duration"),
        // perftest's options that are not implemented are refused by name, not ignored.
        (vec!["perf", "write_bw", "-b"], "-b (bidirectional"),
        (vec!["perf", "write_bw", "--report-both"], "--report-both"),
        (vec!["perf", "send_bw", "--use-srq"], "--use-srq"),
        (vec!["perf", "write_bw", "-l", "4"], "-l/--post_list"),
        (vec!["perf", "write_bw", "--run_infinitely"], "--run_infinitely"),
        (vec!["perf", "write_bw", "--out_json"], "--out_json"),
        (vec!["perf", "write_bw", "-T", "3"], "-T/--tos"),
        (vec!["perf", "send_bw", "-c", "UC"], "'UC'"),
        (vec!["perf", "send_lat", "-D", "2"], "-D runs the bandwidth tests"),
        (vec!["perf", "write_bw", "-Q", "0"], "-Q 0"),
        (vec!["perf", "write_bw", "-u", "32"], "-u 32"),
        (vec!["perf", "write_bw", "-D", "NaN"], "--duration"),
        (vec!["perf", "write_bw", "-D", "0"], "--duration"),
        (vec!["perf", "write_bw", "--duration=-1"], "--duration"),
        (vec!["perf", "write_bw", "-D", "1e30"], "--duration"),
        (vec!["perf", "write_bw", "-n", "0"], "-n 0"),
        (vec!["perf", "write_lat", "-n", "18446744073709551615"], "-n 18446744073709551615"),
        (vec!["perf", "write_bw", "-n", "18446744073709551616"], "--iters"),
        (vec!["perf", "write_bw", "-t", "0"], "-t 0"),
        (vec!["perf", "write_bw", "-t", "4294967295"], "-t 4294967295"),
        (vec!["perf", "send_bw", "-r", "0"], "-r 0"),
        (vec!["perf", "send_bw", "-r", "100000"], "-r 100000"),
        (vec!["perf", "write_bw", "-q", "0"], "-q"),
        (vec!["perf", "write_bw", "-q", "4294967296"], "--qp"),
        (vec!["perf", "write_bw", "-I", "100000"], "-I 100000"),
        (vec!["perf", "write_bw", "-p", "0"], "-p 0"),
        (vec!["perf", "write_bw", "-p", "65536"], "--port"),
        (vec!["perf", "write_bw", "-i", "2"], "-i 2"),
        (vec!["perf", "write_bw", "-m", "-7"], "-7"),
        (vec!["perf", "write_bw", "-t", "65536", "-q", "64"], "max_cqe"),
        // pingpong
        (vec!["pingpong", "-s", "18446744073709551615"], "-s 18446744073709551615"),
        (vec!["pingpong", "-s", "1099511627776"], "-s 1099511627776"),
        (vec!["pingpong", "-s", "18446744073709551616"], "--size"),
        (vec!["pingpong", "-n", "0"], "-n 0"),
        (vec!["pingpong", "-m", "7"], "-m 7"),
        (vec!["pingpong", "-p", "0"], "-p 0"),
        (vec!["pingpong", "--transport", "ud", "-s", "100000"], "-s 100000"),
        (vec!["pingpong", "--bind", "127.0.0.1", "--via", "[::1]:4791"], "--via [::1]:4791"),
        (vec!["pingpong", "--bind", "127.0.0.1", "-g", "1"], "--bind and -g"),
        // memserver
        (vec!["memserver", "--size", "1099511627776"], "--size 1099511627776"),
        (vec!["memserver", "--size", "0"], "--size 0"),
        (vec!["memserver", "--size", "18446744073709551616"], "--size"),
        (vec!["memserver", "--udp-port", "65536"], "--udp-port"),
        // soak
        (vec!["soak", "--depth", "100000"], "--depth 100000"),
        (vec!["soak", "--depth", "0"], "--depth 0"),
        (vec!["soak", "--max-size", "18446744073709551615"], "--max-size 18446744073709551615"),
        (vec!["soak", "--duration", "1e30"], "--duration"),
        (vec!["soak", "--duration", "inf"], "--duration"),
        (vec!["soak", "--duration", "nan"], "--duration"),
        (vec!["soak", "--duration", "0"], "--duration"),
        (vec!["soak", "--loss", "NaN"], "--loss"),
        (vec!["soak", "--loss", "101"], "--loss"),
        (vec!["soak", "--corrupt=-1"], "--corrupt"),
        (vec!["soak", "--seed", "18446744073709551616"], "--seed"),
        // sim
        (vec!["sim", "--loss", "100"], "--loss 100"),
        (vec!["sim", "--corrupt", "100"], "--corrupt 100"),
        (vec!["sim", "--loss", "inf"], "--loss"),
        (vec!["sim", "--ops", "0"], "--ops"),
        (vec!["sim", "--ops", "18446744073709551615"], "--ops"),
        (vec!["sim", "--depth", "0"], "--depth"),
        (vec!["sim", "--max-size", "4294967296"], "--max-size"),
        (vec!["sim", "--mtu", "7"], "--mtu"),
        // rping, cmatose, udaddy, connrate
        (vec!["rping", "-s", "-S", "0"], "-S"),
        (vec!["rping", "-s", "-S", "18446744073709551616"], "-S"),
        (vec!["rping", "-c", "-a", "127.0.0.1", "-C", "18446744073709551616"], "-C"),
        (vec!["rping", "-s", "-p", "65536"], "-p"),
        (vec!["cmatose", "-c", "0"], "-c"),
        (vec!["cmatose", "-S", "0"], "-S"),
        (vec!["cmatose", "-C", "4294967296"], "-C"),
        (vec!["udaddy", "-S", "5000"], "-S"),
        (vec!["connrate", "127.0.0.1", "-n", "0"], "-n"),
        (vec!["connrate", "127.0.0.1", "--concurrent", "0"], "--concurrent"),
        // status and exec
        (vec!["devinfo", "-i", "0"], "--ib-port"),
        (vec!["devinfo", "-i", "256"], "--ib-port"),
        (vec!["exec", "--udp-port", "65536", "--", "true"], "--udp-port"),
        // ipoib
        (vec!["ipoib", "--bind", "127.0.0.1", "--ip", "10.99.0.1"], "--ip"),
        (vec!["ipoib", "--bind", "127.0.0.1", "--ip", "10.99.0.1/0"], "--ip"),
        (vec!["ipoib", "--bind", "127.0.0.1", "--ip", "239.1.1.1/24"], "--ip"),
        (vec!["ipoib", "--bind", "127.0.0.1", "--ip", "10.99.0.1/24", "--mode", "carrier"], "--mode"),
        (vec!["ipoib", "--bind", "127.0.0.1", "--ip", "10.99.0.1/24", "--group", "10.0.0.1"], "--group"),
        // tutorial
        (vec!["tutorial", "-n", "0"], "--iters"),
        (vec!["tutorial", "-s", "0"], "--size"),
        (vec!["tutorial", "-s", "99999999999"], "--size"),
        (vec!["tutorial", "--connect", "127.0.0.1:7472"], "--variant"),
        (vec!["tutorial", "--serve", "127.0.0.1"], "--serve"),
    ];
    // relay: its four addresses, then what is wrong.
    let sides = ["relay", "--b-side", "127.0.0.1:0", "--peer-b", "127.0.0.1:2", "--peer-a", "127.0.0.1:1"];
    v.push((sides.iter().copied().chain(["--a-side", "[::1]:0"]).collect(), "--a-side [::1]:0"));
    let relay: [(&[&str], &str); 5] = [
        (&["--duration", "1e30"], "--duration"),
        (&["--duration", "NaN"], "--duration"),
        (&["--duration=-5"], "--duration"),
        (&["--loss", "inf"], "--loss"),
        (&["--delay-us", "18446744073709551615"], "--delay-us"),
    ];
    for (extra, want) in relay {
        let mut args: Vec<&str> = sides.iter().copied().chain(["--a-side", "127.0.0.1:0"]).collect();
        args.extend_from_slice(extra);
        v.push((args, want));
    }
    v.into_iter().map(|(a, w)| (a.into_iter().map(String::from).collect(), w)).collect()
}

#[test]
fn hostile_arguments_are_usage_errors_that_name_them() {
    let cases = usage_cases();
    let running: Vec<_> = cases
        .iter()
        .map(|(args, want)| (spawn(&args.iter().map(String::as_str).collect::<Vec<_>>(), None), *want))
        .collect();
    let mut failures = Vec::new();
    for (p, want) in running {
        match p.end() {
            Err(e) => failures.push(e),
            Ok(e) => {
                if let Err(why) = e.sane() {
                    failures.push(why);
                } else if e.status.code() != Some(2) || !e.stderr.contains(want) {
                    failures.push(format!("want exit 2 naming {want:?}: {}", e.what()));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} cases:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn hostile_inputs_that_are_not_usage_errors_end_cleanly() {
    let endpoint = |addr: &str| {
        let e =
            softrdma::EndpointInfo { addr: addr.parse().unwrap(), qpn: 17, psn: 1, mtu: 1024, region: None };
        format!("{}\n", serde_json::to_string(&e).unwrap())
    };
    let cases = vec![
        spawn(&["decode", "/dev/zero"], None),
        spawn(&["decode", "/dev/null"], None),
        spawn(&["decode", "/"], None),
        spawn(&["stat", "srdma_lo", "0"], None),
        spawn(&["stat", "srdma_lo", "255"], None),
        // A GID index past the table: refused before the server waits.
        spawn(&["perf", "write_bw", "-x", "4294967295", "-p", &port()], None),
        spawn(&["pingpong", "-g", "4294967295", "-p", &port()], None),
        // A peer of the other IP family, at once rather than after the handshake's
        // timeout.
        spawn(&["memserver", "--bind", "::1"], Some(endpoint("127.0.0.1:4791"))),
        spawn(&["memserver", "--bind", "127.0.0.1"], Some(endpoint("[::1]:4791"))),
        // The passive side with no peer line: stdin closes.
        spawn(&["memserver"], None),
    ];
    let mut failures = Vec::new();
    for p in cases {
        match p.end() {
            Err(e) => failures.push(e),
            Ok(e) => {
                if let Err(why) = e.sane() {
                    failures.push(why);
                } else if e.status.success() {
                    failures.push(format!("want a failure: {}", e.what()));
                } else if e.args[0] == "memserver" && e.args.len() > 1 && !e.stderr.contains("IPv") {
                    failures.push(format!("want the families named: {}", e.what()));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_client_of_the_other_ip_family_fails_at_once_and_the_server_goes_on() {
    // pingpong: an IPv4 server, a client whose device is IPv6 (the TCP exchange itself is
    // IPv4).
    let (tcp, udp) = (port(), port());
    let server = spawn(&["pingpong", "--bind", "127.0.0.1", "--udp-port", &udp, "-p", &tcp], None);
    let client = spawn(&["pingpong", "--bind", "::1", "--udp-port", "0", "-p", &tcp, "127.0.0.1"], None);
    let c = client.end().unwrap();
    c.assert_sane();
    assert!(!c.status.success(), "{}", c.what());
    // perf: the same, with perftest's exchange.
    let ptcp = port();
    let pserver = spawn(&["perf", "send_lat", "-d", "127.0.0.1", "-p", &ptcp], None);
    let pclient = spawn(&["perf", "send_lat", "-d", "::1", "-p", &ptcp, "127.0.0.1"], None);
    let pc = pclient.end().unwrap();
    pc.assert_sane();
    assert!(!pc.status.success(), "{}", pc.what());
    for (name, s) in [("pingpong", server), ("perf", pserver)] {
        // Once the server has dropped the client, it must wait for the next one.
        let (running, err) = s.stop_after("dropped client");
        assert!(running, "the {name} server waits for the next client: {err}");
        assert!(err.contains("dropped client") && err.contains("IPv6"), "{name}: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
}
