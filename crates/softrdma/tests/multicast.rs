//! Multicast UD over real sockets: one SEND to a group reaches every attached QP of every
//! device (through the kernel's IP multicast on loopback), with the group in the GRH area;
//! Q_Keys, missing receives, detaching, the sender's own copy, the group MTU rule and the
//! refusals.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use softrdma::mcast::{group_of_mgid, mgid_of};
use softrdma::{
    Access, Context, Error, MemoryRegion, Mtu, Qkey, QpBuilder, QpCaps, Qpn, QueuePair, RecvWr, SendFlags,
    SendOp, SendWr, UdDest, WcStatus,
};

const QKEY: Qkey = Qkey(0x0123_4567);
const WAIT: Duration = Duration::from_secs(5);

struct Member {
    ctx: Context,
    qp: QueuePair,
    cq: softrdma::CompletionQueue,
    mr: MemoryRegion,
}

fn member(ip: [u8; 4], qkey: Qkey) -> Member {
    member_on(Context::open(IpAddr::from(ip)).unwrap(), qkey)
}

fn member_on(ctx: Context, qkey: Qkey) -> Member {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let mr = pd.register(64 * 1024, Access::LOCAL_WRITE).unwrap();
    let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, ..QpCaps::default() };
    let qp = pd.prepare_qp(&QpBuilder::ud(qkey).caps(caps), &cq, &cq).unwrap().ready().unwrap();
    Member { ctx, qp, cq, mr }
}

impl Member {
    fn post_recvs(&self, n: u64) {
        for i in 0..n {
            let off = (i as usize % 16) * 4096;
            self.qp
                .post_recv(RecvWr { wr_id: i, sg_list: softrdma::sgl![self.mr.sge(off, 4096).unwrap()] })
                .unwrap();
        }
    }

    fn send_to(&self, group: IpAddr, msg: &[u8]) {
        self.mr.write(60 * 1024, msg).unwrap();
        let dest = UdDest {
            addr: SocketAddr::new(group, self.ctx.local_addr().port()),
            qpn: Qpn::MULTICAST,
            qkey: QKEY,
            traffic_class: 0,
        };
        self.qp
            .post_send(SendWr {
                wr_id: 99,
                op: SendOp::Send,
                sg_list: softrdma::sgl![self.mr.sge(60 * 1024, msg.len()).unwrap()],
                flags: SendFlags { signaled: true, ..Default::default() },
                ud: Some(dest),
            })
            .unwrap();
        let wc = self.cq.wait_one_timeout(WAIT).expect("a send completion");
        assert_eq!((wc.wr_id, wc.status), (99, WcStatus::Success));
    }

    /// The payloads received within `wait`, with the GRH's destination address.
    fn received(&self, wait: Duration) -> Vec<(Vec<u8>, IpAddr, Qpn)> {
        let mut out = Vec::new();
        while let Some(wc) = self.cq.wait_one_timeout(wait) {
            assert_eq!(wc.status, WcStatus::Success);
            assert!(wc.grh);
            let off = (wc.wr_id as usize % 16) * 4096;
            let mut grh = [0u8; 40];
            self.mr.read(off, &mut grh).unwrap();
            let dst = IpAddr::from(<[u8; 4]>::try_from(&grh[36..40]).unwrap());
            let mut body = vec![0u8; wc.byte_len as usize - 40];
            self.mr.read(off + 40, &mut body).unwrap();
            out.push((body, dst, wc.src_qp));
        }
        out
    }
}

#[test]
fn one_send_reaches_every_attached_qp_and_only_those() {
    let group: IpAddr = "239.40.0.1".parse().unwrap();
    let a = member([127, 0, 40, 1], QKEY);
    let b = member([127, 0, 40, 2], QKEY);
    let c = member([127, 0, 40, 3], QKEY);
    let other_key = member([127, 0, 40, 4], Qkey(0x1111));
    let outsider = member([127, 0, 40, 5], QKEY);
    for m in [&b, &c, &other_key] {
        assert_eq!(m.qp.attach_mcast(group).unwrap(), Mtu::Mtu4096);
        m.post_recvs(8);
    }
    outsider.post_recvs(8);
    assert_eq!(b.qp.mcast_groups(), [group]);
    for k in 0..3u8 {
        a.send_to(group, &[k; 100]);
    }
    for m in [&b, &c] {
        let got = m.received(Duration::from_millis(300));
        let want: Vec<_> = (0..3u8).map(|k| (vec![k; 100], group, a.qp.qpn())).collect();
        assert_eq!(got, want, "each member gets each datagram once, the group in its GRH");
    }
    assert!(other_key.received(Duration::from_millis(100)).is_empty(), "another Q_Key");
    assert_eq!(other_key.qp.stats().dropped, 3, "Q_Key mismatches are counted");
    assert!(outsider.received(Duration::from_millis(100)).is_empty(), "not attached");
    assert!(b.ctx.endpoint_stats().mcast_delivered >= 3);

    // B leaves: C still gets the group's datagrams, B nothing.
    b.qp.detach_mcast(group).unwrap();
    assert!(b.qp.mcast_groups().is_empty());
    a.send_to(group, b"after B left");
    assert_eq!(c.received(Duration::from_millis(300)).len(), 1);
    assert!(b.received(Duration::from_millis(100)).is_empty(), "B left the group");
}

#[test]
fn members_without_a_posted_receive_lose_the_datagram_and_count_it() {
    let group: IpAddr = "239.40.0.2".parse().unwrap();
    let a = member([127, 0, 40, 11], QKEY);
    let b = member([127, 0, 40, 12], QKEY);
    b.qp.attach_mcast(group).unwrap();
    b.post_recvs(2);
    for k in 0..5u8 {
        a.send_to(group, &[k; 10]);
    }
    let got = b.received(Duration::from_millis(300));
    assert_eq!(got.len(), 2, "two receives posted, two datagrams kept");
    assert_eq!(b.qp.stats().dropped, 3, "the rest lost, and counted");
}

#[test]
fn a_qp_does_not_hear_itself_but_its_neighbours_do() {
    let group: IpAddr = "239.40.0.3".parse().unwrap();
    let a = member([127, 0, 40, 21], QKEY);
    let a2 = member_on(a.ctx.clone(), QKEY);
    for m in [&a, &a2] {
        m.qp.attach_mcast(group).unwrap();
        m.post_recvs(4);
    }
    a.send_to(group, b"from a");
    let got = a2.received(Duration::from_millis(300));
    assert_eq!(got, vec![(b"from a".to_vec(), group, a.qp.qpn())], "another QP of the sender's device");
    assert!(a.received(Duration::from_millis(100)).is_empty(), "not the sending QP");
}

#[test]
fn the_first_members_mtu_is_the_groups_and_smaller_devices_cannot_join() {
    let small_device = |ip: [u8; 4]| {
        let mut d = softrdma::find_device(&IpAddr::from(ip).to_string()).unwrap();
        d.netdev_mtu = 1500; // an Ethernet link: active MTU 1024
        member_on(Context::open_device(d, softrdma::default_port()).unwrap(), QKEY)
    };
    // A 4096 group refuses a 1024 device.
    let group: IpAddr = "239.40.0.4".parse().unwrap();
    let big = member([127, 0, 40, 31], QKEY);
    let small = small_device([127, 0, 40, 32]);
    assert_eq!(big.qp.attach_mcast(group).unwrap(), Mtu::Mtu4096);
    match small.qp.attach_mcast(group) {
        Err(e @ Error::GroupMtu { group_mtu: 4096, device_mtu: 1024, .. }) => {
            assert!(e.to_string().contains("first member"), "{e}");
            assert_eq!(e.errno(), libc::EINVAL);
        }
        other => panic!("a smaller MTU joined a 4096 group: {other:?}"),
    }
    // Once the group is empty, its MTU is the next first member's.
    big.qp.detach_mcast(group).unwrap();
    assert_eq!(small.qp.attach_mcast(group).unwrap(), Mtu::Mtu1024);
    // A 1024 group takes a 4096 device, and stays 1024.
    assert_eq!(big.qp.attach_mcast(group).unwrap(), Mtu::Mtu1024);
    // The rule lives as long as its members: dropping them ends the group.
    drop(big);
    drop(small);
    let again = member([127, 0, 40, 33], QKEY);
    assert_eq!(again.qp.attach_mcast(group).unwrap(), Mtu::Mtu4096);
}

#[test]
fn attaching_refuses_what_cannot_be_multicast() {
    let group: IpAddr = "239.40.0.5".parse().unwrap();
    let m = member([127, 0, 40, 41], QKEY);
    assert!(matches!(m.qp.attach_mcast("127.0.0.1".parse().unwrap()), Err(Error::Mcast(_))));
    m.qp.attach_mcast(group).unwrap();
    assert!(matches!(m.qp.attach_mcast(group), Err(Error::Mcast(_))), "attached twice");
    assert!(matches!(m.qp.detach_mcast("239.40.0.6".parse().unwrap()), Err(Error::Mcast(_))));
    let pd = m.ctx.alloc_pd();
    let rc = pd.create_qp(&QpBuilder::rc(), &m.cq, &m.cq).unwrap();
    assert!(matches!(rc.attach_mcast(group), Err(Error::Mcast(_))), "RC QPs take no multicast");
    let attr = m.ctx.query_device();
    assert_eq!((attr.max_mcast_grp, attr.max_mcast_qp_attach), (8192, 56));
    // MGIDs: the RoCEv2 mapping both ways.
    assert_eq!(group_of_mgid(mgid_of(group).unwrap()), Some(group));
}

/// rdma_cm's way (mckey's): a UD ID resolved to the group from a source address, its QP,
/// `join_multicast` and the JOIN event whose UD parameters address the group.
#[test]
fn cm_ids_join_and_leave_groups_with_events() {
    use softrdma::cm::{CmEventKind, CmId, EventChannel, PortSpace, UDP_QKEY};
    let group: IpAddr = "239.40.0.7".parse().unwrap();
    let join = |src: [u8; 4]| {
        let ch = EventChannel::new().unwrap();
        let id = CmId::new(&ch, PortSpace::Udp);
        id.resolve_addr(Some(IpAddr::from(src)), SocketAddr::new(group, 0), WAIT).unwrap();
        assert_eq!(ch.get_event_timeout(WAIT).unwrap().kind, CmEventKind::AddrResolved);
        let ctx = id.context().unwrap();
        let (pd, cq) = (ctx.alloc_pd(), ctx.create_cq(64, None).unwrap());
        let qp = id.create_qp(&pd, &QpBuilder::ud(UDP_QKEY), &cq, &cq).unwrap();
        let mr = pd.register(64 * 1024, Access::LOCAL_WRITE).unwrap();
        for i in 0..8u64 {
            qp.post_recv(RecvWr {
                wr_id: i,
                sg_list: softrdma::sgl![mr.sge(i as usize * 4096, 4096).unwrap()],
            })
            .unwrap();
        }
        id.join_multicast(group).unwrap();
        let ev = ch.get_event_timeout(WAIT).unwrap();
        assert_eq!((ev.kind, ev.status), (CmEventKind::MulticastJoin, 0));
        let ud = ev.ud.expect("the JOIN event's UD parameters");
        assert_eq!((ud.qpn, ud.qkey, ud.addr.ip()), (Qpn::MULTICAST, UDP_QKEY, group));
        assert_eq!(qp.mcast_groups(), [group], "the ID's QP was attached");
        (ch, id, ctx, qp, cq, mr, ud)
    };
    let (_c1, id1, _x1, qp1, cq1, mr1, ud) = join([127, 0, 40, 51]);
    let (_c2, _id2, _x2, _qp2, cq2, mr2, _) = join([127, 0, 40, 52]);
    let send = |text: &[u8]| {
        mr1.write(60 * 1024, text).unwrap();
        qp1.post_send(SendWr {
            wr_id: 7,
            op: SendOp::Send,
            sg_list: softrdma::sgl![mr1.sge(60 * 1024, text.len()).unwrap()],
            flags: SendFlags { signaled: true, ..Default::default() },
            ud: Some(UdDest { addr: ud.addr, qpn: ud.qpn, qkey: ud.qkey, traffic_class: 0 }),
        })
        .unwrap();
        assert_eq!(cq1.wait_one_timeout(WAIT).unwrap().status, WcStatus::Success);
    };
    send(b"mckey says hi");
    let wc = cq2.wait_one_timeout(WAIT).expect("the other member receives");
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 40 + 13));
    let mut body = [0u8; 13];
    mr2.read(wc.wr_id as usize * 4096 + 40, &mut body).unwrap();
    assert_eq!(&body, b"mckey says hi");
    // Leaving detaches the ID's QP; leaving twice is refused.
    id1.leave_multicast(group).unwrap();
    assert!(qp1.mcast_groups().is_empty());
    assert!(id1.leave_multicast(group).is_err());
    // A unicast address is no group; an RC ID has no multicast.
    assert!(id1.join_multicast("127.0.0.1".parse().unwrap()).is_err());
    let ch = EventChannel::new().unwrap();
    assert!(CmId::new(&ch, PortSpace::Tcp).join_multicast(group).is_err());
}
