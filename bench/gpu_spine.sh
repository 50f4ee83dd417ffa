#!/usr/bin/env bash
# Issue 2 on the GPU machine: the test suite (CPU tests under the machine's torch, plus the CUDA
# parity tests), the demo under torchrun on NCCL, and a 1B Llama-shape step on one GPU.
# Usage (device tool): bash bench/gpu_spine.sh   — logs go to $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)" | tee -a "$OUT/machine.txt"
echo "== tests"; timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" | tail -25
echo "== demo under torchrun (NCCL)"
timeout 120 torchrun --nproc-per-node 1 -m shardwise.cli train --model llama --size small --steps 20 --precision bf16 2>&1 \
  | grep -v Warning | tee "$OUT/demo.log" | tail -6
echo "== llama 1b, bf16, zero3, ws=1, batch 4x2048"
timeout 150 torchrun --nproc-per-node 1 -m shardwise.cli train --model llama --size 1b --strategy zero3 --steps 8 \
  --batch 4 --seq 2048 --precision bf16 --lr 3e-4 2>&1 | grep -v Warning | tee "$OUT/llama1b.log" | tail -10
