"""PyTorch eager (and torch.compile) baseline for the GPU check: tokens/s of one training step
(forward, backward, gradient-norm clipping, AdamW, the loss read back) of a Hugging Face GPT-2
or LLaMA configuration (the sizes and dropout of Tessera's presets) at the same batch, sequence
and precision as Tessera's `speed` check. Prints one JSON line per run.

    python3 scripts/torch-train-bench.py gpt2-medium 4 1024 [--compile] [--no-fp32]
    python3 scripts/torch-train-bench.py llama-1.3b 4 2048 --compile --no-fp32
"""
import json, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

SIZES = {"gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16), "gpt2": dict(n_embd=768, n_layer=12, n_head=12)}
# Tessera's `llama-1.3b` preset (tessera-models/src/presets.rs).
LLAMA = {"llama-1.3b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=24,
                            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)}

def build(name, seq):
    if name in LLAMA:
        cfg = LlamaConfig(**LLAMA[name])
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg), cfg.vocab_size
    # Tessera's GPT-2 presets: embedding and residual dropout 0.1 (HF's defaults); no dropout on
    # the attention probabilities (Tessera's attention is one fused op without it).
    cfg = GPT2Config(n_positions=max(1024, seq), vocab_size=50257, resid_pdrop=0.1, embd_pdrop=0.1,
                     attn_pdrop=0.0, **SIZES[name])
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg), cfg.vocab_size

def run(name, batch, seq, dtype, compile_):
    model, vocab = build(name, seq)
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    step_fn = model
    if compile_:
        step_fn = torch.compile(model)
    # The step Tessera's trainer takes: forward, backward, the global gradient norm clipped at
    # 1.0 (TrainConfig's default), AdamW, and the loss read back on the host.
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = step_fn(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    s = (time.perf_counter() - t0) / reps
    print(json.dumps({"check": "torch", "model": name, "dtype": dtype, "compile": compile_, "batch": batch,
                      "seq": seq, "step_s": round(s, 4), "tokens_per_s": round(batch * seq / s, 1),
                      "peak_bytes": torch.cuda.max_memory_allocated()}), flush=True)
    del model, opt, step_fn
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

if __name__ == "__main__":
    name, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for dtype in ("bf16",) if "--no-fp32" in sys.argv else ("bf16", "fp32"):
        run(name, batch, seq, dtype, False)
    if "--compile" in sys.argv:
        run(name, batch, seq, "bf16", True)
