#!/usr/bin/env python3
"""Writes the Hugging Face parity fixtures under crates/tessera-cli/tests/fixtures/hf/.

Each fixture is a small causal LM built by `transformers` from an explicit config, its weights
re-initialised with a fixed seed and a large std (so that attention, RoPE, GQA, biases and norm
weights all move the logits), saved with `save_pretrained(..., safe_serialization=True)` in
fp32, plus `expected.json`:

    {"tokens": [...n ids...],
     "logits": [[...V...], ...n-1 rows...],   # model(ids).logits[0, :-1], fp32 values
     "loss": float,                           # mean CE of logits vs ids[1:], in float64
     "loss_fp32": float,                      # the same from transformers' own fp32 loss
     ...}

and the `broken-*` directories the CLI's bad-input tests load (tiny models, a few KB each).
Deterministic: re-running rewrites byte-identical files (given the versions in README.md; on
another CPU the fp32 logits in expected.json may differ in their last bits).

usage: scripts/make-hf-fixtures.sh   (sets up .venv-bench, then runs this)
"""

import hashlib
import json
import os
import platform
import shutil
import sys

import safetensors
import safetensors.torch
import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "tessera-cli", "tests", "fixtures", "hf")
MAX_DIR_BYTES = 1 << 20

# 16 fixed ids (< 96), including repeats so that attention to earlier equal tokens matters.
TOKENS = [3, 17, 42, 8, 95, 0, 61, 17, 29, 88, 5, 42, 73, 11, 50, 3]


def common_llama(**extra):
    """LLaMA-family sizes shared by llama / qwen2 / mistral: GQA 4 query heads, 2 kv heads."""
    cfg = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    cfg.update(extra)
    return cfg


FIXTURES = {
    # GPT-2: learned positions, LayerNorm with bias, Conv1D weights [in, out], gelu_new, tied.
    "gpt2": (
        GPT2Config,
        GPT2LMHeadModel,
        dict(
            vocab_size=96,
            n_positions=64,
            n_embd=64,
            n_layer=2,
            n_head=4,
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            torch_dtype="float32",
        ),
    ),
    # LLaMA: RoPE (theta 1e4), GQA 4/2, SwiGLU, RMSNorm, untied head, no biases.
    "llama": (LlamaConfig, LlamaForCausalLM, common_llama()),
    # Qwen2: q/k/v biases, tied embeddings, GQA, rope_theta 1e6 (its default), no window.
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        common_llama(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
    ),
    # Mistral: sliding window 32 > the 15 positions evaluated, so it must not mask anything.
    "mistral": (MistralConfig, MistralForCausalLM, common_llama(sliding_window=32, head_dim=16)),
    # Mistral with a window of 4 < 15 positions: each position attends to itself and the 3
    # before it (transformers masks key j for query i unless i - window < j <= i).
    "mistral-window": (
        MistralConfig, MistralForCausalLM, common_llama(sliding_window=4, head_dim=16),
    ),
}

# Bad-input fixtures: a tiny LLaMA (the tests only check the error messages).
TINY = common_llama(
    vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1,
)
MISSING_TENSOR = "model.layers.0.mlp.down_proj.weight"
EXTRA_TENSOR = "model.layers.0.mlp.extra_proj.weight"


def reinit(model, seed):
    """Every parameter ~ N(0, 0.3²) — norm weights 1 + N(0, 0.2²) — from a fixed seed, in name
    order, so that nothing is near the degenerate 0.02-std init and the result is independent of
    transformers' own init order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            is_norm = ("norm" in name or ".ln_" in name or name.startswith("transformer.ln_f"))
            if is_norm and name.endswith(".weight"):
                value = 1.0 + 0.2 * noise
            elif name.endswith(".bias"):
                value = 0.2 * noise
            else:
                value = 0.3 * noise
            p.copy_(value.to(p.dtype))
    # Tied heads share the embedding parameter: named_parameters lists it once, so nothing to do.


def expected(model, tokens):
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids[:, :-1], labels=None)
        logits = out.logits[0].to(torch.float32)  # [n-1, V], the fp32 forward
        hf_loss = model(input_ids=ids, labels=ids).loss.item()  # transformers' fp32 shifted CE
    logits64 = logits.double()
    loss = torch.nn.functional.cross_entropy(logits64, ids[0, 1:]).item()
    # The forward over ids[:-1] and the first n-1 rows of the forward over all ids agree (causal).
    with torch.no_grad():
        full = model(input_ids=ids).logits[0, :-1]
    assert torch.allclose(full, logits, atol=1e-5, rtol=0), (full - logits).abs().max()
    return {
        "tokens": tokens,
        "shape": list(logits.shape),
        "loss": loss,
        "loss_fp32": hf_loss,
        "logits": [[float(x) for x in row] for row in logits.tolist()],
        "logits_abs_max": float(logits.abs().max()),
        "logits_std": float(logits64.std()),
    }


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=None, separators=(",", ":"))
        f.write("\n")


def save(model, d):
    if os.path.isdir(d):
        shutil.rmtree(d)
    model.save_pretrained(d, safe_serialization=True)
    # save_pretrained also writes generation_config.json for generative models; keep only the
    # two files a checkpoint directory needs.
    for name in os.listdir(d):
        if name not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(d, name))


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def make_fixture(name, seed, config_cls, model_cls, cfg):
    config = config_cls(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    reinit(model, seed)
    d = os.path.join(OUT, name)
    save(model, d)
    # Reload what was written, as a user would, and compute the reference from that.
    model = model_cls.from_pretrained(d, attn_implementation="eager", torch_dtype=torch.float32)
    model.eval()
    exp = expected(model, TOKENS)
    exp["model_type"] = config.model_type
    exp["architecture"] = model_cls.__name__
    write_json(os.path.join(d, "expected.json"), exp)
    return d, exp


def make_broken():
    """broken-missing/: one tensor absent; broken-shape/: config.json's vocab_size changed to
    100 (embed_tokens and lm_head then disagree); broken-extra/: one tensor the model lacks."""
    torch.manual_seed(7)
    config = LlamaConfig(**TINY)
    model = LlamaForCausalLM(config).eval()
    reinit(model, 7)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "pt"}
    dirs = {}

    d = os.path.join(OUT, "broken-missing")
    save(model, d)
    safetensors.torch.save_file(
        {k: v for k, v in tensors.items() if k != MISSING_TENSOR},
        os.path.join(d, "model.safetensors"), metadata=meta)
    dirs["broken-missing"] = d

    d = os.path.join(OUT, "broken-shape")
    save(model, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = 100
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    dirs["broken-shape"] = d

    d = os.path.join(OUT, "broken-extra")
    save(model, d)
    extra = dict(tensors)
    g = torch.Generator().manual_seed(8)
    extra[EXTRA_TENSOR] = torch.randn((4, 4), generator=g)
    safetensors.torch.save_file(extra, os.path.join(d, "model.safetensors"), metadata=meta)
    dirs["broken-extra"] = d
    return dirs


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    torch.set_num_threads(1)  # reductions in one fixed order: reproducible bytes
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT, exist_ok=True)
    rows = []
    for i, (name, (config_cls, model_cls, cfg)) in enumerate(FIXTURES.items()):
        d, exp = make_fixture(name, 1000 + i, config_cls, model_cls, cfg)
        rows.append((name, d, exp))
    broken = make_broken()

    too_big = []
    report = []
    for name, d, exp in rows:
        size = dir_bytes(d)
        report.append(
            f"{name:8s} {exp['architecture']:20s} {size / 1024:7.1f} KiB  loss {exp['loss']:.6f}"
            f"  |logits|max {exp['logits_abs_max']:.2f} std {exp['logits_std']:.2f}")
        if size >= MAX_DIR_BYTES:
            too_big.append(name)
    for name, d in broken.items():
        size = dir_bytes(d)
        report.append(f"{name:14s} {size / 1024:7.1f} KiB")
        if size >= MAX_DIR_BYTES:
            too_big.append(name)
    print("\n".join(report))

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }
    write_json(os.path.join(OUT, "versions.json"), versions)
    checksums = {
        f"{name}/{f}": sha256(os.path.join(OUT, name, f))
        for name in sorted([r[0] for r in rows] + list(broken))
        for f in sorted(os.listdir(os.path.join(OUT, name)))
    }
    print(json.dumps(versions))
    with open(os.path.join(OUT, "SHA256SUMS"), "w") as f:
        for k, v in checksums.items():
            f.write(f"{v}  {k}\n")
    if too_big:
        sys.exit(f"error: fixture directories over 1 MiB: {', '.join(too_big)}")


if __name__ == "__main__":
    main()
