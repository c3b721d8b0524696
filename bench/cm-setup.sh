#!/usr/bin/env bash
# Connection setup through softrdma's connection manager beside TCP connect() on the same
# addresses, in one run: 1,000 sequential and 100 concurrent connections between two
# processes (server on 127.0.0.2, client on 127.0.0.3), rates, latencies and the ratio.
#   bench/cm-setup.sh [N] [CONCURRENT]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p softrdma-cli
b=target/release/softrdma
n=${1:-1000} c=${2:-100}
out=$(mktemp)
"$b" connrate --listen 127.0.0.2 -p 7300 >"$out" 2>&1 &
srv=$!
sleep 0.5
"$b" connrate 127.0.0.2 -b 127.0.0.3 -p 7300 -n "$n" --concurrent "$c"
wait $srv
cat "$out"
rm -f "$out"
