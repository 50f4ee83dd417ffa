"""Losses: the negative log-likelihood of rows of log-probabilities. Rows whole on every rank: the loss whole. Rows in
shards (tokens under sequence parallelism) with whole classes: each rank's loss is a partial sum and the count of its
targets is summed over the axis, which the partitioner does (passes/tp.py: a mean becomes this rank's sum over the whole
count); the gradient keeps the rows' shard. Classes in shards (a vocab-parallel head) with whole targets: each rank
picks the targets its classes hold, a partial sum; the gradient keeps the classes' shard."""

from __future__ import annotations

import torch

from ..ops import register
from ..placements import Partial, Shard
from .base import R, outputs_like, tensors, val

aten = torch.ops.aten


def whole(node, place, ranks):
    return {a: R for a in tensors(node) if place(a) != R}, outputs_like(node, R)


def _rows(node, place):
    """The rows' shard of ``node``'s log-probabilities (2-d, classes whole), or None."""
    x = node.args[0] if node.target is aten.nll_loss_forward.default else node.args[1]
    p = place(x)
    return p if isinstance(p, Shard) and p.dim == 0 and val(x).dim() == 2 else None


def _weight_whole(w):
    return w is None or not isinstance(w, torch.fx.Node) or val(w) is None


def _classes(node, place) -> bool:
    """Log-probabilities in shards of their classes (a vocab-parallel head), targets and weights whole."""
    x = node.args[0] if node.target is aten.nll_loss_forward.default else node.args[1]
    p = place(x)
    return isinstance(p, Shard) and p.groups == 1 and p.dim == 1 and val(x).dim() == 2 and \
        place(node.args[2 if node.target is aten.nll_loss_forward.default else 3]) in (None, R)


def nll_loss_forward(node, place, ranks):
    target, w = node.args[1], node.args[2]
    if _classes(node, place) and _weight_whole(w):
        # each rank picks the targets its classes hold: a partial sum (passes/tp.py)
        return ({target: R} if place(target) != R else {}), (Partial(), R)
    p = _rows(node, place)
    if p is None or not _weight_whole(w) and place(w) != R:
        return whole(node, place, ranks)
    return ({target: p} if place(target) != p else {}), (Partial(), R)


def nll_loss_backward(node, place, ranks):
    grad, x, target, w, _, _, tw = node.args[:7]
    if _classes(node, place) and _weight_whole(w) and place(grad) == R and place(tw) == R:
        return ({target: R} if place(target) != R else {}), place(x)
    p = _rows(node, place)
    if p is None or place(grad) != R or place(tw) != R:
        return whole(node, place, ranks)
    return ({target: p} if place(target) != p else {}), p


register(aten.nll_loss_forward.default, rule=nll_loss_forward)
register(aten.nll_loss_backward.default, rule=nll_loss_backward)
register(aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default, rule=whole)
