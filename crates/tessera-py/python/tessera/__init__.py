"""Tessera from Python: profile, plan, train, evaluate and generate as the ``tessera`` command does.

Every function runs the command's own code (no second implementation): keyword arguments are
its flags (``memory_budget="50MiB"`` is ``--memory-budget 50MiB``, ``explain=True`` the bare
``--explain``, a list repeats a flag, ``None`` and ``False`` leave it out), so defaults and checks
are the CLI's, and the result is the object ``tessera ... --format json`` prints (the dict
``json.loads`` makes of it). A failure raises ``TesseraError`` (a ``ValueError``) with the CLI's
message; its ``.error`` is the error object ``--format json`` prints.

- ``profile``, ``plan``: the symbolic profile and the parallel plan.
- ``train``: a training run; ``data=`` a path (``--data``) or any iterable of dicts of arrays
  (``input_ids``, ``labels``, ``pixel_values``: numpy arrays, lists, or anything with
  ``__array__``, such as a torch DataLoader's tensors), pulled one batch per step. Progress
  goes to ``callback=`` (``callback(event, value)``) or is printed. Ctrl-C ends the run at the
  next step boundary, saving if ``save=`` was given, then raises ``KeyboardInterrupt``.
- ``Trainer``: a run a step at a time (``step()``, ``evaluate()``, ``save()``, ``close()``).
- ``eval``, ``generate``, ``generate_stream``: a checkpoint's loss; generated text and tokens.

``from_torch`` exports a PyTorch module to ONNX for ``model=``.
"""

import os
import sys
import tempfile
import time

from ._native import Run as _Run
from ._native import TesseraError
from ._native import report as _report

__all__ = [
    "Report",
    "TesseraError",
    "Trainer",
    "eval",
    "from_torch",
    "generate",
    "generate_stream",
    "plan",
    "profile",
    "train",
]


def _value(value):
    return os.fspath(value) if isinstance(value, os.PathLike) else str(value)


def _argv(command, flags):
    """The command line (after ``tessera``) for ``command`` with keyword arguments ``flags``."""
    if "format" in flags:
        raise TypeError("format: tessera returns the --format json report as Python objects")
    argv = [command]
    for key, value in flags.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, _value(item)]
        else:
            argv += [flag, _value(value)]
    return argv


def _ids(tokens):
    """Token ids as the CLI's comma-separated list (a string passes as it is)."""
    if isinstance(tokens, str) or tokens is None:
        return tokens
    if hasattr(tokens, "__array__"):
        tokens = tokens.__array__().reshape(-1).tolist()
    return ",".join(str(int(t)) for t in tokens)


class Report(dict):
    """A command's report (the dict ``--format json`` prints) that renders in Jupyter: the
    memory breakdown table and the command's own pictures (a plan's memory timeline and
    pipeline schedule; a training run's loss curve)."""

    def __init__(self, doc, html_pictures=None):
        super().__init__(doc)
        self._pictures = html_pictures

    def _repr_html_(self):
        return _html(self, self._pictures() if self._pictures else [])


def _html_table(rows):
    cells = "".join(
        f"<tr><th style='text-align:left'>{k}</th><td style='text-align:right'>{v}</td></tr>"
        for k, v in rows
    )
    return f"<table>{cells}</table>"


def _bytes(n):
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def _html(doc, svgs):
    parts = []
    if "predicted" in doc and isinstance(doc.get("predicted"), dict):  # a plan
        p = doc["predicted"]
        parts.append(
            f"<b>{doc.get('model', '')}</b> · plan <code>{doc.get('config', '')}</code> · "
            f"{p.get('step_time_s', 0):.4f} s/step · {p.get('tokens_per_s', 0):.0f} tokens/s"
        )
        rows = [(k, _bytes(p.get(k))) for k in
                ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")]
        rows += [(f"peak: {k}", _bytes(v)) for k, v in p.get("peak_breakdown", {}).items()]
        rows += [(f"peak, device {d}", _bytes(b))
                 for d, b in enumerate(p.get("peak_bytes_per_device", []))]
        parts.append(_html_table(rows))
    elif "memory" in doc and "final_loss" in doc:  # a training run
        parts.append(
            f"<b>{doc.get('model', '')}</b> · plan <code>{doc.get('config', '')}</code> · "
            f"{doc.get('steps')} steps · loss {doc.get('initial_loss', 0):.4f} → "
            f"{doc.get('final_loss', 0):.4f} · {doc.get('tokens_per_s', 0):.0f} tokens/s"
        )
        m = doc["memory"]
        rows = [(f"device {d}: peak predicted / measured",
                 f"{_bytes(pr)} / {_bytes(me)}")
                for d, (pr, me) in enumerate(zip(m.get("predicted_peak_bytes", []),
                                                 m.get("measured_peak_bytes", [])))]
        parts.append(_html_table(rows))
    elif "memory" in doc and isinstance(doc["memory"], dict):  # a profile
        rows = [(k, _bytes(v)) for k, v in doc["memory"].items() if isinstance(v, int)]
        parts.append(f"<b>{doc.get('model', '')}</b>")
        parts.append(_html_table(rows))
    parts += svgs
    return "<div>" + "".join(parts) + "</div>"


def _read_svgs(paths):
    out = []
    for path in paths:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                out.append(f.read())
    return out


def profile(model, batch=None, seq=None, dtype=None, **flags):
    """``tessera profile --model MODEL ... --format json`` as a dict.

    ``model``: a preset (``"gpt2"``, ``"llama2-7b"``), a Hugging Face ``config.json`` or its
    directory, or an ``.onnx`` file. ``None`` means the CLI's default (batch 8, fp32, the
    sequence length the model allows up to 1024). Other flags: ``timeline``, ``timeline_svg``,
    ``inference``, ``new_tokens``, ``quantize``.
    """
    flags = dict(model=model, batch=batch, seq=seq, dtype=dtype, **flags)
    return Report(_report(_argv("profile", flags)))


def plan(model, cluster=None, batch=None, seq=None, **flags):
    """``tessera plan --model MODEL --cluster CLUSTER ... --format json`` as a dict.

    ``cluster``: ``"8xH100"``, ``"2x8xH200"``, ``"4xcpu"`` or a cluster file. ``None`` means the
    CLI's default (8xH100, batch 8, bf16). Other flags, e.g. ``dtype``, ``memory_budget``,
    ``reserve``, ``plan`` (``"auto"``, ``"dp2 tp4 zero1"`` or a plan file), ``baseline``
    (a list), ``out``, ``inference``, ``objective``. In Jupyter the plan shows its memory
    breakdown and the CLI's pictures (``memory_svg``, ``schedule_svg``, drawn on display).
    """
    flags = dict(model=model, cluster=cluster, batch=batch, seq=seq, **flags)
    doc = _report(_argv("plan", flags))

    def pictures():
        # The same command again (the planner is deterministic), drawing its pictures.
        d = tempfile.mkdtemp(prefix="tessera-")
        paths = [os.path.join(d, "memory.svg")]
        more = dict(flags, memory_svg=paths[0], out=None)
        if doc.get("pipeline") or doc.get("predicted", {}).get("bubble_fraction") is not None:
            paths.append(os.path.join(d, "schedule.svg"))
            more["schedule_svg"] = paths[1]
        try:
            _report(_argv("plan", more))
        except TesseraError as e:
            return [f"<p>(no picture: {e})</p>"]
        return _read_svgs(paths)

    return Report(doc, None if flags.get("inference") else pictures)


def _field(name, value):
    """One batch field as ``(name, kind, shape, bytes)`` for the native module: kind ``"i"``
    (int64) or ``"f"`` (float32), little-endian, C order."""
    if hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        try:
            arr = value.__array__()
        except Exception as e:  # a GPU tensor, say
            raise TypeError(
                f"data: field `{name}`: its __array__() failed ({e}); give host arrays "
                "(a torch tensor on a GPU: .cpu())"
            ) from e
        kind = arr.dtype.kind
        if kind not in "biuf":
            raise TypeError(f"data: field `{name}` holds {arr.dtype}, not numbers")
        kind = "f" if kind == "f" else "i"
        arr = arr.astype("<f4" if kind == "f" else "<i8", order="C", copy=False)
        return (name, kind, [int(d) for d in arr.shape], arr.tobytes(order="C"))
    import array

    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"data: field `{name}` is a {type(value).__name__}; give a numpy array, a list or "
            "an object with __array__"
        )
    shape, flat = [], [value]
    while flat and isinstance(flat[0], (list, tuple)):
        n = len(flat[0])
        if any(not isinstance(row, (list, tuple)) or len(row) != n for row in flat):
            raise TypeError(f"data: field `{name}`: its rows differ in length")
        shape.append(n)
        flat = [x for row in flat for x in row]
    floats = any(isinstance(x, float) for x in flat)
    packed = array.array("f" if floats else "q", flat)
    if sys.byteorder != "little":
        packed.byteswap()
    return (name, "f" if floats else "i", shape, packed.tobytes())


def _fields(batch):
    if not hasattr(batch, "items"):
        raise TypeError(
            f"data: each batch must be a dict of arrays (input_ids, labels, ...), not a "
            f"{type(batch).__name__}"
        )
    return [_field(str(k), v) for k, v in batch.items()]


class _Progress:
    """The default progress: a line on stdout every couple of seconds, and the last step's."""

    def __init__(self):
        self.last = None

    def __call__(self, event, value):
        if event == "eval":
            print(f"eval | loss {value['loss']:.4f}" if value else "eval", flush=True)
        if event != "step":
            return
        now = time.monotonic()
        if self.last is None or now - self.last >= 2.0 or value["step"] == value["last_step"]:
            self.last = now
            print(
                f"step {value['step']}/{value['last_step']} | loss {value['loss']:.4f} | "
                f"{value['tokens_per_s']:.0f} tok/s",
                flush=True,
            )


def _train_flags(data, flags):
    """The command line of a training run, and the Python iterable of its batches (if any)."""
    if data is None or isinstance(data, (str, os.PathLike)):
        return _argv("train", dict(flags, data=data)), None
    if not hasattr(data, "__iter__"):
        raise TypeError("data: give a path (--data) or an iterable of dicts of arrays")
    return _argv("train", flags), data


def train(data=None, callback=None, **flags):
    """``tessera train ... --format json`` as a dict: keyword arguments are the flags
    (``model=``, ``plan=``, ``devices=``, ``steps=``, ``batch=``, ``seq=``, ``save=``, ...).

    ``data``: a path (the CLI's ``--data``) or an iterable of dicts of arrays, one global batch
    per step (``input_ids`` and ``labels`` ``[batch, seq]``; ``labels`` -100 is ignored), pulled
    as the run needs them; when it runs out the run ends there. ``callback(event, value)``:
    ``"step"`` events (step, loss, grad_norm, lr, tokens_per_s, peak_bytes) and ``"eval"``;
    without it progress is printed. Ctrl-C (``KeyboardInterrupt``) ends the run at the next
    step boundary, saving to ``save=`` if given, then raises. In Jupyter the report shows the
    memory predicted against measured and the loss curve.
    """
    argv, source = _train_flags(data, flags)
    plot = None
    if "plot" not in flags:
        plot = os.path.join(tempfile.mkdtemp(prefix="tessera-"), "loss.svg")
        argv += ["--plot", plot]
    run = _Run(argv, source is not None, source is not None)
    doc = _drive(run, iter(source) if source is not None else None, callback or _Progress())
    path = plot or flags.get("plot")
    return Report(doc, (lambda: _read_svgs([os.fspath(path)])) if path else None)


def _drive(run, batches, callback, until=None):
    """Runs ``run`` to its end (or, with ``until``, to the first message ``until`` accepts,
    returned): answers its questions from ``batches`` (``None``: the run's own data set),
    passes its events to ``callback``. Ctrl-C, or an exception from the data or the callback,
    stops the run at a step boundary (it saves if it saves) and is raised once it has ended."""
    raised = None
    while True:
        try:
            if run.asking:
                # A question left open by an interruption: the run stops.
                run.answer("stop")
            msg = run.wait()
            if msg[0] == "done":
                if raised is not None:
                    raise raised
                return msg if until is not None else msg[1]
            if until is not None and raised is None and until(msg):
                return msg
            if msg[0] == "event":
                if raised is None:
                    callback(msg[1], msg[2])
            elif msg[0] == "ask":
                if raised is not None:
                    run.answer("stop")
                elif batches is None:
                    run.answer("data")
                else:
                    try:
                        batch = next(batches)
                    except StopIteration:
                        run.answer("stop")
                        continue
                    run.answer(("batch", _fields(batch)))
        except BaseException as e:  # KeyboardInterrupt included: stop, then raise it
            if run.finished:
                if raised is not None and raised is not e:
                    raise raised from e
                raise
            if raised is None:
                raised = e
            run.stop()


class Trainer:
    """A training run driven a step at a time, for notebooks: ``Trainer(**flags)`` plans and
    sets up the run (the flags of ``train``; ``data=`` a path or an iterable of batches,
    default the CLI's data set); ``step(batch=None)`` trains one step (on ``batch``, else the
    next of ``data``) and returns its stats; ``evaluate(batches=None)`` the loss on
    ``batches`` (default: the held-out split of the run's data set); ``save()`` writes a
    checkpoint to ``save=``; ``close()`` ends the run (saving if ``save=``) and returns the
    report ``train`` returns.
    """

    def __init__(self, data=None, **flags):
        argv, source = _train_flags(data, flags)
        self._flags = flags
        self._data = iter(source) if source is not None else None
        self._own_data = source is None
        self._run = _Run(argv, True, source is not None)
        self._report = None
        self._msg = self._next()

    def _next(self):
        msg = _drive(self._run, None, lambda e, v: None, until=lambda m: m[0] in ("ask", "done"))
        if msg[0] == "done":
            self._report = Report(msg[1])
        return msg

    def _await(self, kind):
        """Waits for the event ``kind`` and the run's next question; the event's value."""
        got = []

        def until(m):
            if m[0] == "event" and m[1] == kind:
                got.append(m[2])
            return m[0] in ("ask", "done")

        self._msg = _drive(self._run, None, lambda e, v: None, until=until)
        if self._msg[0] == "done":
            self._report = Report(self._msg[1])
        return got[0] if got else None

    def _check(self):
        if self._report is not None:
            raise TesseraError(
                f"the run is over (step {self._report.get('last_step')} of "
                f"{self._report.get('total_steps')}): start a new Trainer"
            )

    def step(self, batch=None):
        """Trains one step; its stats (step, loss, grad_norm, lr, tokens_per_s, peak_bytes)."""
        self._check()
        if batch is None and self._data is not None:
            batch = next(self._data)
        self._run.answer("data" if batch is None else ("batch", _fields(batch)))
        return self._await("step")

    def evaluate(self, batches=None):
        """The mean loss (and accuracy) over ``batches`` (a list of batches), or over the
        held-out split of the run's own data set."""
        self._check()
        if batches is None:
            self._run.answer("evaluate")
        else:
            self._run.answer(("evaluate", [_fields(b) for b in batches]))
        return self._await("eval")

    def save(self):
        """Saves a checkpoint to ``save=`` now; its path."""
        self._check()
        if not self._flags.get("save"):
            raise TesseraError("save(): give the Trainer save=DIR")
        self._run.answer("save")
        self._await(None)
        return os.fspath(self._flags["save"])

    def close(self):
        """Ends the run (saving if ``save=``); the report ``train`` returns."""
        if self._report is None:
            self._run.answer("stop")
            self._next()
        return self._report


def eval(model_dir, tokens=None, **flags):
    """``tessera eval --model-dir DIR --tokens IDS --format json`` as a dict (loss, accuracy).
    ``tokens``: a list of ids (or the CLI's comma-separated string)."""
    return _report(_argv("eval", dict(model_dir=model_dir, tokens=_ids(tokens), **flags)))


def _generate_flags(model_dir, prompt, tokens, flags):
    if tokens is not None and not isinstance(tokens, str):
        rows = list(tokens)
        nested = rows and isinstance(rows[0], (list, tuple)) or hasattr(rows[0], "__len__")
        tokens = [_ids(r) for r in rows] if nested else _ids(rows)
    return _argv("generate", dict(model_dir=model_dir, prompt=prompt, tokens=tokens, **flags))


def generate(model_dir, prompt=None, tokens=None, **flags):
    """``tessera generate --model-dir DIR ... --format json`` as a dict: ``text`` and
    ``new_tokens`` (for several prompts, a list of each), with the timings and memory.
    ``prompt``: text (a list for a batch); ``tokens``: ids instead (a list, or a list of lists).
    Other flags: ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``eos``,
    ``devices``, ``plan``, ``quantize``, ``dtype``."""
    return _report(_generate_flags(model_dir, prompt, tokens, flags))


def generate_stream(model_dir, prompt=None, tokens=None, **flags):
    """``generate`` as an iterator: one dict per new token as it is chosen (``step``,
    ``tokens``: one id per prompt, ``text``: what it adds to a single prompt's text with a
    tokenizer, else None); the report ``generate`` returns is the iterator's return value
    (``StopIteration.value``). Ctrl-C or closing the iterator early lets the generation finish
    in the background and stops waiting for it."""
    run = _Run(_generate_flags(model_dir, prompt, tokens, flags))
    while True:
        msg = run.wait()
        if msg[0] == "done":
            return Report(msg[1])
        if msg[0] == "event" and msg[1] == "token":
            yield msg[2]


def from_torch(module, example_inputs, path=None):
    """Exports ``module`` to ONNX and returns the file's path, for ``model=``.

    ``example_inputs``: a tensor or a tuple of tensors, as ``torch.onnx.export`` takes them. An
    integer tensor ``[batch, sequence]`` is ``input_ids`` (both axes dynamic, so ``batch=`` and
    ``seq=`` bind them); a floating one is ``pixel_values`` (batch dynamic). The output is
    ``logits``. The export is what current PyTorch does by default: ``torch.onnx.export``'s
    dynamo exporter (opset 18 and later, its optimizer on, the weights in ``model.onnx.data``
    beside the file), in eval mode, with ``dynamic_shapes`` naming the batch (and sequence)
    axes. ``path``: default a fresh temporary directory's ``model.onnx``.
    """
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "tessera.from_torch exports through torch.onnx, and torch is not installed: "
            "pip install torch onnx onnxscript, or export the model yourself and pass the "
            ".onnx file as model="
        ) from e
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="tessera-"), "model.onnx")
    path = os.fspath(path)
    dim = torch.export.Dim
    if inputs and torch.is_floating_point(inputs[0]):
        input_name, axes = "pixel_values", {0: dim("batch")}
    else:
        input_name, axes = "input_ids", {0: dim("batch"), 1: dim("sequence")}
    training = module.training
    module.eval()
    try:
        torch.onnx.export(
            module,
            inputs,
            path,
            input_names=[input_name],
            output_names=["logits"],
            dynamic_shapes=(axes,) + (None,) * (len(inputs) - 1),
        )
    finally:
        module.train(training)
    return path
