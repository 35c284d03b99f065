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

and `generate.json`, greedy generations by transformers' own `generate` (KV cache), each prompt
on its own (batch 1, no padding):

    {"max_new_tokens": 12,
     "prompts": [[...5 ids...], [...9 ids...], [...16 ids...]],
     "new_tokens": [[...12 ids...], ...],     # generate(...)[0, len(prompt):]
     "step_logits_top2_gap": [float, ...]}    # per prompt: min over the 12 steps of top1 - top2

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
    BloomConfig,
    BloomForCausalLM,
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

# generate.json: greedy continuations of prompts of these lengths, GEN_NEW_TOKENS new tokens each.
GEN_LENGTHS = (5, 9, 16)
GEN_NEW_TOKENS = 12
# Every greedy step's top-1 logit must beat the top-2 by at least this much (so that a
# reimplementation within the parity tolerance picks the same token), and no generated token may
# be the config's eos_token_id (so that stopping at EOS or not gives the same 12 tokens).
GEN_MIN_GAP = 1e-3


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
    # BLOOM: ALiBi (no position embeddings), LayerNorm after the embedding, fused per-head
    # interleaved query_key_value with biases, BLOOM's tanh gelu, tied head. 4 heads: slopes
    # 2^-2, 2^-4, 2^-6, 2^-8.
    "bloom": (
        BloomConfig,
        BloomForCausalLM,
        dict(
            vocab_size=96,
            hidden_size=64,
            n_layer=2,
            n_head=4,
            layer_norm_epsilon=1e-5,
            apply_residual_connection_post_layernorm=False,
            torch_dtype="float32",
        ),
    ),
    # BLOOM with 6 heads (head dim 8): not a power of two, so ALiBi's slopes are the 4-head ones
    # followed by 2^-1, 2^-3 (every other slope of the 8-head sequence).
    "bloom-6heads": (
        BloomConfig,
        BloomForCausalLM,
        dict(
            vocab_size=96,
            hidden_size=48,
            n_layer=2,
            n_head=6,
            layer_norm_epsilon=1e-5,
            apply_residual_connection_post_layernorm=False,
            torch_dtype="float32",
        ),
    ),
}

# Bad-input fixtures: a tiny LLaMA (the tests only check the error messages).
TINY = common_llama(
    vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1,
)
MISSING_TENSOR = "model.layers.0.mlp.down_proj.weight"
EXTRA_TENSOR = "model.layers.0.mlp.extra_proj.weight"


def is_norm(name):
    """A norm module's parameter: LLaMA-family `*norm*`, GPT-2 `.ln_1/.ln_2/ln_f`, BLOOM
    `input_layernorm`, `post_attention_layernorm`, `word_embeddings_layernorm`, `ln_f`."""
    return "norm" in name or ".ln_" in name or name.startswith("transformer.ln_f")


def reinit(model, seed):
    """Every parameter ~ N(0, 0.3²) — norm weights 1 + N(0, 0.2²) — from a fixed seed, in name
    order, so that nothing is near the degenerate 0.02-std init and the result is independent of
    transformers' own init order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if is_norm(name) and name.endswith(".weight"):
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


def top2_gaps(step_logits):
    """top1 - top2 of each row of [steps, V] logits."""
    top = torch.topk(step_logits, 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def greedy_one(model, prompt, pad_token_id, eos_token_id):
    """transformers' generate on one prompt (batch 1, KV cache), checked against a greedy loop
    that recomputes the full forward at every step (no cache). Returns (new tokens, min top-2 gap)
    or None when the prompt is unusable (a near tie, or an EOS among the new tokens)."""
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            ids,
            # Explicit: left out, generate would infer it from pad_token_id and mask every
            # prompt token equal to it.
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=GEN_NEW_TOKENS,
            pad_token_id=pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
    new = out.sequences[0, len(prompt):].tolist()
    if len(new) != GEN_NEW_TOKENS or (eos_token_id is not None and eos_token_id in new):
        return None
    logits = torch.cat(out.logits, dim=0).to(torch.float32)  # [steps, V], raw (unprocessed)
    assert logits.argmax(dim=-1).tolist() == new, "generate's tokens are not its logits' argmax"
    # The same greedy chain without a cache.
    seq = list(prompt)
    rows = []
    with torch.no_grad():
        for _ in range(GEN_NEW_TOKENS):
            row = model(input_ids=torch.tensor([seq], dtype=torch.long)).logits[0, -1]
            rows.append(row.to(torch.float32))
            seq.append(int(row.argmax()))
    nocache = torch.stack(rows)
    assert seq[len(prompt):] == new, (seq[len(prompt):], new)
    diff = float((nocache - logits).abs().max())
    assert diff < 1e-4, f"cached and uncached step logits differ by {diff}"
    gap = min(top2_gaps(logits) + top2_gaps(nocache))
    if gap < GEN_MIN_GAP:
        return None
    return new, min(top2_gaps(logits)), diff


def prompt_candidates(length):
    """Prompts of `length` ids < 96, in the order tried: TOKENS' prefix, then the prefixes of
    TOKENS rotated left by 1, 2, ..., then seeded random ids."""
    yield TOKENS[:length]
    for k in range(1, len(TOKENS)):
        yield (TOKENS[k:] + TOKENS[:k])[:length]
    for s in range(100):
        g = torch.Generator().manual_seed(2000 + 100 * length + s)
        yield torch.randint(0, 96, (length,), generator=g).tolist()


def generations(model, config):
    """generate.json's content: for each length in GEN_LENGTHS, the first candidate prompt whose
    greedy continuation is usable (see greedy_one)."""
    max_pos = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    eos = config.eos_token_id
    if eos is not None and eos >= config.vocab_size:
        eos = None  # GPT-2's 50256: cannot be generated with a 96-id vocab
    pad = eos if eos is not None else 0
    gen = {"max_new_tokens": GEN_NEW_TOKENS, "prompts": [], "new_tokens": [],
           "step_logits_top2_gap": []}
    max_diff = 0.0
    for length in GEN_LENGTHS:
        assert max_pos is None or length + GEN_NEW_TOKENS <= max_pos, (length, max_pos)
        for prompt in prompt_candidates(length):
            r = greedy_one(model, prompt, pad, eos)
            if r is not None:
                break
        else:
            raise SystemExit(f"no usable {length}-token prompt for {config.model_type}")
        new, gap, diff = r
        gen["prompts"].append(prompt)
        gen["new_tokens"].append(new)
        gen["step_logits_top2_gap"].append(gap)
        max_diff = max(max_diff, diff)
    return gen, max_diff


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
    if config.model_type == "bloom":
        norms = sorted(n for n, _ in model.named_parameters() if is_norm(n))
        assert len(norms) == 4 * config.n_layer + 4, norms  # 2 LayerNorms/layer + emb + ln_f
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
    gen, max_diff = generations(model, model.config)
    write_json(os.path.join(d, "generate.json"), gen)
    # Not written to the files: for the report only.
    exp = dict(exp, gen=gen, gen_cache_diff=max_diff)
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
        gen = exp["gen"]
        report.append(
            f"    generate: min top-2 gaps {[round(g, 4) for g in gen['step_logits_top2_gap']]}"
            f"  cache vs no-cache max diff {exp['gen_cache_diff']:.1e}")
        for p, t in zip(gen["prompts"], gen["new_tokens"]):
            report.append(f"      {p} -> {t}")
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
