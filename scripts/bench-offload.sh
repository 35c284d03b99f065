#!/usr/bin/env bash
# Offload capacity, predicted speed and measured CPU-runtime speed (issue 19); see
# scripts/bench_offload.py. Prints markdown tables for BENCHMARKS.md.
# usage: scripts/bench-offload.sh [path/to/tessera]    (BENCH=capacity,speed,zero-offload,measured)
set -euo pipefail
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
exec python3 "$(dirname "$0")/bench_offload.py" "$bin"
