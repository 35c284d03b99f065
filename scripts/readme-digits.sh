#!/usr/bin/env bash
# Draws README's picture docs/dit-digits.png: dit-tiny trained on the shipped digits with the
# README's recipe, then 8 samples per class (DDIM, 25 steps, guidance 3), one row per class.
# Usage: scripts/readme-digits.sh [path/to/tessera]   (default: target/release/tessera)
set -euo pipefail
cd "$(dirname "$0")/.."
TESSERA=${1:-target/release/tessera}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$TESSERA" train --model dit-tiny --data data/digits.csv --steps 1500 --batch 64 --lr 2e-3 \
    --devices 1 --plan dp1 --eval-batches 0 --save "$work/dit-ck"
mkdir -p docs
"$TESSERA" sample --model-dir "$work/dit-ck" --per-class 8 --steps 25 --guidance-scale 3 \
    --out docs/dit-digits.png
echo "wrote docs/dit-digits.png"
