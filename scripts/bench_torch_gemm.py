#!/usr/bin/env python3
"""PyTorch CPU GEMM speed on the shapes of `cargo bench -p tessera-runtime --bench kernels --
"matmul bf16"` and of gpt2-tiny's step (`--bench step_matmuls` with STEP_BENCH="gpt2-tiny 16
128"), in fp32 (MKL/oneDNN sgemm) and bf16 (oneDNN, on AMX or AVX512_BF16 where the CPU has
them): the peer figure beside Tessera's GEMM micro-benchmark in BENCHMARKS.md.

Each shape is `m k n layout`: `nn` = [m,k] @ [k,n]; `nt` = [m,k] @ [n,k]ᵀ; `tn` = [k,m]ᵀ @ [k,n]
(a weight gradient). GFLOP/s = 2·m·n·k over the mean of `--reps` calls after 3 warm-up calls.

usage: .venv-bench/bin/python scripts/bench_torch_gemm.py [--threads 2] [--reps 20]
"""
import argparse
import time

import torch

SHAPES = [
    (1024, 768, 3072, "nn"),
    (1024, 768, 3072, "nt"),
    (2048, 256, 256, "nn"),
    (256, 2048, 256, "tn"),
    (2048, 256, 768, "nn"),
    (2048, 256, 1024, "nn"),
    (2048, 1024, 256, "nt"),
    (256, 2048, 1024, "tn"),
]


def operand(rows, cols, transposed, dtype):
    """A [rows, cols] operand, stored as its transpose when `transposed`."""
    if transposed:
        return torch.randn(cols, rows, dtype=dtype).t()
    return torch.randn(rows, cols, dtype=dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    print("| shape | layout | fp32 GFLOP/s | bf16 GFLOP/s |")
    print("|---|---|---:|---:|")
    for m, k, n, layout in SHAPES:
        row = []
        for dtype in (torch.float32, torch.bfloat16):
            a = operand(m, k, layout[0] == "t", dtype)
            b = operand(k, n, layout[1] == "t", dtype)
            for _ in range(3):
                a @ b
            t0 = time.perf_counter()
            for _ in range(args.reps):
                a @ b
            dt = (time.perf_counter() - t0) / args.reps
            row.append(2 * m * n * k / dt / 1e9)
        print(f"| {m}×{k}×{n} | {layout} | {row[0]:.0f} | {row[1]:.0f} |")


if __name__ == "__main__":
    main()
