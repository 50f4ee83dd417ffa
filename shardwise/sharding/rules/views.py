"""Views and layout ops: where a shard goes when dims are permuted, inserted, removed, merged or split.

A view that merges dims keeps a shard of the outermost one (its rows are contiguous pieces of the
merged dim); a view that splits a sharded dim shards the outermost factor, where the ranks divide
it. A slice, split or select along the sharded dim, or a view that would shard an inner factor,
needs the whole tensor (an all-gather). Partial values pass through every view unchanged."""

from __future__ import annotations

import operator

import torch

from ..ops import register
from ..placements import Partial, Shard
from .base import R, dim, outputs_like, val

aten = torch.ops.aten


def _keep_partial(rule):
    def wrapped(node, place, ranks):
        x = node.args[0]
        if isinstance(place(x), Partial):
            return {}, outputs_like(node, Partial())
        return rule(node, place, ranks)

    return wrapped


@_keep_partial
def transpose(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    if not isinstance(p, Shard):
        return {}, p
    nd = val(x).dim()
    if node.target is aten.t.default:
        perm = [1, 0] if nd == 2 else [0]
    elif node.target is aten.permute.default:
        perm = [dim(d, nd) for d in node.args[1]]
    else:
        a, b = dim(node.args[1], nd), dim(node.args[2], nd)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    return {}, Shard(perm.index(p.dim))


@_keep_partial
def unsqueeze(node, place, ranks):
    p = place(node.args[0])
    if not isinstance(p, Shard):
        return {}, p
    d = dim(node.args[1], val(node).dim())
    return {}, Shard(p.dim + (p.dim >= d))


@_keep_partial
def squeeze(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    if not isinstance(p, Shard):
        return {}, p
    shape = val(x).shape
    if node.target is aten.squeeze.default:
        gone = [i for i, s in enumerate(shape) if s == 1]
    else:
        ds = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        gone = [dim(d, len(shape)) for d in ds if shape[dim(d, len(shape))] == 1]
    return {}, Shard(p.dim - sum(g < p.dim for g in gone))


@_keep_partial
def expand(node, place, ranks):
    p = place(node.args[0])
    if not isinstance(p, Shard):
        return {}, p
    return {}, Shard(p.dim + val(node).dim() - val(node.args[0]).dim())


def reshape_map(src: tuple, dst: tuple, d: int) -> int | None:
    """The dim of ``dst`` that a shard of dim ``d`` of ``src`` becomes, or None where none can be.

    The shapes split into groups of dims of equal products (a merge, a split, or both). A shard of the
    group's outermost (non-trivial) dim is a cut of the flattened group into contiguous pieces, which
    is a shard of the outermost dim of the other side's group; a shard of an inner dim is not."""
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        a, b = src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                a *= src[i]
                gi.append(i)
            else:
                j += 1
                b *= dst[j]
                gj.append(j)
        if d in gi:
            if d != next(k for k in gi if src[k] != 1):
                return None
            return next((k for k in gj if dst[k] != 1), None)
        i += 1
        j += 1
    return None


@_keep_partial
def reshape(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    if not isinstance(p, Shard):
        return {}, p
    src, dst = tuple(val(x).shape), tuple(val(node).shape)
    out = reshape_map(src, dst, p.dim)
    if out is None or dst[out] % ranks:
        return {x: R}, R
    return {}, Shard(out)


@_keep_partial
def slice_(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    if not isinstance(p, Shard):
        return {}, p
    nd = val(x).dim()
    d = dim(node.args[1] if len(node.args) > 1 else 0, nd)
    if d == p.dim and tuple(val(node).shape) != tuple(val(x).shape):
        return {x: R}, R
    return {}, p


@_keep_partial
def select(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    if not isinstance(p, Shard):
        return {}, p
    d = dim(node.args[1], val(x).dim())
    if d == p.dim:
        return {x: R}, R
    return {}, Shard(p.dim - (p.dim > d))


@_keep_partial
def split(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    if isinstance(p, Shard):
        d = dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), val(x).dim())
        if d == p.dim:
            return {x: R}, outputs_like(node, R)
    return {}, outputs_like(node, p)


def cat(node, place, ranks):
    xs = [a for a in node.args[0] if val(a) is not None and val(a).numel()]
    ps = {place(a) for a in xs}
    nd = val(node).dim()
    d = dim(node.args[1] if len(node.args) > 1 else 0, nd)
    if len(ps) == 1:
        (p,) = ps
        if not (isinstance(p, Shard) and p.dim == d):
            return {}, p
    return {a: R for a in xs}, R


def getitem(node, place, ranks):
    src, i = node.args
    p = place(src)
    return {}, (p[i] if isinstance(p, tuple) else p)


register(aten.t.default, aten.transpose.int, aten.permute.default, rule=transpose)
register(aten.unsqueeze.default, rule=unsqueeze)
register(aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, rule=squeeze)
register(aten.expand.default, rule=expand)
register(aten.view.default, aten.reshape.default, aten._unsafe_view.default, rule=reshape)
register(aten.slice.Tensor, rule=slice_)
register(aten.select.int, rule=select)
register(aten.split.Tensor, aten.split_with_sizes.default, rule=split)
register(aten.cat.default, rule=cat)
register(operator.getitem, rule=getitem)
