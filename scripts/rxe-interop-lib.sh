#!/usr/bin/env bash
# Interop of the drop-in libibverbs.so.1 with Linux rxe in the rxe lab (../shared/rxe-lab):
# Debian's ib_write_bw, ib_send_lat and ibv_rc_pingpong on softrdma's library on the host
# (192.168.77.1, inside the lab's network namespace) against the same tools on rxe in VM B
# (192.168.77.11), both directions; each run captured on the lab bridge, its first 300
# frames kept in testdata/interop-lib/ (decoded by crates/softrdma-cli/tests/decode.rs).
# Not part of CI (needs root and the lab's VMs, ~1 min to boot under TCG). Usage:
#   sudo ../shared/rxe-lab/up.sh && sudo scripts/rxe-interop-lib.sh; sudo ../shared/rxe-lab/down.sh
set -uo pipefail
cd "$(dirname "$0")/.."
lab=${RXELAB:-$(cd ../shared/rxe-lab && pwd)}
. "$lab/lab.conf"
libdir=$(scripts/build-libs.sh) || exit 1
cargo build --release -q -p softrdma-cli || exit 1
softrdma=$PWD/target/release/softrdma
out=testdata/interop-lib
mkdir -p "$out"
host=192.168.77.1
n=200
pass=0
fail=0
results=()

# A program on softrdma's library in the lab namespace, as a command prefix.
on_host=(ip netns exec "$NS" env SOFTRDMA_LIB_DIR="$libdir" "$softrdma" exec --bind $host --foreign --)

# run NAME SERVER-SIDE(host|vm) "HOST-ARGS" "VM-ARGS": the tool is the first word of both.
run() {
  local name=$1 server=$2 hargs=$3 vargs=$4 hlog vlog hrc vrc
  hlog=$(mktemp) vlog=$(mktemp)
  "$lab/capture.sh" start "$name" "udp port 4791" >/dev/null
  if [ "$server" = host ]; then
    # shellcheck disable=SC2086
    timeout 150 "${on_host[@]}" $hargs >"$hlog" 2>&1 &
    local hpid=$!
    sleep 2
    "$lab/run-in-vm.sh" -t 150 B "$vargs $host" >"$vlog" 2>&1
    vrc=$?
    wait $hpid
    hrc=$?
  else
    "$lab/run-in-vm.sh" -t 150 B "$vargs" >"$vlog" 2>&1 &
    local vpid=$!
    sleep 4
    # shellcheck disable=SC2086
    timeout 150 "${on_host[@]}" $hargs $IP_B >"$hlog" 2>&1
    hrc=$?
    wait $vpid
    vrc=$?
  fi
  "$lab/capture.sh" stop "$name" >/dev/null
  if [ $hrc -eq 0 ] && [ $vrc -eq 0 ]; then
    pass=$((pass + 1))
    results+=("$(printf '%-28s ok' "$name")")
    editcap -r "$STATE/pcaps/$name.pcap" "$out/$name.pcap" 1-300 >/dev/null
  else
    fail=$((fail + 1))
    results+=("$(printf '%-28s FAIL (host %s, rxe %s)' "$name" $hrc $vrc)")
    echo "---- $name: host"; tail -8 "$hlog"; echo "---- $name: rxe"; tail -8 "$vlog"
  fi
  rm -f "$hlog" "$vlog"
}

for srv in vm host; do
  run "write_bw_${srv}_srv" $srv "ib_write_bw -F -x 0 -n $n" "ib_write_bw -d rxe0 -F -x 1 -n $n"
  run "send_lat_${srv}_srv" $srv "ib_send_lat -F -x 0 -n $n" "ib_send_lat -d rxe0 -F -x 1 -n $n"
  run "rc_pingpong_${srv}_srv" $srv "ibv_rc_pingpong -g 0 -n $n" "ibv_rc_pingpong -d rxe0 -g 1 -n $n"
done
printf '%s\n' "${results[@]}"
echo "rxe interop (drop-in library): $pass passed, $fail failed"
[ $fail -eq 0 ]
