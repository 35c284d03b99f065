"""How far PyTorch's own bf16 mixed precision moves a loss curve from fp32: the independent
reference for the GPU check's bf16-curve bound (BENCHMARKS.md, "CUDA backend", training).

Two modes.

**From a Tessera dump** (`--from DIR`, what `scripts/bf16-seeds.sh` runs): DIR is what
`bf16_spread --seeds N --dump DIR` wrote, `DIR/<model>/seed<s>/` holding Tessera's exact
initial weights as a Hugging Face directory and the 50 batches Tessera trained on. Each seed's
weights are loaded with `from_pretrained` and trained 50 steps on exactly those batches, in
fp32 and under `torch.autocast(bfloat16)` with fp32 parameters, with Tessera's AdamW settings
as the dump states them (betas, eps, weight decay on parameters of rank >= 2 only, gradient
norm clipped at 1.0, the learning rate as the f32 Tessera binds, constant) and its loss (mean
cross-entropy over all targets). One JSON line per model and seed: `max_rel` (max over the
steps of |L_bf16 - L_fp32| / |L_fp32|), `max_abs`, the final losses, and `same_start`: |first
fp32 loss here - Tessera's first fp32 loss| (same weights, same data: ~1e-6 when the mapping
is right); then one summary line per model (median over seeds, worst seed).

    python3 scripts/torch-bf16-spread.py --from DIR [--device cuda|cpu] [--models a,b] [--seeds N]

**With its own initialisation and data** (the original reference): a Hugging Face LLaMA (or
GPT-2) of Tessera's tiny presets' sizes trains 50 AdamW steps on its own byte windows of the
shipped corpus (batch 4 x 64, lr 3e-4) in fp32 and under autocast, then both again with the
learning rate one f32 ulp higher. One JSON line per model and seed: the max |loss difference|
of each pair.

    python3 scripts/torch-bf16-spread.py [llama-tiny|gpt2-tiny] [seeds]

LR=1e-3 sets another learning rate; SCALED_INIT=1 draws the residual projections as Tessera
does (std 0.02 / sqrt(2 * layers)) instead of Hugging Face's 0.02.
"""
import argparse, json, os, statistics, sys, time

# cuBLAS is deterministic only with a fixed workspace; set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# Everything is local: never ask the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

STEPS, BATCH, SEQ = 50, 4, 64
LR = float(os.environ.get("LR", "3e-4"))


def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")


# ---- from a Tessera dump --------------------------------------------------------------------

def load_model(path, device):
    from transformers import AutoModelForCausalLM
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except Exception:
        pass
    kw = dict(attn_implementation="sdpa", output_loading_info=True)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except TypeError:  # transformers 4.x
        model, info = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kw)
    # Every weight must come from the dump: a missing one would be drawn afresh.
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise SystemExit(f"{path}: the weights do not load cleanly: {bad}")
    for n, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise SystemExit(f"{path}: {n} loaded as {p.dtype}")
    return model.to(device)


def dump_curve(path, meta, device, bf16):
    torch.manual_seed(0)
    model = load_model(path, device)
    model.train()
    a = meta["adamw"]
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights once
    decay = [p for p in params if p.dim() >= a["decay_min_rank"]]
    no_decay = [p for p in params if p.dim() < a["decay_min_rank"]]
    groups = [{"params": decay, "weight_decay": a["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=meta["lr_f32"], betas=(a["beta1"], a["beta2"]), eps=a["eps"])
    inputs = torch.tensor(meta["inputs"], dtype=torch.long)
    targets = torch.tensor(meta["targets"], dtype=torch.long)
    losses = []
    for k in range(meta["steps"]):
        x, y = inputs[k].to(device), targets[k].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a["max_grad_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(params, a["max_grad_norm"])
        opt.step()
        losses.append(loss.item())
    return losses


def max_rel(b, f):
    rels = [abs(p - q) / abs(q) for p, q in zip(b, f)]
    k = max(range(len(rels)), key=rels.__getitem__)
    return rels[k], k + 1


def seeds_of(model_dir):
    found = []
    for name in os.listdir(model_dir):
        if name.startswith("seed") and name[4:].isdigit():
            found.append(int(name[4:]))
    return sorted(found)


def from_dump(args):
    deterministic()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible to PyTorch")
    device = torch.device(args.device)
    if args.device == "cpu":
        torch.set_num_threads(args.threads or torch.get_num_threads())
    models = args.models.split(",") if args.models else sorted(
        m for m in os.listdir(args.source) if os.path.isdir(os.path.join(args.source, m)))
    for model in models:
        mdir = os.path.join(args.source, model)
        seeds = seeds_of(mdir)
        if args.seeds is not None:
            seeds = [s for s in seeds if s < args.seeds]
        if not seeds:
            raise SystemExit(f"{mdir}: no seed<s> directories")
        rows = []
        for seed in seeds:
            path = os.path.join(mdir, f"seed{seed}")
            with open(os.path.join(path, "batches.json")) as f:
                meta = json.load(f)
            theirs = None
            if os.path.exists(os.path.join(path, "tessera.json")):
                with open(os.path.join(path, "tessera.json")) as f:
                    theirs = json.load(f)
            t0 = time.time()
            f32 = dump_curve(path, meta, device, False)
            b16 = dump_curve(path, meta, device, True)
            rel, rel_step = max_rel(b16, f32)
            row = {"side": "torch", "device": args.device, "model": model, "seed": seed,
                   "data_seed": meta["data_seed"], "max_rel": rel, "max_rel_step": rel_step,
                   "max_abs": max(abs(p - q) for p, q in zip(b16, f32)),
                   "first_fp32": f32[0], "first_bf16": b16[0],
                   "final_fp32": f32[-1], "final_bf16": b16[-1]}
            if theirs is not None:
                # Same weights, same data, same loss: the first fp32 losses must agree.
                row["tessera_first_fp32"] = theirs["fp32"][0]
                row["same_start"] = abs(f32[0] - theirs["fp32"][0])
                row["tessera_device"] = theirs["device"]
                # How far the whole fp32 curves drift apart (optimizer settings matched).
                row["fp32_vs_tessera_max_abs"] = max(abs(p - q) for p, q in zip(f32, theirs["fp32"]))
            row["secs"] = time.time() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
        rels = [r["max_rel"] for r in rows]
        worst = max(rows, key=lambda r: r["max_rel"])
        summary = {"side": "torch", "summary": True, "device": args.device, "model": model,
                   "seeds": len(rows), "median_max_rel": statistics.median(rels),
                   "worst_seed": worst["seed"], "worst_max_rel": worst["max_rel"],
                   "median_max_abs": statistics.median(r["max_abs"] for r in rows),
                   "worst_max_abs": max(r["max_abs"] for r in rows)}
        starts = [r["same_start"] for r in rows if "same_start" in r]
        if starts:
            summary["same_start_max"] = max(starts)
        print(json.dumps(summary), flush=True)


# ---- with its own initialisation and data ----------------------------------------------------

def build(name):
    if name == "llama-tiny":  # tessera-models/src/presets.rs
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                          rms_norm_eps=1e-5)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg)
    cfg = GPT2Config(vocab_size=256, n_positions=256, n_embd=256, n_layer=8, n_head=8,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)

def batches(seed):
    text = open(os.path.join(os.path.dirname(__file__), "..", "data", "shakespeare.txt"), "rb").read()
    data = torch.tensor(np.frombuffer(text[: len(text) * 9 // 10], dtype=np.uint8).astype(np.int64))
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        rows = torch.stack([data[s : s + SEQ + 1] for s in starts])
        yield rows[:, :-1], rows[:, 1:]

def curve(name, seed, bf16, lr):
    torch.manual_seed(seed)
    model = build(name)
    if os.environ.get("SCALED_INIT") == "1":
        # Tessera's initialisation (tessera-runtime/src/init.rs): the projections that write
        # into the residual stream drawn with std 0.02 / sqrt(2 * layers) (GPT-2's scaling).
        layers = model.config.num_hidden_layers
        for n, p in model.named_parameters():
            if n.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):
                torch.nn.init.normal_(p, std=0.02 / (2 * layers) ** 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for x, y in batches(seed + 1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses

def own_init(name, seeds):
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    lr_ulp = float(np.nextafter(np.float32(LR), np.float32(1.0)))
    for seed in range(seeds):
        f32, f32u = curve(name, seed, False, LR), curve(name, seed, False, lr_ulp)
        b16, b16u = curve(name, seed, True, LR), curve(name, seed, True, lr_ulp)
        d = lambda a, b: max(abs(p - q) for p, q in zip(a, b))
        print(json.dumps({"model": name, "seed": seed, "first": f32[0], "last": f32[-1],
                          "bf16_vs_fp32": d(b16, f32), "fp32_lr_plus_1ulp": d(f32u, f32),
                          "bf16_lr_plus_1ulp": d(b16u, b16)}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="llama-tiny", help="own-init mode: the model")
    p.add_argument("nseeds", nargs="?", type=int, default=3, help="own-init mode: seeds")
    p.add_argument("--from", dest="source", help="a bf16_spread --dump directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"])
    p.add_argument("--models", help="with --from: these models only (comma-separated)")
    p.add_argument("--seeds", type=int, help="with --from: seeds below this only")
    p.add_argument("--threads", type=int, help="with --from on the CPU: torch threads")
    args = p.parse_args()
    if args.source:
        from_dump(args)
    else:
        own_init(args.model, args.nseeds)


if __name__ == "__main__":
    main()
