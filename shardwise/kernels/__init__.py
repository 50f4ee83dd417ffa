"""Kernels of products fused with their tensor-parallel collectives.

- ``ag_gemm`` (ag_gemm.py) and ``gemm_rs`` (gemm_rs.py): Triton kernels over torch symmetric memory,
  CUDA only; each module holds its public launcher and a pure-torch ``reference``; the Triton code
  is private (_triton.py).
- ring.py: the portable decomposed path in plain torch, on any process group.
"""

from __future__ import annotations

BLOCK_M = 128
"""The Triton products' tile height: a rank's rows must be a whole number of tiles."""


def applies(rows_per_rank: int, itemsize: int) -> bool:
    """Whether the Triton kernels take a shape: whole tiles of rows per rank, 16- or 32-bit floats."""
    return rows_per_rank % BLOCK_M == 0 and itemsize in (2, 4)


def available(device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA, with Triton and symmetric memory."""
    import torch

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True

