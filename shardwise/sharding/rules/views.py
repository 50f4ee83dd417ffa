"""Views and layout ops: where a shard goes when dims are permuted, inserted, removed, merged or split.

A view that merges dims keeps a shard of the outermost one (its rows are contiguous pieces of the
merged dim); a view that splits a sharded dim shards the outermost factor, where the ranks divide
it. A slice, split or select along the sharded dim, or a view that would shard an inner factor,
needs the whole tensor (an all-gather). Partial values pass through every view unchanged."""

from __future__ import annotations

import math
import operator

import torch

from ..ops import register
from ..placements import Partial, Shard
from .base import P, R, dim, outputs_like, tensors, val

aten = torch.ops.aten


def _on_shards(rule):
    """``rule`` for an input in a ``Shard``; a partial or replicated input passes through as it is."""
    def wrapped(node, place, ranks):
        p = place(node.args[0])
        if isinstance(p, Partial):
            return {}, outputs_like(node, Partial())
        return rule(node, place, ranks) if isinstance(p, Shard) else ({}, outputs_like(node, p))

    return wrapped


@_on_shards
def transpose(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    nd = val(x).dim()
    if node.target is aten.t.default:
        perm = [1, 0] if nd == 2 else [0]
    elif node.target is aten.permute.default:
        perm = [dim(d, nd) for d in node.args[1]]
    else:
        a, b = dim(node.args[1], nd), dim(node.args[2], nd)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    return {}, p.moved(perm.index(p.dim))


@_on_shards
def unsqueeze(node, place, ranks):
    p = place(node.args[0])
    return {}, p.moved(p.dim + (p.dim >= dim(node.args[1], val(node).dim())))


@_on_shards
def squeeze(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    shape = val(x).shape
    if node.target is aten.squeeze.default:
        gone = [i for i, s in enumerate(shape) if s == 1]
    else:
        ds = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        gone = [dim(d, len(shape)) for d in ds if shape[dim(d, len(shape))] == 1]
    return {}, p.moved(p.dim - sum(g < p.dim for g in gone))


@_on_shards
def expand(node, place, ranks):
    p = place(node.args[0])
    return {}, p.moved(p.dim + val(node).dim() - val(node.args[0]).dim())


def reshape_map(src: tuple, dst: tuple, p: Shard, ranks: int) -> Shard | None:
    """What a shard ``p`` of ``src`` becomes in ``dst`` (a view of the same elements), or None where
    no shard can say it.

    The shapes split into groups of dims of equal products (a merge, a split, or both). Within its group, the shard cuts
    the flattened group into ``G`` equal blocks (its groups times the entries of the group's dims before it), each into
    per-rank pieces; on the other side that is a shard of the dim where the blocks fall whole: the dims before it hold a
    whole number of blocks, and it holds whole blocks cut into whole pieces. ``[B, T, D]`` sharded on T, viewed
    ``[B*T, D]``, is ``S(0)xB``; ``[.., 3*D]`` in 3 groups viewed ``[.., 3, H, hd]`` is a plain shard of H."""
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
        if p.dim in gi:
            blocks = p.groups * math.prod(src[k] for k in gi if k < p.dim)
            before = 1
            for k in gj:
                if dst[k] != 1 and blocks % before == 0:
                    g = blocks // before
                    if dst[k] % g == 0 and (dst[k] // g) % ranks == 0:
                        return Shard(k, g)
                before *= dst[k]
                if before > blocks:
                    return None
            return None
        i += 1
        j += 1
    return None


@_on_shards
def reshape(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    out = reshape_map(tuple(val(x).shape), tuple(val(node).shape), p, ranks)
    return ({x: R}, R) if out is None else ({}, out)


@_on_shards
def slice_(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    d = dim(node.args[1] if len(node.args) > 1 else 0, val(x).dim())
    return ({x: R}, R) if d == p.dim and tuple(val(node).shape) != tuple(val(x).shape) else ({}, p)


@_on_shards
def select(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    d = dim(node.args[1], val(x).dim())
    return ({x: R}, R) if d == p.dim else ({}, p.moved(p.dim - (p.dim > d)))


@_on_shards
def split(node, place, ranks):
    x, p = node.args[0], place(node.args[0])
    d = dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), val(x).dim())
    if d == p.dim:
        sizes = [v.shape[d] for v in node.meta["val"]]
        if p.groups > 1 and len(sizes) == p.groups and len(set(sizes)) == 1:
            return {}, outputs_like(node, Shard(d))  # the blocks apart: q, k and v each cut alike
        return {x: R}, outputs_like(node, R)
    return {}, outputs_like(node, p)


@_on_shards
def slice_backward(node, place, ranks):
    """The gradient of a slice (or select) laid into zeros of the input's size: a shard on another
    dim passes (the sizes become the local ones)."""
    g, p = node.args[0], place(node.args[0])
    d = dim(node.args[2], len(node.args[1]))
    if node.target is aten.select_backward.default:
        return {}, p.moved(p.dim + (p.dim >= d))  # the selected dim comes back
    return ({g: R}, R) if d == p.dim else ({}, p)


def indexed(node, place, ranks):
    """``gather``/``scatter`` along ``dim``: the self, index and source tensors alike in a shard of
    another dim, the output too (each rank's rows read and write their own rows); else all whole."""
    xs = tensors(node)
    d = dim(node.args[1], val(node).dim())
    ps = {place(a) for a in xs}
    if len(ps) == 1:
        (p,) = ps
        if p == R or isinstance(p, Shard) and p.dim != d:
            return {}, p
    want = next((place(a) for a in xs if isinstance(place(a), Shard) and place(a).dim != d), R)
    if want != R and all(place(a) in (R, want) and (place(a) == want or val(a).shape[want.dim] == val(node).shape[want.dim])
                         for a in xs):
        return {a: want for a in xs if place(a) != want}, want  # the whole operands' slices
    return {a: R for a in xs if place(a) != R}, R


def index_select(node, place, ranks):
    """``x.index_select(d, idx)``: whole rows picked by a shard of the indices are that shard of the rows (a dispatch's
    pairs, by token); a shard of another dim, or a partial ``x``, passes with whole indices; else all whole."""
    x, idx = node.args[0], node.args[2]
    px, pi = place(x), place(idx)
    d = dim(node.args[1], val(x).dim())
    if px == R and isinstance(pi, Shard):
        return {}, pi.moved(d)
    if isinstance(px, Partial) or isinstance(px, Shard) and px.dim != d:
        return ({idx: R} if pi != R else {}), px
    return {a: R for a in (x, idx) if place(a) != R}, R


def index_add(node, place, ranks):
    """``x.index_add(d, idx, src)`` (an index_select's gradient): a partial source with whole indices adds into ``x``
    partial too; a shard of another dim passes with whole indices; shards of the indices and source rows are gathered,
    for the rows added into are read whole next (a dispatch buffer's gradient, read by products of replicated weights:
    partial, it would be reduced later as those products' larger values, the weights' gradients among them)."""
    x, idx, src = node.args[0], node.args[2], node.args[3]
    px, pi, ps = place(x), place(idx), place(src)
    d = dim(node.args[1], val(x).dim())
    if isinstance(ps, Partial) and pi == R:
        return ({x: Partial()} if px != Partial() else {}), Partial()
    if isinstance(ps, Shard) and ps.dim != d and px in (R, ps) and pi == R:
        return ({x: ps} if px != ps else {}), ps
    return {a: R for a in (x, idx, src) if place(a) != R}, R


def index(node, place, ranks):
    """``x[idx]`` (indices on dim 0 only: an expert's tokens, a pair's weights): a shard of another dim (moved past
    the index's dims), or a partial ``x``, passes with whole indices; else all whole."""
    x, idx, px = node.args[0], node.args[1][0], place(node.args[0])
    if len(node.args[1]) == 1 and (isinstance(px, Partial) or isinstance(px, Shard) and px.dim > 0):
        return {a: R for a in (idx,) if place(a) != R}, px.moved(px.dim + val(idx).dim() - 1) if px != P else px
    return {a: R for a in tensors(node) if place(a) != R}, R


def index_put(node, place, ranks):
    """``x[idx] = v`` (added under ``accumulate``; indices on dim 0 only): a partial ``v`` writes into a partial ``x``
    (every position, written or kept, sums to its value over the ranks); a shard of another dim passes; else whole."""
    x, idx, v = node.args[0], node.args[1][0], node.args[2]
    pv = place(v)
    d = pv.dim - val(idx).dim() + 1 if isinstance(pv, Shard) else 0  # the dim of x that v's shard lies along
    if len(node.args[1]) == 1 and (pv == P or d > 0 and place(x) in (R, pv.moved(d))):
        want = pv if pv == P else pv.moved(d)
        return {a: p for a, p in ((x, want), (idx, R)) if place(a) != p}, want
    return {a: R for a in tensors(node) if place(a) != R}, R


def cat(node, place, ranks):
    xs = [a for a in node.args[0] if val(a) is not None and val(a).numel()]
    ps = {place(a) for a in xs}
    d = dim(node.args[1] if len(node.args) > 1 else 0, val(node).dim())
    if len(ps) == 1:
        (p,) = ps
        if not (isinstance(p, Shard) and p.dim == d):
            return {}, p
        if p.groups == 1 and len(xs) > 1 and len({val(a).shape[d] for a in xs}) == 1:
            return {}, Shard(d, len(xs))  # equal pieces side by side: a cut in as many blocks (split's inverse)
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
register(aten.index_select.default, rule=index_select)
register(aten.index_add.default, rule=index_add)
register(aten.index.Tensor, rule=index)
register(aten.index_put.default, aten.index_put_.default, rule=index_put)
register(aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two,
         rule=indexed)
register(aten.slice_backward.default, aten.select_backward.default, rule=slice_backward)
register(operator.getitem, rule=getitem)
