#!/usr/bin/env bash
# Stable Diffusion's UNet planned (issue 47, the seeds' case): SD 2's UNet at batch 16 on
# 512×512 pictures (64×64 latents, 77 text tokens), AdamW, on one RTX 3060 with its host's
# memory and NVMe (the presets' GeForce desktop: 32 GiB, 1 TB), one RTX 4090 and eight
# A100-80G; DreamBooth-style fine-tuning of SD 1.5's UNet (batch 1 and 2, the UNet trained in
# full, or LoRA adapters on its attention projections) on an 8 GB RTX 3050. The text encoder
# and the VAE are not in the planned graph: DreamBooth and SD training keep them frozen, and
# their outputs (text states, latents) are the UNet's inputs. Prints a Markdown table: the
# plan, its predicted per-device peak against the budget, the host peak, the predicted step,
# the search's wall time. A case no plan fits prints the planner's reason.
# usage: scripts/bench-sd-plan.sh [path/to/tessera] [regex]  (regex: only the cases it matches,
# written "model cluster batch mode", e.g. 'A100|lora')
set -euo pipefail
bin=${1:-target/release/tessera}
only=${2:-.}
[ -x "$bin" ] || cargo build --release -q --bin tessera
fx="$(dirname "$0")/../crates/tessera-cli/tests/fixtures/diffusers_unet"
lora="r=4,alpha=4,dropout=0,targets=to_q,to_k,to_v,to_out.0"
cases=(
  "sd2 1xRTX3060 16 full"
  "sd2 1xRTX4090 16 full"
  "sd2 8xA100-80G 16 full"
  "sd15 1xRTX3050 1 full"
  "sd15 1xRTX3050 2 full"
  "sd15 1xRTX3050 1 lora"
)
echo "| UNet | cluster | batch | trains | plan | device peak / budget | host peak | predicted step | search |"
echo "|---|---|---|---|---|---|---|---|---|"
for c in "${cases[@]}"; do
  [[ $c =~ $only ]] || continue
  read -r model cluster batch mode <<<"$c"
  flags=(--model "$fx/$model/config.json" --cluster "$cluster" --batch "$batch" --image-size 64 --seq 77)
  trains="UNet (AdamW)"
  if [ "$mode" = lora ]; then flags+=(--lora "$lora"); trains="LoRA r=4 on to_q/k/v/out"; fi
  t0=$(date +%s.%N)
  if out=$(timeout 900 "$bin" plan "${flags[@]}" --format json 2>/dev/null); then
    t1=$(date +%s.%N)
    python3 - "$model" "$cluster" "$batch" "$trains" "$t0" "$t1" <<PY
import json, sys
d = json.loads('''$out''')
m, c, b, trains, t0, t1 = sys.argv[1:]
p = d["predicted"]
g = lambda x: x / 2**30
host = (d.get("offload") or {}).get("host_peak_bytes", 0)
print(f"| {m} | {c} | {b} | {trains} | \`{d['config']}\` | {g(max(p['peak_bytes_per_device'])):.2f} / {g(d['memory_budget_bytes']):.2f} GiB | {g(host):.2f} GiB | {p['step_time_s']:.3f} s | {d['search_ms'] / 1e3:.1f} s (wall {float(t1) - float(t0):.1f} s) |")
PY
  else
    why=$(timeout 900 "$bin" plan "${flags[@]}" 2>&1 | tr '\n' ' ' | head -c 240)
    echo "| $model | $cluster | $batch | $trains | (no plan: $why) | | | | |"
  fi
done
