//! `softrdma exec`: runs an unmodified RDMA program on softrdma's drop-in
//! `libibverbs.so.1` (library path and device chosen for it).

use std::ffi::OsString;
use std::net::IpAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

/// Names the directory holding the built C libraries (else it is looked for beside the
/// `softrdma` binary: `target/softrdma-lib` for `target/<profile>/softrdma`).
pub const LIB_DIR_ENV: &str = "SOFTRDMA_LIB_DIR";

#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    /// The local address the program uses: its device is listed first, with this address
    /// as GID 0. Two programs on one host need two addresses (127.0.0.2, 127.0.0.3).
    #[arg(long)]
    pub bind: Option<IpAddr>,
    /// The peers are Linux rxe or RoCE NICs (ICRCs checked as kernels build them).
    #[arg(long)]
    pub foreign: bool,
    /// The UDP port of every device (default 4791); both peers must use the same one.
    #[arg(long)]
    pub udp_port: Option<u16>,
    /// Do not provide `/dev/infiniband/<device>` (by default, when it is missing, the
    /// program runs in a private mount namespace that has it, for UCX; see `devnode`).
    #[arg(long)]
    pub no_dev_node: bool,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true, value_name = "PROGRAM")]
    pub program: Vec<OsString>,
}

/// Where the drop-in libraries are, if built.
pub fn lib_dir() -> Option<PathBuf> {
    let has_lib = |d: &Path| d.join("libibverbs.so.1").is_file();
    if let Some(d) = std::env::var_os(LIB_DIR_ENV) {
        return Some(PathBuf::from(d)).filter(|d| has_lib(d));
    }
    let exe = std::env::current_exe().ok()?;
    let bin_dir = exe.parent()?;
    [bin_dir.join("softrdma-lib"), bin_dir.parent()?.join("softrdma-lib")].into_iter().find(|d| has_lib(d))
}

/// Replaces this process with the program; returns only on failure.
pub fn run(args: &ExecArgs) -> i32 {
    let Some(dir) = lib_dir() else {
        eprintln!(
            "softrdma exec: the drop-in libraries are not built. Run scripts/build-libs.sh in the \
             source tree (it links target/softrdma-lib/libibverbs.so.1; cargo alone cannot apply \
             its symbol versions), or set {LIB_DIR_ENV}."
        );
        return 2;
    };
    let mut path = OsString::from(&dir);
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
        path.push(":");
        path.push(old);
    }
    let mut cmd = std::process::Command::new(&args.program[0]);
    cmd.args(&args.program[1..]).env("LD_LIBRARY_PATH", path);
    if let Some(b) = args.bind {
        cmd.env(softrdma_verbs::BIND_ENV, b.to_string());
    }
    if args.foreign {
        cmd.env(softrdma_verbs::FOREIGN_ENV, "1");
    }
    if let Some(p) = args.udp_port {
        cmd.env(softrdma::PORT_ENV, p.to_string());
    }
    if !args.no_dev_node {
        let mut names: Vec<String> =
            softrdma::devices().unwrap_or_default().into_iter().map(|d| d.name).collect();
        if let Some(d) = args.bind.and_then(|b| softrdma::find_device(&b.to_string()).ok()) {
            names.push(d.name);
        }
        let names: Vec<String> = names.iter().map(|n| softrdma_verbs::dev_name(n)).collect();
        if let Err(e) = crate::devnode::provide(&names) {
            eprintln!(
                "softrdma exec: no /dev/infiniband entry for the program ({e}); UCX will not list \
                 the device (other programs do not need it; --no-dev-node skips this)"
            );
        }
    }
    let e = cmd.exec();
    eprintln!("softrdma exec: {}: {e}", args.program[0].to_string_lossy());
    127
}
