"""Roofline time of the compute nodes of a step graph: max(FLOPs / peak, bytes / bandwidth); and the FLOPs of a training
step per token, which MFU and the planner share.

The analytic fallback of the cost model; measured per-node times replace it where profiling runs. What each op costs
(FLOPs, whether it is a view) is the op registry's (sharding/ops.py)."""

from __future__ import annotations

import torch.fx as fx

from ..sharding.collective import collective_of
from ..sharding.ops import flops, info, tensor_bytes
from .devices import Device

CARVE_STRETCH = 0.4
"""How much of the slowdown its SM count predicts a carved product shows. Sitting 7 (MoE 8x7B-8L on
2xH200, bf16): its products took 1.06x, 1.07x, 1.13x, 1.28x as long with 16, 24, 32, 48 of 132 SMs
left free, against 1.14x, 1.22x, 1.32x, 1.57x by SM count (fewer, fuller waves of tiles)."""


def node_time(node: fx.Node, device: Device) -> float:
    """Roofline seconds for one compute node; 0 for placeholders, views and collectives."""
    if node.op != "call_function" or collective_of(node) is not None or info(node.target).free:
        return 0.0
    moved = tensor_bytes(node.meta.get("val")) + sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    if info(node.target).view:
        moved = 0  # views move no data
    # a product beside a collective may use only its share of the SMs (passes/carveout.py): its
    # compute-bound time stretches (by CARVE_STRETCH of what its SM count says), its memory-bound time does not
    share = node.meta.get("sm_share", 1.0)
    return max(flops(node) / device.flops * (1.0 + CARVE_STRETCH * (1.0 / share - 1.0)), moved / device.bandwidth)


def flops_per_token(matmul_weights: float, layers: int, attn_width: int, seq: int) -> float:
    """Training FLOPs per token: 6 per weight a token multiplies (forward 2, backward 4; an embedding
    lookup multiplies nothing, a tied head still does) plus 12·L·d·T for attention (PaLM's formula;
    d the query width, heads x head size, T the sequence length). MFU and ``shardwise plan`` count it so."""
    return 6.0 * matmul_weights + 12.0 * layers * attn_width * seq
