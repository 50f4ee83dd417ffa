"""Simulate one step of a scheduled program on two lanes, compute and communication.

Walk the node order: a compute node advances the compute lane by its estimated time; a collective start queues on the
communication lane (one collective at a time, in issue order, as on one NCCL stream) from the moment it is issued; a
wait holds the compute lane until its collective ends. The compute lane's idle time in waits is the exposed
communication.

With ``free``, the lanes also share the SMs: ``free(node)`` is the share of a collective's SMs a compute node leaves
while it runs. 0 (a persistent product, a block on every SM): a collective due while it runs, or within ``RACE_S``
before it starts, starts when it ends. Between 0 and 1 (a carved product): a collective due while it runs starts, and
runs ``1 / share`` times as long. 1: no contention (default)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from ..sharding.collective import collective_of
from ..sharding.ops import WAIT

RACE_S = 50e-6
"""A collective due this soon before a product that fills the SMs starts loses them to it: its kernel
launches on another stream after an event wait, the product right behind on the compute stream
(sitting 6's MoE traces: the products started first though both were ready together)."""


@dataclass
class Timeline:
    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float
    events: list = field(default_factory=list)
    """(lane, name, start_s, end_s) for plotting and explain."""

    @property
    def exposed_pct(self) -> float:
        return 100.0 * self.exposed_comm_s / self.step_s if self.step_s else 0.0


def simulate(gm: fx.GraphModule, compute_time: Callable[[fx.Node], float],
             comm_time: Callable[[fx.Node], float], free: Callable[[fx.Node], float] | None = None) -> Timeline:
    """Predicted step of ``gm`` under the two estimators (pluggable, so tests can use exact ones);
    ``free``: the SM contention model (module docstring), None for none. ``gm`` may also be the node
    list itself (the planner's synthetic per-layer step: objects with an FX node's fields)."""
    t = 0.0  # compute lane
    comm_free = 0.0  # the link is busy until then
    ends: dict[fx.Node, float] = {}
    pending: list[tuple[fx.Node, float, float]] = []  # (start node, issued at, α-β seconds), not started yet
    exposed = busy_c = busy_m = 0.0
    events = []

    def start(n, s, d):
        nonlocal comm_free, busy_m
        comm_free = ends[n] = s + d
        busy_m += d
        c = collective_of(n)
        events.append(("comm", f"{c.kind} {c.label}".strip(), s, s + d))

    def run_beside(lo: float, hi: float, share: float, upto: fx.Node | None = None):
        """Start the pending collectives due before ``hi`` while the compute lane runs a node leaving ``share`` of the
        SMs over [lo, hi) (``hi`` = inf: the lane is idle). One due less than ``RACE_S`` before the node ends waits for
        the next node: a product filling the SMs that starts then still gets them first."""
        nonlocal comm_free
        while pending:
            n, issued, d = pending[0]
            s = max(issued, comm_free)
            if share <= 0.0:  # the node holds every SM: a collective due while it runs starts when it ends
                if s >= hi:
                    return
                if s >= lo - RACE_S:
                    comm_free = max(comm_free, hi)
                    return
            elif s >= hi - RACE_S:
                return
            pending.pop(0)
            start(n, s, d if share >= 1.0 or s < lo else d / share)
            if n is upto:
                return

    for n in gm.graph.nodes if hasattr(gm, "graph") else gm:
        if n.op != "call_function":
            continue
        if collective_of(n) is not None:  # a collective start, as the passes mark them
            if free is None:
                start(n, max(t, comm_free), comm_time(n))
            else:
                pending.append((n, t, comm_time(n)))
        elif n.target is WAIT:
            if any(p[0] is n.args[0] for p in pending):
                run_beside(t, float("inf"), 1.0, upto=n.args[0])  # the compute lane idles until it ends
            end = ends.get(n.args[0], t)
            if end > t:
                exposed += end - t
                events.append(("wait", n.name, t, end))
                t = end
        else:
            d = compute_time(n)
            if pending:
                run_beside(t, t + d, free(n) if d else 1.0)
            if d:
                events.append(("compute", n.name, t, t + d))
            t += d
            busy_c += d
    run_beside(t, float("inf"), 1.0)
    return Timeline(step_s=max(t, comm_free), compute_s=busy_c, exposed_comm_s=exposed, comm_s=busy_m, events=events)
