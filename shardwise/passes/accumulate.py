"""Gradient accumulation for strategies that keep whole gradients (ddp, zero1).

Over ``k`` micro-batches, the first ``k-1`` run a *local* program, no collective: each gradient is added into a running
sum in the reduce dtype (bf16 compute still accumulates in fp32). The last runs the strategy's program with the sums as
extra inputs, added to its gradients (and loss) right before they are reduced: one reduction per step, as DDP's
``no_sync``.

zero2 and zero3 instead reduce-scatter every micro-batch into a running shard sum (``into_inputs``): they never hold a
whole gradient, the memory difference between zero1 and zero2."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..capture import Capture
from ..sharding import ShardLayout
from . import emit
from .program import Program, ShardContext, cast_placeholders, finish, input_dtypes, parts, set_outputs


def local(cap: Capture, gm: fx.GraphModule, ctx: ShardContext, strategy: str) -> Program:
    """A micro-batch before the last: no collectives; each gradient is added in place into its
    running sum (an input, in the reduce dtype) as soon as it is produced, so no whole set of fresh
    gradients is ever alive beside the sums. Outputs only ``[loss + loss_sum]``."""
    phs, _, _, _ = parts(gm)
    if strategy == "ddp" and ctx.param_dtype is not None:
        # ddp's whole parameters enter as fp32 masters; zero1's already in the compute dtype
        cast_placeholders(gm, phs[: cap.n_params], ctx.master_dtype)
    add_accumulators(cap, gm, ctx, inplace=True)
    layouts = {n: ShardLayout(tuple(s), 1) for n, s in zip(cap.param_names, cap.param_shapes)}
    return Program(finish(gm), f"{strategy}/local", cap, layouts, "full", "none", input_dtypes=input_dtypes(cap, gm))


def add_accumulators(cap: Capture, gm: fx.GraphModule, ctx: ShardContext, inplace: bool = False) -> None:
    """Append inputs ``[*grad_sums, loss_sum]`` and add them to the gradients and the loss.

    ``inplace``: add each gradient into its sum (mutating the input) and output only the loss. Otherwise the sums
    replace the gradients as outputs, for the strategy pass to reduce."""
    g = gm.graph
    _, _, loss, grads = parts(gm)
    first = next(n for n in g.nodes if n.op != "placeholder")
    sums = []
    with g.inserting_before(first):
        for i, gn in enumerate(grads):
            v, ph = emit.val(gn), g.placeholder(f"grad_sum_{i}")
            ph.meta["val"] = emit.fake(v.shape, ctx.reduce_dtype or v.dtype, v.device)
            sums.append(ph)
        lv, loss_ph = emit.val(loss), g.placeholder("loss_sum")
        loss_ph.meta["val"] = emit.fake(lv.shape, lv.dtype, lv.device)
    add = torch.ops.aten.add_.Tensor if inplace else torch.ops.aten.add.Tensor
    new_grads = []
    for gn, ph in zip(grads, sums):
        with g.inserting_before(gn.next):
            new_grads.append(emit.node(g, add, (ph, emit.cast(g, gn, emit.val(ph).dtype)), emit.val(ph)))
    with g.inserting_before(loss.next):
        new_loss = emit.node(g, torch.ops.aten.add.Tensor, (loss_ph, loss), lv)
    set_outputs(gm, new_loss, [] if inplace else new_grads)


def into_inputs(prog: Program) -> Program:
    """zero2/zero3 over several micro-batches: add each reduce-scattered gradient shard in place into
    a running shard sum (an input) and output only the loss, so no second set of shards is alive."""
    gm = prog.gm
    g = gm.graph
    _, out, loss, shards = parts(gm)
    with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
        sums = []
        for i, sh in enumerate(shards):
            ph = g.placeholder(f"shard_sum_{i}")
            ph.meta["val"] = emit.val(sh)
            sums.append(ph)
    for sh, ph in zip(shards, sums):
        with g.inserting_before(sh.next):
            emit.node(g, torch.ops.aten.add_.Tensor, (ph, sh), emit.val(ph))
    set_outputs(gm, loss, [])
    prog.gm, prog.grad_output, prog.strategy = finish(gm), "none", f"{prog.strategy}/acc"
    return prog
