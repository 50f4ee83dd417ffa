"""Measured time: per-node compute of a step graph, and exposed communication of a real step.

``node_times`` runs a program node by node (an ``fx.Interpreter``), timing each compute node with CUDA events on a GPU
and the wall clock on a CPU, and takes the maximum over ranks so that every rank holds the same numbers (the slowest
rank sets the pace of a synchronous step). Collective starts and waits are not compute and are left out: the cost model
times them with its α-β profile.

``exposed_comm`` reads a ``torch.profiler`` trace of a real step: on GPUs, the time NCCL kernels run while no other
kernel does; on gloo ranks, the time the main thread spends blocked in waits."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from ..sharding.collective import collective_of
from .executor import eager_safe

_C10D = "_c10d_functional"


class _Timer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, cuda: bool):
        super().__init__(gm)
        self.cuda = cuda
        self.marks: dict[str, Any] = {}

    def run_node(self, n: fx.Node):
        if n.op != "call_function" or collective_of(n) is not None or _C10D in str(n.target):  # not compute
            return super().run_node(n)
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = super().run_node(n)
            b.record()
            self.marks[n.name] = (a, b)
            return out
        t0 = time.perf_counter()
        out = super().run_node(n)
        self.marks[n.name] = time.perf_counter() - t0
        return out

    def seconds(self) -> dict[str, float]:
        if not self.cuda:
            return dict(self.marks)
        torch.cuda.synchronize()
        return {k: a.elapsed_time(b) / 1e3 for k, (a, b) in self.marks.items()}


@torch.no_grad()
def node_times(gm: fx.GraphModule, inputs: list, device: torch.device, group: dist.ProcessGroup | None = None,
               reps: int = 2) -> dict[str, float]:
    """Seconds per compute node of ``gm`` run on ``inputs`` (the fastest of ``reps`` runs per node, then
    the maximum over the ranks of ``group``). The RNG state is restored, so profiling does not shift
    dropout masks of the training that follows."""
    cuda = device.type == "cuda"
    best: dict[str, float] = {}
    eager = eager_safe(gm)
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        for _ in range(reps):
            t = _Timer(eager, cuda)
            t.run(*inputs)
            for k, v in t.seconds().items():
                best[k] = min(v, best.get(k, v))
    if group is not None and dist.get_world_size(group) > 1:
        names = [n.name for n in gm.graph.nodes if n.name in best]  # graph order: the same on every rank
        v = torch.tensor([best[k] for k in names], dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
        best = dict(zip(names, v.tolist()))
    return best


def merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return sum(b - a for a, b in iv)


def subtract(iv, cut) -> float:
    """Length of the union ``iv`` not covered by the union ``cut`` (both merged, sorted)."""
    total, j = 0.0, 0
    for a, b in iv:
        covered = 0.0
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            covered += min(b, cut[k][1]) - max(a, cut[k][0])
            k += 1
        total += (b - a) - covered
    return total


_NCCL_KINDS = (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
               ("sendrecv", "send_recv"), ("alltoall", "all_to_all"), ("broadcast", "broadcast"))


def nccl_kind(name: str) -> str:
    flat = name.lower().replace("_", "")
    return next((kind for key, kind in _NCCL_KINDS if key in flat), "other")


def exposed_by_kernel(comm: list[tuple[float, float, str]], comp) -> tuple[dict[str, float], list[dict]]:
    """Exposed time (µs, like the inputs) of each communication kernel ``(start, end, kind)`` against the merged compute
    intervals ``comp``: summed per kind, and the five longest with their start from the first kernel. Kernels in flight
    together each count their own exposed time, so the per-kind sums can exceed the union's. A kernel listed more than
    once counts once (the profiler's event list held every NCCL kernel twice on torch 2.11 with CUDA)."""
    by: dict[str, float] = {}
    rows, comm = [], sorted(set(comm))
    t0 = min([a for a, _, _ in comm] + [a for a, _ in comp], default=0.0)
    for a, b, kind in comm:
        x = subtract([(a, b)], comp)
        by[kind] = by.get(kind, 0.0) + x
        if x > 0:
            rows.append({"kind": kind, "at_ms": round((a - t0) / 1e3, 3), "exposed_ms": round(x / 1e3, 3),
                         "kernel_ms": round((b - a) / 1e3, 3)})
    rows.sort(key=lambda r: -r["exposed_ms"])
    return by, rows[:5]


def gathers_held_back(comm: list[tuple[float, float, str]], comp: list[tuple[float, float]],
                      min_us: float = 200.0, near_us: float = 80.0) -> tuple[int, float]:
    """All-gathers (at least ``min_us`` long) that a running compute kernel held back: the link fell
    idle before the gather, a compute kernel (from ``comp``, one interval per kernel, not merged) began
    within ``near_us`` of that moment, and the gather began within ``near_us`` of its end. A
    persistent matrix product takes every SM, so a collective kernel queued while it runs gets none
    until it ends (bench/results/2026-11-30-h200x2-sitting6-summary.md). A gather's input is a
    parameter, ready long before, so a gather that starts as an unrelated product ends was waiting
    for SMs. Returns (how many, the link's idle µs before them)."""
    n, idle, prev_end = 0, 0.0, None
    for a, b, kind in sorted(set(comm)):
        if (prev_end is not None and kind == "all_gather" and b - a >= min_us and a - prev_end > near_us
                and any(ca <= prev_end + near_us and abs(cb - a) <= near_us and cb - ca >= min_us for ca, cb in comp)):
            n += 1
            idle += a - prev_end
        prev_end = b if prev_end is None else max(prev_end, b)
    return n, idle


def exposed_comm(prof) -> dict[str, Any]:
    """Communication (s) and the part of it not overlapped with compute, from a profiler trace; on GPUs
    also the exposed seconds per collective kind and the five most exposed kernels (where in the step)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels:
        nccl = [(e.time_range.start, e.time_range.end, nccl_kind(e.name)) for e in kernels if "nccl" in e.name.lower()]
        comm = merge([(a, b) for a, b, _ in nccl])
        compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
        comp = merge(compute)
        by, top = exposed_by_kernel(nccl, comp)
        held, held_us = gathers_held_back(nccl, compute)
        return {"comm_s": _length(comm) / 1e6, "exposed_s": subtract(comm, comp) / 1e6,
                "exposed_by_kind_s": {k: v / 1e6 for k, v in sorted(by.items())}, "exposed_top": top,
                "gathers_held_back": held, "gathers_held_back_s": held_us / 1e6}
    waits = merge([(e.time_range.start, e.time_range.end) for e in prof.events()
                    if e.name.endswith("wait_tensor") or e.name in ("c10d::wait", "aten::wait")])
    return {"comm_s": None, "exposed_s": _length(waits) / 1e6}


def profiled(fn: Callable[[], Any], device: torch.device, trace: str | None = None) -> tuple[Any, dict[str, float]]:
    """Run ``fn`` (one training step) under ``torch.profiler``; returns (its result, {step_s, comm_s,
    exposed_s, exposed_pct}); ``trace`` writes the chrome trace (open in chrome://tracing or Perfetto)."""
    import os

    from torch.profiler import ProfilerActivity, profile

    # under a job's RANK kineto prints each profiler start and stop ("USDT: ... profiler_start") at
    # every log level below 6; a user's own setting wins (read when the profiler first starts)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step = time.perf_counter() - t0
    if trace:
        prof.export_chrome_trace(trace)
    ex = exposed_comm(prof)
    return out, {"step_s": step, **ex, "exposed_pct": 100.0 * ex["exposed_s"] / step if step else 0.0}
