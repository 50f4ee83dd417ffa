"""Predicted time of a tensor-parallel product fused with its collective (passes/fuse_tp.py), three ways:

- ``plain``: the collective, then the products (what the tp partition makes; its collectives are not overlapped, so the
  two add);
- ``ring``: the decomposed path (kernels/ring.py): ``p`` steps (``chunks`` for an all-reduce), each step's products
  running beside the next step's transfer; a step takes the longer of the two, and the products of a block of rows
  re-read the whole weight; each step costs the host some time too;
- ``kernel``: the Triton kernels over symmetric memory (kernels/ag_gemm.py, kernels/gemm_rs.py): the copy engines move
  the shards while one persistent product runs at ``efficiency`` of the library's rate; all-gather+GEMM starts on the
  local shard, GEMM+reduce-scatter ends with a reduction of the ``p`` partial blocks at memory bandwidth; two barriers a
  call; never faster than its launcher's host time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .devices import Device

KERNEL_EFFICIENCY = ((2e11, 0.957), (1e12, 0.985), (float("inf"), 1.0))
"""The Triton kernels' product rate as a share of cuBLAS's, by the product's FLOPs (up to each bound):
the medians of their default tiles over Llama 3 8B/70B tensor-parallel shapes on one H200 (bench/results/
2026-12-04-h200-fused-kernels.json), where ``shardwise calibrate`` has not measured the machine's
(``LinkProfile.fused``, on ``CALIBRATION_SHAPES``)."""
CALIBRATION_SHAPES = ((1024, 4096, 4096), (4096, 4096, 7168), (8192, 8192, 14336))
"""(m, k, n) of one product in each class of ``KERNEL_EFFICIENCY``."""
KERNEL_HOST_S = {"all_gather": 166e-6, "reduce_scatter": 312e-6}
"""Host seconds a call of each kernel's launcher takes (its Python path: barriers, the symmetric
buffer's views, Triton launches with TMA descriptors): medians over 12 Llama 3 tp shapes each on one
H200 (124-503 and 126-525 µs; bench/results/2026-12-04-h200-fused-kernels-d.json). A call takes at
least this long: below it the launcher, not the device, sets the pace."""
RING_STEP_HOST_S = 40e-6
"""Host seconds a ring step takes at least: its point-to-point exchange issued from Python (about 30 µs
a small collective on our H200s, timed from Python) and its product's launch."""
BARRIER_S = 10e-6
"""One symmetric-memory barrier (a signal-pad exchange), seconds."""
IMPLS = ("plain", "ring", "kernel")


@dataclass(frozen=True)
class Fused:
    """What a fused node does (``node.meta["tp_fused"]``): its collective, how it runs, its products."""

    impl: str
    """``ring`` or ``kernel`` (module docstring)."""
    kind: str
    """The collective it holds: ``all_gather``, ``reduce_scatter`` or ``all_reduce``."""
    full_bytes: int
    """Bytes of the whole tensor the collective moves (its ``Collective.full_bytes``)."""
    ranks: int
    products: tuple[tuple[int, int, int], ...]
    """(m, k, n) of each product, whole (all ranks' rows)."""
    itemsize: int
    chunks: int = 1
    """Blocks of rows an all-reduce's products are cut in (``ring``)."""
    label: str = ""
    """The products it runs (``explain``)."""

    def __str__(self) -> str:
        return f"{self.impl} {self.kind}x{self.ranks} {self.label}"


def product_s(m: float, k: int, n: int, itemsize: int, device: Device) -> float:
    """Roofline seconds of an (m, k) by (k, n) product."""
    return max(2.0 * m * k * n / device.flops, (m * k + k * n + m * n) * itemsize / device.bandwidth)


def fused_s(f: Fused, impl: str, device: Device, link_time: Callable[[str, float, int], float],
            efficiency=None) -> float:
    """Seconds of ``f`` run as ``impl`` on ``device`` over a link timed by ``link_time(kind, bytes, ranks)``;
    ``efficiency``: the kernels' measured share of the library's product rate by FLOPs (as ``KERNEL_EFFICIENCY``)."""
    p = f.ranks

    def products(parts: int) -> float:  # one block of rows of every product
        return sum(product_s(m / parts, k, n, f.itemsize, device) for m, k, n in f.products)

    comm = link_time(f.kind, f.full_bytes, p)
    if impl == "plain":
        return comm + products(1)
    if impl == "ring":
        if f.kind == "all_reduce":
            c, x = products(f.chunks), link_time(f.kind, f.full_bytes / f.chunks, p)
            return max(c + (f.chunks - 1) * max(c, x) + x, f.chunks * RING_STEP_HOST_S)
        c, x = products(p), comm / (p - 1)
        return max(c + (p - 1) * max(c, x), p * RING_STEP_HOST_S)
    if impl == "kernel":
        flops = max(2.0 * m * k * n for m, k, n in f.products)
        eff = next(e for bound, e in (efficiency or KERNEL_EFFICIENCY) if flops <= bound)
        whole = products(1) / eff
        if f.kind == "all_gather":
            return max(max(whole, whole / p + comm) + 2 * BARRIER_S, KERNEL_HOST_S[f.kind])
        reduce = (p + 1) * f.full_bytes / p / device.bandwidth  # p blocks read, one written
        return max(max(whole, comm) + reduce + BARRIER_S, KERNEL_HOST_S[f.kind])
    raise ValueError(f"unknown fused implementation {impl!r}: one of {', '.join(IMPLS)}")
