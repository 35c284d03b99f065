#!/usr/bin/env bash
# BENCHMARKS.md "ONNX import": exports GPT-2 124M and an 8-layer LLaMA (scripts/bench_onnx_export.py,
# in .venv-bench: torch 2.5.1 + transformers 4.46.3, see scripts/make-hf-fixtures.sh), times
# reading and importing them (crates/tessera-onnx/examples/import_time.rs), and compares the
# imported GPT-2's profile and plan with the built-in family on the same config.json.
#
# usage: scripts/bench-onnx-import.sh [OUT_DIR]   (default target/bench-onnx; ~0.8 GB of files)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/bench-onnx}
scripts/make-hf-fixtures.sh --venv-only
mkdir -p "$out"
[ -f "$out/llama-8l.onnx" ] || .venv-bench/bin/python scripts/bench_onnx_export.py "$out"
cargo build --release -q -p tessera-cli
cargo build --release -q -p tessera-onnx --example import_time
imp=target/release/examples/import_time
$imp "$out/gpt2-124m.onnx" 8 1024
for s in 1024 4096 8192; do /usr/bin/time -f "peak RSS %M KB" $imp "$out/llama-8l.onnx" 4 "$s"; done
t=target/release/tessera
for m in "$out/gpt2-124m-config" "$out/gpt2-124m.onnx"; do
  echo "== $m"
  $t profile --model "$m" --batch 8 --seq 1024 --format json | python3 -c \
    'import json,sys; d=json.load(sys.stdin); print("flops", d["flops"]["total"], "peak", d["memory"]["peak_bytes"], "params", d["params"])'
  /usr/bin/time -f "plan wall %e s, RSS %M KB" $t plan --model "$m" --cluster 8xH100 --batch 64 --seq 1024 | head -2
done
