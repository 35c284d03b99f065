#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine, as ordered stages; every figure of BENCHMARKS.md's
# "CUDA backend" section comes from one of them.
#
#   scripts/gpu-check.sh [OUT_DIR] [stages...]     # on a machine with an NVIDIA GPU
#
# Stages run in the order given (default: every stage but nccl, compile and speed-llama), each
# appending its JSON lines to OUT_DIR/checks.jsonl; a failing stage does not stop the others and
# makes the exit code 1.
#   kernels vision moe ring qlora generate tp host flash-bench training memory memory-large calibrate
#   speed
#   speed-llama nccl
#            the check binary's own checks (crates/tessera-cuda/src/bin/tessera-gpu-check/):
#            every op's kernel against the CPU's, the new ops' too; loss curves; memory against
#            the prediction; the GEMM/bandwidth calibration; speed (GPT-2-medium and the 1.3B
#            LLaMA, batches 4 and 8 where the GPU holds them); the matmuls' host cost per path
#            (host) and both flash backwards against each other (flash-bench); NCCL at world
#            size 1
#   shared   several devices sharing the GPU against one device, per plan (gpu_shared_check.py)
#   qlora-cli  `tessera train --quantize-base int4|int8 --lora` (the LoRA fixture's tiny LLaMA,
#            fp32, 5 steps) on the GPU against the CPU: losses within 1e-4, allocator peak ==
#            predicted (gpu_qlora_check.py); the `qlora` stage checks the op's kernel alone
#   unet     the ONNX UNet and ResNet train on the GPU at their predicted memory (`tessera train`)
#   cost     `tessera calibrate --device cuda` (the kernels timed on training steps), then the
#            planner's step against every `speed` row of this run (gpu_cost_check.py); run after
#            `speed`
#   cli      the `tessera` binary's GPU commands: a short bf16 run planned for this GPU, and
#            `tessera generate --device cuda` against transformers' tokens (gpu_generate_check.py)
#   torch    PyTorch eager for the `speed` rows;   compile: torch.compile (slow to compile);
#            TORCH_ROWS="MODEL BATCH SEQ;..." picks the rows
#   decode   transformers' greedy decode speed, beside the `generate` check's decode_speed rows
#   bf16     bf16 against fp32 over 8 seeds, Tessera and PyTorch autocast from the same start
#            (scripts/bf16-seeds.sh)
#
# Binaries: TESSERA_GPU_CHECK (default target/release/tessera-gpu-check), TESSERA_CLI (default
# target/release/tessera, built with `--features cuda`), BF16_SPREAD (the bf16_spread example),
# built with cargo where Rust is present; on a GPU machine without Rust, carry them.
#
# TESSERA_FLASH_BWD=2 runs the second flash backward (flash_bwd2_*), TESSERA_GEMM=legacy the
# per-call cublasGemmStridedBatchedEx instead of cuBLASLt's kept plans: run the checks with and
# without them to check and time both (`host` and `flash-bench` A/B them within one run).
set -uo pipefail
out=${1:-gpu-check-out}; shift || true
mkdir -p "$out"
out=$(cd "$out" && pwd)
bin=${TESSERA_GPU_CHECK:-target/release/tessera-gpu-check}
export TESSERA_CLI=${TESSERA_CLI:-target/release/tessera}
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
  mkdir -p "$out/.nccl" && ln -sf "$nccl" "$out/.nccl/libnccl.so" && export LD_LIBRARY_PATH="$out/.nccl:$LD_LIBRARY_PATH"
fi
# Kernels compiled but not yet run on a GPU are refused unless this is set (the CUDA backend's
# `tessera_cuda::unverified` list): these stages are what checks them.
export TESSERA_CUDA_UNVERIFIED=1
# Compiled kernels are kept between the stages' processes.
export TESSERA_KERNEL_CACHE=${TESSERA_KERNEL_CACHE:-$out/.kernels}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(kernels vision moe ring qlora generate tp training memory memory-large \
  speed cost shared qlora-cli unet cli torch decode bf16)
rc=0
log() { tee -a "$out/checks.jsonl"; }
fail() { echo "{\"check\":\"stage\",\"stage\":\"$1\",\"ok\":false}" | log; rc=1; }
big_gpu() { [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; }
for s in "${stages[@]}"; do
  t0=$SECONDS
  case "$s" in
    kernels|vision|moe|ring|qlora|generate|tp|host|flash-bench|training|memory|memory-large|calibrate|speed|speed-llama|nccl)
      "$bin" "$s" 2>>"$out/stderr.txt" | log; [ "${PIPESTATUS[0]}" -eq 0 ] || fail "$s" ;;
    qlora-cli)
      python3 scripts/gpu_qlora_check.py "$out/qlora" 2>>"$out/stderr.txt" | log
      [ "${PIPESTATUS[0]}" -eq 0 ] || fail qlora-cli ;;
    shared)
      python3 scripts/gpu_shared_check.py "$out/shared" 2>>"$out/stderr.txt" | log
      [ "${PIPESTATUS[0]}" -eq 0 ] || fail shared ;;
    unet)
      for m in unet resnet; do
        "$TESSERA_CLI" train --device cuda --model "crates/tessera-cli/tests/fixtures/onnx/$m/model.onnx" \
          --data data/digits.csv --steps 20 --batch 16 --lr 3e-3 --format json \
          > "$out/$m.json" 2>>"$out/stderr.txt" || fail "$m"
        python3 scripts/gpu_train_row.py train_onnx "$m" "$out/$m.json" | log
        [ "${PIPESTATUS[0]}" -eq 0 ] || fail "$m"
      done ;;
    cost)
      "$TESSERA_CLI" calibrate --device cuda --out "$out/gpu.json" --format json > "$out/calibrate.json" \
        2>>"$out/stderr.txt" || fail calibrate-cli
      python3 scripts/gpu_cost_check.py "$out/checks.jsonl" "$out/gpu.json" 2>>"$out/stderr.txt" | log
      [ "${PIPESTATUS[0]}" -eq 0 ] || fail cost ;;
    cli)
      # A short bf16 run planned for this GPU (its preset and free memory), and the plan itself.
      "$TESSERA_CLI" train --device cuda --model gpt2-tiny --dtype bf16 --steps 5 --format json \
        > "$out/cli-train.json" 2>>"$out/stderr.txt" || fail cli
      python3 scripts/gpu_train_row.py cli gpt2-tiny "$out/cli-train.json" | log
      [ "${PIPESTATUS[0]}" -eq 0 ] || fail cli
      # `tessera generate --device cuda` against transformers' greedy tokens.
      python3 scripts/gpu_generate_check.py 2>>"$out/stderr.txt" | log
      [ "${PIPESTATUS[0]}" -eq 0 ] || fail cli-generate ;;
    torch|compile)
      flag=$([ "$s" = compile ] && echo --compile)
      rows=("gpt2-medium 4 1024" "llama-1.3b 4 2048")
      big_gpu && rows+=("gpt2-medium 8 1024" "llama-1.3b 8 2048")
      # TORCH_ROWS="llama-1.3b 4 2048;gpt2-medium 4 1024" runs those rows alone.
      [ -n "${TORCH_ROWS:-}" ] && IFS=';' read -r -a rows <<< "$TORCH_ROWS"
      for r in "${rows[@]}"; do
        # shellcheck disable=SC2086
        python3 scripts/torch-train-bench.py $r $flag --no-fp32 2>>"$out/torch-stderr.txt" | log
      done ;;
    decode)
      # The PyTorch side of the `generate` check's decode_speed rows: transformers' greedy
      # generate, bf16, batch 1, a 128-token prompt, 128 new tokens, the same configurations.
      python3 scripts/torch-generate-bench.py gpt2-medium llama-1.3b 2>>"$out/stderr.txt" | log
      [ "${PIPESTATUS[0]}" -eq 0 ] || fail decode ;;
    bf16)
      scripts/bf16-seeds.sh "$out/bf16" cuda 2>>"$out/stderr.txt" | log; [ "${PIPESTATUS[0]}" -eq 0 ] || fail bf16 ;;
    *) echo "unknown stage $s" >&2; fail "$s" ;;
  esac
  echo "[$s: $((SECONDS - t0)) s]" >&2
done
exit "$rc"
