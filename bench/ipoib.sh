#!/usr/bin/env bash
# iperf3 across `softrdma ipoib` in datagram and connected mode, beside iperf3 over the
# plain veth that carries softrdma's UDP, in one run: two network namespaces joined by a
# veth pair (MTU 1500: softrdma's active MTU 1024, so datagram mode's interface MTU is
# 1020), the overlay subnet 10.99.0.0/24 reachable only through the TUN interfaces.
# Needs root and iperf3. Usage: bench/ipoib.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
t=${1:-5}
cargo build --release -q -p softrdma-cli
S=$PWD/target/release/softrdma
id=$$
. bench/netns-lib.sh
veth_pair ipbench 10.201.0

gbps() { # client-ns server-address
  ip netns exec "$B" timeout $((t + 20)) iperf3 -s -1 -B "$2" >/dev/null 2>&1 &
  sleep 0.5
  ip netns exec "$1" timeout $((t + 15)) iperf3 -c "$2" -t "$t" -J |
    python3 -c 'import json,sys; e=json.load(sys.stdin)["end"]; print("%.2f %d" % (e["sum_received"]["bits_per_second"]/1e9, e["sum_sent"].get("retransmits",0)))'
  wait
}

printf '%-34s %10s %12s\n' "path (iperf3, $t s, one TCP stream)" "Gbit/s" "retransmits"
read -r g r <<<"$(gbps "$A" 10.201.0.2)"
printf '%-34s %10s %12s\n' "veth (the underlay), MTU 1500" "$g" "$r"
base=$g
for mode in datagram connected; do
  ip netns exec "$A" timeout $((t + 30)) "$S" ipoib --bind 10.201.0.1 --ip 10.99.0.1/24 --mode $mode >/tmp/ipoib-a.$id 2>&1 &
  pa=$!
  ip netns exec "$B" timeout $((t + 30)) "$S" ipoib --bind 10.201.0.2 --ip 10.99.0.2/24 --mode $mode >/tmp/ipoib-b.$id 2>&1 &
  pb=$!
  sleep 1
  mtu=$(ip -n "$A" link show ib0 | grep -o 'mtu [0-9]*' | cut -d' ' -f2)
  read -r g r <<<"$(gbps "$A" 10.99.0.2)"
  kill -INT $pa $pb; wait $pa $pb 2>/dev/null || true
  printf '%-34s %10s %12s   (%.2f of the veth)\n' "softrdma ipoib $mode, MTU $mtu" "$g" "$r" "$(python3 -c "print($g/$base)")"
  rm -f /tmp/ipoib-a.$id /tmp/ipoib-b.$id
done
