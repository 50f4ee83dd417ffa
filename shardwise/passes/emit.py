"""Emit functional collectives and small reshapes into an FX graph.

Every collective is a ``_c10d_functional`` op followed by its ``wait_tensor``; the start node carries a ``Collective``
(sharding/collective.py): its kind, the bytes of the whole tensor and what one rank sends, the ranks and mesh axis of
its group, its phase and parameters. The cost model, the scheduler, ``explain`` and the tests read the graph back
through it."""

from __future__ import annotations

import math
import operator
from typing import Iterable

import torch
import torch.fx as fx

from ..costmodel.collectives import sent_bytes
from ..sharding import ShardLayout
from ..sharding.collective import Collective, collective_of, mark

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default

COLLECTIVE_TARGETS = {c10d.all_gather_into_tensor.default: "all_gather",
                      c10d.reduce_scatter_tensor.default: "reduce_scatter",
                      c10d.all_reduce.default: "all_reduce", c10d.all_to_all_single.default: "all_to_all"}


def val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def node(g: fx.Graph, target, args, like: torch.Tensor | None = None, **kwargs) -> fx.Node:
    """A call of ``target`` appended where ``g`` inserts, its ``meta["val"]`` set to ``like``."""
    n = g.call_function(target, tuple(args), kwargs)
    if like is not None:
        n.meta["val"] = like
    return n


_FAKE = None


def fake(shape, dtype, device) -> torch.Tensor:
    """A fake tensor recording the shape, dtype and device of a new node (read by passes, never run)."""
    global _FAKE
    from torch._subclasses.fake_tensor import FakeTensorMode

    if _FAKE is None:
        _FAKE = FakeTensorMode(allow_non_fake_inputs=True)
    with _FAKE:
        return torch.empty(tuple(shape), dtype=dtype, device=device)


def collective(kind: str, full_bytes: int, ranks: int, phase: str, params=(), axis: str = "dp",
               reason: str = "") -> Collective:
    """The ``Collective`` of one start node (ring bytes from the cost model's bus factor)."""
    params = (params,) if isinstance(params, str) else tuple(params or ())
    return Collective(kind, full_bytes, sent_bytes(kind, full_bytes, ranks), ranks, axis, phase, params, reason)


def retrace(gm: fx.GraphModule, local_shape) -> None:
    """Clean ``gm`` up, recompile it, and trace every value again on fake inputs, each placeholder's
    of the shape ``local_shape(placeholder, recorded shape)`` gives (a partition pass's local sizes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode, fakes = FakeTensorMode(allow_non_fake_inputs=True), []
    for ph in gm.graph.find_nodes(op="placeholder"):
        v = ph.meta["val"]
        fakes.append(mode.from_tensor(torch.empty(list(local_shape(ph, v.shape)), dtype=v.dtype, device=v.device)))
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


def restore_topological_order(g: fx.Graph) -> bool:
    """Move each node that reads a value defined after it to just after its last input, keeping
    every other node where it is (a stable topological sort, earliest position first); returns
    whether anything moved. A pass that replaces a value by one made later (a bucket's collective
    replacing a member's) calls this, so the member's readers follow the new definition."""
    import heapq

    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    need = {n: len(n.all_input_nodes) for n in nodes}
    ready = [i for i, n in enumerate(nodes) if need[n] == 0]  # positions: a heap of ints, earliest first
    order = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for u in n.users:
            need[u] -= 1
            if need[u] == 0:
                heapq.heappush(ready, pos[u])
    if len(order) != len(nodes):
        raise RuntimeError("internal: the graph has a cycle")
    if order == nodes:
        return False
    out = order[-1]
    for n in order[:-1]:
        out.prepend(n)
    return True


def cast(g: fx.Graph, x: fx.Node, dtype: torch.dtype | None) -> fx.Node:
    if dtype is None or (v := val(x)).dtype == dtype:
        return x
    return node(g, aten._to_copy.default, (x,), fake(v.shape, dtype, v.device), dtype=dtype)


def contiguous(g: fx.Graph, x: fx.Node) -> fx.Node:
    if (v := val(x)).is_contiguous():
        return x
    return node(g, aten.clone.default, (x,), fake(v.shape, v.dtype, v.device), memory_format=torch.contiguous_format)


def reshape(g: fx.Graph, x: fx.Node, shape: Iterable[int]) -> fx.Node:
    shape = list(shape)
    if list((v := val(x)).shape) == shape:
        return x
    return node(g, aten.view.default, (contiguous(g, x), shape), fake(shape, v.dtype, v.device))


def start_and_wait(g, target, args, out_shape, dtype, device, c: Collective, stage: str | None = None) -> fx.Node:
    """Start + wait. With ``stage`` (e.g. "cpu") the payload is copied there and back around the
    collective: gloo ranks sharing one GPU need host tensors for all-gather and reduce-scatter."""
    if stage is not None and torch.device(stage) != torch.device(device):
        x = args[0]
        v = val(x)
        host = node(g, aten._to_copy.default, (x,), fake(v.shape, v.dtype, stage), device=torch.device(stage))
        out = start_and_wait(g, target, (host, *args[1:]), out_shape, dtype, stage, c)
        return node(g, aten._to_copy.default, (out,), fake(out_shape, dtype, device), device=device)
    start = node(g, target, args, fake(out_shape, dtype, device))
    mark(start, c)
    return node(g, WAIT, (start,), fake(out_shape, dtype, device))


def all_gather(g: fx.Graph, shard: fx.Node, layout: ShardLayout, group: str, *, param: str | None = None,
               phase: str = "fwd", stage: str | None = None, axis: str = "dp") -> fx.Node:
    """Full parameter (``layout.shape``) from this rank's padded ``Shard(0)`` piece (over mesh ``axis``)."""
    v = val(shard)
    if layout.ranks == 1:
        return reshape(g, shard, layout.shape)
    nbytes = math.prod(layout.padded_shape) * v.dtype.itemsize
    c = collective("all_gather", nbytes, layout.ranks, phase, (param,) if param else (), axis=axis)
    out = start_and_wait(g, c10d.all_gather_into_tensor.default, (contiguous(g, shard), layout.ranks, group),
                         layout.padded_shape, v.dtype, v.device, c, stage)
    if layout.pad_rows:
        rows = layout.shape2[0]
        out = node(g, aten.slice.Tensor, (out, 0, 0, rows), fake((rows, *layout.shape2[1:]), v.dtype, v.device))
    return reshape(g, out, layout.shape)


def reduce_scatter(g: fx.Graph, full: fx.Node, layout: ShardLayout, group: str, *, param: str | None = None,
                   op: str = "avg", stage: str | None = None, axis: str = "dp") -> fx.Node:
    """This rank's ``Shard(0)`` piece of the ``op``-reduction of ``full`` over the group (of mesh ``axis``)."""
    v = val(full)
    x = reshape(g, full, layout.shape2)
    if layout.ranks == 1:
        return x
    if layout.pad_rows:
        pad = [0, 0] * (len(layout.shape2) - 1) + [0, layout.pad_rows]
        x = node(g, aten.constant_pad_nd.default, (x, pad, 0.0), fake(layout.padded_shape, v.dtype, v.device))
    nbytes = math.prod(layout.padded_shape) * v.dtype.itemsize
    c = collective("reduce_scatter", nbytes, layout.ranks, "bwd", (param,) if param else (), axis=axis)
    return start_and_wait(g, c10d.reduce_scatter_tensor.default, (contiguous(g, x), op, layout.ranks, group),
                          layout.local_shape, v.dtype, v.device, c, stage)


def all_reduce_many(g: fx.Graph, xs: list[fx.Node], ranks: int, group: str, *, op: str = "avg", phase: str = "bwd",
                    params=(), stage: str | None = None, axis: str = "dp") -> list[fx.Node]:
    """All-reduce several same-dtype tensors as one flat bucket (on mesh ``axis``); returns the reduced tensors."""
    if ranks == 1:
        return list(xs)
    vs = [val(x) for x in xs]
    dtype, device = vs[0].dtype, vs[0].device
    sizes = [v.numel() for v in vs]
    flats, total = [reshape(g, x, [n]) for x, n in zip(xs, sizes)], sum(sizes)
    flat = flats[0] if len(flats) == 1 else node(g, aten.cat.default, (flats,), fake([total], dtype, device))
    c = collective("all_reduce", total * dtype.itemsize, ranks, phase, params, axis=axis)
    red = start_and_wait(g, c10d.all_reduce.default, (flat, op, group), [total], dtype, device, c, stage)
    if len(xs) == 1:
        return [reshape(g, red, vs[0].shape)]
    parts = node(g, aten.split_with_sizes.default, (red, sizes))
    return [reshape(g, node(g, operator.getitem, (parts, i), fake([n], dtype, device)), v.shape)
            for i, (v, n) in enumerate(zip(vs, sizes))]


def sum_after_last(g: fx.Graph, xs: list[fx.Node], ranks: int, group: str, *, axis: str, params=(),
                   stage: str | None = None) -> list[fx.Node]:
    """``xs`` summed over the group: one all-reduce per dtype, placed right after the last of them
    is made (gradients of parameters whole on ``axis``); returns the sums, in ``xs``'s order."""
    order = {n: i for i, n in enumerate(g.nodes)}
    by_dtype: dict = {}
    for i, x in enumerate(xs):
        by_dtype.setdefault(val(x).dtype, []).append(i)
    out: list = [None] * len(xs)
    for idx in by_dtype.values():
        last = max((xs[i] for i in idx), key=order.__getitem__)
        with g.inserting_after(last):
            anchor = g.call_function(aten.alias.default, (last,))  # keeps the insertion point
        anchor.meta["val"] = val(last)
        with g.inserting_before(anchor):
            summed = all_reduce_many(g, [xs[i] for i in idx], ranks, group, op="sum", phase="bwd", axis=axis,
                                     stage=stage, params=tuple(params[i] for i in idx) if params else ())
        g.erase_node(anchor)
        for i, y in zip(idx, summed):
            out[i] = y
    return out


def collectives(gm: fx.GraphModule, axis: str | None = None) -> list[fx.Node]:
    """The collective-start nodes of a graph (on mesh ``axis``, or on any), in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and collective_of(n) is not None
            and (axis is None or collective_of(n).axis == axis)]
