#!/usr/bin/env bash
# Tessera plan `dp2 tp2 pp2 mb8 sched=interleaved:2 ckpt=full` for llama2-7b on 8xH100 (batch 16 x seq 4096, bf16): predicted 1.0605 s per step, peak 28.14 GiB per device
# Run it from a Megatron-LM checkout; data and tokenizer arguments (--data-path, --tokenizer-type, ...) follow as this script's arguments.
# The vocabulary (32000 tokens) comes from the tokenizer; Megatron-LM pads it to a multiple of 128 x tensor-parallel size.
set -euo pipefail
torchrun --nnodes 1 --nproc-per-node 8 --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \
    --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --swiglu \
    --norm-epsilon 0.00001 --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 1 --global-batch-size 16 --bf16 --clip-grad 1.0 \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    "$@"
