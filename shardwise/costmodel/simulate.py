"""Simulate one step of a scheduled program on two lanes, compute and communication.

Walk the node order: a compute node advances the compute lane by its estimated time; a collective
start queues on the communication lane (one collective at a time, in issue order, as on one NCCL
stream) from the moment it is issued; a wait holds the compute lane until its collective ends.
The compute lane's idle time in waits is the exposed communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

WAIT = torch.ops._c10d_functional.wait_tensor.default


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
             comm_time: Callable[[fx.Node], float]) -> Timeline:
    """Predicted step of ``gm`` under the two estimators (pluggable, so tests can use exact ones)."""
    t = 0.0  # compute lane
    comm_free = 0.0
    ends: dict[fx.Node, float] = {}
    exposed = busy_c = busy_m = 0.0
    events = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.meta.get("sw") is not None:  # a collective start, as the passes mark them
            d = comm_time(n)
            s = max(t, comm_free)
            comm_free = ends[n] = s + d
            busy_m += d
            events.append(("comm", f"{n.meta['sw']['kind']} {n.meta['sw'].get('param') or ''}".strip(), s, s + d))
        elif n.target is WAIT:
            end = ends.get(n.args[0], t)
            if end > t:
                exposed += end - t
                events.append(("wait", n.name, t, end))
                t = end
        else:
            d = compute_time(n)
            if d:
                events.append(("compute", n.name, t, t + d))
            t += d
            busy_c += d
    return Timeline(step_s=max(t, comm_free), compute_s=busy_c, exposed_comm_s=exposed, comm_s=busy_m, events=events)
