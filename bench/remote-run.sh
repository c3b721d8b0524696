#!/usr/bin/env bash
# Runs bench/compare.sh and perftest through the drop-in library on a machine prepared by
# bench/remote-pack.sh (no cargo, no package access needed), writing compare.md and
# perftest.txt into OUTDIR. About four minutes.
set -uo pipefail
OUT=${1:?usage: bench/remote-run.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
[ -x .remote/bin/softrdma ] || { echo "no .remote/: run bench/remote-pack.sh first"; exit 1; }
# The packages are unpacked under a private root, never over the machine's own /.
ROOT=$(mktemp -d)
trap 'rm -rf "$ROOT"' EXIT
for f in .remote/deb/*.deb; do
  [ -f "$f" ] && dpkg -x "$f" "$ROOT"
done
export PATH=$ROOT/usr/bin:$PATH
export LD_LIBRARY_PATH=$ROOT/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$ROOT/usr/lib/x86_64-linux-gnu/ucx
export SOFTRDMA_LIB_DIR=$PWD/.remote/lib
SR=$PWD/.remote/bin/softrdma
echo "$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), kernel $(uname -r)"
SOFTRDMA_BIN=$SR UDP_PROBE_BIN=$PWD/.remote/bin/udp-probe ICRC_COST_BIN=$PWD/.remote/bin/icrc_cost timeout 400 bench/compare.sh >"$OUT/compare.md" 2>&1
cat "$OUT/compare.md"
# perftest, both sides through the drop-in library (server on .2, client on .3).
port=19300
pt() {
  local name=$1
  shift
  port=$((port + 1))
  timeout 30 "$SR" exec --bind 127.0.0.2 -- "$name" -p "$port" "$@" >/dev/null 2>&1 &
  sleep 0.5
  timeout 30 "$SR" exec --bind 127.0.0.3 -- "$name" -p "$port" "$@" 127.0.0.2 >"$OUT/pt.txt" 2>&1 &
  # Halfway through a timed run, the client's packets per send call (a sharded device's
  # first shard's): whether its one-WR posts leave in batches (see the README's "A doorbell
  # that waits for company").
  local calls=""
  if [[ " $* " == *" -D "* ]]; then
    sleep 1.5
    calls=$(timeout 10 "$SR" res 2>/dev/null | grep -o "127.0.0.3:[0-9]*: .*sent [0-9]* in [0-9]* send calls" |
      sed 's/.*sent \([0-9]*\) in \([0-9]*\) send calls/ [\1 packets in \2 send calls]/' | head -1)
  fi
  wait
  echo "$name $*: $(grep -E '^ *[0-9]+ +[0-9]+' "$OUT/pt.txt" | tail -1)$calls"
}
{
  pt ib_send_lat -s 8 -n 5000
  pt ib_send_lat -s 8 -n 5000 -e
  pt ib_write_lat -s 8 -n 5000
  pt ib_write_lat -c UC -s 8 -n 5000
  pt ib_read_lat -s 8 -n 5000
  pt ib_write_bw -s 65536 -D 2
  pt ib_send_bw -s 2 -D 2
  SOFTRDMA_SHARDS=8 pt ib_write_bw -s 65536 -D 2 -q 8 -l 8
} | tee "$OUT/perftest.txt"
# An idle process with eight shards: CPU and the threads' wake-ups over 10 s.
( sleep 13 | SOFTRDMA_SHARDS=8 "$SR" memserver --bind 127.0.0.9 >/dev/null 2>&1 & )
sleep 2
pid=$(pgrep -f "memserver --bind 127.0.0.9" | head -1)
if [ -n "$pid" ]; then
  wakes() { cat /proc/"$pid"/task/*/status | awk '/^voluntary_ctxt/ {s += $2} END {print s}'; }
  t0=$(awk '{print $14+$15}' "/proc/$pid/stat") w0=$(wakes)
  sleep 10
  t1=$(awk '{print $14+$15}' "/proc/$pid/stat") w1=$(wakes)
  echo "idle, 8 shards: CPU $(python3 -c "print(round(100*($t1-$t0)/$(getconf CLK_TCK)/10,2))") %," \
    "$(((w1 - w0) / 10)) wake-ups a second" | tee -a "$OUT/perftest.txt"
fi
