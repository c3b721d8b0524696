//! perftest's exchange: the version string, cycle buffer, cache line and MTU, the
//! 108-byte key message of each QP, the barriers, the BW report's five fields, and `done`;
//! over TCP, or with `-R` over an rdma_cm connection ([`super::cm`]).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::Duration;

use softrdma::{EndpointInfo, Mtu, RemoteRegion};

use super::args::{PerfArgs, Test};
use super::cm::{self, Control};
use super::run::Measured;
use super::setup::Session;
use super::{Fail, CYCLE_BUFFER};
use crate::exchange::{self, Bounded, ClientError};

const VERSION: &[u8; 16] = b"6.06\0\0\0\0\0\0\0\0\0\0\0\0";

/// The channel of perftest's exchange.
pub(super) enum Ctrl {
    Tcp(Bounded),
    Cm(Box<Control>),
}

impl Ctrl {
    /// Sends `msg` and receives the peer's message of the same length (the client speaks
    /// first).
    fn swap(&mut self, client: bool, msg: &[u8]) -> Result<Vec<u8>, Fail> {
        match self {
            Ctrl::Tcp(s) => swap(s, client, msg),
            Ctrl::Cm(c) => c.swap(client, msg),
        }
    }

    /// Whether the peer's next message (or, on TCP, its leaving) is waiting; never blocks.
    pub(super) fn message_waiting(&mut self) -> Result<bool, Fail> {
        match self {
            Ctrl::Tcp(s) => {
                // One non-blocking peek, the socket left as it is.
                let mut b = 0u8;
                // SAFETY: a one-byte buffer of ours on the stream's own descriptor.
                let n = unsafe {
                    libc::recv(
                        s.stream().as_raw_fd(),
                        (&raw mut b).cast(),
                        1,
                        libc::MSG_PEEK | libc::MSG_DONTWAIT,
                    )
                };
                match n {
                    0.. => Ok(true), // the message, or the peer gone (0)
                    _ => match std::io::Error::last_os_error() {
                        e if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
                        e => Err(e.to_string()),
                    },
                }
            }
            Ctrl::Cm(c) => Ok(c.message_waiting()),
        }
    }
}

/// The server's announcement while it waits for a client, as perftest prints it.
pub(super) fn announce(args: &PerfArgs) {
    if args.host.is_none() && !args.json {
        println!("\n************************************\n* Waiting for client to connect... *\n************************************");
    }
}

impl Session<'_> {
    /// perftest's exchange: version, cycle buffer, cache line, MTU, then the QP message;
    /// over `control` when the connection manager made one (`-R`), else over TCP.
    ///
    /// The TCP server serves clients one at a time until one completes the exchange: a
    /// client that sends nothing for [`exchange::CLIENT_TIMEOUT`], or anything that is not
    /// perftest's exchange, is dropped (with a line on stderr) before any QP is connected
    /// to it. Once a client's QPs are connected, the server runs that one benchmark and
    /// exits, as perftest does.
    pub(super) fn exchange(&mut self, control: Option<Control>) -> Result<Ctrl, Fail> {
        let args = self.args;
        let mut ctrl = match (control, &args.host) {
            (Some(c), _) => Ctrl::Cm(Box::new(c)),
            (None, Some(host)) => {
                announce(args);
                let s = exchange::connect(host, args.tcp_port(), Duration::from_secs(15))?;
                Ctrl::Tcp(Bounded::new(s, exchange::SERVER_TIMEOUT))
            }
            (None, None) => {
                announce(args);
                let listener = exchange::Listener::bind(listen_addr(args), args.tcp_port())?;
                return listener.serve("softrdma perf", |s| {
                    let mut ctrl = Ctrl::Tcp(s);
                    let mtu = self.greet(&mut ctrl).map_err(ClientError::Dropped)?;
                    self.finish(ctrl, mtu).map_err(ClientError::Fatal)
                });
            }
        };
        let mtu = self.greet(&mut ctrl)?;
        self.finish(ctrl, mtu)
    }

    /// The exchange up to the peer's QP messages; nothing is connected to the peer yet.
    /// Returns the path MTU both sides settled on.
    fn greet(&mut self, s: &mut Ctrl) -> Result<Option<Mtu>, Fail> {
        let args = self.args;
        // Our QPs' MTU (with -R they do not exist yet: the port's, as perftest's set_mtu).
        let my_mtu = self.mine.first().map_or(self.mtu.bytes(), |e| e.mtu);
        let mtu_enum = [256u32, 512, 1024, 2048, 4096].iter().position(|&m| m == my_mtu).map_or(3, |p| p + 1);
        let mut msgs: Vec<Vec<u8>> = vec![
            VERSION.to_vec(),
            (CYCLE_BUFFER as u32).to_be_bytes().to_vec(),
            64u32.to_be_bytes().to_vec(),
        ];
        msgs.push(vec![b'0' + mtu_enum as u8, 0]);
        let mut theirs_mtu = mtu_enum;
        for (i, m) in msgs.iter().enumerate() {
            let got = s.swap(self.client, m)?;
            if i == 0 && !got.starts_with(b"6.") {
                return Err("the peer is not a perftest-compatible benchmark".into());
            }
            if i == 3 {
                theirs_mtu = usize::from(got[0].saturating_sub(b'0'));
            }
        }
        let mtu = [Mtu::Mtu256, Mtu::Mtu512, Mtu::Mtu1024, Mtu::Mtu2048, Mtu::Mtu4096]
            .get(mtu_enum.min(theirs_mtu).clamp(1, 5) - 1)
            .copied();
        if args.rdma_cm {
            // perftest swaps a message before and after the CM connects the QPs; our server
            // listens before the first, so that no request of the client's comes too early.
            let listener = if self.client { None } else { Some(cm::DataConns::listen(args)?) };
            s.swap(self.client, &[0; cm::DEST_LEN])?;
            self.connect_cm(listener)?;
            s.swap(self.client, &[0; cm::DEST_LEN])?;
        }
        // One message per QP, in order: the peer's i-th QP is the partner of our i-th.
        self.theirs.clear();
        for k in 0..self.mine.len() {
            let got = s.swap(self.client, &self.key_of(k))?;
            let theirs = if args.rdma_cm { cm::parse_dest_message(&got)? } else { parse_key_message(&got)? };
            let addr = SocketAddr::new(theirs.0, softrdma::default_port());
            exchange::same_family(self.ctx.local_addr(), addr)?;
            self.theirs.push(EndpointInfo {
                addr,
                qpn: theirs.1,
                psn: theirs.2,
                mtu: mtu.map_or(1024, |m| m.bytes()),
                region: Some(RemoteRegion { addr: theirs.4, len: u64::MAX, rkey: theirs.3 }),
            });
        }
        Ok(mtu)
    }

    /// Connects our QPs to the peer's and passes perftest's barriers; then lifts the
    /// exchange's deadline for the run.
    fn finish(&mut self, mut s: Ctrl, mtu: Option<Mtu>) -> Result<Ctrl, Fail> {
        if self.args.rdma_cm {
            self.remote = self.theirs.first().and_then(|t| t.region);
        } else {
            self.connect_qps(mtu)?;
        }
        // perftest repeats every QP's message once all QPs are ready (a swap each, in
        // order) and the first one more: that one first in the SEND tests, last in the
        // others, and not at all in the one-sided BW tests.
        if self.args.test.is_send() {
            s.swap(self.client, &self.key())?;
        }
        for k in 0..self.mine.len() {
            s.swap(self.client, &self.key_of(k))?;
        }
        if !self.args.test.is_send() && !self.args.test.is_bw() {
            s.swap(self.client, &self.key())?;
        }
        if let Ctrl::Tcp(b) = &mut s {
            b.unbounded().map_err(|e| format!("exchange: {e}"))?;
        }
        Ok(s)
    }

    /// The message of our `k`-th QP: text over TCP, perftest's structure over rdma_cm.
    fn key_of(&self, k: usize) -> Vec<u8> {
        if self.args.rdma_cm {
            cm::dest_message(&self.mine[k], self.ctx.device().gid_index)
        } else {
            key_message(&self.mine[k])
        }
    }

    /// The message of our first QP, which perftest swaps as a barrier.
    fn key(&self) -> Vec<u8> {
        self.key_of(0)
    }

    /// perftest's barrier before each run: the first QP's message again.
    pub(super) fn barrier(&self, ctrl: &mut Ctrl) -> Result<(), Fail> {
        ctrl.swap(self.client, &self.key()).map(drop)
    }

    /// perftest's goodbye: the message once more, then (over TCP) "done" from the server
    /// first; its write_lat just closes the connection. With `-R` the client then
    /// disconnects the benchmark's connections.
    pub(super) fn goodbye(&mut self, ctrl: &mut Ctrl) -> Result<(), Fail> {
        if self.args.test != Test::WriteLat {
            ctrl.swap(self.client, &self.key())?;
            if let Ctrl::Tcp(_) = ctrl {
                ctrl.swap(!self.client, b"done\0")?;
            }
        }
        if let Some(conns) = self.cm.take() {
            if self.client {
                conns.disconnect();
            }
        }
        Ok(())
    }

    /// perftest's BW report after each run: a barrier, then five 8-byte big-endian fields
    /// (size, iterations, peak MiB/s, average MiB/s, message rate in Mpps), each sent by the
    /// client and answered by the server. Returns the client's numbers on both sides.
    pub(super) fn report(&self, ctrl: &mut Ctrl, size: usize, m: Measured) -> Result<Measured, Fail> {
        ctrl.swap(self.client, &self.key())?;
        let mine = if self.client { report_fields(size, &m) } else { [0; 5] };
        let mut got = [0u64; 5];
        for (g, v) in got.iter_mut().zip(mine) {
            let b = ctrl.swap(self.client, &v.to_be_bytes())?;
            *g = u64::from_be_bytes(b.try_into().map_err(|_| "short report")?);
        }
        if self.client {
            return Ok(m);
        }
        measured_from_report(size, &got)
    }
}

const MIB: f64 = 1_048_576.0;

/// The BW report's five fields of a run of `size`-byte messages.
fn report_fields(size: usize, m: &Measured) -> [u64; 5] {
    let rate = if size == 0 { 0.0 } else { m.bw_avg / size as f64 / 1e6 };
    [size as u64, m.iters, (m.bw_peak / MIB).to_bits(), (m.bw_avg / MIB).to_bits(), rate.to_bits()]
}

/// The run a client reported in the BW report's five fields, expected of `size`-byte
/// messages.
fn measured_from_report(size: usize, got: &[u64; 5]) -> Result<Measured, Fail> {
    if got[0] != size as u64 {
        return Err(format!("the client reported size {}, expected {size}", got[0]));
    }
    let f = |bits: u64| f64::from_bits(bits) * MIB;
    Ok(Measured { iters: got[1], bw_peak: f(got[2]), bw_avg: f(got[3]), lat: Vec::new() })
}

/// Sends `msg` and receives the peer's message of the same length (the client speaks
/// first).
fn swap(s: &mut Bounded, client: bool, msg: &[u8]) -> Result<Vec<u8>, Fail> {
    let mut got = vec![0u8; msg.len()];
    if client {
        s.write_all(msg).map_err(|e| format!("exchange: {e}"))?;
        s.read_exact(&mut got).map_err(|e| format!("exchange: {e}"))?;
    } else {
        s.read_exact(&mut got).map_err(|e| format!("exchange: {e}"))?;
        s.write_all(msg).map_err(|e| format!("exchange: {e}"))?;
    }
    Ok(got)
}

/// Where the TCP server listens: `-d`'s address when `-d` gives one. With a device name,
/// or none, on every IPv4 address, as perftest: its users reach the server by any name of
/// its host, often on another network than the RDMA device's.
fn listen_addr(args: &PerfArgs) -> Option<IpAddr> {
    args.device.as_deref().and_then(|d| d.parse().ok())
}

/// perftest's RoCE QP message: `lid:out_reads:qpn:psn:rkey:vaddr:gid:srqn:` and a NUL, 108
/// bytes.
fn key_message(e: &EndpointInfo) -> Vec<u8> {
    let r = e.region.unwrap_or(RemoteRegion { addr: 0, len: 0, rkey: 0 });
    let gid: String = softrdma::gid_of(e.addr.ip()).iter().map(|b| format!("{b:02x}:")).collect();
    let s = format!(
        "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:{}{:08x}:",
        0, 1, e.qpn, e.psn, r.rkey, r.addr, gid, 0
    );
    let mut v = s.into_bytes();
    v.push(0);
    v.resize(108, 0);
    v
}

/// (address, qpn, psn, rkey, vaddr) of a key message.
fn parse_key_message(m: &[u8]) -> Result<(IpAddr, u32, u32, u32, u64), Fail> {
    let text = std::str::from_utf8(m.split(|&b| b == 0).next().unwrap_or(&[]))
        .map_err(|_| "key message not text")?;
    let f: Vec<&str> = text.split(':').collect();
    if f.len() < 23 {
        return Err(format!("malformed key message {text:?}"));
    }
    let hex = |s: &str| u64::from_str_radix(s, 16).map_err(|_| format!("bad field {s:?} in key message"));
    let mut gid = [0u8; 16];
    for (k, g) in gid.iter_mut().enumerate() {
        *g = hex(f[6 + k])? as u8;
    }
    Ok((softrdma::addr_of_gid(gid), hex(f[2])? as u32, hex(f[3])? as u32, hex(f[4])? as u32, hex(f[5])?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bw_report_fields_are_perftests() {
        // The five fields rxe's ib_write_bw client sent after its run of 100 x 64 bytes in
        // testdata/rxe/write_bw_64.pcap (frames 226-234): size, iterations, then peak and
        // average in MiB/s and the message rate in Mpps, as big-endian doubles.
        let rxe: [u64; 5] = [0x40, 0x64, 0x3fc0_1117_9dd8_3cfc, 0x3fbf_e55b_80f1_519f, 0x3f60_b8ff_b930_e8d9];
        // Read by our server as the run it describes, in bytes per second ...
        let m = measured_from_report(64, &rxe).unwrap();
        assert_eq!(m.iters, 100);
        assert!(m.bw_peak >= m.bw_avg);
        // ... whose average agrees with rxe's message rate: the units are perftest's.
        let rate = f64::from_bits(rxe[4]);
        assert!((rate * 1e6 * 64.0 - m.bw_avg).abs() / m.bw_avg < 0.01, "{rate} Mpps vs {} B/s", m.bw_avg);
        // Sent by our client, the same run is the same fields: size, iterations, peak and
        // average exactly, the rate as rxe computed it.
        let ours = report_fields(64, &m);
        assert_eq!(ours[..4], rxe[..4]);
        let r = f64::from_bits(ours[4]);
        assert!((r - rate).abs() / rate < 0.01, "{r} vs {rate}");
        assert!(measured_from_report(65, &rxe).is_err(), "another size than the run's");
    }

    #[test]
    fn key_message_matches_perftest_and_round_trips() {
        let e = EndpointInfo {
            addr: "192.168.77.10:4791".parse().unwrap(),
            qpn: 0x21,
            psn: 0x2c27a5,
            mtu: 1024,
            region: Some(RemoteRegion { addr: 0x562b6dc6d000, len: 64, rkey: 0x11e1 }),
        };
        let m = key_message(&e);
        assert_eq!(m.len(), 108);
        // The message rxe's ib_write_bw sent in testdata/rxe/write_bw_64.pcap.
        let want = "0000:0001:000021:2c27a5:000011e1:0000562b6dc6d000:00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:4d:0a:00000000:";
        assert_eq!(&m[..want.len()], want.as_bytes());
        assert_eq!(parse_key_message(&m).unwrap(), (e.addr.ip(), 0x21, 0x2c27a5, 0x11e1, 0x562b6dc6d000));
        assert!(parse_key_message(b"garbage").is_err());
    }
}
