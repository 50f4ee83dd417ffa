"""Collectives of another mesh axis (ep's dispatch and combine and their sums, already in the traced step) as the tp
axis sees them: they move or sum whole rows among that axis's ranks, the same on every tp rank, so a value keeps its
tp placement through them (a pending tp sum stays pending: it commutes with theirs) unless it is cut along the rows
they move (dim 0), which they take whole."""

from __future__ import annotations

import torch

from ..ops import register
from ..placements import Shard
from .base import R, norm, val

c10d = torch.ops._c10d_functional
_ROWS = tuple(getattr(c10d, n).default for n in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"))


def rule(node, place, ranks):
    x = node.args[0]
    p = norm(place(x), val(x).dim())
    return ({x: R}, R) if node.target in _ROWS and isinstance(p, Shard) and p.dim == 0 else ({}, p)


register(c10d.all_reduce.default, c10d.wait_tensor.default, *_ROWS, rule=rule)
