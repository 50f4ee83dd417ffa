#!/usr/bin/env bash
# Issue 5 on one H200 capped at 32 GiB (memory fraction 0.2285): the Llama-3.2-3B shape (dim 3072, 28
# layers, 24 heads, 8 KV heads, FFN 8192, vocab 128256, untied head), batch 2 x 2048, bf16 compute with
# fp32 master weights and Adam state. Usage (device tool): SYSTEMS=... CKPT=--checkpoint bash bench/gpu_issue5.sh
# One sitting may span several device commands (the machine stays warm between them): every command
# appends its rows to one record kept in $SITTING (on the device machine) and copies it to $OUT.
# The device copy's git metadata may name an older commit: give SHARDWISE_COMMIT=<hash> in the command.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache} TORCH_CUDA_ARCH_LIST=9.0
# every system runs with the allocator that grows segments (a 32 GiB cap leaves no room for fragmentation)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
SYSTEMS=${SYSTEMS:-shardwise:offload=1}; NAME=${NAME:-h200-32g-llama3b}; SITTING=${SITTING:-/tmp/sitting}
mkdir -p "$SITTING"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/machine.txt"
timeout ${BENCH_TIMEOUT:-540} torchrun --nproc-per-node 1 -m shardwise.cli bench --model llama --size 3b \
  --batch 2 --seq 2048 --precision bf16 --memory-fraction 0.2285 --systems "$SYSTEMS" --steps ${STEPS:-3} \
  --warmup 2 ${CKPT:-} ${EXTRA:-} --out "$SITTING" --name "$NAME" --append 2>&1 | grep -v -i "warn" | tee -a "$SITTING/$NAME.log" | tail -40
cp "$SITTING"/* "$OUT"/
