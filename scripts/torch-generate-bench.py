"""PyTorch baseline of the GPU check's `decode_speed`: tokens/s of Hugging Face transformers'
greedy `generate` with the KV cache on one CUDA GPU, bf16 weights and activations, for the same
model configurations as Tessera's presets (fresh random weights, torch seed 0), batch 1, a
128-token prompt and 128 new tokens. Prints one JSON line per model.

    python3 scripts/torch-generate-bench.py [MODEL ...] [--prompt 128] [--new 128] [--repeats 3]
                                            [--static-compile]

MODEL: gpt2-medium, llama-1.3b (default: both). Runs offline: the models are built from their
configs (no download), with HF_HUB_OFFLINE set.

Counted as Tessera counts (`tessera generate`, the check's `decode_speed`): the decode is every
step after the first new token, so decode tokens/s = (new − 1) / (t(new) − t(1)), where t(n) is
the wall time of a `generate` of n new tokens (synchronised before and after; the median of
`--repeats` runs after a warm-up), and t(1) is the time to the first token (prompt and first
step). Taking the difference leaves out whatever the first step costs, however `generate`
synchronises internally. `--static-compile` also measures transformers' static KV cache under
`torch.compile` (slow to compile: minutes).
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

# Tessera's presets (crates/tessera-models/src/presets.rs).
GPT2 = {"gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16), "gpt2": dict(n_embd=768, n_layer=12, n_head=12)}
LLAMA = {
    "llama-1.3b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                       rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
}


def build(name):
    if name in LLAMA:
        cfg, cls = LlamaConfig(**LLAMA[name]), LlamaForCausalLM
    elif name in GPT2:
        cfg = GPT2Config(vocab_size=50257, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         **GPT2[name])
        cls = GPT2LMHeadModel
    else:
        sys.exit(f"unknown model {name}: give one of {sorted(GPT2) + sorted(LLAMA)}")
    # Initialised on the GPU (seconds, where a 1.3B model's initialisation on the CPU takes a minute).
    with torch.device("cuda"):
        model = cls(cfg)
    model = model.to(dtype=torch.bfloat16).eval()
    # Exactly the asked-for new tokens, as Tessera's check (no end-of-sequence token).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, cfg.vocab_size


def timed_generate(model, ids, new, **extra):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, num_beams=1, use_cache=True, **extra)
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    got = out.shape[1] - ids.shape[1]
    if got != new:
        sys.exit(f"generate made {got} tokens, not {new}")
    return s


def measure(model, ids, new, repeats, **extra):
    timed_generate(model, ids, new, **extra)  # warm-up (and compilation)
    timed_generate(model, ids, 1, **extra)
    full = statistics.median(timed_generate(model, ids, new, **extra) for _ in range(repeats))
    first = statistics.median(timed_generate(model, ids, 1, **extra) for _ in range(repeats))
    decode = max(full - first, 1e-9)
    return {
        "tokens_per_s": round((new - 1) / decode, 1),
        "ms_per_token": round(decode / (new - 1) * 1e3, 3),
        "time_to_first_token_s": round(first, 4),
        "tokens_per_s_with_prefill": round(new / full, 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=["gpt2-medium", "llama-1.3b"])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--static-compile", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible to torch")
    for name in a.models:
        torch.manual_seed(0)
        model, vocab = build(name)
        ids = torch.randint(0, vocab, (1, a.prompt), device="cuda")
        variants = [("eager_dynamic_cache", {})]
        if a.static_compile:
            variants.append(("static_cache_compiled", {"cache_implementation": "static"}))
        for label, extra in variants:
            if label == "static_cache_compiled":
                model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            with torch.inference_mode():
                r = measure(model, ids, a.new, a.repeats, **extra)
            print(json.dumps({"check": "torch_decode_speed", "model": name, "dtype": "bf16", "batch": 1,
                              "prompt": a.prompt, "new_tokens": a.new, "variant": label,
                              "attn": getattr(model.config, "_attn_implementation", None), **r,
                              "torch": torch.__version__, "transformers": transformers.__version__,
                              "device": torch.cuda.get_device_name()}), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
