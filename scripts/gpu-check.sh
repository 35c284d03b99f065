#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine: builds (or takes) the release binary
# `tessera-gpu-check`, runs every check (kernels against the CPU, loss curves, memory against
# the prediction, calibration, speed) and the PyTorch baseline for the speed figures.
#
#   scripts/gpu-check.sh [OUT_DIR] [checks...]     # on a machine with an NVIDIA GPU
#
# checks: kernels training memory calibrate speed (all when none is named); TORCH_BASELINE=0
# skips the PyTorch runs that go with `speed`.
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
"$bin" "$@" 2> >(tee "$out/stderr.txt" >&2) | tee "$out/checks.jsonl"
rc=${PIPESTATUS[0]}
if [ "${TORCH_BASELINE:-1}" != 0 ] && { [ $# -eq 0 ] || printf '%s\n' "$@" | grep -qx speed; }; then
  python3 scripts/torch-train-bench.py gpt2-medium 4 1024 --compile 2>"$out/torch-stderr.txt" | tee -a "$out/checks.jsonl"
fi
exit "$rc"
