#!/usr/bin/env bash
# Manual check of the Tessera → Hugging Face direction (the reverse of tests/hf_parity.rs):
# for each model, `tessera train --devices D --steps 3 --save CKPT` (D=1: an HF directory
# itself; D>1: a sharded checkpoint, gathered by `tessera export --checkpoint CKPT --hf DIR`),
# then `transformers`' AutoModelForCausalLM.from_pretrained(DIR) must load every tensor and
# compute the same logits as `tessera eval --logits` on DIR (max abs diff < 1e-4, loss rel diff < 1e-5). Prints
# PASS/FAIL per model and exits non-zero if any failed. Not part of `cargo test`: it needs the
# Python venv (.venv-bench with torch 2.5.1 + transformers 4.46.3, set up on first use).
#
# usage: scripts/check-hf-roundtrip.sh
# env:   HF_ROUNDTRIP_MODELS="gpt2-tiny llama-tiny fixture:qwen2 ..."  to override the list;
#        "fixture:NAME" trains crates/tessera-cli/tests/fixtures/hf/NAME/config.json with its
#        vocabulary widened to 256 (the default corpus is byte-level); anything else is passed
#        to --model as is (a preset or a config path).
#        HF_ROUNDTRIP_LR=0.03  the training learning rate (constant, no warmup);
#        HF_ROUNDTRIP_DEVICES=1  simulated devices of the training run (default 1; with more,
#        models with dropout are refused, so use presets such as gpt2-tiny / llama-tiny);
#        KEEP=1 keeps the work directory (printed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."

models=${HF_ROUNDTRIP_MODELS:-"gpt2-tiny llama-tiny fixture:gpt2 fixture:llama fixture:qwen2 fixture:mistral fixture:mistral-window"}
py=.venv-bench/bin/python
fixtures=crates/tessera-cli/tests/fixtures/hf
# A large learning rate so that 3 AdamW steps move the weights well away from their small
# init (std 0.02): otherwise attention is near-uniform and the check proves little.
lr=${HF_ROUNDTRIP_LR:-0.03}

scripts/make-hf-fixtures.sh --venv-only
cargo build -q --bin tessera
bin=${CARGO_TARGET_DIR:-target}/debug/tessera

work=$(mktemp -d "${TMPDIR:-/tmp}/tessera-hf-roundtrip.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then
  trap 'echo "work directory kept: $work" >&2' EXIT
else
  trap 'rm -rf "$work"' EXIT
fi

dirs=()
failed=0
for m in $models; do
  name=${m#fixture:}
  spec=$m
  if [ "$name" != "$m" ]; then
    mkdir -p "$work/configs/$name"
    "$py" - "$fixtures/$name/config.json" "$work/configs/$name/config.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["vocab_size"] = 256  # the default training corpus is byte-level
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
PY
    spec=$work/configs/$name/config.json
  fi
  out=$work/saved/$name
  devices=${HF_ROUNDTRIP_DEVICES:-1}
  echo "== tessera train --model $m --devices $devices --steps 3 --save $out" >&2
  if "$bin" train --model "$spec" --devices "$devices" --steps 3 --batch 4 --seq 32 \
       --eval-batches 1 --lr "$lr" --warmup 0 --schedule constant \
       --save "$out" --format json > "$work/train-$name.json" 2> "$work/train-$name.err"; then
    if [ "$devices" -gt 1 ]; then
      "$bin" export --checkpoint "$out" --hf "$out-hf" 2>> "$work/train-$name.err"
      out=$out-hf
    fi
    dirs+=("$out")
  else
    echo "FAIL $name: tessera train failed: $(tail -n 5 "$work/train-$name.err")"
    failed=1
  fi
done

if [ ${#dirs[@]} -gt 0 ]; then
  "$py" scripts/hf_roundtrip.py "$bin" "${dirs[@]}" || failed=1
fi
if [ "$failed" = 0 ]; then echo "PASS: every round trip matched"; else echo "FAIL"; fi
exit "$failed"
