#!/usr/bin/env bash
# Multicast interop with Linux rxe in the rxe lab (../shared/rxe-lab): rdmacm-utils'
# unmodified `mckey` on the host, running on softrdma's drop-in libraries inside the lab's
# network namespace (192.168.77.1), against `mckey` on Linux rxe in VM B (192.168.77.11):
# softrdma sending and rxe receiving, then rxe sending and softrdma receiving, COUNT
# messages of 1,000 bytes each way. Each run is captured on the lab bridge and kept,
# trimmed to its first 120 frames, in testdata/interop-mcast/ (decoded by
# crates/softrdma-cli/tests/decode.rs).
# In the VM the script adds a route for 224.0.0.0/4 on eth0: rxe routes a multicast
# destination like any other, and the lab's VMs have no default route.
# Not part of CI (needs root and the lab's VMs). Usage:
#   ../shared/rxe-lab/up.sh && scripts/rxe-interop-mcast.sh; ../shared/rxe-lab/down.sh
set -uo pipefail
cd "$(dirname "$0")/.."
lab=${RXELAB:-$(cd ../shared/rxe-lab && pwd)}
. "$lab/lab.conf"
scripts/build-libs.sh >/dev/null || exit 1
cargo build --release -q -p softrdma-cli || exit 1
softrdma=$PWD/target/release/softrdma
out=testdata/interop-mcast
mkdir -p "$out"
host=192.168.77.1
n=${COUNT:-50}
pass=0
fail=0
results=()
"$lab/run-in-vm.sh" -t 20 B "ip route replace 224.0.0.0/4 dev eth0" >/dev/null

# run NAME GROUP SENDER(host|vm)
run() {
  local name=$1 group=$2 sender=$3 hlog vlog hrc vrc
  hlog=$(mktemp) vlog=$(mktemp)
  local hs="" vs=""
  if [ "$sender" = host ]; then hs=-s; else vs=-s; fi
  local on_host=(ip netns exec "$NS" "$softrdma" exec --bind $host -- mckey -m "$group" -b $host $hs -C "$n" -S 1000)
  local on_vm="mckey -m $group -b $IP_B $vs -C $n -S 1000"
  "$lab/capture.sh" start "$name" "udp port 4791" >/dev/null
  if [ "$sender" = host ]; then
    # The receiver (rxe) joins first: mckey posts its receives, then joins.
    "$lab/run-in-vm.sh" -t 60 B "$on_vm" >"$vlog" 2>&1 &
    local vpid=$!
    sleep 5
    timeout 60 "${on_host[@]}" >"$hlog" 2>&1
    hrc=$?
    wait $vpid
    vrc=$?
  else
    timeout 60 "${on_host[@]}" >"$hlog" 2>&1 &
    local hpid=$!
    sleep 2
    "$lab/run-in-vm.sh" -t 60 B "$on_vm" >"$vlog" 2>&1
    vrc=$?
    wait $hpid
    hrc=$?
  fi
  "$lab/capture.sh" stop "$name" >/dev/null
  if [ $hrc -eq 0 ] && [ $vrc -eq 0 ] && grep -q "^test complete" "$hlog" && grep -q "^test complete" "$vlog"; then
    pass=$((pass + 1))
    results+=("$(printf '%-22s ok (%s messages to %s)' "$name" "$n" "$group")")
    tshark -r "$STATE/pcaps/$name.pcap" -Y "frame.number <= 120" -w "$out/$name.pcap" -F pcap 2>/dev/null
  else
    fail=$((fail + 1))
    results+=("$(printf '%-22s FAIL (host rc %s, rxe rc %s)' "$name" $hrc $vrc)")
    echo "---- $name: host"; tail -8 "$hlog"; echo "---- $name: rxe"; tail -8 "$vlog"
  fi
  rm -f "$hlog" "$vlog"
}

run mckey_host_sends 239.77.1.1 host
run mckey_rxe_sends 239.77.1.2 vm
printf '%s\n' "${results[@]}"
echo "rxe interop (multicast): $pass passed, $fail failed"
[ $fail -eq 0 ]
