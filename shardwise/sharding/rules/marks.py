"""Marks: a value that must lie in a given placement, whatever its producer leaves it in (sequence parallelism marks the
residual stream where it is made; the GSPMD ``mark_sharding``). A mark is an identity node (``mark(x, placement)``) that
the partitioner removes once the reshard it asks for is in place; every reader of the value reads the marked one."""

from __future__ import annotations

import torch.fx as fx

from ..ops import register
from .base import val


def mark(x, placement):
    """The identity: ``x``, to lie in ``placement`` on the axis."""
    return x


def insert(g: fx.Graph, node: fx.Node, placement) -> fx.Node:
    """A mark of ``node``'s value, read by every reader of ``node`` from now on."""
    users = list(node.users)
    with g.inserting_after(node):
        m = g.call_function(mark, (node, placement))
    m.meta["val"] = node.meta.get("val")
    for u in users:
        u.replace_input_with(node, m)
    return m


def remove(g: fx.Graph) -> None:
    """Every mark replaced by its value (the reshard before it already in place)."""
    for n in list(g.find_nodes(op="call_function", target=mark)):
        n.replace_all_uses_with(n.args[0])
        g.erase_node(n)


def rule(node, place, ranks):
    p = node.args[1]
    return ({node.args[0]: p} if place(node.args[0]) != p and val(node.args[0]) is not None else {}), p


register(mark, rule=rule)
