#!/usr/bin/env python3
"""Offload capacity and speed from the planner (issue 19): the largest GPT-2- and LLaMA-shaped
models `tessera plan` fits for full training (AdamW, bf16) on one GPU, without offload, with host
memory and with host memory + NVMe; the predicted step of a 10B model on one V100 with offload
(ZeRO-Offload's published setting). Prints markdown tables. Planner only: nothing runs on a GPU.

usage: scripts/bench_offload.py [path/to/tessera]
"""
import json
import os
import subprocess
import sys
import tempfile

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/tessera"
TMP = tempfile.mkdtemp(prefix="tessera-offload-bench-")

# Shapes at fixed width; depth is what grows (GPT-2: h 2560 = GPT-2 2.7B's width; LLaMA: h 4096
# = llama2-7b's). Batch 1 × seq 1024, the setting of Gemini's and ZeRO-Offload's capacity runs.
SHAPES = {
    "gpt2": lambda layers: {"model_type": "gpt2", "n_embd": 2560, "n_layer": layers,
                            "n_head": 32, "n_positions": 1024, "vocab_size": 50257},
    "llama": lambda layers: {"model_type": "llama", "hidden_size": 4096,
                             "intermediate_size": 11008, "num_hidden_layers": layers,
                             "num_attention_heads": 32, "num_key_value_heads": 32,
                             "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                             "vocab_size": 32000},
}


def config(shape, layers):
    path = os.path.join(TMP, f"{shape}-{layers}.json")
    with open(path, "w") as f:
        json.dump(SHAPES[shape](layers), f)
    return path


def plan(model, cluster, extra, batch=1, seq=1024):
    cmd = [BIN, "plan", "--model", model, "--cluster", cluster, "--batch", str(batch),
           "--seq", str(seq), "--format", "json"] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)


def params(shape, layers):
    d = 2560 if shape == "gpt2" else 4096
    if shape == "gpt2":
        return layers * 12 * d * d + 50257 * d + 1024 * d
    return layers * (4 * d * d + 3 * d * 11008) + 2 * 32000 * d


def largest(shape, cluster, extra):
    """The deepest model that plans (bisection over layers), with its plan."""
    lo, hi, best = 0, 1024, None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = plan(config(shape, mid), cluster, extra)
        if p is None:
            hi = mid
        else:
            lo, best = mid, p
    return lo, best


def capacity():
    none = ["--host-memory", "0", "--nvme-size", "0"]
    host64 = ["--host-memory", "64GiB", "--nvme-size", "0"]
    nvme = ["--host-memory", "64GiB", "--nvme-size", "1TB"]
    settings = [
        ("1xRTX3080", [("device only", none), ("+ 64 GiB host", host64),
                       ("+ 64 GiB host + 1 TB NVMe", nvme)]),
        ("1xRTX4090", [("device only", none), ("+ 64 GiB host + 1 TB NVMe", nvme)]),
        ("1xH200", [("device only", none),
                    ("+ 1.5 TiB host", ["--host-memory", "1536GiB", "--nvme-size", "0"])]),
    ]
    print("| shape | GPU | tiers | largest model | params | plan | step (s) | host peak | NVMe peak | × device only |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        for cluster, tiers in settings:
            base = None
            for what, extra in tiers:
                layers, p = largest(shape, cluster, extra)
                n = params(shape, layers)
                base = base or n
                if p is None:
                    print(f"| {shape} | {cluster} | {what} | none | | | | | | |")
                    continue
                o = p.get("offload") or {}

                def gib(b):
                    return f"{b / 2**30:.1f} GiB"

                print(f"| {shape} | {cluster} | {what} | {layers} layers | {n / 1e9:.2f} B | "
                      f"`{p['config']}` | {p['predicted']['step_time_s']:.2f} | "
                      f"{gib(o.get('host_peak_bytes', 0))} | {gib(o.get('nvme_peak_bytes', 0))} | "
                      f"{n / base:.1f}× |")
                sys.stdout.flush()


def speed():
    """gpt2 on one H100, batch 8 × 1024: no offload against offloaded optimizer state."""
    print()
    print("| model | GPU | plan | step (s) | moved per step | copies (s) | host AdamW (s) | hidden |")
    print("|---|---|---|---|---|---|---|---|")
    for cfg in ["dp1 tp1", "dp1 tp1 offload=opt", "dp1 tp1 offload=grads+opt"]:
        p = plan("gpt2", "1xH100", ["--plan", cfg], batch=8)
        o = p.get("offload") or {}
        print(f"| gpt2 | 1xH100 | `{p['config']}` | {p['predicted']['step_time_s']:.4f} | "
              f"{o.get('moved_bytes_per_step', 0) / 2**20:.0f} MiB | {o.get('transfer_s', 0):.4f} | "
              f"{o.get('host_compute_s', 0):.4f} | {100 * o.get('hidden_fraction', 1):.0f}% |")


def measured():
    """The CPU runtime (one simulated device): gpt2 with and without offloaded optimizer state,
    measured tokens/s over 6 steps (the first excluded by taking the mean of the rest), and
    the predicted hidden share of copies and host work."""
    print()
    print("| model | plan | tokens/s measured | step (s) measured | predicted hidden | host peak (measured) |")
    print("|---|---|---|---|---|---|")
    for cfg in ["dp1 tp1", "dp1 tp1 offload=opt", "dp1 tp1 offload=grads+opt",
                "dp1 tp1 offload=grads+opt nvme"]:
        log = os.path.join(TMP, "log.jsonl")
        cmd = [BIN, "train", "--devices", "1", "--model", "gpt2", "--batch", "2", "--seq", "128",
               "--steps", "6", "--eval-batches", "0", "--plan", cfg, "--host-memory", "4GiB",
               "--nvme-size", "4GiB", "--offload-dir", TMP, "--format", "json", "--log-json", log]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            print(f"| gpt2 | `{cfg}` | failed: {out.stderr.strip()[-200:]} | | | |")
            continue
        r = json.loads(out.stdout)
        steps = [json.loads(l) for l in open(log)][1:]
        tps = sum(x["tokens_per_s"] for x in steps) / len(steps)
        p = plan("gpt2", "1xcpu", ["--plan", cfg, "--host-memory", "4GiB", "--nvme-size", "4GiB"],
                 batch=2, seq=128)
        o = p.get("offload") or {}
        hidden = f"{100 * o['hidden_fraction']:.0f}%" if o else "—"
        host = r["memory"].get("host_peak_bytes", {}).get("measured", [0])[0]
        print(f"| gpt2 | `{cfg}` | {tps:.0f} | {256 / tps:.3f} | {hidden} | {host / 2**20:.0f} MiB |")
        sys.stdout.flush()


def zero_offload():
    """ZeRO-Offload's single-GPU figure (Ren et al., USENIX ATC 2021, abstract and section 6):
    a 10B-parameter GPT-2-like model on one V100 32 GB of a DGX-2 trains at 40 TFLOPS with
    its optimizer on the CPU. The same model shape (hidden 4096, 50 layers, fp16, batch 8 of
    1024 tokens) planned on our V100 preset with the DGX-2's host."""
    print()
    print("| model | GPU | plan | step (s) | TFLOPS | ZeRO-Offload measured | ratio |")
    print("|---|---|---|---|---|---|---|")
    path = os.path.join(TMP, "gpt2-10b.json")
    with open(path, "w") as f:
        json.dump({"model_type": "gpt2", "n_embd": 4096, "n_layer": 50, "n_head": 32,
                   "n_positions": 1024, "vocab_size": 50257}, f)
    p = plan(path, "1xV100", ["--dtype", "fp16"], batch=8)
    if p is None:
        print("| gpt2-10b | 1xV100 | does not fit | | | 40 | |")
        return
    tflops = p["predicted"]["mfu"] * 125.0
    print(f"| gpt2 10.3B (h4096 × 50) | 1xV100 (DGX-2 host) | `{p['config']}` | "
          f"{p['predicted']['step_time_s']:.2f} | {tflops:.1f} | 40 | {tflops / 40:.2f} |")


if __name__ == "__main__":
    if not os.path.exists(BIN):
        subprocess.run(["cargo", "build", "--release", "-q", "--bin", "tessera"], check=True)
    which = os.environ.get("BENCH", "capacity,speed,zero-offload,measured")
    if "capacity" in which:
        capacity()
    if "speed" in which:
        speed()
    if "zero-offload" in which:
        zero_offload()
    if "measured" in which:
        measured()
