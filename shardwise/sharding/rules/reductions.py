"""Reductions and normalisations: a reduced sharded dim leaves a partial sum; a normalisation needs its
normalised dims whole on every rank and keeps the shard of the others (the token dims, under
sequence parallelism); a softmax needs its dim whole, but for a log-softmax over classes in shards
(a vocab-parallel head), whose max and sum the partitioner reduces over the axis."""

from __future__ import annotations

import torch

from ..ops import register
from ..placements import Partial, Shard
from .base import R, dim, outputs_like, tensors, val

aten = torch.ops.aten


def _dims(node, nd):
    ds = node.args[1] if len(node.args) > 1 else None
    if ds is None:
        return list(range(nd))
    return sorted(dim(d, nd) for d in (ds if isinstance(ds, (list, tuple)) else [ds]))


def sum_(node, place, ranks):
    x = node.args[0]
    p, nd = place(x), val(x).dim()
    if isinstance(p, Partial):
        return {}, Partial()
    if not isinstance(p, Shard):
        return {}, p
    ds = _dims(node, nd)
    if p.dim in ds:
        return {}, Partial()
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return {}, p.moved(p.dim if keep else p.dim - sum(d < p.dim for d in ds))


def mean(node, place, ranks):
    x = node.args[0]
    p, nd = place(x), val(x).dim()
    if isinstance(p, Shard) and p.dim in _dims(node, nd):
        return {x: R}, R  # its divisor is the whole dim's size: reduce the whole tensor
    return sum_(node, place, ranks)


def _classes(p, node, x, d) -> bool:
    """A log-softmax over a plainly sharded dim: vocab-parallel (passes/tp.py reduces its max and sum of exps)."""
    return node.target in _VOCAB_PARALLEL and isinstance(p, Shard) and p.groups == 1 and p.dim == dim(d, val(x).dim())


def softmax(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    if _classes(p, node, x, node.args[1]):
        return {}, p
    if isinstance(p, Partial) or isinstance(p, Shard) and p.dim == dim(node.args[1], val(x).dim()):
        return {a: R for a in tensors(node)}, R
    return {a: p for a in tensors(node) if place(a) != p}, p


def softmax_backward(node, place, ranks):
    grad, out = node.args[0], node.args[1]
    p = place(grad)
    if _classes(p, node, out, node.args[2]) and place(out) == p:
        return {}, p  # vocab-parallel: its sum over the classes reduced over the axis (passes/tp.py)
    if isinstance(p, Shard) and p.dim != dim(node.args[2], val(out).dim()) and place(out) == p:
        return {}, p
    return {a: R for a in (grad, out)}, R


_VOCAB_PARALLEL = (aten._log_softmax.default, aten._log_softmax_backward_data.default)


def along(node, place, ranks):
    """An op along one dim (top-k, sort, a max or min with its indices): a shard of another dim passes
    to every output; its own dim sharded, or a partial value, is needed whole."""
    x = node.args[0]
    p, nd = place(x), val(x).dim()
    d = dim(node.args[2] if node.target is aten.topk.default and len(node.args) > 2
            else node.args[1] if node.target is not aten.topk.default and len(node.args) > 1 else -1, nd)
    if isinstance(p, Partial) or isinstance(p, Shard) and p.dim == d:
        return {x: R}, outputs_like(node, R)
    keep = node.target is not aten.max.dim and node.target is not aten.min.dim or \
        (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if isinstance(p, Shard) and not keep and p.dim > d:
        p = p.moved(p.dim - 1)
    return {}, outputs_like(node, p)


def scan(node, place, ranks):
    """A running sum along one dim: a partial value stays partial (the scan is linear), a shard of
    another dim passes; its own dim sharded is needed whole."""
    x, p = node.args[0], place(node.args[0])
    return ({x: R}, R) if isinstance(p, Shard) and p.dim == dim(node.args[1], val(x).dim()) else ({}, p)


def copy_into(node, place, ranks):
    """``dst.copy_(src)`` (a buffer's new value written back): ``src`` takes ``dst``'s placement."""
    dst, src = node.args[0], node.args[1]
    return ({src: place(dst)} if place(src) != place(dst) else {}), place(dst)


def layer_norm(node, place, ranks):
    x = node.args[0]
    p, nd, k = place(x), val(x).dim(), len(node.args[1])
    if isinstance(p, Shard) and p.dim < nd - k:
        return {a: R for a in tensors(node)[1:] if place(a) != R}, outputs_like(node, p)
    return {a: R for a in tensors(node)}, outputs_like(node, R)


def layer_norm_backward(node, place, ranks):
    grad, x = node.args[0], node.args[1]
    p, nd, k = place(grad), val(x).dim(), len(node.args[2])
    if isinstance(p, Shard) and p.dim < nd - k and place(x) == p:
        # the input's gradient keeps the token shard; the weight's and bias's sum over the tokens
        return {a: p for a in (node.args[3], node.args[4]) if place(a) != p}, (p, Partial(), Partial())
    return {a: R for a in tensors(node)}, (R, R, R)


register(aten.sum.dim_IntList, aten.sum.default, rule=sum_)
register(aten.mean.dim, rule=mean)
register(aten._softmax.default, aten._log_softmax.default, "aten._safe_softmax", rule=softmax)
register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default, rule=softmax_backward)
register(aten.cumsum.default, rule=scan)
register(aten.copy_.default, aten.copy.default, rule=copy_into)
register(aten.topk.default, aten.sort.default, aten.max.dim, aten.min.dim, rule=along)
register(aten.native_layer_norm.default, rule=layer_norm)
register(aten.native_layer_norm_backward.default, rule=layer_norm_backward)
