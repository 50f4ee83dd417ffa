"""A collective in a rewritten step graph: what it moves, over which mesh axis, for which parameters.

Passes put one ``Collective`` on each collective's start node (``node.meta["collective"]``); the cost model, the
scheduler, ``explain`` and the tests read it back with ``collective_of``."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

KEY = "collective"


@dataclass(frozen=True)
class Collective:
    kind: str
    """``all_gather``, ``reduce_scatter`` or ``all_reduce``."""
    full_bytes: int
    """Bytes of the whole tensor: the all-gather output, the reduce-scatter input, the all-reduce buffer."""
    sent_bytes: int
    """Bytes one rank sends under a ring algorithm (costmodel.sent_bytes)."""
    ranks: int
    """Ranks of the group it runs over (the size of ``axis``)."""
    axis: str = "dp"
    """The mesh axis whose group it runs over."""
    phase: str = "fwd"
    """``fwd`` or ``bwd``: where in the step its pass put it."""
    params: tuple[str, ...] = ()
    """The parameters it gathers or reduces (a bucket's several; none for the loss's all-reduce)."""
    reason: str = ""
    """Why it is there, where no parameter says (a tp reshard: the placements, the value, its readers)."""

    @property
    def param(self) -> str | None:
        """The one parameter of a per-parameter collective, else None."""
        return self.params[0] if len(self.params) == 1 else None

    @property
    def label(self) -> str:
        return ",".join(self.params) or self.reason

    def __str__(self) -> str:
        return f"{self.kind}[{self.axis}x{self.ranks}] {self.full_bytes}B {self.phase} {self.label}".rstrip()


def collective_of(node: fx.Node) -> Collective | None:
    """The collective a start node runs, or None for any other node."""
    return node.meta.get(KEY)


def mark(node: fx.Node, c: Collective) -> None:
    node.meta[KEY] = c
