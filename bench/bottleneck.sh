#!/usr/bin/env bash
# softrdma at a shared 1 Gbit/s bottleneck, real kernels: two network namespaces joined by a
# veth pair, the sender side's egress shaped by `tc tbf` (1 Gbit/s, a 1 MB queue, tail
# drop), and optionally nftables marking Congestion Experienced on the RoCE datagrams
# beyond 900 Mbit/s (the kernel here has no RED or fq_codel, so the marking is by rate, the
# stand-in for a switch queue past its threshold). In one run:
#   1. two `softrdma perf write_bw` flows at once, with ECN marks: each flow's MiB/s and
#      Jain's fairness index;
#   2. the same without marks (the tbf queue overflows: loss and delay are the signals);
#   3. one softrdma flow beside an iperf3 TCP flow, with marks: TCP's share of the link;
# and for each, the datagrams the bottleneck dropped and the p99 of a ping's round trip
# through it (the queueing delay). Needs root, tc, nftables, iperf3 and ping.
# Usage: bench/bottleneck.sh [SECONDS]; SOFTRDMA_BIN=path runs another build.
set -euo pipefail
cd "$(dirname "$0")/.."
t=${1:-8}
[ -n "${SOFTRDMA_BIN:-}" ] || cargo build --release -q -p softrdma-cli
S=${SOFTRDMA_BIN:-$PWD/target/release/softrdma}
. bench/netns-lib.sh
veth_pair bn 10.204.0
# A second address each side, for the second flow.
ip -n "$A" addr add 10.204.0.3/24 dev "$DA"; ip -n "$B" addr add 10.204.0.4/24 dev "$DB"
ip netns exec "$A" tc qdisc add dev "$DA" root tbf rate 1gbit burst 256kb limit 1mb

marks() { # on|off
  ip netns exec "$B" nft flush ruleset
  if [ "$1" = on ]; then
    ip netns exec "$B" nft add table inet bn
    ip netns exec "$B" nft add chain inet bn pre '{ type filter hook prerouting priority -150; }'
    ip netns exec "$B" nft add rule inet bn pre udp dport 4791 limit rate over 112 mbytes/second ip ecn set ce
  fi
}
drops() { ip netns exec "$A" tc -s qdisc show dev "$DA" | awk '/dropped/ {gsub(",", "", $7); print $7; exit}'; }
# A ping through the bottleneck for $1 seconds; prints the p99 round trip in ms.
pings() { ip netns exec "$A" timeout $(($1 + 2)) ping -i 0.01 -w "$1" 10.204.0.2 2>/dev/null |
  python3 -c '
import re, sys
r = sorted(float(m.group(1)) for m in (re.search(r"time=([0-9.]+)", l) for l in sys.stdin) if m)
print("%.2f" % r[int(0.99 * (len(r) - 1))] if r else "n/a")'; }
# One write_bw flow from 10.204.0.$1 to 10.204.0.$2 on exchange port $3; prints MiB/s.
flow() {
  ip netns exec "$B" timeout $((t + 30)) "$S" perf write_bw -s 65536 -D "$t" -d "10.204.0.$2" -p "$3" >/dev/null 2>&1 &
  sleep 0.7
  ip netns exec "$A" timeout $((t + 30)) "$S" perf write_bw -s 65536 -D "$t" -d "10.204.0.$1" -p "$3" --json "10.204.0.$2" 2>/dev/null |
    tail -1 | python3 -c 'import json,sys; print("%.0f" % json.loads(sys.stdin.read())["bw_average"])'
  wait
}
jain() { python3 -c "a,b=$1,$2; print('%.3f' % ((a+b)**2/(2*(a*a+b*b)) if a+b else 0))"; }

two_flows() {
  local d0 out1 out2 p
  d0=$(drops)
  out1=$(mktemp); out2=$(mktemp)
  flow 1 2 19561 >"$out1" & f1=$!
  flow 3 4 19562 >"$out2" & f2=$!
  sleep 2; p=$(pings $((t > 4 ? t - 3 : 1)))
  wait $f1 $f2
  local a b; a=$(cat "$out1"); b=$(cat "$out2"); rm -f "$out1" "$out2"
  printf '%-36s %8s %8s %8s %10s %12s\n' "$1" "$a" "$b" "$(jain "$a" "$b")" "$(($(drops) - d0))" "$p"
}

printf '%-36s %8s %8s %8s %10s %12s\n' "two softrdma flows, 1 Gbit/s" "flow 1" "flow 2" "Jain" "dropped" "ping p99 ms"
marks on; two_flows "ECN marks beyond 900 Mbit/s"
marks off; two_flows "no marks (tail drop, 1 MB queue)"

marks on
d0=$(drops)
ip netns exec "$B" iperf3 -s -1 -B 10.204.0.4 -p 5211 >/dev/null 2>&1 &
sleep 0.5
tcp_out=$(mktemp)
ip netns exec "$A" timeout $((t + 20)) iperf3 -c 10.204.0.4 -B 10.204.0.3 -p 5211 -t "$t" -J >"$tcp_out" 2>/dev/null &
tp=$!
r=$(flow 1 2 19563)
wait $tp || true
tcp=$(python3 -c 'import json,sys; print("%.0f" % (json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"]/8/2**20))' "$tcp_out")
rm -f "$tcp_out"
printf '\n%-36s %8s %8s %10s %10s\n' "softrdma beside TCP, ECN marks" "softrdma" "iperf3" "TCP share" "dropped"
printf '%-36s %8s %8s %10s %10s\n' "" "$r" "$tcp" "$(python3 -c "print('%.2f' % ($tcp/($r+$tcp)))")" "$(($(drops) - d0))"
