#!/usr/bin/env python3
"""Writes the dynamo-exporter ONNX fixtures under crates/tessera-cli/tests/fixtures/onnx-dynamo/.

The same tiny models as scripts/make_onnx_fixtures.py (GPT-2, LLaMA, OPT, ResNet, UNet, ViT:
imported from it, same configs, same weight perturbation, same inputs and losses), exported the
way current PyTorch exports by default:

    torch.onnx.export(model, args, path, dynamic_shapes=...)

i.e. the dynamo exporter (torch.export + onnxscript; opset 18+), its ONNX optimizer on
(constant folding: a Linear weight of at most 8192 elements becomes a transposed copy named
val_N, with `pkg.onnxscript.optimizer.folded_from` naming the parameter in its value_info),
weights as external data (`model.onnx` + `model.onnx.data`). The only argument beyond the
defaults is `dynamic_shapes` (batch, and sequence for the LMs), which Tessera's --batch/--seq
bind; `llama-static/` is the fully default call (static [2, 8]).

Each directory holds model.onnx, model.onnx.data, reference.safetensors (the input, the target,
PyTorch's fp32 logits, loss and grad.<name> for every named_parameters() name) and
reference.json (num_parameters, parameter names and shapes, loss_value, what the graph holds).

Deterministic given the versions in versions.json (written beside): re-running rewrites the
same bytes on the same machine; the nodes' `pkg.torch.onnx.stack_trace` metadata holds this
script's absolute path, so a checkout elsewhere writes other bytes for model.onnx only.

usage: .venv-moe/bin/python scripts/make_onnx_dynamo_fixtures.py   (the reference venv)
"""

import hashlib
import json
import os
import platform
import shutil
import sys
import warnings

import onnx
import onnxruntime as ort
import onnxscript
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_onnx_fixtures as base  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "tessera-cli", "tests", "fixtures", "onnx-dynamo")
MAX_DIR_BYTES = 1 << 20
REF_SHAPE = base.REF_SHAPE
ALT_SHAPE = base.ALT_SHAPE
ORT_TOL = 1e-5


def fresh_dir(name):
    d = os.path.join(OUT, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    return d


def export(model, args, path, dynamic_shapes):
    kw = {} if dynamic_shapes is None else {"dynamic_shapes": dynamic_shapes}
    torch.onnx.export(model, args, path, **kw)


def describe(path, param_names):
    m = onnx.load(path)
    onnx.checker.check_model(m, full_check=True)
    g = m.graph
    counts = {}
    for n in g.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    folded = {}
    for v in g.value_info:
        for p in v.metadata_props:
            if p.key == "pkg.onnxscript.optimizer.folded_from":
                folded[v.name] = p.value

    def value_info(v):
        dims = [d.dim_param if d.HasField("dim_param") else d.dim_value
                for d in v.type.tensor_type.shape.dim]
        return {"name": v.name, "shape": dims,
                "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type)}

    names = [t.name for t in g.initializer]
    return {
        "ir_version": m.ir_version,
        "opset": [{"domain": o.domain, "version": o.version} for o in m.opset_import],
        "producer": f"{m.producer_name} {m.producer_version}",
        "inputs": [value_info(v) for v in g.input],
        "outputs": [value_info(v) for v in g.output],
        "initializers": [
            {"name": t.name, "shape": list(t.dims),
             "dtype": onnx.TensorProto.DataType.Name(t.data_type),
             "external": t.data_location == onnx.TensorProto.EXTERNAL}
            for t in onnx.load(path, load_external_data=False).graph.initializer
        ],
        "folded_from": folded,
        "op_types": sorted(counts),
        "op_type_counts": counts,
        "num_nodes": len(g.node),
        "functions": [f.name for f in m.functions],
        "parameters_not_initializers": [p for p in param_names if p not in set(names)],
    }


def check_ort(path, model, feeds, ref_logits, alt_feeds):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    out = sess.get_outputs()[0].name

    def run(f):
        return torch.from_numpy(sess.run([out], {k: v.numpy() for k, v in f.items()})[0])

    d_ref = float((run(feeds) - ref_logits).abs().max())
    res = {"ref_max_abs_diff": d_ref}
    if alt_feeds is not None:
        with torch.no_grad():
            want = model(*alt_feeds.values())
        res["alt_max_abs_diff"] = float((run(alt_feeds) - want).abs().max())
    assert all(v <= ORT_TOL for v in res.values()), (path, res)
    return res


def write(name, model, feeds, loss_fn, targets, dynamic_shapes, alt_feeds, extra):
    tensors, zero = base.reference(model, feeds, loss_fn)
    tensors.update(targets)
    d = fresh_dir(name)
    path = os.path.join(d, "model.onnx")
    export(model, tuple(feeds.values()), path, dynamic_shapes)
    safetensors.torch.save_file(tensors, os.path.join(d, "reference.safetensors"),
                                metadata={"format": "pt"})
    names, shapes, num = base.params_info(model)
    info = {
        "family": name,
        "num_parameters": num,
        "parameters": shapes,
        "zero_grad_parameters": zero,
        "loss_value": float(tensors["loss"]),
        "export": {
            "call": "torch.onnx.export(model, args, path"
                    + (", dynamic_shapes=...)" if dynamic_shapes is not None else ")"),
            "dynamic_shapes": None if dynamic_shapes is None else {
                k: {str(i): str(dim) for i, dim in v.items()}
                for k, v in dynamic_shapes.items()},
        },
        "onnx": describe(path, names),
        **extra,
    }
    base.write_json(os.path.join(d, "reference.json"), info)
    info["ort"] = check_ort(path, model, feeds, tensors["logits"], alt_feeds)
    return d, info


def make_lm(name, seed, config_cls, model_cls, cfg, static=False):
    config = config_cls(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = base.logits_only(model_cls)(config).eval()
    base.perturb(model, seed + 1)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, vocab, REF_SHAPE, generator=g, dtype=torch.int64)
    labels = torch.randint(0, vocab, REF_SHAPE, generator=g, dtype=torch.int64)
    alt_ids = torch.randint(0, vocab, ALT_SHAPE, generator=g, dtype=torch.int64)

    def lm_loss(lg):
        return F.cross_entropy(lg.reshape(-1, vocab), labels.reshape(-1))

    ds = None if static else {"input_ids": {0: torch.export.Dim("batch"),
                                            1: torch.export.Dim("sequence")}}
    return write(name, model, {"input_ids": input_ids}, lm_loss, {"labels": labels}, ds,
                 None if static else {"input_ids": alt_ids},
                 {"architecture": model_cls.__name__, "config": config.to_dict(),
                  "loss": "F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)), mean; "
                          "labels are already-shifted next-token targets"})


def make_vision(name, seed, model_cls):
    torch.manual_seed(seed)
    model = model_cls().eval()
    base.perturb(model, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    shape = model_cls.SHAPE
    pixel_values = torch.randn(2, *shape, generator=g)
    alt_pixels = torch.randn(3, *shape, generator=g)
    if name in ("resnet", "vit"):
        labels = torch.randint(0, 10, (2,), generator=g, dtype=torch.int64)
        targets = {"labels": labels}
        loss_fn = lambda lg: F.cross_entropy(lg, labels)  # noqa: E731
        loss_doc = "F.cross_entropy(logits, labels), mean"
    else:
        target = torch.randn(2, *shape, generator=g)
        targets = {"target": target}
        loss_fn = lambda out: F.mse_loss(out, target)  # noqa: E731
        loss_doc = "F.mse_loss(logits, target), mean"
    ds = {"pixel_values": {0: torch.export.Dim("batch")}}
    return write(name, model, {"pixel_values": pixel_values}, loss_fn, targets, ds,
                 {"pixel_values": alt_pixels},
                 {"architecture": model_cls.__name__, "loss": loss_doc})


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT, exist_ok=True)
    only = set(sys.argv[1:])
    results = []
    jobs = [(n, lambda n=n, i=i: make_lm(n, 4000 + 10 * i, *base.LMS[n]))
            for i, n in enumerate(base.LMS)]
    jobs.append(("llama-static", lambda: make_lm("llama-static", 4050, *base.LMS["llama"],
                                                 static=True)))
    jobs += [(n, lambda n=n, i=i, cls=cls: make_vision(n, 4200 + 10 * i, cls))
             for i, (n, cls) in enumerate(base.VISION.items())]
    for name, job in jobs:
        if only and name not in only:
            continue
        d, info = job()
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        o = info["onnx"]
        print(f"{name:13s} {size / 1024:7.1f} KiB  params {info['num_parameters']}  "
              f"loss {info['loss_value']:.6f}  {o['num_nodes']} nodes; ort {info['ort']}")
        print("    op_types: " + " ".join(o["op_types"]))
        assert size < MAX_DIR_BYTES, (name, size)
        results.append(name)
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": ort.__version__,
    }
    base.write_json(os.path.join(OUT, "versions.json"), versions)
    print(json.dumps(versions, sort_keys=True))
    names = sorted(n for n in os.listdir(OUT) if os.path.isdir(os.path.join(OUT, n)))
    with open(os.path.join(OUT, "SHA256SUMS"), "w") as f:
        for name in names:
            for fn in sorted(os.listdir(os.path.join(OUT, name))):
                f.write(f"{sha256(os.path.join(OUT, name, fn))}  {name}/{fn}\n")


if __name__ == "__main__":
    main()
