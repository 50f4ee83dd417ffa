#!/usr/bin/env bash
# One bench sitting on a multi-GPU machine (issues 4 and 7): NCCL calibration once per sitting, then
# `shardwise bench` of the MODEL (default llama) shape SIZE on NPROC GPUs with the calibrated link profile, rank 0's
# chrome trace of every system's profiled step packed into one tar.
# Usage (device tool, nvidia-h200-x2):
#   SHARDWISE_COMMIT=<hash> NPROC=2 SIZE=1b BATCH=4 SEQ=2048 SYSTEMS=shardwise,fsdp2 NAME=x bash bench/gpu_sitting.sh
# EXTRA=--checkpoint for checkpointed rows. DeepSpeed rows: carry .whl (its wheels); they are installed first.
# SYSTEM_TIMEOUT=S stops a system whose warm-up runs past S seconds, so the systems after it still run.
# A sitting may span several device commands (the machine stays warm between them): rows of one NAME
# append to one record kept in $SITTING on the device machine; each command copies that NAME's record,
# plot, log and traces, and the link profile, to $OUT (at most 8 files come back).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache} TORCH_CUDA_ARCH_LIST=9.0
SITTING=${SITTING:-/tmp/sitting}; mkdir -p "$SITTING"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NPROC=${NPROC:-2}; MODEL=${MODEL:-llama}; SIZE=${SIZE:-1b}; BATCH=${BATCH:-4}; SEQ=${SEQ:-2048}; SYSTEMS=${SYSTEMS:-shardwise}
NAME=${NAME:-h200-$MODEL$SIZE-ws$NPROC}; LINK=$SITTING/link-nccl-ws$NPROC.json
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$SITTING/machine.txt"
nvidia-smi topo -m >> "$SITTING/machine.txt" 2>&1
# LINK_FROM=<profile.json>: take an earlier machine's profile of the same kind instead of calibrating (~20 s)
if [ -n "${LINK_FROM:-}" ] && [ ! -f "$LINK" ]; then cp "$LINK_FROM" "$LINK"; fi
if [ "$NPROC" -gt 1 ] && [ ! -f "$LINK" ]; then
  timeout 120 torchrun --nproc-per-node "$NPROC" -m shardwise.cli calibrate --min-bytes 1024 \
    --max-bytes $((1 << 30)) --name "nccl-h200-ws$NPROC" --out "$LINK" 2>&1 | grep -v -i warn | tee "$SITTING/calibrate.log"
fi
LP=(); [ -f "$LINK" ] && LP=(--link-profile "$LINK")
timeout ${BENCH_TIMEOUT:-540} torchrun --nproc-per-node "$NPROC" -m shardwise.cli bench --model "$MODEL" --size "$SIZE" \
  --batch "$BATCH" --seq "$SEQ" --precision bf16 --systems "$SYSTEMS" --steps ${STEPS:-6} --warmup 2 "${LP[@]}" \
  --trace-dir "$SITTING/traces-$NAME" ${SYSTEM_TIMEOUT:+--system-timeout $SYSTEM_TIMEOUT} ${EXTRA:-} \
  --out "$SITTING" --name "$NAME" --append 2>&1 \
  | grep -v -i "warn" | tee -a "$SITTING/$NAME.log" | tail -40
(cd "$SITTING" && tar cf "$OUT/traces-$NAME.tar" "traces-$NAME" 2>/dev/null)
cp "$SITTING/$NAME".* "$SITTING/machine.txt" "$OUT"/ 2>/dev/null
cp "$SITTING"/link-*.json "$SITTING"/calibrate.log "$OUT"/ 2>/dev/null
ls -la "$OUT"
