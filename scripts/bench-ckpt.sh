#!/usr/bin/env bash
# Joint activation checkpointing against its baselines (checkpointing issue): for each case
# (model, cluster, batch, seq) a sweep of per-device budgets from the unconstrained plan's peak
# ("fits without checkpointing") down to just above the least memory any plan needs with full
# recompute (the planner's own "needs at least" figure), and at each budget the joint plan
# against four baselines: the sharding-only search (checkpointing off), Chen's √L segments and
# full recompute — each both as a whole search (best sharding for that policy) and applied to
# the joint plan's own sharding. Prints a markdown table; raw JSON goes to target/bench-ckpt/.
# usage: scripts/bench-ckpt.sh [path/to/tessera]
# env:   CKPT_CASES="model cluster batch seq;..." to override the cases
#        CKPT_POINTS=5  budgets per case below the unconstrained one
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/tessera}
[ -x "$bin" ] || cargo build --release -q --bin tessera
mkdir -p target/bench-ckpt
export CKPT_BIN=$bin
export CKPT_CASES=${CKPT_CASES:-"gpt2-xl 8xH100 16 1024;llama2-7b 8xH100 16 1024;llama2-70b 8xH100 16 1024;gpt2-xl 8x8xH100 128 1024;llama2-7b 8x8xH100 128 1024;llama2-70b 8x8xH100 128 1024"}
export CKPT_POINTS=${CKPT_POINTS:-5}
python3 - <<'PY'
import json, math, os, re, subprocess, time

GiB = 2**30
binary = os.environ["CKPT_BIN"]
points = int(os.environ["CKPT_POINTS"])


def plan(model, cluster, batch, seq, budget=None, baselines=()):
    cmd = [binary, "plan", "--model", model, "--cluster", cluster, "--batch", str(batch),
           "--seq", str(seq), "--format", "json"]
    if budget is not None:
        cmd += ["--memory-budget", f"{budget:.3f}GiB"]
    for b in baselines:
        cmd += ["--baseline", b]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    secs = time.time() - t0
    if r.returncode != 0:
        return None, r.stderr.strip(), secs
    return json.loads(r.stdout), "", secs


def least_needed(err):
    m = re.search(r"least any plan needs is ([0-9.]+) (GiB|MiB)", err)
    if not m:
        return None
    return float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1)


def fmt(x):
    return "—" if x is None else f"{x:.4f}"


print("| model | cluster | batch × seq | budget (GiB) | joint plan | step (s) | recompute (s) "
      "| blocks none / sel / full | sharding only (s) | Chen: search / same sharding (s) "
      "| full: search / same sharding (s) | joint / best baseline | search (s) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for case in os.environ["CKPT_CASES"].split(";"):
    model, cluster, batch, seq = case.split()
    tag = f"{model}_{cluster}_{batch}x{seq}"
    free, err, _ = plan(model, cluster, batch, seq)
    _, err_min, _ = plan(model, cluster, batch, seq, budget=0.5)
    least = least_needed(err_min)
    if least is None:
        print(f"| {model} | {cluster} | {batch} × {seq} | — | no plan: {err_min[:160]} |"
              " | | | | | | | |")
        continue
    if free is None:
        # Nothing fits the device at all: report the least memory a plan needs.
        print(f"| {model} | {cluster} | {batch} × {seq} | — | does not fit: needs "
              f"{least:.2f} GiB per device with full recompute |  | | | | | | | |")
        continue
    top = max(free["predicted"]["peak_bytes_per_device"]) / GiB
    low = least * 1.02
    budgets = [top] + [top * (low / top) ** (k / points) for k in range(1, points + 1)]
    for budget in budgets:
        d, err, secs = plan(model, cluster, batch, seq, budget,
                            ["chen", "full-recompute", "sharding-only"])
        if d is None:
            print(f"| {model} | {cluster} | {batch} × {seq} | {budget:.2f} | no plan: "
                  f"{err[:120]} | | | | | | | | {secs:.0f} |")
            continue
        with open(f"target/bench-ckpt/{tag}_{budget:.2f}GiB.json", "w") as f:
            json.dump(d, f, indent=1)
        p, b = d["predicted"], d["baselines"]
        modes = [c["mode"] for c in d.get("checkpoint", [])]
        counts = " / ".join(str(modes.count(m)) for m in ("none", "selective", "full"))
        so = b["sharding_only"]["step_time_s"]
        chen, chen_same = b["chen"]["step_time_s"], b["chen"].get("same_sharding_step_time_s")
        full, full_same = (b["full_recompute"]["step_time_s"],
                           b["full_recompute"].get("same_sharding_step_time_s"))
        best = min([x for x in (so, chen, chen_same, full, full_same) if x is not None],
                   default=None)
        ratio = "—" if best is None else f"{p['step_time_s'] / best:.3f}"
        print(f"| {model} | {cluster} | {batch} × {seq} | {budget:.2f} | {d['config']} "
              f"| {p['step_time_s']:.4f} | {p['recompute_s']:.4f} | {counts} | {fmt(so)} "
              f"| {fmt(chen)} / {fmt(chen_same)} | {fmt(full)} / {fmt(full_same)} "
              f"| {ratio} | {secs:.0f} |", flush=True)
PY
