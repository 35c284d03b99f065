"""QLoRA on the GPU against the CPU: `tessera train --quantize-base int4|int8 --lora ...` of the
LoRA fixture's tiny LLaMA (crates/tessera-cli/tests/fixtures/lora, as tests/lora.rs runs it),
fp32, 5 steps, on `--device cuda` and on `--device cpu`. Per run: the per-step losses must agree
within 1e-4 (relative), and the CUDA run's caching-allocator peak must equal its predicted peak
and the accountant's, to the byte.

    python3 scripts/gpu_qlora_check.py [OUT_DIR]     # TESSERA_CLI=target/release/tessera

TESSERA_DEVICE=cpu runs the "GPU" side on the CPU too (a dry run of this script without a GPU:
the CPU has no allocator books, so only predicted == measured is checked there). Prints one JSON
line per quantisation, then exits 1 when a bound fails.
"""
import json, os, subprocess, sys

CLI = os.environ.get("TESSERA_CLI", "target/release/tessera")
DEVICE = os.environ.get("TESSERA_DEVICE", "cuda")
FIXTURE = "crates/tessera-cli/tests/fixtures/lora"
SPEC = "r=4,alpha=8,targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
TOL = 1e-4
STEPS = 5


def train(out, device, quant):
    log = os.path.join(out, f"qlora-{quant}-{device}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [CLI, "train", "--device", device, "--devices", "1", "--init", f"{FIXTURE}/base",
           "--data", f"{FIXTURE}/data", "--lora", SPEC, "--quantize-base", quant,
           "--steps", str(STEPS), "--batch", "4", "--seq", "16", "--lr", "2e-2",
           "--schedule", "constant", "--weight-decay", "0", "--max-grad-norm", "0",
           "--eval-batches", "0", "--dtype", "fp32", "--format", "json", "--log-json", log]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return None, None, p.stderr[-1500:]
    return json.loads(p.stdout), [json.loads(l)["loss"] for l in open(log)], ""


def flat(v):
    return v if isinstance(v, list) else [v]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-qlora-out"
    os.makedirs(out, exist_ok=True)
    fails = []
    for quant in ["int4", "int8"]:
        ref, ref_losses, err = train(out, "cpu", quant)
        rep, losses, err2 = (None, None, "") if ref is None else train(out, DEVICE, quant)
        if ref is None or rep is None:
            e = err or err2
            print(json.dumps({"check": "qlora_cli", "quant": quant, "ok": False, "error": e}),
                  flush=True)
            fails.append(f"{quant}: {e[-300:]}")
            continue
        worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses)),
                    default=float("inf"))
        m = rep["memory"]
        pred, meas = flat(m["predicted_peak_bytes"]), flat(m["measured_peak_bytes"])
        alloc = m.get("allocator_peak_bytes")
        mem_ok = pred == meas and (DEVICE == "cpu" or (alloc is not None and flat(alloc) == pred))
        ok = (len(losses) == len(ref_losses) == STEPS and worst <= TOL and mem_ok
              and rep.get("device") == DEVICE)
        print(json.dumps({"check": "qlora_cli", "quant": quant, "device": rep.get("device"),
                          "losses": losses, "cpu_losses": ref_losses, "worst_rel": worst,
                          "tol": TOL, "predicted_peak": pred, "accountant_peak": meas,
                          "allocator_peak": alloc, "ok": ok}), flush=True)
        if not ok:
            fails.append(f"{quant}: worst rel {worst:.3e}, peaks {pred} {meas} {alloc}")
    for f in fails:
        print(f"FAIL qlora {f}", file=sys.stderr)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
