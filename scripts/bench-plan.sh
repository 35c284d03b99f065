#!/usr/bin/env bash
# Planner quality and speed: for each case (model, cluster, batch, seq, optional per-device
# budget), the automatic plan against the best Megatron-LM-style configuration under the same
# cost model, and the search time. Prints a markdown table.
# usage: scripts/bench-plan.sh [path/to/tessera]
set -euo pipefail
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
cases=(
  "gpt2 1xH100 8 1024"
  "gpt2 8xH100 16 1024"
  "gpt2-medium 4xRTX4090 16 1024"
  "gpt2-medium 4xRTX4090 16 1024 4GiB"
  "gpt2-xl 8xA100-80G 32 1024"
  "gpt2-xl 8xA100-40G 16 1024"
  "gpt2-xl 8xA100-40G 16 1024 8GiB"
  "gpt2-xl 8xH100 64 1024 10GiB"
  "llama2-7b 8xRTX4090 8 1024"
  "llama2-7b 8xH100 32 4096"
  "llama2-7b 8xH100 32 4096 40GiB"
  "llama3-8b 8xH100 32 4096"
  "llama3-8b 8xH100 32 4096 30GiB"
  "llama2-13b 2x8xH100 64 4096"
  "llama2-13b 2x8xH200 64 4096"
  "llama2-13b 8xA100-80G 16 4096 40GiB"
  "llama2-70b 2x8xH100 256 4096"
  "llama2-70b 2x8xH200 256 4096"
  "llama2-70b 8x8xH100 256 4096"
  "llama2-70b 8x8xH100 256 4096 50GiB"
  "gpt3-175b 16x8xH100 1536 2048"
  "gpt3-175b 64x8xH100 1536 2048"
)
echo "| model | cluster | batch × seq | plan | step (s) | Megatron best | step (s) | ratio | peak / budget | search (ms) |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for c in "${cases[@]}"; do
  read -r model cluster batch seq budget <<<"$c"
  extra=()
  [ -n "${budget:-}" ] && extra=(--memory-budget "$budget")
  if out=$(timeout 300 "$bin" plan --model "$model" --cluster "$cluster" --batch "$batch" --seq "$seq" \
      "${extra[@]}" --baseline megatron --format json 2>/dev/null); then
    python3 - "$model" "$cluster" "$batch" "$seq" <<PY
import json, sys
d = json.loads('''$out''')
m, c, b, s = sys.argv[1:]
p = d["predicted"]; mg = d["baselines"].get("megatron")
mt = mg["step_time_s"] if mg else float("nan")
lay = " (per-op)" if d.get("layout") == "per-op" else ""
print(f"| {m} | {c} | {b} × {s} | {d['config']}{lay} | {p['step_time_s']:.4f} | {mg['config'] if mg else '-'} | {mt:.4f} | {mt / p['step_time_s']:.3f} | {max(p['peak_bytes_per_device'])/2**30:.1f} / {d['memory_budget_bytes']/2**30:.1f} GiB | {d['search_ms']:.0f} |")
PY
  else
    echo "| $model | $cluster | $batch × $seq | (no plan: $(timeout 300 "$bin" plan --model "$model" --cluster "$cluster" --batch "$batch" --seq "$seq" "${extra[@]}" 2>&1 | head -c 160)) | | | | | | |"
  fi
done
