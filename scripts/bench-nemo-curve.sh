#!/usr/bin/env bash
# NeMo's long-context curve (issue 44's acceptance): predicted TFLOPs per GPU for llama3-8b,
# bf16, AdamW, one sequence per step, from 8K to 1M tokens on 16, 32, 64 and 128 H100s, the
# automatic plan at each point (ring attention in the search: cp × tp past the KV heads).
# NeMo's published curve is flat: 1,671 TFLOPs/GPU at 8K and 1,608 at 1M (TP4 CP16), as
# issue 44 quotes it. Planner figures (no run); the search time is this machine's.
# usage: [SEQS="8192 1048576"] scripts/bench-nemo-curve.sh [path/to/tessera] [cluster ...]
set -euo pipefail
here=$(dirname "$0")
bin=${1:-target/release/tessera}
shift || true
clusters=("$@")
[ ${#clusters[@]} -gt 0 ] || clusters=(2x8xH100 4x8xH100 8x8xH100 16x8xH100)
export SEQS="${SEQS:-8192 32768 131072 262144 524288 1048576}"
exec "$here/bench-long-context.sh" "$bin" "${clusters[@]}"
