"""A ZeRO-3 / FSDP step on the compiler's two-lane simulation (costmodel.simulate), layer by layer.

Per micro-batch: the embedding and head's weights gathered first (held to the backward, as FSDP2 holds its root's); each
layer's weights all-gathered before its forward and again before its backward, each gather issued one layer ahead
(FSDP2's default prefetch, DeepSpeed's and XLA's latency-hiding schedule of a scan: one layer in flight); each layer's
gradients reduce-scattered (and, hybrid-sharded, all-reduced across the groups) right after its backward. One
communication lane in issue order; the compute lane waits for a layer's gather before it runs it. What the lane waits is
the exposed communication, where the closed form could only assume a share."""

from __future__ import annotations

from dataclasses import dataclass

from ..costmodel import simulate
from ..sharding.collective import KEY, Collective
from ..sharding.ops import WAIT


class _Node:
    """Just what the simulation reads of an FX node."""

    __slots__ = ("args", "meta", "name", "op", "target")

    def __init__(self, name: str, seconds: float, target=None, args=(), collective: Collective | None = None):
        self.op, self.name, self.target, self.args = "call_function", name, target, args
        self.meta = {"s": seconds} if collective is None else {"s": seconds, KEY: collective}


@dataclass(frozen=True)
class LayerCosts:
    """Seconds of one micro-batch's pieces on this GPU."""

    layers: int
    fwd_s: float
    """One layer's forward (with what stalls the compute lane inside it: exposed tp, ep, cp traffic)."""
    bwd_s: float
    """One layer's backward, its recomputation included."""
    head_s: float
    """The output head's forward and backward, and the loss."""
    gather_s: float
    """All-gathers of one layer's 16-bit weights (over each group that holds a part)."""
    reduce_s: float
    """Its gradients' reduce-scatters (+ the hybrid all-reduces)."""
    root_gather_s: float
    root_reduce_s: float


def _micro_batches(c: LayerCosts, k: int) -> list[_Node]:
    nodes: list[_Node] = []

    def comm(kind: str, s: float, label: str) -> _Node:
        nodes.append(_Node(label, s, collective=Collective(kind, 0, 0, 0, "dp", "", (label,))))
        return nodes[-1]

    def wait(n: _Node) -> None:
        nodes.append(_Node(f"wait {n.name}", 0.0, WAIT, (n,)))

    L = c.layers
    for mb in range(k):
        root = comm("all_gather", c.root_gather_s, f"{mb}.root")
        nxt = comm("all_gather", c.gather_s, f"{mb}.f0")
        wait(root)
        for i in range(L):
            cur = nxt
            if i + 1 < L:
                nxt = comm("all_gather", c.gather_s, f"{mb}.f{i + 1}")
            wait(cur)
            nodes.append(_Node(f"{mb}.fwd{i}", c.fwd_s))
        nxt = comm("all_gather", c.gather_s, f"{mb}.b{L - 1}")
        nodes.append(_Node(f"{mb}.head", c.head_s))
        comm("reduce_scatter", c.root_reduce_s, f"{mb}.root")
        for i in reversed(range(L)):
            cur = nxt
            if i:
                nxt = comm("all_gather", c.gather_s, f"{mb}.b{i - 1}")
            wait(cur)
            nodes.append(_Node(f"{mb}.bwd{i}", c.bwd_s))
            comm("reduce_scatter", c.reduce_s, f"{mb}.r{i}")
    return nodes


def _seconds(n) -> float:
    return n.meta["s"]


def zero3_step(c: LayerCosts, micro_batches: int) -> tuple[float, float, float]:
    """(seconds of the step's forward and backward over ``micro_batches``, of them the compute lane's
    wait for collectives and the trailing reductions, seconds the link is busy). Micro-batches after
    the second repeat the second's increment, so at most two are simulated."""
    tl = [simulate(_micro_batches(c, k), _seconds, _seconds) for k in range(1, min(micro_batches, 2) + 1)]
    a, b, more = tl[-1], tl[0], max(micro_batches - 2, 0)
    step = a.step_s + more * (a.step_s - b.step_s)
    return step, step - (a.compute_s + more * (a.compute_s - b.compute_s)), a.comm_s + more * (a.comm_s - b.comm_s)
