#!/usr/bin/env bash
# NeMo's long-context curve (issue 44's acceptance), two tables. Planner figures (no run); the
# search time is this machine's.
#
# 1. `curve`: predicted TFLOPs per GPU for llama3-8b, bf16, AdamW, one sequence per step, from
#    8K to 1M tokens on 16, 32, 64 and 128 H100s, the automatic plan at each point (ring
#    attention in the search: cp × tp past the KV heads), by scripts/bench-long-context.sh.
# 2. `layouts`: NeMo's own long-sequence layouts on H100 (NVIDIA/NeMo
#    docs/source/performance/performance_long_sequence.md, "LLAMA2-7B (FP8)", DGX-H100,
#    NeMo 24.03.01: TP/PP/DP/CP and TFLOPs/GPU at each sequence length, the GPU count growing
#    with it), rows of 16 to 128 GPUs: llama2-7b under `--plan "dpD tpT ppP cpC cp=ring"`
#    (Megatron's default p2p context parallelism is ring attention; the search chooses the
#    rest: micro-batches, sp, ZeRO, checkpointing), bf16, beside NeMo's FP8 figure. NeMo's
#    H100 table gives no batch; its later B200 table keeps 4M tokens per step (batch × seq),
#    which this assumes. That B200 table (LLAMA3-8B, FP8, 1,671 TFLOPs/GPU at 8K, 1,608 at 1M
#    on 1,024 B200s, TP4 CP16) is the flat curve issue 44 quotes: neither H100 nor bf16.
# TFLOPs/GPU counts 6·N per token plus attention's causal 6·L·h·S², as NeMo and Megatron-LM do.
# usage: [PART=curve|layouts|both] [SEQS="8192 1048576"] scripts/bench-nemo-curve.sh \
#          [path/to/tessera] [cluster ...]   (clusters: the curve's; default 16 to 128 H100s)
set -euo pipefail
here=$(dirname "$0")
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
shift || true
clusters=("$@")
[ ${#clusters[@]} -gt 0 ] || clusters=(2x8xH100 4x8xH100 8x8xH100 16x8xH100)
part=${PART:-both}
if [ "$part" != layouts ]; then
  SEQS="${SEQS:-8192 32768 131072 262144 524288 1048576}" \
    "$here/bench-long-context.sh" "$bin" "${clusters[@]}"
fi
[ "$part" != curve ] || exit 0
[ "$part" != both ] || echo
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
echo "| GPUs | seq | NeMo layout (TP PP DP CP) | NeMo FP8 TFLOPs/GPU | plan (bf16) | step (s) | TFLOPs/GPU | peak / device | search (s) |"
echo "|---|---|---|---|---|---|---|---|---|"
# seq (K), cluster, TP, PP, DP, CP, NeMo's TFLOPs/GPU with CP.
while read -r k cluster tp pp dp cp nemo; do
  seq=$((k * 1024))
  batch=$((4194304 / seq))
  config="dp$dp tp$tp"
  [ "$cp" = 1 ] || config="$config cp$cp cp=ring"
  [ "$pp" = 1 ] || config="$config pp$pp"
  t0=$(date +%s.%N)
  if timeout 900 "$bin" plan --model llama2-7b --cluster "$cluster" --batch "$batch" \
      --seq "$seq" --dtype bf16 --plan "$config" --format json >"$tmp" 2>&1; then
    t1=$(date +%s.%N)
    python3 - "$tmp" "$cluster" "$seq" "$batch" "$tp $pp $dp $cp" "$nemo" "$t0" "$t1" <<'PY'
import json, sys
path, cluster, seq, batch, layout, nemo, t0, t1 = sys.argv[1:9]
seq, batch = int(seq), int(batch)
p = json.load(open(path))
pr = p["predicted"]
n = len(pr["peak_bytes_per_device"])
# llama2-7b: 6.74e9 parameters, 32 layers, hidden 4096.
n_params, layers, hidden = 6.74e9, 32, 4096
flops = batch * (6 * n_params * seq + 6 * layers * hidden * seq * seq)
tflops = flops / pr["step_time_s"] / n / 1e12
print(f"| {n} | {seq // 1024}K | {layout} | {nemo} | `{p['config']}` | {pr['step_time_s']:.3f} | "
      f"{tflops:.0f} | {max(pr['peak_bytes_per_device']) / 2**30:.2f} GiB | "
      f"{float(t1) - float(t0):.1f} |")
PY
  else
    echo "| - | ${k}K | $tp $pp $dp $cp | $nemo | refused: $(head -c 160 "$tmp" | tr '\n|' '  ') | | | | |"
  fi
done <<'ROWS'
16 2x8xH100 2 1 8 1 660
32 4x8xH100 2 1 8 2 610
64 8x8xH100 4 1 8 2 574
128 16x8xH100 4 1 8 4 555
ROWS
