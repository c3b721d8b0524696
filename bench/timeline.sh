#!/usr/bin/env bash
# What both sides of a benchmark do within one burst: builds softrdma with the `timeline`
# feature (into target/timeline, apart from the normal build), runs `softrdma perf` on
# loopback with SOFTRDMA_TIMELINE set 2.5 s ahead, so that both processes write their last
# events of the same moment (crates/softrdma/src/timeline.rs), and prints a few bursts with
# bench/timeline.py. Arguments go to `softrdma perf`; the default is the 2-byte rate test.
# Usage: bench/timeline.sh [send_bw -s 2 -D 4]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- send_bw -s 2 -D 4
CARGO_TARGET_DIR=target/timeline cargo build --release -q -p softrdma-cli --features softrdma/timeline
rm -f /tmp/softrdma-timeline-*.txt
at=$(awk '{print $1 + 2.5}' /proc/uptime)
SOFTRDMA_TIMELINE=$at timeout 120 target/timeline/release/softrdma perf "$@" --local | grep -E '^ *[0-9]+ +[0-9]+' || true
python3 bench/timeline.py /tmp/softrdma-timeline-*.txt
