#!/usr/bin/env bash
# Tessera plan `dp4 tp4 sp` for gpt2 on 2x8xH100 (batch 16 x seq 1024, bf16): predicted 0.0174 s per step, peak 1.21 GiB per device
# Run it on each of the 2 nodes with NODE_RANK (0 to 1) and MASTER_ADDR (node 0's address) set.
# Run it from a Megatron-LM checkout; data and tokenizer arguments (--data-path, --tokenizer-type, ...) follow as this script's arguments.
# The vocabulary (50257 tokens) comes from the tokenizer; Megatron-LM pads it to a multiple of 128 x tensor-parallel size.
set -euo pipefail
torchrun --nnodes 2 --nproc-per-node 8 --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --num-layers 12 --hidden-size 768 --ffn-hidden-size 3072 --num-attention-heads 12 \
    --seq-length 1024 --max-position-embeddings 1024 --norm-epsilon 0.00001 --openai-gelu \
    --hidden-dropout 0.1 --attention-dropout 0 \
    --micro-batch-size 4 --global-batch-size 16 --bf16 --clip-grad 1.0 \
    --tensor-model-parallel-size 4 --sequence-parallel \
    "$@"
