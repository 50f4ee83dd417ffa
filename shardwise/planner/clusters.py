"""Clusters for ``shardwise plan``: which accelerators, how many, and the link levels between them.

The collective model (levels, rings, NVLS, tori) is costmodel/collectives.py's ``Topology``, the accelerators are
costmodel/devices.py's table: a cluster preset only says which devices and links a machine has and how many of each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..costmodel.collectives import IB_HDR, IB_NDR, NO_LINK, NVLINK3, NVLINK4, PCIE5_HOST, PRESETS, Level, Topology
from ..costmodel.devices import DEVICES, Device

@dataclass(frozen=True)
class ClusterSpec:
    """Accelerators and the topology between them (costmodel.Topology: ``(size, Level)`` pairs, innermost first; a DGX
    cluster is ``[(8, NVLink), (nodes, InfiniBand)]``, a TPU slice one pair per torus axis)."""

    name: str
    accel: Device
    topology: Topology

    @property
    def dims(self) -> tuple:
        return self.topology.dims

    @property
    def rings(self) -> bool:
        return self.topology.rings

    @property
    def gpus(self) -> int:
        return self.topology.gpus

    @property
    def per_node(self) -> int:
        """Ranks of the innermost dimension (a node's GPUs; a torus slice's first axis)."""
        return self.dims[0][0]

    def levels(self, group: int, inner: int = 1) -> list[tuple[int, Level]]:
        """How a group of ``group`` ranks ``inner`` apart spreads over the dimensions (Topology.levels)."""
        return self.topology.levels(group, inner)

    def collective_s(self, kind: str, nbytes: float, group: int, inner: int = 1) -> float:
        """Seconds of one collective over ``group`` ranks ``inner`` apart (Topology.time)."""
        return self.topology.time(kind, nbytes, group, inner)

    def collective_parts(self, kind: str, nbytes: float, group: int, inner: int = 1) -> tuple[float, float, float]:
        """(latency s, bandwidth s, latency-bearing steps) of one collective (Topology.parts)."""
        return self.topology.parts(kind, nbytes, group, inner)

    def __str__(self) -> str:
        shape = " x ".join(str(n) for n, _ in self.dims)
        links = ", ".join(dict.fromkeys(str(lvl) for _, lvl in self.dims))  # a calibrated level is unhashable
        return f"{self.name}: {shape} {self.accel.label} ({self.gpus} chips), {links}"


H200, H100, A100, H100_PCIE = DEVICES["h200"], DEVICES["h100"], DEVICES["a100"], DEVICES["h100-pcie"]
H100_HBM2E = DEVICES["h100-hbm2e"]

NODES = {
    "h200": (H200, 1, NO_LINK, None),  # one GPU (our bench machine)
    # our two-GPU bench machine (NV18): the link `shardwise calibrate` measured over NCCL on it, the
    # compiler's default link profile on NCCL (costmodel.PRESETS["h200-nv18-x2"])
    "h200-nv18-x2": (H200, 2, PRESETS["h200-nv18-x2"].level("NVLink NV18"), None),
    "dgx-h100": (H100, 8, NVLINK4, IB_NDR), "dgx-h200": (H200, 8, NVLINK4, IB_NDR),
    "dgx-a100": (A100, 8, NVLINK3, IB_HDR), "h100-hbm2e": (H100_HBM2E, 8, NVLINK4, IB_NDR),  # 400 Gb/s per GPU
    "dgx-a100-40gb": (DEVICES["a100-40gb"], 8, NVLINK3, IB_HDR),
    # a PCIe-only server: 8 H100 PCIe without NVLink bridges, one NDR NIC per 2 GPUs between servers
    "pcie-h100": (H100_PCIE, 8, PCIE5_HOST, Level("InfiniBand NDR 400G per 2 GPUs", 23.5e9, 14e-6)),
    # the A100 cluster of vTrain's measurements (its validation configs: 800 Gb/s per 8-GPU node)
    "a100-800g": (A100, 8, NVLINK3, Level("800 Gb/s per node", 12.5e9, 14e-6))}

# TPUs (Cloud TPU documentation, jax-ml/scaling-book; shared/notes/cost-models.md §2): the chip (the device table's),
# one-way ICI bandwidth per link, torus rank, the axis length that carries a wraparound link (a full axis)
TPUS = {"tpu-v3": (DEVICES["tpu-v3"], 1e11, 2, 32),  # a 32x32 pod: its 6.4 TB/s bisection over the 64 links of a cut
        "tpu-v4": (DEVICES["tpu-v4"], 4.5e10, 3, 4), "tpu-v5p": (DEVICES["tpu-v5p"], 9e10, 3, 4),
        "tpu-v5e": (DEVICES["tpu-v5e"], 5e10, 2, 16), "tpu-v6e": (DEVICES["tpu-v6e"], 1e11, 2, 16)}
ICI_HOP_S = 1e-6  # about 1 µs per hop (scaling-book)
# slices of a multi-slice job meet over the data-center network: per chip, its host's NICs shared by
# the host's chips (Cloud TPU documentation, v5e: 2 x 100 Gb/s per host of 8 chips, 6.4 Tb/s per pod)
DCN = {"tpu-v5e": Level("DCN (2 x 100 Gb/s per host of 8 chips)", 2 * 100e9 / 8 / 8, 14e-6),
       "tpu-v5p": Level("DCN (50 Gb/s per chip)", 50e9 / 8, 14e-6)}  # v5p's: the documentation's, per chip
DCN_SPINE = 3.9e12
"""Bytes/s the data-center network carries between all the slices of a job together (31 Tb/s): a
chip's share falls below its host's NICs' beyond 4 v5e-256 slices. Fitted on MaxText's 64B step
growing by 1.86 s from 2 to 32 v5e slices (data/runs.toml, its two rows marked fitted)."""


def _tpu(spec: str, name: str, shape: str) -> ClusterSpec:
    accel, link, rank, full = TPUS[name]
    shape, star, n_slices = shape.partition("*")
    try:
        sizes = [int(x) for x in shape.split("x")]
        slices = int(n_slices) if star else 1
    except ValueError:
        raise ValueError(f"cluster {spec!r}: a TPU slice is NAME:AxBxC, e.g. {name}:" + "x".join(["4"] * rank)
                         + ", and several slices NAME:AxBxC*SLICES") from None
    if slices < 1 or (slices > 1 and name not in DCN):
        raise ValueError(f"cluster {spec!r}: " + ("slices must be at least 1" if slices < 1 else
                         f"the data-center network between {name} slices is not known; multi-slice: {', '.join(DCN)}"))
    if len(sizes) != rank or min(sizes) < 1:
        raise ValueError(f"cluster {spec!r}: {name} is a {rank}-D torus: give {rank} axis lengths")
    # along an axis with a wraparound link a ring sends both ways: twice the link's one-way bandwidth
    dims = tuple((n, Level(f"ICI {'torus' if n % full == 0 else 'line'}", link * (2 if n % full == 0 else 1),
                           ICI_HOP_S)) for n in sizes)
    if slices > 1:
        nic, chips = DCN[name], slices * sizes[0] * sizes[1]
        share = min(nic.busbw, DCN_SPINE / chips)
        dims += ((slices, dataclasses.replace(nic, busbw=share, name=nic.name + (
            f", its {DCN_SPINE * 8 / 1e12:g} Tb/s spine shared by {chips} chips" if share < nic.busbw else ""))),)
    return ClusterSpec(spec, accel, Topology(spec, dims, rings=False))


def network(spec: str) -> dict:
    """``--network bw=25,latency=10,leaf=16,oversub=2``: the fabric between nodes, per GPU: bandwidth in
    GB/s, latency in µs (default: InfiniBand's), and, for a leaf-spine fabric, the nodes under one leaf and the
    oversubscription of its uplinks (traffic between leaves at ``bw / oversub``)."""
    out = {k.strip(): v for k, _, v in (p.partition("=") for p in spec.split(","))}
    try:
        out = {k: float(v) for k, v in out.items() if k in ("bw", "latency", "leaf", "oversub") and float(v) > 0}
    except ValueError:
        out = {}
    if "bw" not in out or len(out) < spec.count(",") + 1 or ("leaf" in out) != ("oversub" in out):
        raise ValueError(f"--network {spec!r}: give bw=GB/s per GPU, and optionally latency=µs and, for a leaf-spine "
                         "fabric, both leaf=NODES and oversub=FACTOR (positive numbers), e.g. bw=25,leaf=16,oversub=2")
    return out


def cluster(spec: str, fabric: str | None = None) -> ClusterSpec:
    """``dgx-h100:32`` = 32 nodes of 8 H100s (a bare node name is one node); ``tpu-v5p:4x4x8`` a TPU slice;
    ``tpu-v5e:16x16*4`` four slices joined by the data-center network. ``fabric`` (``network``'s
    format) replaces the network between nodes: a custom fabric, RoCE or Ethernet, oversubscribed."""
    if "@" in spec:  # a power cap: clocks fall as the cube root of the power (dynamic power ~ f·V², V ~ f)
        base, _, watts = spec.partition("@")
        c = cluster(base, fabric)
        w = float(watts.rstrip("Ww")) if watts.rstrip("Ww").replace(".", "", 1).isdigit() else 0.0
        if not c.accel.tdp or not 0 < w <= c.accel.tdp:
            raise ValueError(f"cluster {spec!r}: a power cap is NAME:NODES@WATTS, at most the {c.accel.label}'s "
                             f"{c.accel.tdp or 'unknown'} W")
        capped = dataclasses.replace(c.accel, clock=(w / c.accel.tdp) ** (1 / 3),
                                     label=f"{c.accel.label} at {w:g} W")
        return ClusterSpec(spec, capped, dataclasses.replace(c.topology, name=spec))
    name, _, n = spec.partition(":")
    if fabric is not None and name in TPUS:
        raise ValueError(f"--network describes the fabric between GPU nodes; {name} slices are joined by ICI "
                         "(and, between slices, the data-center network)")
    if name in TPUS:
        return _tpu(spec, name, n or "x".join(["4"] * TPUS[name][2]))
    if name not in NODES:
        raise ValueError(f"unknown cluster {name!r}: one of {', '.join([*NODES, *TPUS])} "
                         "(as NAME:NODES, e.g. dgx-h100:32, or a TPU slice, e.g. tpu-v5p:4x4x8)")
    try:
        nodes = int(n or 1)
    except ValueError:
        raise ValueError(f"cluster {spec!r}: the node count after ':' must be an integer") from None
    if nodes < 1:
        raise ValueError(f"cluster {spec!r}: needs at least one node")
    accel, per, intra, inter = NODES[name]
    if inter is None and nodes > 1:
        raise ValueError(f"cluster {spec!r}: {name} is one machine with no network between machines; use {name}:1")
    if fabric is not None:
        if nodes == 1:
            raise ValueError(f"--network describes the fabric between nodes; {spec} is one node")
        f = network(fabric)
        alpha = f["latency"] * 1e-6 if "latency" in f else IB_NDR.alpha  # the cost model's, where not given
        inter = Level(f"custom fabric {f['bw']:g} GB/s per GPU", f["bw"] * 1e9, alpha)
        if (leaf := int(f.get("leaf", nodes))) < nodes:
            if nodes % leaf:
                raise ValueError(f"--network leaf={leaf} does not divide the {nodes} nodes of {spec}")
            spine = Level(f"spine ({f['oversub']:g}:1 oversubscribed)", f["bw"] * 1e9 / f["oversub"], inter.alpha)
            return ClusterSpec(spec, accel, Topology(spec, ((per, intra), (leaf, inter), (nodes // leaf, spine))))
    dims = ((per, intra),) + (((nodes, inter),) if nodes > 1 or inter is not None else ())
    return ClusterSpec(spec, accel, Topology(spec, dims))
