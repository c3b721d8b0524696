#!/usr/bin/env python3
"""Reads the timelines softrdma's `timeline` feature wrote (/tmp/softrdma-timeline-*.txt,
one per process) and prints what both sides did in a few bursts of a bandwidth test: from
one completion the client polled to the next, each post, send call and receive call, with
microseconds from the burst's start (the server's polls and receive posts summed up).
Then the median burst. Usage: bench/timeline.py [FILES...]"""
import glob
import statistics
import sys

files = sys.argv[1:] or glob.glob("/tmp/softrdma-timeline-*.txt")
events = []
for f in files:
    pid = f.rsplit("-", 1)[-1].split(".")[0]
    for line in open(f):
        ns, name, tid, count = line.split()
        events.append((int(ns), name, tid, int(count), pid))
if not events:
    sys.exit("no timeline files")
events.sort()
pids = sorted({e[4] for e in events})
# The stretch every process covered.
lo = max(min(e[0] for e in events if e[4] == p) for p in pids)
hi = min(max(e[0] for e in events if e[4] == p) for p in pids)
events = [e for e in events if lo <= e[0] <= hi]
posters = [p for p in pids if any(e[1] == "post" for e in events if e[4] == p)]
if not posters:
    sys.exit("no posts in the common stretch")
client = posters[0]
marks = [i for i, e in enumerate(events) if e[4] == client and e[1] == "polled"]
bursts = [(events[b][0] - events[a][0]) / 1000 for a, b in zip(marks, marks[1:])]
print(f"{len(pids)} processes, {(hi - lo) / 1e3:.0f} us in common, {len(bursts)} client polls that found completions")
for k in range(len(marks) // 2, min(len(marks) // 2 + 3, len(marks) - 1)):
    a, b = marks[k], marks[k + 1]
    t0 = events[a][0]
    print(f"--- {bursts[k]:.1f} us")
    polled = posted = 0
    for ns, name, tid, count, pid in events[a : b + 1]:
        side = "client" if pid == client else "server"
        if side == "server" and name in ("polled", "post-recv"):
            polled += count if name == "polled" else 0
            posted += name == "post-recv"
            continue
        if side == "server" and (polled or posted):
            print(f"{'':9}server: {polled} completions polled, {posted} receives posted")
            polled = posted = 0
        print(f"{(ns - t0) / 1000:8.2f} {side} {name} {count}")
    if polled or posted:
        print(f"{'':9}server: {polled} completions polled, {posted} receives posted")
if bursts:
    print(f"median {statistics.median(bursts):.1f} us between the client's completions")
