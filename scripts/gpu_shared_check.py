"""Several devices on one GPU, checked against one device: `tessera train --device cuda
--devices N --plan P` on a machine with fewer GPUs than N runs N devices that share a GPU (own
streams and allocators; collectives staged through the host), each running its plan's GPU
kernels. For gpt2-tiny and llama-tiny in fp32 (and mixtral-tiny under the EXTRA plans: the
MoE routing kernels, expert parallelism), every plan's per-step losses and gradient norms
must equal the one-device run's within 1e-5 (relative), and each device's caching-allocator
peak must equal its predicted peak to the byte (and the accountant's).

    python3 scripts/gpu_shared_check.py [OUT_DIR]     # TESSERA_CLI=target/release/tessera

Prints one JSON line per run, then a summary; exits 1 when a bound fails.
"""
import json, os, subprocess, sys, time

CLI = os.environ.get("TESSERA_CLI", "target/release/tessera")
# `cpu` runs the same comparison on simulated devices (a dry run of this script without a GPU;
# the CPU has no allocator books apart from the accountant's).
DEVICE = os.environ.get("TESSERA_DEVICE", "cuda")
PLANS = [(2, "dp2"), (2, "tp2"), (4, "dp2 tp2 sp"), (2, "pp2 mb4"), (4, "dp4 zero3")]
# Context parallelism: all-to-all (both models), ring attention (llama-tiny: ring does not
# split GPT-2's learned position table yet), its kernels also checked by `tessera-gpu-check ring`;
# and tp8 on llama-tiny's 4 KV heads (tensor parallelism past the KV heads, the same check).
PLANS += [(2, "cp2")]
MODEL_PLANS = {"llama-tiny": [(2, "cp2 cp=ring"), (4, "cp4 cp=ring"), (4, "dp2 cp2 cp=ring"),
                              (8, "tp8")]}
MODELS = ["gpt2-tiny", "llama-tiny"]
# Runs beside MODELS × PLANS: (model, devices, plan).
EXTRA = [("mixtral-tiny", 2, "ep2"), ("mixtral-tiny", 2, "dp2")]
TOL = 1e-5
STEPS = 12


def train(out, model, devices, plan, tag):
    log = os.path.join(out, f"{model}-{tag}.jsonl")
    cmd = [CLI, "train", "--device", DEVICE, "--devices", str(devices), "--model", model,
           "--steps", str(STEPS), "--batch", "8", "--seq", "64", "--lr", "1e-4",
           "--eval-batches", "0", "--format", "json", "--log-json", log]
    if plan:
        cmd += ["--plan", plan]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.time() - t0
    if p.returncode != 0:
        return None, None, secs, p.stderr[-1500:]
    steps = [json.loads(l) for l in open(log)]
    return json.loads(p.stdout), steps, secs, ""


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-shared-out"
    os.makedirs(out, exist_ok=True)
    fails = []
    runs = {m: list(PLANS) + MODEL_PLANS.get(m, []) for m in MODELS}
    for model, devices, plan in EXTRA:
        runs.setdefault(model, []).append((devices, plan))
    for model, plans in runs.items():
        base, base_steps, secs, err = train(out, model, 1, None, "one")
        if base is None:
            print(json.dumps({"check": "shared", "model": model, "plan": "one device", "ok": False,
                              "error": err}), flush=True)
            fails.append(f"{model} one device: {err[-300:]}")
            continue
        for devices, plan in plans:
            rep, steps, secs, err = train(out, model, devices, plan, plan.replace(" ", "_"))
            if rep is None:
                print(json.dumps({"check": "shared", "model": model, "plan": plan, "ok": False,
                                  "error": err}), flush=True)
                fails.append(f"{model} {plan}: {err[-300:]}")
                continue
            loss = max(rel(s["loss"], b["loss"]) for s, b in zip(steps, base_steps))
            norm = max(rel(s["grad_norm"], b["grad_norm"]) for s, b in zip(steps, base_steps))
            mem = rep["memory"]
            alloc = mem.get("allocator_peak_bytes", [])
            if DEVICE == "cpu":
                alloc = mem["measured_peak_bytes"]
            peaks_equal = (alloc == mem["predicted_peak_bytes"] == mem["measured_peak_bytes"])
            ok = (len(steps) == len(base_steps) == STEPS and loss <= TOL and norm <= TOL
                  and peaks_equal and rep["devices"] == devices)
            print(json.dumps({
                "check": "shared", "model": model, "plan": plan, "devices": rep["devices"],
                "config": rep["config"], "max_rel_loss": loss, "max_rel_grad_norm": norm,
                "predicted_peak": mem["predicted_peak_bytes"],
                "accountant_peak": mem["measured_peak_bytes"], "allocator_peak": alloc,
                "comm_predicted": rep["comm"]["predicted_bytes"],
                "comm_measured": rep["comm"]["measured_bytes"], "seconds": round(secs, 1),
                "ok": ok}), flush=True)
            if not ok:
                fails.append(f"{model} {plan}: loss {loss:.2e}, norm {norm:.2e}, peaks "
                             f"{mem['predicted_peak_bytes']} / {alloc}")
    print(json.dumps({"check": "shared_summary", "ok": not fails, "failures": fails}), flush=True)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
