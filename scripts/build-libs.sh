#!/usr/bin/env bash
# Builds softrdma's drop-in C libraries into target/softrdma-lib/:
#   libibverbs.so.1          rdma-core's verbs and rdma_cm ABIs over the softrdma runtime
#   librdmacm.so.1           a symbolic link to it: the loader maps one object for both
#                            names, so the CM's objects are the verbs' objects
#   libmlx5.so.1, libefa.so.1  stubs perftest's binaries need at load time
# cargo cannot apply a symbol-version script to a Rust cdylib (rustc adds its own), so the
# crate builds as a static library and the C compiler links it with our version scripts.
# Usage: scripts/build-libs.sh [--debug]. Prints the library directory.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
[ "${1:-}" = "--debug" ] && profile=debug
flag=--release
[ $profile = debug ] && flag=
cargo build $flag -q -p softrdma-verbs >&2
archive=target/$profile/libsoftrdma_verbs.a
out=target/softrdma-lib
mkdir -p "$out"
maps=crates/softrdma-verbs
cat "$maps/libibverbs.map" "$maps/librdmacm.map" >target/libibverbs+rdmacm.map
maps_verbs=$PWD/target/libibverbs+rdmacm.map
link() { # soname map
  local map=$2
  [ "$map" = libibverbs.map ] && map=$maps_verbs || map=$maps/$map
  cc -shared -o "$out/$1.tmp" -Wl,-soname,"$1" -Wl,--version-script="$map" \
    -Wl,--whole-archive "$archive" -Wl,--no-whole-archive -Wl,--gc-sections -Wl,--strip-debug \
    -lpthread -ldl -lm
  mv "$out/$1.tmp" "$out/$1" # atomic: a running program keeps its mapping
}
link libibverbs.so.1 libibverbs.map
ln -sfn libibverbs.so.1 "$out/librdmacm.so.1"
link libmlx5.so.1 libmlx5.map
link libefa.so.1 libefa.map
echo "$PWD/$out"
