"""α-β time of collectives, in the form of NCCL's ring model, with profiles measured or preset.

``t(kind, S, n) = α_kind + S · f_kind(n) / busbw_kind`` where ``S`` is the bytes of the full tensor
(the all-gather output, the reduce-scatter input, the all-reduce buffer) and ``f`` is the ring's
bus factor: ``(n-1)/n`` for all-gather and reduce-scatter, ``2(n-1)/n`` for all-reduce. ``busbw`` is
what nccl-tests call bus bandwidth, so published figures drop in as they are.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def bus_factor(kind: str, n: int) -> float:
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}: one of {KINDS}")
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


@dataclass(frozen=True)
class LinkProfile:
    """Latency (s) and bus bandwidth (bytes/s) per collective kind over one group of ranks."""

    name: str
    alpha: dict = field(default_factory=dict)
    """Seconds of fixed cost per call, by kind."""
    busbw: dict = field(default_factory=dict)
    """Bus bandwidth in bytes/s, by kind."""
    source: str = ""
    """Where the numbers come from (a measurement's command and date, or a citation)."""
    host: dict | None = None
    """The host link, bytes/s ``{"h2d", "d2h", "both"}`` (costmodel/hostlink.py), where measured."""

    def __post_init__(self):
        for k in KINDS:
            if k not in self.alpha or k not in self.busbw:
                raise ValueError(f"LinkProfile {self.name!r}: needs alpha and busbw for {k}")
            if self.busbw[k] <= 0 or self.alpha[k] < 0:
                raise ValueError(f"LinkProfile {self.name!r}: {k} needs busbw > 0 and alpha >= 0")

    def time(self, kind: str, nbytes: int, n: int) -> float:
        """Predicted seconds for one ``kind`` over ``n`` ranks on a full tensor of ``nbytes``."""
        if n <= 1:
            return 0.0
        return self.alpha[kind] + nbytes * bus_factor(kind, n) / self.busbw[kind]

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @staticmethod
    def load(path: str) -> "LinkProfile":
        with open(path) as f:
            d = json.load(f)
        return LinkProfile(d["name"], d["alpha"], d["busbw"], d.get("source", ""), d.get("host"))

    def host_link(self):
        """The profile's host link as a ``HostLink``, or None where it was not measured."""
        from .hostlink import HostLink

        return None if not self.host else HostLink(self.host["h2d"], self.host["d2h"], self.host["both"], self.source)

    def __str__(self) -> str:
        parts = [f"{k} α={self.alpha[k] * 1e6:.1f}µs busbw={self.busbw[k] / 1e9:.1f}GB/s" for k in KINDS]
        if self.host:
            parts.append(f"host link h2d {self.host['h2d'] / 1e9:.1f} d2h {self.host['d2h'] / 1e9:.1f} "
                         f"both {self.host['both'] / 1e9:.1f} GB/s")
        return f"{self.name}: " + ", ".join(parts)


def _preset(name, alpha_us, gbs, source):
    return LinkProfile(name, {k: a * 1e-6 for k, a in zip(KINDS, alpha_us)}, {k: g * 1e9 for k, g in zip(KINDS, gbs)},
                       source)


PRESETS = {
    "h200-nv18-x2": _preset("h200-nv18-x2", (32, 32, 32), (266, 259, 328),
                            "NCCL on 2xH200 NV18 at 1 GiB, Python-timed, 2026-11-29 (shared/notes/peers-measured)"),
    "nvlink-8gpu": _preset("nvlink-8gpu", (15, 15, 15), (370, 370, 475),
                           "8xH100/H200 NVSwitch ring busbw; all-reduce with NVLS (DESIGN.md reference figures)"),
    "cpu-gloo": _preset("cpu-gloo", (150, 150, 150), (1.0, 1.0, 1.0), "rough default for gloo over loopback"),
}


def fit(samples: list[tuple[int, float]], kind: str, n: int) -> tuple[float, float]:
    """Least-squares (α, busbw) from ``(full-tensor bytes, seconds)`` samples of one kind."""
    x = np.array([s * bus_factor(kind, n) for s, _ in samples], dtype=np.float64)
    y = np.array([t for _, t in samples], dtype=np.float64)
    a = np.stack([np.ones_like(x), x], axis=1)
    (alpha, inv_bw), *_ = np.linalg.lstsq(a, y, rcond=None)
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
    """Measure every kind over ``sizes`` (full-tensor bytes) on ``group``; every rank must call it.

    Times are the maximum over ranks, so every rank gets the same profile (DESIGN.md invariant 2).
    Returns the fitted profile and the raw samples.
    """
    n = dist.get_world_size(group)
    c10d = torch.ops._c10d_functional
    gname = group.group_name
    samples: dict[str, list] = {k: [] for k in KINDS}
    for nbytes in sizes:
        numel = max(n, (nbytes // dtype.itemsize) // n * n)
        full = torch.ones(numel, dtype=dtype, device=device)
        shard = full[: numel // n].clone()
        ops = {
            "all_gather": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(shard, n, gname)),
            "reduce_scatter": lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(full, "sum", n, gname)),
            "all_reduce": lambda: c10d.wait_tensor(c10d.all_reduce(full, "sum", gname)),
        }
        for k, fn in ops.items():
            t = torch.tensor([_timed(fn, device, iters)], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            samples[k].append((numel * dtype.itemsize, float(t)))
    alpha, busbw = {}, {}
    for k in KINDS:
        alpha[k], busbw[k] = fit(samples[k], k, n)
    src = f"shardwise calibrate over {n} ranks ({dist.get_backend(group)}, {device.type}), {time.strftime('%Y-%m-%d')}"
    from .hostlink import measure as measure_host

    h = measure_host(device, (256 if device.type == "cuda" else 32) * 2**20)  # the slowest rank's figures, below
    hv = torch.tensor([h.h2d, h.d2h, h.both], dtype=torch.float64, device=device)
    dist.all_reduce(hv, op=dist.ReduceOp.MIN, group=group)
    host = {"h2d": float(hv[0]), "d2h": float(hv[1]), "both": float(hv[2])}
    return LinkProfile(name, alpha, busbw, src, host), samples
