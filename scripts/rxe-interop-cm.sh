#!/usr/bin/env bash
# Interop of softrdma's connection manager with Linux rdma_cm on rxe in the rxe lab
# (../shared/rxe-lab): `softrdma rping` on the host (192.168.77.1, inside the lab's network
# namespace) against rdmacm-utils' rping on rxe in VM B (192.168.77.11), softrdma as
# client and as server; each run captured on the lab bridge, its first 300 frames and every CM message kept in
# testdata/interop-cm/ (decoded by crates/softrdma-cli/tests/decode.rs).
# ucmatose and udaddy against `softrdma cmatose` and `softrdma udaddy` likewise (10
# connections, 100 messages each way). ONLY=1 skips rping, ONLY=udaddy runs udaddy alone.
# Not part of CI (needs root and the lab's VMs, ~1 min to boot under TCG). Usage:
#   sudo ../shared/rxe-lab/up.sh && sudo scripts/rxe-interop-cm.sh; sudo ../shared/rxe-lab/down.sh
set -uo pipefail
cd "$(dirname "$0")/.."
lab=${RXELAB:-$(cd ../shared/rxe-lab && pwd)}
. "$lab/lab.conf"
cargo build --release -q -p softrdma-cli || exit 1
softrdma=$PWD/target/release/softrdma
out=testdata/interop-cm
mkdir -p "$out"
host=192.168.77.1
n=${COUNT:-50}
pass=0
fail=0
results=()
on_host=(ip netns exec "$NS" "$softrdma")

# check NAME LOG PATTERN COUNT: LOG has COUNT lines matching PATTERN.
lines() { grep -c "$2" "$1" || true; }

# run NAME SERVER-SIDE(host|vm) "HOST-ARGS" "VM-ARGS" HOST-PATTERN VM-PATTERN
run() {
  local name=$1 server=$2 hargs=$3 vargs=$4 hpat=$5 vpat=$6 hlog vlog hrc vrc
  hlog=$(mktemp) vlog=$(mktemp)
  "$lab/capture.sh" start "$name" "udp port 4791" >/dev/null
  if [ "$server" = host ]; then
    # shellcheck disable=SC2086
    timeout 120 "${on_host[@]}" $hargs >"$hlog" 2>&1 &
    local hpid=$!
    sleep 1
    "$lab/run-in-vm.sh" -t 120 B "stdbuf -oL -eL $vargs" >"$vlog" 2>&1
    vrc=$?
    wait $hpid
    hrc=$?
  else
    "$lab/run-in-vm.sh" -t 120 B "stdbuf -oL -eL $vargs" >"$vlog" 2>&1 &
    local vpid=$!
    sleep 4
    # shellcheck disable=SC2086
    timeout 120 "${on_host[@]}" $hargs >"$hlog" 2>&1
    hrc=$?
    wait $vpid
    vrc=$?
  fi
  "$lab/capture.sh" stop "$name" >/dev/null
  local hn vn
  hn=$(lines "$hlog" "$hpat") vn=$(lines "$vlog" "$vpat")
  local want=$n
  case $name in cmatose* | udaddy*) want=1 ;; esac
  if [ $hrc -eq 0 ] && [ $vrc -eq 0 ] && [ "$hn" -ge "$want" ] && [ "$vn" -ge "$want" ]; then
    pass=$((pass + 1))
    results+=("$(printf '%-24s ok (%s and %s lines)' "$name" "$hn" "$vn")")
    # The first 300 frames and every CM message (QP1).
    tshark -r "$STATE/pcaps/$name.pcap" -Y "frame.number <= 300 || infiniband.bth.destqp == 1" \
      -w "$out/$name.pcap" -F pcap 2>/dev/null
  else
    fail=$((fail + 1))
    results+=("$(printf '%-24s FAIL (host rc %s, %s lines; rxe rc %s, %s lines)' "$name" $hrc "$hn" $vrc "$vn")")
    echo "---- $name: host"; tail -8 "$hlog"; echo "---- $name: rxe"; tail -8 "$vlog"
  fi
  rm -f "$hlog" "$vlog"
}

[ -n "${ONLY:-}" ] || run rping_vm_srv vm "rping -c -a $IP_B -I $host -C $n -v -V" "rping -s -a $IP_B -C $n -v" \
  "^ping data: rdma-ping-" "^server ping data: rdma-ping-"
[ -n "${ONLY:-}" ] || run rping_host_srv host "rping -s -a $host -C $n -v" "rping -c -a $host -C $n -v -V" \
  "^server ping data: rdma-ping-" "^ping data: rdma-ping-"
# ucmatose: 10 connections, 100 messages each way on each; every side prints these once.
[ "${ONLY:-}" = udaddy ] || run cmatose_vm_srv vm "cmatose -s $IP_B -b $host -c 10 -C 100" "ucmatose -b $IP_B -c 10 -C 100" \
  "^return status 0" "^return status 0"
[ "${ONLY:-}" = udaddy ] || run cmatose_host_srv host "cmatose -b $host -c 10 -C 100" "ucmatose -s $host -c 10 -C 100" \
  "^return status 0" "^return status 0"
# udaddy: 10 UD endpoints resolved with SIDR, 100 messages each way on each.
run udaddy_vm_srv vm "udaddy -s $IP_B -b $host -c 10 -C 100" "udaddy -b $IP_B -c 10 -C 100" \
  "^return status 0" "^return status 0"
run udaddy_host_srv host "udaddy -b $host -c 10 -C 100" "udaddy -s $host -c 10 -C 100" \
  "^return status 0" "^return status 0"
printf '%s\n' "${results[@]}"
echo "rxe interop (connection manager): $pass passed, $fail failed"
[ $fail -eq 0 ]
