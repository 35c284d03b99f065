"""Exports the two models of BENCHMARKS.md's "ONNX import" section with freshly initialised
weights (torch 2.5.1, transformers 4.46.3, the TorchScript exporter, opset 17, dynamic batch and
sequence, do_constant_folding=False), and writes GPT-2's config.json for the built-in family.

usage: python scripts/bench_onnx_export.py OUT_DIR   (writes gpt2-124m.onnx, llama-8l.onnx,
       gpt2-124m-config/config.json)
"""

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def logits_only(cls):
    class M(cls):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False, return_dict=False)[0]

    return M


def export(model, vocab, path):
    ids = torch.randint(0, vocab, (1, 16))
    torch.onnx.export(
        model.eval(), (ids,), path, opset_version=17, do_constant_folding=False, dynamo=False,
        input_names=["input_ids"], output_names=["logits"],
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                      "logits": {0: "batch", 1: "sequence"}})


def main():
    out = sys.argv[1]
    os.makedirs(os.path.join(out, "gpt2-124m-config"), exist_ok=True)
    torch.manual_seed(0)
    gpt2 = GPT2Config(n_layer=12, n_embd=768, n_head=12, attn_pdrop=0, resid_pdrop=0, embd_pdrop=0)
    gpt2._attn_implementation = "eager"
    gpt2.to_json_file(os.path.join(out, "gpt2-124m-config", "config.json"))
    export(logits_only(GPT2LMHeadModel)(gpt2), gpt2.vocab_size, os.path.join(out, "gpt2-124m.onnx"))
    llama = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1344,
                        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=8192)
    llama._attn_implementation = "eager"
    export(logits_only(LlamaForCausalLM)(llama), llama.vocab_size,
           os.path.join(out, "llama-8l.onnx"))


if __name__ == "__main__":
    main()
