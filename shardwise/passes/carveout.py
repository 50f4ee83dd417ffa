"""Matrix products beside a collective leave SMs free for it (runtime/ops.py says why).

The cost model's two-lane simulation of the finished program (``costmodel.simulate``: each node's predicted time, each
collective's α-β time) says when each product runs and when each collective is on the link. A product predicted to take
at least ``min_s`` and to overlap a collective becomes its carved twin (same arguments, then the SMs to leave free),
which runs the product with the carveout set and puts it back. Products with the link idle beside them keep every SM,
and so do short ones (for them a carved call's cost, ~10 µs on the host, is not worth it). Each carved product is the
product to the op registry (its FLOPs) and keeps its share of the SMs in ``meta["sm_share"]`` (the roofline stretches
its time, ``costmodel.compute``).

``auto`` lets the cost model decide whether to carve at all: it simulates the program with the SM contention model
(``contention``; costmodel/simulate.py) uncarved and carved, and carves only if that is predicted at least ``CARVE_TIE``
faster. Uncarved, a product that fills every SM holds back a collective due while it runs (what sitting 7's traces show
for the MoE's expert gathers); carved, the collective runs beside it, slower where fewer SMs are left than its kernels
need. ``auto`` is ``compile``'s default on CUDA. In sitting 8 (2xH200) it carved the MoE, 4.2% faster than every SM, and
left the 8B shape whole, where carving 24 SMs measured 0.9% slower.

Runs last (``shard_step``): buckets, in-flight cap and memory plan are chosen on uncarved candidates. The choice is a
function of the graph and the cost model, so every rank makes the same one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from ..runtime import ops as runtime_ops  # noqa: F401 - its carved twins enter the op registry on import
from ..sharding.ops import info

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
    def free(n: fx.Node) -> float:
        if info(n.target).carves is not None:
            return min(1.0, n.args[-1] / c.need)
        if info(n.target).carved is not None:
            v = n.meta.get("val")
            return 0.0 if v is not None and v.numel() >= TILE * c.total else 1.0
        return 1.0

    return free


def apply(gm: fx.GraphModule, c: SMCarveout, cost) -> tuple[int, tuple[float, float, bool] | None]:
    """Carve the products ``cost`` (the cost model) predicts to run beside a collective. Returns how many were carved
    and, under ``auto``, (predicted step uncarved, carved, whether carved) by the contention model."""
    tl = cost.simulate(gm)
    comm = sorted((s, e) for lane, _, s, e in tl.events if lane == "comm" and e > s)
    runs = {name: (s, e) for lane, name, s, e in tl.events if lane == "compute"}
    before = cost.simulate(gm, free=contention(c)).step_s if c.auto else None
    carved = []
    for n in gm.graph.nodes:
        twin = info(n.target).carved if n.op == "call_function" else None
        if twin is None or n.kwargs or n.name not in runs:
            continue
        s, e = runs[n.name]
        if e - s < c.min_s or not any(cs < e and s < ce for cs, ce in comm):
            continue
        carved.append((n, n.target, n.args))
        n.meta["sm_share"] = c.share
        n.target = twin
        n.args = (*n.args, c.sms)
    choice = None
    if c.auto:
        after = cost.simulate(gm, free=contention(c)).step_s if carved else before
        keep = bool(carved) and after <= before * (1.0 - CARVE_TIE)
        choice = (before, after, keep)
        if not keep:
            for n, target, args in carved:
                n.target, n.args = target, args
                del n.meta["sm_share"]
            carved = []
    if carved:
        gm.graph.lint()
        gm.recompile()
    return len(carved), choice


CARVE_MIN_S = 20e-6
"""Products predicted shorter than this keep every SM (a carved call costs ~10 µs on the host)."""


def choose(sms, device: torch.device, backend: str = "nccl", schedule: bool = True) -> SMCarveout | None:
    """``compile``'s ``matmul_sm_carveout`` checked against the device: the pass's settings, or None for every SM."""
    if sms is None:
        return None
    auto = isinstance(sms, str) and sms == "auto"
    if not auto and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
        raise ValueError(f"matmul_sm_carveout must be a positive number of SMs (e.g. 32, what NCCL's kernels "
                         f"need on an H200), 'auto' (the cost model decides) or None, got {sms!r}")
    if device.type != "cuda":
        # gloo's collectives take no SMs: "auto" never carves; a number carves, inert, to show the pass at work
        return None if auto else SMCarveout(sms, 0)
    if auto and (backend != "nccl" or not schedule or torch.version.hip is not None):
        # gloo's collectives run on the host; the unscheduled baseline keeps every choice at its plain
        # setting; the contention model was measured on NVIDIA's cuBLAS and NCCL
        return None
    if not (hasattr(torch._C, "_set_sm_carveout_experimental") and hasattr(torch.backends.cuda, "preferred_blas_library")):
        if auto:
            return None
        raise ValueError(f"matmul_sm_carveout needs torch's experimental SM carveout and cuBLASLt, which torch "
                         f"{torch.__version__} does not have: leave it at None")
    props = torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
    total = props.multi_processor_count
    if auto:
        # measured on Hopper, whose persistent products hold every SM; a GPU of 2 x COMM_SMS SMs or
        # fewer would give the collective half of them or more
        return SMCarveout(COMM_SMS, total, CARVE_MIN_S, auto=True) if props.major >= 9 and total > 2 * COMM_SMS else None
    if sms >= total:
        raise ValueError(f"matmul_sm_carveout={sms} leaves no SM to the products: this device has {total}; "
                         f"pass fewer (NCCL's kernels take 16-32)")
    return SMCarveout(sms, total, CARVE_MIN_S)
