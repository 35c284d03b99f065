"""One training step's bf16 error budget, Tessera's against PyTorch autocast's, from the same
weights and batch: where Tessera's bf16 loses precision that autocast keeps.

For a seed directory that `bf16_spread --dump-only` wrote (a Hugging Face directory plus
`batches.json`), this takes batch STEP (0 by default) and computes the loss, the logits and
every parameter's gradient four ways: Tessera fp32 and bf16 (the `grad_budget` example of
tessera-runtime, on the CPU: the model built in that dtype, as training builds it) and PyTorch
fp32 and under `autocast(bfloat16)` with fp32 parameters (as `torch-bf16-spread.py` trains).
Per parameter: the relative error ||g_bf16 - g_fp32|| / ||g_fp32|| of each framework against
its own fp32, and the ratio Tessera / PyTorch; the same for the loss and the logits. Both fp32
sides are also compared with each other (same start: ~1e-6).

    python3 scripts/bf16_grad_budget.py --seed-dir DUMP/gpt2-tiny/seed1 \
        --bin target/debug/examples/grad_budget [--step 0] [--device cpu|cuda] [--json]

--warm K starts both from PyTorch's fp32 weights after K AdamW steps (the seed's first K
batches) and takes batch K: at step 0 the weights are the init, where bf16 storage of small
updates cannot yet show. --torch-round REGEX (an experiment) holds the matching PyTorch
parameters in bf16 before autocast, to test whether Tessera's bf16 storage of them explains a gap.
`scripts/bf16-grad-budget.sh` dumps a seed and runs this for both models.

--device is PyTorch's (Tessera's side runs on the CPU: its CPU and CUDA backends round at
the same points). --group sums the table by parameter kind (the name with layer numbers
dropped). --acts PREFIX,... also dumps Tessera's activations under those scopes (fp32 and
bf16) and prints their relative errors.
"""
import argparse, json, os, re, subprocess, sys, tempfile

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from safetensors.torch import load_file, save_file


def rel(a, b):
    a, b = a.double(), b.double()
    n = b.norm().item()
    return (a - b).norm().item() / n if n > 0 else float("nan")


def load(path, device):
    from transformers import AutoModelForCausalLM
    kw = dict(attn_implementation="sdpa")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except TypeError:  # transformers 4.x
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kw)
    return model.to(device)


def torch_side(seed_dir, x, y, device, bf16, round_re=None):
    from transformers import AutoModelForCausalLM
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model = load(seed_dir, device)
    model.train()
    if bf16 and round_re:
        # An experiment: hold these parameters in bf16 as Tessera does (autocast keeps them fp32).
        with torch.no_grad():
            for n, p in model.named_parameters():
                if re.search(round_re, n):
                    p.copy_(p.bfloat16().float())
    x, y = x.to(device), y.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            grads[n] = p.grad.detach().float().cpu()
    return loss.item(), logits.detach().float().cpu(), grads


def warm_start(seed_dir, meta, steps, device, out):
    """The seed's weights after `steps` fp32 AdamW steps of PyTorch (torch-bf16-spread.py's
    settings), saved as a Hugging Face directory `out`: both frameworks' budget then starts there."""
    from transformers import AutoModelForCausalLM
    model = load(seed_dir, device)
    model.train()
    a = meta["adamw"]
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= a["decay_min_rank"]], "weight_decay": a["weight_decay"]},
              {"params": [p for p in params if p.dim() < a["decay_min_rank"]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=meta["lr_f32"], betas=(a["beta1"], a["beta2"]), eps=a["eps"])
    for k in range(steps):
        x = torch.tensor(meta["inputs"][k], dtype=torch.long).to(device)
        y = torch.tensor(meta["targets"][k], dtype=torch.long).to(device)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a["max_grad_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(params, a["max_grad_norm"])
        opt.step()
    model.cpu().save_pretrained(out)
    with open(os.path.join(out, "batches.json"), "w") as f:
        json.dump(meta, f)


def tessera_side(binary, seed_dir, inp, dtype, acts, tmp):
    out = os.path.join(tmp, f"tessera-{dtype}.safetensors")
    cmd = [binary, seed_dir, inp, out, dtype] + acts
    subprocess.run(cmd, check=True)
    t = load_file(out)
    grads = {k[5:]: v.float() for k, v in t.items() if k.startswith("grad.")}
    a = {k[4:]: v.float() for k, v in t.items() if k.startswith("act.")}
    return t["loss"].float().item(), t["logits"].float(), grads, a


def group_of(name):
    return re.sub(r"\.\d+\.", ".N.", name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed-dir", required=True)
    ap.add_argument("--bin", required=True, help="tessera-runtime's grad_budget example")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--group", action="store_true")
    ap.add_argument("--acts", default="")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--torch-round", default=None, metavar="REGEX",
                    help="experiment: round the PyTorch parameters whose names match to bf16 before autocast")
    ap.add_argument("--warm", type=int, default=0,
                    help="start from the weights after this many fp32 PyTorch steps (--step defaults to it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with open(os.path.join(args.seed_dir, "batches.json")) as f:
        meta = json.load(f)
    device = torch.device(args.device)
    keep = tempfile.TemporaryDirectory()
    if args.warm:
        warmed = os.path.join(keep.name, "warm")
        warm_start(args.seed_dir, meta, args.warm, device, warmed)
        args.seed_dir = warmed
        args.step = args.step or args.warm
    x = torch.tensor(meta["inputs"][args.step], dtype=torch.long)
    y = torch.tensor(meta["targets"][args.step], dtype=torch.long)
    acts = [a for a in args.acts.split(",") if a]
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "in.safetensors")
        save_file({"input_ids": x.contiguous(), "labels": y.contiguous()}, inp)
        tf = tessera_side(args.bin, args.seed_dir, inp, "fp32", acts, tmp)
        tb = tessera_side(args.bin, args.seed_dir, inp, "bf16", acts, tmp)
    pf = torch_side(args.seed_dir, x, y, device, False)
    pb = torch_side(args.seed_dir, x, y, device, True, args.torch_round)

    rows = []
    def row(name, t_err, p_err, same):
        rows.append({"name": name, "tessera": t_err, "torch": p_err,
                     "ratio": t_err / p_err if p_err > 0 else float("inf"), "same_start": same})
    row("loss", abs(tb[0] - tf[0]) / abs(tf[0]), abs(pb[0] - pf[0]) / abs(pf[0]),
        abs(tf[0] - pf[0]) / abs(pf[0]))
    tl = tf[1].reshape(pf[1].shape)
    row("logits", rel(tb[1].reshape(pf[1].shape), tl), rel(pb[1], pf[1]), rel(tl, pf[1]))
    names = [n for n in pf[2] if n in tf[2]]
    missing = sorted(set(pf[2]) ^ set(tf[2]))
    if args.group:
        groups = {}
        for n in names:
            groups.setdefault(group_of(n), []).append(n)
        for g, ns in groups.items():
            cat = lambda d: torch.cat([d[n].reshape(-1) for n in ns])
            row(g, rel(cat(tb[2]), cat(tf[2])), rel(cat(pb[2]), cat(pf[2])), rel(cat(tf[2]), cat(pf[2])))
    else:
        for n in names:
            row(n, rel(tb[2][n], tf[2][n]), rel(pb[2][n], pf[2][n]), rel(tf[2][n], pf[2][n]))
    cat = lambda d: torch.cat([d[n].reshape(-1) for n in names])
    row("ALL grads", rel(cat(tb[2]), cat(tf[2])), rel(cat(pb[2]), cat(pf[2])), rel(cat(tf[2]), cat(pf[2])))
    if args.json:
        for r in rows:
            print(json.dumps({"seed_dir": args.seed_dir, "step": args.step, **r}))
    else:
        print(f"{'':44s} {'tessera':>9s} {'torch':>9s} {'ratio':>6s} {'fp32 T-vs-P':>11s}")
        for r in rows:
            flag = "  <==" if r["ratio"] > 2 else ""
            print(f"{r['name']:44s} {r['tessera']:9.2e} {r['torch']:9.2e} {r['ratio']:6.2f} "
                  f"{r['same_start']:11.1e}{flag}")
        if missing:
            print("not compared (one side only):", missing)
    for k in sorted(tb[3]):
        if k in tf[3] and tf[3][k].shape == tb[3][k].shape:
            print(f"act {k:60s} {rel(tb[3][k], tf[3][k]):9.2e}")


if __name__ == "__main__":
    sys.exit(main())
