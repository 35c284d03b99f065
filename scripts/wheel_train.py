"""Training, evaluation and generation through the installed `tessera` wheel, checked against
the `tessera` binary (imported by scripts/wheel_smoke.py; see its docstring).

The batches a Python generator feeds `tessera.train` are drawn here, independently of the
package: the windows `tessera train --data DIR` takes from DIR/train.bin (its documented
sampling: row r of step s starts at Lemire's multiply-high of splitmix64 counters keyed by the
seed, the step and the row), so the two runs see the same tokens and must give the same
losses, bit for bit.
"""

import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time

import tessera

MASK = (1 << 64) - 1
SEED = 1337  # `tessera train`'s default --seed
# A small GPT-2 (two layers, 64 wide) for the checkpoints: saves stay quick in a debug build.
SMALL = {"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 64,
         "n_layer": 2, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
         "layer_norm_epsilon": 1e-5}


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def windows(tokens, batch, seq, step, seed=SEED):
    """Step `step`'s global batch of a token stream, as `tessera train` draws it."""
    starts = len(tokens) - seq
    rows = []
    for row in range(batch):
        key = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ row)
        rows.append((key * starts) >> 64)
    return ([tokens[o:o + seq] for o in rows], [tokens[o + 1:o + seq + 1] for o in rows])


class Array:
    """Something with `__array__` that is not a numpy array (a torch tensor's stand-in); without
    numpy, its `__array__` gives a stand-in for the ndarray (the members the package uses)."""

    def __init__(self, value):
        self.value = value

    def __array__(self, dtype=None, copy=None):
        if have_numpy():
            import numpy

            return numpy.asarray(self.value)
        return FakeNd(self.value)


class FakeNd:
    """An int32 ndarray's stand-in: dtype.kind, shape, astype, tobytes."""

    class dtype:
        kind = "i"

    def __init__(self, rows, fmt="<i"):
        self.rows, self.fmt = rows, fmt
        self.shape = (len(rows), len(rows[0]))

    def astype(self, dtype, order="K", copy=True):
        assert dtype in ("<i8", "<f4") and order == "C", (dtype, order)
        return FakeNd(self.rows, "<q" if dtype == "<i8" else "<f")

    def tobytes(self, order="C"):
        flat = [x for row in self.rows for x in row]
        return struct.pack(f"{self.fmt[0]}{len(flat)}{self.fmt[1]}", *flat)


def have_numpy():
    try:
        import numpy  # noqa: F401

        return True
    except ImportError:
        return False


def batches(tokens, batch, seq, first=1, form="list"):
    """The run's batches from step `first` on, as lists, numpy arrays or `__array__` objects."""
    step = first
    while True:
        x, y = windows(tokens, batch, seq, step)
        if form == "numpy":
            import numpy

            x, y = numpy.array(x, dtype=numpy.int32), numpy.array(y, dtype=numpy.int64)
        elif form == "array":
            x, y = Array(x), Array(y)
        yield {"input_ids": x, "labels": y}
        step += 1


def make_data(root):
    """DIR with train.bin and val.bin (u16 tokens) and a small GPT-2's config.json."""
    rng = random.Random(7)
    tokens = [rng.randrange(256) for _ in range(3000)]
    data = os.path.join(root, "data")
    os.makedirs(data)
    with open(os.path.join(data, "train.bin"), "wb") as f:
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))
    with open(os.path.join(data, "val.bin"), "wb") as f:
        f.write(struct.pack("<400H", *[rng.randrange(256) for _ in range(400)]))
    config = os.path.join(root, "small.json")
    with open(config, "w") as f:
        json.dump(SMALL, f)
    return data, config, tokens


def cli(binary, *args):
    run = subprocess.run([binary, *args, "--format", "json"], capture_output=True, text=True)
    assert run.returncode == 0, f"tessera {' '.join(args)}: {run.stderr}"
    return json.loads(run.stdout)


def cli_losses(binary, *args):
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "log.jsonl")
        report = cli(binary, "train", *args, "--log-json", log)
        with open(log) as f:
            return [json.loads(line)["loss"] for line in f], report


def sigint_child(data, save):
    """The Ctrl-C check's Python training loop: trains the small GPT-2 from a generator,
    saving every step, printing each step; the parent interrupts it."""
    # Python raises KeyboardInterrupt on SIGINT only if SIGINT was not ignored when it
    # started; a child of a background job (`cmd &` in a script, nohup) inherits SIG_IGN.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(os.path.join(data, "train.bin"), "rb") as f:
        raw = f.read()
    tokens = list(struct.unpack(f"<{len(raw) // 2}H", raw))
    config = os.path.join(os.path.dirname(data), "small.json")
    try:
        tessera.train(data=batches(tokens, 2, 16), model=config, devices=1, steps=500,
                      batch=2, seq=16, eval_batches=0, save=save, save_every=1,
                      callback=lambda e, v: print(f"step {v['step']}", flush=True))
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise
    print("finished without an interruption", flush=True)


def check(binary, smoke):
    root = tempfile.mkdtemp(prefix="tessera-train-")
    data, config, tokens = make_data(root)
    t0 = time.monotonic()

    # Same tokens, same losses: two simulated devices (dp2), three steps.
    common = ["--model", "gpt2-tiny", "--devices", "2", "--plan", "dp2", "--steps", "3",
              "--batch", "2", "--seq", "16", "--eval-batches", "0"]
    want, want_report = cli_losses(binary, *common, "--data", data)
    forms = ["list", "numpy", "array"] if have_numpy() else ["list", "array"]
    for form in forms:
        got = []
        report = tessera.train(data=batches(tokens, 2, 16, form=form), model="gpt2-tiny",
                               devices=2, plan="dp2", steps=3, batch=2, seq=16, eval_batches=0,
                               callback=lambda e, v: got.append(v["loss"]) if e == "step" else 0)
        assert got == want, f"{form}: Python-fed losses {got} != the CLI's {want}"
        assert report["final_loss"] == want_report["final_loss"], (report, want_report)
        assert report["memory"]["predicted_peak_bytes"] == \
            want_report["memory"]["predicted_peak_bytes"], report["memory"]
        assert "<table>" in report._repr_html_() and "<svg" in report._repr_html_()
    print(f"ok   train from a Python generator ({', '.join(forms)}): losses {want} — the CLI's, "
          "bit for bit")

    # A bad flag, an unknown one, a bad model: the CLI's message and error object.
    for flags in (dict(lr=-1.0), dict(stepz=3), dict(model="gpt9")):
        flags = dict(dict(model="gpt2-tiny", steps=1), **flags)
        try:
            tessera.train(**flags)
            raise AssertionError(f"{flags} should raise tessera.TesseraError")
        except tessera.TesseraError as e:
            run = subprocess.run([binary, *tessera._argv("train", flags), "--format", "json"],
                                 capture_output=True, text=True)
            assert run.returncode != 0 and e.error == json.loads(run.stdout)["error"], \
                (e.error, run.stdout)
            assert str(e) == e.error["message"], (str(e), e.error)
            if e.error["kind"] != "usage":  # clap's usage text is the binary's, not one line
                assert run.stderr == f"error: {e}\n", (str(e), run.stderr)
    print("ok   a bad train flag, an unknown one, a bad model: TesseraError, the CLI's message")

    # Ctrl-C in a Python training loop (another process): it stops at a step boundary, saves,
    # raises KeyboardInterrupt; the checkpoint is the CLI's run stopped after the same step.
    save = os.path.join(root, "py-ckpt")
    child = subprocess.Popen([sys.executable, smoke, "--sigint-child", data, save],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in child.stdout:
        if line.strip() == "step 3":
            child.send_signal(signal.SIGINT)
            break
    out, err = child.communicate(timeout=120)
    assert child.returncode != 0 and "KeyboardInterrupt" in err and "interrupted" in out, \
        (child.returncode, out, err)
    with open(os.path.join(save, "manifest.json")) as f:
        step = json.load(f)["step"]
    assert step >= 3, step
    verify = subprocess.run([binary, "checkpoint", "verify", save], capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stderr
    ref = os.path.join(root, "cli-ckpt")
    cli(binary, "train", "--model", config, "--data", data, "--devices", "1", "--steps", "500",
        "--stop-after", str(step), "--batch", "2", "--seq", "16", "--eval-batches", "0",
        "--save", ref)
    for name in ("model.safetensors", "optimizer.safetensors"):
        with open(os.path.join(save, name), "rb") as a, open(os.path.join(ref, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs from the CLI's after step {step}"
    print(f"ok   Ctrl-C after step {step}: KeyboardInterrupt, checkpoint verified, equal to "
          f"`tessera train --stop-after {step}`'s")

    # eval and generate on that checkpoint: the binary's JSON.
    ids = tokens[:12]
    got = tessera.eval(save, tokens=ids)
    assert got == cli(binary, "eval", "--model-dir", save, "--tokens",
                      ",".join(map(str, ids))), got
    timing = ("time_to_first_token_s", "decode_s", "tokens_per_s", "decode_tokens_per_s")
    got = tessera.generate(save, prompt="To be", max_new_tokens=5)
    want = cli(binary, "generate", "--model-dir", save, "--prompt", "To be",
               "--max-new-tokens", "5")
    for k in timing:
        got.pop(k), want.pop(k)
    assert got == want, (got, want)
    stream = tessera.generate_stream(save, prompt="To be", max_new_tokens=5)
    pieces = list(stream)
    assert [p["tokens"][0] for p in pieces] == want["new_tokens"], (pieces, want)
    assert "".join(p["text"] for p in pieces) == want["text"], (pieces, want)
    got = tessera.generate(save, tokens=[ids[:4], ids[4:8]], max_new_tokens=3)
    assert len(got["new_tokens"]) == 2 and len(got["new_tokens"][0]) == 3, got
    print(f"ok   eval, generate, generate_stream: the CLI's JSON ({want['text']!r})")

    # A Trainer: steps on the caller's batches equal the CLI's, evaluates, saves.
    trainer_save = os.path.join(root, "trainer-ckpt")
    trainer = tessera.Trainer(model=config, data=batches(tokens, 2, 16), devices=1, steps=500,
                              batch=2, seq=16, eval_batches=0, save=trainer_save)
    first = [trainer.step()["loss"] for _ in range(2)]
    want, _ = cli_losses(binary, "--model", config, "--data", data, "--devices", "1",
                         "--steps", "500", "--stop-after", "2", "--batch", "2", "--seq", "16",
                         "--eval-batches", "0")
    assert first == want, (first, want)
    held_out = [next(batches(tokens, 2, 16, first=900))]
    e = trainer.evaluate(held_out)
    assert e["loss"] > 0, e
    assert trainer.save() == trainer_save
    with open(os.path.join(trainer_save, "manifest.json")) as f:
        assert json.load(f)["step"] == 2
    trainer.step()
    report = trainer.close()
    assert report["steps"] == 3 and report["stopped_before_step"] == 4, report
    print(f"ok   Trainer: step() losses the CLI's, evaluate() {e['loss']:.4f}, save(), close()")
    print(f"     (train/eval/generate checks took {time.monotonic() - t0:.1f} s)")
