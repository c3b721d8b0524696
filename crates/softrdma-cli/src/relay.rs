//! `softrdma relay`: a UDP relay between two softrdma endpoints that drops, duplicates,
//! reorders, corrupts and delays datagrams by a seeded schedule, for testing RDMA programs
//! under faults.
//!
//! The relay listens on two addresses, one facing each endpoint. Endpoint A sends to the
//! A-facing address as if it were B, and the relay forwards from its B-facing address to
//! B, and back. Each endpoint must therefore use the relay's address facing it as its
//! peer's address (the GID in an RC QP's address vector). The ICRC covers the addresses
//! and ports, so the relay moves each packet's ICRC to the new ones — the CRC is linear, so
//! a packet damaged on the way in stays damaged — and only then applies its own damage.
//! The schedule is the simulator's impairment model (`softrdma sim`), on real time.
//! Counters are printed when it stops (after `--duration`, or on SIGINT/SIGTERM).

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use softrdma_proto::sim::{Impairments, NetStats, Network};
use softrdma_proto::wire::icrc;

use crate::limits;

/// The longest delay the relay adds (`--delay-us`): a minute.
const MAX_DELAY_US: u64 = 60_000_000;

/// Arguments of `softrdma relay`.
#[derive(Debug, clap::Args)]
pub struct RelayArgs {
    /// Address the relay listens on for endpoint A (A's peer address).
    #[arg(long)]
    pub a_side: SocketAddr,
    /// Address the relay listens on for endpoint B (B's peer address).
    #[arg(long)]
    pub b_side: SocketAddr,
    /// Endpoint A's address (IP and UDP port).
    #[arg(long)]
    pub peer_a: SocketAddr,
    /// Endpoint B's address.
    #[arg(long)]
    pub peer_b: SocketAddr,
    /// Datagrams lost, in percent.
    #[arg(long, default_value_t = 0.0, value_parser = limits::percent)]
    pub loss: f64,
    /// Datagrams duplicated, in percent.
    #[arg(long, default_value_t = 0.0, value_parser = limits::percent)]
    pub dup: f64,
    /// Datagrams delayed past later ones, in percent.
    #[arg(long, default_value_t = 0.0, value_parser = limits::percent)]
    pub reorder: f64,
    /// Datagrams with flipped bits, in percent.
    #[arg(long, default_value_t = 0.0, value_parser = limits::percent)]
    pub corrupt: f64,
    /// One-way delay added, in microseconds (at most 60 s).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=MAX_DELAY_US))]
    pub delay_us: u64,
    /// Seed of the schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Stop after this long: seconds, or a number with a unit (ms, s, m, h); default: run
    /// until interrupted.
    #[arg(long, value_parser = limits::duration)]
    pub duration: Option<Duration>,
}

/// What the relay did.
#[derive(Debug, Clone, Copy, Default)]
pub struct RelayStats {
    /// Datagrams received from either side.
    pub received: u64,
    /// Of those, RoCEv2 packets whose ICRC was moved to the new addresses.
    pub repatched: u64,
    /// The impairment model's counters.
    pub net: NetStats,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// The relay's two sockets and schedule.
#[derive(Debug)]
pub struct Relay {
    a: UdpSocket,
    b: UdpSocket,
    peer_a: SocketAddr,
    peer_b: SocketAddr,
    net: Network,
    epoch: Instant,
    stats: RelayStats,
}

impl Relay {
    /// Binds both sides.
    pub fn new(
        a_side: SocketAddr,
        b_side: SocketAddr,
        peer_a: SocketAddr,
        peer_b: SocketAddr,
        imp: Impairments,
        seed: u64,
    ) -> std::io::Result<Relay> {
        let a = UdpSocket::bind(a_side)?;
        let b = UdpSocket::bind(b_side)?;
        for s in [&a, &b] {
            s.set_nonblocking(true)?;
        }
        Ok(Relay {
            a,
            b,
            peer_a,
            peer_b,
            net: Network::new(seed, imp),
            epoch: Instant::now(),
            stats: RelayStats::default(),
        })
    }

    /// The addresses facing A and B (with the ports actually bound).
    pub fn sides(&self) -> (SocketAddr, SocketAddr) {
        (self.a.local_addr().expect("bound"), self.b.local_addr().expect("bound"))
    }

    /// Runs until `stop` is set or `until` passes.
    pub fn run(&mut self, stop: &AtomicBool, until: Option<Instant>) -> RelayStats {
        let mut buf = vec![0u8; 65536];
        let (a_side, b_side) = self.sides();
        while !stop.load(Ordering::Relaxed) && until.is_none_or(|t| Instant::now() < t) {
            let mut busy = false;
            for from_a in [true, false] {
                let sock = if from_a { &self.a } else { &self.b };
                while let Ok((n, src)) = sock.recv_from(&mut buf) {
                    busy = true;
                    self.stats.received += 1;
                    let (expected, in_side, out_side, dst) = if from_a {
                        (self.peer_a, a_side, b_side, self.peer_b)
                    } else {
                        (self.peer_b, b_side, a_side, self.peer_a)
                    };
                    // From the endpoint's address, and any port: a RoCEv2 sender puts a
                    // flow's entropy in its source port (softrdma and rxe: one per QP),
                    // while answers go to the endpoint's own port.
                    if src.ip() != expected.ip() {
                        continue;
                    }
                    let mut pkt = buf[..n].to_vec();
                    if let (Some(old), Some(new)) =
                        (icrc::Encap::new(src, in_side), icrc::Encap::new(out_side, dst))
                    {
                        if repatch(&old, &new, &mut pkt) {
                            self.stats.repatched += 1;
                        }
                    }
                    let now = self.epoch.elapsed();
                    self.net.send(now, out_side, dst, pkt);
                }
            }
            let now = self.epoch.elapsed();
            while let Some(d) = self.net.poll(now) {
                busy = true;
                let sock = if d.from == b_side { &self.b } else { &self.a };
                let _ = sock.send_to(&d.bytes, d.to);
            }
            if !busy {
                let next = self.net.next_delivery().map(|t| t.saturating_sub(self.epoch.elapsed()));
                let wait = next.unwrap_or(Duration::from_millis(5)).min(Duration::from_millis(5));
                let mut fds = [
                    libc::pollfd { fd: self.a.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                    libc::pollfd { fd: self.b.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                ];
                let ts =
                    libc::timespec { tv_sec: 0, tv_nsec: wait.as_nanos().min(999_999_999) as libc::c_long };
                // SAFETY: two valid pollfds and a live timespec for the duration of the call.
                unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
            }
        }
        self.stats.net = self.net.stats();
        self.stats
    }
}

/// Refuses sides that cannot reach their endpoints: each side sends to its peer, so the two
/// must be of one IP family.
fn check(args: &RelayArgs) -> Result<(), String> {
    for (side, peer, name) in [(args.a_side, args.peer_a, "a"), (args.b_side, args.peer_b, "b")] {
        if side.is_ipv4() != peer.is_ipv4() {
            return Err(format!(
                "--{name}-side {side} and --peer-{name} {peer}: the relay reaches an endpoint from the side facing it, so both need one IP family"
            ));
        }
    }
    Ok(())
}

/// Runs the command; returns the process exit status.
pub fn run(args: &RelayArgs) -> i32 {
    if let Err(e) = check(args) {
        eprintln!("softrdma relay: {e}");
        return limits::USAGE;
    }
    let imp = Impairments {
        delay: Duration::from_micros(args.delay_us),
        ..Impairments::from_percent(args.loss, args.dup, args.reorder, args.corrupt)
    };
    let mut relay = match Relay::new(args.a_side, args.b_side, args.peer_a, args.peer_b, imp, args.seed) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("softrdma relay: {e}");
            return 2;
        }
    };
    // SAFETY: installs a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    // `--duration` is at most limits::MAX_DURATION, which any clock can add.
    let until = args.duration.and_then(|d| Instant::now().checked_add(d));
    let s = relay.run(&STOP, until);
    println!("received={} repatched={} {}", s.received, s.repatched, s.net);
    0
}

/// Moves a datagram's ICRCs from the encapsulation `old` to `new`: one, or two for a
/// bundle (softrdma's request with the ACK it carries, `wire::bundle`).
fn repatch(old: &icrc::Encap, new: &icrc::Encap, pkt: &mut [u8]) -> bool {
    match softrdma_proto::wire::bundle::split_mut(pkt) {
        Some((request, ack)) => icrc::repatch(old, new, request) & icrc::repatch(old, new, ack),
        None => icrc::repatch(old, new, pkt),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use softrdma_proto::wire::{bundle, AethRepr, AethSyndrome, BthRepr, Opcode, PacketRepr};
    use softrdma_proto::{Psn, Qpn};

    fn packet(opcode: u8, payload: &[u8], encap: &icrc::Encap, flags: u8) -> Vec<u8> {
        let op = Opcode::new(opcode).unwrap();
        let mut r = PacketRepr::new(BthRepr::new(op, Qpn::new(0x12), Psn::new(5)), payload.len());
        if opcode == 0x11 {
            r.ext.aeth = Some(AethRepr { syndrome: AethSyndrome::ACK, msn: 1 });
        }
        let mut buf = vec![0u8; 128];
        let n = r.emit(&mut buf, payload, encap).unwrap();
        buf.truncate(n);
        buf[bundle::FLAG_BYTE] |= flags;
        let crc = icrc::compute(encap, &buf[..n - 4]);
        buf[n - 4..].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    #[test]
    fn both_icrcs_of_a_bundle_move_to_the_relays_addresses() {
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        let old = icrc::Encap::new(addr("127.0.8.3:4791"), addr("127.0.8.1:4791")).unwrap();
        let new = icrc::Encap::new(addr("127.0.8.2:4791"), addr("127.0.8.4:4791")).unwrap();
        let mut d = packet(0x04, b"12345678", &old, bundle::BUNDLED_ACK);
        d.extend(packet(0x11, &[], &old, 0));
        assert!(repatch(&old, &new, &mut d));
        let (request, ack) = bundle::split(&d).expect("still a bundle");
        assert!(icrc::verify(&new, request) && icrc::verify(&new, ack));
        // A plain packet: its one ICRC.
        let mut p = packet(0x04, b"12345678", &old, 0);
        assert!(repatch(&old, &new, &mut p));
        assert!(icrc::verify(&new, &p));
    }
}
