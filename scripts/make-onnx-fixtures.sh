#!/usr/bin/env bash
# Regenerates the ONNX importer fixtures (crates/tessera-cli/tests/fixtures/onnx/): tiny GPT-2,
# LLaMA and OPT causal LMs (plus a small ResNet and UNet) exported with torch.onnx.export
# (TorchScript exporter, opset 17), and PyTorch's fp32 logits, loss and parameter gradients on
# them; plus `unsupported/`, a model using the ONNX `Det` operator.
# Deterministic: a re-run rewrites identical bytes (compare with the fixtures' SHA256SUMS).
#
# usage: scripts/make-onnx-fixtures.sh              set up .venv-bench if needed, then generate
#        scripts/make-onnx-fixtures.sh --no-ort     generate without the onnxruntime comparison
#        scripts/make-onnx-fixtures.sh --venv-only  only set up the venv
#
# The venv is .venv-bench (set up by scripts/make-hf-fixtures.sh --venv-only: torch 2.5.1,
# transformers 4.46.3, safetensors), plus onnx (to check the exported models and list their
# initializers and operators) and onnxruntime (to check the exports against PyTorch's logits,
# including at another batch and sequence length: the dynamic axes).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/make-hf-fixtures.sh --venv-only

venv=.venv-bench
py=$venv/bin/python
ONNX=1.17.0
ONNXRUNTIME=1.20.1

onnx_ok() {
  "$py" -c "import onnx, onnxruntime, sys; sys.exit(onnx.__version__ != '$ONNX' or onnxruntime.__version__ != '$ONNXRUNTIME')" 2>/dev/null
}

if ! onnx_ok; then
  echo "installing onnx==$ONNX and onnxruntime==$ONNXRUNTIME into $venv..." >&2
  "$venv/bin/pip" install -q "onnx==$ONNX" "onnxruntime==$ONNXRUNTIME"
  onnx_ok || { echo "error: onnx $ONNX / onnxruntime $ONNXRUNTIME do not import in $venv" >&2; exit 1; }
fi
[ "${1:-}" = "--venv-only" ] && exit 0

"$py" scripts/make_onnx_fixtures.py "$@"
