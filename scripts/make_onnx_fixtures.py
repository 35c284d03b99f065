#!/usr/bin/env python3
"""Writes the ONNX importer fixtures under crates/tessera-cli/tests/fixtures/onnx/.

Each fixture directory <name>/ holds

    model.onnx               torch.onnx.export (TorchScript exporter, dynamo=False), opset 17,
                             export_params=True, do_constant_folding=False (so parameter
                             initializers keep PyTorch's named_parameters() names, and nn.Linear
                             weights stay [out, in] initializers feeding a Transpose node)
    reference.safetensors    the inputs (input_ids or pixel_values), the targets (labels or
                             target), PyTorch's fp32 CPU `logits`, `loss` (a scalar, shape []) and
                             `grad.<name>` for every named_parameters() name (tied weights once)
    reference.json           family, config, num_parameters, parameter names and shapes, and what
                             the exported graph holds (initializer names/shapes, op_types)

Causal LMs (gpt2, llama, opt): input "input_ids" int64 [batch, sequence] -> "logits" f32
[batch, sequence, V], both axes dynamic; reference at [2, 8]; labels are already-shifted
next-token targets: loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)) (mean).
Vision: "pixel_values" f32 [batch, 1, 8, 8] (the digits data set's shape), batch dynamic.
`unsupported/model.onnx` only: a graph with an ONNX `Det` node, for the importer's error path.

Deterministic: re-running rewrites byte-identical files (given the versions in versions.json;
on another CPU the fp32 logits/grads may differ in their last bits).

usage: scripts/make-onnx-fixtures.sh   (sets up .venv-bench, then runs this)
       scripts/make-onnx-fixtures.sh --no-ort   skips the onnxruntime comparison
"""

import hashlib
import json
import os
import platform
import shutil
import sys
import warnings

import safetensors
import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

try:
    import onnx
except ImportError:  # the fixtures can still be written; reference.json then has "onnx": null
    onnx = None
try:
    import onnxruntime as ort
except ImportError:
    ort = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "tessera-cli", "tests", "fixtures", "onnx")
MAX_DIR_BYTES = 1 << 20
OPSET = 17
REF_SHAPE = (2, 8)  # [batch, sequence] of the reference
ALT_SHAPE = (1, 5)  # another shape, run through onnxruntime to check the dynamic axes
ORT_TOL = 1e-5

# ----------------------------------------------------------------------------------------------
# models


def logits_only(base):
    """A subclass of an HF causal-LM class whose forward(input_ids) returns only the logits
    (use_cache=False, return_dict=False, no attention_mask). A subclass rather than a wrapping
    module so that named_parameters() (and so the ONNX initializer names) are exactly the HF
    names, with no "model." prefix."""

    class LogitsOnly(base):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False, return_dict=False)[0]

    LogitsOnly.__name__ = LogitsOnly.__qualname__ = base.__name__ + "LogitsOnly"
    return LogitsOnly


LMS = {
    # GPT-2: learned positions, LayerNorm with bias, Conv1D ([in, out]) weights, gelu_new,
    # tied head.
    "gpt2": (
        GPT2Config,
        GPT2LMHeadModel,
        dict(
            vocab_size=256,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            torch_dtype="float32",
        ),
    ),
    # LLaMA: RoPE, GQA 4/2, SwiGLU, RMSNorm, untied head, no biases.
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_act="silu",
            max_position_embeddings=64,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            torch_dtype="float32",
        ),
    ),
    # OPT: learned positions with OPT's offset of 2 (computed from the all-ones attention mask),
    # pre-LayerNorm, ReLU MLP, biases everywhere, tied head. pad_token_id=None: OPT's default
    # (1) would make embed_tokens an nn.Embedding with padding_idx=1, whose row 1 PyTorch zeroes
    # at init and never gives a gradient — a PyTorch-only rule the ONNX Gather does not carry.
    "opt": (
        OPTConfig,
        OPTForCausalLM,
        dict(
            vocab_size=256,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            layerdrop=0.0,
            do_layer_norm_before=True,
            pad_token_id=None,
            torch_dtype="float32",
        ),
    ),
}


class ResBlock(nn.Module):
    """conv3x3-GroupNorm-ReLU-conv3x3-GroupNorm, + the input (1x1 projection when the stride or
    the channel count changes), ReLU."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(2, cout)
        if stride != 1 or cin != cout:
            self.proj = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
        else:
            self.proj = None

    def forward(self, x):
        h = F.relu(self.norm1(self.conv1(x)))
        h = self.norm2(self.conv2(h))
        skip = x if self.proj is None else self.proj(x)
        return F.relu(h + skip)


class TinyResNet(nn.Module):
    """[B,1,8,8] (the shape of data/digits.csv, so `tessera train` can train it) -> stem conv3x3
    (8 ch) + GroupNorm + ReLU -> MaxPool2d(2) (4x4) -> block 8->8 -> block 8->16 stride 2 with
    1x1 projection (2x2) -> global average pool -> Linear(16, 10)."""

    SHAPE = (1, 8, 8)

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.stem_norm = nn.GroupNorm(2, 8)
        self.pool = nn.MaxPool2d(2)
        self.block1 = ResBlock(8, 8, 1)
        self.block2 = ResBlock(8, 16, 2)
        self.head = nn.Linear(16, 10)

    def forward(self, pixel_values):
        x = self.pool(F.relu(self.stem_norm(self.stem(pixel_values))))
        x = self.block2(self.block1(x))
        x = x.mean(dim=(2, 3))
        return self.head(x)


class ConvNormAct(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(2, cout)

    def forward(self, x):
        return F.silu(self.norm(self.conv(x)))


class TinyUNet(nn.Module):
    """[B,1,8,8] (digits' shape: `tessera train` trains it as a denoiser) -> enc (8 ch, 8x8) ->
    AvgPool2d(2) -> mid (16 ch, 4x4) -> Upsample x2 nearest -> up conv (8 ch, 8x8) ->
    cat([up, enc], channels) -> dec (8 ch) -> 1x1 conv to 1. Each conv block: conv3x3 +
    GroupNorm(2) + SiLU."""

    SHAPE = (1, 8, 8)

    def __init__(self):
        super().__init__()
        self.enc = ConvNormAct(1, 8)
        self.down = nn.AvgPool2d(2)
        self.mid = ConvNormAct(8, 16)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.up = ConvNormAct(16, 8)
        self.dec = ConvNormAct(16, 8)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, pixel_values):
        e = self.enc(pixel_values)
        m = self.mid(self.down(e))
        u = self.up(self.upsample(m))
        d = self.dec(torch.cat([u, e], dim=1))
        return self.out(d)


class Unsupported(nn.Module):
    """inputs [B,4,4] -> flatten -> Linear(16,16) -> [B,4,4] -> torch.linalg.det (ONNX Det) ->
    [B,1] -> Linear(1,4)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(16, 16)
        self.lin2 = nn.Linear(1, 4)

    def forward(self, inputs):
        h = self.lin1(inputs.flatten(1)).reshape(-1, 4, 4)
        return self.lin2(torch.linalg.det(h).unsqueeze(-1))


class TinyViT(ViTForImageClassification):
    """ViTForImageClassification on [B,1,8,8] (digits): patch 4, hidden 32, 2 layers, 4 heads,
    MLP 64, exact GELU (nn.GELU: Erf in the graph), unmasked attention, 10 labels. A subclass,
    so parameter names stay transformers' own."""

    SHAPE = (1, 8, 8)

    def __init__(self):
        config = ViTConfig(
            image_size=8, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, hidden_act="gelu",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10,
        )
        config._attn_implementation = "eager"
        super().__init__(config)

    def forward(self, pixel_values):
        return super().forward(pixel_values=pixel_values, return_dict=False)[0]


VISION = {"resnet": TinyResNet, "unet": TinyUNet, "vit": TinyViT}

# ----------------------------------------------------------------------------------------------
# helpers


def is_norm_module(m):
    return isinstance(m, (nn.LayerNorm, nn.GroupNorm)) or type(m).__name__.endswith("RMSNorm")


def perturb(model, seed):
    """Keep the model's own init (HF: N(0, 0.02²) weights), but make nothing degenerate: norm
    weights 1 + N(0, 0.1²), norm biases N(0, 0.1²), every other bias (zero after HF's init)
    + N(0, 0.02²). In sorted-name order from a fixed seed."""
    norm_params = set()
    for mname, m in model.named_modules():
        if is_norm_module(m):
            for pname, _ in m.named_parameters(recurse=False):
                norm_params.add(f"{mname}.{pname}" if mname else pname)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name in norm_params:
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
                if name.endswith("weight"):
                    p.copy_(1.0 + 0.1 * noise)
                else:
                    p.copy_(0.1 * noise)
            elif name.endswith("bias"):
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
                p.add_(0.02 * noise)
    return sorted(norm_params)


def export(model, args, path, input_name, dynamic_axes):
    torch.onnx.export(
        model,
        args,
        path,
        export_params=True,
        opset_version=OPSET,
        do_constant_folding=False,
        input_names=[input_name],
        output_names=["logits"],
        dynamic_axes=dynamic_axes,
        dynamo=False,
    )


def describe_onnx(path, param_names):
    """What the exported graph holds, for reference.json (None without the onnx package)."""
    if onnx is None:
        return None
    m = onnx.load(path)
    onnx.checker.check_model(m, full_check=True)
    g = m.graph
    inits = [
        {"name": t.name, "shape": list(t.dims),
         "dtype": onnx.TensorProto.DataType.Name(t.data_type)}
        for t in g.initializer
    ]
    names = [t["name"] for t in inits]
    counts = {}
    for n in g.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    for n in g.node:  # no control flow expected: every op is in the top-level graph
        assert not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                       for a in n.attribute), n.op_type

    def value_info(v):
        dims = [d.dim_param if d.HasField("dim_param") else d.dim_value
                for d in v.type.tensor_type.shape.dim]
        return {"name": v.name, "shape": dims,
                "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type)}

    return {
        "ir_version": m.ir_version,
        "opset": [{"domain": o.domain, "version": o.version} for o in m.opset_import],
        "producer": f"{m.producer_name} {m.producer_version}",
        "inputs": [value_info(v) for v in g.input if v.name not in set(names)],
        "outputs": [value_info(v) for v in g.output],
        "initializers": inits,
        "num_initializers": len(inits),
        "op_types": sorted(counts),
        "op_type_counts": counts,
        "num_nodes": len(g.node),
        "parameters_missing_from_initializers": [p for p in param_names if p not in set(names)],
        "initializers_not_parameters": [n for n in names if n not in set(param_names)],
    }


def ort_logits(path, feeds):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(["logits"], {k: v.numpy() for k, v in feeds.items()})[0])


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")


def fresh_dir(name):
    d = os.path.join(OUT, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    return d


def reference(model, feeds, loss_fn):
    """fp32 forward + backward on CPU: the logits, the loss and every named_parameters() grad."""
    model.zero_grad(set_to_none=True)
    logits = model(*feeds.values())
    loss = loss_fn(logits)
    loss.backward()
    tensors = {k: v.contiguous() for k, v in feeds.items()}
    tensors["logits"] = logits.detach().contiguous()
    tensors["loss"] = loss.detach().reshape(()).contiguous()
    zero = []
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        assert p.grad.dtype == torch.float32
        tensors[f"grad.{name}"] = p.grad.detach().clone().contiguous()
        if not bool(p.grad.abs().max() > 0):
            zero.append(name)
    model.zero_grad(set_to_none=True)
    return tensors, zero


def check_initializers(path, fresh, feeds, loss_fn, tensors):
    """Copies the ONNX initializers into `fresh` (an untrained instance of the same model) by
    parameter name and requires its logits, loss and grads to be bit-identical to the reference:
    the graph's weights are exactly the weights the reference was computed with."""
    if onnx is None:
        return
    from onnx import numpy_helper
    graph = onnx.load(path).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    # Parameters the exporter merged because their values were equal are Identity nodes named
    # as the parameter was (what Tessera reads them as).
    for n in graph.node:
        if n.op_type == "Identity" and n.input[0] in inits and n.output[0] not in inits:
            inits[n.output[0]] = inits[n.input[0]]
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.copy_(torch.from_numpy(inits[name].copy()))
    again, _ = reference(fresh, feeds, loss_fn)
    for k, v in again.items():
        assert torch.equal(v, tensors[k]), f"{path}: {k} differs reloaded from the initializers"


def check_ort(path, model, feeds, ref_logits, alt_feeds):
    """onnxruntime's logits vs PyTorch's: at the reference shape (vs the saved logits) and at
    another shape (the dynamic axes). Returns the two max abs differences."""
    if ort is None:
        return None
    got = ort_logits(path, feeds)
    assert got.shape == ref_logits.shape, (got.shape, ref_logits.shape)
    d_ref = float((got - ref_logits).abs().max())
    with torch.no_grad():
        want = model(*alt_feeds.values())
    got = ort_logits(path, alt_feeds)
    assert got.shape == want.shape, (got.shape, want.shape)
    d_alt = float((got - want).abs().max())
    assert d_ref <= ORT_TOL and d_alt <= ORT_TOL, (path, d_ref, d_alt)
    return {"ref_shape": list(ref_logits.shape), "ref_max_abs_diff": d_ref,
            "alt_shape": list(want.shape), "alt_max_abs_diff": d_alt}


def params_info(model):
    named = list(model.named_parameters())
    return (
        [n for n, _ in named],
        [{"name": n, "shape": list(p.shape)} for n, p in named],
        sum(p.numel() for _, p in named),
    )


# ----------------------------------------------------------------------------------------------
# fixtures


def make_lm(name, seed, config_cls, model_cls, cfg, fresh_init=False):
    config = config_cls(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = logits_only(model_cls)(config).eval()
    fresh = logits_only(model_cls)(config).eval()
    for m in model.modules():
        assert not isinstance(m, nn.Embedding) or m.padding_idx is None, (name, m)
        assert not isinstance(m, nn.Dropout) or m.p == 0.0, (name, m)
    # `fresh_init`: the model as transformers initialises it (zero biases, unit norms), so the
    # exporter merges every equal-valued parameter (Identity nodes in the graph).
    norm_params = [] if fresh_init else perturb(model, seed + 1)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, vocab, REF_SHAPE, generator=g, dtype=torch.int64)
    labels = torch.randint(0, vocab, REF_SHAPE, generator=g, dtype=torch.int64)
    alt_ids = torch.randint(0, vocab, ALT_SHAPE, generator=g, dtype=torch.int64)

    def lm_loss(lg):
        return F.cross_entropy(lg.reshape(-1, vocab), labels.reshape(-1))

    tensors, zero = reference(model, {"input_ids": input_ids}, lm_loss)
    tensors["labels"] = labels
    assert list(tensors["logits"].shape) == [*REF_SHAPE, vocab]

    d = fresh_dir(name)
    path = os.path.join(d, "model.onnx")
    export(model, (input_ids,), path, "input_ids",
           {"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}})
    safetensors.torch.save_file(tensors, os.path.join(d, "reference.safetensors"),
                                metadata={"format": "pt"})
    check_initializers(path, fresh, {"input_ids": input_ids}, lm_loss, tensors)
    names, shapes, num = params_info(model)
    config_dict = config.to_dict()
    info = {
        "family": name,
        "architecture": model_cls.__name__,
        "model_type": config.model_type,
        "config": config_dict,
        "num_parameters": num,
        "parameters": shapes,
        "norm_parameters": norm_params,
        "zero_grad_parameters": zero,
        "input": {"name": "input_ids", "dtype": "int64", "shape": list(REF_SHAPE),
                  "dynamic_axes": ["batch", "sequence"]},
        "loss": "F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)), mean; labels are "
                "already-shifted next-token targets",
        "loss_value": float(tensors["loss"]),
        "export": export_info(),
        "onnx": describe_onnx(path, names),
    }
    write_json(os.path.join(d, "reference.json"), info)
    ort_res = check_ort(path, model, {"input_ids": input_ids}, tensors["logits"],
                        {"input_ids": alt_ids})
    return d, info, ort_res


def make_vision(name, seed, model_cls):
    torch.manual_seed(seed)
    model = model_cls().eval()
    fresh = model_cls().eval()
    norm_params = perturb(model, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    shape = getattr(model_cls, "SHAPE", (3, 16, 16))
    pixel_values = torch.randn(2, *shape, generator=g)
    alt_pixels = torch.randn(1, *shape, generator=g)
    if name in ("resnet", "vit"):
        labels = torch.randint(0, 10, (2,), generator=g, dtype=torch.int64)
        targets = {"labels": labels}
        loss_fn = lambda lg: F.cross_entropy(lg, labels)  # noqa: E731
        loss_doc = "F.cross_entropy(logits, labels), mean; logits [B,10], labels int64 [B]"
    else:
        target = torch.randn(2, *shape, generator=g)
        targets = {"target": target}
        loss_fn = lambda out: F.mse_loss(out, target)  # noqa: E731
        loss_doc = f"F.mse_loss(logits, target), mean; logits and target f32 [B,{','.join(map(str, shape))}]"
    tensors, zero = reference(model, {"pixel_values": pixel_values}, loss_fn)
    tensors.update(targets)

    d = fresh_dir(name)
    path = os.path.join(d, "model.onnx")
    export(model, (pixel_values,), path, "pixel_values",
           {"pixel_values": {0: "batch"}, "logits": {0: "batch"}})
    safetensors.torch.save_file(tensors, os.path.join(d, "reference.safetensors"),
                                metadata={"format": "pt"})
    check_initializers(path, fresh, {"pixel_values": pixel_values}, loss_fn, tensors)
    names, shapes, num = params_info(model)
    info = {
        "family": name,
        "architecture": model_cls.__name__,
        # transformers' own config.json for HF models (the built-in family reads it), else a
        # description.
        "config": (json.loads(model.config.to_json_string()) if hasattr(model, "config")
                   else {"description": " ".join(model_cls.__doc__.split()),
                         "input_shape": list(shape), "groupnorm_groups": 2}),
        "num_parameters": num,
        "parameters": shapes,
        "norm_parameters": norm_params,
        "zero_grad_parameters": zero,
        "input": {"name": "pixel_values", "dtype": "float32", "shape": [2, *shape],
                  "dynamic_axes": ["batch"]},
        "loss": loss_doc,
        "loss_value": float(tensors["loss"]),
        "export": export_info(),
        "onnx": describe_onnx(path, names),
    }
    write_json(os.path.join(d, "reference.json"), info)
    ort_res = check_ort(path, model, {"pixel_values": pixel_values}, tensors["logits"],
                        {"pixel_values": alt_pixels})
    return d, info, ort_res


def make_unsupported(seed):
    torch.manual_seed(seed)
    model = Unsupported().eval()
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(2, 4, 4, generator=g)
    d = fresh_dir("unsupported")
    path = os.path.join(d, "model.onnx")
    export(model, (x,), path, "inputs", {"inputs": {0: "batch"}, "logits": {0: "batch"}})
    info = {"onnx": describe_onnx(path, [n for n, _ in model.named_parameters()])}
    ort_res = None
    if ort is not None:
        with torch.no_grad():
            want = model(x)
        got = ort_logits(path, {"inputs": x})
        ort_res = {"ref_max_abs_diff": float((got - want).abs().max())}
        assert ort_res["ref_max_abs_diff"] <= 1e-4, ort_res
    assert info["onnx"] is None or "Det" in info["onnx"]["op_types"], info
    return d, info, ort_res


def export_info():
    return {"exporter": "torch.onnx.export (TorchScript, dynamo=False)", "opset_version": OPSET,
            "export_params": True, "do_constant_folding": False, "training": "eval"}


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def main():
    global ort
    if "--no-ort" in sys.argv[1:]:
        ort = None
    # Tracing HF models warns about every Python-level shape check; the exports are checked
    # against onnxruntime at two shapes instead.
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    torch.set_num_threads(1)  # reductions in one fixed order: reproducible bytes
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT, exist_ok=True)
    results = []
    for i, (name, (config_cls, model_cls, cfg)) in enumerate(LMS.items()):
        results.append((name, *make_lm(name, 3000 + 10 * i, config_cls, model_cls, cfg)))
    results.append(("gpt2-fresh", *make_lm("gpt2-fresh", 3050, *LMS["gpt2"], fresh_init=True)))
    results.append(("unsupported", *make_unsupported(3100)))
    for i, (name, cls) in enumerate(VISION.items()):
        results.append((name, *make_vision(name, 3200 + 10 * i, cls)))

    too_big = []
    for name, d, info, ort_res in results:
        size = dir_bytes(d)
        if size >= MAX_DIR_BYTES:
            too_big.append(name)
        line = f"{name:12s} {size / 1024:7.1f} KiB"
        if "num_parameters" in info:
            line += f"  params {info['num_parameters']}  loss {info['loss_value']:.6f}"
        print(line)
        o = info.get("onnx")
        if o:
            print(f"    {o['num_nodes']} nodes, {o['num_initializers']} initializers; op_types: "
                  + " ".join(o["op_types"]))
            if o["parameters_missing_from_initializers"]:
                print("    parameters not initializers: "
                      f"{o['parameters_missing_from_initializers']}")
            if o["initializers_not_parameters"]:
                print(f"    initializers not parameters: {o['initializers_not_parameters']}")
        if info.get("zero_grad_parameters"):
            print(f"    all-zero grads: {info['zero_grad_parameters']}")
        if ort_res:
            print(f"    onnxruntime vs torch: {ort_res}")

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "onnx": onnx.__version__ if onnx is not None else None,
    }
    write_json(os.path.join(OUT, "versions.json"), versions)
    print(json.dumps(versions, sort_keys=True))
    with open(os.path.join(OUT, "SHA256SUMS"), "w") as f:
        for name in sorted(r[0] for r in results):
            for fn in sorted(os.listdir(os.path.join(OUT, name))):
                f.write(f"{sha256(os.path.join(OUT, name, fn))}  {name}/{fn}\n")
    if too_big:
        sys.exit(f"error: fixture directories over 1 MiB: {', '.join(too_big)}")


if __name__ == "__main__":
    main()
