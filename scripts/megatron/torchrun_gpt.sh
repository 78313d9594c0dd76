#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with trainguard on one node (8 GPUs), restarts included:
# `trainguard run --` in front of the launch, `--trainguard-config` among pretrain_gpt's arguments.
# Your script runs as it is (trainguard's bootstrap guards megatron.training when it is imported).
#
#   MEGATRON_LM=~/Megatron-LM DATA=/data/my-corpus_text_document \
#       bash scripts/megatron/torchrun_gpt.sh --trainguard-config configs/megatron_trainguard.json
#
# Extra arguments go to pretrain_gpt.py (after the defaults below, so they win).
set -euo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to your Megatron-LM checkout}"
: "${DATA:?set DATA to a preprocessed dataset prefix}"
: "${NPROC_PER_NODE:=8}"
: "${MAX_RESTARTS:=3}"
: "${CKPT:=checkpoints/gpt}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

exec trainguard run -- torchrun --standalone --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" \
  "$MEGATRON_LM/pretrain_gpt.py" \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
  --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 256 \
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --train-iters 100000 \
  --clip-grad 1.0 --bf16 --data-path "$DATA" --split 98,2,0 \
  --vocab-file "${VOCAB:-gpt2-vocab.json}" --merge-file "${MERGES:-gpt2-merges.txt}" \
  --save "$CKPT" --load "$CKPT" --save-interval 1000 --eval-interval 1000 --eval-iters 10 \
  --log-interval 10 \
  "$@"
