"""Sharding propagation over the joint graph (forward and backward together), on one mesh axis.

Seeds place some inputs (the tensor-parallel plan's parameters); every other input is replicated. Nodes are visited in
graph order, so each one's inputs are placed before it: the op's rule (sharding/rules/, registered in the op registry)
takes the inputs' placements and says which placements it needs them in and what its output is. Where an input is not in
the placement its rule needs, a ``Reshard`` is recorded on that edge: the collective the partitioner inserts there (S→R
all-gather, P→R all-reduce, P→S reduce-scatter, S(d)→S(d') all-to-all, R→S a local slice). The graph's outputs want the
loss replicated and each gradient placed as its parameter.

Partial values (pending sums) flow on through linear ops (views, additions of partials, products
with replicated factors) and are reduced where an op needs the whole value: a row-parallel product's
output is all-reduced once before the residual addition, however many views lie between. The result
is a function of the graph and the seeds alone, so every rank derives the same plan.

    >>> import torch
    >>> from shardwise.sharding import Shard, Replicate
    >>> from shardwise.sharding.propagate import propagate
    >>> g = torch.fx.Graph()
    >>> x, w = g.placeholder("x"), g.placeholder("w")
    >>> x.meta["val"], w.meta["val"] = torch.empty(4, 8), torch.empty(8, 6)
    >>> y = g.call_function(torch.ops.aten.mm.default, (x, w)); y.meta["val"] = torch.empty(4, 6)
    >>> _ = g.output([y])
    >>> plan = propagate(torch.fx.GraphModule(torch.nn.Module(), g), {w: Shard(1)}, 2, outputs=[Replicate()])
    >>> str(plan.placements[y]), [str(r) for r in plan.reshards]
    ('S(1)', ['all_gather S(1)->R of mm_default into output'])
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch.fx as fx

from . import rules  # noqa: F401 - the op families' rules enter the op registry on import
from .ops import info
from .placements import Partial, Replicate, Shard
from .rules.base import R, ShardingError, norm, val
from .rules.matmul import FEWER_BYTES
from .rules.pointwise import is_pointwise, pointwise_rule


@dataclass(frozen=True)
class Reshard:
    """``arg`` is moved from ``src`` to ``dst`` before ``node`` reads it."""

    node: fx.Node
    arg: fx.Node
    src: object
    dst: object

    @property
    def kind(self) -> str:
        """The collective that does it (or ``slice``: a local slice of a replicated value; ``one_rank``:
        a replicated value kept on the axis's first rank, zeros on the others, so a sum of it is once)."""
        s, d = self.src, self.dst
        if isinstance(d, Partial) and isinstance(s, Replicate):
            return "one_rank"
        if isinstance(s, Partial):
            return "all_reduce" if isinstance(d, Replicate) else "reduce_scatter"
        if isinstance(s, Shard):
            return "all_gather" if isinstance(d, Replicate) else "all_to_all"
        return "slice"

    def __str__(self) -> str:
        return f"{self.kind} {self.src}->{self.dst} of {self.arg.name} into {self.node.name}"


@dataclass
class Propagation:
    """Each node's placement on the axis (a tuple for an op of several outputs), and the reshards to insert."""

    ranks: int
    placements: dict = field(default_factory=dict)
    reshards: list = field(default_factory=list)

    def collectives(self) -> list[Reshard]:
        """The reshards as the partitioner inserts them: one per value and placement it is moved to
        (readers that need the same value alike share it), in graph order."""
        first: dict = {}
        for r in self.reshards:
            first.setdefault((r.arg, r.dst), r)
        return list(first.values())

    def count(self, kind: str) -> int:
        """Collectives of ``kind`` the partitioner inserts."""
        return sum(r.kind == kind for r in self.collectives())


def check_divisible(node: fx.Node, p, ranks: int, names: dict | None = None) -> None:
    v = val(node)
    if isinstance(p, Shard) and v is not None and v.shape[p.dim] % (ranks * p.groups):
        cut = f"{p.groups} blocks over {ranks} ranks" if p.groups > 1 else f"over {ranks} ranks"
        raise ShardingError(f"{(names or {}).get(node, node.name)} ({node.target}) of shape {tuple(v.shape)} would be sharded on dim {p.dim} "
                            f"{cut}, which do not divide its {v.shape[p.dim]}: choose a tensor-parallel "
                            f"size that divides it, or replicate the parameter feeding it in the tp plan")


def whole(node: fx.Node, place, ranks: int):
    """An op read on whole inputs (``allow_replicate``): its outputs are whole."""
    return {a: R for a in node.all_input_nodes if place(a) != R and val(a) is not None}, replicated(node, place, ranks)[1]


def replicated(node: fx.Node, place, ranks: int):
    """An op every input of which is whole: its outputs are whole too."""
    v = node.meta.get("val")
    return {}, (tuple(R for _ in v) if isinstance(v, (list, tuple)) else R)


def propagate(gm: fx.GraphModule, seeds: dict, ranks: int, outputs: list | None = None,
              names: dict | None = None, prefer: dict | None = None, allow_replicate: bool = False,
              gather: str = "activation") -> Propagation:
    """Place every node of ``gm`` on an axis of ``ranks`` ranks from ``seeds`` (placeholder -> placement); ``outputs``:
    the placement each graph output must have (None: as its producer leaves it); ``names``: what errors call a
    placeholder (its parameter's name); ``prefer``: {shape: Shard} where a partial value of that shape that a reader
    needs whole is reduce-scattered to the shard instead, if the reader takes it so (sequence parallelism: the residual
    stream's gradients, by their shape); ``allow_replicate``: an op without a rule reads its inputs whole (a warning
    names it) instead of stopping with an error; ``gather``: which operand a product of operands sharded on different
    dims gathers (``GATHER``)."""
    if gather not in GATHER:
        raise ValueError(f"gather must be one of {GATHER}, got {gather!r}")
    token = FEWER_BYTES.set(gather == "fewer_bytes")
    try:
        return _propagate(gm, seeds, ranks, outputs, names, prefer, allow_replicate)
    finally:
        FEWER_BYTES.reset(token)


GATHER = ("activation", "fewer_bytes")
"""How a product of operands sharded on different dims is resolved (sharding/rules/matmul.py)."""


def _propagate(gm: fx.GraphModule, seeds: dict, ranks: int, outputs: list | None = None,
               names: dict | None = None, prefer: dict | None = None, allow_replicate: bool = False) -> Propagation:
    """``propagate``'s walk over the graph, under the product policy it set."""
    plan = Propagation(ranks)
    pl, prefer = plan.placements, prefer or {}

    def place(a):
        return pl.get(a, R) if isinstance(a, fx.Node) else None

    def scattered(n, rule, need):
        """``need`` with the partials of a preferred shape reduce-scattered where the rule allows."""
        move = {a: prefer[tuple(val(a).shape)] for a, d in need.items()
                if d == R and isinstance(place(a), Partial) and val(a) is not None and tuple(val(a).shape) in prefer}
        if not move:
            return None
        need2, out2 = rule(n, lambda a: move.get(a, place(a)), ranks)
        return None if any(a in need2 for a in move) else ({**need2, **move}, out2)

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            pl[n] = norm(seeds.get(n, R), val(n).dim() if val(n) is not None else 1)
            check_divisible(n, pl[n], ranks, names)
        elif n.op == "call_function":
            rule = info(n.target).rule
            if rule is None and all(place(a) == R for a in n.all_input_nodes):
                rule = replicated  # any op runs as it is on whole values
            if rule is None and is_pointwise(n):
                rule = pointwise_rule
            elif rule is None:
                got = {a.name: str(place(a)) for a in n.all_input_nodes}
                if not allow_replicate:
                    raise ShardingError(f"no sharding rule for {n.target} (node {n.name}, inputs placed {got}); "
                                        "add one in shardwise/sharding/rules/, replicate what feeds it in the tp "
                                        "plan, or pass allow_replicate=True to run it on whole inputs")
                warnings.warn(f"shardwise: no sharding rule for {n.target} (node {n.name}, inputs placed {got}): "
                              "it runs on whole inputs (allow_replicate=True); explain shows the gathers",
                              stacklevel=2)
                rule = whole
            need, out = rule(n, place, ranks)
            need, out = scattered(n, rule, need) or (need, out)
            for a, dst in need.items():
                if dst != place(a):
                    plan.reshards.append(Reshard(n, a, place(a), dst))
            pl[n] = out
            for p in (out if isinstance(out, tuple) else (out,)):
                if isinstance(p, Shard) and val(n) is not None:
                    check_divisible(n, p, ranks)
        elif n.op == "output" and outputs is not None:
            for a, dst in zip(n.args[0], outputs):
                if isinstance(a, fx.Node) and dst is not None and dst != place(a):
                    plan.reshards.append(Reshard(n, a, place(a), dst))
    return plan
