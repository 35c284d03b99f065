#!/usr/bin/env bash
# Fine-tuning plans (issue 46, item 4): LoRA on a bf16 base and QLoRA on an int4 base
# (`--quantize-base int4`, generation's int4: one f32 scale per 128 input features), planned
# by the automatic search like any other job. For each case: the plan, its predicted per-device
# peak against the budget, the predicted tokens/s, the trainable parameters, and the planner's
# state breakdown (frozen base at its stored bytes; gradients and AdamW state for the adapters
# only). A case no plan fits prints the planner's reason.
# usage: scripts/bench-finetune.sh [path/to/tessera]
set -euo pipefail
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
# QLoRA's recipe (Dettmers et al. 2023): adapters on every linear of the decoder.
spec="r=16,alpha=32,dropout=0,targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
cases=(
  "llama3-8b 1xRTX4090 4 2048 lora"
  "llama3-8b 1xRTX4090 4 2048 qlora"
  "llama3-8b 1xRTX3060 4 2048 lora"
  "llama3-8b 1xRTX3060 4 2048 qlora"
  "llama3-8b 1xRTX3060 1 2048 qlora"
  "llama2-70b 1xA6000 1 2048 qlora"
  "llama2-70b 1xA6000 4 512 qlora"
  "llama2-70b 2xRTX4090 1 2048 qlora"
)
echo "| model | cluster | batch × seq | base | plan | peak / budget | predicted tokens/s | params (predicted.params_bytes) |"
echo "|---|---|---|---|---|---|---|---|"
for c in "${cases[@]}"; do
  read -r model cluster batch seq mode <<<"$c"
  flags=(--lora "$spec" --dtype bf16)
  base="bf16"
  if [ "$mode" = qlora ]; then flags+=(--quantize-base int4); base="int4"; fi
  if out=$(timeout 600 "$bin" plan --model "$model" --cluster "$cluster" --batch "$batch" --seq "$seq" \
      "${flags[@]}" --format json 2>/dev/null); then
    python3 - "$model" "$cluster" "$batch" "$seq" "$base" <<PY
import json, sys
d = json.loads('''$out''')
m, c, b, s, base = sys.argv[1:]
p = d["predicted"]
g = lambda x: x / 2**30
print(f"| {m} | {c} | {b} × {s} | {base} | {d['config']} | {g(max(p['peak_bytes_per_device'])):.1f} / {g(d['memory_budget_bytes']):.1f} GiB | {p['tokens_per_s']:.0f} | {g(p['params_bytes']):.2f} GiB |")
PY
  else
    why=$(timeout 600 "$bin" plan --model "$model" --cluster "$cluster" --batch "$batch" --seq "$seq" \
      "${flags[@]}" 2>&1 | tr '\n' ' ' | head -c 200)
    echo "| $model | $cluster | $batch × $seq | $base | (no plan: $why) | | | |"
  fi
done
