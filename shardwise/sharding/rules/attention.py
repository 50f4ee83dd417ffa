"""Scaled dot-product attention, forward and backward: split by batch or by heads, never by the
sequence or the head's width (every query reads every key of its head)."""

from __future__ import annotations

import torch

from ..ops import register
from ..placements import Shard
from .base import R, outputs_like, tensors, val

aten = torch.ops.aten


def attention(node, place, ranks):
    ins = [a for a in tensors(node) if val(a).dim() >= 3]  # q, k, v (and the backward's grad, out, lse)
    ps = {place(a) for a in ins}
    if len(ps) == 1:
        (p,) = ps
        if p == R or isinstance(p, Shard) and p.dim in (0, 1):
            return {}, outputs_like(node, p)
    # heads, if any input has them split; else whole
    want = next((place(a) for a in ins if isinstance(place(a), Shard) and place(a).dim in (0, 1)), R)
    return {a: want for a in ins if place(a) != want}, outputs_like(node, want)


register(*(f"aten.{n}" for n in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")), rule=attention)
