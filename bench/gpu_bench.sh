#!/usr/bin/env bash
# Issue 4 on one H200: `shardwise bench` of the 1.1B Llama shape (dim 2048, 16 layers, 16 heads, 8 KV
# heads, FFN 8192, vocab 32000), batch 4 x 2048, bf16 compute with fp32 master weights and optimizer,
# no activation checkpointing, at one rank: plain torch.compile vs shardwise vs FSDP2.
# Usage (device tool): SYSTEMS=compile,shardwise,fsdp2 NPROC=1 bash bench/gpu_bench.sh   — results in $OUT.
# One sitting may span several device commands (the machine stays warm between them): every command
# appends its rows to one record kept in $SITTING (on the device machine) and copies it to $OUT.
# Checkpointing rows: EXTRA=--checkpoint NAME=...-ckpt. DeepSpeed rows: carry .whl and install it first.
# The device copy's git metadata may name an older commit: give SHARDWISE_COMMIT=<hash> in the command.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
NPROC=${NPROC:-1}; SYSTEMS=${SYSTEMS:-compile,shardwise,fsdp2}; NAME=${NAME:-h200-llama1b-ws$NPROC}
SITTING=${SITTING:-/tmp/sitting}; mkdir -p "$SITTING"; export TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
timeout ${BENCH_TIMEOUT:-540} torchrun --nproc-per-node "$NPROC" -m shardwise.cli bench --model llama --size 1b \
  --batch 4 --seq 2048 --precision bf16 --systems "$SYSTEMS" --steps ${STEPS:-6} --warmup 2 ${EXTRA:-} \
  --out "$SITTING" --name "$NAME" --append 2>&1 | grep -v -i "warn" | tee -a "$SITTING/$NAME.log" | tail -30
cp "$SITTING"/* "$OUT"/
