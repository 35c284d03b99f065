#!/usr/bin/env bash
# The cost model against published measured runs: each run's configuration evaluated with
# `tessera plan --plan`, predicted vs measured step time. Prints a markdown table of
# scripts/published-runs.tsv (the runs the test holds within 20%; 25% at seq >= 32768 and for mixtures
# of experts), then one of
# scripts/published-runs-outside.tsv (published runs the model misses by more, or that the planner
# refuses: those rows print the refusal).
# usage: scripts/validate-cost-model.sh [path/to/tessera]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
table() {
  echo "| run | model | cluster | batch × seq | config | measured step (s) | predicted (s) | error | predicted MFU |"
  echo "|---|---|---|---|---|---|---|---|---|"
  grep -v '^#' "$1" | while IFS=$'\t' read -r run model cluster batch seq dtype config flags measured _source; do
    # The flags column: further `tessera plan` flags (`-`: none), split on whitespace.
    extra=()
    [ "$flags" = "-" ] || read -r -a extra <<<"$flags"
    shown=$config
    [ "$flags" = "-" ] || shown="$config\` \`$flags"
    if ! out=$("$bin" plan --model "$model" --cluster "$cluster" --batch "$batch" --seq "$seq" \
      --dtype "$dtype" --plan "$config" "${extra[@]}" --format json 2>&1); then
      # A refusal (a memory miss): the planner's message in place of the prediction.
      msg=$(printf '%s\n' "$out" | grep -m1 '^error: ' | tr '|' ' ' | sed 's/^error: //')
      echo "| $run | $model | $cluster | $batch × $seq | \`$shown\` | $measured | refused: $msg | — | — |"
      continue
    fi
    printf '%s' "$out" | python3 -c '
import json, sys
d = json.load(sys.stdin); run, model, cluster, batch, seq, config, measured = sys.argv[1:]
p = d["predicted"]; t = p["step_time_s"]; mfu = p["mfu"]; m = float(measured)
print(f"| {run} | {model} | {cluster} | {batch} × {seq} | `{config}` | {m:.3f} | {t:.3f} | {100 * (t / m - 1):+.1f}% | {100 * mfu:.1f}% |")
' "$run" "$model" "$cluster" "$batch" "$seq" "$shown" "$measured"
  done
}
table scripts/published-runs.tsv
echo
echo "Outside the bound (scripts/published-runs-outside.tsv):"
echo
table scripts/published-runs-outside.tsv
