#!/usr/bin/env bash
# Long-context capacity (issue 44): for llama3-8b, bf16, AdamW, one sequence per step, the
# automatic plan at growing sequence lengths on each cluster — its config, predicted step time,
# tokens/s, TFLOPs per GPU and peak per device, or the refusal's least peak — so the longest
# sequence that fits is the last row with a plan. Planner figures (no run); the search time is
# this machine's. Prints a markdown table.
# usage: [SEQS="262144 327680"] scripts/bench-long-context.sh [path/to/tessera] [cluster ...]
# (SEQS: the sequence lengths to try, in tokens, ascending; default 8K to 2M in powers of two)
set -euo pipefail
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
shift || true
clusters=("$@")
[ ${#clusters[@]} -gt 0 ] || clusters=(1xH100 1xH200 8xH100)
read -r -a seqs <<<"${SEQS:-8192 32768 65536 131072 262144 524288 1048576 2097152}"
echo "| cluster | seq | plan | step (s) | tokens/s | TFLOPs/GPU | peak / device | search (s) |"
echo "|---|---|---|---|---|---|---|---|"
for cluster in "${clusters[@]}"; do
  for seq in "${seqs[@]}"; do
    t0=$(date +%s.%N)
    if timeout 600 "$bin" plan --model llama3-8b --cluster "$cluster" --batch 1 --seq "$seq" \
        --dtype bf16 --format json >"$tmp" 2>&1; then
      t1=$(date +%s.%N)
      python3 - "$tmp" "$cluster" "$seq" "$t0" "$t1" <<'PY'
import json, sys
path, cluster, seq, t0, t1 = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
p = json.load(open(path))
pr = p["predicted"]
n = len(pr["peak_bytes_per_device"])
# Model FLOPs per step, as NeMo and Megatron-LM count them: 6·N per token plus attention's
# 6·L·h·S² (the causal half of QKᵀ and PV, forward and backward), over step time and devices.
n_params, layers, hidden = 8.03e9, 32, 4096
flops = 6 * n_params * seq + 6 * layers * hidden * seq * seq
tflops = flops / pr["step_time_s"] / n / 1e12
print(f"| {cluster} | {seq // 1024}K | `{p['config']}` | {pr['step_time_s']:.3f} | "
      f"{pr['tokens_per_s']:,.0f} | {tflops:.0f} | "
      f"{max(pr['peak_bytes_per_device']) / 2**30:.2f} GiB | {t1 - t0:.1f} |")
PY
    else
      least=$(grep -o 'least any plan needs is [0-9.]* [KMGT]iB' "$tmp" | head -1 || true)
      echo "| $cluster | $((seq / 1024))K | no plan fits (${least:-$(head -c 120 "$tmp")}) | | | | | |"
      break # longer sequences need more
    fi
  done
done
