#!/usr/bin/env bash
# A planner speed change must not change the planner's answers: runs `tessera plan --format json`
# with two binaries (before and after) on rows of scripts/bench-plan.sh and
# scripts/bench-long-context.sh and compares the outputs, all but `search_ms` (the search's own
# time). Prints one line per row and exits non-zero if any row differs.
# usage: scripts/check-plan-same.sh path/to/tessera-before path/to/tessera-after [row ...]
# (a row: "model cluster batch seq [budget|-] [dtype]", with `--baseline megatron` unless a dtype
# is given, as in bench-plan.sh; default: the rows below)
# Known: "llama3-8b 1xH100 1 65536 - bf16" differs between two runs of one binary (which AdamW
# moments the offload section lists, and the last digits of its transfer times): check a
# difference there against BEFORE run twice.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BEFORE AFTER [row ...]" >&2; exit 2; }
before=$1 after=$2
shift 2
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(
  "gpt2 8xH100 16 1024"
  "gpt2-medium 4xRTX4090 16 1024 4GiB"
  "gpt2-xl 4xRTX4090 16 1024"
  "gpt2-xl 8xA100-40G 16 1024 8GiB"
  "llama2-7b 8xRTX4090 8 1024"
  "llama3-8b 8xH100 32 4096"
  "llama3-8b 8xH100 32 4096 30GiB"
  "llama3-8b 1xH100 1 65536 - bf16"
  "llama3-8b 8xH100 1 262144 - bf16"
)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for row in "${rows[@]}"; do
  read -r model cluster batch seq budget dtype <<<"$row"
  args=(plan --model "$model" --cluster "$cluster" --batch "$batch" --seq "$seq" --format json)
  [ -n "${budget:-}" ] && [ "$budget" != - ] && args+=(--memory-budget "$budget")
  # bench-plan.sh's rows (no dtype) with its Megatron baseline, bench-long-context.sh's without
  if [ -n "${dtype:-}" ]; then args+=(--dtype "$dtype"); else args+=(--baseline megatron); fi
  for side in before after; do
    bin=${!side}
    # stdout alone is the JSON; a refusal (no JSON) is compared by its message on stderr
    "$bin" "${args[@]}" >"$tmp/$side.json" 2>"$tmp/$side.err" || true
    python3 - "$tmp/$side.json" "$tmp/$side.err" <<'PY'
import json, sys
path, err = sys.argv[1], sys.argv[2]
try:
    d = json.loads(open(path).read())
except ValueError:
    open(path, "a").write(open(err).read())  # a refusal: compared as text
    sys.exit(0)
d.pop("search_ms", None)
open(path, "w").write(json.dumps(d, indent=1, sort_keys=True))
PY
  done
  if cmp -s "$tmp/before.json" "$tmp/after.json"; then
    echo "same: $row ($(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("config"))' "$tmp/after.json" 2>/dev/null || head -c 80 "$tmp/after.json"))"
  else
    echo "DIFFERENT: $row"
    diff "$tmp/before.json" "$tmp/after.json" | head -20 || true
    status=1
  fi
done
exit $status
