//! The CM state machines of two agents over the simulator's network: handshakes,
//! disconnection and SIDR, clean and under loss, duplication and reordering of MADs;
//! refusals, a vanished peer, strays, garbage and a flood of forged REQs.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use softrdma_proto::cm::{
    service_id, CmAgent, CmConfig, CmEvent, CmMad, CmMsg, CmPath, Ids, IdsAndData, MsgKind, PortSpace, Rej,
    Rep, Req, MAX_UNCLAIMED,
};
use softrdma_proto::sim::{Impairments, Network};

const A: [u8; 4] = [10, 0, 0, 1];
const B: [u8; 4] = [10, 0, 0, 2];

fn ip(a: [u8; 4]) -> IpAddr {
    IpAddr::from(a)
}

fn sock(a: IpAddr) -> SocketAddr {
    SocketAddr::new(a, 4791)
}

fn sid() -> u64 {
    service_id(PortSpace::Tcp, 7174)
}

fn req(qpn: u32, private: &[u8]) -> Req {
    Req {
        local_comm_id: 0,
        ece_vendor_id: 0,
        service_id: sid(),
        local_ca_guid: 0,
        local_qkey: 0,
        local_qpn: qpn,
        responder_resources: 4,
        initiator_depth: 4,
        remote_cm_response_timeout: 0,
        transport_type: 0,
        e2e_flow_control: false,
        starting_psn: 0x1234,
        local_cm_response_timeout: 0,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: 3,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 0,
        srq: false,
        extended_transport_type: 0,
        primary_path: CmPath::default(),
        alternate_path: None,
        private_data: private.to_vec(),
    }
}

fn rep(qpn: u32, private: &[u8]) -> Rep {
    Rep {
        local_comm_id: 0,
        remote_comm_id: 0,
        local_qkey: 0,
        local_qpn: qpn,
        local_eecn: 0,
        starting_psn: 0x5678,
        ece_vendor_id: 0,
        responder_resources: 4,
        initiator_depth: 4,
        target_ack_delay: 15,
        failover_accepted: 0,
        e2e_flow_control: false,
        rnr_retry_count: 7,
        srq: false,
        local_ca_guid: 0,
        private_data: private.to_vec(),
    }
}

/// What the consumer of each side does with events.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Consumer {
    /// Accepts every request, sends the RTU after every REP, answers every SIDR_REQ.
    Auto,
    /// Rejects every request with reason 28 and private data "no".
    Reject,
    /// Does nothing.
    Idle,
}

struct World {
    net: Network,
    agents: [CmAgent; 2],
    addrs: [IpAddr; 2],
    consumers: [Consumer; 2],
    events: [Vec<CmEvent>; 2],
    now: Duration,
    /// The largest number of connections side 1 held at once.
    peak_b: usize,
}

impl World {
    fn new(seed: u64, imp: Impairments) -> World {
        let cfg = |s: u64| CmConfig {
            seed: s,
            ca_guid: s,
            timewait: Duration::from_millis(500),
            ..Default::default()
        };
        World {
            net: Network::new(seed, imp),
            agents: [CmAgent::new(cfg(seed ^ 1)), CmAgent::new(cfg(seed ^ 2))],
            addrs: [ip(A), ip(B)],
            consumers: [Consumer::Auto, Consumer::Auto],
            events: [Vec::new(), Vec::new()],
            now: Duration::ZERO,
            peak_b: 0,
        }
    }

    fn flush(&mut self) {
        for i in 0..2 {
            while let Some((peer, mad)) = self.agents[i].poll_transmit() {
                self.net.send(self.now, sock(self.addrs[i]), sock(peer), mad.to_vec());
            }
        }
    }

    fn consume(&mut self) -> bool {
        let mut any = false;
        for i in 0..2 {
            while let Some(ev) = self.agents[i].poll_event() {
                any = true;
                let now = self.now;
                let agent = &mut self.agents[i];
                match (&ev, self.consumers[i]) {
                    (CmEvent::ConnectRequest { id, .. }, Consumer::Auto) => {
                        agent.accept(now, *id, rep(0x200 + *id % 100, b"rep data")).unwrap()
                    }
                    (CmEvent::ConnectRequest { id, .. }, Consumer::Reject) => {
                        agent.reject(*id, 28, b"no").unwrap()
                    }
                    (CmEvent::ConnectResponse { id, .. }, Consumer::Auto) => agent.rtu(*id, b"").unwrap(),
                    (CmEvent::SidrRequest { id, .. }, Consumer::Auto) => {
                        agent.sidr_reply(*id, 0, 0x77, 0x0123_4567, b"").unwrap()
                    }
                    _ => {}
                }
                self.events[i].push(ev);
            }
        }
        any
    }

    /// Runs until nothing is left to do or `limit` of virtual time passes.
    fn run(&mut self, limit: Duration) {
        let end = self.now + limit;
        loop {
            self.flush();
            if self.consume() {
                continue;
            }
            let mut delivered = false;
            while let Some(d) = self.net.poll(self.now) {
                // Datagrams to other addresses (forged peers) go nowhere.
                if let Some(i) = self.addrs.iter().position(|&a| a == d.to.ip()) {
                    self.agents[i].handle_mad(self.now, d.from.ip(), &d.bytes);
                }
                delivered = true;
            }
            self.peak_b = self.peak_b.max(self.agents[1].len());
            if delivered {
                continue;
            }
            let next =
                [self.net.next_delivery(), self.agents[0].poll_timeout(), self.agents[1].poll_timeout()]
                    .into_iter()
                    .flatten()
                    .min();
            match next {
                Some(t) if t <= end => {
                    self.now = self.now.max(t);
                    for a in &mut self.agents {
                        a.handle_timeout(self.now);
                    }
                }
                _ => return,
            }
        }
    }

    fn count(&self, side: usize, pred: impl Fn(&CmEvent) -> bool) -> usize {
        self.events[side].iter().filter(|e| pred(e)).count()
    }
}

fn established(e: &CmEvent) -> bool {
    matches!(e, CmEvent::Established { .. })
}
fn disconnected(e: &CmEvent) -> bool {
    matches!(e, CmEvent::Disconnected { .. })
}

/// Connects A to B, then disconnects from A; returns the world after everything settled.
fn handshake_and_close(seed: u64, imp: Impairments) -> World {
    let mut w = World::new(seed, imp);
    w.agents[1].listen(sid(), 16).unwrap();
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"hello")).unwrap();
    w.run(Duration::from_secs(120));
    assert_eq!(w.count(0, established), 1, "seed {seed}: A established once: {:?}", w.events[0]);
    assert_eq!(w.count(1, established), 1, "seed {seed}: B established once: {:?}", w.events[1]);
    // Exactly one connection on B, and the two sides name each other.
    let b_id = match w.events[1].iter().find(|e| matches!(e, CmEvent::ConnectRequest { .. })) {
        Some(CmEvent::ConnectRequest { id, peer, req }) => {
            assert_eq!(*peer, ip(A));
            assert_eq!(req.local_qpn, 0x11);
            assert_eq!(&req.private_data[..5], b"hello");
            *id
        }
        _ => unreachable!(),
    };
    assert_eq!(w.count(1, |e| matches!(e, CmEvent::ConnectRequest { .. })), 1, "seed {seed}: one request");
    assert_eq!(w.agents[0].remote_id(id), Some(b_id));
    assert_eq!(w.agents[1].remote_id(b_id), Some(id));
    match w.events[0].iter().find(|e| matches!(e, CmEvent::ConnectResponse { .. })) {
        Some(CmEvent::ConnectResponse { rep, .. }) => {
            assert_eq!(rep.starting_psn, 0x5678);
            assert_eq!(&rep.private_data[..8], b"rep data");
        }
        _ => panic!("seed {seed}: no REP"),
    }
    w.agents[0].disconnect(w.now, id, b"bye").unwrap();
    w.run(Duration::from_secs(120));
    assert_eq!(w.count(0, disconnected), 1, "seed {seed}: A disconnected once: {:?}", w.events[0]);
    assert_eq!(w.count(1, disconnected), 1, "seed {seed}: B disconnected once: {:?}", w.events[1]);
    for side in 0..2 {
        assert_eq!(w.count(side, |e| matches!(e, CmEvent::TimewaitExit { .. })), 1, "seed {seed}");
        assert!(w.agents[side].is_empty(), "seed {seed}: side {side} keeps state");
    }
    w
}

#[test]
fn clean_handshake_and_disconnect() {
    let w = handshake_and_close(1, Impairments::default());
    assert_eq!(w.agents[0].stats().retransmits + w.agents[1].stats().retransmits, 0);
    // REQ, REP, RTU, DREQ, DREP.
    assert_eq!(w.net.stats().sent, 5);
}

#[test]
fn handshake_and_disconnect_exactly_once_under_loss_duplication_and_reordering() {
    let imp =
        Impairments { delay: Duration::from_millis(1), ..Impairments::from_percent(25.0, 20.0, 20.0, 0.0) };
    let mut retransmits = 0;
    let mut duplicates = 0;
    for seed in 0..300 {
        let w = handshake_and_close(seed, imp);
        retransmits += w.agents[0].stats().retransmits + w.agents[1].stats().retransmits;
        duplicates += w.agents[0].stats().duplicates + w.agents[1].stats().duplicates;
    }
    // The impairments were exercised: retries and duplicate answers happened.
    assert!(retransmits > 100, "{retransmits} retransmits");
    assert!(duplicates > 100, "{duplicates} duplicates");
}

#[test]
fn a_request_nobody_listens_for_is_rejected_with_invalid_service_id() {
    let mut w = World::new(3, Impairments::default());
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"")).unwrap();
    // Not before the listen grace: a listener may still come.
    let grace = CmConfig::default().listen_grace;
    w.run(grace - Duration::from_millis(1));
    assert_eq!(w.events[0], vec![]);
    w.run(Duration::from_secs(10));
    assert_eq!(w.events[0], vec![CmEvent::Rejected { id, reason: 8, private_data: vec![0; 148] }]);
    assert!(w.agents[0].is_empty() && w.agents[1].is_empty());
    assert!(w.now < grace + Duration::from_millis(1), "refused at the grace's end: {:?}", w.now);
}

#[test]
fn a_request_that_comes_just_before_its_listener_is_taken() {
    // A server that listens anew a moment after the client's REQ came (perftest -R
    // between its two connections) gets the request, and nothing is refused.
    let mut w = World::new(4, Impairments::default());
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"early")).unwrap();
    let ud = service_id(PortSpace::Udp, 7174);
    let sidr = w.agents[0].sidr_request(w.now, ip(B), ud, b"").unwrap();
    w.run(Duration::from_millis(200));
    assert_eq!(w.events[1], vec![], "nothing for B's consumer before it listens");
    w.agents[1].listen(sid(), 16).unwrap();
    w.agents[1].listen(ud, 16).unwrap();
    w.run(Duration::from_secs(10));
    assert!(w.events[0].contains(&CmEvent::Established { id }), "{:?}", w.events[0]);
    assert!(
        w.events[0]
            .iter()
            .any(|e| matches!(e, CmEvent::SidrResponse { id, rep } if *id == sidr && rep.status == 0)),
        "{:?}",
        w.events[0]
    );
    assert!(!w.events[0].iter().any(|e| matches!(e, CmEvent::Rejected { .. })), "{:?}", w.events[0]);
    assert_eq!(w.count(1, |e| matches!(e, CmEvent::ConnectRequest { .. })), 1);
}

#[test]
fn a_request_refused_at_once_for_want_of_a_listener_goes_again_within_the_grace() {
    // A peer that refuses a REQ for an unknown service at once (Linux's CM; here an agent
    // without a listen grace): the active side sends it again within its own grace, and
    // a listener that comes 200 ms late still gets the connection; after the grace, the
    // refusal is final.
    let mut w = World::new(8, Impairments::default());
    w.agents[1] =
        CmAgent::new(CmConfig { seed: 9, ca_guid: 9, listen_grace: Duration::ZERO, ..Default::default() });
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"late")).unwrap();
    w.run(Duration::from_millis(200));
    assert_eq!(w.events[0], vec![], "no refusal reaches the consumer within the grace");
    let retries = w.agents[0].stats().unlistened_retries;
    assert!((2..=5).contains(&retries), "{retries} REQs sent again in 200 ms");
    w.agents[1].listen(sid(), 16).unwrap();
    w.run(Duration::from_secs(5));
    assert!(w.events[0].contains(&CmEvent::Established { id }), "{:?}", w.events[0]);
    assert_eq!(w.count(1, |e| matches!(e, CmEvent::ConnectRequest { .. })), 1);

    let mut w = World::new(10, Impairments::default());
    w.agents[1] =
        CmAgent::new(CmConfig { seed: 11, ca_guid: 11, listen_grace: Duration::ZERO, ..Default::default() });
    let start = w.now;
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"")).unwrap();
    w.run(Duration::from_secs(5));
    assert_eq!(w.events[0], vec![CmEvent::Rejected { id, reason: 8, private_data: vec![0; 148] }]);
    let grace = CmConfig::default().listen_grace;
    assert!(w.now - start < grace + Duration::from_millis(50), "refused at the grace's end: {:?}", w.now);
    assert!(w.agents[0].is_empty());

    // Two refusals before the resend (a duplicate, say): it goes once, and the REQ's own
    // retries stay as they were.
    let mut w = World::new(16, Impairments::default());
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"")).unwrap();
    let local = id;
    let rej = Rej {
        ids: Ids { local_comm_id: 0, remote_comm_id: local },
        rejected: MsgKind::Req,
        ari_length: 0,
        reason: 8,
        ari: Vec::new(),
        private_data: Vec::new(),
    };
    for _ in 0..2 {
        w.agents[0].handle_mad(w.now, ip(B), &CmMad::new(1, CmMsg::Rej(rej.clone())).emit());
    }
    assert_eq!(w.agents[0].stats().unlistened_retries, 1);
    let sent = |w: &mut World| std::iter::from_fn(|| w.agents[0].poll_transmit()).count();
    sent(&mut w);
    w.now += Duration::from_millis(60);
    w.agents[0].handle_timeout(w.now);
    assert_eq!(sent(&mut w), 1, "one resend");
    assert_eq!(w.agents[0].stats().retransmits, 0, "no retry spent");

    // A grace longer than the REQ's retries (15, one every 50 ms): the resends spend none
    // of them, and a listener 3 s late still gets the connection.
    let mut w = World::new(12, Impairments::default());
    w.agents[0] = CmAgent::new(CmConfig {
        seed: 13,
        ca_guid: 13,
        listen_grace: Duration::from_secs(10),
        ..Default::default()
    });
    w.agents[1] =
        CmAgent::new(CmConfig { seed: 14, ca_guid: 14, listen_grace: Duration::ZERO, ..Default::default() });
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"")).unwrap();
    w.run(Duration::from_secs(3));
    assert_eq!(w.events[0], vec![]);
    assert!(w.agents[0].stats().unlistened_retries > 50, "{:?}", w.agents[0].stats());
    w.agents[1].listen(sid(), 16).unwrap();
    w.run(Duration::from_secs(5));
    assert!(w.events[0].contains(&CmEvent::Established { id }), "{:?}", w.events[0]);
}

#[test]
fn a_request_its_peer_gave_up_on_is_not_handed_to_a_late_listener() {
    let mut w = World::new(6, Impairments::default());
    let mut r = req(0x40, b"");
    r.local_comm_id = 77;
    w.agents[1].handle_mad(w.now, ip(A), &CmMad::new(7, CmMsg::Req(r)).emit());
    assert!(w.agents[1].poll_timeout().is_some(), "the REQ waits for a listener");
    // The peer gives up (its REJ names no ID of ours: we never answered).
    let rej = Rej {
        ids: Ids { local_comm_id: 77, remote_comm_id: 0 },
        rejected: MsgKind::Req,
        ari_length: 0,
        reason: 1,
        ari: Vec::new(),
        private_data: Vec::new(),
    };
    w.agents[1].handle_mad(w.now, ip(A), &CmMad::new(8, CmMsg::Rej(rej)).emit());
    w.agents[1].listen(sid(), 8).unwrap();
    assert_eq!(w.agents[1].poll_event(), None, "no request for a connection already abandoned");
    assert_eq!(w.agents[1].poll_timeout(), None);
}

#[test]
fn requests_for_unknown_services_wait_in_a_bounded_queue() {
    // Forged REQs for a service nobody listens on: at most MAX_UNCLAIMED wait, the rest
    // are refused at once, and when the grace ends every one has been refused.
    let mut w = World::new(5, Impairments::default());
    let unknown = service_id(PortSpace::Tcp, 9);
    let n = MAX_UNCLAIMED as u32 + 36;
    for k in 0..n {
        let mut r = req(0x40, b"");
        r.service_id = unknown;
        r.local_comm_id = k + 1;
        w.agents[1].handle_mad(w.now, ip(A), &CmMad::new(7, CmMsg::Req(r)).emit());
    }
    let answered = |w: &mut World| std::iter::from_fn(|| w.agents[1].poll_transmit()).count();
    assert_eq!(answered(&mut w), 36, "the requests past the bound are refused at once");
    w.now += CmConfig::default().listen_grace;
    w.agents[1].handle_timeout(w.now);
    assert_eq!(answered(&mut w), MAX_UNCLAIMED, "and the waiting ones at the grace's end");
    assert_eq!(w.agents[1].poll_timeout(), None);
}

#[test]
fn the_consumer_rejects_with_its_private_data() {
    let mut w = World::new(4, Impairments::default());
    w.consumers[1] = Consumer::Reject;
    w.agents[1].listen(sid(), 16).unwrap();
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"")).unwrap();
    w.run(Duration::from_secs(10));
    match &w.events[0][..] {
        [CmEvent::Rejected { id: got, reason: 28, private_data }] => {
            assert_eq!(*got, id);
            assert_eq!(&private_data[..2], b"no");
        }
        other => panic!("{other:?}"),
    }
    assert!(w.agents[0].is_empty() && w.agents[1].is_empty());
}

#[test]
fn a_vanished_peer_is_unreachable_after_the_retries_and_nothing_is_left() {
    let mut w = World::new(5, Impairments { loss: 1.0, ..Default::default() });
    w.agents[1].listen(sid(), 16).unwrap();
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"")).unwrap();
    w.run(Duration::from_secs(600));
    assert_eq!(w.events[0], vec![CmEvent::Unreachable { id }]);
    assert!(w.agents[0].is_empty());
    // 1 + 15 REQs, then the REJ "timeout", each about 1.07 s apart.
    assert_eq!(w.net.stats().sent, 17);
    let expect = softrdma_proto::cm::cm_timeout(18) * 16;
    assert!(w.now >= expect && w.now < expect + Duration::from_secs(1), "gave up after {:?}", w.now);
}

#[test]
fn a_passive_side_whose_rtu_never_comes_gives_up_and_frees_the_connection() {
    // B's REP and its retries are all lost; A's REQ went through.
    let mut w = World::new(6, Impairments::default());
    w.agents[1].listen(sid(), 16).unwrap();
    w.consumers[0] = Consumer::Idle;
    let _ = w.agents[0].connect(w.now, ip(B), req(0x11, b"")).unwrap();
    w.flush();
    // Deliver the REQ, then cut the network.
    w.run(Duration::from_millis(1));
    w.net.set_impairments(Impairments { loss: 1.0, ..Default::default() });
    w.run(Duration::from_secs(600));
    assert_eq!(w.count(1, |e| matches!(e, CmEvent::Unreachable { .. })), 1, "{:?}", w.events[1]);
    assert!(w.agents[1].is_empty());
}

#[test]
fn strays_and_garbage_create_no_state() {
    let mut w = World::new(7, Impairments::default());
    w.agents[1].listen(sid(), 16).unwrap();
    // A DREQ about a connection B never had: answered with a DREP, nothing kept.
    let dreq = CmMad::new(
        9,
        CmMsg::Dreq(softrdma_proto::cm::Dreq {
            ids: Ids { local_comm_id: 41, remote_comm_id: 42 },
            remote_qpn: 5,
            private_data: vec![],
        }),
    );
    w.agents[1].handle_mad(w.now, ip(A), &dreq.emit());
    let (to, mad) = w.agents[1].poll_transmit().expect("a DREP");
    assert_eq!(to, ip(A));
    match CmMad::parse(&mad).unwrap().msg {
        CmMsg::Drep(d) => assert_eq!((d.ids.local_comm_id, d.ids.remote_comm_id), (42, 41)),
        m => panic!("{m:?}"),
    }
    // An RTU, a REP and a REJ for nothing; a truncated MAD; garbage.
    let rtu = CmMad::new(
        1,
        CmMsg::Rtu(IdsAndData { ids: Ids { local_comm_id: 1, remote_comm_id: 2 }, private_data: vec![] }),
    );
    w.agents[1].handle_mad(w.now, ip(A), &rtu.emit());
    let mut r = rep(1, b"");
    r.remote_comm_id = 77;
    w.agents[1].handle_mad(w.now, ip(A), &CmMad::new(1, CmMsg::Rep(r)).emit());
    w.agents[1].handle_mad(w.now, ip(A), &rtu.emit()[..100]);
    w.agents[1].handle_mad(w.now, ip(A), &[0xAB; 256]);
    assert!(w.agents[1].is_empty());
    assert_eq!(w.agents[1].stats().malformed, 2);
    // The stray REP got a REJ "invalid comm ID", so its sender forgets it.
    let rejs: Vec<_> = std::iter::from_fn(|| w.agents[1].poll_transmit()).collect();
    assert_eq!(rejs.len(), 1);
    match CmMad::parse(&rejs[0].1).unwrap().msg {
        CmMsg::Rej(r) => assert_eq!(r.reason, 6),
        m => panic!("{m:?}"),
    }
    assert!(w.agents[1].poll_event().is_none());
}

#[test]
fn a_req_of_another_class_version_gets_rej_31() {
    let mut w = World::new(8, Impairments::default());
    w.agents[1].listen(sid(), 16).unwrap();
    let mut mad = CmMad::new(5, CmMsg::Req(req(0x11, b""))).emit();
    mad[2] = 3;
    w.agents[1].handle_mad(w.now, ip(A), &mad);
    let (_, out) = w.agents[1].poll_transmit().unwrap();
    match CmMad::parse(&out).unwrap().msg {
        CmMsg::Rej(r) => assert_eq!(r.reason, 31),
        m => panic!("{m:?}"),
    }
    assert!(w.agents[1].is_empty());
}

#[test]
fn a_req_repeated_during_timewait_is_rejected_as_stale() {
    let mut w = World::new(9, Impairments::default());
    w.agents[1].listen(sid(), 16).unwrap();
    let id = w.agents[0].connect(w.now, ip(B), req(0x11, b"")).unwrap();
    w.run(Duration::from_millis(100));
    let b_id = w.agents[0].remote_id(id).unwrap();
    w.agents[1].disconnect(w.now, b_id, b"").unwrap();
    w.run(Duration::from_millis(100));
    // B is in TIMEWAIT; an old copy of A's REQ arrives.
    let mut old = req(0x11, b"");
    old.local_comm_id = id;
    w.agents[1].handle_mad(w.now, ip(A), &CmMad::new(1, CmMsg::Req(old)).emit());
    let (_, out) = w.agents[1].poll_transmit().unwrap();
    match CmMad::parse(&out).unwrap().msg {
        CmMsg::Rej(r) => assert_eq!(r.reason, 10),
        m => panic!("{m:?}"),
    }
    assert_eq!(w.count(1, |e| matches!(e, CmEvent::ConnectRequest { .. })), 1);
}

#[test]
fn sidr_resolves_a_ud_service_and_refuses_an_unknown_one() {
    let mut w = World::new(10, Impairments::from_percent(20.0, 10.0, 10.0, 0.0));
    let ud = service_id(PortSpace::Udp, 7174);
    w.agents[1].listen(ud, 16).unwrap();
    let id = w.agents[0].sidr_request(w.now, ip(B), ud, b"who").unwrap();
    let unknown = w.agents[0].sidr_request(w.now, ip(B), service_id(PortSpace::Udp, 9), b"").unwrap();
    w.run(Duration::from_secs(60));
    let rep_of = |want| {
        w.events[0].iter().find_map(|e| match e {
            CmEvent::SidrResponse { id, rep } if *id == want => Some(rep.clone()),
            _ => None,
        })
    };
    let r = rep_of(id).expect("answer");
    assert_eq!((r.status, r.qpn, r.qkey), (0, 0x77, 0x0123_4567));
    assert_eq!(rep_of(unknown).expect("refusal").status, 1);
    assert!(w.agents[0].is_empty());
}

#[test]
fn a_flood_of_forged_requests_stays_bounded_and_a_real_peer_gets_through() {
    let mut w = World::new(11, Impairments::default());
    let cfg = CmConfig { max_pending: 64, seed: 99, ..Default::default() };
    w.agents[1] = CmAgent::new(cfg);
    w.agents[1].listen(sid(), 1 << 20).unwrap();
    // 20,000 REQs from forged addresses (whose REPs go nowhere), 200 per millisecond,
    // with A's real REQ in the middle of them.
    let mut real = None;
    for burst in 0..100u32 {
        for k in 0..200u32 {
            let mut r = req(0x40, b"");
            r.local_comm_id = burst * 1000 + k + 1;
            let forged = IpAddr::from([192, 0, 2, (k % 250) as u8 + 1]);
            w.agents[1].handle_mad(w.now, forged, &CmMad::new(7, CmMsg::Req(r)).emit());
        }
        if burst == 50 {
            real = Some(w.agents[0].connect(w.now, ip(B), req(0x11, b"real")).unwrap());
        }
        w.run(Duration::from_millis(1));
        assert!(w.agents[1].len() <= 64 + 1, "burst {burst}: {} connections", w.agents[1].len());
    }
    w.run(Duration::from_secs(1));
    let real = real.unwrap();
    assert!(w.events[0].contains(&CmEvent::Established { id: real }), "{:?}", w.events[0]);
    assert!(w.peak_b <= 65, "peak {}", w.peak_b);
    // Every forged REQ beyond the bound was either refused at once (the consumer had not
    // seen it yet) or displaced an older forged one.
    let st = w.agents[1].stats();
    assert!(st.evicted > 1_000 && st.evicted + st.refused_full >= 20_000 - 64, "{st:?}");
}

// ---- The CM on QP1 of two endpoints: real packets, ICRC, P_Key, Q_Key ----------------

mod gsi {
    use super::*;
    use softrdma_proto::endpoint::{Arrival, Endpoint};
    use softrdma_proto::qp::Transmit;
    use softrdma_proto::sim::SimMemory;
    use softrdma_proto::wire::{icrc, BthRepr, DethRepr, Opcode, Operation, PacketRepr, Transport};
    use softrdma_proto::{Psn, Qkey, Qpn};

    /// Moves every packet each endpoint has to the other, running timers, until quiet;
    /// returns the packets moved.
    fn pump(eps: &mut [Endpoint; 2], mem: &mut SimMemory, now: Duration) -> Vec<(usize, Vec<u8>)> {
        let mut moved = Vec::new();
        loop {
            let mut any = false;
            for from in 0..2 {
                eps[from].handle_timeout(now);
                let mut buf = vec![0u8; 2048];
                while let Some(t) = eps[from].poll_transmit(now, &mut buf, mem) {
                    let t: Transmit = t;
                    let bytes = t.assemble(&buf, mem);
                    let src = eps[from].local();
                    eps[1 - from].handle_datagram(now, Arrival::new(src, t.dst), &bytes, mem);
                    moved.push((from, bytes));
                    any = true;
                }
            }
            if !any {
                return moved;
            }
        }
    }

    fn endpoints() -> [Endpoint; 2] {
        let mut eps = [Endpoint::new(sock(ip(A))), Endpoint::new(sock(ip(B)))];
        for (i, ep) in eps.iter_mut().enumerate() {
            ep.enable_cm(CmConfig { seed: i as u64 + 1, ..CmConfig::default() });
        }
        eps
    }

    fn events(ep: &mut Endpoint) -> Vec<CmEvent> {
        std::iter::from_fn(|| ep.cm_mut().and_then(|c| c.poll_event())).collect()
    }

    #[test]
    fn a_handshake_and_a_disconnect_cross_qp1_as_ud_sends_to_the_gsi() {
        let mut mem = SimMemory::new(1);
        let mut eps = endpoints();
        let t0 = Duration::ZERO;
        eps[1].cm_mut().unwrap().listen(sid(), 8).unwrap();
        let id = eps[0].cm_mut().unwrap().connect(t0, ip(B), req(0x11, b"hello")).unwrap();
        let moved = pump(&mut eps, &mut mem, t0);
        assert_eq!(moved.len(), 1, "the REQ only");
        let pkt = softrdma_proto::wire::Packet::new_checked(&moved[0].1[..]).unwrap();
        assert_eq!(pkt.bth().dest_qp(), Qpn::new(1));
        assert_eq!(Some(pkt.opcode()), Opcode::from_parts(Transport::Ud, Operation::SendOnly));
        assert_eq!(pkt.deth().unwrap().qkey(), Qkey::GSI);
        assert_eq!(pkt.deth().unwrap().src_qp(), Qpn::new(1));
        assert_eq!(pkt.payload().len(), 256);
        let encap = icrc::Encap::new(sock(ip(A)), sock(ip(B))).unwrap();
        assert!(icrc::verify(&encap, &moved[0].1), "softrdma sends the exact ICRC");

        let ev = events(&mut eps[1]);
        let [CmEvent::ConnectRequest { id: pid, peer, req: r }] = &ev[..] else { panic!("{ev:?}") };
        assert_eq!((*peer, r.local_qpn, &r.private_data[..5]), (ip(A), 0x11, &b"hello"[..]));
        assert!(!eps[1].peer_is_foreign(ip(A)));
        eps[1].cm_mut().unwrap().accept(t0, *pid, rep(0x22, b"")).unwrap();
        pump(&mut eps, &mut mem, t0);
        let ev = events(&mut eps[0]);
        assert!(matches!(&ev[..], [CmEvent::ConnectResponse { rep, .. }] if rep.local_qpn == 0x22), "{ev:?}");
        eps[0].cm_mut().unwrap().rtu(id, b"").unwrap();
        pump(&mut eps, &mut mem, t0);
        assert!(events(&mut eps[0]).iter().any(established));
        assert!(events(&mut eps[1]).iter().any(established));

        eps[0].cm_mut().unwrap().disconnect(t0, id, b"").unwrap();
        let moved = pump(&mut eps, &mut mem, t0);
        // The DREQ names the peer's QP, from its REP: Linux drops a DREQ naming another.
        let dreq = CmMad::parse(&moved[0].1[20..20 + 256]).unwrap();
        assert!(matches!(dreq.msg, CmMsg::Dreq(ref d) if d.remote_qpn == 0x22), "{dreq:?}");
        assert!(events(&mut eps[1]).iter().any(disconnected));
        assert!(events(&mut eps[0]).iter().any(disconnected));
        // TIMEWAIT ends through the endpoint's timer.
        let later = eps[0].poll_timeout().expect("a TIMEWAIT deadline");
        pump(&mut eps, &mut mem, later);
        assert!(events(&mut eps[0]).iter().any(|e| matches!(e, CmEvent::TimewaitExit { .. })));
        assert_eq!(eps[0].stats().gsi_dropped + eps[1].stats().icrc_errors, 0);
    }

    fn gsi_packet(op: Operation, qkey: u32, mad: &[u8], pkey: u16) -> Vec<u8> {
        let mut repr = PacketRepr::new(
            BthRepr::new(Opcode::from_parts(Transport::Ud, op).unwrap(), Qpn::new(1), Psn::new(0)),
            mad.len(),
        );
        repr.bth.pkey = pkey;
        repr.ext.deth = Some(DethRepr { qkey: Qkey(qkey), src_qp: Qpn::new(1) });
        let mut buf = vec![0u8; 400];
        let n = repr.emit(&mut buf, mad, &icrc::Encap::new(sock(ip(A)), sock(ip(B))).unwrap()).unwrap();
        buf.truncate(n);
        buf
    }

    #[test]
    fn qp1_takes_only_gsi_mads_and_needs_the_cm() {
        let mut mem = SimMemory::new(1);
        let mut eps = endpoints();
        let mut off = Endpoint::new(sock(ip(B)));
        eps[1].cm_mut().unwrap().listen(sid(), 8).unwrap();
        // A real REQ, taken from what the other endpoint sends.
        eps[0].cm_mut().unwrap().connect(Duration::ZERO, ip(B), req(0x11, b"")).unwrap();
        let mut buf = vec![0u8; 2048];
        let t = eps[0].poll_transmit(Duration::ZERO, &mut buf, &mem).unwrap();
        let real = t.assemble(&buf, &mem);
        let mad = real[20..20 + 256].to_vec();
        let arrive = |ep: &mut Endpoint, mem: &mut SimMemory, b: &[u8]| {
            ep.handle_datagram(Duration::ZERO, Arrival::new(sock(ip(A)), sock(ip(B))), b, mem)
        };
        // Wrong Q_Key, a short MAD, a SEND with immediate: dropped and counted.
        arrive(&mut eps[1], &mut mem, &gsi_packet(Operation::SendOnly, 0x1234, &mad, 0xFFFF));
        arrive(&mut eps[1], &mut mem, &gsi_packet(Operation::SendOnly, 0x8001_0000, &mad[..200], 0xFFFF));
        assert_eq!(eps[1].stats().gsi_dropped, 2);
        // A P_Key of another partition.
        arrive(&mut eps[1], &mut mem, &gsi_packet(Operation::SendOnly, 0x8001_0000, &mad, 0x1234));
        assert_eq!(eps[1].stats().pkey_violations, 1);
        // A damaged ICRC.
        let mut bad = real.clone();
        let n = bad.len();
        bad[n - 1] ^= 1;
        arrive(&mut eps[1], &mut mem, &bad);
        assert_eq!(eps[1].stats().icrc_errors, 1);
        assert!(events(&mut eps[1]).is_empty());
        // Without the CM the real one is dropped too; with it, it makes a request.
        arrive(&mut off, &mut mem, &real);
        assert_eq!(off.stats().gsi_dropped, 1);
        arrive(&mut eps[1], &mut mem, &real);
        assert!(matches!(&events(&mut eps[1])[..], [CmEvent::ConnectRequest { .. }]));
    }

    #[test]
    fn a_cm_message_with_a_kernel_ip_id_is_taken_and_its_sender_marked_foreign() {
        let mut mem = SimMemory::new(1);
        let mut eps = endpoints();
        eps[1].cm_mut().unwrap().listen(sid(), 8).unwrap();
        eps[0].cm_mut().unwrap().connect(Duration::ZERO, ip(B), req(0x11, b"")).unwrap();
        let mut buf = vec![0u8; 2048];
        let t = eps[0].poll_transmit(Duration::ZERO, &mut buf, &mem).unwrap();
        let mut pkt = t.assemble(&buf, &mem);
        // Re-seal the ICRC as a kernel would with IP ID 0x4242 and DF: rxe's packets.
        let n = pkt.len();
        let encap = icrc::Encap::new(sock(ip(A)), sock(ip(B))).unwrap().with_ipv4_ident(0x4242, true);
        let crc = icrc::compute(&encap, &pkt[..n - 4]);
        pkt[n - 4..].copy_from_slice(&crc.to_le_bytes());
        eps[1].handle_datagram(Duration::ZERO, Arrival::new(sock(ip(A)), sock(ip(B))), &pkt, &mut mem);
        assert!(matches!(&events(&mut eps[1])[..], [CmEvent::ConnectRequest { .. }]));
        assert!(eps[1].peer_is_foreign(ip(A)));
    }
}
