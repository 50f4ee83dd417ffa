"""Expert parallelism: the captured step's experts split over the ep axis of the mesh, tokens moved to them and back by
all-to-all.

The ranks of an ep line each hold their own micro-batch (the ep axis is data parallel for everything but the experts)
and ``1/ep`` of every MoE layer's experts. An expert parameter is a 3-dim parameter that a batched product (``bmm``)
reads as one matrix per expert (dim 0). The values computed per expert from it (the batched products, the pointwise ops
and transposes between them, forward and backward) form the layer's *expert region*. Its values are ``[E, C, ...]`` on
each rank (all ``E`` experts, this rank's ``C`` token slots); it runs instead on ``[E/ep, ep*C, ...]``. So:

1. a value entering the region (the dispatch buffer; in the backward, the gradient of the combine's input) is sent by
   all-to-all: expert block ``j`` to rank ``j``, received blocks concatenated by slot;
2. a value leaving it (the experts' output; the gradient of the dispatch buffer) comes back by the inverse all-to-all;
3. a value of an expert parameter's shape made in the region (its gradient) is this rank's experts' whole gradient (a
   product over every rank's slots): it stays where it is.

Outside the region every value is this rank's own, as under data parallelism: the other gradients are summed over the ep
ranks, and every gradient and the loss taken as the mean of the ep ranks'. The result is a Capture of the ep-local step,
its expert parameters the ep shards (``Shard(0)``), which the dp strategy passes then shard as a single device's. Under
a ZeRO strategy the other parameters are cut over ep too (``_shard_shared``): ZeRO over dp x ep.

Hugging Face experts (``use_experts_implementation``) sort their pairs by expert into groups whose sizes follow the
routing, which no static graph rewrite can move: they are split as the step is traced instead (``hf_forwards``),
dropless, and the traced collectives named after (``finish_traced``); on a mesh with tp, its last step (``finish_local``)
waits for the tp partition, which passes those collectives through (sharding/rules/collectives.py)."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch

import torch
import torch.fx as fx

from ..capture import Capture
from ..sharding import Shard, ShardLayout
from ..sharding.collective import collective_of, mark
from ..sharding.rules.pointwise import is_pointwise
from . import emit

aten = torch.ops.aten
_TRANSPOSES = (aten.transpose.int,)


class ExpertError(ValueError):
    """The experts of the graph cannot be split over the ep axis as found (the message says why)."""


def _planned(found: dict[str, int], names, plan) -> dict[str, int]:
    """``found`` kept to the parameters ``plan``'s globs name (all where it is None); a glob naming none is an error."""
    if plan is None:
        return found
    for g in plan:
        if not any(fnmatch.fnmatch(n, g) for n in found):
            named = [n for n in names if fnmatch.fnmatch(n, g)]
            why = (f"it names {named[:3]}, which no batched product reads as one matrix per expert" if named
                   else "it names no parameter of the model")
            raise ExpertError(f"ep_plan: {g!r} names no expert parameter: {why} (experts found: "
                              f"{sorted(found)[:4] or 'none'})")
    return {n: e for n, e in found.items() if any(fnmatch.fnmatch(n, g) for g in plan)}


def experts_of(cap: Capture, ranks: int = 1, plan=None) -> dict[str, int]:
    """The expert parameters of ``cap``: {name: number of experts (its dim 0)}, kept to those the
    ``plan``'s globs name where there is one; every count must be a multiple of the ep ``ranks``."""
    g = cap.gm.graph
    names = dict(zip(g.find_nodes(op="placeholder")[: cap.n_params], cap.param_names))
    found: dict[str, int] = {}
    for n in g.nodes:
        if n.target is not aten.bmm.default:
            continue
        for a in n.args:
            while isinstance(a, fx.Node) and a.target in _TRANSPOSES:
                a = a.args[0]
            if a in names and a.meta["val"].dim() == 3:
                found[names[a]] = a.meta["val"].shape[0]
    found = _planned(found, cap.param_names, plan)
    for name, e in found.items():
        if e % ranks:
            raise ExpertError(f"ep={ranks} does not divide the {e} experts of {name}: use an ep that divides "
                              "every MoE layer's expert count")
    return found


def _swapped(d: int | None, n: fx.Node) -> int | None:
    """The slot dim of ``transpose(x, a, b)``'s output where ``x``'s is ``d``."""
    if d is None:
        return None
    a, b = (x % n.args[0].meta["val"].dim() for x in n.args[1:3])
    return b if d == a else a if d == b else d


def _swap01(g, x, shape, v):
    """``x`` with dims 0 and 1 swapped (``shape`` after), laid out contiguously."""
    t = emit.node(g, aten.transpose.int, (x, 0, 1), emit.fake(shape, v.dtype, v.device))
    return emit.node(g, aten.clone.default, (t,), emit.fake(shape, v.dtype, v.device), memory_format=torch.contiguous_format)


def _reshape(g, x, shape, v):
    return emit.node(g, aten.reshape.default, (x, list(shape)), emit.fake(shape, v.dtype, v.device))


def _to_experts(g, x, ranks, group, phase, stage):
    """``[E, C, ...]`` (this rank's slots of every expert) -> ``[E/ep, ep*C, ...]`` (every rank's
    slots of this rank's experts): block ``j`` of dim 0 to rank ``j``, received blocks by slot."""
    v = x.meta["val"]
    e, c, rest = v.shape[0], v.shape[1], list(v.shape[2:])
    k = emit.collective("all_to_all", v.numel() * v.dtype.itemsize, ranks, phase, axis="ep",
                        reason="tokens to their experts" if phase == "fwd" else "gradients of the outputs to the experts")
    split = [e // ranks] * ranks
    got = emit.start_and_wait(g, emit.c10d.all_to_all_single.default, (emit.contiguous(g, x), split, split, group),
                              list(v.shape), v.dtype, v.device, k, stage)
    # [rank, E/ep, C, ...] -> [E/ep, rank, C, ...] -> [E/ep, ep*C, ...]
    blocks = _reshape(g, got, [ranks, e // ranks, c, *rest], v)
    return _reshape(g, _swap01(g, blocks, [e // ranks, ranks, c, *rest], v), [e // ranks, ranks * c, *rest], v)


def _from_experts(g, y, ranks, group, phase, stage):
    """The inverse of ``_to_experts``: ``[E/ep, ep*C, ...]`` -> ``[E, C, ...]``. (``y``'s recorded
    value is still the whole ``[E, C, ...]``: the values are traced again once all is rewritten.)"""
    v = y.meta["val"]
    e, c, rest = v.shape[0], v.shape[1], list(v.shape[2:])
    el = e // ranks
    blocks = _reshape(g, y, [el, ranks, c, *rest], v)
    flat = _reshape(g, _swap01(g, blocks, [ranks, el, c, *rest], v), [e, c, *rest], v)
    k = emit.collective("all_to_all", v.numel() * v.dtype.itemsize, ranks, phase, axis="ep",
                        reason="expert outputs back to their tokens" if phase == "fwd"
                        else "gradients of the inputs back to their tokens")
    return emit.start_and_wait(g, emit.c10d.all_to_all_single.default, (flat, [el] * ranks, [el] * ranks, group),
                               list(v.shape), v.dtype, v.device, k, stage)


def _region(g: fx.Graph, experts: set[fx.Node]) -> tuple[dict[fx.Node, int | None], list[fx.Node]]:
    """(the slot dim of each region value, None where shaped as an expert parameter; the values entering, in order)."""
    slot: dict[fx.Node, int | None] = {p: None for p in experts}
    entries: list[fx.Node] = []
    known = set(experts)

    def enters(a: fx.Node) -> None:
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            raise ExpertError(f"{a.name} enters an expert region but is not a [experts, slots, ...] batch")
        if a not in known:
            entries.append(a)
            known.add(a)
            slot[a] = 1

    for n in g.nodes:
        if n.op != "call_function":
            continue
        ins = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if not any(a in known for a in ins):
            continue
        if n.target is aten.bmm.default:
            a, b = n.args
            for x in (a, b):
                if x not in known:
                    enters(x)
            # [E, n, k] @ [E, k, m]: slots as a's rows (dim 1) give the product's rows, as b's columns (dim 2) its
            # columns; a's slot columns times b's slot rows sum over every rank's slots (a weight's gradient)
            rule = {(1, None): 1, (None, 2): 2, (2, 1): None, (None, None): None}
            if (slot[a], slot[b]) not in rule:
                raise ExpertError(f"{n.name}: a batched product of expert values with slots on dims "
                                  f"{slot[a]} and {slot[b]} of its operands is not built")
            slot[n] = rule[slot[a], slot[b]]
        elif n.target in _TRANSPOSES:
            slot[n] = _swapped(slot[n.args[0]], n)
        elif is_pointwise(n) or n.target is aten.silu_backward.default:
            dims = set()
            for a in ins:
                if a in known:
                    dims.add(slot[a])
                elif a.meta["val"].dim() > 0:
                    enters(a)
                    dims.add(1)
            if len(dims) > 1:
                raise ExpertError(f"{n.name} ({n.target}) mixes expert values laid out apart: not built")
            slot[n] = dims.pop()
        else:
            continue
        known.add(n)
    return {n: d for n, d in slot.items() if n not in experts}, entries


def partition(cap: Capture, ranks: int, group: str, stage: str | None = None,
              plan=None, shard_shared: bool = False, split: int = 1) -> tuple[Capture, dict[str, Shard]]:
    """The ep-local step of ``cap`` over ``ranks`` ranks of process group ``group`` (module docstring; ``shard_shared``
    and ``split``: ``_finish_local``). Returns (its Capture, each split parameter's ep placement: ``Shard(0)``)."""
    from ..capture import forward_nodes

    counts = experts_of(cap, ranks, plan)
    if not counts:
        raise ExpertError(f"mesh ep={ranks}: shardwise finds no experts in the model. It finds them as 3-dim "
                          "parameters [experts, in, out] that batched products (torch.bmm) read, as the built-in "
                          "MoE's capacity dispatch does; a model without such a layer trains on a mesh without ep")
    gm = copy.deepcopy(cap.gm)
    g = gm.graph
    params = dict(zip(g.find_nodes(op="placeholder")[: cap.n_params], cap.param_names))
    experts = {ph for ph, name in params.items() if name in counts}
    slot, entries = _region(g, experts)
    for x in entries:
        if x.meta["val"].shape[0] not in counts.values():
            raise ExpertError(f"{x.name} of shape {tuple(x.meta['val'].shape)} enters an expert region, but its "
                              f"dim 0 is not an expert count ({sorted(set(counts.values()))})")
    fwd = forward_nodes(gm)
    region = set(slot) - set(entries)  # the values computed in it
    layers = []  # one per MoE layer: on a split batch each part's dispatch is its layer's too
    for layer in (_layer(x, region, params, ranks) for x in entries if x in fwd):
        same = next((m for m in layers if m["params"] == layer["params"]), None)
        if same is None:
            layers.append(layer)
        else:
            same["fwd_collectives"] += layer["fwd_collectives"]
    out = g.find_nodes(op="output")[0]
    for x in entries:
        users = [u for u in x.users if u in region]
        with g.inserting_before(x.next):
            moved = _to_experts(g, x, ranks, group, "fwd" if x in fwd else "bwd", stage)
        for u in users:
            u.replace_input_with(x, moved)
    for n in [n for n in g.nodes if n in region]:
        outside = [u for u in n.users if u not in region]
        if not outside:
            continue
        if slot[n] is None:
            if any(u is not out for u in outside):
                raise ExpertError(f"{n.name}, shaped as an expert parameter, is read outside the experts: not built")
            continue  # an expert parameter's gradient: this rank's experts', whole
        if slot[n] != 1 or out in outside:
            raise ExpertError(f"{n.name} leaves an expert region with its slots on dim {slot[n]}: not built")
        with g.inserting_before(n.next):
            back = _from_experts(g, n, ranks, group, "fwd" if n in fwd else "bwd", stage)
        for u in outside:
            u.replace_input_with(n, back)
    shared = _finish_local(g, cap, params, counts, ranks, group, stage, shard_shared, split)
    # the inputs' local values (this rank's experts; the shared ones' placeholders are already), all traced again
    emit.retrace(gm, lambda ph, shape: [shape[0] // ranks, *shape[1:]] if ph in experts else shape)
    cut = {**counts, **shared}
    shapes = [torch.Size([s[0] // ranks, *s[1:]]) if n in cut else s for n, s in zip(cap.param_names, cap.param_shapes)]
    return dataclasses.replace(cap, gm=gm, param_shapes=shapes, moe_layers=layers), {n: Shard(0) for n in cut}


def _finish_local(g, cap, params, counts, ranks, group, stage, shard_shared: bool, split: int) -> dict:
    """What every ep-local step ends with (``partition``'s and ``finish_traced``'s): under a ZeRO strategy the other
    parameters cut over ep (``_shard_shared``), the gradients and the loss averaged over ep, a split batch's parts
    interleaved, each ep collective started early. Returns the other parameters cut over ep, with their layouts."""
    shared = _shard_shared(g, params, counts, ranks, group, stage) if shard_shared else {}
    _mean_over_ranks(g, cap, params, counts, ranks, group, stage, shared)
    g.eliminate_dead_code()
    if split > 1:
        interleave(g)
    issue_early(g)
    return shared


def _shard_shared(g: fx.Graph, params: dict, counts: dict, ranks: int, group: str, stage) -> dict:
    """ZeRO of the other (non-expert) parameters over the ep axis too, so that with the dp strategy's it
    is over dp x ep (each rank holds ``1/(dp*ep)``): each one whose dim 0 the ep ranks divide enters as
    this rank's ``Shard(0)`` rows on ep, all-gathered over ep right before its first reader (zero3 gives
    its backward readers their own gather); its gradient is reduce-scattered over ep. Two gathers, over
    dp then ep, send what one over dp x ep would. Returns {name: its ep layout}."""
    order, out = {n: i for i, n in enumerate(g.nodes)}, {}
    for ph, name in params.items():
        v = ph.meta["val"]
        if name in counts or v.dim() == 0 or v.shape[0] % ranks or not v.is_floating_point() or not ph.users:
            continue
        out[name] = lay = ShardLayout(tuple(v.shape), ranks)
        users = list(ph.users)
        ph.meta["val"] = emit.fake(lay.local_shape, v.dtype, v.device)
        with g.inserting_before(min(users, key=order.__getitem__)):
            whole = emit.all_gather(g, ph, lay, group, param=name, stage=stage, axis="ep")
        for u in users:
            u.replace_input_with(ph, whole)
    return out


def _layer(x: fx.Node, region: set, params: dict, ranks: int) -> dict:
    """What ``explain`` says of the MoE layer whose dispatch buffer ``x`` is: its expert parameters
    (the region's forward products read them), experts, ranks, slots per expert per rank, and the
    bytes of each of its all-to-alls (one rank's whole buffer)."""
    v = x.meta["val"]
    names, seen, stack = [], set(), list(x.users)
    while stack:
        n = stack.pop()
        if n in seen or n not in region:
            continue
        seen.add(n)
        stack.extend(n.users)
        for a in n.args if n.target is aten.bmm.default else ():
            while isinstance(a, fx.Node) and a.target in _TRANSPOSES:
                a = a.args[0]
            if a in params and params[a] not in names:
                names.append(params[a])
    return {"params": sorted(names), "experts": v.shape[0], "ranks": ranks, "capacity": v.shape[1],
            "bytes": v.numel() * v.dtype.itemsize, "fwd_collectives": 2}


_LIGHT = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
          aten.contiguous.default, aten._to_copy.default, aten.t.default, aten.transpose.int)


def issue_early(g: fx.Graph) -> int:
    """Each ep collective started as soon as its input is made (with the views and copies that feed it alone), its wait
    left where its value is first read: what the graph computes meanwhile and does not need it (a shared expert beside
    the routed ones) runs while it is in flight. Returns how many moved."""
    order, moved = {n: i for i, n in enumerate(g.nodes)}, 0

    def hoist(n: fx.Node) -> bool:
        for a in n.all_input_nodes:
            if a.op == "call_function" and a.target in _LIGHT and len(a.users) == 1:
                hoist(a)
        if not n.all_input_nodes:
            return False
        last = max(n.all_input_nodes, key=lambda a: order[a])
        if last.next is n:
            return False
        last.append(n)
        order.update((m, i) for i, m in enumerate(g.nodes))  # positions after the move
        return True

    for n in list(g.nodes):
        c = collective_of(n) if n.op == "call_function" else None
        if c is not None and c.axis == "ep" and not c.params:  # a parameter's gather waits for its reader
            moved += hoist(n)
    return moved


def interleave(g: fx.Graph) -> None:
    """A step traced on parts of its batch (``capture_step(split=)``) ordered so that one part's ep collectives run
    under the other's compute (DeepSpeed-MoE's and MegaScale's split batch): nodes sorted by the ep collectives on their
    longest path from the inputs, then traced order, forward first (a valid order: no key is below its inputs')."""
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out = g.find_nodes(op="output")[0]
    fwd = set(nodes[: pos[out.args[0][0]] + 1])  # the loss, and what it needs: traced before it

    def crosses(a: fx.Node) -> bool:  # the wait of a collective moving tokens over ep
        c = collective_of(a.args[0]) if a.target is emit.WAIT else None
        return c is not None and c.axis == "ep" and not c.params

    depth: dict[fx.Node, int] = {}
    for n in nodes:  # in graph order: every input's depth is known
        depth[n] = max((depth[a] + crosses(a) for a in n.all_input_nodes), default=0)
    for n in sorted((n for n in nodes if n.op not in ("placeholder", "output")),
                    key=lambda n: (n not in fwd, depth[n], pos[n])):
        out.prepend(n)


def _mean_over_ranks(g, cap, params, counts, ranks, group, stage, sharded=None) -> None:
    """The loss and every gradient as the mean over the ep ranks: the other parameters' gradients
    summed over them (one all-reduce per dtype, after the last is made; those ``sharded`` over ep
    reduce-scattered as each is made), all scaled by ``1/ep``."""
    out = g.find_nodes(op="output")[0]
    outs = list(out.args[0])
    grads = [name for name, t in zip(params.values(), cap.trainable) if t] if len(outs) > 1 else []
    sharded = sharded or {}
    for i, name in enumerate(grads):
        x = outs[i + 1]
        if name in sharded and isinstance(x, fx.Node):
            with g.inserting_before(x.next):
                outs[i + 1] = emit.reduce_scatter(g, x, sharded[name], group, param=name, op="sum", stage=stage,
                                                  axis="ep")
    shared = [i + 1 for i, name in enumerate(grads) if name not in counts and name not in sharded
              and isinstance(outs[i + 1], fx.Node)]
    summed = emit.sum_after_last(g, [outs[i] for i in shared], ranks, group, axis="ep",
                                 params=[grads[i - 1] for i in shared], stage=stage)
    for i, y in zip(shared, summed):
        outs[i] = y
    loss = outs[0]
    # right after the loss is made, so that what comes before the loss is still the forward (zero3
    # gives its backward gathers of its own by that)
    with g.inserting_before(loss.next):
        v = loss.meta["val"]
        c = emit.collective("all_reduce", v.numel() * v.dtype.itemsize, ranks, "bwd", axis="ep",
                            reason="the loss: the mean of the ep ranks'")
        summed = emit.start_and_wait(g, emit.c10d.all_reduce.default, (emit.contiguous(g, loss), "sum", group),
                                     list(v.shape), v.dtype, v.device, c, stage)
        outs[0] = emit.node(g, aten.mul.Tensor, (summed, 1.0 / ranks), emit.fake(list(v.shape), v.dtype, v.device))
    with g.inserting_before(out):
        for i, x in enumerate(outs[1: len(grads) + 1], 1):
            if isinstance(x, fx.Node):
                w = x.meta["val"]
                outs[i] = emit.node(g, aten.mul.Tensor, (x, 1.0 / ranks), emit.fake(list(w.shape), w.dtype, w.device))
    out.args = (tuple(outs), *out.args[1:])


# -- experts whose dispatch the graph cannot show statically (Hugging Face's) ------------------------

def hf_experts(model, plan=None) -> list[tuple[str, object]]:
    """The Hugging Face experts modules of ``model`` (capture's ``hf_experts``): (name, module); with a
    ``plan``, those whose parameters its globs name."""
    from ..capture import hf_experts as found

    mods = found(model)
    if plan is None or not mods:
        return mods
    params = {f"{n}.{p}" if n else p: (n, m) for n, m in mods for p, _ in m.named_parameters(recurse=False)}
    found = _planned({k: 0 for k in params}, [n for n, _ in model.named_parameters()], plan)
    return list({params[k][0]: params[k] for k in found}.values())


def add_rank_buffers(model, ranks: int, rank: int, capacity: float | str | None = None) -> None:
    """Each Hugging Face experts module gets ``ep_first_expert``: this rank's first expert on the ep
    axis, which ``hf_forwards`` reads; unless ``capacity`` is ``"dropless"`` also ``dropped``, the
    pairs it dropped in the last micro-batch under a capacity rule (buffers, not saved)."""
    for _, m in hf_experts(model):
        dev = next(m.parameters()).device
        m.register_buffer("ep_first_expert", torch.tensor(rank * (m.num_experts // ranks), dtype=torch.long,
                                                          device=dev), persistent=False)
        if capacity != "dropless":
            m.register_buffer("dropped", torch.zeros((), dtype=torch.long, device=dev), persistent=False)


def capacity_dispatch(m, hidden, top_k_index, top_k_weights, factor: float, ranks: int, group):
    """Hugging Face experts ``m`` (this rank's ``E/ranks`` of them) under GShard's capacity rule (as the
    built-in MoE's, models/moe.py): the kept pairs go to their experts' ranks by one all-to-all into
    ``[E, capacity, d]`` blocks and come back by another; the experts run their own implementation on
    every rank's slots of theirs. With ``ranks == 1`` (no ``group``), the same rule on one device."""
    import math

    import torch.nn.functional as F

    e = m.num_experts
    el = e // ranks
    t, k = top_k_index.shape
    d = hidden.shape[-1]
    cap = math.ceil(factor * t * k / e)
    choice = top_k_index.t().reshape(-1)  # choice-major: every token's first choice queues first
    onehot = F.one_hot(choice, e)
    pos = (onehot.cumsum(0) * onehot).sum(-1) - 1
    dump = e * cap
    if "dropped" in m._buffers:  # the pairs this rank dropped in its last micro-batch (add_rank_buffers)
        m.dropped.copy_((pos >= cap).sum())
    slot = torch.where(pos < cap, choice * cap + pos, torch.full_like(pos, dump))
    token = torch.arange(t, device=hidden.device).repeat(k)
    filler = torch.full((dump + 1,), t, dtype=token.dtype, device=hidden.device).scatter(0, slot, token)[:dump]
    xe = torch.cat([hidden, hidden.new_zeros(1, d)]).index_select(0, filler)  # [E*cap, d], expert-major
    if ranks > 1:
        from torch.distributed import _functional_collectives as fc

        split = [el * cap] * ranks
        xe = fc.all_to_all_single_autograd(xe, split, split, group)  # [rank, E/ep, cap, d]
        xe = xe.view(ranks, el, cap, d).transpose(0, 1).reshape(el * ranks * cap, d)
    ids = torch.arange(el, device=hidden.device).repeat_interleave(xe.shape[0] // el).unsqueeze(1)
    ones = torch.ones(xe.shape[0], 1, dtype=top_k_weights.dtype, device=hidden.device)
    saved, m.num_experts = m.num_experts, el
    try:
        ye = type(m).forward(m, xe, ids, ones)
    finally:
        m.num_experts = saved
    if ranks > 1:
        ye = ye.view(el, ranks, cap, d).transpose(0, 1).reshape(e * cap, d)
        ye = fc.all_to_all_single_autograd(ye, split, split, group)  # this rank's slots of every expert
    ye = torch.cat([ye, ye.new_zeros(1, d)])
    pair = slot.view(k, t).t().reshape(-1)
    return (ye.index_select(0, pair).view(t, k, d) * top_k_weights.unsqueeze(-1).to(ye.dtype)).sum(1)


def hf_forwards(model, ranks: int, rank: int, group, plan=None,
                capacity: float | None = None) -> tuple[dict, dict, dict[str, int]]:
    """Forwards that split Hugging Face experts over the ep axis as the step is traced, dropless: every
    ep rank's (token, choice) pairs are gathered, each rank runs the experts' own implementation on all
    of them with its ``E/ep`` experts (another rank's expert takes gate 0), and the outputs are
    reduce-scattered back. Group sizes depend on the routing, so buffers are sized for the worst case:
    every pair on every rank. With ``capacity`` (a factor), ``capacity_dispatch`` instead. Returns
    (forwards by module, the expert parameters' local shapes, their expert counts)."""
    from torch.distributed import _functional_collectives as fc

    # torch's differentiable all-gather and reduce-scatter (the ``_single_`` ones where it has them)
    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    scatter = getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd
    forwards, shapes, counts = {}, {}, {}
    for prefix, m in hf_experts(model, plan):
        e = m.num_experts
        if e % ranks:
            raise ExpertError(f"ep={ranks} does not divide the {e} experts of {prefix}: use an ep that divides "
                              "every MoE layer's expert count")
        el = e // ranks
        for n, p in m.named_parameters(recurse=False):
            if p.dim() >= 1 and p.shape[0] == e:
                name = f"{prefix}.{n}" if prefix else n
                shapes[name], counts[name] = (el, *p.shape[1:]), e

        def forward(hidden, top_k_index, top_k_weights, _m=m, _el=el):
            tokens = gather(hidden, 0, group)
            # this rank's first expert is a buffer (an input), not a number: the graph is every rank's
            ids = getattr(fc, "all_gather_single", fc.all_gather_tensor)(top_k_index, 0, group) - _m.ep_first_expert
            mine = (ids >= 0) & (ids < _el)
            gates = gather(top_k_weights, 0, group) * mine.to(top_k_weights.dtype)
            saved, _m.num_experts = _m.num_experts, _el
            try:
                out = type(_m).forward(_m, tokens, ids.clamp(0, _el - 1), gates)
            finally:
                _m.num_experts = saved
            return scatter(out, "sum", 0, group)

        def dispatched(hidden, top_k_index, top_k_weights, _m=m):
            return capacity_dispatch(_m, hidden, top_k_index, top_k_weights, capacity, ranks, group)

        forwards[m] = forward if capacity is None else dispatched
    return forwards, shapes, counts


DEFAULT_CAPACITY = 1.25
"""Hugging Face experts' capacity factor where dropless does not fit (Switch Transformer's training factor)."""


def dispatch_choice(trace, cost, room: int | None) -> tuple[tuple, dict]:
    """Dropless unless its traced step's predicted graph peak is over ``room`` (None: no limit), else
    the capacity rule at ``DEFAULT_CAPACITY``; ``trace(factor)`` traces (None: dropless). Returns (the
    chosen trace, the choice: the predictions made, the room, the dispatch)."""
    dropless = trace(None)
    t, peak = cost.estimate(dropless[0].gm)
    choice = {"dropless_s": t, "dropless_peak": peak, "room": room}
    if room is None or peak <= room:
        return dropless, {**choice, "dispatch": "dropless", "factor": None}
    capacity = trace(DEFAULT_CAPACITY)
    tc, pc = cost.estimate(capacity[0].gm)
    return capacity, {**choice, "dispatch": "capacity", "factor": DEFAULT_CAPACITY, "capacity_s": tc,
                      "capacity_peak": pc}


def _staged(g: fx.Graph, start: fx.Node, stage: str | None) -> None:
    """The collective ``start`` run on a copy of its payload on ``stage``, its result copied back."""
    x = start.args[0]
    v = x.meta["val"]
    if stage is None or v.device.type == torch.device(stage).type:
        return
    with g.inserting_before(start):
        host = emit.node(g, aten._to_copy.default, (x,), emit.fake(v.shape, v.dtype, stage), device=torch.device(stage))
    start.replace_input_with(x, host)
    wait = next(iter(start.users))
    w = wait.meta["val"]
    with g.inserting_before(wait.next):
        back = emit.node(g, aten._to_copy.default, (wait,), emit.fake(w.shape, w.dtype, w.device), device=w.device)
    wait.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)


_AUTOGRAD = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_to_all_single": "all_to_all"}


def finish_traced(cap: Capture, counts: dict[str, int], ranks: int, group: str, stage: str | None = None,
                  capacity: float | None = None, shard_shared: bool = False, split: int = 1,
                  local: bool = True) -> tuple[Capture, dict[str, Shard]]:
    """The ep-local step traced through ``hf_forwards``: its collectives made the plain functional ones
    the passes read (named, by kind, phase and bytes, on the ep axis; with ``stage``, their payloads
    copied there and back, as gloo ranks on a GPU need), and the other gradients and the loss
    averaged over the ep ranks (``partition``'s last step). ``local=False`` leaves that last step to
    ``finish_local``, once the tp axis has partitioned the step (its ZeRO over ep cuts tp-local shards)."""
    from ..capture import forward_nodes

    gm = copy.deepcopy(cap.gm)
    g = gm.graph
    fwd = forward_nodes(gm)
    auto = getattr(torch.ops, "_c10d_functional_autograd", None)
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        name = next((k for k in _AUTOGRAD if auto is not None
                     and n.target is getattr(getattr(auto, k, None), "default", None)), None)
        if name is not None:
            n.target = getattr(emit.c10d, name).default
        kind = emit.COLLECTIVE_TARGETS.get(n.target)
        if kind is None or collective_of(n) is not None:
            continue
        v = n.meta["val"] if kind != "reduce_scatter" else n.args[0].meta["val"]
        what = {"all_gather": "every rank's pairs to every rank's experts", "reduce_scatter": "expert outputs "
                "summed back to their ranks", "all_to_all": "pairs to and from their experts' ranks (capacity)"
                }.get(kind, "")
        mark(n, emit.collective(kind, v.numel() * v.dtype.itemsize, ranks, "fwd" if n in fwd else "bwd",
                                     axis="ep", reason=what if n in fwd else f"gradients: {what}"))
        _staged(g, n, stage)
    params = dict(zip(g.find_nodes(op="placeholder")[: cap.n_params], cap.param_names))
    shared = _finish_local(g, cap, params, counts, ranks, group, stage, shard_shared, split) if local else {}
    g.lint()
    gm.recompile()
    by_module: dict[str, list[str]] = {}
    for name in counts:  # the experts' parameters, by the module that holds them, in model order
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    # dropless: tokens, ids, gates in and the outputs back; capacity: the slots there and back
    layers = [{"params": sorted(names), "experts": counts[names[0]], "ranks": ranks,
               "capacity": None if capacity is None else f"x{capacity:g}",
               "fwd_collectives": (4 if capacity is None else 2) * split}
              for names in by_module.values()]
    shapes = [torch.Size(shared[n].local_shape) if n in shared else s for n, s in zip(cap.param_names, cap.param_shapes)]
    return (dataclasses.replace(cap, gm=gm, param_shapes=shapes, moe_layers=layers),
            {n: Shard(0) for n in {**counts, **shared}})


def finish_local(cap: Capture, experts, ranks: int, group: str, stage: str | None = None, shard_shared: bool = False,
                 split: int = 1) -> tuple[Capture, dict[str, Shard]]:
    """``finish_traced``'s last step (``_finish_local``) on ``cap``, a step traced with ``local=False`` and since
    partitioned over tp: ``experts`` names the parameters the trace split over ep."""
    gm = copy.deepcopy(cap.gm)
    g = gm.graph
    params = dict(zip(g.find_nodes(op="placeholder")[: cap.n_params], cap.param_names))
    shared = _finish_local(g, cap, params, set(experts), ranks, group, stage, shard_shared, split)
    g.lint()
    gm.recompile()
    shapes = [torch.Size(shared[n].local_shape) if n in shared else s
              for n, s in zip(cap.param_names, cap.param_shapes)]
    return dataclasses.replace(cap, gm=gm, param_shapes=shapes), {n: Shard(0) for n in {*experts, *shared}}
