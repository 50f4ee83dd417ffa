"""Selective recomputation: elementwise forward results are recomputed in the backward, not kept.

A forward value the backward reads stays alive into the backward. When it is a cheap elementwise function of values
alive anyway (inputs, matrix-product outputs the backward needs), the backward can recompute it and the forward copy
dies after its last forward use: saved activations shrink for a few elementwise kernels (the papers' "selective
recomputation", torch's min-cut partitioner; here on the joint graph).

Decided in forward order: a value is recomputed when all its tensor inputs are placeholders or kept forward values (not
themselves recomputed). A copy of the node goes right before its first backward reader; deterministic elementwise
arithmetic, so results are identical."""

from __future__ import annotations

import torch.fx as fx

from ..capture import forward_nodes
from ..sharding.collective import collective_of
from ..sharding.ops import elementwise


def apply(gm: fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` in place; returns the names of the recomputed forward nodes."""
    g = gm.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    fwd, out = forward_nodes(gm), g.find_nodes(op="output")[0]

    def bwd_users(n):
        return [u for u in n.users if u not in fwd and u is not out]

    kept = {n for n in nodes if n in fwd and n.op != "placeholder" and bwd_users(n)}
    done = []
    for n in nodes:
        if (n not in kept or not elementwise(n) or out in n.users or collective_of(n) is not None
                or any(collective_of(a) is not None or not (a.op == "placeholder" or a in kept)
                       for a in n.all_input_nodes)):
            continue
        users = sorted(bwd_users(n), key=pos.__getitem__)
        with g.inserting_before(users[0]):
            again = g.node_copy(n)
        again.meta = dict(n.meta)
        for u in users:
            u.replace_input_with(n, again)
        kept.discard(n)
        done.append(n.name)
    g.lint()
    gm.recompile()
    return done
