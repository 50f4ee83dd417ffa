"""All-gather + GEMM: ``g = all_gather(x, dim)`` over a tp group and ``g @ w`` for each weight, the
products computed tile by tile as the shards arrive (the Triton kernel, _triton.py).

``ag_gemm`` is the launcher (CUDA, torch symmetric memory); ``reference`` is the same function in
plain torch over every rank's shard, in one process.
"""

from __future__ import annotations

import torch


def reference(shards: list[torch.Tensor], ws: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    """``[g, *(g as rows of its last dim) @ w for w in ws]``, ``g`` the shards put together along ``dim``."""
    g = torch.cat(shards, dim)
    rows = g.reshape(-1, g.shape[-1])
    return [g, *(rows @ w for w in ws)]


def ag_gemm(x: torch.Tensor, ws: list[torch.Tensor], dim: int, group: str) -> list[torch.Tensor]:
    """This rank's ``reference`` of every rank's ``x`` over process group ``group``, by the Triton kernel."""
    from ._triton import ag_gemm as run

    return run(x, ws, dim, group)


def product_share(m: int, k: int, n: int, device) -> float:
    """The kernels' bf16 product rate over cuBLAS's on an (m, k) by (k, n) product, the GEMM both
    kernels run (``shardwise calibrate``)."""
    from ._triton import product_share as share

    return share(m, k, n, device)
