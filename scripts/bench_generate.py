#!/usr/bin/env python3
"""Decode throughput of `tessera generate` against Hugging Face `transformers`' generate.

One run on this machine, same weights and prompts for both engines:

- weights: `GPT2LMHeadModel(GPT2Config())` (the 124M `gpt2` preset) with torch seed 0,
  written with `save_pretrained` into `<out>/gpt2-seed0` (reused when present);
- prompts: 8 rows of 32 token ids from `random.Random(0)`; batch 1 takes the first;
- greedy, 64 new tokens per row, fp32, end-of-text ignored (`--eos -1`; transformers with
  `eos_token_id` None), so every row generates all 64;
- transformers: `model.generate(use_cache=True)`, eager attention,
  `torch.set_num_threads(os.cpu_count())`, one untimed warm-up generate per batch. Time to
  first token = start of `generate` to the first logits (a `LogitsProcessor` clock); decode
  = the rest (63 decode steps), decode tokens/s = 63 · batch / that, as Tessera counts it;
- tessera: `tessera generate --tokens .. --max-new-tokens 64 --eos -1 --format json
  [--quantize int8|int4]`, its `time_to_first_token_s` and `decode_tokens_per_s` (all rows).

Each case runs `--repeats` times (median reported). Before each case the script waits (up to
`--wait` s) for the rest of the machine to be quiet, and records how busy the rest of the
machine was during it (CPU time of other processes over wall time × cores).

Prints a Markdown table and writes the raw results to `<out>/results.json`.

usage: bench_generate.py --tessera target/release/tessera [--out target/bench-generate]
"""

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

VOCAB = 50257


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def busy_s():
    """CPU seconds the whole machine has spent busy (all cores)."""
    v = [int(x) for x in open("/proc/stat").readline().split()[1:8]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s():
    """CPU seconds of this process and its finished children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class Busy:
    """Share (%) of the machine's CPU the rest of the machine used during the block."""

    def __enter__(self):
        self.b0, self.o0, self.t0 = busy_s(), own_cpu_s(), time.time()
        return self

    def __exit__(self, *exc):
        wall = max(1e-9, time.time() - self.t0)
        other = max(0.0, (busy_s() - self.b0) - (own_cpu_s() - self.o0))
        self.pct = 100 * other / (wall * os.cpu_count())


def wait_quiet(limit, budget):
    """Waits until the machine is at most `limit` % busy over 5 s, or `budget` s passed."""
    end = time.time() + budget
    while True:
        def snap():
            v = [int(x) for x in open("/proc/stat").readline().split()[1:8]]
            return sum(v), v[3] + v[4]

        t0, i0 = snap()
        time.sleep(5)
        t1, i1 = snap()
        b = 100 * (1 - (i1 - i0) / max(1, t1 - t0))
        if b <= limit or time.time() > end:
            return b


def make_model(path):
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(
        os.path.join(path, "model.safetensors")
    ):
        return
    log(f"writing GPT2LMHeadModel(GPT2Config()) with seed 0 to {path}")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    tmp = path + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)


class Clock(LogitsProcessor):
    """Records when each step's logits are ready (before the greedy pick)."""

    def __init__(self):
        self.t = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


def hf_generate(model, prompts, new):
    ids = torch.tensor(prompts, dtype=torch.long)
    clock = Clock()
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        logits_processor=LogitsProcessorList([clock]),
    )
    t_end = time.perf_counter()
    tokens = out[:, ids.shape[1] :].tolist()
    assert all(len(t) == new for t in tokens), "transformers stopped early"
    ttft = clock.t[0] - t0
    decode_s = t_end - clock.t[0]
    return {
        "ttft_s": ttft,
        "decode_tokens_per_s": (new - 1) * len(prompts) / decode_s,
        "tokens": tokens,
    }


def tessera_generate(binary, model_dir, prompts, new, quant):
    cmd = [binary, "generate", "--model-dir", model_dir, "--max-new-tokens", str(new)]
    cmd += ["--eos", "-1", "--format", "json"]
    for p in prompts:
        cmd += ["--tokens", ",".join(map(str, p))]
    if quant:
        cmd += ["--quantize", quant]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:4])} ... failed:\n{r.stderr}")
    doc = json.loads(r.stdout)
    tokens = doc["new_tokens"] if len(prompts) > 1 else [doc["new_tokens"]]
    assert all(len(t) == new for t in tokens), "tessera stopped early"
    return {
        "ttft_s": doc["time_to_first_token_s"],
        "decode_tokens_per_s": doc["decode_tokens_per_s"],
        "tokens": tokens,
    }


def median_run(fn, repeats):
    runs = [fn() for _ in range(repeats)]
    return {
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
        "tokens": runs[0]["tokens"],
    }


def machine():
    cpu = next(
        (l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
        "?",
    )
    flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"
    mem = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
    return f"{cpu} ({isa}), {os.cpu_count()} cores, {mem // 2**20} GiB RAM, {platform.platform()}"


def git_rev():
    sh = lambda *a: subprocess.run(a, capture_output=True, text=True).stdout.strip()
    rev = sh("git", "rev-parse", "--short", "HEAD")
    dirty = sh("git", "status", "--porcelain", "--untracked-files=no")
    return rev + (" (dirty tree)" if dirty else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tessera", default="target/release/tessera")
    ap.add_argument("--out", default="target/bench-generate")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quant", default="int8,int4", help="tessera --quantize cases ('' none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-busy", type=float, default=25.0)
    ap.add_argument("--wait", type=float, default=120.0)
    a = ap.parse_args()

    os.makedirs(a.out, exist_ok=True)
    model_dir = os.path.join(a.out, "gpt2-seed0")
    make_model(model_dir)
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    batches = [int(b) for b in a.batches.split(",")]
    quants = [q for q in a.quant.split(",") if q]
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(a.prompt_len)] for _ in range(max(batches))]

    model = GPT2LMHeadModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    # Generate exactly --new-tokens per row, as `tessera generate --eos -1` does.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None

    started = time.strftime("%Y-%m-%d %H:%M %Z")
    rows = []  # (engine, batch, dtype, result, busy %)
    for b in batches:
        ps = prompts[:b]
        before = wait_quiet(a.max_busy, a.wait)
        log(f"batch {b}: machine {before:.0f}% busy before the case")
        with torch.inference_mode():
            hf_generate(model, ps, 4)  # warm-up
        with Busy() as busy, torch.inference_mode():
            hf = median_run(lambda: hf_generate(model, ps, a.new_tokens), a.repeats)
        log(f"  transformers: {hf['decode_tokens_per_s']:.1f} tok/s (busy {busy.pct:.0f}%)")
        rows.append(("transformers", b, "fp32", hf, busy.pct))
        for quant in [None] + quants:
            with Busy() as busy:
                r = median_run(
                    lambda: tessera_generate(a.tessera, model_dir, ps, a.new_tokens, quant),
                    a.repeats,
                )
            log(f"  tessera {quant or 'fp32'}: {r['decode_tokens_per_s']:.1f} tok/s "
                f"(busy {busy.pct:.0f}%)")
            rows.append(("tessera", b, quant or "fp32", r, busy.pct))

    # Greedy agreement (fp32): tessera's tokens against transformers', per batch.
    agree = {}
    for b in batches:
        hf = next(r for e, bb, d, r, _ in rows if e == "transformers" and bb == b)
        ts = next(r for e, bb, d, r, _ in rows if e == "tessera" and bb == b and d == "fp32")
        same = [h == t for h, t in zip(hf["tokens"], ts["tokens"])]
        first = [
            next((i for i, (x, y) in enumerate(zip(h, t)) if x != y), None)
            for h, t in zip(hf["tokens"], ts["tokens"])
        ]
        agree[b] = (sum(same), len(same), first)

    print(f"### `tessera generate` vs transformers `generate`: gpt2 (124M), decode")
    print()
    print(f"- Machine: {machine()}")
    print(f"- Date: {started}; Tessera {git_rev()}; torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), transformers {transformers.__version__}, "
          f"{threads} threads each")
    print(f"- Prompt {a.prompt_len} tokens, {a.new_tokens} new tokens per row, greedy, fp32 "
          f"activations; median of {a.repeats} runs; decode tokens/s counts every row")
    for b, (n_same, n, first) in agree.items():
        word = "equal" if n_same == n else "DIFFER"
        where = "" if n_same == n else f" (first differing step per row: {first})"
        print(f"- Greedy tokens, tessera fp32 vs transformers, batch {b}: {word} in "
              f"{n_same}/{n} rows{where}")
    print()
    print("| engine | batch | dtype / quant | TTFT s | decode tok/s | vs transformers "
          "| vs tessera fp32 | rest of machine busy |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for engine, b, dtype, r, busy in rows:
        hf = next(x for e, bb, d, x, _ in rows if e == "transformers" and bb == b)
        fp = next((x for e, bb, d, x, _ in rows if e == "tessera" and bb == b and d == "fp32"), None)
        vs_fp = (f"{r['decode_tokens_per_s'] / fp['decode_tokens_per_s']:.2f}×"
                 if engine == "tessera" and fp else "")
        print(f"| {engine} | {b} | {dtype} | {r['ttft_s']:.3f} | {r['decode_tokens_per_s']:.1f} "
              f"| {r['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.2f}× | {vs_fp} "
              f"| {busy:.0f}% |")
    noisy = [f"{e} b{b} {d}" for e, b, d, _, busy in rows if busy > a.max_busy]
    if noisy:
        print()
        print(f"**Warning: other work used > {a.max_busy:.0f}% of the CPU during "
              f"{', '.join(noisy)}: those figures are not representative.**")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(
            {
                "date": started,
                "machine": machine(),
                "rows": [
                    {"engine": e, "batch": b, "dtype": d, "busy_pct": busy,
                     **{k: v for k, v in r.items()}}
                    for e, b, d, r, busy in rows
                ],
                "greedy_agree": {str(b): list(v) for b, v in agree.items()},
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
