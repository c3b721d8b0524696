//! perftest's rdma_cm mode (`-R`): the exchange runs over an RC connection the connection
//! manager sets up, and the benchmark's QPs are connected by the CM too.
//!
//! As perftest 4.5 does it:
//! - The control connection: the server listens on the rdma_cm port (`-p`, TCP port
//!   space), accepts one request and closes its listener; the client resolves, connects
//!   and waits for ESTABLISHED. Each message of the exchange is one SEND of exactly its
//!   bytes, into a 56-byte receive re-posted after each message; the QP messages are
//!   perftest's `struct pingpong_dest` in network order (56 bytes), not the text of the
//!   TCP exchange, and the goodbye has no `done`.
//! - The benchmark's connections: after one swap as a barrier, the server listens again on
//!   the same port and accepts `-q` requests; the client connects each QP, retrying while
//!   the server is not listening yet (10 tries, 100 ms apart); another swap follows. The CM
//!   carries the PSNs, MTU and, for READ and atomics, the responder resources, and moves
//!   the QPs to RTS.
//! - At the end the client disconnects the benchmark's connections.
//!
//! Only RC: perftest runs UD over rdma_cm through SIDR with a QP-number message of its own,
//! which `softrdma perf -R` does not speak.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softrdma::cm::{getaddrinfo, AddrHints, AddrInfo, ConnParam, Ep, EpQp};
use softrdma::{
    Context, EndpointInfo, MemoryRegion, QpCaps, QueuePair, RemoteRegion, SendFlags, WcOpcode, WcStatus,
    WorkCompletion,
};

use super::args::{PerfArgs, Test};
use super::Fail;

/// `sizeof(struct pingpong_dest)`: the receive size of perftest's control QP and the size
/// of its QP message.
pub(super) const DEST_LEN: usize = 56;
/// Where the control QP's outgoing message is staged, after the receive buffer.
const SEND_AT: usize = 64;
/// How long one CM step (a connection, a completion) may take.
const STEP: Duration = Duration::from_secs(15);
/// perftest's retries of a benchmark connection, and the pause between them.
const DATA_TRIES: u32 = 10;
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The address the benchmark runs on: `-d`'s device, or 127.0.0.1.
fn device_addr(args: &PerfArgs) -> Result<IpAddr, Fail> {
    if args.gid_index.is_some() {
        return Err("-x cannot be combined with -R: the connection manager uses the address's GID".into());
    }
    match &args.device {
        Some(d) => softrdma::find_device(d).map(|d| d.addr).map_err(|e| e.to_string()),
        None => Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)),
    }
}

/// Where the endpoints go: the client to the server (`host`, `-p`) from `-d`'s address
/// if given; the server listens on `-d`'s address and `-p`.
fn addr_info(args: &PerfArgs) -> Result<AddrInfo, Fail> {
    let local = device_addr(args)?;
    let port = args.tcp_port().to_string();
    let hints = match &args.host {
        Some(_) => {
            AddrHints { ipv6: Some(false), src: args.device.as_ref().map(|_| local), ..AddrHints::default() }
        }
        None => AddrHints { passive: true, ipv6: Some(false), ..AddrHints::default() },
    };
    let node = args.host.clone().unwrap_or_else(|| local.to_string());
    let infos = getaddrinfo(Some(&node), Some(&port), &hints).map_err(|e| format!("{node}: {e}"))?;
    infos.first().copied().ok_or_else(|| format!("{node}: no IPv4 address"))
}

/// perftest's connection parameters: responder resources and initiator depth for READ
/// and atomics, retry counts 7.
fn conn_param(args: &PerfArgs) -> ConnParam {
    let reads = if args.test.is_send() || matches!(args.test, Test::WriteBw | Test::WriteLat) {
        0
    } else {
        softrdma::MAX_QP_RD_ATOM
    };
    ConnParam {
        responder_resources: reads,
        initiator_depth: reads,
        retry_count: 7,
        rnr_retry_count: 7,
        ..ConnParam::default()
    }
}

/// The control connection: perftest's exchange over SEND and RECV.
pub(super) struct Control {
    ep: Ep,
    /// The receive buffer, then the outgoing message at [`SEND_AT`].
    mr: MemoryRegion,
    /// A receive completion taken while looking for a waiting message.
    pending: Option<WorkCompletion>,
}

impl Control {
    /// Connects the control QP: the client to `host`, the server by accepting the first
    /// request on `-p`.
    pub(super) fn connect(args: &PerfArgs) -> Result<Control, Fail> {
        let info = addr_info(args)?;
        let qp =
            EpQp { caps: QpCaps { max_send_wr: 2, max_recv_wr: 2, ..QpCaps::default() }, sq_sig_all: false };
        if info.passive {
            let listener = Ep::create(&info, None, Some(&qp))
                .map_err(|e| format!("rdma_cm port {:?}: {e}", info.src))?;
            listener.listen(1).map_err(|e| e.to_string())?;
            // As perftest's server: wait for a client as long as it takes.
            let mut c = Control::new(listener.get_request().map_err(|e| e.to_string())?)?;
            c.ep.accept(&conn_param(args)).map_err(|e| e.to_string())?;
            // The benchmark's listener takes the port next.
            listener.id().destroy();
            return Ok(c);
        }
        // perftest's server may not listen yet: try for as long as the TCP exchange does.
        let deadline = Instant::now() + STEP;
        loop {
            let attempt = Ep::create(&info, None, Some(&qp)).map_err(|e| e.to_string()).and_then(|ep| {
                let mut c = Control::new(ep)?;
                c.ep.connect(&conn_param(args)).map_err(|e| e.to_string())?;
                Ok(c)
            });
            match attempt {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() > deadline => return Err(format!("rdma_cm {:?}: {e}", info.dst)),
                Err(_) => std::thread::sleep(RETRY_PAUSE),
            }
        }
    }

    /// Registers the buffers and posts the first receive.
    fn new(ep: Ep) -> Result<Control, Fail> {
        let mr = ep.reg_msgs(2 * SEND_AT).map_err(|e| e.to_string())?;
        let c = Control { ep, mr, pending: None };
        c.post_recv()?;
        Ok(c)
    }

    /// The device the connection manager opened for the control connection, which the
    /// benchmark's QPs share.
    pub(super) fn context(&self) -> Result<Context, Fail> {
        self.ep.id().context().ok_or_else(|| "the CM ID has no device".into())
    }

    fn post_recv(&self) -> Result<(), Fail> {
        self.ep.post_recv(1, &self.mr, 0, DEST_LEN).map_err(|e| e.to_string())
    }

    fn send(&self, msg: &[u8]) -> Result<(), Fail> {
        if msg.len() > DEST_LEN {
            return Err(format!("exchange message of {} bytes (at most {DEST_LEN})", msg.len()));
        }
        self.mr.write(SEND_AT, msg).map_err(|e| e.to_string())?;
        let signaled = SendFlags { signaled: true, ..Default::default() };
        self.ep.post_send(2, &self.mr, SEND_AT, msg.len(), signaled).map_err(|e| e.to_string())?;
        let wc = self.ep.get_send_comp_timeout(STEP).map_err(|e| format!("exchange: {e}"))?;
        if wc.status != WcStatus::Success {
            return Err(format!("exchange: SEND failed: {:?}", wc.status));
        }
        Ok(())
    }

    /// Whether the peer's next message has arrived (kept for [`Self::recv`]).
    pub(super) fn message_waiting(&mut self) -> bool {
        if self.pending.is_none() {
            self.pending = self.ep.recv_cq().and_then(|cq| cq.poll_one());
        }
        self.pending.is_some()
    }

    /// The peer's next message, which must be `len` bytes. Waits while the connection
    /// stands: the peer may be running a long benchmark; it fails when the peer
    /// disconnects or the connection breaks.
    fn recv(&mut self, len: usize) -> Result<Vec<u8>, Fail> {
        let wc = loop {
            if let Some(wc) = self.pending.take() {
                break wc;
            }
            match self.ep.get_recv_comp_timeout(Duration::from_millis(100)) {
                Ok(wc) => break wc,
                Err(_) if self.ep.peer_disconnected() => return Err("exchange: the peer disconnected".into()),
                Err(_) => {}
            }
        };
        if wc.status != WcStatus::Success || wc.opcode != WcOpcode::Recv {
            return Err(format!("exchange: receive failed: {:?}", wc.status));
        }
        if wc.byte_len as usize != len {
            return Err(format!("exchange: the peer sent {} bytes where {len} were due", wc.byte_len));
        }
        let mut got = vec![0u8; len];
        self.mr.read(0, &mut got).map_err(|e| e.to_string())?;
        self.post_recv()?;
        Ok(got)
    }

    /// Sends `msg` and receives the peer's message of the same length (the client speaks
    /// first).
    pub(super) fn swap(&mut self, client: bool, msg: &[u8]) -> Result<Vec<u8>, Fail> {
        if client {
            self.send(msg)?;
            self.recv(msg.len())
        } else {
            let got = self.recv(msg.len())?;
            self.send(msg)?;
            Ok(got)
        }
    }
}

/// The benchmark's connections, kept until the end.
pub(super) struct DataConns(Vec<Ep>);

impl DataConns {
    /// The server's listener for the benchmark's QPs on `-p`, opened before the swap that
    /// lets the client connect: perftest's client does not survive a refused first
    /// request (its retry uses the IDs it has just destroyed).
    pub(super) fn listen(args: &PerfArgs) -> Result<Ep, Fail> {
        let info = addr_info(args)?;
        let listener =
            Ep::create(&info, None, None).map_err(|e| format!("rdma_cm port {:?}: {e}", info.src))?;
        listener.listen(args.qps.max(1) as usize).map_err(|e| e.to_string())?;
        Ok(listener)
    }

    /// Connects `n` QPs, each made by `make` on its endpoint: the client to the server's
    /// address, the server by accepting `n` requests on `listener` ([`Self::listen`]).
    pub(super) fn connect(
        args: &PerfArgs,
        n: usize,
        listener: Option<Ep>,
        mut make: impl FnMut(&mut Ep) -> Result<Arc<QueuePair>, Fail>,
    ) -> Result<(DataConns, Vec<Arc<QueuePair>>), Fail> {
        let info = addr_info(args)?;
        let param = conn_param(args);
        // One connection: its QP made, then accepted or connected (both wait for
        // ESTABLISHED, which the CM's own retries bound).
        let mut one = |mut ep: Ep| -> Result<(Ep, Arc<QueuePair>), Fail> {
            let qp = make(&mut ep)?;
            if info.passive { ep.accept(&param) } else { ep.connect(&param) }.map_err(|e| e.to_string())?;
            Ok((ep, qp))
        };
        let mut conns = Vec::with_capacity(n);
        if info.passive {
            let listener = listener.ok_or("the server listens before the swap (DataConns::listen)")?;
            for _ in 0..n {
                conns.push(one(listener.get_request_timeout(STEP).map_err(|e| e.to_string())?)?);
            }
            listener.id().destroy();
        } else {
            for _ in 0..n {
                // The server may not listen again yet: perftest's retries.
                let mut tries = 1;
                let c = loop {
                    match Ep::create(&info, None, None).map_err(|e| e.to_string()).and_then(&mut one) {
                        Ok(c) => break c,
                        Err(e) if tries >= DATA_TRIES => {
                            return Err(format!(
                                "rdma_cm: connecting a QP to {:?}, {tries} tries: {e}",
                                info.dst
                            ))
                        }
                        Err(_) => tries += 1,
                    }
                    std::thread::sleep(RETRY_PAUSE);
                };
                conns.push(c);
            }
        }
        let (eps, qps) = conns.into_iter().unzip();
        Ok((DataConns(eps), qps))
    }

    /// Disconnects every connection and waits (boundedly) for their DISCONNECTED events.
    pub(super) fn disconnect(self) {
        let mut left: Vec<&Ep> = self.0.iter().filter(|ep| ep.disconnect().is_ok()).collect();
        let deadline = Instant::now() + Duration::from_secs(2);
        while !left.is_empty() && Instant::now() < deadline {
            left.retain(|ep| !ep.peer_disconnected());
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// perftest's `struct pingpong_dest` in network order: lid, out_reads, qpn, psn, rkey,
/// (padding), vaddr, gid, srqn, gid_index.
pub(super) fn dest_message(e: &EndpointInfo, gid_index: u32) -> Vec<u8> {
    let r = e.region.unwrap_or(RemoteRegion { addr: 0, len: 0, rkey: 0 });
    let mut m = vec![0u8; DEST_LEN];
    m[4..8].copy_from_slice(&1u32.to_be_bytes());
    m[8..12].copy_from_slice(&e.qpn.to_be_bytes());
    m[12..16].copy_from_slice(&e.psn.to_be_bytes());
    m[16..20].copy_from_slice(&r.rkey.to_be_bytes());
    m[24..32].copy_from_slice(&r.addr.to_be_bytes());
    m[32..48].copy_from_slice(&softrdma::gid_of(e.addr.ip()));
    m[52..56].copy_from_slice(&gid_index.to_be_bytes());
    m
}

/// (address, qpn, psn, rkey, vaddr) of a `struct pingpong_dest` message.
pub(super) fn parse_dest_message(m: &[u8]) -> Result<(IpAddr, u32, u32, u32, u64), Fail> {
    if m.len() != DEST_LEN {
        return Err(format!("QP message of {} bytes, not {DEST_LEN}", m.len()));
    }
    let u32_at = |k: usize| u32::from_be_bytes([m[k], m[k + 1], m[k + 2], m[k + 3]]);
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&m[32..48]);
    let mut vaddr = [0u8; 8];
    vaddr.copy_from_slice(&m[24..32]);
    Ok((softrdma::addr_of_gid(gid), u32_at(8), u32_at(12), u32_at(16), u64::from_be_bytes(vaddr)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dest_message_is_perftests_struct_and_round_trips() {
        let e = EndpointInfo {
            addr: "192.168.77.10:4791".parse().unwrap(),
            qpn: 0x21,
            psn: 0x2c27a5,
            mtu: 1024,
            region: Some(RemoteRegion { addr: 0x562b_6dc6_d000, len: 64, rkey: 0x11e1 }),
        };
        let m = dest_message(&e, 1);
        assert_eq!(m.len(), 56);
        assert_eq!(&m[8..12], &[0, 0, 0, 0x21]);
        assert_eq!(&m[24..32], &[0, 0, 0x56, 0x2b, 0x6d, 0xc6, 0xd0, 0]);
        assert_eq!(&m[42..48], &[0xff, 0xff, 192, 168, 77, 10]);
        assert_eq!(parse_dest_message(&m).unwrap(), (e.addr.ip(), 0x21, 0x2c27a5, 0x11e1, 0x562b_6dc6_d000));
        assert!(parse_dest_message(&m[..55]).is_err());
    }
}
