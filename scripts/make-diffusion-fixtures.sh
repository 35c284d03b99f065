#!/usr/bin/env bash
# Regenerates the diffusers UNet fixtures (crates/tessera-cli/tests/fixtures/diffusers_unet/)
# that crates/tessera-cli/tests/diffusers_unet.rs checks Tessera's UNet2DConditionModel
# against: the SD 1.5 / SD 2 UNet configs with diffusers' parameter counts, and two tiny
# UNets saved by `save_pretrained` with their inputs, prediction, MSE loss and gradients.
# Deterministic: a re-run rewrites identical bytes. versions.json records the libraries.
#
# usage: scripts/make-diffusion-fixtures.sh [PYTHON]
#   PYTHON: an interpreter with torch (2.15.0 used), diffusers (0.42.1) and safetensors;
#   default .venv-moe/bin/python (the shared reference venv).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv-moe/bin/python}
"$py" scripts/make_diffusion_fixtures.py crates/tessera-cli/tests/fixtures/diffusers_unet
