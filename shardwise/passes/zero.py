"""ZeRO stages as rewrites of the captured step.

- zero1 / zero2: every rank holds the whole model (in the compute dtype); each gradient is
  reduce-scattered into this rank's ``Shard(0)`` piece right after it is produced; the optimizer
  updates fp32 master shards and the runtime all-gathers them back into the whole model. (With one
  micro-batch per step the two are the same graph; they differ across micro-batches.)
- zero3: a parameter enters the graph only as this rank's shard, all-gathered right before its first
  forward use, dead after its last. Backward users get a gather of their own and their own copy of
  the view/cast chain built on the gathered weight (the ops the op registry marks ``chain``, e.g.
  ``t(W)``), so no gathered weight lives from forward into backward."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..capture import Capture, forward_nodes
from ..sharding import ShardLayout
from ..sharding.collective import collective_of, mark
from ..sharding.ops import info
from . import emit
from .program import Program, ShardContext, average_loss, finish, input_dtypes, parts, set_outputs

aten = torch.ops.aten

def layouts_for(names, shapes, ranks: int) -> dict[str, ShardLayout]:
    """Padded Shard(0) layout of each parameter over ``ranks`` ranks."""
    return {n: ShardLayout(tuple(s), ranks) for n, s in zip(names, shapes)}


def _reduce_scatter_grads(cap: Capture, gm: fx.GraphModule, ctx: ShardContext, layouts) -> list[fx.Node]:
    g = gm.graph
    _, _, _, grads = parts(gm)
    out = []
    for name, gn in zip(cap.grad_names, grads):
        with g.inserting_before(gn.next):
            c = emit.cast(g, gn, ctx.reduce_dtype)
        with g.inserting_before(c.next):
            out.append(emit.reduce_scatter(g, c, layouts[name], ctx.group, param=name, stage=ctx.stage))
    return out


def apply_zero12(cap: Capture, gm: fx.GraphModule, ctx: ShardContext, strategy: str) -> Program:
    layouts = layouts_for(cap.param_names, cap.param_shapes, ctx.dp)
    _, _, loss, _ = parts(gm)
    set_outputs(gm, loss, _reduce_scatter_grads(cap, gm, ctx, layouts))
    average_loss(gm, ctx)
    return Program(finish(gm), strategy, cap, layouts, "full", "shard", input_dtypes=input_dtypes(cap, gm))


def _chain_root(node: fx.Node, params: dict[fx.Node, str], memo: dict) -> fx.Node | None:
    """The parameter placeholder ``node`` is a pure view/cast chain of, or None."""
    if node in memo:
        return memo[node]
    root = None
    if node in params:
        root = node
    elif node.op == "call_function" and (info(node.target).chain or _gathers_param(node)):
        ins = node.all_input_nodes
        if len(ins) == 1:
            root = _chain_root(ins[0], params, memo)
    memo[node] = root
    return root


def _gathers_param(node: fx.Node) -> bool:
    """Whether ``node`` is a link of a parameter's gather on another mesh axis (ep's: passes/ep.py
    ``_shard_shared``), its start or its wait: the backward gets a copy of it, as of a view chain."""
    c = collective_of(node)
    if c is None and node.target is emit.WAIT:
        c = collective_of(node.args[0])
    return c is not None and c.kind == "all_gather" and bool(c.params)


def apply_zero3(cap: Capture, gm: fx.GraphModule, ctx: ShardContext) -> Program:
    g = gm.graph
    layouts = layouts_for(cap.param_names, cap.param_shapes, ctx.dp)
    phs, out, loss, _ = parts(gm)
    params = {ph: name for ph, name in zip(phs[: cap.n_params], cap.param_names)}
    nodes = list(g.nodes)
    # forward = what the loss depends on, plus anything traced before the loss (saved-for-backward
    # detaches and the like); the rest is backward
    fwd = forward_nodes(gm) | set(nodes[: nodes.index(loss)])
    order = {n: i for i, n in enumerate(nodes)}

    compute = {ph: ph.meta["val"].dtype for ph in params}
    store = {ph: ctx.master_dtype if ctx.param_dtype is not None and ph.meta["val"].is_floating_point() else compute[ph]
             for ph in params}

    def gather(ph: fx.Node, before: fx.Node, phase: str) -> fx.Node:
        with g.inserting_before(before):
            s = emit.cast(g, ph, compute[ph])
            return emit.all_gather(g, s, layouts[params[ph]], ctx.group, param=params[ph], phase=phase, stage=ctx.stage)

    # placeholders enter as shards (in the master dtype under mixed precision)
    for ph, name in params.items():
        ph.meta["val"] = emit.fake(layouts[name].local_shape, store[ph], ph.meta["val"].device)

    # backward first, on the original links: every backward read of a parameter or of a forward
    # view/cast chain of it is redirected to a copy of that chain on a backward gather
    memo: dict = {}
    copies: dict[fx.Node, fx.Node] = {}

    def rebuild(node: fx.Node, before: fx.Node) -> fx.Node:
        if node not in copies:
            if node in params:
                copies[node] = gather(node, before, "bwd")
            else:
                (src,) = node.all_input_nodes
                src_new = rebuild(src, before)
                with g.inserting_before(before):
                    new = g.node_copy(node, lambda n: src_new if n is src else n)
                new.meta = dict(node.meta)
                if collective_of(new) is not None:  # a gather on another axis, now the backward's
                    mark(new, dataclasses.replace(collective_of(new), phase="bwd"))
                copies[node] = new
        return copies[node]

    # parameters kept gathered (selective unsharding) skip this: their backward reads the forward
    # gather, which then lives from its forward use to its last backward use
    keep = {ph for ph, name in params.items() if name in ctx.keep_gathered}
    for node in nodes:
        if node in fwd or node.op != "call_function":
            continue
        for a in list(node.all_input_nodes):
            root = _chain_root(a, params, memo) if (a in params or a in fwd) else None
            if root is not None and root not in keep:
                node.replace_input_with(a, rebuild(a, node))

    # forward: one gather per parameter, right before its first forward user
    for ph in params:
        users = sorted((u for u in ph.users if u in fwd or ph in keep), key=order.__getitem__)
        if not users:
            continue
        full = gather(ph, users[0], "fwd")
        for u in users:
            u.replace_input_with(ph, full)

    set_outputs(gm, loss, _reduce_scatter_grads(cap, gm, ctx, layouts))
    average_loss(gm, ctx)
    return Program(finish(gm), "zero3", cap, layouts, "shard", "shard",
                   input_dtypes={params[ph]: store[ph] for ph in params})
