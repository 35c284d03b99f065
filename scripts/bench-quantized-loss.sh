#!/usr/bin/env bash
# Held-out loss of gpt2-tiny with fp32, int8 and int4 weights (BENCHMARKS.md, "What
# quantisation costs in quality"): trains 400 steps on the shipped corpus (4 simulated devices,
# the default plan), then scores twelve 256-byte windows of the held-out split (the last 10%)
# with `tessera eval [--quantize ...]` and prints each weight format's mean loss.
#
# usage: scripts/bench-quantized-loss.sh      env: TESSERA=path/to/tessera (default target/release/tessera)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TESSERA:-target/release/tessera}
[ -x "$bin" ] || cargo build --release --bin tessera
out=target/bench-quantized-loss
rm -rf "$out" && mkdir -p "$out"
"$bin" train --steps 400 --save "$out/model" --data data/shakespeare.txt >"$out/train.log" 2>&1
python3 - "$bin" "$out/model" <<'PY'
import json, statistics, subprocess, sys
tessera, model = sys.argv[1], sys.argv[2]
data = open("data/shakespeare.txt", "rb").read()
losses = {"fp32": [], "int8": [], "int4": []}
for k in range(12):
    at = int(len(data) * 0.905) + 7000 * k
    ids = ",".join(str(b) for b in data[at:at + 257])
    for q in losses:
        args = [tessera, "eval", "--model-dir", model, "--tokens", ids, "--format", "json"]
        if q != "fp32":
            args += ["--quantize", q]
        losses[q].append(json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)["loss"])
base = statistics.mean(losses["fp32"])
print("| weights | mean loss (nats/byte) | vs fp32 |\n|---|---:|---:|")
for q, v in losses.items():
    m = statistics.mean(v)
    print(f"| {q} | {m:.5f} | {100 * (m - base) / base:+.3f}% |")
PY
