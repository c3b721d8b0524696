#!/usr/bin/env bash
# softrdma's reaction to ECN marks on real sockets: two network namespaces joined by a veth
# pair, nftables in the receiver's namespace marking Congestion Experienced on the RoCE
# datagrams that exceed a rate (`limit rate over R mbytes/second ip ecn set ce`, the
# software stand-in for a switch queue past its marking threshold), and
# `softrdma perf write_bw` (64 KiB) without marks and at each marking rate, in one run.
# The responder answers marks with CNPs; the requester cuts its window. Needs root and
# nftables. Usage: bench/ecn.sh [SECONDS]; SOFTRDMA_BIN=path runs another build.
set -euo pipefail
cd "$(dirname "$0")/.."
t=${1:-4}
[ -n "${SOFTRDMA_BIN:-}" ] || cargo build --release -q -p softrdma-cli
S=${SOFTRDMA_BIN:-$PWD/target/release/softrdma}
. bench/netns-lib.sh
veth_pair ecn 10.203.0
wbw() {
  ip netns exec "$B" timeout $((t + 30)) "$S" perf write_bw -s 65536 -D "$t" -d 10.203.0.2 -p 19556 >/dev/null 2>&1 &
  sleep 0.7
  ip netns exec "$A" timeout $((t + 30)) "$S" perf write_bw -s 65536 -D "$t" -d 10.203.0.1 -p 19556 --json 10.203.0.2 2>/dev/null |
    tail -1 | python3 -c 'import json,sys; print("%.0f" % json.loads(sys.stdin.read())["bw_average"])'
  wait
}
printf '%-34s %16s\n' "CE marks on datagrams beyond" "write_bw MiB/s"
printf '%-34s %16s\n' "(no marks)" "$(wbw)"
for rate in 500 200 100; do
  ip netns exec "$B" nft flush ruleset
  ip netns exec "$B" nft add table inet cong
  ip netns exec "$B" nft add chain inet cong pre '{ type filter hook prerouting priority -150; }'
  ip netns exec "$B" nft add rule inet cong pre udp dport 4791 limit rate over $rate mbytes/second ip ecn set ce
  printf '%-34s %16s\n' "$rate MB/s" "$(wbw)"
done
