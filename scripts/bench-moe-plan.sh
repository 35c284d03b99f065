#!/usr/bin/env bash
# Planner on mixtures of experts (issue 45): for each case (model, cluster, batch, seq, extra
# flags), the automatic plan — expert parallelism (epN) searched with dp, tp, sp, ZeRO,
# micro-batches, checkpointing and pipelines — against the best Megatron-LM-style
# dp/tp/pp/ep configuration under the same cost model, with the memory per device and the
# search time. Routing is priced balanced (--moe-imbalance 1.0, the default) with the capacity
# that holds it (--capacity-factor auto: factor 1.0): the rows a dropless grouped GEMM runs
# under balanced routing, and the buffers Megatron-LM's dropless dispatch then holds (the
# presets' own dropless capacity, a whole sequence per expert, would hold E/k times more).
# Prints a markdown table.
# usage: scripts/bench-moe-plan.sh [path/to/tessera]
set -euo pipefail
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
cases=(
  "mixtral-8x7b 8xH100 64 4096 --capacity-factor auto"
  "mixtral-8x7b 2x8xH100 128 4096 --capacity-factor auto"
  "qwen3-30b-a3b 2x8xH100 128 4096 --capacity-factor auto"
  "deepseek-v3 32x8xH100 1024 4096 --capacity-factor auto"
)
profile=$(case "$bin" in *release*) echo release ;; *) echo debug ;; esac)
echo "Timed $(date -u +%F) on $(nproc) cores of a shared machine, $profile build: search times are upper bounds (the main session may re-time them idle)."
echo
echo "| model | cluster | batch × seq | plan | step (s) | Megatron best | step (s) | ratio | peak / budget | search (s) |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for c in "${cases[@]}"; do
  read -r model cluster batch seq extra <<<"$c"
  args=(plan --model "$model" --cluster "$cluster" --batch "$batch" --seq "$seq" --baseline megatron)
  # shellcheck disable=SC2206
  [ -n "${extra:-}" ] && args+=($extra)
  if out=$(timeout 600 "$bin" "${args[@]}" --format json 2>/dev/null); then
    python3 - "$model" "$cluster" "$batch" "$seq" <<PY
import json, sys
d = json.loads('''$out''')
m, c, b, s = sys.argv[1:]
p = d["predicted"]; mg = d["baselines"].get("megatron")
mt = mg["step_time_s"] if mg else float("nan")
lay = " (per-op)" if d.get("layout") == "per-op" else ""
print(f"| {m} | {c} | {b} × {s} | {d['config']}{lay} | {p['step_time_s']:.3f} | {mg['config'] if mg else '-'} | {mt:.3f} | {mt / p['step_time_s']:.3f} | {max(p['peak_bytes_per_device'])/2**30:.1f} / {d['memory_budget_bytes']/2**30:.1f} GiB | {d['search_ms']/1e3:.1f} |")
PY
  else
    echo "| $model | $cluster | $batch × $seq | (no plan: $(timeout 600 "$bin" "${args[@]}" 2>&1 | tr '\n' ' ' | head -c 200)) | | | | | | |"
  fi
done
