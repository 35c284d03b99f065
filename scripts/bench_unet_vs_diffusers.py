"""A CPU training step of a small UNet2DConditionModel: `tessera train` against diffusers on
PyTorch CPU, in the same run, the two sides back to back `--reps` times (driven by
scripts/bench-unet-vs-diffusers.sh, which builds the release binary and picks the Python).

The model is the tiny Stable Diffusion pipeline of the tests (crates/tessera-cli/tests/
fixtures/tiny_sd: its CLIP text encoder, VAE and tokenizer) with a wider UNet written over its
`unet/config.json` (`--channels`, `--heads`, `--latent`), so a step takes a fraction of a
second rather than a millisecond. Both sides train that UNet from a random initialisation:

- Tessera: `tessera train --model PIPE/unet --data PICTURES --devices 1 --plan dp1` (the VAE
  and CLIP encode the pictures once before step 1; that is outside the timed steps), f32.
- diffusers: `UNet2DConditionModel.from_config` of the same config.json; per step, random
  latents and text states of the same shapes (4 channels × latent × latent, 16 text tokens of
  32), timesteps drawn in 0..1000, DDPMScheduler's `add_noise` with the pipeline's scheduler
  config, 10% of the text states replaced by the empty caption's (classifier-free guidance,
  as Tessera's `--cond-drop-prob` default), MSE against the noise.

Both: AdamW (β 0.9/0.95, ε 1e-8, weight decay 0.1 on weights of rank ≥ 2, as Tessera's
default), clipping at 1.0, lr 1e-3, f32, 2 threads (RAYON_NUM_THREADS=2;
torch.set_num_threads(2)). Timed: the steps after `--warmup` untimed ones, as wall time per
step and as the process's CPU time (user + system, all threads) per step — Tessera's read from
/proc/PID/stat as its --log-json shows the first and last timed steps, PyTorch's from
time.process_time(). On a machine shared with other work the CPU time is the steadier figure.

usage: python bench_unet_vs_diffusers.py --bin target/release/tessera [--reps 3] [...]
       python bench_unet_vs_diffusers.py torch-side CONFIG.json ...   (one PyTorch run; JSON)
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "crates/tessera-cli/tests/fixtures/tiny_sd"
TEXT_TOKENS = 16  # the tiny CLIP's max_position_embeddings (its tokenizer's length)
TEXT_DIM = 32  # the tiny CLIP's hidden_size (the UNet's cross_attention_dim)


def unet_config(channels, heads, latent, groups):
    cfg = json.loads((FIXTURE / "pipeline/unet/config.json").read_text())
    cfg.update({
        "block_out_channels": channels,
        "attention_head_dim": heads,
        "sample_size": latent,
        "norm_num_groups": groups,
    })
    return cfg


def pipeline_dir(cfg):
    """A pipeline directory: the fixture's frozen parts, this UNet's config (no weights)."""
    d = Path(tempfile.mkdtemp(prefix="bench-unet-"))
    for part in ("text_encoder", "tokenizer", "vae", "scheduler"):
        (d / part).symlink_to(FIXTURE / "pipeline" / part)
    (d / "unet").mkdir()
    (d / "unet/config.json").write_text(json.dumps(cfg, indent=1))
    return d


def cpu_s(pid):
    """user + system CPU seconds of process `pid` (every thread)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def tessera_side(args, pipe):
    log = pipe / "steps.jsonl"
    if log.exists():
        log.unlink()
    steps = args.warmup + args.steps + 1  # one more: the process is alive at the last read
    cmd = [args.bin, "train", "--model", str(pipe / "unet"), "--data",
           str(FIXTURE / "pictures"), "--devices", "1", "--plan", "dp1",
           "--batch", str(args.batch), "--steps", str(steps), "--lr", "1e-3",
           "--eval-batches", "0", "--format", "json", "--log-json", str(log)]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    marks = {}  # step -> (wall, cpu) when its log line appeared
    want = {args.warmup, args.warmup + args.steps}
    while p.poll() is None and len(marks) < len(want):
        n = sum(1 for _ in open(log)) if log.exists() else 0
        for s in want:
            if s not in marks and n >= s:
                marks[s] = (time.perf_counter(), cpu_s(p.pid))
        time.sleep(0.002)
    out, err = p.communicate()
    if p.returncode != 0 or len(marks) < len(want):
        raise SystemExit(f"tessera failed ({p.returncode}): {err[-2000:]}")
    lines = [json.loads(l) for l in open(log)]
    per_step = [args.batch / l["samples_per_s"] for l in lines[args.warmup:args.warmup + args.steps]]
    (w0, c0), (w1, c1) = marks[args.warmup], marks[args.warmup + args.steps]
    report = json.loads(out)
    return {
        "wall_s": statistics.median(per_step),
        "wall_s_polled": (w1 - w0) / args.steps,
        "cpu_s": (c1 - c0) / args.steps,
        "losses": [l["loss"] for l in lines],
        "plan": report.get("plan", {}).get("config") if isinstance(report.get("plan"), dict)
        else report.get("plan"),
        "parameters": report.get("parameters", {}).get("total"),
    }


def torch_side(cfg_path, batch, warmup, steps, threads, seed=1337):
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler, UNet2DConditionModel

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = json.loads(Path(cfg_path).read_text())
    model = UNet2DConditionModel.from_config(cfg)
    model.train()
    sched = DDPMScheduler.from_pretrained(FIXTURE / "pipeline/scheduler")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    lat, ch = cfg["sample_size"], cfg["in_channels"]
    null = torch.randn(1, TEXT_TOKENS, TEXT_DIM)

    def step():
        latents = torch.randn(batch, ch, lat, lat)
        states = torch.randn(batch, TEXT_TOKENS, TEXT_DIM)
        drop = (torch.rand(batch) < 0.1).view(batch, 1, 1)
        states = torch.where(drop, null, states)
        noise = torch.randn_like(latents)
        t = torch.randint(0, sched.config.num_train_timesteps, (batch,))
        noisy = sched.add_noise(latents, noise, t)
        opt.zero_grad(set_to_none=True)
        pred = model(noisy, t, encoder_hidden_states=states).sample
        loss = F.mse_loss(pred, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    walls = []
    c0 = time.process_time()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
    c1 = time.process_time()
    return {
        "wall_s": statistics.median(walls),
        "cpu_s": (c1 - c0) / steps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
        "attention": type(model.down_blocks[0].attentions[0].transformer_blocks[0].attn1
                          .processor).__name__,
    }


def busy_share(f):
    """Runs f(); returns (its result, the share of the machine's CPU the rest used meanwhile,
    counting the child processes it waited for as its own)."""
    import resource

    def busy():
        v = [int(x) for x in open("/proc/stat").readline().split()[1:8]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

    r0, b0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), busy(), time.time()
    out = f()
    r1, b1, t1 = resource.getrusage(resource.RUSAGE_CHILDREN), busy(), time.time()
    own = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return out, max(0.0, (b1 - b0) - own) / ((t1 - t0) * os.cpu_count())


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "torch-side":
        cfg, batch, warmup, steps, threads = sys.argv[2], *map(int, sys.argv[3:7])
        print(json.dumps(torch_side(cfg, batch, warmup, steps, threads)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="the tessera binary (release)")
    ap.add_argument("--channels", type=int, nargs=2, default=[32, 64])
    ap.add_argument("--heads", type=int, nargs=2, default=[2, 4])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--latent", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    cfg = unet_config(args.channels, args.heads, args.latent, args.groups)
    pipe = pipeline_dir(cfg)
    rows = []
    try:
        for rep in range(args.reps):
            ts, tbusy = busy_share(lambda: tessera_side(args, pipe))
            cmd = [sys.executable, __file__, "torch-side", str(pipe / "unet/config.json"),
                   str(args.batch), str(args.warmup), str(args.steps), str(args.threads)]
            pt, pbusy = busy_share(lambda: json.loads(subprocess.check_output(cmd)))
            if ts["parameters"] != pt["parameters"]:
                raise SystemExit(f"parameters: tessera {ts['parameters']}, diffusers "
                                 f"{pt['parameters']}")
            rows.append((ts, tbusy, pt, pbusy))
            print(f"rep {rep + 1}: tessera {ts['wall_s']:.3f} s wall {ts['cpu_s']:.3f} s CPU "
                  f"(rest busy {100 * tbusy:.0f}%); diffusers {pt['wall_s']:.3f} s wall "
                  f"{pt['cpu_s']:.3f} s CPU (rest busy {100 * pbusy:.0f}%)", file=sys.stderr)
    finally:
        shutil.rmtree(pipe, ignore_errors=True)
    med = lambda xs: statistics.median(xs)
    tw, tc = med([r[0]["wall_s"] for r in rows]), med([r[0]["cpu_s"] for r in rows])
    pw, pc = med([r[2]["wall_s"] for r in rows]), med([r[2]["cpu_s"] for r in rows])
    busy = max(max(r[1], r[3]) for r in rows)
    pt = rows[0][2]
    print(json.dumps({"config": {k: cfg[k] for k in ("block_out_channels", "attention_head_dim",
                                                      "sample_size", "norm_num_groups")},
                      "batch": args.batch, "reps": [
                          {"tessera": r[0], "tessera_rest_busy": r[1], "diffusers": r[2],
                           "diffusers_rest_busy": r[3]} for r in rows]}), file=sys.stderr)
    print("| UNet (params) | batch × latent | Tessera step: wall / CPU | diffusers step: wall / "
          "CPU | ratio diffusers/Tessera: wall / CPU | reps | rest of machine busy (max) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| channels {args.channels}, heads {args.heads}, 16×32 text states "
          f"({pt['parameters']:,}) | {args.batch} × {args.latent}×{args.latent}×4 | "
          f"{tw:.3f} / {tc:.3f} s | {pw:.3f} / {pc:.3f} s | {pw / tw:.2f}× / {pc / tc:.2f}× | "
          f"{args.reps} (medians) | {100 * busy:.0f}% |")
    print(f"\ntorch {pt['torch']}, diffusers {pt['diffusers']} ({pt['attention']}), "
          f"{args.threads} threads each; {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d', time.gmtime())}")


if __name__ == "__main__":
    main()
