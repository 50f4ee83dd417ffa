"""Matrix products beside a collective leave SMs free for it (runtime/carveout.py says why).

Walks the finished program in order, keeping the collectives started and not yet waited for. A
matrix product placed while one is in flight runs beside it on the GPU: it becomes its carved twin
(same arguments, then the SMs to leave free), which runs the product with the carveout set and puts
it back. Products with nothing in flight keep every SM. Each carved product keeps its ATen op in
``meta["sw_product"]`` (its FLOPs) and the share of the SMs it gets in ``meta["sm_share"]``: the
roofline stretches its time by that share.

Runs after scheduling (and after activation offload and readiness waits), so the collective
schedule is the one the cost model chose. Every rank makes the same change (the same program),
though it only changes local kernels.
"""

from __future__ import annotations

import torch.fx as fx

from ..runtime.carveout import CARVED
from . import _emit

WAIT = _emit.c10d.wait_tensor.default


def apply(gm: fx.GraphModule, sms: int, share: float) -> int:
    """Carve the products that run while a collective is in flight; returns how many there are."""
    in_flight: set[fx.Node] = set()
    carved = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _emit.COLLECTIVE_TARGETS:
            in_flight.add(n)
        elif n.target is WAIT and n.args[0] in in_flight:
            in_flight.discard(n.args[0])
        elif n.target in CARVED and in_flight and not n.kwargs:
            n.meta["sw_product"] = n.target
            n.meta["sm_share"] = share
            n.target = CARVED[n.target]
            n.args = (*n.args, sms)
            carved += 1
    if carved:
        gm.graph.lint()
        gm.recompile()
    return carved
