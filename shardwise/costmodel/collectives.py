"""The one collective model: α-β over a topology of link levels, in the form of NCCL's ring model.

A group of ranks spreads over the levels of a ``Topology`` (innermost first: NVLink inside a node, InfiniBand between
nodes, one level per TPU torus axis). A collective of ``kind`` over a tensor of ``S`` bytes (the all-gather output, the
reduce-scatter input, the all-reduce buffer) costs

- latency: each spanned level's ``f·(n_d − 1)`` algorithm steps at its per-step ``alpha``, plus the largest per-call
  ``overhead`` of a spanned level (launch and host dispatch, which ``calibrate`` measures as one figure per call). A GPU
  cluster's all-gather or reduce-scatter is one ring through the whole group (NCCL's tuner: ``p − 1`` steps,
  ``nodes − 1`` of them over the network), so each level's ``n_d − 1`` hops repeat once per group of the levels above
  it;
- bandwidth: ``bus_factor(kind, n) · S / busbw`` on one level. Across levels, GPU clusters (``rings``) run NCCL's rings
  through the whole group at the slowest level's bus bandwidth, a network level counting every NIC of the node; TPU tori
  (and slices over the data-center network) go level by level on shrinking data, ``Σ_d f·(n_d − 1)/n_d · S_d / B_d``
  with ``S_{d+1} = S_d / n_d``. Inside an NVSwitch node an all-reduce may reduce in the switch (NVLS), and across such
  nodes run as NVLSTree, whichever is faster.

``f`` is 2 for an all-reduce (a reduce-scatter and an all-gather) and 1 otherwise; ``busbw`` is what nccl-tests call bus
bandwidth, so published figures drop in as they are. A calibrated ``LinkProfile`` (per-kind α per call and bus
bandwidth, measured over one group) is a one-level topology: the compiler, the memory plan and ``shardwise plan`` all
time collectives here."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""The collectives a link profile measures (the planner also times ``all_to_all``)."""


def _f(kind: str) -> int:
    if kind not in KINDS and kind != "all_to_all":
        raise ValueError(f"unknown collective {kind!r}: one of {KINDS} or all_to_all")
    return 2 if kind == "all_reduce" else 1


def bus_factor(kind: str, n: int) -> float:
    """Bytes each rank moves per byte of the full tensor under a ring of ``n`` ranks: f·(n-1)/n."""
    return _f(kind) * (n - 1) / n if n > 1 else 0.0


def sent_bytes(kind: str, full_bytes: int, n: int) -> int:
    """Bytes one rank sends for a ``kind`` over a ``full_bytes`` tensor with a ring of ``n`` ranks."""
    return _f(kind) * (n - 1) * full_bytes // n if n > 1 else 0


def _by_kind(v, kind: str) -> float:
    """A figure that is one number, or one per kind (an all-to-all moves what an all-gather does)."""
    if isinstance(v, Mapping):
        return v[kind] if kind in v else v["all_gather"]
    return v


@dataclass(frozen=True)
class Level:
    """The ranks joined by one kind of link."""

    name: str
    busbw: float | Mapping = 0.0
    """Bytes/s per rank (ring bus bandwidth within the level; NIC bandwidth across nodes); one number,
    or one per collective kind (a calibrated link)."""
    alpha: float | Mapping = 0.0
    """Seconds per step of the algorithm at this level."""
    nvls_algbw: float | None = None
    """NVSwitch with NVLink SHARP: an all-reduce within this level reduces in the switch at this algorithm bandwidth
    (bytes/s of the whole buffer) when that beats the ring; NCCL's default on H100/H200 NVSwitch nodes."""
    overhead: float | Mapping = 0.0
    """Seconds per call beyond the algorithm's steps (kernel launch, host dispatch), by kind."""

    def bw(self, kind: str = "all_gather") -> float:
        return _by_kind(self.busbw, kind)

    def __str__(self) -> str:
        return f"{self.name} {self.bw() / 1e9:.3g} GB/s"


@dataclass(frozen=True)
class Topology:
    """Ranks and the link levels between them, innermost first: ``(size, Level)`` pairs. A DGX
    cluster is ``[(8, NVLink), (nodes, InfiniBand)]``, a TPU slice one pair per torus axis."""

    name: str
    dims: tuple
    rings: bool = True
    """GPU clusters: NCCL runs a large collective as rings through every rank of the group, each ring
    leaving a node through its own NIC, so the bandwidth term is set by the slowest level, a network
    level counting every NIC of the node (``busbw_d x ranks of the group inside one node``). TPU tori
    (False): axis by axis on shrinking data (the multi-dimensional algorithm)."""

    @property
    def gpus(self) -> int:
        return int(np.prod([size for size, _ in self.dims]))

    def levels(self, group: int, inner: int = 1) -> list[tuple[int, Level]]:
        """How a group of ``group`` ranks spreads over the dimensions when its ranks are ``inner`` apart
        (tensor-parallel groups are innermost: ``inner`` = 1; data-parallel ranks are ``tp · pp`` apart)."""
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

    def time(self, kind: str, nbytes: float, group: int, inner: int = 1) -> float:
        """Seconds of one ``kind`` (all_gather, reduce_scatter, all_reduce, all_to_all) over ``group`` ranks on a full
        tensor of ``nbytes`` (the all-gather output, the reduce-scatter input, one rank's all-to-all buffer)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        if kind == "all_to_all":
            # each rank sends (n-1)/n of its ``nbytes`` buffer, the slowest level it spans bounding it
            lv = self.levels(group, inner)
            return (max(_by_kind(lvl.overhead, kind) for _, lvl in lv)
                    + (group - 1) * max(_by_kind(lvl.alpha, kind) for _, lvl in lv)
                    + bus_factor(kind, group) * nbytes / min(lvl.bw(kind) for _, lvl in lv))
        latency, bandwidth, _ = self.parts(kind, nbytes, group, inner)
        return latency + bandwidth

    def parts(self, kind: str, nbytes: float, group: int, inner: int = 1) -> tuple[float, float, float]:
        """(latency s, bandwidth s, latency-bearing steps) of a reduce-scatter, all-gather or
        all-reduce (module docstring)."""
        f = _f(kind)
        lat = bw = steps = 0.0
        s = float(nbytes)
        levels = self.levels(group, inner)
        below, slowest, call = 1, float("inf"), 0.0
        ring = self.rings and kind != "all_reduce"  # one ring through every rank (see the docstring)
        for n, lvl in levels:
            above = group // (below * n) if ring else 1
            if n > 1:
                lat += f * (n - 1) * above * _by_kind(lvl.alpha, kind)
                bw += bus_factor(kind, n) * s / lvl.bw(kind)
                steps += f * (n - 1) * above
                slowest = min(slowest, lvl.bw(kind) * below)
                call = max(call, _by_kind(lvl.overhead, kind))
            s /= n
            below *= n
        spanned = [(n, lvl) for n, lvl in levels if n > 1]
        if self.rings and len(spanned) > 1:
            bw = bus_factor(kind, group) * nbytes / slowest
            if kind == "all_reduce" and len(spanned) == 2 and spanned[0][1].nvls_algbw:
                bw = min(bw, self.nvls_tree_s(nbytes, *spanned))
        elif kind == "all_reduce" and len(spanned) == 1 and spanned[0][1].nvls_algbw:
            bw = min(bw, nbytes / spanned[0][1].nvls_algbw)
        return call + lat, bw, steps

    @staticmethod
    def nvls_tree_s(nbytes: float, node: tuple[int, Level], net: tuple[int, Level]) -> float:
        """NCCL's NVLSTree all-reduce over NVSwitch nodes (bandwidth term): the switch reduces the buffer inside each
        node, leaving each of the node's g GPUs 1/g of it to all-reduce across the m nodes over its own NIC on a double
        binary tree, then multicasts the result back. The two stages are pipelined, so the slower sets the time. Over
        the trees a NIC carries its share once each way when m = 2 (each node is one tree's root and the other's leaf)
        and twice when m > 2 (an inner node of one tree receives from two children, then sends to both)."""
        (g, inside), (m, lvl) = node, net
        per_nic = nbytes / g * (1 if m == 2 else 2)
        return max(nbytes / inside.nvls_algbw, per_nic / lvl.bw("all_reduce"))


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


@dataclass(frozen=True)
class LinkProfile:
    """Latency (s per call) and bus bandwidth (bytes/s) per collective kind over one group of ranks,
    as ``calibrate`` measures them: a one-level topology."""

    name: str
    alpha: dict = field(default_factory=dict)
    """Seconds of fixed cost per call, by kind (``all_to_all`` where measured; else predicted from the all-gather's)."""
    busbw: dict = field(default_factory=dict)
    """Bus bandwidth in bytes/s, by kind."""
    source: str = ""
    """Where the numbers come from (a measurement's command and date, or a citation)."""
    host: dict | None = None
    """The host link, bytes/s ``{"h2d", "d2h", "both"}`` (costmodel/hostlink.py), where measured."""
    fused: list | None = None
    """The Triton tp kernels' product rate as a share of the library's, ``[[flops bound, share], ...]``
    (costmodel/fused.py ``KERNEL_EFFICIENCY``), where measured."""

    def __post_init__(self):
        for k in KINDS:
            if k not in self.alpha or k not in self.busbw:
                raise ValueError(f"LinkProfile {self.name!r}: needs alpha and busbw for {k}")
            if self.busbw[k] <= 0 or self.alpha[k] < 0:
                raise ValueError(f"LinkProfile {self.name!r}: {k} needs busbw > 0 and alpha >= 0")

    def level(self, name: str | None = None) -> Level:
        """This profile as a topology level: its α is per call, its bandwidth per kind."""
        return Level(name or self.name, busbw=dict(self.busbw), overhead=dict(self.alpha))

    def time(self, kind: str, nbytes: int, n: int) -> float:
        """Predicted seconds for one ``kind`` over ``n`` ranks on a full tensor of ``nbytes``."""
        return Topology(self.name, ((n, self.level()),)).time(kind, nbytes, n)

    @staticmethod
    def of(topology: Topology, ranks: int, name: str, source: str = "") -> "LinkProfile":
        """The one-level view of ``topology`` for groups of ``ranks``: per kind, its latency at that
        size as α and the bus bandwidth its bandwidth term works out to (exact at ``ranks``)."""
        alpha, busbw = {}, {}
        for k in KINDS:
            lat, bw, _ = topology.parts(k, 2**30, ranks)
            alpha[k], busbw[k] = lat, bus_factor(k, ranks) * 2**30 / bw
        return LinkProfile(name, alpha, busbw, source or f"{topology.name} at {ranks} ranks")

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @staticmethod
    def load(path: str) -> "LinkProfile":
        with open(path) as f:
            d = json.load(f)
        return LinkProfile(d["name"], d["alpha"], d["busbw"], d.get("source", ""), d.get("host"), d.get("fused"))

    def host_link(self):
        """The profile's host link as a ``HostLink``, or None where it was not measured."""
        from .hostlink import HostLink

        return None if not self.host else HostLink(self.host["h2d"], self.host["d2h"], self.host["both"], self.source)

    def __str__(self) -> str:
        parts = [f"{k} α={self.alpha[k] * 1e6:.1f}µs busbw={self.busbw[k] / 1e9:.1f}GB/s"
                 for k in (*KINDS, "all_to_all") if k in self.alpha]
        if self.host:
            parts.append(f"host link h2d {self.host['h2d'] / 1e9:.1f} d2h {self.host['d2h'] / 1e9:.1f} "
                         f"both {self.host['both'] / 1e9:.1f} GB/s")
        if self.fused:
            parts.append("tp kernels' products at " + "/".join(f"{e:.2f}" for _, e in self.fused) + " of the library's")
        return f"{self.name}: " + ", ".join(parts)


def _per_kind(name, alpha_s, busbw, source) -> LinkProfile:
    return LinkProfile(name, dict(zip(KINDS, alpha_s)), dict(zip(KINDS, busbw)), source)


PRESETS = {
    # `shardwise calibrate` over NCCL on our two H200s (bench/results/2026-11-30-h200x2-nccl-link.json):
    # the compiler's default on NCCL, and the link of the planner's `h200-nv18-x2` machine
    "h200-nv18-x2": _per_kind("h200-nv18-x2", (71.72e-6, 61.59e-6, 75.69e-6), (279.51e9, 281.67e9, 290.22e9),
                              "shardwise calibrate over 2 ranks (nccl, cuda) on 2xH200 NV18, 2026-11-30 "
                              "(bench/results/2026-11-30-h200x2-nccl-link.json)"),
    # one 8-GPU NVSwitch node (the planner's dgx-h100/dgx-h200 node), seen by groups of all 8 GPUs
    "nvlink-8gpu": LinkProfile.of(Topology("8-GPU NVSwitch node", ((8, NVLINK4),)), 8, "nvlink-8gpu",
                                  "8xH100/H200 NVSwitch: ring busbw 370 GB/s, NVLS all-reduce, 3.4 µs per step "
                                  "(shared/notes/cost-models.md §2)"),
    "cpu-gloo": _per_kind("cpu-gloo", (150e-6,) * 3, (1e9,) * 3, "rough default for gloo over loopback")}


def fit(samples: list[tuple[int, float]], kind: str, n: int) -> tuple[float, float]:
    """Least-squares (α, busbw) from ``(full-tensor bytes, seconds)`` samples of one kind."""
    x = np.array([s * bus_factor(kind, n) for s, _ in samples], dtype=np.float64)
    y = np.array([t for _, t in samples], dtype=np.float64)
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), y, rcond=None)
    if inv_bw <= 0:
        raise ValueError(f"fit: {kind} times do not grow with size ({samples}); measure larger messages")
    return max(float(alpha), 0.0), float(1.0 / inv_bw)


def _timed(fn, device: torch.device, iters: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        # CUDA events: Python timing adds tens of µs per call on GPUs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    ts = []
    for _ in range(iters):  # the median: CPU timings carry scheduler noise
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def calibrate(group: dist.ProcessGroup, device: torch.device, sizes: list[int], iters: int = 10,
              dtype: torch.dtype = torch.bfloat16, name: str = "measured") -> tuple[LinkProfile, dict]:
    """Measure every kind (and all-to-all) over ``sizes`` (full-tensor bytes) on ``group``; every rank
    must call it. Times are the maximum over ranks, so every rank gets the same profile (DESIGN.md
    invariant 2). Returns the fitted profile and the raw samples."""
    n = dist.get_world_size(group)
    c10d = torch.ops._c10d_functional
    gname = group.group_name
    samples: dict[str, list] = {k: [] for k in (*KINDS, "all_to_all")}
    for nbytes in sizes:
        numel = max(n, (nbytes // dtype.itemsize) // n * n)
        full = torch.ones(numel, dtype=dtype, device=device)
        shard = full[: numel // n].clone()
        ops = {
            "all_gather": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(shard, n, gname)),
            "reduce_scatter": lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(full, "sum", n, gname)),
            "all_reduce": lambda: c10d.wait_tensor(c10d.all_reduce(full, "sum", gname)),
            # one rank's whole buffer, an equal block to every rank (the ep axis's dispatch and combine)
            "all_to_all": lambda: c10d.wait_tensor(c10d.all_to_all_single(full, [numel // n] * n, [numel // n] * n,
                                                                          gname))}
        for k, fn in ops.items():
            t = torch.tensor([_timed(fn, device, iters)], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            samples[k].append((numel * dtype.itemsize, float(t)))
    alpha, busbw = {}, {}
    for k in samples:
        try:
            alpha[k], busbw[k] = fit(samples[k], k, n)
        except ValueError:
            if k in KINDS:
                raise
            # an all-to-all too noisy to fit keeps the all-gather's figures (the profile's default for it)
    src = f"shardwise calibrate over {n} ranks ({dist.get_backend(group)}, {device.type}), {time.strftime('%Y-%m-%d')}"
    from .hostlink import measure as measure_host

    h = measure_host(device, (256 if device.type == "cuda" else 32) * 2**20)  # the slowest rank's figures, below
    hv = torch.tensor([h.h2d, h.d2h, h.both], dtype=torch.float64, device=device)
    dist.all_reduce(hv, op=dist.ReduceOp.MIN, group=group)
    host = {"h2d": float(hv[0]), "d2h": float(hv[1]), "both": float(hv[2])}
    return LinkProfile(name, alpha, busbw, src, host), samples
