#!/usr/bin/env bash
# The drop-in libraries' acceptance suite: unmodified rdma-core tools and perftest on
# softrdma, each pair of processes on 127.0.0.2 (server) and 127.0.0.3 (client), every run
# bounded in time. Prints a table (program, options, result) and exits 1 if any run fails.
#
# Needs Debian's ibverbs-utils and perftest; without them it says so and exits 0, unless
# CI is set (then missing tools are a failure). Usage: scripts/acceptance.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."

quick=0
[ "${1:-}" = "--quick" ] && quick=1
for tool in ibv_devinfo ibv_rc_pingpong ib_write_bw; do
  if ! command -v $tool >/dev/null; then
    echo "acceptance: $tool not installed (apt-get install ibverbs-utils perftest)"
    [ -n "${CI:-}" ] && exit 1
    exit 0
  fi
done

libdir=$(scripts/build-libs.sh) || exit 1
cargo build --release -q -p softrdma-cli || exit 1
softrdma=$PWD/target/release/softrdma
export SOFTRDMA_LIB_DIR=$libdir
# A UDP port of this run's own (both sides use it), so that another run or a local rxe on
# 4791 does not collide.
export SOFTRDMA_PORT=$((30000 + $$ % 20000))
srv_ip=127.0.0.2
cli_ip=127.0.0.3
tcp=$((20000 + $$ % 20000))
logs=$(mktemp -d)
pass=0
fail=0
table=()

record() { # program options result
  table+=("$(printf '%-18s %-34s %s' "$1" "$2" "$3")")
  if [ "${3%% *}" = ok ]; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
}

# One server/client pair: pair NAME "OPTIONS" SERVER-CMD... :: CLIENT-CMD...
# The result is ok when both exit 0 within the limit; the client's last figure is kept.
pair() {
  local name=$1 opts=$2
  shift 2
  local server=() client=()
  while [ "$1" != "::" ]; do server+=("$1"); shift; done
  shift
  client=("$@")
  tcp=$((tcp + 1))
  local s_log=$logs/${name//\//_}.$tcp.server c_log=$logs/${name//\//_}.$tcp.client
  timeout 60 "${server[@]//@PORT@/$tcp}" >"$s_log" 2>&1 &
  local spid=$!
  kernel_tcp=
  if [ "${wait_mode:-}" = mcast ]; then
    wait_mcast $spid
  elif [ "${wait_mode:-}" = cm ]; then
    wait_cm $spid
    # Whether the server listens on a kernel TCP port after all (an rsocket program that
    # fell back to TCP).
    if command -v ss >/dev/null; then ss -Hltn "sport = :$tcp" | grep -q . && kernel_tcp=yes || kernel_tcp=no; fi
  else
    wait_listening $tcp $spid
  fi
  timeout 60 "${client[@]//@PORT@/$tcp}" >"$c_log" 2>&1
  local crc=$?
  last_client_log=$c_log
  wait $spid
  local src=$?
  if [ $crc -eq 0 ] && [ $src -eq 0 ]; then
    record "$name" "$opts" "ok  $(figure "$c_log")"
  else
    record "$name" "$opts" "FAIL (server $src, client $crc)"
    echo "---- $name $opts: server" >&2; tail -5 "$s_log" >&2
    echo "---- $name $opts: client" >&2; tail -5 "$c_log" >&2
  fi
}

# Waits (at most 10 s) until the server listens on its TCP port or has exited: a client
# that comes too early fails ("Couldn't connect"), and probing the port would use up the
# server's one accept. Without ss, a fixed pause.
wait_listening() { # port server-pid
  if ! command -v ss >/dev/null; then sleep 1; return; fi
  for _ in $(seq 200); do
    ss -Hltn "sport = :$1" | grep -q . && return
    kill -0 "$2" 2>/dev/null || return
    sleep 0.05
  done
}

# A multicast receiver has joined once its device has a socket on the group's address.
wait_mcast() { # server-pid
  if ! command -v ss >/dev/null; then sleep 1; return; fi
  for _ in $(seq 200); do
    ss -Hlun "sport = :$SOFTRDMA_PORT" | grep -q "$mcast_group:" && return
    kill -0 "$1" 2>/dev/null || return
    sleep 0.05
  done
}

# rdma_cm servers listen on no TCP port: wait (at most 10 s) until the server's device is
# open (its UDP socket on $srv_ip) and a moment more for its listener.
wait_cm() { # server-pid
  if ! command -v ss >/dev/null; then sleep 1; return; fi
  for _ in $(seq 200); do
    ss -Hlun "sport = :$SOFTRDMA_PORT" | grep -q "$srv_ip:" && { sleep 0.2; return; }
    kill -0 "$1" 2>/dev/null || return
    sleep 0.05
  done
}

# The headline figure of a run: the pingpongs' usec/iter, ucx_perftest's final line,
# perftest's last table row.
figure() {
  if grep -q "^Final:" "$1"; then
    grep "^Final:" "$1" | tail -1 | awk '{printf "%s us avg, %s MB/s", $4, $6}'
  elif grep -q "usec per round trip" "$1"; then
    grep "usec per round trip" "$1" | tail -1 | sed 's/.*: //'
  elif grep -q "^name *bytes *xfers" "$1"; then
    tail -1 "$1" | awk '{printf "%s Gb/s, %s usec/xfer", $(NF-1), $NF}'
  elif grep -q "usec/iter" "$1"; then
    grep "usec/iter" "$1" | tail -1 | sed 's/.*= //'
  else
    awk '/^ *#bytes/ {h=1; next} h && NF>3 && $1 ~ /^[0-9]+$/ {row=$0} END {print row}' "$1" | tr -s ' \t' ' '
  fi
}

on() { # address command...: run a program on softrdma bound to the address
  local ip=$1
  shift
  echo "$softrdma" exec --bind "$ip" -- "$@"
}

# ---- Status tools --------------------------------------------------------------------
check_output() { # name options pattern command...
  local name=$1 opts=$2 pattern=$3
  shift 3
  local out
  out=$(timeout 20 "$softrdma" exec --bind $srv_ip -- "$@" 2>&1)
  if [ $? -eq 0 ] && grep -qE "$pattern" <<<"$out"; then
    record "$name" "$opts" "ok"
  else
    record "$name" "$opts" "FAIL"
    echo "$out" | head -20 >&2
  fi
}
check_output ibv_devices "" "srdma_lo" ibv_devices
check_output ibv_devinfo "" "PORT_ACTIVE \(4\)" ibv_devinfo -d srdma_lo
check_output ibv_devinfo "-v" "GID\[  0\]:.*::ffff:127.0.0.2, RoCE v2" ibv_devinfo -v -d srdma_lo

# ---- rdma-core's pingpongs -----------------------------------------------------------
for prog in ibv_rc_pingpong ibv_uc_pingpong ibv_ud_pingpong ibv_srq_pingpong; do
  variants=("" "-e")
  [ $prog != ibv_ud_pingpong ] && variants+=("-s 65536")
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086
    pair $prog "-g 0 $v" $(on $srv_ip $prog -g 0 -p @PORT@ $v) :: $(on $cli_ip $prog -g 0 -p @PORT@ $v 127.0.0.1)
  done
done

# shellcheck disable=SC2086
pair ibv_rc_pingpong "-g 0 -N (ibv_wr_* API)" $(on $srv_ip ibv_rc_pingpong -g 0 -N -p @PORT@) :: \
  $(on $cli_ip ibv_rc_pingpong -g 0 -N -p @PORT@ 127.0.0.1)

for v in "" "-e"; do
  # shellcheck disable=SC2086
  pair ibv_rc_pingpong "-g 0 -t $v (extended CQ, timestamps)" $(on $srv_ip ibv_rc_pingpong -g 0 -t $v -p @PORT@) :: \
    $(on $cli_ip ibv_rc_pingpong -g 0 -t $v -p @PORT@ 127.0.0.1)
done
# The completion timestamps count nanoseconds (hca_core_clock 1 GHz): the average gap
# between receive completions must agree with the measured time per iteration.
avg=$(sed -n 's/^Average receive completion clock cycles = //p' "$last_client_log")
usec=$(sed -n 's/^.* = \([0-9.]*\) usec\/iter$/\1/p' "$last_client_log")
if [ -n "$avg" ] && [ -n "$usec" ] && awk -v a="$avg" -v u="$usec" 'BEGIN {r = a / 1000 / u; exit !(r > 0.5 && r < 2)}'; then
  record ibv_rc_pingpong "-t: timestamps agree with usec/iter" "ok  ${avg%.*} ns vs $usec us"
else
  record ibv_rc_pingpong "-t: timestamps agree with usec/iter" "FAIL (average '$avg' cycles, '$usec' usec/iter)"
fi

# ---- perftest ------------------------------------------------------------------------
iters=(-n 2000)
[ $quick = 1 ] && iters=(-n 200)
for t in send write read atomic; do
  for kind in bw lat; do
    prog=ib_${t}_$kind
    # shellcheck disable=SC2086
    pair $prog "${iters[*]}" $(on $srv_ip $prog -p @PORT@ ${iters[@]}) :: $(on $cli_ip $prog -p @PORT@ ${iters[@]} $srv_ip)
  done
done
for prog in ib_send_bw ib_send_lat; do
  # shellcheck disable=SC2086
  pair $prog "-c UD ${iters[*]}" $(on $srv_ip $prog -c UD -p @PORT@ ${iters[@]}) :: \
    $(on $cli_ip $prog -c UD -p @PORT@ ${iters[@]} $srv_ip)
done
# UC: perftest's bandwidth server leaves its QP in RTR, from where it still tells the client
# that it takes filler off (see wire::fill).
for prog in ib_write_bw ib_send_bw ib_write_lat; do
  # shellcheck disable=SC2086
  pair $prog "-c UC ${iters[*]}" $(on $srv_ip $prog -c UC -p @PORT@ ${iters[@]}) :: \
    $(on $cli_ip $prog -c UC -p @PORT@ ${iters[@]} $srv_ip)
done
if [ $quick = 0 ]; then
  for opts in "-a -n 100" "-q 4 -n 2000" "-D 2" "--report_gbits -n 2000"; do
    # shellcheck disable=SC2086
    pair ib_write_bw "$opts" $(on $srv_ip ib_write_bw -p @PORT@ $opts) :: $(on $cli_ip ib_write_bw -p @PORT@ $opts $srv_ip)
  done
  # shellcheck disable=SC2086
  pair ib_send_bw "-e -n 2000" $(on $srv_ip ib_send_bw -e -p @PORT@ -n 2000) :: \
    $(on $cli_ip ib_send_bw -e -p @PORT@ -n 2000 $srv_ip)
  # shellcheck disable=SC2086
  pair ib_send_lat "-a -n 100" $(on $srv_ip ib_send_lat -a -p @PORT@ -n 100) :: \
    $(on $cli_ip ib_send_lat -a -p @PORT@ -n 100 $srv_ip)
fi

# ---- Mixed pairs: perftest on the C library against softrdma perf on the Rust API -----
# shellcheck disable=SC2086
pair "ib_write_bw/perf" "C server, Rust client" $(on $srv_ip ib_write_bw -p @PORT@ -n 2000) :: \
  $softrdma perf write_bw -d $cli_ip -p @PORT@ -n 2000 $srv_ip
# shellcheck disable=SC2086
pair "perf/ib_send_lat" "Rust server, C client" $softrdma perf send_lat -d $srv_ip -p @PORT@ -n 2000 :: \
  $(on $cli_ip ib_send_lat -p @PORT@ -n 2000 $srv_ip)
# Several QPs: perftest swaps every QP's message again once they are connected.
# shellcheck disable=SC2086
pair "ib_send_bw/perf" "-q 4, C server, Rust client" $(on $srv_ip ib_send_bw -q 4 -p @PORT@ -n 1000) :: \
  $softrdma perf send_bw -q 4 -d $cli_ip -p @PORT@ -n 1000 $srv_ip
# shellcheck disable=SC2086
pair "perf/ib_write_bw" "-q 4, Rust server, C client" $softrdma perf write_bw -q 4 -d $srv_ip -p @PORT@ -n 1000 :: \
  $(on $cli_ip ib_write_bw -q 4 -p @PORT@ -n 1000 $srv_ip)
# write_lat past 256 writes: the byte each write ends with counts as perftest's, modulo 256.
# shellcheck disable=SC2086
pair "perf/ib_write_lat" "-n 600, Rust server, C client" $softrdma perf write_lat -d $srv_ip -p @PORT@ -n 600 :: \
  $(on $cli_ip ib_write_lat -p @PORT@ -n 600 $srv_ip)

# ---- rdma_cm: rdmacm-utils, perftest -R, the tutorial's programs ------------------------
# The servers listen on the rdma_cm port @PORT@ (udaddy: its fixed 7174; rping, ucmatose and udaddy bind their
# address; perftest and rdma_server listen on a wildcard address, which takes --bind's).
cm_pair() { wait_mode=cm pair "$@"; }
pings=100
# shellcheck disable=SC2086
cm_pair rping "-s/-c -C $pings -v" $(on $srv_ip rping -s -a $srv_ip -p @PORT@ -C $pings -v) :: \
  $(on $cli_ip rping -c -a $srv_ip -p @PORT@ -C $pings -v)
n=$(grep -c "^ping data: rdma-ping-" "$last_client_log")
if [ "$n" = $pings ]; then
  record rping "client prints $pings ping lines" "ok"
else
  record rping "client prints $pings ping lines" "FAIL ($n)"
fi
# shellcheck disable=SC2086
cm_pair ucmatose "-c 10 -C 100" $(on $srv_ip ucmatose -b $srv_ip -p @PORT@ -c 10 -C 100) :: \
  $(on $cli_ip ucmatose -s $srv_ip -b $cli_ip -p @PORT@ -c 10 -C 100)
# shellcheck disable=SC2086
cm_pair udaddy "-c 5 -C 100" $(on $srv_ip udaddy -b $srv_ip -c 5 -C 100) :: \
  $(on $cli_ip udaddy -s $srv_ip -b $cli_ip -c 5 -C 100)
# Multicast: mckey's receiver joins the group, then its sender (another process, another
# address) joins and sends; every message must arrive (the receiver posts a receive for
# each before joining).
mcast_group=239.42.0.1
# shellcheck disable=SC2086
wait_mode=mcast pair mckey "-m $mcast_group -C 100 -S 1000" \
  $(on $srv_ip mckey -m $mcast_group -b $srv_ip -C 100 -S 1000) :: \
  $(on $cli_ip mckey -m $mcast_group -b $cli_ip -s -C 100 -S 1000)
# shellcheck disable=SC2086
cm_pair rdma_server "rdma_client" $(on $srv_ip rdma_server -p @PORT@) :: $(on $cli_ip rdma_client -s $srv_ip -p @PORT@)
for prog in ib_send_bw ib_write_bw ib_send_lat; do
  # shellcheck disable=SC2086
  cm_pair $prog "-R ${iters[*]}" $(on $srv_ip $prog -R -p @PORT@ ${iters[@]}) :: \
    $(on $cli_ip $prog -R -p @PORT@ ${iters[@]} $srv_ip)
done
# Mixed pairs: perftest -R on the C library against softrdma perf -R on the Rust API.
# shellcheck disable=SC2086
cm_pair "ib_send_bw/perf" "-R, C server, Rust client" $(on $srv_ip ib_send_bw -R -p @PORT@ -n 2000) :: \
  $softrdma perf send_bw -R -d $cli_ip -p @PORT@ -n 2000 $srv_ip
# shellcheck disable=SC2086
cm_pair "perf/ib_write_bw" "-R, Rust server, C client" $softrdma perf write_bw -R -d $srv_ip -p @PORT@ -n 2000 :: \
  $(on $cli_ip ib_write_bw -R -p @PORT@ -n 2000 $srv_ip)
# shellcheck disable=SC2086
cm_pair "ib_write_bw/perf" "-R, C server, Rust client" $(on $srv_ip ib_write_bw -R -p @PORT@ -n 2000) :: \
  $softrdma perf write_bw -R -d $cli_ip -p @PORT@ -n 2000 $srv_ip
# shellcheck disable=SC2086
cm_pair "perf/ib_send_lat" "-R, Rust server, C client" $softrdma perf send_lat -R -d $srv_ip -p @PORT@ -n 2000 :: \
  $(on $cli_ip ib_send_lat -R -p @PORT@ -n 2000 $srv_ip)
# Sharded devices (SOFTRDMA_SHARDS=4: four engines and sockets, QPs in turn over them):
# perftest's QPs spread over the shards, connected by its exchange and by rdma_cm (whose
# CM runs on shard 0 and readies QPs on the others), and ucmatose's ten connections.
sharded="env SOFTRDMA_SHARDS=4"
# shellcheck disable=SC2086
pair ib_write_bw "-q 8 -n 2000, 4 shards" $sharded $(on $srv_ip ib_write_bw -q 8 -p @PORT@ -n 2000) :: \
  $sharded $(on $cli_ip ib_write_bw -q 8 -p @PORT@ -n 2000 $srv_ip)
# shellcheck disable=SC2086
cm_pair ib_send_bw "-R -q 4 -n 2000, 4 shards" $sharded $(on $srv_ip ib_send_bw -R -q 4 -p @PORT@ -n 2000) :: \
  $sharded $(on $cli_ip ib_send_bw -R -q 4 -p @PORT@ -n 2000 $srv_ip)
# shellcheck disable=SC2086
cm_pair ucmatose "-c 10 -C 100, 4 shards" $sharded $(on $srv_ip ucmatose -b $srv_ip -p @PORT@ -c 10 -C 100) :: \
  $sharded $(on $cli_ip ucmatose -s $srv_ip -b $cli_ip -p @PORT@ -c 10 -C 100)
# Mixed pairs: Debian's rping on the C library against softrdma rping on the Rust API.
# shellcheck disable=SC2086
cm_pair "rping/softrdma" "C server, Rust client" $(on $srv_ip rping -s -a $srv_ip -p @PORT@ -C $pings) :: \
  $softrdma rping -c -a $srv_ip -p @PORT@ -C $pings
# shellcheck disable=SC2086
cm_pair "softrdma/rping" "Rust server, C client" $softrdma rping -s -a $srv_ip -p @PORT@ -C $pings :: \
  $(on $cli_ip rping -c -a $srv_ip -p @PORT@ -C $pings)
# The tutorial's client and server, built against Debian's headers and libraries.
if cc -O2 -o "$logs/tutorial_server" examples/c/tutorial_server.c -lrdmacm -libverbs &&
  cc -O2 -o "$logs/tutorial_client" examples/c/tutorial_client.c -lrdmacm -libverbs; then
  # shellcheck disable=SC2086
  cm_pair tutorial_server "-n 2000 -c 2 (two clients)" $(on $srv_ip "$logs/tutorial_server" -a $srv_ip -p @PORT@ -n 2000 -c 2) :: \
    bash -c "$(on $cli_ip "$logs/tutorial_client" -a $srv_ip -b $cli_ip -p @PORT@ -n 2000) && $(on $cli_ip "$logs/tutorial_client" -a $srv_ip -b $cli_ip -p @PORT@ -n 2000)"
else
  record tutorial_server "" "FAIL (does not build: apt-get install librdmacm-dev)"
fi

# ---- rsockets: rstream, riostream, and iperf3 under Debian's librspreload.so --------------
# shellcheck disable=SC2086
for topt in "" "-T v" "-T a" "-T n"; do
  cm_pair rstream "-S 65536 -C 1000 $topt" $(on $srv_ip rstream -b $srv_ip -p @PORT@ -S 65536 -C 1000 $topt) :: \
    $(on $cli_ip rstream -s $srv_ip -b $cli_ip -p @PORT@ -S 65536 -C 1000 $topt)
done
# shellcheck disable=SC2086
cm_pair rstream "(every size, both tests)" $(on $srv_ip rstream -b $srv_ip -p @PORT@) :: \
  $(on $cli_ip rstream -s $srv_ip -b $cli_ip -p @PORT@)
# shellcheck disable=SC2086
cm_pair riostream "-S 65536 -C 100 -T v" $(on $srv_ip riostream -b $srv_ip -p @PORT@ -S 65536 -C 100 -T v) :: \
  $(on $cli_ip riostream -s $srv_ip -b $cli_ip -p @PORT@ -S 65536 -C 100 -T v)
rspreload=/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so
if command -v iperf3 >/dev/null && [ -f $rspreload ]; then
  # The same iperf3 run over the kernel's TCP and over rsockets, side by side.
  iperf_pair() { # name prefix...
    local name=$1
    shift
    pair "$name" "-t 3" "$@" iperf3 -s -B $srv_ip -p @PORT@ -1 :: "$@" iperf3 -c $srv_ip -B $cli_ip -p @PORT@ -t 3
  }
  iperf_pair iperf3 env
  tcp_gbit=$(grep -E "sender$" "$last_client_log" | awk '{print $(NF-3)}')
  # shellcheck disable=SC2046
  wait_mode=cm iperf_pair "iperf3/rspreload" $(on $srv_ip env LD_PRELOAD=$rspreload)
  rs_gbit=$(grep -E "sender$" "$last_client_log" | awk '{print $(NF-3)}')
  # Over RDMA, not TCP: the rsocket server listened on no kernel TCP port.
  if [ "$kernel_tcp" != yes ] && [ -n "$rs_gbit" ] && [ -n "$tcp_gbit" ]; then
    record "iperf3/rspreload" "Gbit/s beside kernel TCP" "ok  $rs_gbit vs $tcp_gbit ($(awk -v a="$rs_gbit" -v b="$tcp_gbit" 'BEGIN {if (b > 0) printf "%.2f", a / b}'))"
  else
    record "iperf3/rspreload" "Gbit/s beside kernel TCP" "FAIL"
  fi
else
  table+=("$(printf '%-18s %-34s %s' iperf3 "" "not installed (apt-get install iperf3)")")
  [ -n "${CI:-}" ] && fail=$((fail + 1))
fi

# ---- UCX -------------------------------------------------------------------------------
# UCX lists a device only if /dev/infiniband/<dev_name> exists; softrdma exec provides it
# in a private mount namespace. UCT-level runs name the transport; UCP-level runs choose
# them with UCX_TLS (rc_v = rc_verbs with ud_verbs for wire-up).
if command -v ucx_perftest >/dev/null; then
  export UCX_NET_DEVICES=srdma_lo:1
  check_output ucx_info "-d (rc_verbs, ud_verbs listed)" "Transport: rc_verbs" ucx_info -d -t rc_verbs
  check_output ucx_info "-d -t ud_verbs" "Transport: ud_verbs" ucx_info -d -t ud_verbs
  for spec in "rc_verbs am_lat" "rc_verbs am_bw" "rc_verbs put_bw" "rc_verbs get -D bcopy" \
    "rc_verbs put_bw -D zcopy -s 65536" "rc_verbs fadd" "rc_verbs cswap" "ud_verbs am_lat" "ud_verbs am_bw"; do
    read -r tl t <<<"$spec"
    # shellcheck disable=SC2086
    pair ucx_perftest "-x $tl -t $t" $(on $srv_ip ucx_perftest -p @PORT@) :: \
      $(on $cli_ip ucx_perftest 127.0.0.1 -p @PORT@ -d srdma_lo:1 -x $tl -t $t -n 2000)
  done
  for spec in "rc_v tag_lat -n 10000" "rc_v tag_bw -s 1048576 -n 200" "rc_v ucp_put_bw -s 65536 -n 2000" \
    "rc_v ucp_get -s 65536 -n 2000" "ud_v tag_lat -n 10000" "ud_v stream_bw -n 20000"; do
    read -r tls t <<<"$spec"
    # shellcheck disable=SC2086
    UCX_TLS=$tls,self pair ucx_perftest "UCX_TLS=$tls,self -t $t" $(on $srv_ip ucx_perftest -p @PORT@) :: \
      $(on $cli_ip ucx_perftest 127.0.0.1 -p @PORT@ -t $t)
  done
else
  table+=("$(printf '%-18s %-34s %s' ucx_perftest "" "not installed")")
  [ -n "${CI:-}" ] && fail=$((fail + 1))
fi

# ---- Open MPI over UCX ---------------------------------------------------------------
# Two ranks, each on its own address (an MPMD launch), the UCX PML forced (Debian's
# configuration turns it off) and allowed on any device; the program checks its results.
if command -v mpirun >/dev/null && command -v mpicc >/dev/null; then
  mpicc -O2 -o "$logs/mpi_check" scripts/mpi/mpi_check.c
  root=()
  [ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
  for tls in rc_v ud_v; do
    log=$logs/mpirun.$tls
    UCX_TLS=$tls,self timeout 120 mpirun "${root[@]}" --oversubscribe --mca pml ucx --mca pml_ucx_devices any \
      --mca osc ^ucx --mca btl self -np 1 "$softrdma" exec --bind $srv_ip -- "$logs/mpi_check" : \
      -np 1 "$softrdma" exec --bind $cli_ip -- "$logs/mpi_check" >"$log" 2>&1
    if [ $? -eq 0 ] && grep -q "^alltoall: 64 MiB per rank ok" "$log"; then
      record "mpirun -np 2" "pml ucx, UCX_TLS=$tls,self" "ok  $(grep -o '[0-9.]* us round trip' "$log")"
    else
      record "mpirun -np 2" "pml ucx, UCX_TLS=$tls,self" "FAIL"
      tail -20 "$log" >&2
    fi
  done
else
  table+=("$(printf '%-18s %-34s %s' mpirun "" "not installed")")
  [ -n "${CI:-}" ] && fail=$((fail + 1))
fi

echo
printf '%-18s %-34s %s\n' program options result
printf '%s\n' "${table[@]}"
echo
echo "acceptance: $pass passed, $fail failed (logs in $logs)"
[ $fail -eq 0 ]
