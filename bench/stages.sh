#!/usr/bin/env bash
# Where a ping-pong's user-space turnaround goes: builds softrdma with the stage-probe
# feature (into target/stages, apart from the normal build) and runs `perf send_lat` on
# loopback; each busy-polling thread prints, every 20,000 turnarounds, the mean time of
# each stage between a receive call that returned the message and the send call of the
# answer (crates/softrdma/src/stages.rs). Beside it, the raw UDP floors: a ping-pong with
# plain send/recv on connected sockets, and one with softrdma's system calls
# (udp-probe pingpong-mmsg). ITERS (default 100000) sets the round trips.
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS=${ITERS:-100000}
CARGO_TARGET_DIR=target/stages cargo build --release -q -p softrdma-cli --features softrdma/stage-probe
cargo build --release -q -p udp-probe
timeout 60 target/release/udp-probe pingpong "$ITERS" 8
timeout 60 target/release/udp-probe pingpong-mmsg "$ITERS" 8
timeout 120 target/stages/release/softrdma perf send_lat -s 8 -n "$ITERS" --local 2>&1 |
  grep -E '^stages|^ 8 ' | tail -3
