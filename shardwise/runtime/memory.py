"""Measured memory per rank: CUDA allocator statistics on GPUs, MemTracker on CPUs."""

from __future__ import annotations

import os
from typing import Callable

import torch


def tracked_tensors(job) -> list[torch.Tensor]:
    """The tensors a job holds between steps: whole parameters, master shards, buffers."""
    st = job.state
    held = [*st.full.values(), *st.master.values(), *job.buffers.values()]
    return list({id(t): t for t in held if not t.is_meta}.values())


def measure(job, fn: Callable[[], object]) -> tuple[object, int]:
    """Run ``fn`` (typically ``lambda: job.step(batch)``) and return (its result, peak bytes on this rank).

    On CUDA the peak is ``max_memory_allocated`` over the call. On CPU, torch's MemTracker follows every tensor the call
    creates plus the state the job already holds (parameters, shards, buffers, optimizer state), so the number is the
    live-tensor peak, not the process RSS."""
    dev = job.mesh.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return fn(), torch.cuda.max_memory_allocated(dev)
    return tracked_peak(fn, job.optimizer, *tracked_tensors(job))


def tracked_peak(fn: Callable[[], object], *external) -> tuple[object, int]:
    """(``fn()``, MemTracker's live-tensor peak over the call), counting ``external`` (modules,
    optimizers, tensors that exist before the call) as held throughout."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(*external)
    with mt:
        out = fn()
    return out, int(sum(d.get("Total", 0) for d in mt.get_tracker_snapshot("peak").values()))


def inductor_wrapper_peak(fn: Callable[[], object]) -> dict:
    """Run ``fn`` and follow the tensors held by inductor's generated ``call`` (its wrapper) line by line: the most
    bytes of storages it made alive at once, where, and their sizes.

    On CPU inductor's wrapper allocates outside the dispatcher, unseen by MemTracker; its locals hold the buffers, so a
    Python line tracer reads them (slow: small graphs). Storages passed in are not counted. Returns {peak, line, file,
    blocks: [(bytes, local name)] live at the peak, largest first}; peak 0 and no file when no inductor wrapper ran."""
    import sys

    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        where = os.path.realpath(cache_dir())
    except Exception:  # noqa: BLE001 - another torch: its default cache directory's name
        where = "torchinductor"
    st: dict = {"peak": 0, "line": None, "file": None, "blocks": []}
    inputs: dict[int, torch.UntypedStorage] = {}  # held while the call runs, so no address is reused

    def tensors(v, depth=0):
        if isinstance(v, torch.Tensor):
            yield v
        elif depth < 4 and isinstance(v, (list, tuple, dict)):
            for x in v.values() if isinstance(v, dict) else v:
                yield from tensors(x, depth + 1)

    def held(loc) -> dict[int, tuple[int, str]]:
        seen: dict[int, tuple[int, str]] = {}
        for k, v in loc.items():
            for t in tensors(v):
                s = t.untyped_storage()
                if s.data_ptr() not in inputs:
                    seen.setdefault(s.data_ptr(), (s.nbytes(), k))
        return seen

    def local(frame, event, arg):
        if event in ("line", "return"):
            live = held(frame.f_locals)
            tot = sum(b for b, _ in live.values())
            if tot > st["peak"]:
                st.update(peak=tot, line=frame.f_lineno, file=frame.f_code.co_filename,
                          blocks=sorted(live.values(), reverse=True))
        return local

    def calls(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name == "call" and "args" in frame.f_locals and where in code.co_filename:
            inputs.clear()
            inputs.update((t.untyped_storage().data_ptr(), t.untyped_storage()) for t in tensors(frame.f_locals["args"]))
            return local
        return None

    old = sys.gettrace()
    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(old)
        inputs.clear()
    return st


def _site(frames: list[dict]) -> str:
    """Where an allocation was made: the innermost frame outside torch's own Python (an inductor
    wrapper's line, a shardwise module, an optimizer, a model)."""
    for f in frames:
        name = f.get("filename", "")
        if "torchinductor" in name or "/torch/" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name', '')}"
    return f"{frames[0].get('filename', '?').rsplit('/', 1)[-1]}:{frames[0].get('line')}" if frames else "?"


def live_at_peak(trace: list[dict], baseline: int, top: int = 25) -> dict:
    """The allocator's live blocks at the peak of one recorded step, grouped by allocation site.

    ``trace`` is one device's event list from ``torch.cuda.memory._snapshot()["device_traces"]``; ``baseline`` the bytes
    requested and not yet freed when recording started (``memory_stats()["requested_bytes.all.current"]``). A block
    counts from its ``alloc`` to its ``free_requested``, in requested sizes, as ``requested_bytes`` counts it
    (``max_memory_allocated`` rounds them up to block sizes); blocks older than the recording are ``before``. Returns
    {peak, before, sites: [(site, bytes, blocks)] largest first}."""
    def replay(stop: int | None = None):
        """Walk the events (up to index ``stop``): (peak, its index, live blocks, bytes of older blocks)."""
        live: dict[int, tuple[int, object]] = {}
        before = cur = peak = baseline
        at = -1
        for i, e in enumerate(trace[:stop]):
            act, addr, size = e.get("action"), e.get("addr"), e.get("size", 0)
            if act == "alloc":
                live[addr] = (size, e)
                cur += size
                if cur > peak:
                    peak, at = cur, i
            elif act == "free_requested":
                if live.pop(addr, None) is None:
                    before -= size
                cur -= size
        return peak, at, live, before

    peak, at, _, _ = replay()
    _, _, at_peak, peak_before = replay(at + 1)
    sites: dict[str, list[int]] = {}
    for size, e in at_peak.values():
        s = sites.setdefault(_site(e.get("frames", [])), [0, 0])
        s[0] += size
        s[1] += 1
    ranked = sorted(((k, v[0], v[1]) for k, v in sites.items()), key=lambda r: -r[1])
    return {"peak": peak, "before": peak_before, "sites": ranked[:top]}
