#!/usr/bin/env bash
# Packs what a bigger machine without cargo or package access needs to take softrdma's
# figures: the release binaries, the drop-in libraries and the Debian packages of the
# baselines (UCX, iperf3, perftest and what they link), into .remote/ (ignored by git).
#
#   bench/remote-pack.sh          # here: builds, downloads; about 15 MB
#   # copy the checkout with .remote/ to the other machine (x86-64, glibc 2.36 or newer), then
#   bench/remote-run.sh OUTDIR    # there: unpacks the packages under /tmp, runs the benchmarks
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p softrdma-cli -p udp-probe
cargo build --release -q -p softrdma-proto --example icrc_cost
scripts/build-libs.sh >/dev/null
rm -rf .remote && mkdir -p .remote/bin .remote/deb
cp target/release/softrdma target/release/udp-probe target/release/examples/icrc_cost .remote/bin/
strip .remote/bin/*
cp -a target/softrdma-lib .remote/lib
# apt downloads into the current directory; as root it warns that _apt cannot write there.
# Each package on its own, so that one this release names otherwise (libssl3 is
# libssl3t64 on newer ones) does not stop the rest; compare.sh skips a baseline it lacks.
for p in ucx-utils libucx0 iperf3 libiperf0 libsctp1 perftest libibverbs1 librdmacm1 libibumad3 \
  libnuma1 libpci3 libssl3 ibverbs-providers; do
  (cd .remote/deb && apt-get download -q "$p" >/dev/null 2>&1) || echo "not downloaded: $p"
done
ls .remote/deb/*.deb >/dev/null 2>&1 || { echo "no package downloaded: only softrdma will run there"; }
du -sh .remote
