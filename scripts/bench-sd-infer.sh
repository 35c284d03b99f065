#!/usr/bin/env bash
# int8 inference of Stable Diffusion's UNet (issue 47, the seeds' 2.5×): one denoising step's
# UNet forward (`tessera profile --inference`), SD 2 and SD 1.5 at 64×64 latents and 77 text
# tokens, batch 2 (one picture with classifier-free guidance), its weights in fp32, bf16, or
# bf16 with every linear and convolution weight held int8 (`--quantize int8`). Prints a
# Markdown table of the profile's weights, activations and peak.
# usage: scripts/bench-sd-infer.sh [path/to/tessera] [batch]
set -euo pipefail
bin=${1:-target/release/tessera}
batch=${2:-2}
[ -x "$bin" ] || cargo build --release -q --bin tessera
fx="$(dirname "$0")/../crates/tessera-cli/tests/fixtures/diffusers_unet"
echo "| UNet | batch | weights held | of them int8 | weights | activations | peak | fp32 peak / peak | bf16 peak / peak |"
echo "|---|---|---|---|---|---|---|---|---|"
for model in sd2 sd15; do
  f32=""; b16=""
  for mode in fp32 bf16 int8; do
    flags=(--model "$fx/$model/config.json" --batch "$batch" --image-size 64 --seq 77)
    case $mode in
      fp32) flags+=(--dtype fp32) ;;
      bf16) flags+=(--dtype bf16) ;;
      int8) flags+=(--dtype bf16 --quantize int8) ;;
    esac
    out=$("$bin" profile --inference "${flags[@]}" --format json)
    row=$(python3 - "$model" "$batch" "$mode" "$f32" "$b16" <<PY
import json, sys
d = json.loads('''$out''')
m, b, mode, f32, b16 = sys.argv[1:]
x = d["memory"]
g = lambda v: f"{v / 2**30:.2f} GiB"
r = lambda base: f"{float(base) / x['peak_bytes']:.2f}×" if base else "—"
print(f"| {m} | {b} | {mode} | {g(x['quantized_weights_bytes'])} | {g(x['weights_bytes'])} | {g(x['activations_bytes'])} | {g(x['peak_bytes'])} | {r(f32)} | {r(b16)} |")
print(x["peak_bytes"])
PY
)
    echo "$row" | head -1
    peak=$(echo "$row" | tail -1)
    case $mode in fp32) f32=$peak ;; bf16) b16=$peak ;; esac
  done
done
