"""Matrix products that leave SMs free for communication kernels running beside them.

Hopper's cuBLAS products are persistent kernels: one block per SM on every SM. A collective kernel
queued behind one gets no SM until it ends, so a gather and the product beside it take turns instead
of overlapping (bench/results/2026-11-30-h200x2-sitting6-summary.md, the MoE forward). torch's
experimental SM carveout makes cuBLASLt size a product for fewer SMs. Each op here runs one product
with the carveout set, through cuBLASLt (the path that honours it on every torch we support), and
puts both settings back before it returns (also when it raises). The carveout pass
(passes/carveout.py) swaps them in for the products the cost model predicts to run beside a
collective. A product is one extern call under inductor too, so the setting cannot leak onto
another kernel. On CPU they are the plain products.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def _carved(x: torch.Tensor, sms: int):
    if x.device.type != "cuda" or sms <= 0:
        yield
        return
    blas = torch.backends.cuda.preferred_blas_library()
    before = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)
        torch.backends.cuda.preferred_blas_library(blas)


def _custom_op(name: str):
    """A custom op whose inputs may come in any strides (a product takes any): inductor then need
    not copy an input into a fixed layout for it."""
    tags = (torch.Tag.flexible_layout,) if hasattr(torch.Tag, "flexible_layout") else ()
    try:
        return torch.library.custom_op(name, mutates_args=(), tags=tags)
    except TypeError:  # a torch whose custom_op takes no tags
        return torch.library.custom_op(name, mutates_args=())


@_custom_op("shardwise::carved_mm")
def carved_mm(a: torch.Tensor, b: torch.Tensor, sms: int) -> torch.Tensor:
    with _carved(a, sms):
        return torch.mm(a, b)


@_custom_op("shardwise::carved_bmm")
def carved_bmm(a: torch.Tensor, b: torch.Tensor, sms: int) -> torch.Tensor:
    with _carved(a, sms):
        return torch.bmm(a, b)


@_custom_op("shardwise::carved_addmm")
def carved_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sms: int) -> torch.Tensor:
    with _carved(a, sms):
        return torch.addmm(bias, a, b)


@carved_mm.register_fake
def _(a, b, sms):
    return a.new_empty((a.shape[0], b.shape[1]))


@carved_bmm.register_fake
def _(a, b, sms):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


@carved_addmm.register_fake
def _(bias, a, b, sms):
    return a.new_empty((a.shape[0], b.shape[1]))


aten = torch.ops.aten
CARVED = {aten.mm.default: torch.ops.shardwise.carved_mm.default,
          aten.bmm.default: torch.ops.shardwise.carved_bmm.default,
          aten.addmm.default: torch.ops.shardwise.carved_addmm.default}
"""Each product the carveout pass swaps, and its carved op (same arguments, then the SMs)."""
