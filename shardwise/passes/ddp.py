"""ddp: every rank holds the whole model; gradients are averaged by bucketed all-reduces.

Each bucket's all-reduce is issued right after the last of its gradients is produced, so it can run while the rest of
the backward computes."""

from __future__ import annotations

from ..capture import Capture
from ..sharding import ShardLayout
from . import emit
from .program import Program, ShardContext, average_loss, cast_placeholders, finish, input_dtypes, parts, set_outputs


def apply(cap: Capture, gm, ctx: ShardContext) -> Program:
    g = gm.graph
    phs, out, loss, grads = parts(gm)
    cast_grads = []
    for gn in grads:
        with g.inserting_before(gn.next):
            cast_grads.append(emit.cast(g, gn, ctx.reduce_dtype))
    order = {n: i for i, n in enumerate(g.nodes)}
    # buckets in production order, one dtype per bucket, closed at bucket_bytes
    buckets: list[list[int]] = []
    size = 0
    for i in sorted(range(len(grads)), key=lambda i: order[cast_grads[i]]):
        v = emit.val(cast_grads[i])
        nb = v.numel() * v.dtype.itemsize
        if buckets and emit.val(cast_grads[buckets[-1][0]]).dtype == v.dtype and size + nb <= ctx.bucket_bytes:
            buckets[-1].append(i)
            size += nb
        else:
            buckets.append([i])
            size = nb
    reduced = list(cast_grads)
    for b in buckets:
        with g.inserting_before(max((cast_grads[i] for i in b), key=order.__getitem__).next):
            outs = emit.all_reduce_many(g, [cast_grads[i] for i in b], ctx.dp, ctx.group, op="avg",
                                        params=[cap.grad_names[i] for i in b], stage=ctx.stage)
        for i, o in zip(b, outs):
            reduced[i] = o
    set_outputs(gm, loss, reduced)
    if ctx.param_dtype is not None:
        cast_placeholders(gm, phs[: cap.n_params], ctx.master_dtype)
    average_loss(gm, ctx)
    layouts = {n: ShardLayout(tuple(s), 1) for n, s in zip(cap.param_names, cap.param_shapes)}  # replicated
    return Program(finish(gm), "ddp", cap, layouts, "full", "full", input_dtypes=input_dtypes(cap, gm))
