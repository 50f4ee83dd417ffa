"""Bucketing: merge neighbouring per-parameter all-gathers and reduce-scatters into one collective each (the dp
strategy's, and ep's of parameters: ZeRO over dp x ep).

Every collective pays a fixed latency α; a bucket pays it once for many parameters. Buckets are closed at
``bucket_bytes`` (the cost model picks it: passes/pipeline.py), hold one dtype and one phase, and keep graph order, so
the order of collectives stays a function of the graph.

All-gather bucket: the members' shards are concatenated, gathered once (rank-major), and each member's padded rows are
copied out of its column of the ``[ranks, total]`` result. Reduce-scatter bucket: each member's padded gradient is
viewed as ``[ranks, k_i]``, the views concatenated along dim 1, reduce-scattered once, and the result split into the
members' shards."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..sharding.collective import Collective, collective_of, mark
from . import emit
from .schedule import feed_chain

aten = torch.ops.aten


def _groups(starts: list[fx.Node], limit: int) -> list[list[fx.Node]]:
    out: list[list[fx.Node]] = []
    keys: dict[fx.Node, tuple] = {}
    size = 0
    for s in starts:
        c = collective_of(s)
        key = (c.kind, c.phase, emit.val(s).dtype, s.args[1:])
        if out and keys[out[-1][0]] == key and size + c.full_bytes <= limit:
            out[-1].append(s)
            size += c.full_bytes
        else:
            out.append([s])
            size = c.full_bytes
        keys[s] = key
    return [g for g in out if len(g) > 1]


def _merged(members: list[fx.Node]) -> Collective:
    """The collective of a bucket: its members' bytes and parameters, in order."""
    cs = [collective_of(m) for m in members]
    return Collective(cs[0].kind, sum(c.full_bytes for c in cs), sum(c.sent_bytes for c in cs), cs[0].ranks,
                      cs[0].axis, cs[0].phase, tuple(p for c in cs for p in c.params))


def _merge_all_gathers(g: fx.Graph, members: list[fx.Node], ranks: int) -> None:
    ins = [m.args[0] for m in members]
    sizes = [emit.val(x).numel() for x in ins]
    total, v0 = sum(sizes), emit.val(ins[0])
    for m in members[1:]:  # shards of placeholders: their feed chains brought forward (of another axis's gather: the
        for c in feed_chain(m) or ():  # bucket follows the last, restore_topological_order)
            members[0].prepend(c)
    with g.inserting_before(members[0]):
        flats = [emit.reshape(g, x, [n]) for x, n in zip(ins, sizes)]
        flat = emit.node(g, aten.cat.default, (flats,), emit.fake([total], v0.dtype, v0.device))
        start = emit.node(g, members[0].target, (flat, *members[0].args[1:]), emit.fake([ranks * total], v0.dtype, v0.device))
        mark(start, _merged(members))
        wait = emit.node(g, emit.WAIT, (start,), emit.fake([ranks * total], v0.dtype, v0.device))
        grid = emit.node(g, aten.view.default, (wait, [ranks, total]), emit.fake([ranks, total], v0.dtype, v0.device))
    off = 0
    for m, n in zip(members, sizes):
        old_wait = next(iter(m.users))
        shape = list(emit.val(old_wait).shape)
        # each member's piece goes right before its own first use, so it can die after its last one
        with g.inserting_before(min(old_wait.users, key=lambda u: _order(g)[u])):
            col = emit.node(g, aten.slice.Tensor, (grid, 1, off, off + n), emit.fake([ranks, n], v0.dtype, v0.device))
            piece = emit.node(g, aten.clone.default, (col,), emit.fake([ranks, n], v0.dtype, v0.device),
                              memory_format=torch.contiguous_format)
            full = emit.node(g, aten.view.default, (piece, shape), emit.fake(shape, v0.dtype, v0.device))
        old_wait.replace_all_uses_with(full)
        g.erase_node(old_wait)
        g.erase_node(m)
        off += n


def _merge_reduce_scatters(g: fx.Graph, members: list[fx.Node], ranks: int) -> None:
    ins = [m.args[0] for m in members]
    ks = [emit.val(x).numel() // ranks for x in ins]
    total, v0 = sum(ks), emit.val(ins[0])
    with g.inserting_before(max(ins, key=_order(g).__getitem__).next):
        grids = [emit.reshape(g, x, [ranks, k]) for x, k in zip(ins, ks)]
        cat = emit.node(g, aten.cat.default, (grids, 1), emit.fake([ranks, total], v0.dtype, v0.device))
        flat = emit.node(g, aten.view.default, (cat, [ranks * total]), emit.fake([ranks * total], v0.dtype, v0.device))
        start = emit.node(g, members[0].target, (flat, *members[0].args[1:]), emit.fake([total], v0.dtype, v0.device))
        mark(start, _merged(members))
        wait = emit.node(g, emit.WAIT, (start,), emit.fake([total], v0.dtype, v0.device))
        parts = emit.node(g, aten.split_with_sizes.default, (wait, ks))
        for i, m in enumerate(members):
            old_wait = next(iter(m.users))
            shape = list(emit.val(old_wait).shape)
            piece = emit.node(g, operator.getitem, (parts, i), emit.fake([ks[i]], v0.dtype, v0.device))
            new = emit.node(g, aten.view.default, (piece, shape), emit.fake(shape, v0.dtype, v0.device))
            old_wait.replace_all_uses_with(new)
            g.erase_node(old_wait)
            g.erase_node(m)


def _order(g: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(g.nodes)}


def candidates(gm: fx.GraphModule) -> list[fx.Node]:
    """The collectives ``bucket`` may merge: the dp strategy's (the tp axis's move activations, each read soon after),
    and ep's gathers and reduce-scatters of parameters (ZeRO over dp x ep, passes/ep.py), whose gathers read dp's."""
    cs = {s: collective_of(s) for s in emit.collectives(gm)}
    return [s for s, c in cs.items() if c.ranks > 1 and (c.axis == "dp" or c.axis == "ep" and c.kind != "all_reduce"
                                                        and c.params)]


def bucket(gm: fx.GraphModule, bucket_bytes: int) -> int:
    """Merge per-parameter all-gathers and reduce-scatters of ``gm`` in place, each axis's apart; returns buckets
    made."""
    if bucket_bytes <= 0:
        return 0
    g, made = gm.graph, 0
    for axis in ("dp", "ep"):
        for kind, merge in (("all_gather", _merge_all_gathers), ("reduce_scatter", _merge_reduce_scatters)):
            starts = [s for s in candidates(gm) if (collective_of(s).axis, collective_of(s).kind) == (axis, kind)]
            if kind == "all_gather":  # an ep gather reads a dp gather's wait (the dp buckets are made by then)
                dp = {s for s in emit.collectives(gm, "dp") if collective_of(s).kind == kind} if axis == "ep" else ()
                starts = [s for s in starts if feed_chain(s, dp) is not None]
            for members in _groups(starts, bucket_bytes):
                merge(g, members, collective_of(members[0]).ranks)
                made += 1
    # a member's result now comes from the bucket's collective, issued after the last member's input: readers placed
    # between (the copy back to the GPU of gloo's host-staged collectives) follow it there
    emit.restore_topological_order(g)
    g.lint()
    gm.recompile()
    return made
