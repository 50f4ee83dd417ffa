"""The parity matrix on a CUDA GPU: NCCL at ws=1, two gloo ranks sharing the GPU at ws=2.

Skipped by name on machines without a GPU; run on the GPU machine (see bench/gpu_spine.sh).
"""

import pytest
import torch

from harness import check

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


@needs_cuda
@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_parity_nccl_ws1(pools, strategy, name):
    check(pools, name, strategy, "fp64", 1, steps=4, device="cuda", backend="nccl", loss_tol=1e-10, param_tol=1e-10)


@needs_cuda
@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_parity_gloo_ws2_shared_gpu(pools, strategy, name):
    check(pools, name, strategy, "fp64", 2, steps=4, device="cuda", backend="gloo", loss_tol=1e-10, param_tol=1e-10)


@needs_cuda
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_cuda_fp32_parity_ws2(pools, strategy):
    # against single-device training on the same GPU (CPU kernels round differently); TF32 stays off
    over = (("bias", False),)
    check(pools, "gpt", strategy, "fp32", 2, steps=10, over=over, device="cuda", ref_device="cuda",
          loss_tol=1e-5, param_tol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_parity_nccl_ws2(pools, strategy, name):
    # two GPUs over NCCL, scheduler on (several collectives in flight on NCCL's stream)
    check(pools, name, strategy, "fp64", 2, steps=4, device="cuda", backend="nccl", loss_tol=1e-10, param_tol=1e-10)
