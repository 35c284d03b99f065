#!/usr/bin/env python3
"""Checks that a checkpoint directory written by Tessera loads in `transformers` and computes
what `tessera eval` computes on it.

usage: hf_roundtrip.py TESSERA_BIN DIR [DIR...]

For each DIR (config.json + model.safetensors, e.g. from `tessera train --save DIR`):
  1. AutoModelForCausalLM.from_pretrained(DIR) in fp32 with eager attention; any missing,
     unexpected or mismatched tensor is a failure (transformers would otherwise silently
     initialise it at random);
  2. runs `TESSERA_BIN eval --model-dir DIR --tokens <16 fixed ids> --format json --logits F`;
  3. compares the per-position logits (max abs diff < 1e-4) and the loss (rel diff < 1e-5).
Prints one PASS/FAIL line per directory and exits non-zero if any failed.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM

LOGITS_ABS_TOL = 1e-4
LOSS_REL_TOL = 1e-5
N_TOKENS = 16


def token_ids(vocab):
    """16 fixed ids spread over the vocabulary (with a repeat), all < vocab."""
    ids = [(7 + 37 * i) % vocab for i in range(N_TOKENS - 1)]
    return ids + [ids[2]]


def check(bin_path, d):
    name = os.path.basename(os.path.normpath(d))
    config = AutoConfig.from_pretrained(d)
    ids = token_ids(config.vocab_size)

    model, info = AutoModelForCausalLM.from_pretrained(
        d, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    model.eval()
    bad = {k: v for k, v in info.items() if v}
    if bad:
        return False, f"{name}: transformers did not load every tensor cleanly: {bad}"
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids[:-1]])).logits[0].double()
    ref_loss = torch.nn.functional.cross_entropy(ref, torch.tensor(ids[1:])).item()

    with tempfile.TemporaryDirectory() as tmp:
        logits_path = os.path.join(tmp, "logits.json")
        cmd = [bin_path, "eval", "--model-dir", d, "--tokens", ",".join(map(str, ids)),
               "--format", "json", "--logits", logits_path]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            return False, f"{name}: tessera eval failed: {run.stderr.strip()}"
        loss = json.loads(run.stdout)["loss"]
        with open(logits_path) as f:
            doc = json.load(f)
    got = torch.tensor(doc["logits"], dtype=torch.float64)
    if list(got.shape) != list(ref.shape):
        return False, f"{name}: logits shape {list(got.shape)} != transformers' {list(ref.shape)}"
    err = (got - ref).abs()
    max_err = err.max().item()
    pos, v = divmod(int(err.argmax()), ref.shape[1])
    rel = abs(loss - ref_loss) / abs(ref_loss)
    ok = max_err < LOGITS_ABS_TOL and rel < LOSS_REL_TOL
    line = (f"{name}: {config.model_type}, max |logit diff| {max_err:.2e} at [{pos}, {v}], "
            f"loss {loss:.7f} vs transformers {ref_loss:.7f} (rel {rel:.1e}); "
            f"logit std {ref.std().item():.3f}")
    return ok, line


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    bin_path, dirs = sys.argv[1], sys.argv[2:]
    failed = 0
    for d in dirs:
        try:
            ok, line = check(bin_path, d)
        except Exception as e:  # a load failure is a FAIL for this directory, not a crash
            ok, line = False, f"{os.path.basename(os.path.normpath(d))}: {type(e).__name__}: {e}"
        print(f"{'PASS' if ok else 'FAIL'} {line}", flush=True)
        failed += not ok
    print(f"{len(dirs) - failed}/{len(dirs)} round trips within {LOGITS_ABS_TOL:g} abs "
          f"(logits) / {LOSS_REL_TOL:g} rel (loss)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
