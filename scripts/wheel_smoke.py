#!/usr/bin/env python3
"""Checks the installed `tessera` wheel against the `tessera` binary (scripts/check-wheel.sh).

usage: wheel_smoke.py TESSERA_BINARY [GPT2_ONNX_FIXTURE]
       wheel_smoke.py --sigint-child DATA_DIR SAVE_DIR   (the Ctrl-C check's training loop)

Through `import tessera`: profiles gpt2-tiny and plans llama-tiny on 2xH100, each dict equal to
`json.loads` of the binary's `--format json` output for the same flags (timings, the keys ending
in `_ms`, aside; floats to 1e-12 relative); a bad model name raises tessera.TesseraError with the binary's `error:` line;
an ONNX file (the GPT-2 fixture, when given and present) profiles like a preset; from_torch
either exports (torch installed) or says how to get torch.

Training, evaluation and generation (wheel_train.py): gpt2-tiny trained from a Python
generator of batches — windows of a token file drawn here by the CLI's documented sampling
(splitmix64 counters), as lists, numpy arrays or `__array__` objects — gives the per-step
losses of `tessera train --data` on that file, bit for bit (two simulated devices); eval and
generate return the binary's JSON; a bad flag raises the CLI's message; Ctrl-C sent to a
Python training loop ends it with its last checkpoint intact, equal to the CLI's run stopped
after the same step; a Trainer steps, evaluates and saves. Prints PASS at the end.
"""

import json
import os
import subprocess
import sys

if sys.argv[1] == "--sigint-child":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import wheel_train

    wheel_train.sigint_child(sys.argv[2], sys.argv[3])
    sys.exit(0)

import tessera

binary = sys.argv[1]
fixture = sys.argv[2] if len(sys.argv) > 2 else None


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if not k.endswith("_ms")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def equal(a, b):
    """JSON values equal, floats to 1e-12 relative (a sum of per-op times can round differently
    in its last place from one run to another, the plan unchanged)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= 1e-12 * max(abs(a), abs(b))
    return a == b


def cli(*args):
    run = subprocess.run([binary, *args, "--format", "json"], capture_output=True, text=True)
    return run.returncode, json.loads(run.stdout), run.stderr


def same(name, got, *args):
    code, want, stderr = cli(*args)
    assert code == 0, f"{name}: the binary failed: {stderr}"
    assert isinstance(got, dict), f"{name}: {type(got)}"
    got, want = without_timings(got), without_timings(want)
    if not equal(got, want):
        diff = [k for k in set(got) | set(want) if not equal(got.get(k), want.get(k))]
        raise AssertionError(f"{name}: the package's dict differs from the CLI's JSON at {diff}")
    print(f"ok   {name}: equal to `tessera {' '.join(args)} --format json`")


print(f"tessera from {os.path.dirname(tessera.__file__)}")

p = tessera.profile("gpt2-tiny", batch=2, seq=64)
same("profile gpt2-tiny", p, "profile", "--model", "gpt2-tiny", "--batch", "2", "--seq", "64")
assert p["model"] == "gpt2-tiny" and p["seq"] == 64 and p["memory"]["peak_bytes"] > 0, p
print(f"     {p['params']} parameters, {p['flops']['total']} FLOPs, peak {p['memory']['peak_bytes']} B")

q = tessera.plan("llama-tiny", cluster="2xH100", batch=8, seq=128)
same("plan llama-tiny", q, "plan", "--model", "llama-tiny", "--cluster", "2xH100",
     "--batch", "8", "--seq", "128")
peak = max(q["predicted"]["peak_bytes_per_device"])  # one per device
assert isinstance(q["config"], str) and peak > 0, q
print(f"     plan `{q['config']}`, {q['predicted']['step_time_s']:.4f} s/step, peak {peak} B/device")

q = tessera.plan("gpt2-tiny", cluster="2xcpu", batch=4, seq=32, plan="dp2 zero1",
                 memory_budget="1GiB", baseline=["megatron"])
same("plan gpt2-tiny with flags", q, "plan", "--model", "gpt2-tiny", "--cluster", "2xcpu",
     "--batch", "4", "--seq", "32", "--plan", "dp2 zero1", "--memory-budget", "1GiB",
     "--baseline", "megatron")

try:
    tessera.profile("gpt9")
    raise AssertionError("a bad model name should raise tessera.TesseraError")
except tessera.TesseraError as e:
    code, want, stderr = cli("profile", "--model", "gpt9")
    assert code != 0 and stderr == f"error: {e}\n", (str(e), stderr)
    assert e.error == want["error"], (e.error, want)
    assert isinstance(e, ValueError)
    print(f"ok   bad model: TesseraError({str(e)[:60]!r}...), the CLI's message")

try:
    tessera.plan("gpt2-tiny", cluster="2xcpu", seq=64, memory_budget="1KiB")
    raise AssertionError("a 1 KiB budget should raise tessera.TesseraError")
except tessera.TesseraError as e:
    assert e.error["kind"] == "infeasible" and e.error["needed_bytes"] > 1024, e.error
    print(f"ok   infeasible budget: .error kind {e.error['kind']}, needs {e.error['needed_bytes']} B")
try:
    tessera.profile("gpt2-tiny", dtype="fp64")
    raise AssertionError("--dtype fp64 should raise tessera.TesseraError")
except tessera.TesseraError as e:
    assert e.error["kind"] == "usage" and "fp64" in str(e), (e.error, str(e))
    print("ok   bad flag value: clap's message, .error kind usage")

if fixture and os.path.exists(fixture):
    p = tessera.profile(fixture, batch=2, seq=8)
    same("profile ONNX fixture", p, "profile", "--model", fixture, "--batch", "2", "--seq", "8")
else:
    print("skip profile of the ONNX fixture (not found)")

try:
    import torch
except ImportError:
    torch = None
if torch is None:
    try:
        tessera.from_torch(object(), ())
        raise AssertionError("from_torch without torch should raise ImportError")
    except ImportError as e:
        assert "torch" in str(e), e
        print("ok   from_torch without torch: ImportError naming the fix")
    # The export call itself, against a stand-in for torch that records it.
    import types

    calls = []
    stub = types.ModuleType("torch")
    stub.is_floating_point = lambda t: t == "floats"
    stub.onnx = types.SimpleNamespace(export=lambda *a, **k: calls.append((a, k)))
    stub.export = types.SimpleNamespace(Dim=lambda name: f"Dim({name})")

    class Module:
        training = True

        def eval(self):
            self.training = False

        def train(self, mode):
            self.training = mode

    sys.modules["torch"] = stub
    try:
        module = Module()
        path = tessera.from_torch(module, "ids")
        (m, inputs, where), kw = calls[-1]
        assert m is module and inputs == ("ids",) and where == path and path.endswith(".onnx")
        # Current torch's default exporter (dynamo): no opset, dynamo or folding overrides.
        assert not {"opset_version", "dynamo", "do_constant_folding"} & set(kw), kw
        assert kw["output_names"] == ["logits"] and kw["input_names"] == ["input_ids"], kw
        assert kw["dynamic_shapes"] == ({0: "Dim(batch)", 1: "Dim(sequence)"},), kw
        assert module.training, "from_torch should restore the module's mode"
        tessera.from_torch(module, ("floats",), "x.onnx")
        assert calls[-1][1]["input_names"] == ["pixel_values"], calls[-1]
    finally:
        del sys.modules["torch"]
    print("ok   from_torch's torch.onnx.export call (the default dynamo exporter, dynamic shapes)")
else:
    import tempfile

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 16)
            self.head = torch.nn.Linear(16, 64)

        def forward(self, input_ids):
            return self.head(self.embed(input_ids))

    path = tessera.from_torch(Tiny(), torch.zeros(2, 8, dtype=torch.long),
                              os.path.join(tempfile.mkdtemp(), "tiny.onnx"))
    p = tessera.profile(path, batch=2, seq=8)
    print(f"ok   from_torch: {path} profiles ({p['params']} parameters)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wheel_train

wheel_train.check(binary, os.path.abspath(__file__))

print("PASS: the tessera wheel installs offline; profiles, plans, trains, evaluates and "
      "generates like the CLI")
