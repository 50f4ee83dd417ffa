"""Gradient accumulation for strategies that keep whole gradients (ddp, zero1).

Over ``k`` micro-batches, the first ``k-1`` run a *local* program: no collective at all, whole
gradients out (in the reduce dtype, so bf16 compute still accumulates in fp32). The last runs the
strategy's program with the running sums as extra inputs, added to its own gradients (and loss)
right before they are reduced: one reduction per step, as DDP's ``no_sync`` gives.

zero2 and zero3 instead reduce-scatter every micro-batch and accumulate shards: they never hold
a whole gradient, which is the memory difference between zero1 and zero2.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..capture import Capture
from . import _emit, ddp
from .program import Program, ShardContext, parts, set_outputs


def local(cap: Capture, gm: fx.GraphModule, ctx: ShardContext, strategy: str) -> Program:
    """The step with no collectives: whole gradients in the reduce dtype, this rank's own loss."""
    # ddp's rewrite on a one-rank axis emits no collective but casts as ddp does; zero1's whole
    # parameters already enter in the compute dtype, so it casts no placeholder
    lctx = dataclasses.replace(ctx, ws=1, param_dtype=ctx.param_dtype if strategy == "ddp" else None)
    prog = ddp.apply(cap, gm, lctx)
    prog.strategy = f"{strategy}/local"
    return prog


def add_accumulators(cap: Capture, gm: fx.GraphModule, ctx: ShardContext) -> None:
    """Append inputs ``[*grad_sums, loss_sum]`` and add them to the gradients and loss before any reduction."""
    g = gm.graph
    _, _, loss, grads = parts(gm)
    first = next(n for n in g.nodes if n.op != "placeholder")
    sums = []
    with g.inserting_before(first):
        for i, gn in enumerate(grads):
            v = _emit.val(gn)
            ph = g.placeholder(f"grad_sum_{i}")
            ph.meta["val"] = _emit.fake(v.shape, ctx.reduce_dtype or v.dtype, v.device)
            sums.append(ph)
        lv = _emit.val(loss)
        loss_ph = g.placeholder("loss_sum")
        loss_ph.meta["val"] = _emit.fake(lv.shape, lv.dtype, lv.device)
    new_grads = []
    for gn, ph in zip(grads, sums):
        with g.inserting_before(gn.next):
            c = _emit.cast(g, gn, _emit.val(ph).dtype)
            new_grads.append(_emit._fn(g, torch.ops.aten.add.Tensor, (ph, c), _emit.val(ph)))
    with g.inserting_before(loss.next):
        new_loss = _emit._fn(g, torch.ops.aten.add.Tensor, (loss_ph, loss), lv)
    set_outputs(gm, new_loss, new_grads)
