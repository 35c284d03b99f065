"""How far PyTorch's own bf16 mixed precision moves a loss curve from fp32: the independent
reference for the GPU check's bf16-curve bound (BENCHMARKS.md, "CUDA backend", training).

A Hugging Face LLaMA (or GPT-2) of Tessera's tiny presets' sizes trains 50 AdamW steps on
byte windows of the shipped corpus (batch 4 x 64, lr 3e-4, Tessera's AdamW settings, gradient
norm clipped at 1.0) in fp32 and under `torch.autocast(bfloat16)` with fp32 parameters, from the
same initialisation and data; then both again with the learning rate one f32 ulp higher.
Prints one JSON line per model and seed: the max |loss difference| of each pair.

    python3 scripts/torch-bf16-spread.py [llama-tiny|gpt2-tiny] [seeds]

LR=1e-3 sets another learning rate; SCALED_INIT=1 draws the residual projections as Tessera
does (std 0.02 / sqrt(2 * layers)) instead of Hugging Face's 0.02.
"""
import json, os, sys
import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

STEPS, BATCH, SEQ = 50, 4, 64
LR = float(os.environ.get("LR", "3e-4"))

def build(name):
    if name == "llama-tiny":  # tessera-models/src/presets.rs
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                          rms_norm_eps=1e-5)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg)
    cfg = GPT2Config(vocab_size=256, n_positions=256, n_embd=256, n_layer=8, n_head=8,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)

def batches(seed):
    text = open(os.path.join(os.path.dirname(__file__), "..", "data", "shakespeare.txt"), "rb").read()
    data = torch.tensor(np.frombuffer(text[: len(text) * 9 // 10], dtype=np.uint8).astype(np.int64))
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        rows = torch.stack([data[s : s + SEQ + 1] for s in starts])
        yield rows[:, :-1], rows[:, 1:]

def curve(name, seed, bf16, lr):
    torch.manual_seed(seed)
    model = build(name)
    if os.environ.get("SCALED_INIT") == "1":
        # Tessera's initialisation (tessera-runtime/src/init.rs): the projections that write
        # into the residual stream drawn with std 0.02 / sqrt(2 * layers) (GPT-2's scaling).
        layers = model.config.num_hidden_layers
        for n, p in model.named_parameters():
            if n.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):
                torch.nn.init.normal_(p, std=0.02 / (2 * layers) ** 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for x, y in batches(seed + 1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses

def main():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-tiny"
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    lr_ulp = float(np.nextafter(np.float32(LR), np.float32(1.0)))
    for seed in range(seeds):
        f32, f32u = curve(name, seed, False, LR), curve(name, seed, False, lr_ulp)
        b16, b16u = curve(name, seed, True, LR), curve(name, seed, True, lr_ulp)
        d = lambda a, b: max(abs(p - q) for p, q in zip(a, b))
        print(json.dumps({"model": name, "seed": seed, "first": f32[0], "last": f32[-1],
                          "bf16_vs_fp32": d(b16, f32), "fp32_lr_plus_1ulp": d(f32u, f32),
                          "bf16_lr_plus_1ulp": d(b16u, b16)}), flush=True)

if __name__ == "__main__":
    main()
