#!/usr/bin/env bash
# The planner's search time as CPU time, for a machine shared with other work: each case is
# planned RUNS times (default 3) under /usr/bin/time, and the table gives the median CPU time
# (user + system: what the search itself spent, whatever else the machine runs), the median wall
# time and the plan found. The cases: the issue-44 search-time rows (gpt2-xl on 4xRTX4090 at
# bench-plan.sh's settings, llama3-8b at 256K on 8xH100 at bench-long-context.sh's).
# usage: [RUNS=3] scripts/bench-search-time.sh [path/to/tessera] [case ...]
# (a case: "model cluster batch seq [dtype]"; without a dtype `--baseline megatron` is added,
# as bench-plan.sh does)
set -euo pipefail
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
shift || true
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(
  "gpt2-xl 4xRTX4090 16 1024"
  "llama3-8b 8xH100 1 262144 bf16"
)
runs=${RUNS:-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| case | plan | CPU (s), median of $runs | wall (s), median | runs: CPU / wall (s) |"
echo "|---|---|---|---|---|"
for c in "${cases[@]}"; do
  read -r model cluster batch seq dtype <<<"$c"
  args=(plan --model "$model" --cluster "$cluster" --batch "$batch" --seq "$seq" --format json)
  if [ -n "${dtype:-}" ]; then args+=(--dtype "$dtype"); else args+=(--baseline megatron); fi
  : >"$tmp/times"
  for _ in $(seq "$runs"); do
    /usr/bin/time -f "%U %S %e" -o "$tmp/t" "$bin" "${args[@]}" >"$tmp/out.json"
    cat "$tmp/t" >>"$tmp/times"
  done
  python3 - "$tmp/times" "$tmp/out.json" "$c" <<'PY'
import json, statistics, sys
times = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
cpu = [u + s for u, s, _ in times]
wall = [w for _, _, w in times]
d = json.load(open(sys.argv[2]))
runs = ", ".join(f"{c:.2f} / {w:.2f}" for c, w in zip(cpu, wall))
print(f"| {sys.argv[3]} | `{d['config']}` ({d['predicted']['step_time_s']:.4f} s/step) | "
      f"{statistics.median(cpu):.2f} | {statistics.median(wall):.2f} | {runs} |")
PY
done
