"""Clusters for ``shardwise plan``: accelerators and the network levels between them.

A collective over a group that spans levels runs level by level (reduce-scatter inside the node,
then across nodes on 1/n of the data, then all-gather back: the multi-dimensional algorithm), so
its time is ``Σ_d [(n_d - 1)·α_d + f·(n_d - 1)/n_d · S_d / B_d]`` with ``S_1 = S`` and
``S_{d+1} = S_d / n_d`` for all-gather and reduce-scatter (f = 1) and twice that for all-reduce.
``B_d`` is the bus bandwidth of one rank at level d (nccl-tests' busbw; for a network level, the
bandwidth of the NIC each GPU drives).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Level:
    name: str
    busbw: float
    """Bytes/s per rank (ring bus bandwidth within the level; NIC bandwidth across nodes)."""
    alpha: float
    """Seconds per step of the algorithm at this level."""


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float
    """Dense bf16 FLOP/s from the datasheet (MFU is quoted against it)."""
    hbm_bytes: float
    hbm_bw: float
    eff_max: float = 0.71
    eff_x0: float = 291.0
    """Achieved fraction of peak of a transformer layer's compute, ``eff_max · x / (x + eff_x0)`` with
    ``x`` = hidden size / tensor-parallel size (the width of each GPU's matrix products): wider
    products run closer to peak. Fitted on two runs of Korthikanti et al. 2022 on A100s (the 22B and
    175B models with selective recomputation, Table 5); every other run in the validation table is
    predicted blind. Other accelerators use the A100 curve until runs of theirs are fitted."""

    def efficiency(self, width: float) -> float:
        return self.eff_max * width / (width + self.eff_x0)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    accel: Accelerator
    per_node: int
    nodes: int
    intra: Level
    inter: Level | None = None
    notes: tuple = field(default_factory=tuple)

    @property
    def gpus(self) -> int:
        return self.per_node * self.nodes

    def levels(self, group: int, inner: int = 1) -> list[tuple[int, Level]]:
        """How a group of ``group`` consecutive-stride ranks spreads over the levels, when the ranks
        of one group are ``inner`` apart (tensor parallel groups are innermost: ``inner`` = 1)."""
        in_node = max(1, min(group, self.per_node // min(inner, self.per_node)))
        out = [(in_node, self.intra)]
        rest = group // in_node
        if rest > 1:
            if self.inter is None:
                raise ValueError(f"{self.name}: a group of {group} does not fit one node and the cluster has no network")
            out.append((rest, self.inter))
        return out

    def collective_s(self, kind: str, nbytes: float, group: int, inner: int = 1) -> float:
        """Seconds of one ``kind`` (all_gather, reduce_scatter, all_reduce) over ``group`` ranks on a
        full tensor of ``nbytes`` (the all-gather output, the reduce-scatter input)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        f = 2.0 if kind == "all_reduce" else 1.0
        t, s = 0.0, float(nbytes)
        for n, lvl in self.levels(group, inner):
            if n > 1:
                t += f * ((n - 1) * lvl.alpha + (n - 1) / n * s / lvl.busbw)
            s /= n
        return t

    def __str__(self) -> str:
        net = f", {self.inter.name} {self.inter.busbw / 1e9:.0f} GB/s per GPU" if self.inter else ""
        return (f"{self.name}: {self.nodes} x {self.per_node} {self.accel.name} ({self.gpus} GPUs), "
                f"{self.intra.name} {self.intra.busbw / 1e9:.0f} GB/s busbw{net}")


H100 = Accelerator("H100 SXM", 989e12, 80e9, 3.35e12)
H200 = Accelerator("H200 SXM", 989e12, 141e9, 4.8e12)
A100 = Accelerator("A100 SXM 80GB", 312e12, 80e9, 2.0e12)

# bus bandwidths and latencies: shared/notes/cost-models.md §2 (nccl-tests issues; NCCL's tuning constants)
NVLINK4 = Level("NVLink4/NVSwitch", 370e9, 3.4e-6)    # ring busbw ~370 GB/s on 8xH100 (nccl-tests#212)
NVLINK3 = Level("NVLink3/NVSwitch", 229e9, 3.4e-6)    # 8xA100 all-reduce at 1 GiB (vTrain LUT)
IB_NDR = Level("InfiniBand NDR 400G", 47e9, 14e-6)    # 46-48 GB/s per CX-7 NIC (nccl-tests#290)
IB_HDR = Level("InfiniBand HDR 200G", 24e9, 14e-6)    # per NIC (nccl-tests#119)

NO_LINK = Level("none", 1e12, 0.0)

NODES = {
    "h200": (H200, 1, NO_LINK, None),  # one GPU (our bench machine)
    "dgx-h100": (H100, 8, NVLINK4, IB_NDR),
    "dgx-h200": (H200, 8, NVLINK4, IB_NDR),
    "dgx-a100": (A100, 8, NVLINK3, IB_HDR),
}


def cluster(spec: str) -> ClusterSpec:
    """``dgx-h100:32`` = 32 nodes of 8 H100s; a bare node name is one node."""
    name, _, n = spec.partition(":")
    if name not in NODES:
        raise ValueError(f"unknown cluster {name!r}: one of {', '.join(NODES)} (as NAME:NODES, e.g. dgx-h100:32)")
    try:
        nodes = int(n or 1)
    except ValueError:
        raise ValueError(f"cluster {spec!r}: the node count after ':' must be an integer") from None
    if nodes < 1:
        raise ValueError(f"cluster {spec!r}: needs at least one node")
    accel, per, intra, inter = NODES[name]
    return ClusterSpec(spec, accel, per, nodes, intra, inter)
