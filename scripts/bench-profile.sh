#!/usr/bin/env bash
# Measures `tessera profile` speed: median `profile_ms` (build graph + autodiff + lower +
# simulate, as the binary reports it) over N runs per model, and the ratio to the 50 ms bound
# the foundation issue sets. Prints Markdown rows for BENCHMARKS.md.
# usage: scripts/bench-profile.sh [runs]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-7}
cargo build --release -q --bin tessera
bin=target/release/tessera
echo "| model | batch | seq | nodes | median profile_ms | bound 50 ms / measured |"
echo "|---|---|---|---|---|---|"
while read -r model batch seq; do
  ms=()
  for _ in $(seq "$runs"); do
    ms+=("$("$bin" profile --model "$model" --batch "$batch" --seq "$seq" --format json \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["profile_ms"])')")
  done
  nodes=$("$bin" profile --model "$model" --batch "$batch" --seq "$seq" --format json \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["graph"]["nodes"])')
  med=$(printf '%s\n' "${ms[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  python3 -c "print(f'| $model | $batch | $seq | $nodes | {float($med):.2f} | {50/float($med):.1f}x |')"
done <<'MODELS'
gpt2 1 1024
gpt2-xl 1 1024
llama2-7b 1 4096
llama2-70b 1 4096
gpt3-175b 1 2048
MODELS
