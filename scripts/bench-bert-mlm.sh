#!/usr/bin/env bash
# BERT masked-LM learning against transformers' BertForMaskedLM: bert-tiny trained on the
# shipped corpus by `tessera train` and by scripts/bert_mlm_torch.py with the same
# configuration, objective, optimizer and schedule; prints both held-out masked-LM losses and
# the corpus's unigram entropy (BENCHMARKS.md, "One training path"). Not part of `cargo test`:
# it needs the Python venv (.venv-bench with torch + transformers, set up on first use).
#
# usage: scripts/bench-bert-mlm.sh [STEPS] [BATCH] [SEQ] [LR]     (default 2000 16 64 1e-3)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-2000}
batch=${2:-16}
seq=${3:-64}
lr=${4:-1e-3}

scripts/make-hf-fixtures.sh --venv-only
cargo build -q --release --bin tessera
bin=${CARGO_TARGET_DIR:-target}/release/tessera

tessera=$("$bin" train --model bert-tiny --devices 1 --steps "$steps" --batch "$batch" \
  --seq "$seq" --lr "$lr" --eval-batches 16 --format json 2>/dev/null |
  python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.4f %.4f" % (d["eval_loss"], d["unigram_entropy"]))')
torch=$(.venv-bench/bin/python scripts/bert_mlm_torch.py data/shakespeare.txt "$steps" "$batch" "$seq" "$lr")
echo "steps $steps batch $batch seq $seq lr $lr"
echo "held-out masked-LM loss: tessera ${tessera% *}, transformers $torch; unigram entropy ${tessera#* }"
