#!/usr/bin/env python3
"""PyTorch CPU baseline for `tessera train`: the same GPT-2 or LLaMA training step, timed.

A self-contained GPT-2 (Hugging Face GPT2LMHeadModel's architecture, no `transformers`):
token + position embeddings, embedding dropout, pre-LN blocks with a fused qkv projection,
causal attention, gelu_new (tanh GELU), residual dropout, final LayerNorm, lm_head tied to
wte, cross-entropy. Like Tessera it applies embd_pdrop and resid_pdrop but not attn_pdrop.
The step matches Tessera's trainer: AdamW(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
on 2-D parameters only; PyTorch's default fused/foreach choice), clip_grad_norm_(1.0), fp32.

A self-contained LLaMA (LlamaForCausalLM's architecture): RMSNorm (eps 1e-6), RoPE (theta
10000, rotate_half), grouped-query attention, SwiGLU MLP without biases, untied lm_head.

`--dtype bf16` runs the forward and loss under `torch.autocast("cpu", torch.bfloat16)`
(PyTorch's mixed precision on the CPU: fp32 parameters and optimizer, bf16 matmuls through
oneDNN, which uses AVX512_BF16/AMX where the CPU has them); the backward follows autocast's
casts. Tessera's `--dtype bf16` keeps bf16 weights with an fp32 master copy.

Random token batches, generated before timing (Tessera also fetches a batch outside its
per-step timer). `--warmup` untimed steps, then `--steps` timed ones.
Prints one JSON object: tokens_per_s, step_s, params, ...

usage: bench_torch_lm.py --model gpt2 --batch 4 --seq 256 --steps 4 [--attn sdpa|eager]
                         [--dtype fp32|bf16]
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# Same fields as crates/tessera-models/src/presets.rs.
PRESETS = {
    "gpt2": dict(vocab=50257, n_positions=1024, d=768, layers=12, heads=12, pdrop=0.1),
    "gpt2-tiny": dict(vocab=256, n_positions=256, d=256, layers=8, heads=8, pdrop=0.0),
}
LLAMA_PRESETS = {
    "llama-tiny": dict(vocab=256, d=256, ffn=688, layers=8, heads=8, kv_heads=4, n_positions=256),
}
# Parameter counts Tessera reports for these presets.
EXPECTED_PARAMS = {"gpt2": 124_439_808, "gpt2-tiny": 6_449_664, "llama-tiny": 5_935_360}


class Block(nn.Module):
    def __init__(self, d, heads, pdrop, attn):
        super().__init__()
        self.heads, self.attn_kind = heads, attn
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.c_attn = nn.Linear(d, 3 * d)  # fused q, k, v (HF's Conv1D, transposed)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(pdrop)

    def attention(self, x):
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.attn_kind == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # eager: HF's GPT2Attention._attn (matmul, causal mask, softmax, matmul)
            w = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
            o = F.softmax(w, dim=-1) @ v
        o = o.transpose(1, 2).contiguous().view(b, s, d)
        return self.drop(self.attn_proj(o))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")  # gelu_new
        return x + self.drop(self.mlp_proj(h))


class GPT2(nn.Module):
    def __init__(self, vocab, n_positions, d, layers, heads, pdrop, attn="sdpa"):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(n_positions, d)
        self.drop = nn.Dropout(pdrop)
        self.h = nn.ModuleList(Block(d, heads, pdrop, attn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        # HF GPT2PreTrainedModel._init_weights: N(0, 0.02), c_proj scaled by 1/sqrt(2L).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids, labels):
        s = ids.size(1)
        x = self.drop(self.wte(ids) + self.wpe.weight[:s])
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied lm_head, no bias
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1))


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, d, ffn, heads, kv_heads, attn):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.attn_kind = heads, kv_heads, d // heads, attn
        self.input_layernorm = RMSNorm(d)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d)
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def attention(self, x, cos, sin):
        b, s, d = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.attn_kind == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            w = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            o = F.softmax(w.masked_fill(~mask, torch.finfo(w.dtype).min), dim=-1) @ v
        return self.o_proj(o.transpose(1, 2).reshape(b, s, d))

    def forward(self, x, cos, sin):
        x = x + self.attention(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, vocab, d, ffn, layers, heads, kv_heads, n_positions, attn="sdpa"):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            LlamaBlock(d, ffn, heads, kv_heads, attn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(n_positions, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, ids, labels):
        s = ids.size(1)
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(PRESETS) + sorted(LLAMA_PRESETS), default="gpt2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = PRESETS.get(args.model) or LLAMA_PRESETS[args.model]
    if args.seq > cfg["n_positions"]:
        ap.error(f"--seq {args.seq} exceeds {args.model}'s {cfg['n_positions']} positions")
    arch = GPT2 if args.model in PRESETS else Llama
    model = arch(**cfg, attn=args.attn)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    expected = EXPECTED_PARAMS[args.model]
    if params != expected:
        raise SystemExit(f"{args.model}: {params} parameters, Tessera has {expected}")

    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    n = args.warmup + args.steps
    batches = []
    for _ in range(n):
        tokens = torch.randint(0, cfg["vocab"], (args.batch, args.seq + 1), dtype=torch.long)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))

    def step(ids, labels):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = model(ids, labels)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item(), norm.item()

    losses, times = [], []
    for i, (ids, labels) in enumerate(batches):
        t0 = time.perf_counter()
        loss, _ = step(ids, labels)
        dt = time.perf_counter() - t0
        losses.append(loss)
        if i >= args.warmup:
            times.append(dt)
    tokens_per_step = args.batch * args.seq
    total = sum(times)
    print(json.dumps({
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "attn": args.attn,
        "dtype": args.dtype,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "tokens_per_s": tokens_per_step * len(times) / total,
        "step_s": total / len(times),
        "step_s_median": statistics.median(times),
        "step_s_all": times,
        "params": params,
        "initial_loss": losses[0],
        "final_loss": losses[-1],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "optimizer": {k: opt.defaults.get(k) for k in ("foreach", "fused")},
    }))


if __name__ == "__main__":
    main()
