#!/usr/bin/env bash
# Interop of the drop-in libibverbs.so.1 with Linux rxe in the rxe lab (../shared/rxe-lab):
# Debian's ib_write_bw, ib_send_lat and ibv_rc_pingpong on softrdma's library on the host
# (192.168.77.1, inside the lab's network namespace) against the same tools on rxe in VM B
# (192.168.77.11), both directions; with the drop-in librdmacm.so.1, Debian's rping,
# ucmatose and ib_send_bw -R likewise; and `softrdma perf -R` (the Rust API) against
# ib_send_bw -R and ib_write_bw -R on rxe. Each run captured on the lab bridge, its first
# 300 frames kept in testdata/interop-lib/ (decoded by crates/softrdma-cli/tests/decode.rs).
# ib_write_bw -q 4 also runs on a four-shard device (SOFTRDMA_SHARDS=4); with SOFTRDMA_SHARDS
# set for the whole script, every case does. ONLY=cm runs the rdma_cm cases alone.
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

# The lab namespace, and a program on softrdma's library there, as command prefixes.
in_ns=(ip netns exec "$NS" env SOFTRDMA_LIB_DIR="$libdir")
lib=("$softrdma" exec --bind $host --foreign --)

# run NAME SERVER-SIDE(host|vm) "HOST-CMD" "VM-CMD": @SRV@ in a command is the server's
# address; perftest-style commands without it get the address appended on the client.
# Captures of rdma_cm cases (names with _R_, rping, ucmatose) go to testdata/interop-rdmacm.
run() {
  local name=$1 server=$2 hargs=$3 vargs=$4 hlog vlog hrc vrc dir=$out
  if [ "$server" = host ]; then
    [[ $vargs == *@SRV@* ]] || vargs="$vargs @SRV@"
    vargs=${vargs//@SRV@/$host} hargs=${hargs//@SRV@/$host}
  else
    [[ $hargs == *@SRV@* ]] || hargs="$hargs @SRV@"
    hargs=${hargs//@SRV@/$IP_B} vargs=${vargs//@SRV@/$IP_B}
  fi
  case $name in *_R_* | rping* | ucmatose*) dir=testdata/interop-rdmacm ;; esac
  mkdir -p "$dir"
  hlog=$(mktemp) vlog=$(mktemp)
  "$lab/capture.sh" start "$name" "udp port 4791" >/dev/null
  if [ "$server" = host ]; then
    # shellcheck disable=SC2086
    timeout 150 "${in_ns[@]}" $hargs >"$hlog" 2>&1 &
    local hpid=$!
    sleep 2
    "$lab/run-in-vm.sh" -t 150 B "$vargs" >"$vlog" 2>&1
    vrc=$?
    wait $hpid
    hrc=$?
  else
    "$lab/run-in-vm.sh" -t 150 B "$vargs" >"$vlog" 2>&1 &
    local vpid=$!
    sleep 4
    # shellcheck disable=SC2086
    timeout 150 "${in_ns[@]}" $hargs >"$hlog" 2>&1
    hrc=$?
    wait $vpid
    vrc=$?
  fi
  "$lab/capture.sh" stop "$name" >/dev/null
  if [ $hrc -eq 0 ] && [ $vrc -eq 0 ]; then
    pass=$((pass + 1))
    results+=("$(printf '%-28s ok' "$name")")
    editcap -r "$STATE/pcaps/$name.pcap" "$dir/$name.pcap" 1-300 >/dev/null
  else
    fail=$((fail + 1))
    results+=("$(printf '%-28s FAIL (host %s, rxe %s)' "$name" $hrc $vrc)")
    echo "---- $name: host"; tail -8 "$hlog"; echo "---- $name: rxe"; tail -8 "$vlog"
  fi
  rm -f "$hlog" "$vlog"
}

for srv in vm host; do
  [ "${ONLY:-}" = cm ] && break
  run "write_bw_${srv}_srv" $srv "${lib[*]} ib_write_bw -F -x 0 -n $n" "ib_write_bw -d rxe0 -F -x 1 -n $n"
  run "send_lat_${srv}_srv" $srv "${lib[*]} ib_send_lat -F -x 0 -n $n" "ib_send_lat -d rxe0 -F -x 1 -n $n"
  run "rc_pingpong_${srv}_srv" $srv "${lib[*]} ibv_rc_pingpong -g 0 -n $n" "ibv_rc_pingpong -d rxe0 -g 1 -n $n"
  # READs, 64 KiB: perftest's client takes the server's advertised outstanding READs (128
  # on rxe) for its own, so this fails to reach RTS where the device allows fewer.
  run "read_bw_${srv}_srv" $srv "${lib[*]} ib_read_bw -F -x 0 -s 65536 -n $n" "ib_read_bw -d rxe0 -F -x 1 -s 65536 -n $n"
done
# A sharded device (four shards, its QPs in turn over them) against rxe, whose QPs each
# send from a UDP source port of their own.
for srv in vm host; do
  [ "${ONLY:-}" = cm ] && break
  run "write_bw_q4_shards_${srv}_srv" $srv "env SOFTRDMA_SHARDS=4 ${lib[*]} ib_write_bw -F -x 0 -q 4 -n $n" \
    "ib_write_bw -d rxe0 -F -x 1 -q 4 -n $n"
done
# rdma_cm: the drop-in librdmacm.so.1 (servers bind the address they serve on).
run rping_lib_vm_srv vm "${lib[*]} rping -c -a @SRV@ -C $n -v" "rping -s -a @SRV@ -C $n -v"
run rping_lib_host_srv host "${lib[*]} rping -s -a @SRV@ -C $n -v" "rping -c -a @SRV@ -C $n -v"
run ucmatose_lib_vm_srv vm "${lib[*]} ucmatose -s @SRV@ -b $host -c 4 -C 50" "ucmatose -b @SRV@ -c 4 -C 50"
run ucmatose_lib_host_srv host "${lib[*]} ucmatose -b @SRV@ -c 4 -C 50" "ucmatose -s @SRV@ -c 4 -C 50"
run send_bw_R_lib_vm_srv vm "${lib[*]} ib_send_bw -R -n $n" "ib_send_bw -d rxe0 -R -n $n"
run send_bw_R_lib_host_srv host "${lib[*]} ib_send_bw -R -n $n" "ib_send_bw -d rxe0 -R -n $n"
# softrdma perf -R on the Rust API against perftest -R on rxe.
for t in send_bw write_bw; do
  run "perf_${t}_R_vm_srv" vm "$softrdma perf $t -R -d $host -n $n" "ib_$t -d rxe0 -R -n $n"
  run "perf_${t}_R_host_srv" host "$softrdma perf $t -R -d $host -n $n" "ib_$t -d rxe0 -R -n $n"
done
printf '%s\n' "${results[@]}"
echo "rxe interop (drop-in library): $pass passed, $fail failed"
[ $fail -eq 0 ]
