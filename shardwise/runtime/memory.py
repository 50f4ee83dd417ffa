"""Measured memory per rank: CUDA allocator statistics on GPUs, MemTracker on CPUs."""

from __future__ import annotations

from typing import Callable

import torch


def tracked_tensors(job) -> list[torch.Tensor]:
    """The tensors a job holds between steps: whole parameters, master shards, buffers."""
    st = job.state
    seen: dict[int, torch.Tensor] = {}
    for t in list(st.full.values()) + list(st.master.values()) + list(job.buffers.values()):
        if not t.is_meta:
            seen.setdefault(id(t), t)
    return list(seen.values())


def measure(job, fn: Callable[[], object]) -> tuple[object, int]:
    """Run ``fn`` (typically ``lambda: job.step(batch)``) and return (its result, peak bytes on this rank).

    On CUDA the peak is ``max_memory_allocated`` over the call. On CPU, torch's MemTracker follows
    every tensor the call creates plus the state the job already holds (parameters, shards,
    buffers, optimizer state), so the number is the live-tensor peak, not the process RSS.
    """
    dev = job.mesh.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        return out, torch.cuda.max_memory_allocated(dev)
    return tracked_peak(fn, job.optimizer, *tracked_tensors(job))


def tracked_peak(fn: Callable[[], object], *external) -> tuple[object, int]:
    """(``fn()``, MemTracker's live-tensor peak over the call), counting ``external`` (modules,
    optimizers, tensors that exist before the call) as held throughout."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(*external)
    with mt:
        out = fn()
    peak = mt.get_tracker_snapshot("peak")
    return out, int(sum(d.get("Total", 0) for d in peak.values()))
