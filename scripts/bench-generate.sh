#!/usr/bin/env bash
# Decode tokens/s of `tessera generate` (fp32, --quantize int8, --quantize int4) against
# Hugging Face transformers' `generate` on GPT-2 124M (random weights, torch seed 0, written
# with `save_pretrained`), batch 1 and 8, 32-token prompts, 64 new tokens, greedy, measured in
# one run on this machine; also checks that tessera's greedy tokens equal transformers'.
# Prints a Markdown table (see scripts/bench_generate.py for the method).
#
# usage: scripts/bench-generate.sh [bench_generate.py options, e.g. --repeats 5]
# env:   TESSERA=path/to/tessera (default target/release/tessera, built if absent)
#
# Needs no network beyond PyPI for the venv: .venv-bench (torch 2.5.1 CPU, transformers
# 4.46.3), set up by scripts/make-hf-fixtures.sh --venv-only. Outputs in target/bench-generate/.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/make-hf-fixtures.sh --venv-only
bin=${TESSERA:-target/release/tessera}
if ! [ -x "$bin" ]; then
  echo "building $bin..." >&2
  cargo build --release --bin tessera
fi
exec .venv-bench/bin/python scripts/bench_generate.py --tessera "$bin" --out target/bench-generate "$@"
