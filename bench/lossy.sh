#!/usr/bin/env bash
# softrdma on a lossy path, real sockets: two network namespaces joined by a veth pair,
# nftables dropping a share of the datagrams that arrive in the server's namespace
# (`numgen random mod 1000 < N drop`), and `softrdma perf write_bw` across it, loss-free
# and at each loss rate, in one run, with selective recovery (the default between softrdma
# peers) and with go-back-N only (SOFTRDMA_SELECTIVE=0, what an rxe peer gets); iperf3
# (TCP) beside it on the same path. Needs root, nftables and iperf3.
# Usage: bench/lossy.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
t=${1:-4}
cargo build --release -q -p softrdma-cli
S=${SOFTRDMA_BIN:-$PWD/target/release/softrdma}
. bench/netns-lib.sh
veth_pair lossy 10.202.0

loss() { # per mille, both directions
  for ns in "$A" "$B"; do
    ip netns exec "$ns" nft flush ruleset
    if [ "$1" != 0 ]; then
      ip netns exec "$ns" nft add table inet lossy
      ip netns exec "$ns" nft add chain inet lossy in '{ type filter hook input priority 0; }'
      ip netns exec "$ns" nft add rule inet lossy in numgen random mod 1000 '<' "$1" drop
    fi
  done
}
wbw() { # $1: SOFTRDMA_SELECTIVE
  ip netns exec "$B" env SOFTRDMA_SELECTIVE="$1" timeout $((t + 30)) "$S" perf write_bw -s 65536 -D "$t" -d 10.202.0.2 -p 19555 >/dev/null 2>&1 &
  sleep 0.7
  ip netns exec "$A" env SOFTRDMA_SELECTIVE="$1" timeout $((t + 30)) "$S" perf write_bw -s 65536 -D "$t" -d 10.202.0.1 -p 19555 --json 10.202.0.2 2>/dev/null |
    tail -1 | python3 -c 'import json,sys; print("%.0f" % json.loads(sys.stdin.read())["bw_average"])'
  wait
}
tcp() {
  ip netns exec "$B" timeout $((t + 20)) iperf3 -s -1 -B 10.202.0.2 >/dev/null 2>&1 &
  sleep 0.5
  ip netns exec "$A" timeout $((t + 15)) iperf3 -c 10.202.0.2 -t "$t" -J |
    python3 -c 'import json,sys; print("%.0f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/8/2**20))'
  wait
}
printf '%-8s %16s %9s %16s %9s %14s %9s\n' "loss" "selective MiB/s" "of clean" "go-back-N MiB/s" \
  "of clean" "iperf3 MiB/s" "of clean"
base=""; gbase=""; tbase=""
ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }
for pm in ${LEVELS:-0 1 10 50}; do
  loss $pm
  w=$(wbw 1); g=$(wbw 0); c=$(tcp)
  [ -z "$base" ] && base=$w && gbase=$g && tbase=$c
  printf '%-8s %16s %9s %16s %9s %14s %9s\n' "$(python3 -c "print(f'{$pm/10:g} %')")" "$w" \
    "$(ratio "$w" "$base")" "$g" "$(ratio "$g" "$gbase")" "$c" "$(ratio "$c" "$tbase")"
done
