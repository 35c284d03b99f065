#!/usr/bin/env bash
# Tessera plan `dp16 tp1 zero1 shard=8 ckpt=full` for llama3-8b on 2x8xH100 (batch 16 x seq 4096, bf16): predicted 0.6716 s per step, peak 30.26 GiB per device
# Run it on each of the 2 nodes with NODE_RANK (0 to 1) and MASTER_ADDR (node 0's address) set.
# Run it from a Megatron-LM checkout; data and tokenizer arguments (--data-path, --tokenizer-type, ...) follow as this script's arguments.
# The vocabulary (128256 tokens) comes from the tokenizer; Megatron-LM pads it to a multiple of 128 x tensor-parallel size.
set -euo pipefail
torchrun --nnodes 2 --nproc-per-node 8 --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000 \
    --normalization RMSNorm --swiglu --norm-epsilon 0.00001 --disable-bias-linear --untie-embeddings-and-output-weights \
    --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 1 --global-batch-size 16 --bf16 --clip-grad 1.0 \
    --tensor-model-parallel-size 1 --use-distributed-optimizer --num-distributed-optimizer-instances 2 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    "$@"
