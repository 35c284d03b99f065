"""The cost model against Tessera's own measured GPU step: for every `speed` row the GPU check
printed (`tessera-gpu-check speed`: a bf16 training step of GPT-2-medium or the 1.3B LLaMA,
measured), the planner's predicted step for the same model, batch and sequence on one device
of the cluster file `tessera calibrate --device cuda` wrote in the same run. The bound is the
issue's: within 10%.

    python3 scripts/gpu_cost_check.py CHECKS_JSONL GPU_JSON   # TESSERA_CLI=target/release/tessera

Prints one JSON line per row and a summary; exits 1 when a row misses the bound.
"""
import json, os, subprocess, sys

CLI = os.environ.get("TESSERA_CLI", "target/release/tessera")
BOUND = 0.10


def main():
    checks, cluster = sys.argv[1], sys.argv[2]
    rows = [json.loads(l) for l in open(checks) if l.startswith("{")]
    rows = [r for r in rows if r.get("check") == "speed"]
    fails = []
    for r in rows:
        cmd = [CLI, "plan", "--model", r["model"], "--cluster", cluster, "--batch", str(r["batch"]),
               "--seq", str(r["seq"]), "--dtype", "bf16", "--plan", "dp1", "--format", "json"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            fails.append(f"{r['model']} {r['batch']}x{r['seq']}: {p.stderr[-300:]}")
            print(json.dumps({"check": "cost", "model": r["model"], "ok": False,
                              "error": p.stderr[-1000:]}), flush=True)
            continue
        pred = json.loads(p.stdout)["predicted"]
        measured = r["step_s"]
        err = pred["step_time_s"] / measured - 1.0
        ok = abs(err) <= BOUND
        print(json.dumps({
            "check": "cost", "model": r["model"], "batch": r["batch"], "seq": r["seq"],
            "predicted_step_s": round(pred["step_time_s"], 5), "measured_step_s": measured,
            "error": round(err, 4), "issue_wait_s": pred.get("issue_wait_s"),
            "predicted_by_op_s": {k: round(v, 5) for k, v in
                                  sorted(pred["compute_by_op_s"].items(), key=lambda kv: -kv[1])[:8]},
            "measured_gpu_busy_s": r.get("gpu_busy_s"), "ok": ok}), flush=True)
        if not ok:
            fails.append(f"{r['model']} {r['batch']}x{r['seq']}: {err:+.1%}")
    if not rows:
        fails.append("no speed rows in " + checks)
    print(json.dumps({"check": "cost_summary", "ok": not fails, "failures": fails}), flush=True)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
