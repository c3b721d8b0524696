//! A simulated datagram network with seeded impairments, in virtual time.
//!
//! Endpoints hand datagrams to [`Network::send`] and collect them with [`Network::poll`];
//! between the two, each datagram may be dropped, delayed past later ones, duplicated or
//! have bits flipped, with the probabilities of [`Impairments`]. The idea follows smoltcp's
//! `phy::FaultInjector`, but for datagrams between any number of addresses, and with time
//! passed in by the caller (a [`Duration`] since an arbitrary epoch) instead of read from a
//! clock.
//!
//! A [`Bottleneck`] adds a link of finite rate in front of each destination: datagrams
//! queue behind one another, a full queue drops them (tail drop), and a queue beyond the
//! marking threshold marks ECN-capable datagrams Congestion Experienced, as a switch port
//! configured for RoCE does.
//!
//! This module owns the datagrams in flight, their delivery order and the impairment
//! counters. Every random choice comes from one seeded [`Rng`], so a seed and the sequence
//! of calls determine every delivery exactly.

use core::cmp::Ordering;
use core::fmt;
use core::time::Duration;
use std::collections::{BinaryHeap, HashMap};
use std::net::SocketAddr;

use super::rng::Rng;

/// What the network does to datagrams. Probabilities are in `0..=1` and apply to each
/// datagram independently.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Impairments {
    /// Probability that a datagram is dropped.
    pub loss: f64,
    /// Probability that a second copy of a datagram is delivered, slightly later.
    pub duplicate: f64,
    /// Probability that a datagram is held back so that later ones overtake it.
    pub reorder: f64,
    /// Probability that a delivered copy has one to three bits flipped.
    pub corrupt: f64,
    /// Base one-way delay of every datagram.
    pub delay: Duration,
    /// Largest extra delay of a reordered datagram; when zero, four times `delay` is used.
    pub jitter: Duration,
    /// Largest datagram carried; larger ones are dropped and counted as oversize.
    pub mtu: usize,
    /// A link of finite rate and buffer in front of each destination address, if any.
    pub bottleneck: Option<Bottleneck>,
}

/// A bottleneck link in front of each destination address, as a switch's egress port:
/// datagrams to one address leave one at a time at `rate_bps` (each counted with 42 bytes
/// of Ethernet, IPv4 and UDP headers), in the order they were sent (after the random
/// loss); a datagram that would find more than `buffer` bytes queued ahead of it and
/// itself is dropped; an ECN-capable one (ECT(0), ECT(1)) that finds more than
/// `ecn_threshold` bytes queued is marked Congestion Experienced. Queueing comes before
/// the base delay and any reordering delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bottleneck {
    /// Link rate in bits per second (at least 1).
    pub rate_bps: u64,
    /// Bytes the queue holds at most.
    pub buffer: usize,
    /// Queue depth in bytes beyond which ECN-capable datagrams are marked; `None`: none are.
    pub ecn_threshold: Option<usize>,
}

/// Bytes of Ethernet, IPv4 and UDP headers a datagram takes on a link besides its payload.
pub const LINK_OVERHEAD: usize = 42;

impl Default for Impairments {
    /// A perfect network: nothing lost, reordered, duplicated or corrupted; 10 µs of delay;
    /// no jitter; datagrams up to 65535 bytes.
    fn default() -> Impairments {
        Impairments {
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            corrupt: 0.0,
            delay: Duration::from_micros(10),
            jitter: Duration::ZERO,
            mtu: 65535,
            bottleneck: None,
        }
    }
}

impl Impairments {
    /// The default network with the given loss, duplication, reordering and corruption
    /// rates in percent (`0.0..=100.0`; out-of-range values are clamped).
    pub fn from_percent(loss: f64, duplicate: f64, reorder: f64, corrupt: f64) -> Impairments {
        let p = |percent: f64| (percent / 100.0).clamp(0.0, 1.0);
        Impairments {
            loss: p(loss),
            duplicate: p(duplicate),
            reorder: p(reorder),
            corrupt: p(corrupt),
            ..Impairments::default()
        }
    }
}

/// Counters of what the network did, for assertions and logs.
///
/// Once the network is idle, `delivered == sent - lost - oversize - queue_drops + duplicated`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Datagrams passed to [`Network::send`].
    pub sent: u64,
    /// Copies handed out by [`Network::poll`], duplicates included.
    pub delivered: u64,
    /// Datagrams dropped by random loss.
    pub lost: u64,
    /// Extra copies scheduled.
    pub duplicated: u64,
    /// Datagrams held back for reordering.
    pub reordered: u64,
    /// Copies with flipped bits.
    pub corrupted: u64,
    /// Datagrams dropped for exceeding the MTU.
    pub oversize: u64,
    /// Datagrams dropped by a full bottleneck queue.
    pub queue_drops: u64,
    /// Datagrams a bottleneck marked Congestion Experienced.
    pub ce_marked: u64,
}

impl fmt::Display for NetStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sent={} delivered={} lost={} dup={} reordered={} corrupted={} oversize={}",
            self.sent,
            self.delivered,
            self.lost,
            self.duplicated,
            self.reordered,
            self.corrupted,
            self.oversize
        )?;
        if self.queue_drops + self.ce_marked > 0 {
            write!(f, " queue_drops={} ce_marked={}", self.queue_drops, self.ce_marked)?;
        }
        Ok(())
    }
}

/// A datagram delivered by the network.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Datagram {
    /// Sender's address.
    pub from: SocketAddr,
    /// Receiver's address.
    pub to: SocketAddr,
    /// The payload, possibly corrupted.
    pub bytes: Vec<u8>,
    /// The IP TOS byte it arrives with (a bottleneck may have set its ECN bits to CE).
    pub tos: u8,
}

/// A datagram in flight, ordered by delivery time, then by scheduling order.
#[derive(Debug)]
struct InFlight {
    at: Duration,
    seq: u64,
    datagram: Datagram,
}

impl PartialEq for InFlight {
    fn eq(&self, other: &InFlight) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for InFlight {}

impl PartialOrd for InFlight {
    fn partial_cmp(&self, other: &InFlight) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for InFlight {
    /// Reversed, so that the max-heap `BinaryHeap` yields the earliest first.
    fn cmp(&self, other: &InFlight) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// A deterministic simulated network between any number of socket addresses.
#[derive(Debug)]
pub struct Network {
    rng: Rng,
    imp: Impairments,
    queue: BinaryHeap<InFlight>,
    next_seq: u64,
    stats: NetStats,
    /// With a bottleneck: when each destination's link finishes what is queued for it.
    links: HashMap<SocketAddr, Duration>,
    /// With a bottleneck: each queued datagram's wait, in nanoseconds (saturating).
    queue_waits: Vec<u32>,
}

impl Network {
    /// An empty network with impairments `imp`, drawing every random choice from `seed`.
    pub fn new(seed: u64, imp: Impairments) -> Network {
        Network {
            rng: Rng::new(seed),
            imp,
            queue: BinaryHeap::new(),
            next_seq: 0,
            stats: NetStats::default(),
            links: HashMap::new(),
            queue_waits: Vec::new(),
        }
    }

    /// The current impairments.
    pub fn impairments(&self) -> &Impairments {
        &self.imp
    }

    /// Changes the impairments for datagrams sent from now on; those in flight keep their
    /// fate.
    pub fn set_impairments(&mut self, imp: Impairments) {
        self.imp = imp;
    }

    /// Sends `datagram` from `from` to `to` at time `now`.
    ///
    /// A datagram longer than the MTU is dropped; otherwise it is lost with probability
    /// `loss`, else scheduled for `now + delay`. With probability `reorder` it is held back
    /// by an extra delay in `(0, jitter]` (or `(0, 4 × delay]` without jitter); with
    /// probability `duplicate` a second copy follows it, up to one `delay` later; each
    /// copy has one to three bits flipped with probability `corrupt`.
    pub fn send(&mut self, now: Duration, from: SocketAddr, to: SocketAddr, datagram: Vec<u8>) {
        self.send_tos(now, from, to, 0, datagram);
    }

    /// [`Self::send`] with an IP TOS byte, which the receiver sees (a bottleneck may mark
    /// its ECN bits Congestion Experienced on the way).
    pub fn send_tos(&mut self, now: Duration, from: SocketAddr, to: SocketAddr, tos: u8, datagram: Vec<u8>) {
        self.stats.sent += 1;
        if datagram.len() > self.imp.mtu {
            self.stats.oversize += 1;
            return;
        }
        if self.rng.chance(self.imp.loss) {
            self.stats.lost += 1;
            return;
        }
        let mut tos = tos;
        let mut at = now;
        if let Some(b) = self.imp.bottleneck {
            let Some(done) = self.enqueue(now, to, &b, datagram.len(), &mut tos) else {
                self.stats.queue_drops += 1;
                return;
            };
            at = done;
        }
        let mut at = at.saturating_add(self.imp.delay);
        if self.rng.chance(self.imp.reorder) {
            let max =
                if self.imp.jitter.is_zero() { self.imp.delay.saturating_mul(4) } else { self.imp.jitter };
            at = at.saturating_add(self.random_up_to(max));
            self.stats.reordered += 1;
        }
        let duplicate_at = if self.rng.chance(self.imp.duplicate) {
            Some(at.saturating_add(self.random_up_to(self.imp.delay)))
        } else {
            None
        };
        let datagram = Datagram { from, to, bytes: datagram, tos };
        if let Some(dup_at) = duplicate_at {
            self.stats.duplicated += 1;
            self.schedule(at, datagram.clone());
            self.schedule(dup_at, datagram);
        } else {
            self.schedule(at, datagram);
        }
    }

    /// Queues a datagram of `len` bytes on the link to `to`: returns when it has left the
    /// link, or `None` if the queue is full; marks `tos` CE past the marking threshold.
    fn enqueue(
        &mut self,
        now: Duration,
        to: SocketAddr,
        b: &Bottleneck,
        len: usize,
        tos: &mut u8,
    ) -> Option<Duration> {
        let rate = u128::from(b.rate_bps.max(1));
        let free = self.links.get(&to).copied().unwrap_or(Duration::ZERO).max(now);
        let wait = free - now;
        let queued = usize::try_from(wait.as_nanos() * rate / 8_000_000_000).unwrap_or(usize::MAX);
        let wire = len + LINK_OVERHEAD;
        if queued.saturating_add(wire) > b.buffer {
            return None;
        }
        if b.ecn_threshold.is_some_and(|t| queued > t) && *tos & 3 != 0 {
            *tos |= 3;
            self.stats.ce_marked += 1;
        }
        let tx_ns = (wire as u128 * 8_000_000_000).div_ceil(rate);
        let done = free.saturating_add(Duration::from_nanos(u64::try_from(tx_ns).unwrap_or(u64::MAX)));
        self.links.insert(to, done);
        self.queue_waits.push(u32::try_from(wait.as_nanos()).unwrap_or(u32::MAX));
        Some(done)
    }

    /// The `q`-quantile (`0.0..=1.0`) of the time datagrams waited in bottleneck queues, if
    /// any passed one (waits beyond about 4.3 s count as 4.3 s).
    pub fn queue_wait_quantile(&self, q: f64) -> Option<Duration> {
        if self.queue_waits.is_empty() {
            return None;
        }
        let mut w = self.queue_waits.clone();
        let k = ((w.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        let (_, x, _) = w.select_nth_unstable(k);
        Some(Duration::from_nanos(u64::from(*x)))
    }

    /// Forgets the queue waits recorded so far, so that [`Self::queue_wait_quantile`]
    /// describes only what follows (a steady state after a start-up, say).
    pub fn clear_queue_waits(&mut self) {
        self.queue_waits.clear();
    }

    /// A random duration in `(0, max]`, at nanosecond resolution; 1 ns when `max` is zero.
    fn random_up_to(&mut self, max: Duration) -> Duration {
        let max_ns = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX).max(1);
        Duration::from_nanos(1 + self.rng.below(max_ns))
    }

    /// Queues one copy for delivery at `at`, corrupting it with probability `corrupt`.
    fn schedule(&mut self, at: Duration, mut datagram: Datagram) {
        if self.rng.chance(self.imp.corrupt) && !datagram.bytes.is_empty() {
            let bits = datagram.bytes.len() as u64 * 8;
            let flips = 1 + self.rng.below(3);
            let mut flipped = Vec::with_capacity(3);
            while (flipped.len() as u64) < flips.min(bits) {
                let bit = self.rng.below(bits);
                // Distinct bits, so that two flips never cancel out.
                if !flipped.contains(&bit) {
                    flipped.push(bit);
                    datagram.bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
                }
            }
            self.stats.corrupted += 1;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push(InFlight { at, seq, datagram });
    }

    /// The next datagram due at or before `now`: the earliest first, ties in the order they
    /// were scheduled.
    pub fn poll(&mut self, now: Duration) -> Option<Datagram> {
        if self.queue.peek()?.at > now {
            return None;
        }
        let next = self.queue.pop()?;
        self.stats.delivered += 1;
        Some(next.datagram)
    }

    /// When the next datagram is due, if any is in flight.
    pub fn next_delivery(&self) -> Option<Duration> {
        self.queue.peek().map(|d| d.at)
    }

    /// Whether no datagram is in flight.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty()
    }

    /// Datagrams in flight, duplicates included.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }

    /// What the network has done so far.
    pub fn stats(&self) -> NetStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    fn payload(i: u32) -> Vec<u8> {
        let mut v = i.to_be_bytes().to_vec();
        v.extend_from_slice(&[0x5A; 60]);
        v
    }

    /// Sends `n` numbered datagrams 1 µs apart, then drains the network; returns each
    /// delivery with its time.
    fn run(net: &mut Network, n: u32) -> Vec<(Duration, Datagram)> {
        for i in 0..n {
            net.send(Duration::from_micros(u64::from(i)), addr(1), addr(2), payload(i));
        }
        let mut out = Vec::new();
        while let Some(t) = net.next_delivery() {
            while let Some(d) = net.poll(t) {
                out.push((t, d));
            }
        }
        out
    }

    fn seq_of(d: &Datagram) -> u32 {
        u32::from_be_bytes(d.bytes[..4].try_into().unwrap())
    }

    #[test]
    fn perfect_network_delivers_everything_once_in_order() {
        let mut net = Network::new(1, Impairments::default());
        assert!(net.is_idle());
        net.send(Duration::ZERO, addr(1), addr(2), vec![1]);
        net.send(Duration::ZERO, addr(2), addr(1), vec![2]);
        assert_eq!(net.next_delivery(), Some(Duration::from_micros(10)));
        assert_eq!(net.poll(Duration::from_micros(9)), None);
        let a = net.poll(Duration::from_micros(10)).unwrap();
        assert_eq!(a, Datagram { from: addr(1), to: addr(2), bytes: vec![1], tos: 0 });
        assert_eq!(net.poll(Duration::from_micros(10)).unwrap().bytes, [2]);
        assert!(net.is_idle());

        let out = run(&mut net, 100);
        assert_eq!(out.len(), 100);
        for (i, (t, d)) in out.iter().enumerate() {
            assert_eq!(seq_of(d), i as u32);
            assert_eq!(*d, Datagram { from: addr(1), to: addr(2), bytes: payload(i as u32), tos: 0 });
            assert_eq!(*t, Duration::from_micros(i as u64 + 10));
        }
        let s = net.stats();
        assert_eq!(s, NetStats { sent: 102, delivered: 102, ..NetStats::default() });
        assert_eq!(s.to_string(), "sent=102 delivered=102 lost=0 dup=0 reordered=0 corrupted=0 oversize=0");
    }

    #[test]
    fn total_loss_delivers_nothing() {
        let imp = Impairments { loss: 1.0, ..Impairments::default() };
        let mut net = Network::new(3, imp);
        assert!(run(&mut net, 50).is_empty());
        assert_eq!(net.stats().lost, 50);
        assert!(net.is_idle());
    }

    #[test]
    fn oversize_is_dropped() {
        let mut net = Network::new(3, Impairments { mtu: 64, ..Impairments::default() });
        net.send(Duration::ZERO, addr(1), addr(2), vec![0; 65]);
        net.send(Duration::ZERO, addr(1), addr(2), vec![0; 64]);
        assert_eq!(net.in_flight(), 1);
        assert_eq!(net.stats().oversize, 1);
    }

    #[test]
    fn counters_add_up_and_runs_replay() {
        let imp = Impairments {
            jitter: Duration::from_micros(30),
            ..Impairments::from_percent(10.0, 10.0, 20.0, 5.0)
        };
        let mut net = Network::new(0xC0FFEE, imp);
        let out = run(&mut net, 2000);
        let s = net.stats();
        assert_eq!(s.delivered, out.len() as u64);
        assert_eq!(s.delivered, s.sent - s.lost - s.oversize + s.duplicated);
        for (count, expected) in [(s.lost, 200), (s.duplicated, 180), (s.reordered, 360), (s.corrupted, 90)] {
            assert!(count > expected / 2 && count < expected * 2, "{s}");
        }
        // Times never go backwards.
        assert!(out.windows(2).all(|w| w[0].0 <= w[1].0));

        let mut again = Network::new(0xC0FFEE, imp);
        assert_eq!(run(&mut again, 2000), out);
        assert_eq!(again.stats(), s);
        let mut other = Network::new(0xC0FFEF, imp);
        assert_ne!(run(&mut other, 2000), out);
    }

    #[test]
    fn reordering_reorders() {
        let mut net = Network::new(5, Impairments::from_percent(0.0, 0.0, 30.0, 0.0));
        let out = run(&mut net, 200);
        assert_eq!(out.len(), 200);
        let order: Vec<u32> = out.iter().map(|(_, d)| seq_of(d)).collect();
        let inversions = order.windows(2).filter(|w| w[0] > w[1]).count();
        assert!(inversions > 10, "{order:?}");
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..200).collect::<Vec<_>>());
        // Reordered datagrams are late by at most 4 × delay without jitter.
        for (t, d) in &out {
            let sent = Duration::from_micros(u64::from(seq_of(d)));
            assert!(*t >= sent + Duration::from_micros(10) && *t <= sent + Duration::from_micros(50));
        }
    }

    #[test]
    fn duplicates_follow_the_original() {
        let mut net = Network::new(5, Impairments::from_percent(0.0, 100.0, 0.0, 0.0));
        let out = run(&mut net, 20);
        assert_eq!(out.len(), 40);
        for i in 0..20 {
            let copies: Vec<_> = out.iter().filter(|(_, d)| seq_of(d) == i).collect();
            assert_eq!(copies.len(), 2);
            assert_eq!(copies[0].1, copies[1].1);
        }
        assert_eq!(net.stats().duplicated, 20);
    }

    #[test]
    fn corruption_flips_one_to_three_bits() {
        let mut net = Network::new(11, Impairments::from_percent(0.0, 0.0, 0.0, 100.0));
        let out = run(&mut net, 200);
        assert_eq!(out.len(), 200);
        let mut seen = [false; 4];
        for (t, d) in &out {
            // Without reordering, the delivery time tells which datagram this was.
            let original = payload((t.as_micros() - 10) as u32);
            let flips: u32 = d.bytes.iter().zip(original).map(|(a, b)| (a ^ b).count_ones()).sum();
            assert!((1..=3).contains(&flips), "{flips}");
            seen[flips as usize] = true;
        }
        assert_eq!(seen, [false, true, true, true]);
        assert_eq!(net.stats().corrupted, 200);
        // Empty datagrams pass through untouched.
        net.send(Duration::ZERO, addr(1), addr(2), Vec::new());
        assert_eq!(net.poll(Duration::from_secs(1)).unwrap().bytes, []);
    }

    #[test]
    fn a_bottleneck_paces_queues_drops_and_marks() {
        // 8 Mbit/s: a 58-byte datagram (16 + 42 bytes on the wire) takes 58 µs.
        let b = Bottleneck { rate_bps: 8_000_000, buffer: 4 * 58, ecn_threshold: Some(58) };
        let mut net = Network::new(1, Impairments { bottleneck: Some(b), ..Impairments::default() });
        for i in 0..6u8 {
            net.send_tos(Duration::ZERO, addr(1), addr(2), 0x02, vec![i; 16]);
        }
        // A datagram to another address has a link of its own; one without ECT is not marked.
        net.send_tos(Duration::ZERO, addr(1), addr(3), 0x00, vec![9; 16]);
        net.send_tos(Duration::ZERO, addr(1), addr(3), 0x00, vec![9; 16]);
        let mut out = Vec::new();
        while let Some(t) = net.next_delivery() {
            while let Some(d) = net.poll(t) {
                out.push((t.as_micros(), d.to, d.bytes[0], d.tos));
            }
        }
        let us = |k: u128| 58 * k + 10;
        assert_eq!(
            out,
            vec![
                (us(1), addr(2), 0, 0x02),
                (us(1), addr(3), 9, 0x00),
                (us(2), addr(2), 1, 0x02),
                (us(2), addr(3), 9, 0x00),
                (us(3), addr(2), 2, 0x03),
                (us(4), addr(2), 3, 0x03),
            ],
            "paced at the link rate; CE past one datagram queued; the 5th and 6th dropped"
        );
        let s = net.stats();
        assert_eq!((s.queue_drops, s.ce_marked, s.delivered), (2, 2, 6));
        assert_eq!(s.delivered, s.sent - s.lost - s.oversize - s.queue_drops + s.duplicated);
        assert!(s.to_string().ends_with("queue_drops=2 ce_marked=2"), "{s}");
        assert_eq!(net.queue_wait_quantile(0.0), Some(Duration::ZERO));
        assert_eq!(net.queue_wait_quantile(1.0), Some(Duration::from_micros(3 * 58)));
        // A later datagram finds the queue drained.
        net.send_tos(Duration::from_secs(1), addr(1), addr(2), 0x02, vec![7; 16]);
        assert_eq!(net.next_delivery(), Some(Duration::from_secs(1) + Duration::from_micros(us(1) as u64)));
    }

    #[test]
    fn extreme_times_do_not_panic() {
        let imp = Impairments { delay: Duration::MAX, ..Impairments::from_percent(0.0, 100.0, 100.0, 0.0) };
        let mut net = Network::new(1, imp);
        net.send(Duration::MAX, addr(1), addr(2), vec![1]);
        assert_eq!(net.next_delivery(), Some(Duration::MAX));
        assert!(net.poll(Duration::MAX).is_some());
        assert!(net.poll(Duration::MAX).is_some());
        assert!(net.is_idle());
    }
}
