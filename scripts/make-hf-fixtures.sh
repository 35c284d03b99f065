#!/usr/bin/env bash
# Regenerates the Hugging Face parity fixtures (crates/tessera-cli/tests/fixtures/hf/) that
# crates/tessera-cli/tests/hf_parity.rs checks `tessera eval` against: small GPT-2, LLaMA,
# Qwen2 and Mistral checkpoints written by `transformers` plus their logits and loss.
# Deterministic: a re-run rewrites identical bytes (compare with the fixtures' SHA256SUMS).
#
# usage: scripts/make-hf-fixtures.sh              set up .venv-bench if needed, then generate
#        scripts/make-hf-fixtures.sh --venv-only  only set up the venv (check-hf-roundtrip.sh)
#
# The venv is .venv-bench (shared with scripts/bench-vs-torch.sh): torch==2.5.1 (CPU use) plus
# transformers==4.46.3 (the version DESIGN.md's FLOP reference uses) and safetensors.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-bench
py=$venv/bin/python
TORCH=2.5.1
TRANSFORMERS=4.46.3

torch_ok() { "$py" -c "import torch, sys; torch.ones(2) @ torch.ones(2); sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; }
hf_ok() { "$py" -c "import transformers, safetensors, sys; sys.exit(transformers.__version__ != '$TRANSFORMERS')" 2>/dev/null; }

if ! [ -x "$py" ]; then
  echo "creating $venv..." >&2
  python3 -m venv "$venv"
fi
if ! torch_ok; then
  echo "installing torch==$TORCH into $venv..." >&2
  # PyPI's Linux torch wheel is the CUDA build: try it without the nvidia-* packages first
  # (as scripts/bench-vs-torch.sh does), then with them.
  "$venv/bin/pip" install -q --no-deps "torch==$TORCH" filelock 'typing-extensions>=4.8' \
    sympy==1.13.1 mpmath networkx jinja2 MarkupSafe fsspec numpy
  torch_ok || "$venv/bin/pip" install -q "torch==$TORCH"
  torch_ok || { echo "error: torch $TORCH does not import in $venv" >&2; exit 1; }
fi
if ! hf_ok; then
  echo "installing transformers==$TRANSFORMERS and safetensors into $venv..." >&2
  "$venv/bin/pip" install -q "transformers==$TRANSFORMERS" safetensors
  hf_ok || { echo "error: transformers $TRANSFORMERS does not import in $venv" >&2; exit 1; }
fi
[ "${1:-}" = "--venv-only" ] && exit 0

"$py" scripts/make_hf_fixtures.py
