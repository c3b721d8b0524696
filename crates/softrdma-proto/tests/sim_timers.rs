//! QP timers with few QPs on an endpoint (each QP asked for its deadline), with many (a
//! heap of deadlines), and across the switch between the two, both ways, while timers
//! are armed: only a timer can resend what a network that dropped everything lost.

use std::time::Duration;

use softrdma_proto::memory::{Access, PdId};
use softrdma_proto::qp::{QpType, SendFlags, SendOp, SendWr, Sge, WcStatus};
use softrdma_proto::sim::{ConnectParams, Impairments, Sim};
use softrdma_proto::{Lkey, Qpn, Rkey};

const BASE: u64 = 0x100_0000;

struct Net {
    sim: Sim,
    pairs: Vec<(Qpn, Qpn)>,
    a: Lkey,
    b: Rkey,
}

impl Net {
    fn connect(&mut self, n: usize) {
        for _ in 0..n {
            let p = self.sim.connect(0, 1, QpType::Rc, ConnectParams::default());
            self.pairs.push(p);
        }
    }

    /// Drops every datagram, posts one WRITE on each pair, lets `dark` of virtual time pass
    /// (probes go out and are lost too), runs `meanwhile`, restores the network and waits
    /// for every WRITE to complete on the pairs that still exist. Returns the probes
    /// their requesters sent.
    fn writes_through_an_outage(&mut self, dark: Duration, meanwhile: impl FnOnce(&mut Net)) -> u64 {
        self.sim.net.set_impairments(Impairments { loss: 1.0, ..Impairments::default() });
        let posted = self.pairs.clone();
        for (i, &(qa, _)) in posted.iter().enumerate() {
            let wr = SendWr {
                wr_id: i as u64,
                op: SendOp::Write { remote_addr: BASE + 64 * i as u64, rkey: self.b },
                sg_list: softrdma_proto::sgl![Sge { addr: BASE, length: 64, lkey: self.a }],
                flags: SendFlags { signaled: true, ..SendFlags::default() },
                ud: None,
            };
            let node = &mut self.sim.nodes[0];
            node.endpoint.qp_mut(qa).unwrap().post_send(wr, &node.mem).unwrap();
        }
        let wall = std::time::Instant::now();
        // A timer due but never run stops virtual time: fail instead of spinning.
        let stuck = move |sim: &Sim| {
            assert!(wall.elapsed() < Duration::from_secs(30), "virtual time stuck at {:?}", sim.now)
        };
        self.sim.run_until(dark, |sim| {
            stuck(sim);
            false
        });
        meanwhile(self);
        self.sim.net.set_impairments(Impairments::default());
        let pairs: Vec<(Qpn, Qpn)> = posted.into_iter().filter(|p| self.pairs.contains(p)).collect();
        let mut done = vec![false; pairs.len()];
        // Completions are taken as the engine takes them, from the QPs that may have some
        // (`qp_mut` would mark every QP touched and re-arm its timer, hiding a lost one).
        let all = self.sim.run_until(Duration::from_secs(10), |sim| {
            stuck(sim);
            sim.nodes[0].endpoint.poll_completions(|qp| {
                while let Some(wc) = qp.poll_send_completion() {
                    let k = pairs.iter().position(|&(qa, _)| qa == qp.qpn()).expect("a pair's QP");
                    assert_eq!(wc.status, WcStatus::Success, "pair {k}");
                    done[k] = true;
                }
            });
            done.iter().all(|&d| d)
        });
        let left: Vec<usize> = (0..done.len()).filter(|&k| !done[k]).collect();
        assert!(all, "WRITEs never completed on pairs {left:?} of {}", pairs.len());
        pairs.iter().map(|&(qa, _)| self.sim.nodes[0].endpoint.qp(qa).unwrap().stats().probes).sum()
    }
}

#[test]
fn timers_fire_with_few_qps_with_many_and_across_the_switch() {
    let mut sim = Sim::new(11, Impairments::default(), 2);
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let (a, _) = sim.nodes[0].mem.register(PdId(1), BASE, 4096, access).unwrap();
    let (_, b) = sim.nodes[1].mem.register(PdId(1), BASE, 4096, access).unwrap();
    let mut net = Net { sim, pairs: Vec::new(), a, b };
    let dark = Duration::from_millis(3);
    let mut probes = 0;

    // Few QPs.
    net.connect(2);
    let p = net.writes_through_an_outage(dark, |_| {});
    assert!(p > probes, "no probe with 2 QPs");
    probes = p;

    // Many: a heap.
    net.connect(10);
    let p = net.writes_through_an_outage(dark, |_| {});
    assert!(p > probes, "no probe with 12 QPs");

    // Many to few while every requester waits on its timer: 3 pairs stay, and their
    // deadlines must survive the heap's end.
    let p = net.writes_through_an_outage(dark, |net| {
        for (qa, qb) in net.pairs.drain(3..) {
            net.sim.nodes[0].endpoint.destroy_qp(qa).unwrap();
            net.sim.nodes[1].endpoint.destroy_qp(qb).unwrap();
        }
    });
    assert!(p > 0, "no probe after the switch to few");

    // Few to many while they wait: their deadlines must enter the new heap.
    let p = net.writes_through_an_outage(dark, |net| net.connect(9));
    assert!(p > 0, "no probe after the switch to many");
}
