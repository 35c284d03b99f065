#!/usr/bin/env bash
# The bf16-curve acceptance point: over SEEDS seeds (8), the median over seeds of the max
# relative per-step loss difference between bf16 and fp32 over 50 steps, Tessera's against
# PyTorch autocast's from the same initialisation and data, for gpt2-tiny and llama-tiny.
#
#   scripts/bf16-seeds.sh [OUT_DIR] [device]        # device: cuda (default) or cpu
#
# 1. `bf16_spread --dump-only` (examples/bf16_spread.rs) writes each seed's initial weights (a
#    Hugging Face directory) and its 50 batches to DUMP (default a temporary directory, removed
#    at the end; 16 seeds x ~27 MB).
# 2. Tessera trains each seed in fp32 and bf16 on the device: OUT_DIR/tessera.jsonl (one line
#    per model and seed: max_rel, max_abs, first and final losses; a summary line per model).
# 3. PyTorch (`scripts/torch-bf16-spread.py --from DUMP`) loads each seed with `from_pretrained`
#    and trains it in fp32 and under autocast(bf16) on the device: OUT_DIR/torch.jsonl, the same
#    fields. On cuda, 2 and 3 run side by side on the one GPU; on cpu, one after the other.
# 4. The verdict per model, one JSON line each (OUT_DIR/verdict.jsonl, and stdout): pass when
#    Tessera's median max_rel <= BOUND x PyTorch's, both worst seeds, every seed's max_rel, and
#    `same_start`: per seed, |PyTorch's first fp32 loss - Tessera's on the device| (same weights,
#    same data: ~1e-6 when they are). Exit 0 whatever the verdict; non-zero only when a side
#    failed to run.
#
# Needs no Rust and no network: BF16_SPREAD names the prebuilt example binary (default
# target/release/examples/bf16_spread, built with `cargo build --release -p tessera-cuda
# --example bf16_spread`, which this script runs where cargo is present and the binary is
# not). PYTHON names an interpreter with torch and transformers (default python3). SEEDS (8),
# MODELS (comma-separated) and BOUND (1.5) change the rest. TORCH_JSONL names an earlier run's
# OUT_DIR/torch.jsonl to reuse instead of running PyTorch again (its side depends only on the
# seeds' weights and batches, which are Tessera-build independent: `same_start` still checks
# them), so a before/after comparison of two Tessera builds trains PyTorch once.
set -uo pipefail
out=${1:-bf16-seeds-out}
dev=${2:-cuda}
seeds=${SEEDS:-8}
models=${MODELS:-gpt2-tiny,llama-tiny}
bound=${BOUND:-1.5}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
bin=${BF16_SPREAD:-$here/../target/release/examples/bf16_spread}
mkdir -p "$out"
if [ ! -x "$bin" ]; then
  if command -v cargo >/dev/null; then
    (cd "$here/.." && cargo build --release -p tessera-cuda --example bf16_spread) || exit 1
  else
    echo "bf16-seeds: no binary at $bin (set BF16_SPREAD)" >&2; exit 1
  fi
fi
if [ "$dev" = cuda ]; then
  # The driver API, NVRTC and cuBLAS are loaded at run time: find them (as gpu-check.sh does).
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64 \
           $("$py" -c 'import nvidia, os; p = nvidia.__path__[0]; print(" ".join(os.path.join(p, d, "lib") for d in os.listdir(p)))' 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
  done
fi
# The dump (~420 MB) stays out of OUT_DIR, which may be a folder that is copied back; a temporary
# one goes when the script ends, one named by DUMP stays.
if [ -n "${DUMP:-}" ]; then
  dump=$DUMP
else
  dump=$(mktemp -d "${TMPDIR:-/tmp}/bf16-seeds-dump.XXXXXX") || exit 1
  trap 'rm -rf "$dump"' EXIT
fi
t0=$(date +%s)
# Each seed's initial weights and batches (on the CPU: the init does not depend on the device).
"$bin" --model "$models" --seeds "$seeds" --dump "$dump" --dump-only 2> "$out/tessera-stderr.txt" \
  || { echo "bf16-seeds: bf16_spread --dump-only failed:" >&2; tail -20 "$out/tessera-stderr.txt" >&2; exit 1; }
t1=$(date +%s)
# Tessera's training and PyTorch's, side by side on a GPU (one after the other on the CPU).
"$bin" --model "$models" --seeds "$seeds" --device "$dev" --json \
  > "$out/tessera.jsonl" 2>> "$out/tessera-stderr.txt" &
tessera=$!
if [ "$dev" != cuda ]; then
  wait $tessera; tessera_rc=$?; t_tessera=$(( $(date +%s) - t1 ))
fi
t2=$(date +%s)
if [ -n "${TORCH_JSONL:-}" ]; then
  cp "$TORCH_JSONL" "$out/torch.jsonl"
  torch_rc=$?
else
  "$py" "$here/torch-bf16-spread.py" --from "$dump" --device "$dev" --models "$models" --seeds "$seeds" \
    > "$out/torch.jsonl" 2> "$out/torch-stderr.txt"
  torch_rc=$?
fi
t_torch=$(( $(date +%s) - t2 ))
if [ "$dev" = cuda ]; then
  wait $tessera; tessera_rc=$?; t_tessera=$(( $(date +%s) - t1 ))
fi
t_total=$(( $(date +%s) - t0 ))
[ $tessera_rc = 0 ] || { echo "bf16-seeds: bf16_spread failed:" >&2; tail -20 "$out/tessera-stderr.txt" >&2; exit 1; }
[ $torch_rc = 0 ] || { echo "bf16-seeds: torch-bf16-spread.py failed:" >&2; tail -20 "$out/torch-stderr.txt" >&2; exit 1; }
"$py" - "$out" "$bound" "$t_tessera" "$t_torch" "$t_total" "$dev" "$seeds" <<'EOF' | tee "$out/verdict.jsonl"
import json, statistics, sys
out, bound, dev = sys.argv[1], float(sys.argv[2]), sys.argv[6]
t_tessera, t_torch, t_total = map(int, sys.argv[3:6])
nseeds = int(sys.argv[7])
def lines(name):
    return [json.loads(l) for l in open(f"{out}/{name}") if l.strip()]
tess, torch = lines("tessera.jsonl"), lines("torch.jsonl")
def summ(rows):
    # From the per-seed rows (seeds below SEEDS: a reused TORCH_JSONL may hold more).
    worst = max(rows.values(), key=lambda r: r["max_rel"])
    return {"device": worst["device"], "seeds": len(rows),
            "median_max_rel": statistics.median(r["max_rel"] for r in rows.values()),
            "worst_seed": worst["seed"], "worst_max_rel": worst["max_rel"],
            "median_max_abs": statistics.median(r["max_abs"] for r in rows.values())}
for m in [r["model"] for r in tess if r.get("summary")]:
    seeds = lambda rows: {r["seed"]: r for r in rows
                          if r["model"] == m and not r.get("summary") and r["seed"] < nseeds}
    ts, ps = seeds(tess), seeds(torch)
    if sorted(ts) != sorted(ps):
        sys.exit(f"{m}: Tessera ran seeds {sorted(ts)}, PyTorch {sorted(ps)}")
    a, b = summ(ts), summ(ps)
    # Same weights, same data: PyTorch's first fp32 loss against Tessera's on the device.
    starts = [abs(ps[s]["first_fp32"] - ts[s]["first_fp32"]) for s in ps if s in ts]
    ratio = a["median_max_rel"] / b["median_max_rel"] if b["median_max_rel"] > 0 else None
    print(json.dumps({
        "verdict": "pass" if a["median_max_rel"] <= bound * b["median_max_rel"] else "fail",
        "model": m, "device": a["device"], "seeds": a["seeds"], "bound": bound,
        "tessera_median_max_rel": a["median_max_rel"], "torch_median_max_rel": b["median_max_rel"],
        "ratio": ratio,
        "tessera_worst": {"seed": a["worst_seed"], "max_rel": a["worst_max_rel"]},
        "torch_worst": {"seed": b["worst_seed"], "max_rel": b["worst_max_rel"]},
        "tessera_max_rel": [ts[s]["max_rel"] for s in sorted(ts)],
        "torch_max_rel": [ps[s]["max_rel"] for s in sorted(ps)],
        "tessera_median_max_abs": a["median_max_abs"], "torch_median_max_abs": b["median_max_abs"],
        "same_start": starts, "same_start_max": max(starts) if starts else None,
        # ~1e-6 when both start from the same weights and data; a mapping error shows as > 0.1.
        "same_start_ok": bool(starts) and max(starts) <= 1e-4,
        "secs": {"tessera": t_tessera, "torch": t_torch, "total": t_total},
        "side_by_side": dev == "cuda",
    }))
EOF
exit 0
