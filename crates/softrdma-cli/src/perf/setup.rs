//! The verbs set-up of a run: the device's context, the protection domain, completion
//! queue, memory region and queue pairs, and connecting them to the peer's.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use softrdma::{
    Access, CompletionChannel, CompletionQueue, ConnectOptions, Context, EndpointInfo, MemoryRegion, Mtu,
    ProtectionDomain, Qkey, QpBuilder, QpCaps, QueuePair, RecvWr, RemoteRegion, UdDest,
};

use super::args::{self, Conn, PerfArgs};
use super::cm::DataConns;
use super::Fail;
use softrdma::cm::Ep;

const QKEY: Qkey = Qkey(0x1111_1111);

/// Opens the device `-d` names (127.0.0.1 without one), binding its GID `-x` when given.
pub(super) fn open(args: &PerfArgs) -> Result<Context, Fail> {
    let opened = match (&args.device, args.gid_index) {
        (d, Some(idx)) => {
            Context::open_gid(d.as_deref().unwrap_or("127.0.0.1"), idx, softrdma::default_port())
        }
        (Some(d), None) => softrdma::find_device(d).and_then(|d| Context::open(d.addr)),
        (None, None) => Context::open(IpAddr::V4(Ipv4Addr::LOCALHOST)),
    };
    opened.map_err(|e| e.to_string())
}

/// One side of a benchmark: its verbs objects and, once the exchange is over, the peer's.
pub(super) struct Session<'a> {
    pub(super) args: &'a PerfArgs,
    pub(super) ctx: Context,
    pub(super) client: bool,
    /// The path MTU of the run: `-m`'s as perftest settles it ([`args::mtu`]).
    pub(super) mtu: Mtu,
    pub(super) cq: CompletionQueue,
    pub(super) channel: Option<CompletionChannel>,
    pub(super) mr: MemoryRegion,
    pd: ProtectionDomain,
    builder: QpBuilder,
    /// The connected queue pairs (`-q` of them), once the exchange is over.
    pub(super) qps: Vec<Arc<QueuePair>>,
    /// With `-R`: the connection manager's IDs of the QPs.
    pub(super) cm: Option<DataConns>,
    pub(super) prepared: Vec<softrdma::PreparedQp>,
    /// The peer's memory: one region behind all its QPs.
    pub(super) remote: Option<RemoteRegion>,
    pub(super) ud_dests: Vec<UdDest>,
    pub(super) mine: Vec<EndpointInfo>,
    pub(super) theirs: Vec<EndpointInfo>,
    pub(super) buf: usize,
    /// Receive slots per QP (SEND tests) and buffers in each.
    pub(super) slots: usize,
    /// Offset of the buffer that is sent from, written to and read into: after the
    /// receive slots.
    pub(super) local: usize,
    /// Receives posted so far, per QP.
    pub(super) posted_recvs: Vec<u64>,
}

impl<'a> Session<'a> {
    pub(super) fn new(args: &'a PerfArgs, ctx: Context, max: usize) -> Result<Session<'a>, Fail> {
        let client = args.host.is_some();
        let pd = ctx.alloc_pd();
        let channel = if args.events { Some(ctx.create_channel().map_err(|e| e.to_string())?) } else { None };
        let nq = args.qps.max(1) as usize;
        // args::check kept the CQ within max_cqe and the region within max_mr_size.
        let depth = usize::try_from(args::cq_entries(args)).unwrap_or(usize::MAX).min(softrdma::MAX_CQE);
        let cq = ctx.create_cq(depth, channel.as_ref()).map_err(|e| e.to_string())?;
        let ud = args.connection == Conn::Ud;
        let (len, buf, slots) = args::layout(args, max).ok_or("the memory region's size overflows")?;
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        let len = usize::try_from(len).map_err(|_| "the memory region's size overflows")?;
        let mr = pd.register(len, access).map_err(|e| e.to_string())?;
        let caps = QpCaps {
            max_send_wr: args.tx_depth.clamp(1, softrdma::MAX_QP_WR),
            max_recv_wr: args.rx_depth.clamp(1, softrdma::MAX_QP_WR),
            max_inline_data: args.inline.min(softrdma::MAX_INLINE),
            ..QpCaps::default()
        };
        let b = if ud { QpBuilder::ud(QKEY) } else { QpBuilder::rc().access(access) }.caps(caps);
        let mtu = args::mtu(args, ctx.device().active_mtu()).0;
        let mut s = Session {
            args,
            ctx,
            client,
            mtu,
            cq,
            channel,
            mr,
            pd,
            builder: b,
            qps: Vec::new(),
            cm: None,
            prepared: Vec::new(),
            remote: None,
            ud_dests: Vec::new(),
            mine: Vec::new(),
            theirs: Vec::new(),
            buf,
            slots,
            local: buf * slots * nq,
            posted_recvs: vec![0; nq],
        };
        // With -R the connection manager makes the QPs (`connect_cm`).
        if !args.rdma_cm {
            for _ in 0..nq {
                let p = s.pd.prepare_qp(&s.builder, &s.cq, &s.cq).map_err(|e| e.to_string())?;
                let mut e = p.endpoint();
                e.mtu = e.mtu.min(s.mtu.bytes());
                e.region = Some(s.target());
                s.prepared.push(p);
                s.mine.push(e);
            }
            s.post_recvs()?;
        }
        Ok(s)
    }

    /// The region the peer's RDMA targets: after our receive slots and local buffer;
    /// perftest, as peer, targets exactly what we advertise.
    fn target(&self) -> RemoteRegion {
        let r = self.mr.remote();
        let after = self.local + self.buf;
        RemoteRegion { addr: r.addr + after as u64, len: r.len - after as u64, rkey: r.rkey }
    }

    /// Fills the receive queues of the send tests.
    fn post_recvs(&mut self) -> Result<(), Fail> {
        if self.args.test.is_send() {
            for q in 0..self.posted_recvs.len() {
                for _ in 0..self.args.rx_depth {
                    self.post_recv(q)?;
                }
            }
        }
        Ok(())
    }

    /// `-R`: connects the benchmark's QPs through the connection manager, which readies
    /// them, and posts the receives.
    /// The server passes the listener it opened with [`DataConns::listen`].
    pub(super) fn connect_cm(&mut self, listener: Option<Ep>) -> Result<(), Fail> {
        let (pd, cq, b) = (&self.pd, &self.cq, self.builder);
        let (conns, qps) = DataConns::connect(self.args, self.posted_recvs.len(), listener, |ep| {
            ep.create_qp(pd, &b, cq, cq).map_err(|e| e.to_string())
        })?;
        let addr = self.ctx.local_addr();
        for qp in &qps {
            let (attr, _) = qp.query().map_err(|e| e.to_string())?;
            self.mine.push(EndpointInfo {
                addr,
                qpn: qp.qpn().get(),
                psn: attr.sq_psn.map_or(0, |p| p.get()),
                mtu: attr.path_mtu.map_or(1024, |m| m.bytes()),
                region: Some(self.target()),
            });
        }
        self.qps = qps;
        self.cm = Some(conns);
        self.post_recvs()
    }

    /// Posts the next receive of QP `q` (into its next slot, round robin).
    pub(super) fn post_recv(&mut self, q: usize) -> Result<(), Fail> {
        let k = self.posted_recvs[q];
        let slot = q * self.slots + (k % self.slots as u64) as usize;
        let sge = self.mr.sge(slot * self.buf, self.buf).map_err(|e| e.to_string())?;
        let wr = RecvWr { wr_id: k, sg_list: softrdma::sgl![sge] };
        let r = match (self.qps.get(q), self.prepared.get(q)) {
            (Some(qp), _) => qp.post_recv(wr),
            (None, Some(p)) => p.post_recv(wr),
            _ => return Err("no QP".into()),
        };
        self.posted_recvs[q] += 1;
        r.map_err(|e| e.to_string())
    }

    /// Connects our QPs to the peer's endpoints (UD: readies them and keeps the
    /// destinations), at the MTU the exchange settled on.
    pub(super) fn connect_qps(&mut self, mtu: Option<Mtu>) -> Result<(), Fail> {
        for (prepared, remote) in std::mem::take(&mut self.prepared).into_iter().zip(&self.theirs) {
            let qp = if self.args.connection == Conn::Ud {
                self.ud_dests.push(UdDest {
                    addr: remote.addr,
                    qpn: softrdma::Qpn::new(remote.qpn),
                    qkey: QKEY,
                    traffic_class: 0,
                });
                prepared.ready().inspect(|q| q.set_foreign_peer(self.args.foreign))
            } else {
                let foreign_peer = self.args.foreign;
                let timeout = self.args.qp_timeout;
                let remote = &EndpointInfo { addr: self.args.via.unwrap_or(remote.addr), ..*remote };
                prepared.handshake(
                    remote,
                    &ConnectOptions { mtu, foreign_peer, timeout, ..ConnectOptions::default() },
                )
            }
            .map_err(|e| e.to_string())?;
            self.qps.push(Arc::new(qp));
        }
        self.remote = self.theirs.first().and_then(|t| t.region);
        Ok(())
    }
}
