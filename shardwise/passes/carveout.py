"""Matrix products beside a collective leave SMs free for it (runtime/carveout.py says why).

The cost model's two-lane simulation of the finished program (``costmodel.simulate``: each node's
predicted time, each collective's α-β time) says when each product runs and when each collective
is on the link. A product predicted to take at least ``min_s`` and to overlap a collective becomes
its carved twin (same arguments, then the SMs to leave free), which runs the product with the
carveout set and puts it back. Products with the link idle beside them keep every SM, and so do
short ones (for them a carved call's cost, ~10 µs on the host, is not worth it). Each carved product
keeps its ATen op in ``meta["sw_product"]`` (its FLOPs) and its share of the SMs in
``meta["sm_share"]`` (the roofline stretches its time, ``costmodel.compute``).

``auto`` lets the cost model decide whether to carve at all: it simulates the program with the SM
contention model (``contention``; costmodel/simulate.py) uncarved and carved, and carves only if
that is predicted at least ``CARVE_TIE`` faster. Uncarved, a product that fills every SM holds back
a collective due while it runs (what sitting 7's traces show for the MoE's expert gathers);
carved, the collective runs beside it, slower where fewer SMs are left than its kernels need.
``auto`` is ``compile``'s default on CUDA. In sitting 8 (2xH200) it carved the MoE, 4.2% faster
than every SM, and left the 8B shape whole, where carving 24 SMs measured 0.9% slower.

Runs last (``shard_step``), on the program every choice settled on: buckets, in-flight cap and
memory plan are chosen on uncarved candidates. The choice is a function of the graph and the cost model
(roofline and link profile), so every rank makes the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from ..costmodel.simulate import simulate
from ..runtime.carveout import CARVED

CARVE_TIE = 0.02
"""``auto`` carves only where the carved program is predicted at least this much faster (the
in-flight cap's tie band: the model's gains below it did not survive measurement, sitting 6)."""

TILE = 128 * 128
"""Output elements per block of a Hopper cuBLAS product (128 x 128 tiles and up): a product with at
least one tile per SM is taken to fill every SM (persistent kernels keep them until they end)."""


COMM_SMS = 32
"""SMs a collective's kernels need to run at full speed beside a product. Sitting 7 (2xH200): NCCL's
all-gather and reduce-scatter kernels launch 24 blocks, yet the MoE's gathers ran 1.6x longer beside
products leaving 16 or 24 SMs free, and at full speed from 32."""


@dataclass(frozen=True)
class SMCarveout:
    """How products beside a collective share the SMs (``ShardContext.sm_carveout``)."""

    sms: int
    """SMs a carved product leaves free for the collective."""
    total: int
    """The device's SMs; 0 off CUDA, where the carveout is inert (and carves every product beside a
    collective, so the pass is seen at work)."""
    min_s: float = 0.0
    """Products predicted shorter than this keep every SM."""
    need: int = COMM_SMS
    """SMs a collective's kernels need to run at full speed beside a product (``COMM_SMS``)."""
    auto: bool = False
    """Carve only where the contention model predicts a faster step (module docstring)."""

    def __post_init__(self):
        if not (0 < self.sms and 0 < self.need and (self.total == 0 or self.sms < self.total)):
            raise ValueError(f"SMCarveout: need 0 < sms < total (or total 0 off CUDA) and need > 0, got {self}")

    @property
    def share(self) -> float:
        """The share of the SMs a carved product keeps."""
        return (self.total - self.sms) / self.total if self.total else 1.0


def contention(c: SMCarveout) -> Callable[[fx.Node], float]:
    """The share of a collective's SMs a compute node leaves free while it runs (costmodel/simulate.py):
    0 for an uncarved product with a tile per SM, the carved SMs over what the collective needs for
    a carved product, 1 for the rest (small kernels leave SMs free between their blocks)."""
    carved = set(CARVED.values())

    def free(n: fx.Node) -> float:
        if n.target in carved:
            return min(1.0, n.args[-1] / c.need)
        if n.target in CARVED:
            v = n.meta.get("val")
            return 0.0 if v is not None and v.numel() >= TILE * c.total else 1.0
        return 1.0

    return free


def apply(gm: fx.GraphModule, c: SMCarveout, compute_time: Callable[[fx.Node], float],
          comm_time: Callable[[fx.Node], float]) -> tuple[int, tuple[float, float, bool] | None]:
    """Carve the products predicted to run beside a collective. Returns how many were carved and,
    under ``auto``, (predicted step uncarved, carved, whether carved) by the contention model."""
    tl = simulate(gm, compute_time, comm_time)
    comm = sorted((s, e) for lane, _, s, e in tl.events if lane == "comm" and e > s)
    runs = {name: (s, e) for lane, name, s, e in tl.events if lane == "compute"}
    before = simulate(gm, compute_time, comm_time, contention(c)).step_s if c.auto else None
    carved = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in CARVED or n.kwargs or n.name not in runs:
            continue
        s, e = runs[n.name]
        if e - s < c.min_s or not any(cs < e and s < ce for cs, ce in comm):
            continue
        carved.append((n, n.target, n.args))
        n.meta["sw_product"] = n.target
        n.meta["sm_share"] = c.share
        n.target = CARVED[n.target]
        n.args = (*n.args, c.sms)
    choice = None
    if c.auto:
        after = simulate(gm, compute_time, comm_time, contention(c)).step_s if carved else before
        keep = bool(carved) and after <= before * (1.0 - CARVE_TIE)
        choice = (before, after, keep)
        if not keep:
            for n, target, args in carved:
                n.target, n.args = target, args
                del n.meta["sw_product"], n.meta["sm_share"]
            carved = []
    if carved:
        gm.graph.lint()
        gm.recompile()
    return len(carved), choice
