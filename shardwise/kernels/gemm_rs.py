"""GEMM + reduce-scatter: this rank's block of ``(a @ w).view(shape) + c`` summed over a tp group and
cut along ``dim``; the tiles bound for other ranks computed first and stored into theirs as they
finish, then each rank sums the blocks it received (the Triton kernels, _triton.py).

``gemm_rs`` is the launcher (CUDA, torch symmetric memory); ``reference`` is the same function in
plain torch over every rank's operands, in one process.
"""

from __future__ import annotations

import torch


def reference(parts: list[tuple], shape: list[int], dim: int) -> list[torch.Tensor]:
    """Each rank's block: ``parts`` holds every rank's ``(a, w, c or None)``."""
    total = sum((a @ w).view(shape) + (c.view(shape) if c is not None else 0) for a, w, c in parts)
    return list(total.chunk(len(parts), dim))


def gemm_rs(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, shape: list[int], dim: int,
            group: str) -> torch.Tensor:
    """This rank's ``reference`` block over process group ``group``, by the Triton kernels."""
    from ._triton import gemm_rs as run

    return run(a, w, c, shape, dim, group)
