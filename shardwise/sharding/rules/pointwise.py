"""Elementwise ops, with broadcasting: a shard passes through to the output dim it lines up with.

Operands are aligned from the right, as broadcasting does. Every sharded operand must name the same output dim; a
replicated operand that has that dim at full size is sliced to it locally (no communication), one that broadcasts along
it (size 1) is read whole. A pending sum (Partial) passes through additions and subtractions of partials and through
copies; anything else needs the sum taken first: where another operand is sharded, only this rank's shard of it (a
reduce-scatter, as sequence parallelism has after each row-parallel product), else whole (an all-reduce). A smaller
whole term added to a partial (a bias) is added on one rank only, and the sum stays partial. Products with replicated
factors are linear too, but taking the sum before them is what keeps it to one: a gradient that reaches a norm's
backward as partial sums would leave the norm's weight gradient partial as well (two reductions, not one). A product
whose one reader is a sum is the exception: the pending sum passes through it (an expert's input gradient masked to its
rows, then added over the experts), and the sum of the terms takes one reduction for all of them."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ops import elementwise, register
from ..placements import Partial, Shard
from .base import R, tensors, val

aten = torch.ops.aten
_SUMS = (aten.add.Tensor, aten.sub.Tensor)
"""Linear in every operand: partial + partial is the partial of the sum."""
_COPIES = (aten.clone.default, aten.detach.default, aten.alias.default)
"""The value itself: a partial stays partial."""


def is_pointwise(n: fx.Node) -> bool:
    return elementwise(n) or n.target in (aten.clone.default, aten.detach.default, aten.alias.default)


def pointwise_rule(node: fx.Node, place, ranks: int):
    ins, out = tensors(node), val(node)
    nd = out.dim()
    partial = [a for a in ins if isinstance(place(a), Partial)]
    if partial:
        others = [a for a in ins if a not in partial]
        # a sum of partials is partial (x + y with x partial and y replicated is not: y would be added once per rank)
        if node.target in _SUMS and not others or node.target in _COPIES:
            return {}, Partial()
        if node.target == aten.mul.Tensor and len(partial) == 1 and all(place(a) == R for a in others) \
                and len(node.users) == 1 and next(iter(node.users)).target in _SUMS:
            return {}, Partial()
        if node.target in _SUMS and all(place(a) == R and val(a).numel() < out.numel() for a in others) \
                and all(val(a).shape == out.shape for a in partial):
            # a partial plus a smaller whole term that broadcasts (a row-parallel product's bias): the
            # term added on one rank only keeps the sum pending, to be reduced where a reader needs it
            # (a term as large as the sum, a residual, is not: the sum is reduced here)
            return {a: Partial() for a in others}, Partial()
        need, out = _pointwise(node, others, place, nd)
        if isinstance(out, Shard):
            # the sum is needed only where this rank's shard of the other operands lies: a
            # reduce-scatter to that shard (sequence parallelism's, after a row-parallel product)
            for a in partial:
                k = out.dim - (nd - val(a).dim())
                full = k >= 0 and val(a).shape[k] == val(node).shape[out.dim] and val(a).shape[k] != 1
                need[a] = out.moved(k) if full else R
            return need, out
        return {a: R for a in partial}, _pointwise(node, ins, lambda a: R if a in partial else place(a), nd)[1]
    return _pointwise(node, ins, place, nd)


def _pointwise(node, ins, place, nd):
    outs = {place(a).moved(place(a).dim + nd - val(a).dim()) for a in ins if isinstance(place(a), Shard)}
    if not outs:
        return {}, R
    if len(outs) > 1:  # shards of different dims or cuts: gather all (rare: no model of ours does it)
        return {a: R for a in ins}, R
    (o,) = outs
    need = {}
    for a in ins:
        k = o.dim - (nd - val(a).dim())
        if k >= 0 and place(a) == R and val(a).shape[k] == val(node).shape[o.dim] and val(a).shape[k] != 1:
            need[a] = o.moved(k)  # a replicated operand at full size: its local slice
    return need, o


register(aten.detach.default, aten.alias.default, aten.clone.default, rule=pointwise_rule)
