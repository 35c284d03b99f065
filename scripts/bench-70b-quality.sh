#!/usr/bin/env bash
# Issue 18's quality check: llama2-70b, batch 256 × 4096, bf16, on 2x8xH100 and 2x8xH200 — the
# automatic plan against the seeds' hand-written configurations evaluated with `--plan`, each
# at its best micro-batch count (and, for pipelines, checkpointing mode) that fits; one that
# fits at none is reported with the least memory it needs. Prints a markdown table.
# usage: scripts/bench-70b-quality.sh [path/to/tessera]
set -euo pipefail
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
batch=256
seq=4096
configs=("dp2 tp2 pp4 zero1" "tp8 pp2" "dp2 tp8 sp zero1" "dp16 zero2")

# step_of CLUSTER CONFIG: prints "step_s peak_GiB config" for a fitting plan, or
# "nofit needed_GiB config" (inf when the error names no figure).
step_of() {
  local out
  if out=$("$bin" plan --model llama2-70b --cluster "$1" --batch $batch --seq $seq \
      --plan "$2" --format json 2>/tmp/bench-70b.err); then
    python3 -c '
import json, sys
d = json.load(sys.stdin)
p = d["predicted"]
print(p["step_time_s"], max(p["peak_bytes_per_device"]) / 2**30, d["config"])' <<<"$out"
  else
    local need
    need=$(grep -oE "least any plan needs is [0-9.]+ GiB" /tmp/bench-70b.err | awk '{print $6}')
    echo "nofit ${need:-inf} $2"
  fi
}

echo "| cluster | configuration | best fitting form | step (s) | peak (GiB) | auto / this |"
echo "|---|---|---|---|---|---|"
for cluster in 2x8xH100 2x8xH200; do
  auto=$("$bin" plan --model llama2-70b --cluster "$cluster" --batch $batch --seq $seq --format json)
  read -r auto_step auto_peak auto_cfg auto_ms < <(python3 -c '
import json, sys
d = json.load(sys.stdin)
p = d["predicted"]
print(p["step_time_s"], max(p["peak_bytes_per_device"]) / 2**30, d["config"].replace(" ", "_"), d["search_ms"])' <<<"$auto")
  printf '| %s | automatic (search %.1f s) | `%s` | %.3f | %.1f | 1.000 |\n' \
    "$cluster" "$(echo "$auto_ms / 1000" | bc -l)" "${auto_cfg//_/ }" "$auto_step" "$auto_peak"
  for cfg in "${configs[@]}"; do
    dp=$(grep -oE "dp[0-9]+" <<<"$cfg" | tr -d dp || true)
    dp=${dp:-1}
    best=""
    least=""
    if grep -q pp <<<"$cfg"; then
      forms=()
      for size in 1 2; do
        for ck in "" " ckpt=selective" " ckpt=full"; do
          forms+=("$cfg mb$((batch / (dp * size)))$ck")
        done
      done
    else
      forms=()
      for mb in 1 2 4 8 16 32 64 128; do
        [ $((batch % (dp * mb))) -eq 0 ] && forms+=("$cfg mb$mb")
      done
    fi
    for form in "${forms[@]}"; do
      read -r a b c <<<"$(step_of "$cluster" "$form")"
      if [ "$a" = nofit ]; then
        if [ -z "$least" ] || python3 -c "import sys; sys.exit(0 if float('$b') < float('$least') else 1)"; then
          least="$b"
        fi
      elif [ -z "$best" ] || python3 -c "import sys; sys.exit(0 if $a < ${best%% *} else 1)"; then
        best="$a $b $form"
      fi
    done
    if [ -n "$best" ]; then
      read -r s p f <<<"$best"
      printf '| %s | `%s` | `%s` | %.3f | %.1f | %.3f |\n' "$cluster" "$cfg" "${best#* * }" "$s" "$p" \
        "$(echo "$auto_step / $s" | bc -l)"
    else
      printf '| %s | `%s` | fits in no form (the least any needs: %s GiB) | — | — | — |\n' \
        "$cluster" "$cfg" "$least"
    fi
  done
done
