"""Matrix products beside a collective leave SMs free for it (runtime/carveout.py says why).

The cost model's two-lane simulation of the finished program (``costmodel.simulate``: each node's
predicted time, each collective's α-β time) says when each product runs and when each collective
is on the link. A product predicted to take at least ``min_s`` and to overlap a collective becomes
its carved twin (same arguments, then the SMs to leave free), which runs the product with the
carveout set and puts it back. Products with the link idle beside them keep every SM, and so do
short ones (for them a carved call's cost, ~10 µs on the host, is not worth it). Each carved product
keeps its ATen op in ``meta["sw_product"]`` (its FLOPs) and its share of the SMs in
``meta["sm_share"]``: the roofline stretches its compute-bound time by that share.

Runs last (``shard_step``), on the program every choice settled on: buckets, in-flight cap and
memory plan are chosen on uncarved candidates. The choice is a function of the graph and the cost model
(roofline and link profile), so every rank makes the same one.
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from ..costmodel.simulate import simulate
from ..runtime.carveout import CARVED


def apply(gm: fx.GraphModule, sms: int, share: float, compute_time: Callable[[fx.Node], float],
          comm_time: Callable[[fx.Node], float], min_s: float = 0.0) -> int:
    """Carve the products predicted to run beside a collective; returns how many there are."""
    tl = simulate(gm, compute_time, comm_time)
    comm = sorted((s, e) for lane, _, s, e in tl.events if lane == "comm" and e > s)
    runs = {name: (s, e) for lane, name, s, e in tl.events if lane == "compute"}
    carved = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in CARVED or n.kwargs or n.name not in runs:
            continue
        s, e = runs[n.name]
        if e - s < min_s or not any(cs < e and s < ce for cs, ce in comm):
            continue
        n.meta["sw_product"] = n.target
        n.meta["sm_share"] = share
        n.target = CARVED[n.target]
        n.args = (*n.args, sms)
        carved += 1
    if carved:
        gm.graph.lint()
        gm.recompile()
    return carved
