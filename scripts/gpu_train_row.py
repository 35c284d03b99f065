"""One JSON line of the GPU check from a `tessera train --format json` report: the losses, and
the device's predicted, accountant and caching-allocator peaks, which must be equal (and, for
`train_onnx`, the held-out loss below the first step's). Exits 1 when they are not.

    python3 scripts/gpu_train_row.py CHECK_NAME MODEL REPORT_JSON
"""
import json, sys

check, model, path = sys.argv[1:4]
try:
    d = json.load(open(path))
except (OSError, ValueError) as e:
    print(json.dumps({"check": check, "model": model, "ok": False, "error": str(e)}))
    sys.exit(1)
m = d["memory"]
alloc = m.get("allocator_peak_bytes")
ok = alloc == m["predicted_peak_bytes"] == m["measured_peak_bytes"] and d["device"] == "cuda"
if check == "train_onnx":
    ok = ok and d["eval_loss"] is not None and d["eval_loss"] < d["initial_loss"]
print(json.dumps({"check": check, "model": model, "device": d["device"], "config": d["config"],
                  "initial_loss": d["initial_loss"], "final_loss": d["final_loss"],
                  "eval_loss": d.get("eval_loss"), "tokens_per_s": d.get("tokens_per_s"),
                  "predicted_peak": m["predicted_peak_bytes"], "accountant_peak": m["measured_peak_bytes"],
                  "allocator_peak": alloc, "ok": ok}))
sys.exit(0 if ok else 1)
