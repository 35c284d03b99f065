"""Reference for BERT masked-LM learning: transformers' BertForMaskedLM with bert-tiny's
configuration, trained as `tessera train --model bert-tiny` trains it (byte tokens, [MASK] =
256, 15% of positions with 80/10/10 replacement, AdamW with weight decay on matrices, warmup
+ cosine to a tenth, gradient clipping at 1), on the same corpus and held-out split (the last
10% of the bytes). Prints the held-out masked-LM loss. Used by scripts/bench-bert-mlm.sh; needs
torch and transformers.

usage: python bert_mlm_torch.py DATA STEPS BATCH SEQ LR
"""
import math
import random
import sys

import torch
from transformers import BertConfig, BertForMaskedLM

data_path, steps, batch, seq, peak = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
torch.manual_seed(0)
random.seed(0)
cfg = BertConfig(vocab_size=260, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=512, max_position_embeddings=256, hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1, layer_norm_eps=1e-12)
model = BertForMaskedLM(cfg)
data = list(open(data_path, "rb").read())
n_val = round(len(data) * 0.1)
train, val = data[: len(data) - n_val], data[len(data) - n_val:]
params = list(model.named_parameters())
opt = torch.optim.AdamW(
    [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": 0.1},
     {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}],
    lr=peak, betas=(0.9, 0.999), eps=1e-8)
warmup = steps // 20


def lr_at(s):
    if s <= warmup:
        return peak * s / max(warmup, 1)
    p = (s - warmup) / max(steps - warmup, 1)
    return peak * 0.1 + 0.5 * (peak - peak * 0.1) * (1 + math.cos(math.pi * p))


def mask(x, gen):
    labels = torch.full_like(x, -100)
    inp = x.clone()
    chosen = torch.rand(x.shape, generator=gen) < 0.15
    labels[chosen] = x[chosen]
    how = torch.rand(x.shape, generator=gen)
    inp[chosen & (how < 0.8)] = 256
    rnd = chosen & (how >= 0.8) & (how < 0.9)
    inp[rnd] = torch.randint(0, 260, x.shape, generator=gen)[rnd]
    return inp, labels


gen = torch.Generator().manual_seed(1)
model.train()
for step in range(1, steps + 1):
    rows = [random.randrange(0, len(train) - seq) for _ in range(batch)]
    inp, labels = mask(torch.tensor([train[r:r + seq] for r in rows]), gen)
    for g in opt.param_groups:
        g["lr"] = lr_at(step)
    loss = model(input_ids=inp, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
model.eval()
gen = torch.Generator().manual_seed(2)
losses = []
with torch.no_grad():
    windows = [val[i * seq:(i + 1) * seq] for i in range((len(val) - 1) // seq)]
    for b in range(min(16, len(windows) // batch)):
        inp, labels = mask(torch.tensor(windows[b * batch:(b + 1) * batch]), gen)
        losses.append(model(input_ids=inp, labels=labels).loss.item())
print(f"{sum(losses) / len(losses):.4f}")
