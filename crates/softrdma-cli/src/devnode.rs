//! `/dev/infiniband/<dev_name>` for programs that insist on it.
//!
//! UCX lists an RDMA device only if `/dev/infiniband/<ibv_device.dev_name>` is a character
//! device it may read and write; without it the device is dropped without a word, and
//! Open MPI's UCX layer with it. A host without RDMA hardware has no `/dev/infiniband`,
//! and only root could create one. `softrdma exec` therefore runs the program in a private
//! mount namespace (inside a user namespace when not root, so no privilege is needed)
//! whose `/dev` is an overlay of the real one with one more directory: each device's
//! entry is `/dev/null` bound to the expected name. Nothing changes outside the
//! namespace; the staging directory is removed before the program starts.

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};

/// Gives this process (and what it executes) `/dev/infiniband/<name>` for each name that
/// is missing. Call from a single-threaded process: it enters new namespaces.
pub fn provide(names: &[String]) -> io::Result<()> {
    let missing: Vec<&String> =
        names.iter().filter(|n| !Path::new("/dev/infiniband").join(n.as_str()).exists()).collect();
    if missing.is_empty() {
        return Ok(());
    }
    enter_namespaces()?;
    let submounts = dev_submounts()?;
    let stage = make_stage()?;
    let result = build(&stage, &submounts, &missing);
    // The staging tree is detached in every case; what was mounted from it stays.
    let _ = umount_detach(&stage);
    let _ = std::fs::remove_dir(&stage);
    result
}

fn build(stage: &Path, submounts: &[PathBuf], names: &[&String]) -> io::Result<()> {
    let (old, upper, work) = (stage.join("old"), stage.join("upper"), stage.join("work"));
    for d in [&old, &upper, &work, &upper.join("infiniband")] {
        std::fs::create_dir_all(d)?;
    }
    mount(Some(Path::new("/dev")), &old, None, libc::MS_BIND | libc::MS_REC, None)?;
    let opts = format!("lowerdir={},upperdir={},workdir={}", old.display(), upper.display(), work.display());
    mount(None, Path::new("/dev"), Some("overlay"), 0, Some(&opts))
        .map_err(|e| io::Error::new(e.kind(), format!("overlay on /dev: {e}")))?;
    // The overlay shows /dev's own files; the file systems mounted below /dev (pts, shm,
    // mqueue, ...) are bound back in.
    for m in submounts {
        let rel = m.strip_prefix("/dev").unwrap_or(m);
        mount(Some(&old.join(rel)), m, None, libc::MS_BIND | libc::MS_REC, None)?;
    }
    for name in names {
        let entry = Path::new("/dev/infiniband").join(name.as_str());
        std::fs::File::create(&entry)?;
        mount(Some(&old.join("null")), &entry, None, libc::MS_BIND, None)?;
    }
    Ok(())
}

/// A private mount namespace; when not root, inside a new user namespace that maps the
/// caller's uid and gid to themselves (the program keeps its identity; capabilities in
/// the namespace end at `exec`).
fn enter_namespaces() -> io::Result<()> {
    // SAFETY: these calls take no pointers.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let flags = if uid == 0 { libc::CLONE_NEWNS } else { libc::CLONE_NEWUSER | libc::CLONE_NEWNS };
    // SAFETY: unshare takes no pointers; the process is single-threaded (the caller's
    // contract), as CLONE_NEWUSER requires.
    if unsafe { libc::unshare(flags) } != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("unshare: {}", io::Error::last_os_error()),
        ));
    }
    if uid != 0 {
        std::fs::write("/proc/self/setgroups", "deny")?;
        std::fs::write("/proc/self/uid_map", format!("{uid} {uid} 1"))?;
        std::fs::write("/proc/self/gid_map", format!("{gid} {gid} 1"))?;
    }
    // Nothing mounted here propagates back to the host.
    mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE, None)
}

/// The mount points directly below `/dev` (binding them recursively brings the rest).
fn dev_submounts() -> io::Result<Vec<PathBuf>> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mut out: Vec<PathBuf> = Vec::new();
    for line in info.lines() {
        // Field 5 is the mount point, with spaces and such octal-escaped.
        let Some(point) = line.split(' ').nth(4) else { continue };
        let Some(rel) = point.strip_prefix("/dev/") else { continue };
        if rel.is_empty() || rel.contains('\\') {
            continue;
        }
        let top = Path::new("/dev").join(rel.split('/').next().unwrap_or(rel));
        if !out.contains(&top) {
            out.push(top);
        }
    }
    Ok(out)
}

/// A fresh directory with a tmpfs on it, for the overlay's upper layer.
fn make_stage() -> io::Result<PathBuf> {
    let template = std::env::temp_dir().join("softrdma-dev.XXXXXX");
    let c = CString::new(template.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "temporary directory name"))?;
    let mut buf = c.into_bytes_with_nul();
    // SAFETY: buf is a writable NUL-terminated template ending in XXXXXX.
    if unsafe { libc::mkdtemp(buf.as_mut_ptr().cast()) }.is_null() {
        return Err(io::Error::last_os_error());
    }
    buf.pop();
    let stage = PathBuf::from(String::from_utf8_lossy(&buf).into_owned());
    if let Err(e) = mount(None, &stage, Some("tmpfs"), 0, Some("mode=0700")) {
        let _ = std::fs::remove_dir(&stage);
        return Err(e);
    }
    Ok(stage)
}

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path with NUL"))
}

fn mount(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let src = src.map(cstr).transpose()?;
    let target_c = cstr(target)?;
    let fstype = fstype.map(|f| CString::new(f).expect("no NUL"));
    let data =
        data.map(CString::new).transpose().map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL"))?;
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is NULL or a NUL-terminated string alive for the call.
    let r = unsafe { libc::mount(ptr(&src), target_c.as_ptr(), ptr(&fstype), flags, ptr(&data).cast()) };
    if r != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("mount on {}: {e}", target.display())));
    }
    Ok(())
}

fn umount_detach(target: &Path) -> io::Result<()> {
    let t = cstr(target)?;
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
