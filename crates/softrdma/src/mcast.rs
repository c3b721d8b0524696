//! Multicast groups: the mapping between IP multicast addresses and MGIDs, and the group
//! MTU rule.
//!
//! RoCEv2 multicast is IP multicast: a UD SEND to destination QP 0xFFFFFF whose IP
//! destination is the group. An IPv4 group `m` is the MGID `::ffff:m`; an IPv6 group is
//! its own 16 bytes. (rdma_cm maps IPv4 groups to `ff0e::ffff:m` for RoCE v1 only; that
//! form is accepted too.) Membership is the kernel's: joining a group opens a socket on
//! the group's address and port that the kernel adds to the group (IGMP or MLD), which
//! needs no privilege.
//!
//! The group MTU rule (seed 003; IBTA 15.2.5.17, enforced by a subnet manager on a real
//! fabric): the first member's active MTU becomes the group's; a device whose active MTU
//! is smaller cannot join while the group has members. softrdma has no subnet manager, so
//! the rule holds among the processes of one user on one host, through a file per group
//! in the user's runtime directory (`$XDG_RUNTIME_DIR/softrdma/groups/`), locked while it
//! is read and written; members of processes that died are forgotten.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use softrdma_proto::qp::Mtu;

use crate::{Error, Result};

/// The MGID of a multicast address, or `None` if `group` is not one.
pub fn mgid_of(group: IpAddr) -> Option<[u8; 16]> {
    group.is_multicast().then(|| crate::gid_of(group))
}

/// The multicast address of an MGID (`::ffff:m`, `ff0e::ffff:m` or an IPv6 group), or
/// `None` if it names no multicast group.
pub fn group_of_mgid(mgid: [u8; 16]) -> Option<IpAddr> {
    let v6 = Ipv6Addr::from(mgid);
    let group = match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None if mgid[..2] == [0xff, 0x0e] && mgid[2..10] == [0; 8] && mgid[10..12] == [0xff, 0xff] => {
            IpAddr::V4(Ipv4Addr::new(mgid[12], mgid[13], mgid[14], mgid[15]))
        }
        None => IpAddr::V6(v6),
    };
    group.is_multicast().then_some(group)
}

/// This process's membership of a group in the host-wide registry, for the MTU rule.
#[derive(Debug)]
pub(crate) struct Membership {
    path: PathBuf,
    line: String,
}

fn locked(path: &PathBuf) -> Result<File> {
    let f = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(f)
}

fn alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks that the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// The members in the file, oldest first, without those of dead processes.
fn members(f: &mut File) -> Result<Vec<(String, Mtu)>> {
    let mut text = String::new();
    f.rewind()?;
    f.read_to_string(&mut text)?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let pid: i32 = w.next()?.parse().ok()?;
            let bytes: u32 = w.last()?.parse().ok()?;
            let mtu = (1..=5).filter_map(Mtu::from_enum).find(|m| m.bytes() == bytes)?;
            alive(pid).then(|| (l.to_string(), mtu))
        })
        .collect())
}

fn rewrite(f: &mut File, lines: &[String]) -> Result<()> {
    f.set_len(0)?;
    f.rewind()?;
    for l in lines {
        writeln!(f, "{l}")?;
    }
    Ok(())
}

impl Membership {
    /// Joins `group` for a QP (`who`) of a device whose active MTU is `mtu`; returns the
    /// membership and the group's MTU, or refuses if the group's is larger than `mtu`.
    pub(crate) fn join(group: IpAddr, mtu: Mtu, who: &str) -> Result<(Membership, Mtu)> {
        let Some(dir) = crate::introspect::private_dir().map(|d| d.join("groups")) else {
            // No private directory: no registry, so no rule to enforce.
            return Ok((Membership { path: PathBuf::new(), line: String::new() }, mtu));
        };
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(group.to_string().replace(':', "_"));
        let mut f = locked(&path)?;
        let mut list = members(&mut f)?;
        let group_mtu = list.first().map_or(mtu, |(_, m)| *m);
        if mtu.bytes() < group_mtu.bytes() {
            return Err(Error::GroupMtu { group, group_mtu: group_mtu.bytes(), device_mtu: mtu.bytes() });
        }
        let line = format!("{} {who} {}", std::process::id(), mtu.bytes());
        list.push((line.clone(), mtu));
        rewrite(&mut f, &list.into_iter().map(|(l, _)| l).collect::<Vec<_>>())?;
        Ok((Membership { path, line }, group_mtu))
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        if self.line.is_empty() {
            return;
        }
        let Ok(mut f) = locked(&self.path) else { return };
        let Ok(list) = members(&mut f) else { return };
        let rest: Vec<String> = list.into_iter().map(|(l, _)| l).filter(|l| *l != self.line).collect();
        // An empty file stays: removing it while another process waits for its lock would
        // let that process register in a file no one else opens.
        let _ = rewrite(&mut f, &rest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_map_to_mgids_and_back() {
        let g: IpAddr = "239.1.2.3".parse().unwrap();
        let mgid = mgid_of(g).unwrap();
        assert_eq!(mgid[..12], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(group_of_mgid(mgid), Some(g));
        let v1 = [0xff, 0x0e, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 1, 2, 3];
        assert_eq!(group_of_mgid(v1), Some(g), "rdma_cm's RoCE v1 form");
        let v6: IpAddr = "ff12::1:2".parse().unwrap();
        assert_eq!(group_of_mgid(mgid_of(v6).unwrap()), Some(v6));
        assert_eq!(mgid_of("10.0.0.1".parse().unwrap()), None);
        assert_eq!(group_of_mgid(crate::gid_of("10.0.0.1".parse().unwrap())), None);
        assert_eq!(group_of_mgid(crate::gid_of("fe80::1".parse().unwrap())), None);
    }
}
