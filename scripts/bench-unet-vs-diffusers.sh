#!/usr/bin/env bash
# A CPU training step of a small Stable Diffusion UNet (UNet2DConditionModel) in Tessera
# against diffusers on PyTorch CPU, in the same run (issue 47's speed row in BENCHMARKS.md):
# the two sides back to back --reps times, 2 threads each, steady-state steps (warmup steps
# excluded), wall time and CPU time per step and their ratios. What is timed and how:
# scripts/bench_unet_vs_diffusers.py. Extra arguments go to it (--reps, --batch, --latent,
# --channels, --heads, --steps, --warmup).
#
# usage: BENCH_PY=path/to/python scripts/bench-unet-vs-diffusers.sh [--reps 3]
#   BENCH_PY: a Python with torch and diffusers (default .venv-diffusers/bin/python; set one up
#   with `python3 -m venv .venv-diffusers && .venv-diffusers/bin/pip install torch diffusers
#   transformers`).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${BENCH_PY:-.venv-diffusers/bin/python}
if ! "$py" -c 'import torch, diffusers' 2>/dev/null; then
  echo "error: $py cannot import torch and diffusers; set BENCH_PY (see this script's header)" >&2
  exit 1
fi
cargo build --release -q --bin tessera
exec "$py" scripts/bench_unet_vs_diffusers.py --bin target/release/tessera "$@"
