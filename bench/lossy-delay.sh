#!/usr/bin/env bash
# softrdma on a lossy path with delay, real sockets, no root: `softrdma perf write_bw`
# (64 KiB) through `softrdma relay`, which adds DELAY_US of one-way delay in each direction
# (default 1000: a 2 ms round trip) and drops the given share of the datagrams both ways,
# loss-free and at each loss rate, in one run, with selective recovery (the default between
# softrdma peers) and with go-back-N only (SOFTRDMA_SELECTIVE=0). This kernel has no netem;
# the relay stands in for it (it runs on one core, so it caps the loss-free figure too).
# Usage: bench/lossy-delay.sh [SECONDS]   (LEVELS="0 1 5" in percent, DELAY_US=1000,
#        OP=write_bw or read_bw or send_bw)
set -euo pipefail
cd "$(dirname "$0")/.."
t=${1:-4}
delay=${DELAY_US:-1000}
op=${OP:-write_bw}
cargo build --release -q -p softrdma-cli
S=${SOFTRDMA_BIN:-$PWD/target/release/softrdma}
# Addresses of the relay's two sides and of the two endpoints (loopback, port 4791).
RA=127.0.9.1:4791 RB=127.0.9.2:4791 PA=127.0.9.3 PB=127.0.9.4
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

wbw() { # $1: loss %, $2: SOFTRDMA_SELECTIVE
  "$S" relay --a-side $RA --b-side $RB --peer-a $PA:4791 --peer-b $PB:4791 --loss "$1" \
    --delay-us "$delay" --seed 7 --duration $((t + 40)) >/dev/null 2>&1 &
  local relay=$!
  pids+=("$relay")
  sleep 0.3
  SOFTRDMA_SELECTIVE="$2" timeout $((t + 30)) "$S" perf "$op" -s 65536 -D "$t" -d $PA --via $RA \
    -p 19556 >/dev/null 2>&1 &
  local server=$!
  sleep 0.7
  SOFTRDMA_SELECTIVE="$2" timeout $((t + 30)) "$S" perf "$op" -s 65536 -D "$t" -d $PB --via $RB \
    -p 19556 --json $PA 2>/dev/null |
    tail -1 | python3 -c 'import json,sys; print("%.0f" % json.loads(sys.stdin.read())["bw_average"])'
  wait "$server" || true
  kill "$relay" 2>/dev/null || true
  wait "$relay" 2>/dev/null || true
}
ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }
echo "one-way delay ${delay} us each way, $op 64 KiB, ${t} s per figure"
printf '%-8s %16s %9s %16s %9s\n' "loss" "selective MiB/s" "of clean" "go-back-N MiB/s" "of clean"
base=""; gbase=""
for pc in ${LEVELS:-0 1 5}; do
  w=$(wbw "$pc" 1); g=$(wbw "$pc" 0)
  [ -z "$base" ] && base=$w && gbase=$g
  printf '%-8s %16s %9s %16s %9s\n' "$pc %" "$w" "$(ratio "$w" "$base")" "$g" "$(ratio "$g" "$gbase")"
done
