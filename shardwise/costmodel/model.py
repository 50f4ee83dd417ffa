"""``CostModel``: the cost model of one job, the object passes, the memory plan, ``explain`` and the predictions all ask
(DESIGN.md invariant 5: one cost model).

It knows the device (roofline compute, costmodel/devices.py), the link its collectives run on (α-β over a topology,
costmodel/collectives.py), the host link (offload), and how the job's executor allocates (liveness,
costmodel/memory.py). Passes get the roofline alone, which every rank computes alike from the graph; measured per-node
times (``job.profile_compute``) enter predictions only."""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from ..capture import forward_nodes
from ..sharding.collective import collective_of
from ..sharding.ops import info
from .collectives import PRESETS, LinkProfile
from .compute import node_time
from .devices import CPU_POOL, DEVICES, PCIE5, Device, cuda_device
from .fused import Fused, fused_s
from .hostlink import HostLink
from .memory import Liveness, liveness
from .simulate import Timeline, simulate


class CostModel:
    """Times and memory of a job's programs on its device and link.

    Example::

        >>> from shardwise.costmodel import CostModel
        >>> cm = CostModel.for_job("cpu-gloo", "cpu")
        >>> cm.link.name, cm.device.name
        ('cpu-gloo', 'cpu')
    """

    def __init__(self, device: Device, link, host: HostLink, fused: bool = False):
        self.device = device
        self.link = link
        """Anything with ``time(kind, full_bytes, ranks)``: a ``LinkProfile`` or a ``Topology``."""
        self.host = host
        self.fused = fused
        """The executor is inductor, whose kernels fuse elementwise code (liveness models that)."""

    @classmethod
    def for_job(cls, link_profile, device_type: str, backend: str = "gloo", device_name: str = "",
                fused: bool = False) -> "CostModel":
        """The cost model of a job on ``device_type`` over ``backend``: ``link_profile`` is a preset
        name, a JSON file from ``shardwise calibrate``, a ``LinkProfile``, or None for the backend's
        preset (gloo: ``cpu-gloo``; NCCL: our two H200s' calibrated link)."""
        lp = link_profile if link_profile is not None else "cpu-gloo" if backend == "gloo" else "h200-nv18-x2"
        if isinstance(lp, str):
            lp = PRESETS[lp] if lp in PRESETS else LinkProfile.load(lp)
        dev = cuda_device(device_name) if device_type == "cuda" else DEVICES["cpu"]
        host = (lp.host_link() if isinstance(lp, LinkProfile) else None) or (PCIE5 if device_type == "cuda" else CPU_POOL)
        return cls(dev, lp, host, fused)

    @classmethod
    def custom(cls, node_time: Callable | None = None, comm_time: Callable | None = None,
               estimate: Callable | None = None, fetch_time: Callable | None = None) -> "CostModel":
        """A cost model whose parts are the given functions (each one replaces the method of its name; the rest are the
        CPU's roofline over the gloo preset): estimators of one's own, exact ones in tests."""
        cm = cls.for_job(None, "cpu")
        for name, fn in (("node_time", node_time), ("comm_time", comm_time), ("estimate", estimate),
                         ("fetch_time", fetch_time)):
            if fn is not None:
                setattr(cm, name, fn)
        return cm

    # -- time ----------------------------------------------------------------------------------

    def node_time(self, n: fx.Node) -> float:
        """The roofline seconds of one node on this device (a fused tp product's with its collective)."""
        f = n.meta.get("tp_fused")
        return node_time(n, self.device) if f is None else self.fused_time(f, f.impl)

    def fused_time(self, f: Fused, impl: str) -> float:
        """Seconds of a tp product fused with its collective, run as ``impl`` (costmodel/fused.py)."""
        return fused_s(f, impl, self.device, self.link.time, getattr(self.link, "fused", None))

    def comm_time(self, n: fx.Node) -> float:
        """The α-β seconds of one collective start node over its group."""
        c = collective_of(n)
        return self.link.time(c.kind, c.full_bytes, c.ranks)

    def fetch_time(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` from host to device memory."""
        return nbytes / self.host.h2d

    def simulate(self, gm: fx.GraphModule, measured: dict[str, float] | None = None,
                 free: Callable[[fx.Node], float] | None = None) -> Timeline:
        """The two-lane simulation of ``gm``: ``measured`` per-node seconds where given (a node
        missing from them takes none), else the roofline; ``free`` the SM contention model."""
        compute = (lambda n: measured.get(n.name, 0.0)) if measured is not None else self.node_time
        return simulate(gm, compute, self.comm_time, free)

    def step_time(self, gm: fx.GraphModule, tl: Timeline, update_s: float, overlap: str | None = None) -> float:
        """A step of ``gm`` (simulated as ``tl``) with an update of ``update_s`` seconds: after the graph, or, where the
        update overlaps the next step, beside its forward (passes/ready.py). ``"host"`` (offload): the update runs on
        the host and the copy engines, so the step is its backward plus the longer of its forward and the update.
        ``"device"`` (overlap_update): it runs on the same SMs as the forward, whose matrix products hold them whole, so
        it hides only in the forward's idle compute time (waits for collectives)."""
        if overlap is None:
            return tl.step_s + update_s
        seen = {n.name for n in forward_nodes(gm)}
        end = max((e for k, name, _, e in tl.events if k == "compute" and name in seen), default=0.0)
        if overlap == "host":
            return (tl.step_s - end) + max(end, update_s)
        idle = sum(e - s for k, _, s, e in tl.events if k == "wait" and e <= end)  # compute lane waiting
        return tl.step_s + max(0.0, update_s - idle)

    # -- memory --------------------------------------------------------------------------------

    def liveness_mode(self, gm: fx.GraphModule) -> dict:
        """How the executor allocates: inductor's fused kernels, which write a result into a dying
        input's buffer unless the graph copies values to the host on a side stream (its buffer reuse
        is turned off then, runtime/inductor.py)."""
        copies_out = any(info(n.target).to_host for n in gm.graph.nodes)
        return {"fused": self.fused, "inplace": self.fused and not copies_out}

    def liveness(self, gm: fx.GraphModule) -> Liveness:
        return liveness(gm, **self.liveness_mode(gm))

    def estimate(self, gm: fx.GraphModule) -> tuple[float, int]:
        """(predicted seconds, predicted peak bytes of the graph) of a finished program, on the
        roofline: what the passes' choices are made on."""
        return self.simulate(gm).step_s, self.liveness(gm).peak

    def __str__(self) -> str:
        return f"link {self.link.name}; roofline on {self.device.name}; {self.host}"
