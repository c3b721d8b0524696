"""Draws bench/results/sweep.csv (from bench/sweep.sh): latency and bandwidth by message
size, softrdma beside raw UDP and UCX over TCP. Usage: plot_sweep.py CSV PNG"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = list(csv.DictReader(open(sys.argv[1])))
size = [int(r["size"]) for r in rows]


def col(name):
    return [float(r[name]) if r[name] not in ("", "None") else None for r in rows]


def line(ax, name, label, style):
    pts = [(s, v) for s, v in zip(size, col(name)) if v is not None]
    if pts:
        ax.plot(*zip(*pts), style, label=label)


fig, (lat, bw) = plt.subplots(1, 2, figsize=(12, 4.5))
line(lat, "sr_lat", "softrdma send_lat (median)", "o-")
line(lat, "sr_lat_p99", "softrdma send_lat (99 %)", "o:")
line(lat, "udp_lat", "raw UDP ping-pong", "s-")
line(lat, "ucx_lat", "UCX over TCP (ucp_am_lat)", "^-")
lat.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="one-way latency (µs)")
lat.set_title("Latency, busy-polling, loopback")
line(bw, "sr_bw", "softrdma write_bw", "o-")
line(bw, "udp_bw", "raw UDP, GSO+GRO (segments of min(size, 4096))", "s-")
line(bw, "ucx_bw", "UCX over TCP (ucp_am_bw)", "^-")
bw.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="bandwidth (MiB/s)")
bw.set_title("Bandwidth, one QP / one stream, loopback")
for ax in (lat, bw):
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=100)
print("wrote", sys.argv[2])
