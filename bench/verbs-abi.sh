#!/usr/bin/env bash
# What the C ABI costs: perftest's ib_send_lat and ib_write_bw on the drop-in
# libibverbs.so.1 against `softrdma perf` on the Rust API doing the same work, side by
# side in one run, alternating, best of ROUNDS. Prints each figure and the ratio.
# Usage: bench/verbs-abi.sh [ROUNDS]   (needs perftest; loopback, 127.0.0.2/.3)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
scripts/build-libs.sh >/dev/null
cargo build --release -q -p softrdma-cli
sr=$PWD/target/release/softrdma
export SOFTRDMA_PORT=$((30000 + $$ % 20000))
tcp=$((20000 + $$ % 20000))

run_pair() { # server-cmd... :: client-cmd...; prints the client's output
  local s=() c=()
  while [ "$1" != "::" ]; do s+=("$1"); shift; done
  shift
  c=("$@")
  tcp=$((tcp + 1))
  timeout 120 "${s[@]//@P@/$tcp}" >/dev/null 2>&1 &
  sleep 0.3
  timeout 120 "${c[@]//@P@/$tcp}" 2>&1
  wait
}
# The typical latency (t_typical, µs) and the average bandwidth (MiB/s) of a perftest table.
lat() { awk '/t_typical/ {h=1; next} h && $1 ~ /^[0-9]+$/ {print $5; exit}'; }
bw() { awk '/BW average/ {h=1; next} h && $1 ~ /^[0-9]+$/ {print $4; exit}'; }

best_c_lat=999999 best_r_lat=999999 best_c_bw=0 best_r_bw=0
for _ in $(seq "$rounds"); do
  c=$(run_pair $sr exec --bind 127.0.0.2 -- ib_send_lat -p @P@ -n 20000 :: \
    $sr exec --bind 127.0.0.3 -- ib_send_lat -p @P@ -n 20000 127.0.0.2 | lat)
  r=$(run_pair $sr perf send_lat -d 127.0.0.2 -p @P@ -n 20000 :: \
    $sr perf send_lat -d 127.0.0.3 -p @P@ -n 20000 127.0.0.2 | lat)
  cb=$(run_pair $sr exec --bind 127.0.0.2 -- ib_write_bw -p @P@ -n 20000 :: \
    $sr exec --bind 127.0.0.3 -- ib_write_bw -p @P@ -n 20000 127.0.0.2 | bw)
  rb=$(run_pair $sr perf write_bw -d 127.0.0.2 -p @P@ -n 20000 :: \
    $sr perf write_bw -d 127.0.0.3 -p @P@ -n 20000 127.0.0.2 | bw)
  echo "round: ib_send_lat $c us, perf send_lat $r us; ib_write_bw $cb MiB/s, perf write_bw $rb MiB/s"
  best_c_lat=$(echo "$c $best_c_lat" | awk '{print ($1 < $2) ? $1 : $2}')
  best_r_lat=$(echo "$r $best_r_lat" | awk '{print ($1 < $2) ? $1 : $2}')
  best_c_bw=$(echo "$cb $best_c_bw" | awk '{print ($1 > $2) ? $1 : $2}')
  best_r_bw=$(echo "$rb $best_r_bw" | awk '{print ($1 > $2) ? $1 : $2}')
done
echo
echo "send_lat (2 bytes, typical): C ABI $best_c_lat us, Rust API $best_r_lat us, ratio $(awk -v a="$best_c_lat" -v b="$best_r_lat" 'BEGIN {printf "%.2f", a / b}')"
echo "write_bw (64 KiB, average):  C ABI $best_c_bw MiB/s, Rust API $best_r_bw MiB/s, ratio $(awk -v a="$best_c_bw" -v b="$best_r_bw" 'BEGIN {printf "%.2f", a / b}')"
