//! The `softrdma` command.

use clap::{Parser, Subcommand};

mod capture;
mod cmatose;
mod connrate;
mod decode;
mod devnode;
mod exchange;
mod exec;
mod ipoib;
mod limits;
mod memserver;
mod perf;
mod pingpong;
mod relay;
mod res;
mod rping;
mod sim;
mod soak;
mod status;
mod tutorial;
mod udaddy;

/// softrdma: RDMA (RoCEv2) in user space over UDP.
#[derive(Debug, Parser)]
#[command(name = "softrdma", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Decode the RoCEv2 packets in pcap/pcapng captures and check their ICRCs.
    ///
    /// Prints one line per packet to UDP port 4791 and a summary. Exit status: 0 when every
    /// packet is well-formed with a good ICRC, 1 when any is not, 2 when a file cannot be read.
    Decode(decode::DecodeArgs),
    /// Run a mixed RC workload between two simulated endpoints over an impaired network.
    ///
    /// Deterministic for a given seed: loss, duplication, reordering and corruption all come
    /// from it. Every byte and completion is checked; the last line reports
    /// `ops=N completed=N data-errors=0 status-errors=0 ...`, and any error exits 1.
    Sim(sim::SimArgs),
    /// Ping-pong between two processes over RC or UD, like ibv_rc_pingpong.
    ///
    /// Run the server without a host, then the client with the server's host name. They
    /// exchange their QP endpoints over TCP (-p, 18515), then trade -n messages of -s bytes,
    /// checking every byte. Two processes on one host need different addresses
    /// (--bind 127.0.0.2 and --bind 127.0.0.3) or UDP ports (--udp-port). A server given an
    /// address (--bind, -d ADDRESS) listens on that address only: the client names it.
    Pingpong(pingpong::PingPongArgs),
    /// Expose a memory region for one-sided RDMA, then stay passive.
    ///
    /// Prints its endpoint (with the region) as a JSON line, reads the peer's, connects,
    /// and makes no further verbs call until stdin closes; then prints the region's CRC-32.
    Memserver(memserver::MemServerArgs),
    /// perftest's benchmarks: send_lat, send_bw, write_lat, write_bw, read_lat, read_bw,
    /// atomic_lat, atomic_bw.
    ///
    /// Server without a host, client with one, or both at once on loopback with --local.
    /// Options are perftest's.
    Perf(perf::PerfArgs),
    /// Relay UDP between two endpoints, dropping, duplicating, reordering, corrupting and
    /// delaying datagrams by a seeded schedule.
    ///
    /// Each endpoint uses the relay's address facing it as its peer's address. ICRCs are
    /// moved to the new addresses (a damaged packet stays damaged) before the relay's own
    /// damage. Counters are printed at exit.
    Relay(relay::RelayArgs),
    /// Mixed RC traffic between two processes through an impaired relay, every byte and
    /// completion checked, for --duration.
    ///
    /// Starts the relay and both endpoints itself. The last line is
    /// `ops=N data-errors=0 status-errors=0 ...`; any error exits 1.
    Soak(soak::SoakArgs),
    /// rdma_cm's ping test, like rping: `-s` serves, `-c -a ADDR` connects.
    ///
    /// Per iteration the server RDMA READs the client's ping buffer and RDMA WRITEs it back
    /// into a second one; `-v` prints each ping, `-V` checks it. Runs against the real
    /// rping in either role.
    Rping(rping::RpingArgs),
    /// rdma_cm's multi-connection test, like ucmatose: the server without -s, the client
    /// with `-s SERVER`.
    ///
    /// The client opens -c connections; the server SENDs -C messages of -S bytes on each,
    /// the client answers with as many, and the server disconnects them all. Runs against
    /// the real ucmatose in either role.
    Cmatose(cmatose::CmatoseArgs),
    /// rdma_cm's UD test, like udaddy: the server without -s, the client with `-s SERVER`.
    ///
    /// The client resolves the server's UD QP with SIDR for each of -c endpoints, SENDs -C
    /// messages of -S bytes, and gets as many replies. Runs against the real udaddy in
    /// either role.
    Udaddy(udaddy::UdaddyArgs),
    /// Connection setup rate and latency through the connection manager, beside TCP
    /// connect() on the same addresses.
    ///
    /// `softrdma connrate --listen ADDR` serves; `softrdma connrate ADDR` makes -n
    /// sequential and --concurrent simultaneous connections each way and prints the ratio.
    Connrate(connrate::ConnrateArgs),
    /// List the RDMA devices (like ibv_devices).
    Devices(status::DevicesArgs),
    /// Show devices, ports and limits (like ibv_devinfo).
    Devinfo(status::DevinfoArgs),
    /// Show the state of devices and ports (like ibstat).
    Stat(status::StatArgs),
    /// Show which interface each device is on (like ibdev2netdev).
    Link(status::LinkArgs),
    /// Show the devices, QPs and memory regions of running softrdma processes (like rdma
    /// res show).
    Res(res::ResArgs),
    /// Run an unmodified RDMA program (ibv_rc_pingpong, ib_write_bw, ...) on softrdma.
    ///
    /// Puts softrdma's drop-in libibverbs.so.1 on the program's library path and gives it
    /// its address: `softrdma exec --bind 127.0.0.2 -- ib_write_bw` and
    /// `softrdma exec --bind 127.0.0.3 -- ib_write_bw 127.0.0.2`. The libraries are built
    /// by scripts/build-libs.sh.
    Exec(exec::ExecArgs),
    /// Run the OFA tutorial's four ping-pongs (SEND/RECV busy-polling and
    /// wait-for-notify, RDMA WRITE/READ signaled and unsignaled) between two processes and
    /// rank them by round-trip time, with each side's user and kernel CPU %.
    Tutorial(tutorial::TutorialArgs),
    /// An IP network interface over softrdma (IPoIB): a TUN interface whose packets travel
    /// as UD datagrams (--mode datagram) or over an RC connection per neighbour (--mode
    /// connected, MTU 65520), neighbours found with ARP over a multicast group. Needs
    /// CAP_NET_ADMIN; runs until SIGINT or SIGTERM and prints its counters then.
    Ipoib(ipoib::IpoibArgs),
}

fn main() {
    // Like the C tools: a closed pipe (`softrdma decode x.pcap | head`) ends the process
    // quietly instead of making every print panic.
    // SAFETY: setting a signal's disposition to the default is always sound.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Decode(args) => decode::run(&args),
        Command::Sim(args) => sim::run(&args),
        Command::Pingpong(args) => pingpong::run(&args),
        Command::Memserver(args) => memserver::run(&args),
        Command::Perf(args) => perf::run(&args),
        Command::Relay(args) => relay::run(&args),
        Command::Rping(args) => rping::run(&args),
        Command::Cmatose(args) => cmatose::run(&args),
        Command::Udaddy(args) => udaddy::run(&args),
        Command::Connrate(args) => connrate::run(&args),
        Command::Soak(args) => soak::run(&args),
        Command::Devices(args) => status::devices(&args),
        Command::Devinfo(args) => status::devinfo(&args),
        Command::Stat(args) => status::stat(&args),
        Command::Res(args) => res::run(&args),
        Command::Link(args) => status::link(&args),
        Command::Exec(args) => exec::run(&args),
        Command::Tutorial(args) => tutorial::run(&args),
        Command::Ipoib(args) => ipoib::run(&args),
    };
    std::process::exit(code);
}
