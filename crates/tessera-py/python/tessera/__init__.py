"""Tessera from Python: profile and plan a model as the ``tessera`` command does.

``profile`` and ``plan`` return the objects ``tessera profile|plan --format json`` prints (the
dict ``json.loads`` makes of it), computed by the command's own code: keyword arguments are its
flags (``memory_budget="50MiB"`` is ``--memory-budget 50MiB``, ``explain=True`` the bare
``--explain``, a list repeats a flag, ``None`` and ``False`` leave it out), so defaults and checks
are the CLI's. A failure raises ``TesseraError`` (a ``ValueError``) with the CLI's message; its
``.error`` is the error object ``--format json`` prints.

``from_torch`` exports a PyTorch module to ONNX for ``model=``.
"""

import os
import tempfile

from ._native import TesseraError
from ._native import report as _report

__all__ = ["TesseraError", "from_torch", "plan", "profile"]


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
                argv += [flag, os.fspath(item) if isinstance(item, os.PathLike) else str(item)]
        else:
            argv += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return argv


def profile(model, batch=None, seq=None, dtype=None, **flags):
    """``tessera profile --model MODEL ... --format json`` as a dict.

    ``model``: a preset (``"gpt2"``, ``"llama2-7b"``), a Hugging Face ``config.json`` or its
    directory, or an ``.onnx`` file. ``None`` means the CLI's default (batch 8, fp32, the
    sequence length the model allows up to 1024). Other flags: ``timeline``, ``timeline_svg``,
    ``inference``, ``new_tokens``, ``quantize``.
    """
    return _report(_argv("profile", dict(model=model, batch=batch, seq=seq, dtype=dtype, **flags)))


def plan(model, cluster=None, batch=None, seq=None, **flags):
    """``tessera plan --model MODEL --cluster CLUSTER ... --format json`` as a dict.

    ``cluster``: ``"8xH100"``, ``"2x8xH200"``, ``"4xcpu"`` or a cluster file. ``None`` means the
    CLI's default (8xH100, batch 8, bf16). Other flags, e.g. ``dtype``, ``memory_budget``,
    ``reserve``, ``plan`` (``"auto"``, ``"dp2 tp4 zero1"`` or a plan file), ``baseline``
    (a list), ``out``, ``inference``, ``objective``.
    """
    return _report(
        _argv("plan", dict(model=model, cluster=cluster, batch=batch, seq=seq, **flags))
    )


def from_torch(module, example_inputs, path=None):
    """Exports ``module`` to ONNX and returns the file's path, for ``model=``.

    ``example_inputs``: a tensor or a tuple of tensors, as ``torch.onnx.export`` takes them. An
    integer tensor ``[batch, sequence]`` is ``input_ids`` (both axes dynamic, so ``batch=`` and
    ``seq=`` bind them); a floating one is ``pixel_values`` (batch dynamic). The output is
    ``logits``. The export is the one the importer is tested on: the TorchScript exporter
    (``dynamo=False``), opset 17, no constant folding (initialisers keep PyTorch's parameter
    names), in eval mode. ``path``: default a fresh temporary directory's ``model.onnx``.
    """
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "tessera.from_torch exports through torch.onnx, and torch is not installed: "
            "pip install torch onnx, or export the model yourself and pass the .onnx file as "
            "model="
        ) from e
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="tessera-"), "model.onnx")
    path = os.fspath(path)
    if inputs and torch.is_floating_point(inputs[0]):
        input_name, axes = "pixel_values", {0: "batch"}
    else:
        input_name, axes = "input_ids", {0: "batch", 1: "sequence"}
    training = module.training
    module.eval()
    try:
        torch.onnx.export(
            module,
            inputs,
            path,
            export_params=True,
            opset_version=17,
            do_constant_folding=False,
            dynamo=False,
            input_names=[input_name],
            output_names=["logits"],
            dynamic_axes={input_name: axes, "logits": axes},
        )
    finally:
        module.train(training)
    return path
