#!/usr/bin/env bash
# One training step's bf16 error budget, Tessera's against PyTorch autocast's, from the same
# weights and batch (scripts/bf16_grad_budget.py): per parameter group, the relative error of
# the bf16 gradient against the same framework's fp32 one, and of the loss and logits.
#
#   scripts/bf16-grad-budget.sh [device] [seed] [warm steps ...]     # cpu (default) or cuda
#
# Dumps the seed's initial weights and batches (`bf16_spread --dump-only`, as bf16-seeds.sh),
# then for each WARM (default 0 8) starts both frameworks from PyTorch's fp32 weights after
# WARM steps and takes batch WARM. device is PyTorch's; Tessera's side runs on the CPU (its
# CUDA backend rounds at the same points). MODELS (gpt2-tiny,llama-tiny), PYTHON (python3),
# BF16_SPREAD and GRAD_BUDGET (the example binaries; built in debug with cargo when absent).
set -euo pipefail
dev=${1:-cpu}
seed=${2:-1}
shift $(( $# > 2 ? 2 : $# ))
warms=${*:-0 8}
models=${MODELS:-gpt2-tiny,llama-tiny}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
spread=${BF16_SPREAD:-$here/../target/debug/examples/bf16_spread}
budget=${GRAD_BUDGET:-$here/../target/debug/examples/grad_budget}
if [ ! -x "$spread" ] || [ ! -x "$budget" ]; then
  (cd "$here/.." && cargo build -p tessera-cuda --example bf16_spread && cargo build -p tessera-runtime --example grad_budget)
fi
dump=$(mktemp -d "${TMPDIR:-/tmp}/bf16-grad-budget.XXXXXX")
trap 'rm -rf "$dump"' EXIT
"$spread" --model "$models" --seeds $((seed + 1)) --dump "$dump" --dump-only
for m in ${models//,/ }; do
  for w in $warms; do
    echo "== $m seed $seed, from PyTorch's fp32 weights after $w steps, batch $w"
    "$py" "$here/bf16_grad_budget.py" --seed-dir "$dump/$m/seed$seed" --bin "$budget" \
      --device "$dev" --group --warm "$w"
  done
done
