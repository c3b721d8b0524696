//! The out-of-band exchange of the commands that pair two processes (`pingpong`, `perf`,
//! `memserver`, `soak`): a TCP connection (connect with bounded retries, or a listener
//! that serves clients one at a time), and one JSON line each way on it, or on stdin and
//! stdout.
//!
//! Nothing a peer sends can hold a process forever or grow it without bound: every read on
//! the connection ends by a deadline ([`Bounded`]), lines have a length limit
//! ([`recv_line`]), and a server drops a client that is silent, slow or talks nonsense,
//! says so on stderr, and serves the next one ([`Listener::serve`]).

use std::fmt;
use std::io::{self, BufRead, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// The longest line [`recv_line`] takes from a peer by default, newline not counted.
pub const MAX_LINE: usize = 64 << 10;

/// How long a server gives one client for the whole exchange before it drops it.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client waits for the server's side of the exchange: longer than
/// [`CLIENT_TIMEOUT`], since a server may first have to drop a client before it.
pub const SERVER_TIMEOUT: Duration = Duration::from_secs(30);

/// Pause between two connection attempts.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// Shortest time one connection attempt is given, however close the deadline.
const MIN_ATTEMPT: Duration = Duration::from_millis(100);

/// Connects to `host:port`, trying again until `retry_for` has passed (the server may
/// not be listening yet).
pub fn connect(host: &str, port: u16, retry_for: Duration) -> Result<TcpStream, String> {
    let deadline = Instant::now() + retry_for;
    loop {
        match try_connect(host, port, deadline) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() > deadline => return Err(format!("cannot reach {host}:{port}: {e}")),
            Err(_) => std::thread::sleep(RETRY_PAUSE),
        }
    }
}

/// One attempt on each address of `host`, none of them outliving the deadline by much.
fn try_connect(host: &str, port: u16, deadline: Instant) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "could not resolve to any address");
    for addr in (host, port).to_socket_addrs()? {
        let wait = deadline.saturating_duration_since(Instant::now()).max(MIN_ATTEMPT);
        match TcpStream::connect_timeout(&addr, wait) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Why a server gave up on one client.
#[derive(Debug)]
pub enum ClientError {
    /// The client's fault (silent, too slow, garbage, too much, gone): the server drops
    /// it and serves the next.
    Dropped(String),
    /// The server cannot go on.
    Fatal(String),
}

/// A server's TCP listener.
#[derive(Debug)]
pub struct Listener(TcpListener);

impl Listener {
    /// Listens on TCP `port` of `addr`: the address the command line asked for. Without
    /// one, on every IPv4 address, as `ibv_rc_pingpong` and perftest do: their users reach
    /// a server by any of its host's names (often another network's than RDMA's).
    pub fn bind(addr: Option<IpAddr>, port: u16) -> Result<Listener, String> {
        let addr = SocketAddr::new(addr.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), port);
        TcpListener::bind(addr).map(Listener).map_err(|e| format!("TCP {addr}: {e}"))
    }

    /// Serves clients one at a time until `exchange` succeeds with one, and returns what
    /// it returned. Each client's stream comes bounded by [`CLIENT_TIMEOUT`] for the whole
    /// exchange; a client `exchange` drops is reported on stderr after `tool`.
    pub fn serve<T>(
        &self,
        tool: &str,
        mut exchange: impl FnMut(Bounded) -> Result<T, ClientError>,
    ) -> Result<T, String> {
        loop {
            let (stream, peer) = match self.0.accept() {
                Ok(c) => c,
                // The client left before we took it: not the server's problem.
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => continue,
                Err(e) => return Err(format!("accepting a client: {e}")),
            };
            match exchange(Bounded::new(stream, CLIENT_TIMEOUT)) {
                Ok(v) => return Ok(v),
                Err(ClientError::Fatal(e)) => return Err(e),
                Err(ClientError::Dropped(e)) => {
                    eprintln!("{tool}: dropped client {peer}: {e}; waiting for the next client");
                }
            }
        }
    }
}

/// A TCP stream whose reads and writes all end by one deadline; past it they fail with
/// [`io::ErrorKind::TimedOut`].
#[derive(Debug)]
pub struct Bounded {
    stream: TcpStream,
    deadline: Option<Instant>,
    limit: Duration,
}

impl Bounded {
    /// `stream`, its reads and writes to end within `limit` from now.
    pub fn new(stream: TcpStream, limit: Duration) -> Bounded {
        Bounded { stream, deadline: Instant::now().checked_add(limit), limit }
    }

    /// The stream underneath.
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Lifts the deadline for what comes after the exchange (a benchmark's run, as long
    /// as it takes): from then on, a peer that is gone is found by TCP keepalive, which
    /// gives up after about 25 s without an answer.
    pub fn unbounded(&mut self) -> io::Result<()> {
        use socket2::{SockRef, TcpKeepalive};
        self.deadline = None;
        self.stream.set_read_timeout(None)?;
        self.stream.set_write_timeout(None)?;
        let keepalive = TcpKeepalive::new()
            .with_time(Duration::from_secs(10))
            .with_interval(Duration::from_secs(5))
            .with_retries(3);
        SockRef::from(&self.stream).set_tcp_keepalive(&keepalive)
    }

    /// The time left, as a socket timeout (never zero, which would mean none).
    fn left(&self) -> io::Result<Option<Duration>> {
        match self.deadline {
            None => Ok(None),
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Ok(Some(left)),
                _ => Err(self.timed_out()),
            },
        }
    }

    fn timed_out(&self) -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, format!("no answer within {} s", self.limit.as_secs_f64()))
    }

    /// A timeout of the socket reads as EAGAIN: name it.
    fn name_timeout(&self, e: io::Error) -> io::Error {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => self.timed_out(),
            _ => e,
        }
    }
}

impl Read for Bounded {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(left)?;
        self.stream.read(buf).map_err(|e| self.name_timeout(e))
    }
}

impl Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(left)?;
        self.stream.write(buf).map_err(|e| self.name_timeout(e))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// Refuses a peer of the other IP family at once: the device could never reach it.
pub fn same_family(mine: SocketAddr, theirs: SocketAddr) -> Result<(), String> {
    if mine.is_ipv4() == theirs.is_ipv4() {
        Ok(())
    } else {
        Err(format!(
            "the peer's address {} is {} but this device's ({}) is {}: choose addresses of one family",
            theirs.ip(),
            family(theirs),
            mine.ip(),
            family(mine)
        ))
    }
}

fn family(a: SocketAddr) -> &'static str {
    if a.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// Writes `value` as one line of JSON and flushes it.
pub fn send_line<T: Serialize>(w: &mut impl Write, value: &T) -> Result<(), String> {
    let mut line = serde_json::to_string(value).map_err(|e| e.to_string())?;
    line.push('\n');
    w.write_all(line.as_bytes()).map_err(|e| e.to_string())?;
    w.flush().map_err(|e| e.to_string())
}

/// Why [`recv_line`] returned no value.
#[derive(Debug)]
pub enum LineError {
    /// Reading or writing failed, or the line is not UTF-8.
    Io(io::Error),
    /// The line goes on past the limit.
    TooLong(usize),
    /// The line is not the JSON expected (an empty one: the peer closed without a line).
    Json(serde_json::Error),
}

impl LineError {
    /// The message, with `what` (what the line should have held) before anything wrong
    /// with the line itself.
    pub fn about(&self, what: &str) -> String {
        match self {
            LineError::Io(_) => self.to_string(),
            _ => format!("{what}: {self}"),
        }
    }
}

impl fmt::Display for LineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LineError::Io(e) => e.fmt(f),
            LineError::TooLong(max) => write!(f, "line longer than {max} bytes"),
            LineError::Json(e) => e.fmt(f),
        }
    }
}

/// Reads one line, of at most `max_len` bytes before its newline (more is refused, not
/// buffered), and parses it as JSON. End of input before a newline ends the line.
pub fn recv_line<T: DeserializeOwned>(r: &mut impl BufRead, max_len: usize) -> Result<T, LineError> {
    let mut buf = Vec::new();
    let limit = u64::try_from(max_len).unwrap_or(u64::MAX).saturating_add(1);
    r.by_ref().take(limit).read_until(b'\n', &mut buf).map_err(LineError::Io)?;
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > max_len {
        return Err(LineError::TooLong(max_len));
    }
    let text = String::from_utf8(buf)
        .map_err(|_| LineError::Io(io::Error::new(io::ErrorKind::InvalidData, "line is not UTF-8")))?;
    serde_json::from_str(text.trim()).map_err(LineError::Json)
}

/// Prints `mine` as one JSON line on stdout, then reads the peer's line from stdin.
pub fn stdio_swap<T: Serialize, U: DeserializeOwned>(mine: &T) -> Result<U, LineError> {
    send_line(&mut io::stdout().lock(), mine).map_err(|e| LineError::Io(io::Error::other(e)))?;
    recv_line(&mut io::stdin().lock(), MAX_LINE)
}

/// Reads and discards stdin until it closes: the peer's signal that it is done.
pub fn wait_for_stdin_close() -> io::Result<()> {
    io::copy(&mut io::stdin().lock(), &mut io::sink()).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_one_line_at_a_time() {
        let mut r = io::Cursor::new(b"{\"a\":1}\n[2]\n3".to_vec());
        let a: serde_json::Value = recv_line(&mut r, MAX_LINE).unwrap();
        assert_eq!(a["a"], 1);
        assert_eq!(recv_line::<Vec<u32>>(&mut r, MAX_LINE).unwrap(), vec![2]);
        // The last line needs no newline.
        assert_eq!(recv_line::<u32>(&mut r, MAX_LINE).unwrap(), 3);
        // Nothing left: not JSON.
        assert!(matches!(recv_line::<u32>(&mut r, MAX_LINE), Err(LineError::Json(_))));
    }

    #[test]
    fn refuses_a_line_over_the_limit() {
        let exact = format!("\"{}\"\n", "x".repeat(8));
        assert_eq!(recv_line::<String>(&mut io::Cursor::new(exact.as_bytes()), 10).unwrap(), "x".repeat(8));
        let long = format!("\"{}\"\n", "x".repeat(9));
        let e = recv_line::<String>(&mut io::Cursor::new(long.as_bytes()), 10).unwrap_err();
        assert!(matches!(e, LineError::TooLong(10)), "{e}");
        assert_eq!(e.about("bad endpoint"), "bad endpoint: line longer than 10 bytes");
        // Without a newline too.
        let e = recv_line::<String>(&mut io::Cursor::new(&long.as_bytes()[..11]), 10).unwrap_err();
        assert!(matches!(e, LineError::TooLong(10)), "{e}");
    }

    #[test]
    fn a_line_round_trips() {
        let mut v = Vec::new();
        send_line(&mut v, &serde_json::json!({"qpn": 17})).unwrap();
        assert_eq!(v, b"{\"qpn\":17}\n");
        let back: serde_json::Value = recv_line(&mut io::Cursor::new(v), MAX_LINE).unwrap();
        assert_eq!(back["qpn"], 17);
    }

    #[test]
    fn connect_gives_up_after_its_deadline() {
        // A port nobody listens on: bound, then closed.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let t = Instant::now();
        let e = connect("127.0.0.1", port, Duration::from_millis(200)).unwrap_err();
        assert!(e.starts_with(&format!("cannot reach 127.0.0.1:{port}: ")), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}
