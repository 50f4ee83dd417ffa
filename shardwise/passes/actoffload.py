"""Activation offload: a saved activation waits for the backward in host memory, not on the device.

For each chosen forward value the backward reads: right after it is made, ``to_host`` starts its copy out
(runtime/ops.py); early in the backward, ``to_device`` starts its copy back, and a ``wait_tensor`` right before its
first backward reader waits for it. The device value dies after its last forward reader instead of living into the
backward. The copy back starts where the backward compute before the first reader is predicted to take as long as the
copy (``fetch_s``), never in the forward.

Inserted after scheduling, so the collective schedule is untouched."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ..capture import forward_nodes
from ..runtime.ops import TO_DEVICE, TO_HOST
from ..sharding.collective import collective_of
from ..sharding.ops import WAIT, aliases_input, tensor_bytes
from . import emit


def _views(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """For each node that owns its storage, the views of it (chains of aliasing nodes), in order."""
    owner: dict[fx.Node, fx.Node] = {}
    views: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        src = n.all_input_nodes[0] if n.all_input_nodes else None
        if aliases_input(n) and n.target is not WAIT and src is not None and src in owner:
            owner[n] = owner[src]
            views[owner[n]].append(n)
        else:
            owner[n], views[n] = n, []
    return views


def candidates(gm: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    """Forward values the backward reads (itself or through views of it), largest first: what offload
    can move out. Graph inputs, collectives and values already moved are left out."""
    fwd, out = forward_nodes(gm), gm.graph.find_nodes(op="output")[0]
    got = []
    for o, vs in _views(gm).items():
        if o not in fwd or not isinstance(o.meta.get("val"), torch.Tensor) or collective_of(o) is not None \
                or o.target in (TO_HOST, TO_DEVICE):
            continue
        if any(u not in fwd and u is not out and u not in vs for x in (o, *vs) for u in x.users):
            got.append((o, tensor_bytes(o.meta["val"])))
    return sorted(got, key=lambda nb: -nb[1])


def apply(gm: fx.GraphModule, names, node_s: Callable[[fx.Node], float], fetch_s: Callable[[int], float]) -> list[str]:
    """Offload the saved values named in ``names``; returns the names offloaded. ``node_s`` predicts a
    node's time, ``fetch_s`` a copy back of so many bytes."""
    g = gm.graph
    fwd, out = forward_nodes(gm), g.find_nodes(op="output")[0]
    like = next(p for p in g.find_nodes(op="placeholder") if getattr(p.meta.get("val"), "device", None) is not None
                and p.meta["val"].device.type != "meta")
    nodes = list(g.nodes)
    pos, views, done = {n: i for i, n in enumerate(nodes)}, _views(gm), []
    for n, nbytes in candidates(gm):
        if n.name not in names:
            continue
        group = [n, *views[n]]
        readers = {x: [u for u in x.users if u not in fwd and u is not out and u not in group] for x in group}
        first = min((u for us in readers.values() for u in us), key=pos.__getitem__)
        # where the copy back starts: enough predicted backward compute before the first reader
        need, at = fetch_s(nbytes), first
        i = pos[first]
        while need > 0 and i - 1 > pos[n] and nodes[i - 1] not in fwd and nodes[i - 1].op == "call_function":
            i -= 1
            need -= node_s(nodes[i])
            at = nodes[i]
        v = n.meta["val"]
        with g.inserting_after(n):
            h = g.call_function(TO_HOST, (n,))
        h.meta["val"] = emit.fake(v.shape, v.dtype, "cpu")
        h.meta["sw_host"] = True  # the host tier: no device memory (on CPU, a separate pool)
        with g.inserting_before(at):
            y = g.call_function(TO_DEVICE, (h, like))
        y.meta["val"] = v
        with g.inserting_before(first):
            w = g.call_function(emit.WAIT, (y,))
            w.meta["val"] = v
            w.meta["sw_act"] = n.name
            # the backward's views of the value, made again on the fetched copy
            again = {n: w}
            for x in views[n]:
                again[x] = g.node_copy(x, lambda a: again.get(a, a))
        for x, us in readers.items():
            for u in us:
                u.replace_input_with(x, again[x])
        for x in reversed(views[n]):  # forward views only the backward read are dead now
            if not x.users:
                g.erase_node(x)
        done.append(n.name)
    if done:
        g.lint()
        gm.recompile()
    return done
