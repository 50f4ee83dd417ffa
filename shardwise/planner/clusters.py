"""Clusters for ``shardwise plan``: accelerators and the network levels between them.

A collective over a group pays each level's steps at its latency, ``Σ_d f·(n_d - 1)·α_d`` (f = 1
for all-gather and reduce-scatter, 2 for all-reduce). Its bandwidth term depends on the machine:

- GPU clusters (``ClusterSpec.rings``): NCCL's rings run through the whole group, so
  ``f·(n - 1)/n · S / B`` at the slowest level's bus bandwidth B, a network level counting every
  NIC of the node; inside an NVSwitch node an all-reduce may reduce in the switch (NVLS), and
  across such nodes run as NVLSTree, whichever is faster;
- TPU tori and the data-center network between slices: level by level on shrinking data (the
  multi-dimensional algorithm), ``Σ_d f·(n_d - 1)/n_d · S_d / B_d`` with ``S_1 = S`` and
  ``S_{d+1} = S_d / n_d``.

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
    nvls_algbw: float | None = None
    """NVSwitch with NVLink SHARP: an all-reduce within this level reduces in the switch at this
    algorithm bandwidth (bytes/s of the whole buffer) when that beats the ring; NCCL's default on
    H100/H200 NVSwitch nodes."""


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float
    """Dense bf16 FLOP/s from the datasheet (MFU is quoted against it)."""
    hbm_bytes: float
    hbm_bw: float
    eff_max: float = 0.683
    eff_x0: float = 0.0
    """Achieved fraction of peak of the matrix products, ``eff_max · x / (x + eff_x0)`` with ``x`` =
    hidden size / tensor-parallel size. The A100's ``eff_max`` is fitted on two runs of Korthikanti et
    al. 2022 (the 22B and 175B models with selective recomputation, Table 5); with the memory-bound
    kernels counted on their own (``mem_eff``, models.ModelSpec.elementwise_bytes) the fit wants no
    dependence on the width (``eff_x0`` = 0; without them it was 0.71·x/(x+291)). H100 and H200 have
    their ``eff_max`` fitted on one run of ours (``HOPPER_EFF_MAX``), TPU v5p and v5e on one of MaxText's
    each; the other TPUs use the A100's until runs of theirs are fitted. Every other run in the validation table
    is predicted blind."""
    mem_eff: float = 0.8
    """Share of ``hbm_bw`` the memory-bound kernels reach (an assumption, not fitted)."""

    def efficiency(self, width: float) -> float:
        return self.eff_max * width / (width + self.eff_x0)


@dataclass(frozen=True)
class ClusterSpec:
    """Accelerators and the network dimensions between them, innermost first: ``(size, Level)``
    pairs — a DGX cluster is ``[(8, NVLink), (nodes, InfiniBand)]``, a TPU slice one pair per torus
    axis."""

    name: str
    accel: Accelerator
    dims: tuple
    rings: bool = True
    """GPU clusters (NVLink inside a node, a network between nodes): NCCL runs a large collective as
    rings through every rank of the group, each ring leaving a node through its own NIC, so the
    bandwidth term is set by the slowest level, a network level counting every NIC of the node
    (``busbw_d x ranks of the group inside one node``). TPU tori (False): axis by axis on shrinking
    data (the multi-dimensional algorithm)."""

    @property
    def gpus(self) -> int:
        n = 1
        for size, _ in self.dims:
            n *= size
        return n

    @property
    def per_node(self) -> int:
        """Ranks of the innermost dimension (a node's GPUs; a torus slice's first axis)."""
        return self.dims[0][0]

    def levels(self, group: int, inner: int = 1) -> list[tuple[int, Level]]:
        """How a group of ``group`` ranks spreads over the dimensions when its ranks are ``inner``
        apart (tensor-parallel groups are innermost: ``inner`` = 1; data-parallel ranks are
        ``tp · pp`` apart)."""
        out, stride, left = [], inner, group
        for size, lvl in self.dims:
            if left <= 1:
                break
            if stride >= size:  # this dimension lies inside one group of the inner axes
                stride //= size
                continue
            room = size // stride
            n = min(left, room)
            if not self.rings and (left % n or room % n):  # on a torus, groups must tile the axes
                raise ValueError(f"{self.name}: groups of {group} ranks {inner} apart do not tile its "
                                 f"{' x '.join(str(d) for d, _ in self.dims)} layout; choose a size that fills "
                                 f"whole leading axes or divides the next one (e.g. tp = 4 or 8 on 4 x 4 x 4)")
            stride = 1
            out.append((n, lvl))
            left //= n
        if left > 1:
            raise ValueError(f"{self.name}: a group of {group} ranks {inner} apart does not fit its {self.gpus} ranks")
        return out

    def collective_s(self, kind: str, nbytes: float, group: int, inner: int = 1) -> float:
        """Seconds of one ``kind`` (all_gather, reduce_scatter, all_reduce, all_to_all) over ``group``
        ranks on a full tensor of ``nbytes`` (the all-gather output, the reduce-scatter input, one
        rank's all-to-all buffer)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        if kind == "all_to_all":
            # each rank sends (n-1)/n of its ``nbytes`` buffer, the slowest level it spans bounding it
            lv = self.levels(group, inner)
            return (group - 1) * max(lvl.alpha for _, lvl in lv) + (group - 1) / group * nbytes / min(
                lvl.busbw for _, lvl in lv)
        latency, bandwidth, _ = self.collective_parts(kind, nbytes, group, inner)
        return latency + bandwidth

    def collective_parts(self, kind: str, nbytes: float, group: int, inner: int = 1) -> tuple[float, float, float]:
        """(latency s, bandwidth s, latency-bearing steps) of a reduce-scatter, all-gather or
        all-reduce (an all-reduce is a reduce-scatter and an all-gather). Latency: each level's steps
        at its α. Bandwidth: rings through the whole group at its slowest level's bus bandwidth (GPU
        clusters, see ``rings``), or level by level on shrinking data (TPU tori)."""
        f = 2.0 if kind == "all_reduce" else 1.0
        lat = bw = steps = 0.0
        s = float(nbytes)
        levels = self.levels(group, inner)
        below, slowest = 1, float("inf")
        for n, lvl in levels:
            if n > 1:
                lat += f * (n - 1) * lvl.alpha
                bw += f * (n - 1) / n * s / lvl.busbw
                steps += f * (n - 1)
                slowest = min(slowest, lvl.busbw * below)
            s /= n
            below *= n
        spanned = [(n, lvl) for n, lvl in levels if n > 1]
        if self.rings and len(spanned) > 1:
            bw = f * (group - 1) / group * nbytes / slowest
            if kind == "all_reduce" and len(spanned) == 2 and spanned[0][1].nvls_algbw:
                bw = min(bw, self._nvls_tree_s(nbytes, *spanned))
        elif kind == "all_reduce" and len(spanned) == 1 and spanned[0][1].nvls_algbw:
            bw = min(bw, nbytes / spanned[0][1].nvls_algbw)
        return lat, bw, steps

    @staticmethod
    def _nvls_tree_s(nbytes: float, node: tuple[int, Level], net: tuple[int, Level]) -> float:
        """NCCL's NVLSTree all-reduce over NVSwitch nodes (bandwidth term): the switch reduces the
        buffer inside each node, leaving each of the node's g GPUs 1/g of it to all-reduce across
        the m nodes over its own NIC on a double binary tree, then multicasts the result back. The
        two stages are pipelined, so the slower sets the time. Over the trees a NIC carries its
        share once each way when m = 2 (each node is one tree's root and the other's leaf) and twice
        when m > 2 (an inner node of one tree receives from two children, then sends to both)."""
        (g, inside), (m, lvl) = node, net
        per_nic = nbytes / g * (1 if m == 2 else 2)
        return max(nbytes / inside.nvls_algbw, per_nic / lvl.busbw)

    def __str__(self) -> str:
        shape = " x ".join(str(n) for n, _ in self.dims)
        links = ", ".join(f"{lvl.name} {lvl.busbw / 1e9:.0f} GB/s" for lvl in dict.fromkeys(l for _, l in self.dims))
        return f"{self.name}: {shape} {self.accel.name} ({self.gpus} chips), {links}"


# H100/H200: the matrix products' share of peak fitted on one run only: plain torch.compile of the 1.1B
# Llama shape on one H200, batch 4x2048, bf16, 0.1257 s/step (bench/results/2026-11-29-h200-llama1b-ws1.json).
# With the A100's share that run was predicted 18% fast. Every other Hopper row is blind.
HOPPER_EFF_MAX = 0.546
H100 = Accelerator("H100 SXM", 989e12, 80e9, 3.35e12, eff_max=HOPPER_EFF_MAX)
H200 = Accelerator("H200 SXM", 989e12, 141e9, 4.8e12, eff_max=HOPPER_EFF_MAX)
A100 = Accelerator("A100 SXM 80GB", 312e12, 80e9, 2.0e12)
H100_PCIE = Accelerator("H100 PCIe", 756e12, 80e9, 2.0e12, eff_max=HOPPER_EFF_MAX)

# bus bandwidths and latencies: shared/notes/cost-models.md §2 (nccl-tests issues; NCCL's tuning constants)
# ring busbw ~370 GB/s on 8xH100; NVLS all-reduce algbw ~275 GB/s (busbw ~480) (nccl-tests#212)
NVLINK4 = Level("NVLink4/NVSwitch", 370e9, 3.4e-6, nvls_algbw=275e9)
NVLINK3 = Level("NVLink3/NVSwitch", 229e9, 3.4e-6)    # 8xA100 all-reduce at 1 GiB (vTrain LUT)
IB_NDR = Level("InfiniBand NDR 400G", 47e9, 14e-6)    # 46-48 GB/s per CX-7 NIC (nccl-tests#290)
IB_HDR = Level("InfiniBand HDR 200G", 24e9, 14e-6)    # per NIC (nccl-tests#119)

NO_LINK = Level("none", 1e12, 0.0)
# GPUs on PCIe alone (no NVLink): a ring crosses the host's PCIe root complexes, whose CPU and memory
# set the bandwidth. 28 GB/s all-reduce bus bandwidth over 8 GPUs on PCIe Gen5 (dual Xeon 8480+;
# NVIDIA/nccl#1639, where NCCL's maintainer calls that what such hosts deliver); an 8-byte all-reduce
# over 8 PCIe GPUs takes about 42 µs, 14 ring steps of 3 µs (NVIDIA/nccl#1530)
PCIE5_HOST = Level("PCIe Gen5 through the host", 28e9, 3e-6)

NODES = {
    "h200": (H200, 1, NO_LINK, None),  # one GPU (our bench machine)
    # our two-GPU bench machine (NV18); the link is `shardwise calibrate` over NCCL on it, 2026-11-30
    # (bench/results/2026-11-30-h200x2-nccl-link.json: all-gather 280 GB/s bus bandwidth, α 72 µs)
    "h200-nv18-x2": (H200, 2, Level("NVLink NV18", 279.5e9, 71.7e-6), None),
    "dgx-h100": (H100, 8, NVLINK4, IB_NDR),
    "dgx-h200": (H200, 8, NVLINK4, IB_NDR),
    "dgx-a100": (A100, 8, NVLINK3, IB_HDR),
    # a PCIe-only server: 8 H100 PCIe without NVLink bridges, one NDR NIC per 2 GPUs between servers
    "pcie-h100": (H100_PCIE, 8, PCIE5_HOST, Level("InfiniBand NDR 400G per 2 GPUs", 23.5e9, 14e-6)),
    # the A100 cluster of vTrain's measurements (its validation configs: 800 Gb/s per 8-GPU node)
    "a100-800g": (A100, 8, NVLINK3, Level("800 Gb/s per node", 12.5e9, 14e-6)),
}

# TPUs (Cloud TPU documentation, jax-ml/scaling-book; shared/notes/cost-models.md §2): chip, one-way ICI
# bandwidth per link, torus rank, the axis length that carries a wraparound link (a full axis)
TPUS = {
    "tpu-v4": (Accelerator("TPU v4", 275e12, 32e9, 1.2e12), 4.5e10, 3, 4),
    # v5p's share fitted on one run: MaxText's 32B model on v5p-128 (validation.py); v4 and v6e use the A100's
    # (v6e's tpu-recipes runs are predicted blind with it)
    "tpu-v5p": (Accelerator("TPU v5p", 459e12, 95e9, 2.76e12, eff_max=0.753), 9e10, 3, 4),
    # v5e's share fitted on one run: MaxText's 16B model on one v5e-256 with full remat, planned as
    # per-layer (block) recomputation (validation.py)
    "tpu-v5e": (Accelerator("TPU v5e", 197e12, 16e9, 0.82e12, eff_max=0.824), 5e10, 2, 16),
    "tpu-v6e": (Accelerator("TPU v6e", 918e12, 32e9, 1.64e12), 1e11, 2, 16),
}
ICI_HOP_S = 1e-6  # about 1 µs per hop (scaling-book)
# slices of a multi-slice job meet over the data-center network: per chip, its host's NICs shared by
# the host's chips (Cloud TPU documentation, v5e: 2 x 100 Gb/s per host of 8 chips, 6.4 Tb/s per pod)
DCN = {"tpu-v5e": Level("DCN (2 x 100 Gb/s per host of 8 chips)", 2 * 100e9 / 8 / 8, 14e-6)}


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
                         f"the data-center network between {name} slices is not known; multi-slice: "
                         f"{', '.join(DCN)}"))
    if len(sizes) != rank or min(sizes) < 1:
        raise ValueError(f"cluster {spec!r}: {name} is a {rank}-D torus: give {rank} axis lengths")
    # along an axis with a wraparound link a ring sends both ways: twice the link's one-way bandwidth
    dims = tuple((n, Level(f"ICI {'torus' if n % full == 0 else 'line'}", link * (2 if n % full == 0 else 1),
                           ICI_HOP_S)) for n in sizes)
    if slices > 1:
        dims += ((slices, DCN[name]),)
    return ClusterSpec(spec, accel, dims, rings=False)


def cluster(spec: str) -> ClusterSpec:
    """``dgx-h100:32`` = 32 nodes of 8 H100s (a bare node name is one node); ``tpu-v5p:4x4x8`` a TPU slice;
    ``tpu-v5e:16x16*4`` four slices joined by the data-center network."""
    name, _, n = spec.partition(":")
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
    dims = ((per, intra),) + (((nodes, inter),) if nodes > 1 or inter is not None else ())
    return ClusterSpec(spec, accel, dims)
