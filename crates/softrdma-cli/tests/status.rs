//! The status tools run as processes: `softrdma devices`, `devinfo`, `stat` and `link`,
//! checked for the layout of `ibv_devices`, `ibv_devinfo`, `ibstat` and `ibdev2netdev` and for
//! the loopback device's values.

use std::process::Output;
use std::time::Duration;

mod common;
use common::{output, softrdma};

const LIMIT: Duration = Duration::from_secs(20);

fn run(args: &[&str]) -> Output {
    output(&mut softrdma(args), LIMIT)
}

/// Runs, expects success, returns stdout.
fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// The value after `key:` and tabs on the line that has it.
fn field<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.trim_start().strip_prefix(key).and_then(|r| r.strip_prefix(':')))
        .unwrap_or_else(|| panic!("no {key} in\n{out}"))
        .trim()
}

#[test]
fn devices_lists_loopback_with_a_guid() {
    let out = ok(&["devices"]);
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("    device          \t   node GUID"));
    assert_eq!(lines.next(), Some("    ------          \t----------------"));
    let lo = lines.find(|l| l.split_whitespace().next() == Some("srdma_lo")).expect(&out);
    let guid = lo.split_whitespace().nth(1).unwrap();
    assert_eq!(guid.len(), 16, "{lo}");
    assert!(guid.chars().all(|c| c.is_ascii_hexdigit()), "{lo}");
    assert!(lo.starts_with("    srdma_lo"), "{lo:?}");
}

#[test]
fn devinfo_of_loopback() {
    let out = ok(&["devinfo", "-d", "127.0.0.1"]);
    assert!(out.starts_with("hca_id:\tsrdma_lo\n"), "{out}");
    assert!(out.contains("\ttransport:\t\t\tInfiniBand (0)\n"), "{out}");
    assert!(out.contains("\t\tport:\t1\n"), "{out}");
    assert!(out.contains("\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n"), "{out}");
    assert!(out.contains("\t\t\tmax_mtu:\t\t4096 (5)\n"), "{out}");
    // The loopback MTU is 65536: the largest IB MTU fits.
    assert!(out.contains("\t\t\tactive_mtu:\t\t4096 (5)\n"), "{out}");
    assert!(out.contains("\t\t\tlink_layer:\t\tEthernet\n"), "{out}");
    assert_eq!(field(&out, "vendor_id"), "0x0000");
    assert_eq!(field(&out, "phys_port_cnt"), "1");
    assert_eq!(field(&out, "port_lmc"), "0x00");
    let guid = field(&out, "node_guid");
    assert_eq!(guid.len(), 19, "{guid}");
    assert_eq!(guid.split(':').count(), 4, "{guid}");
    assert_eq!(field(&out, "sys_image_guid"), guid);
    assert!(!out.contains("GID["), "GIDs only with -v:\n{out}");
    assert!(!out.contains("max_qp"), "limits only with -v:\n{out}");
    assert!(out.ends_with("\n\n"), "a blank line ends the port: {out:?}");
}

#[test]
fn devinfo_verbose_has_limits_and_gids() {
    let out = ok(&["devinfo", "-d", "srdma_lo", "-v"]);
    assert!(out.contains("\t\t\tGID[  0]:\t\t::ffff:127.0.0.1, RoCE v2\n"), "{out}");
    assert_eq!(field(&out, "max_qp"), softrdma::MAX_QP.to_string());
    assert_eq!(field(&out, "max_qp_wr"), softrdma::MAX_QP_WR.to_string());
    assert_eq!(field(&out, "max_sge"), softrdma::MAX_SGE.to_string());
    assert_eq!(field(&out, "max_cqe"), softrdma::MAX_CQE.to_string());
    assert_eq!(field(&out, "max_mr"), softrdma::MAX_MR.to_string());
    assert_eq!(field(&out, "max_qp_rd_atom"), softrdma::MAX_QP_RD_ATOM.to_string());
    assert_eq!(field(&out, "atomic_cap"), "ATOMIC_HCA (1)");
    assert_eq!(field(&out, "phys_state"), "LINK_UP (5)");
    // The GID table holds lo's addresses, IPv4 first; SOFTRDMA_GIDS adds more.
    let gids = out.lines().filter(|l| l.contains("GID[")).count();
    assert!(gids >= 1);
    assert_eq!(field(&out, "gid_tbl_len"), gids.to_string());
    let more = output(
        softrdma(["devinfo", "-d", "srdma_lo", "-v"]).env("SOFTRDMA_GIDS", "127.0.0.2,127.0.0.3"),
        LIMIT,
    );
    let more = String::from_utf8_lossy(&more.stdout);
    assert_eq!(field(&more, "gid_tbl_len"), (gids + 2).to_string(), "{more}");
    assert!(more.contains(&format!("\t\t\tGID[{:3}]:\t\t::ffff:127.0.0.3, RoCE v2\n", gids + 1)), "{more}");
    // The port lines stay after the device's.
    assert!(out.find("max_qp:").unwrap() < out.find("\t\tport:\t1").unwrap());
}

#[test]
fn devinfo_of_an_unlisted_loopback_address() {
    let out = ok(&["devinfo", "-d", "127.0.0.2", "-v"]);
    assert!(out.starts_with("hca_id:\tsrdma_lo"), "{out}");
    assert!(out.contains("PORT_ACTIVE (4)"), "{out}");
    assert!(out.contains("::ffff:127.0.0.2, RoCE v2"), "{out}");
}

#[test]
fn devinfo_of_an_unknown_device_fails() {
    for name in ["nosuch", "192.0.2.254"] {
        let o = run(&["devinfo", "-d", name]);
        assert_eq!(o.status.code(), Some(1), "{name}");
        assert!(o.stdout.is_empty(), "{name}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(name), "{name}: {err}");
    }
    let o = run(&["stat", "nosuch"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nosuch"));
}

#[test]
fn devinfo_port_option() {
    let out = ok(&["devinfo", "-d", "127.0.0.1", "-i", "1"]);
    assert!(out.contains("\t\tport:\t1\n"), "{out}");
    let o = run(&["devinfo", "-d", "127.0.0.1", "-i", "2"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!String::from_utf8_lossy(&o.stderr).is_empty());
}

#[test]
fn devinfo_list() {
    let out = ok(&["devinfo", "-l"]);
    assert!(out.lines().next().unwrap().ends_with(" found:"), "{out}");
    assert!(out.lines().any(|l| l == "\tsrdma_lo"), "{out}");
}

#[test]
fn devinfo_json() {
    let out = ok(&["devinfo", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let devs = v.as_array().expect("an array");
    let lo = devs.iter().find(|d| d["hca_id"] == "srdma_lo").expect(&out);
    assert_eq!(lo["address"], "127.0.0.1");
    assert_eq!(lo["netdev"], "lo");
    assert_eq!(lo["transport"], "InfiniBand");
    assert_eq!(lo["vendor_id"], 0);
    assert_eq!(lo["max_qp"], softrdma::MAX_QP);
    assert_eq!(lo["node_guid"].as_str().unwrap().len(), 19);
    let port = &lo["ports"][0];
    assert_eq!(port["port"], 1);
    assert_eq!(port["state"], "PORT_ACTIVE");
    assert_eq!(port["active_mtu"], 4096);
    assert_eq!(port["link_layer"], "Ethernet");
    assert_eq!(port["gids"][0]["gid"], "::ffff:127.0.0.1");
    assert_eq!(port["gids"][0]["type"], "RoCE v2");

    let one: serde_json::Value =
        serde_json::from_str(&ok(&["devinfo", "-d", "127.0.0.2", "--json"])).unwrap();
    assert_eq!(one.as_array().unwrap().len(), 1);
    assert_eq!(one[0]["address"], "127.0.0.2");
}

#[test]
fn stat_shows_an_active_ethernet_port() {
    let out = ok(&["stat"]);
    let start = out.find("CA 'srdma_lo'\n").expect(&out);
    let lo = &out[start..];
    let lo = &lo[..lo[1..].find("CA '").map_or(lo.len(), |e| e + 1)];
    for line in [
        "\tNumber of ports: 1\n",
        "\tPort 1:\n",
        "\t\tState: Active\n",
        "\t\tPhysical state: LinkUp\n",
        "\t\tBase lid: 0\n",
        "\t\tLMC: 0\n",
        "\t\tSM lid: 0\n",
        "\t\tPort GUID: 0x0000ffff7f000001\n",
        "\t\tLink layer: Ethernet\n",
    ] {
        assert!(lo.contains(line), "{line:?} in\n{lo}");
    }
    let guid = field(lo, "Node GUID");
    assert!(guid.starts_with("0x") && guid.len() == 18, "{guid}");
    assert_eq!(field(lo, "System image GUID"), guid);
    assert!(field(lo, "Rate").parse::<f64>().is_ok(), "{lo}");

    let one = ok(&["stat", "srdma_lo"]);
    assert!(one.starts_with("CA 'srdma_lo'\n"), "{one}");
    assert_eq!(one.matches("CA '").count(), 1, "{one}");

    let port = ok(&["stat", "srdma_lo", "1"]);
    assert!(port.starts_with("CA: 'srdma_lo'\nPort 1:\nState: Active\n"), "{port}");
    assert_eq!(run(&["stat", "srdma_lo", "2"]).status.code(), Some(1));

    assert!(ok(&["stat", "-l"]).lines().any(|l| l == "srdma_lo"));
    assert!(ok(&["stat", "-p", "srdma_lo"]) == "0x0000ffff7f000001\n");
}

#[test]
fn link_maps_devices_to_interfaces() {
    let out = ok(&["link"]);
    assert!(out.lines().any(|l| l == "srdma_lo port 1 ==> lo (Up)"), "{out}");
    assert!(out
        .lines()
        .all(|l| l.contains(" port 1 ==> ") && (l.ends_with("(Up)") || l.ends_with("(Down)"))));
}
