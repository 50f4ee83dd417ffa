"""Bucketing: merge neighbouring per-parameter all-gathers and reduce-scatters into one collective each.

Every collective pays a fixed latency α; a bucket pays it once for many parameters. Buckets are
closed at ``bucket_bytes`` (the cost model picks it: see ``bucket_target``), hold one dtype and one
phase, and keep graph order, so the order of collectives stays a function of the graph.

All-gather bucket: the members' shards are concatenated, gathered once (rank-major), and each
member's padded rows are copied out of its column of the ``[ws, total]`` result. Reduce-scatter
bucket: each member's padded gradient is viewed as ``[ws, k_i]``, the views concatenated along
dim 1, reduce-scattered once, and the result split into the members' shards.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import _emit
from .schedule import _feed_chain

aten = torch.ops.aten


def bucket_target(alpha_s: float, busbw: float, ws: int, overhead: float = 0.1) -> int:
    """Smallest bucket whose fixed latency is at most ``overhead`` of its transfer time."""
    if ws <= 1:
        return 0
    return int(alpha_s * busbw / overhead * ws / (ws - 1))


def _groups(starts: list[fx.Node], limit: int) -> list[list[fx.Node]]:
    out: list[list[fx.Node]] = []
    size = 0
    for s in starts:
        sw = s.meta["sw"]
        key = (sw["kind"], sw["phase"], _emit.val(s).dtype, s.args[1:])
        if out and out[-1][0].meta["sw_key"] == key and size + sw["full_bytes"] <= limit:
            out[-1].append(s)
            size += sw["full_bytes"]
        else:
            out.append([s])
            size = sw["full_bytes"]
        s.meta["sw_key"] = key
    return [g for g in out if len(g) > 1]


def _merge_all_gathers(g: fx.Graph, members: list[fx.Node], ws: int) -> None:
    ins = [m.args[0] for m in members]
    sizes = [_emit.val(x).numel() for x in ins]
    total = sum(sizes)
    v0 = _emit.val(ins[0])
    for m in members[1:]:  # their shards come from placeholders only: bring the feed chains forward
        for c in _feed_chain(m):
            members[0].prepend(c)
    with g.inserting_before(members[0]):
        flats = [_emit.reshape(g, x, [n]) for x, n in zip(ins, sizes)]
        flat = _emit._fn(g, aten.cat.default, (flats,), _emit.fake([total], v0.dtype, v0.device))
        sw = dict(kind="all_gather", bytes=sum(m.meta["sw"]["bytes"] for m in members),
                  full_bytes=sum(m.meta["sw"]["full_bytes"] for m in members),
                  param=[m.meta["sw"]["param"] for m in members], phase=members[0].meta["sw"]["phase"])
        start = _emit._fn(g, members[0].target, (flat, *members[0].args[1:]), _emit.fake([ws * total], v0.dtype, v0.device))
        start.meta["sw"] = sw
        wait = _emit._fn(g, _emit.c10d.wait_tensor.default, (start,), _emit.fake([ws * total], v0.dtype, v0.device))
        grid = _emit._fn(g, aten.view.default, (wait, [ws, total]), _emit.fake([ws, total], v0.dtype, v0.device))
    off = 0
    for m, n in zip(members, sizes):
        old_wait = next(iter(m.users))
        shape = list(_emit.val(old_wait).shape)
        # each member's piece goes right before its own first use, so it can die after its last one
        first = min(old_wait.users, key=lambda u: _order(g)[u])
        with g.inserting_before(first):
            col = _emit._fn(g, aten.slice.Tensor, (grid, 1, off, off + n), _emit.fake([ws, n], v0.dtype, v0.device))
            piece = _emit._fn(g, aten.clone.default, (col,), _emit.fake([ws, n], v0.dtype, v0.device),
                              memory_format=torch.contiguous_format)
            full = _emit._fn(g, aten.view.default, (piece, shape), _emit.fake(shape, v0.dtype, v0.device))
        old_wait.replace_all_uses_with(full)
        g.erase_node(old_wait)
        g.erase_node(m)
        off += n


def _merge_reduce_scatters(g: fx.Graph, members: list[fx.Node], ws: int) -> None:
    ins = [m.args[0] for m in members]
    ks = [_emit.val(x).numel() // ws for x in ins]
    total = sum(ks)
    v0 = _emit.val(ins[0])
    order = _order(g)
    last_in = max(ins, key=order.__getitem__)
    with g.inserting_before(last_in.next):
        grids = [_emit.reshape(g, x, [ws, k]) for x, k in zip(ins, ks)]
        cat = _emit._fn(g, aten.cat.default, (grids, 1), _emit.fake([ws, total], v0.dtype, v0.device))
        flat = _emit._fn(g, aten.view.default, (cat, [ws * total]), _emit.fake([ws * total], v0.dtype, v0.device))
        sw = dict(kind="reduce_scatter", bytes=sum(m.meta["sw"]["bytes"] for m in members),
                  full_bytes=sum(m.meta["sw"]["full_bytes"] for m in members),
                  param=[m.meta["sw"]["param"] for m in members], phase="bwd")
        start = _emit._fn(g, members[0].target, (flat, *members[0].args[1:]), _emit.fake([total], v0.dtype, v0.device))
        start.meta["sw"] = sw
        wait = _emit._fn(g, _emit.c10d.wait_tensor.default, (start,), _emit.fake([total], v0.dtype, v0.device))
        parts = _emit._fn(g, aten.split_with_sizes.default, (wait, ks))
        for i, m in enumerate(members):
            old_wait = next(iter(m.users))
            shape = list(_emit.val(old_wait).shape)
            piece = _emit._fn(g, operator.getitem, (parts, i), _emit.fake([ks[i]], v0.dtype, v0.device))
            new = _emit._fn(g, aten.view.default, (piece, shape), _emit.fake(shape, v0.dtype, v0.device))
            old_wait.replace_all_uses_with(new)
            g.erase_node(old_wait)
            g.erase_node(m)


def _order(g: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(g.nodes)}


def bucket(gm: fx.GraphModule, ws: int, bucket_bytes: int) -> int:
    """Merge per-parameter all-gathers and reduce-scatters of ``gm`` in place; returns buckets made."""
    if ws <= 1 or bucket_bytes <= 0:
        return 0
    g = gm.graph
    made = 0
    for kind, merge in (("all_gather", _merge_all_gathers), ("reduce_scatter", _merge_reduce_scatters)):
        starts = [s for s in _emit.collectives(gm) if s.meta["sw"]["kind"] == kind]
        if kind == "all_gather":
            starts = [s for s in starts if _feed_chain(s) is not None]
        for members in _groups(starts, bucket_bytes):
            merge(g, members, ws)
            made += 1
    for n in g.nodes:
        n.meta.pop("sw_key", None)
    # a member's result now comes from the bucket's collective, issued after the last member's
    # input: readers placed between (the copy back to the GPU of gloo's host-staged collectives)
    # follow it there
    _emit.restore_topological_order(g)
    g.lint()
    gm.recompile()
    return made
