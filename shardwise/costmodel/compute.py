"""Roofline time of the compute nodes of a step graph: max(FLOPs / peak, bytes / bandwidth).

The analytic fallback of the cost model; measured per-node times replace it where profiling runs.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten


@dataclass(frozen=True)
class Device:
    """Peak rates of one device (dense matrix FLOP/s at the compute dtype, memory bytes/s)."""

    name: str
    flops: float
    bandwidth: float


DEVICES = {
    # measured on this workplace's H200s (DESIGN.md reference figures): 790 TFLOP/s bf16 GEMM, 4.3 TB/s copy
    "h200": Device("h200", 790e12, 4.3e12),
    "h100": Device("h100", 700e12, 3.0e12),  # about 0.7 of the datasheet's 989 TFLOP/s, 3.35 TB/s
    "a100": Device("a100", 250e12, 1.6e12),
    "cpu": Device("cpu", 50e9, 10e9),
}


CARVE_STRETCH = 0.4
"""How much of the slowdown its SM count predicts a carved product shows. Sitting 7 (MoE 8x7B-8L on
2xH200, bf16): its products took 1.06x, 1.07x, 1.13x, 1.28x as long with 16, 24, 32, 48 of 132 SMs
left free, against 1.14x, 1.22x, 1.32x, 1.57x by SM count (fewer, fuller waves of tiles)."""


VIEWS = frozenset({"view", "_unsafe_view", "view_as", "_reshape_alias", "alias", "detach", "t", "transpose", "permute",
                   "expand", "expand_as", "slice", "select", "unsqueeze", "squeeze", "as_strided", "split",
                   "split_with_sizes", "unbind", "narrow", "diagonal", "unflatten", "view_as_real", "view_as_complex"})
"""ATen ops whose outputs are views of their inputs: no data moves."""


def _numel(v) -> int:
    return math.prod(v.shape) if isinstance(v, torch.Tensor) else 0


def _bytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return _numel(v) * v.dtype.itemsize
    if isinstance(v, (list, tuple)):
        return sum(_bytes(x) for x in v)
    return 0


def flops(node: fx.Node) -> float:
    """Floating-point operations of one ATen node (matrix products and attention; 0 elsewhere)."""
    t = node.meta.get("sw_product", node.target)  # a carved product counts as the product it runs
    ins = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
    out = node.meta.get("val")
    if t in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default):
        k = ins[-2].shape[-1]  # the contracted dim of the left operand
        return 2.0 * _numel(out) * k
    if "scaled_dot_product" in str(t):
        q, k_ = ins[0], ins[1]
        b_h = math.prod(q.shape[:-2])
        fwd = 4.0 * b_h * q.shape[-2] * k_.shape[-2] * q.shape[-1]
        return fwd * (2.5 if "backward" in str(t) else 1.0)
    return 0.0


def node_time(node: fx.Node, device: Device) -> float:
    """Roofline seconds for one compute node; 0 for placeholders, views and collectives."""
    if node.op != "call_function" or node.meta.get("sw") is not None:
        return 0.0
    name = str(node.target)
    if "_c10d_functional" in name or node.target is operator.getitem or getattr(node.target, "sw_no_kernel", False):
        return 0.0  # collectives, picks from a tuple, Python no-ops the passes insert (``keep_alive``)
    moved = _bytes(node.meta.get("val")) + sum(_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    if isinstance(node.target, torch._ops.OpOverload) and node.target.__name__.split(".")[0] in VIEWS:
        moved = 0  # views move no data
    # a product beside a collective may use only its share of the SMs (passes/carveout.py): its
    # compute-bound time stretches (by CARVE_STRETCH of what its SM count says), its memory-bound time does not
    share = node.meta.get("sm_share", 1.0)
    return max(flops(node) / device.flops * (1.0 + CARVE_STRETCH * (1.0 / share - 1.0)), moved / device.bandwidth)
