#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine: builds (or takes) the release binary
# `tessera-gpu-check`, runs every check (kernels against the CPU, loss curves, memory against
# the prediction, calibration, speed) and the PyTorch baseline for the speed figures.
#
#   scripts/gpu-check.sh [OUT_DIR] [checks...]     # on a machine with an NVIDIA GPU
#
# checks: kernels vision generate training memory memory-large calibrate speed nccl cli (all but nccl and cli
# when none is named; `generate` also runs scripts/torch-generate-bench.py, the PyTorch side of its
# decode speed), and speed-llama (the 1.3B LLaMA's step alone, for a profiler's run:
# `ncu ... tessera-gpu-check speed-llama`); TORCH_BASELINE=0 skips the PyTorch runs that go
# with `speed` (on a GPU of over 100 GB, `speed` also runs the LLaMA at batch 8). `cli` runs
# the `tessera` binary's GPU commands (TESSERA_CLI, default target/release/tessera, built with
# `--features cuda`).
#
# The binary is built with `cargo build --release -p tessera-cuda --bin tessera-gpu-check`
# where Rust is present; on a GPU machine without Rust, carry target/release/tessera-gpu-check.
set -uo pipefail
out=${1:-gpu-check-out}; shift || true
mkdir -p "$out"
bin=${TESSERA_GPU_CHECK:-target/release/tessera-gpu-check}
if [ ! -x "$bin" ]; then
  cargo build --release -p tessera-cuda --bin tessera-gpu-check || exit 1
fi
# The driver API, NVRTC and cuBLAS are loaded at run time: find them.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64 \
         $(python3 -c 'import nvidia, os; p = nvidia.__path__[0]; print(" ".join(os.path.join(p, d, "lib") for d in os.listdir(p)))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
# cudarc loads NCCL as libnccl.so; distributions and pip install libnccl.so.2: link it.
nccl=$(ldconfig -p 2>/dev/null | awk '/libnccl.so.2 /{print $NF; exit}')
[ -z "$nccl" ] && nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"))' 2>/dev/null)
if [ -n "$nccl" ] && [ -f "$nccl" ]; then
  mkdir -p "$out/.nccl" && ln -sf "$nccl" "$out/.nccl/libnccl.so" && export LD_LIBRARY_PATH="$(cd "$out/.nccl" && pwd):$LD_LIBRARY_PATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
rc=0
checks=()
for c in "$@"; do [ "$c" != cli ] && checks+=("$c"); done
if [ $# -eq 0 ] || [ ${#checks[@]} -gt 0 ]; then
  "$bin" "${checks[@]}" 2> >(tee "$out/stderr.txt" >&2) | tee "$out/checks.jsonl"
  rc=${PIPESTATUS[0]}
fi
if printf '%s\n' "$@" | grep -qx cli; then
  # The CLI's GPU paths: a short bf16 run, and this GPU measured into a cluster file that the
  # planner then reads.
  cli=${TESSERA_CLI:-target/release/tessera}
  { "$cli" train --device cuda --devices 1 --model gpt2-tiny --dtype bf16 --steps 5 --format json \
      && "$cli" calibrate --device cuda --out "$out/gpu.json" \
      && "$cli" plan --model gpt2 --cluster "$out/gpu.json" --format json; } \
    > "$out/cli.jsonl" 2> "$out/cli-stderr.txt" || { echo '{"check":"cli","ok":false}'; rc=1; }
  tail -c 2000 "$out/cli.jsonl"
  # `tessera generate --device cuda`: transformers' greedy tokens of the GPT-2 and LLaMA
  # fixtures, on one device and on two sharing the GPU.
  python3 - "$cli" >> "$out/cli.jsonl" 2>> "$out/cli-stderr.txt" <<'PY' || rc=1
import json, subprocess, sys
ok_all = True
for name, n in [("gpt2", 1), ("llama", 1), ("gpt2", 2)]:
    fx = f"crates/tessera-cli/tests/fixtures/hf/{name}"
    want = json.load(open(f"{fx}/generate.json"))
    cmd = [sys.argv[1], "generate", "--device", "cuda", "--devices", str(n), "--model-dir", fx,
           "--max-new-tokens", str(want["max_new_tokens"]), "--format", "json"]
    for p in want["prompts"]:
        cmd += ["--tokens", ",".join(map(str, p))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    got = json.loads(r.stdout) if r.returncode == 0 else {}
    ok = got.get("new_tokens") == want["new_tokens"]
    ok_all &= ok
    line = {"check": "cli_generate", "model": name, "devices": n, "tokens_equal": ok,
            "decode_tokens_per_s": got.get("decode_tokens_per_s"), "error": r.stderr[-500:] if r.returncode else None, "ok": ok}
    print(json.dumps(line)); print(json.dumps(line), file=sys.stderr)
sys.exit(0 if ok_all else 1)
PY
fi
if [ "${TORCH_BASELINE:-1}" != 0 ] && { [ $# -eq 0 ] || printf '%s\n' "$@" | grep -qx generate; }; then
  # The PyTorch side of `generate`'s decode_speed: transformers' greedy generate, bf16, batch 1,
  # 128-token prompt, 128 new tokens, the same model configurations.
  python3 scripts/torch-generate-bench.py gpt2-medium llama-1.3b 2>"$out/torch-generate-stderr.txt" | tee -a "$out/checks.jsonl"
fi
if [ "${TORCH_BASELINE:-1}" != 0 ] && { [ $# -eq 0 ] || printf '%s\n' "$@" | grep -qx speed; }; then
  python3 scripts/torch-train-bench.py gpt2-medium 4 1024 --compile --no-fp32 2>"$out/torch-stderr.txt" | tee -a "$out/checks.jsonl"
  python3 scripts/torch-train-bench.py llama-1.3b 4 2048 --compile --no-fp32 2>>"$out/torch-stderr.txt" | tee -a "$out/checks.jsonl"
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mib:-0}" -gt 100000 ]; then
    python3 scripts/torch-train-bench.py llama-1.3b 8 2048 --compile --no-fp32 2>>"$out/torch-stderr.txt" | tee -a "$out/checks.jsonl"
  fi
fi
exit "$rc"
