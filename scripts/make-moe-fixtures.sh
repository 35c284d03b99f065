#!/usr/bin/env bash
# Regenerates the Hugging Face MoE parity fixtures (crates/tessera-cli/tests/fixtures/hf_moe/)
# that crates/tessera-cli/tests/moe_models.rs checks `tessera eval` / `generate` / `profile`
# against: tiny Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 checkpoints written from
# `transformers` in the Hub's per-expert layout, their logits, loss (router auxiliary loss
# included) and greedy generations, the released MoE checkpoints' configs with transformers'
# parameter counts, and DeepSeek-V3's parameter count on the meta device
# (deepseek_v3_params.json).
#
# usage: scripts/make-moe-fixtures.sh              set up .venv-moe if needed, then generate
#        scripts/make-moe-fixtures.sh --venv-only  only set up the venv
#
# The venv is .venv-moe: the newest torch and transformers from PyPI (Qwen3-MoE needs
# transformers >= 4.51; the fixtures were written with the versions in versions.json). PyPI's
# Linux torch wheel is the CUDA build, and torch >= 2.6 does not import without its nvidia-*
# libraries, so they are installed too (a few GB; the CPU-only index is not reachable here).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-moe
py=$venv/bin/python

ok() { "$py" -c "import torch, transformers, safetensors; torch.ones(2) @ torch.ones(2); from transformers import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM" 2>/dev/null; }

if ! [ -x "$py" ]; then
  echo "creating $venv..." >&2
  python3 -m venv "$venv"
fi
if ! ok; then
  echo "installing torch, transformers and safetensors into $venv..." >&2
  "$venv/bin/pip" install -q torch transformers safetensors
  ok || { echo "error: torch / transformers do not import in $venv" >&2; exit 1; }
fi
[ "${1:-}" = "--venv-only" ] && exit 0

"$py" scripts/make_moe_fixtures.py
