#!/usr/bin/env python3
"""Writes the Hugging Face MoE parity fixtures under crates/tessera-cli/tests/fixtures/hf_moe/.

As scripts/make_hf_fixtures.py does for the dense families: each fixture is a tiny MoE causal
LM built by `transformers` from an explicit config, its weights re-initialised with a fixed
seed and a large std, written in fp32 in the Hub's per-expert layout
(`...experts.{e}.w1.weight` for Mixtral, `...mlp.experts.{e}.gate_proj.weight` for Qwen3-MoE
and DeepSeek-V3:
transformers 5 holds the experts fused in memory and converts on load, so the file is written
from the fused parameters here and reloaded through `from_pretrained` to check the layout), plus
`expected.json`:

    {"tokens": [...16 ids...],
     "logits": [[...V...], ...15 rows...],    # model(ids[:-1]).logits[0], fp32
     "ce": float,                             # mean CE of those logits vs ids[1:], float64
     "aux_loss": float,                       # transformers' load_balancing_loss over the
                                              # 15 positions' router logits (fp32)
     "loss": float}                           # ce + router_aux_loss_coef · aux_loss: what
                                              # transformers' loss is with output_router_logits

and `generate.json`, transformers' greedy `generate` (KV cache) on three prompts, as
scripts/make_hf_fixtures.py writes it for the dense families (same prompts rule, same checks).

`qwen2_moe` is written by `save_pretrained` itself (transformers converts its fused experts back
to the Hub's per-expert names on save), the others from the fused parameters as above.

`real_configs/<preset>.json`: the config.json values of the released checkpoints the MoE presets
reproduce, and `param_counts.json`: transformers' parameter count of each, built on the meta
device (no memory). Sources of the values: each checkpoint's config.json on the Hugging Face Hub
(mistralai/Mixtral-8x7B-v0.1, mistralai/Mixtral-8x22B-v0.1, Qwen/Qwen1.5-MoE-A2.7B,
Qwen/Qwen2-57B-A14B, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B), copied here by hand (there is no
Hub access where this runs); only the fields that shape the model and its defaults matter to the
count.

Also `deepseek_v3_params.json`: DeepSeek-V3's parameter count on the meta device and the
numel of its `e_score_correction_bias` buffers.

usage: scripts/make-moe-fixtures.sh   (sets up .venv-moe, then runs this)
"""

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
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import generations, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "tessera-cli", "tests", "fixtures", "hf_moe")
MAX_DIR_BYTES = 1 << 20

TOKENS = [3, 17, 42, 8, 95, 0, 61, 17, 29, 88, 5, 42, 73, 11, 50, 3]


def common(**extra):
    cfg = dict(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        output_router_logits=True,
        dtype="float32",
    )
    cfg.update(extra)
    return cfg


FIXTURES = {
    # Mixtral: 4 experts of width 48, top 2 renormalised, aux coefficient 0.02, no window.
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        common(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
               router_aux_loss_coef=0.02, sliding_window=None),
    ),
    # Qwen3-MoE: q/k norms, head_dim 16 (not hidden/heads), 3 layers of which layer 0 is a
    # dense MLP (mlp_only_layers), 8 experts of width 32, top 2 not renormalised.
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        common(num_hidden_layers=3, head_dim=16, intermediate_size=80, moe_intermediate_size=32,
               num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
               mlp_only_layers=[0], router_aux_loss_coef=0.01, rope_theta=1000000.0),
    ),
    # Qwen2-MoE: q/k/v biases, hidden 32, 3 layers of which layer 1 is a dense MLP
    # (mlp_only_layers), 4 experts of width 16, top 2 not renormalised, a shared expert of width
    # 24 behind its sigmoid gate.
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        common(hidden_size=32, num_hidden_layers=3, intermediate_size=40,
               moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
               num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
               mlp_only_layers=[1], router_aux_loss_coef=0.02, rope_theta=1000000.0),
    ),
    # DeepSeek-V3: multi-head latent attention with a low-rank q (rank 24) and kv latent (16),
    # 8 + 4 q/k head dims (interleaved RoPE pairs) and v 8 (narrower: tessera pads it), YaRN
    # x4 over 32 positions with mscale != mscale_all_dim (attention factor and softmax scale
    # both != 1); layer 0 dense, then 8 experts of width 16 in 4 groups (2 kept), top 3,
    # renormalised and scaled by 2.5, two shared experts; a non-zero correction bias (set in
    # reinit). DeepseekV3ForCausalLM adds no auxiliary loss.
    "deepseek_v3": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        common(hidden_size=32, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48,
               moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
               n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
               routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
               rope_interleave=True, output_router_logits=False, max_position_embeddings=128,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                    original_max_position_embeddings=32, beta_fast=32.0,
                                    beta_slow=1.0, mscale=0.8, mscale_all_dim=0.5)),
    ),
}

# Released checkpoints' config.json values (see the module docs for the sources).
REAL_CONFIGS = {
    "mixtral-8x7b": (MixtralForCausalLM, MixtralConfig, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
        router_aux_loss_coef=0.02, sliding_window=None, tie_word_embeddings=False,
        hidden_act="silu", torch_dtype="bfloat16")),
    "mixtral-8x22b": (MixtralForCausalLM, MixtralConfig, dict(
        vocab_size=32000, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
        num_attention_heads=48, num_key_value_heads=8, max_position_embeddings=65536,
        num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
        router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False,
        hidden_act="silu", torch_dtype="bfloat16")),
    "qwen1.5-moe-a2.7b": (Qwen2MoeForCausalLM, Qwen2MoeConfig, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=8192,
        num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1,
        rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False, sliding_window=32768,
        max_window_layers=21, router_aux_loss_coef=0.001, tie_word_embeddings=False,
        hidden_act="silu", torch_dtype="bfloat16")),
    "qwen2-57b-a14b": (Qwen2MoeForCausalLM, Qwen2MoeConfig, dict(
        vocab_size=151936, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=2560,
        shared_expert_intermediate_size=20480, norm_topk_prob=False, decoder_sparse_step=1,
        rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False, sliding_window=131072,
        max_window_layers=28, router_aux_loss_coef=0.001, tie_word_embeddings=False,
        hidden_act="silu", torch_dtype="bfloat16")),
    "qwen3-30b-a3b": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6, attention_bias=False,
        use_sliding_window=False, sliding_window=None, max_window_layers=48,
        router_aux_loss_coef=0.001, tie_word_embeddings=False, hidden_act="silu",
        torch_dtype="bfloat16")),
    "qwen3-235b-a22b": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=1536, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6, attention_bias=False,
        use_sliding_window=False, sliding_window=None, max_window_layers=94,
        router_aux_loss_coef=0.001, tie_word_embeddings=False, hidden_act="silu",
        torch_dtype="bfloat16")),
}

# deepseek-ai/DeepSeek-V3's config.json (architecture keys), for the parameter count.
DEEPSEEK_V3 = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                         original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                         mscale=1.0, mscale_all_dim=1.0),
)


def reinit(model, seed):
    """Every parameter ~ N(0, 0.3²), norm weights 1 + N(0, 0.2²), in name order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            value = 1.0 + 0.2 * noise if "norm" in name else 0.3 * noise
            p.copy_(value.to(p.dtype))
        # DeepSeek-V3's correction bias is a buffer (zeros by default): make it matter.
        for name, buf in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                buf.copy_((0.3 * torch.randn(buf.shape, generator=g, dtype=torch.float64))
                          .to(buf.dtype))


def hub_state_dict(model, model_type):
    """The state dict in the Hub's per-expert layout (transformers 4.x names)."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                gate, up = t[e, :f], t[e, f:]
                if model_type == "mixtral":
                    prefix2 = prefix.replace(".mlp.", ".block_sparse_moe.")
                    out[f"{prefix2}{e}.w1.weight"] = gate.clone()
                    out[f"{prefix2}{e}.w3.weight"] = up.clone()
                else:
                    out[f"{prefix}{e}.gate_proj.weight"] = gate.clone()
                    out[f"{prefix}{e}.up_proj.weight"] = up.clone()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                if model_type == "mixtral":
                    prefix2 = prefix.replace(".mlp.", ".block_sparse_moe.")
                    out[f"{prefix2}{e}.w2.weight"] = t[e].clone()
                else:
                    out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        elif model_type == "mixtral" and ".mlp.gate." in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t.clone()
        else:
            out[name] = t.clone()
    return out


def save(model, config, d):
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    if config.model_type == "qwen2_moe":
        model.save_pretrained(d)
        sd = safetensors.torch.load_file(os.path.join(d, "model.safetensors"))
        assert any(".experts.0.gate_proj.weight" in k for k in sd), sorted(sd)
    else:
        config.save_pretrained(d)
        sd = hub_state_dict(model, config.model_type)
        safetensors.torch.save_file(sd, os.path.join(d, "model.safetensors"),
                                    metadata={"format": "pt"})
    for name in os.listdir(d):
        if name not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(d, name))
    return sd


def expected(model, tokens):
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids[:, :-1], output_router_logits=True)
    logits = out.logits[0].to(torch.float32)
    ce = torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:]).item()
    aux = float(out.aux_loss) if out.aux_loss is not None else 0.0
    coef = getattr(model.config, "router_aux_loss_coef", 0.0)
    return {
        "tokens": tokens,
        "shape": list(logits.shape),
        "ce": ce,
        "aux_loss": aux,
        "router_aux_loss_coef": coef,
        "loss": ce + coef * aux,
        "logits": [[float(x) for x in row] for row in logits.tolist()],
    }


def make_fixture(name, seed, config_cls, model_cls, cfg):
    config = config_cls(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    reinit(model, seed)
    d = os.path.join(OUT, name)
    sd = save(model, config, d)
    # Reload the per-expert file as a user would: every tensor must come back.
    reloaded = model_cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float32)
    reloaded.eval()
    for k, v in model.state_dict().items():
        assert torch.equal(v, reloaded.state_dict()[k]), f"{name}: {k} changed on reload"
    exp = expected(reloaded, TOKENS)
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(exp, f, separators=(",", ":"))
        f.write("\n")
    gen, _ = generations(reloaded, reloaded.config)
    write_json(os.path.join(d, "generate.json"), gen)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    assert size < MAX_DIR_BYTES, (name, size)
    print(f"{name}: {len(sd)} tensors, {size} bytes, loss {exp['loss']:.6f} "
          f"(ce {exp['ce']:.6f}, aux {exp['aux_loss']:.6f})")


def real_counts():
    """real_configs/<preset>.json and param_counts.json: transformers' count on the meta device."""
    d = os.path.join(OUT, "real_configs")
    os.makedirs(d, exist_ok=True)
    counts = {}
    for preset, (model_cls, config_cls, values) in sorted(REAL_CONFIGS.items()):
        config = config_cls(**values)
        config.save_pretrained(os.path.join(d, "tmp"))
        os.replace(os.path.join(d, "tmp", "config.json"), os.path.join(d, f"{preset}.json"))
        shutil.rmtree(os.path.join(d, "tmp"))
        with torch.device("meta"):
            model = model_cls(config)
        counts[preset] = sum(p.numel() for p in model.parameters())
        print(f"{preset}: {counts[preset]:,} parameters")
    with open(os.path.join(OUT, "param_counts.json"), "w") as f:
        json.dump(counts, f, indent=1, sort_keys=True)
        f.write("\n")


def deepseek_v3_count():
    """DeepSeek-V3's parameter count on the meta device (transformers builds no MTP layer),
    and the numel of its e_score_correction_bias buffers (which tessera holds as parameters)."""
    config = DeepseekV3Config(**DEEPSEEK_V3)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    out = {"deepseek-v3": {"parameters": model.num_parameters(), "e_score_correction_bias": bias}}
    with open(os.path.join(OUT, "deepseek_v3_params.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"deepseek-v3: {out}")


def main():
    os.makedirs(OUT, exist_ok=True)
    real_counts()
    deepseek_v3_count()
    # Seeds fixed per fixture when it was added (a fixture added later does not change the
    # others' weights; qwen2_moe and deepseek_v3 were added the same day, both with 1002).
    seeds = {"mixtral": 1000, "qwen3_moe": 1001, "qwen2_moe": 1002, "deepseek_v3": 1002}
    for name, (config_cls, model_cls, cfg) in sorted(FIXTURES.items()):
        make_fixture(name, seeds[name], config_cls, model_cls, cfg)
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }
    with open(os.path.join(OUT, "versions.json"), "w") as f:
        json.dump(versions, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
