#!/usr/bin/env bash
# A size sweep, 2 B to 1 MiB, of one-way latency and bandwidth: softrdma (`perf send_lat`,
# `perf write_bw`, --local) beside raw UDP (`udp-probe pingpong`, and GSO+GRO streams cut
# as softrdma cuts a message: into datagrams of the message size up to its 4096-byte MTU)
# and UCX over TCP (ucp_am_lat, ucp_am_bw), one size after the other in one run. Writes
# bench/results/sweep.csv and, with matplotlib, bench/sweep.png (bench/plot_sweep.py).
#   bench/sweep.sh            # about three minutes
set -uo pipefail
cd "$(dirname "$0")/.."
DUR=${DUR:-2}
cargo build --release -q -p softrdma-cli -p udp-probe || exit 1
SR=target/release/softrdma
PROBE=target/release/udp-probe
mkdir -p bench/results
out=bench/results/sweep.csv
json() { python3 -c "import sys,json; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(' '.join(str(d[k]) for k in sys.argv[1:]))" "$@"; }
port=19800
perf() { port=$((port + 1)); timeout 120 "$SR" perf "$@" --local --json -p "$port" 2>/dev/null; }
ucx() { # test size iterations -> the Final line's typical latency (us) or bandwidth (MiB/s)
  command -v ucx_perftest >/dev/null 2>&1 || return
  port=$((port + 1))
  UCX_TLS=tcp timeout 120 ucx_perftest -t "$1" -s "$2" -n "$3" -p "$port" >/dev/null 2>&1 &
  sleep 1
  UCX_TLS=tcp timeout 120 ucx_perftest 127.0.0.1 -t "$1" -s "$2" -n "$3" -p "$port" 2>/dev/null |
    awk -v t="$1" '/Final:/ { print (t ~ /lat/) ? $4 : $6 }'
  wait
}
echo "size,sr_lat,sr_lat_p99,udp_lat,ucx_lat,sr_bw,udp_bw,ucx_bw" >"$out"
for size in 2 8 64 512 4096 16384 65536 262144 1048576; do
  n=$((size >= 262144 ? 500 : 5000))
  read -r sr_lat sr_p99 <<<"$(perf send_lat -s $size -n $n | json t_typical p99)"
  udp_lat=""
  [ $size -le 65507 ] && udp_lat=$("$PROBE" pingpong $n $size | awk '{print $2}')
  ucx_lat=$(ucx ucp_am_lat $size $n)
  sr_bw=$(perf write_bw -s $size -D "$DUR" | json bw_average)
  seg=$((size < 4096 ? size : 4096))
  udp_bw=$("$PROBE" bw "$DUR" $seg | awk '{print $2}')
  ucx_bw=$(ucx ucp_am_bw $size $((size >= 262144 ? 2000 : 20000)))
  echo "$size,$sr_lat,$sr_p99,$udp_lat,$ucx_lat,$sr_bw,$udp_bw,$ucx_bw" | tee -a "$out"
done
python3 bench/plot_sweep.py "$out" bench/sweep.png || echo "no plot (pip install matplotlib)"
