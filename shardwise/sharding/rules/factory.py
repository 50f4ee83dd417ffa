"""Ops that make tensors: from nothing (``arange``, ``zeros``, ``full``: replicated, computed from the
single-device graph's full sizes), or shaped like another (``ones_like``: its shard, not its sums)."""

from __future__ import annotations

import torch

from ..ops import register
from ..placements import Partial
from .base import R

aten = torch.ops.aten


def new(node, place, ranks):
    return {}, R


def like(node, place, ranks):
    p = place(node.args[0])
    return {}, (R if isinstance(p, Partial) else p)


register(*(f"aten.{n}" for n in ("arange", "zeros", "ones", "full", "empty", "scalar_tensor", "new_zeros",
                                  "new_ones", "new_full", "new_empty", "randn", "rand")), rule=new)
register(*(f"aten.{n}" for n in ("ones_like", "zeros_like", "empty_like", "full_like", "rand_like",
                                  "randn_like")), rule=like)
