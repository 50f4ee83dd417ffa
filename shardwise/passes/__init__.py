"""Graph rewrites. A strategy pass turns the captured single-device step into this rank's program."""

from __future__ import annotations

import copy
import dataclasses

from ..capture import Capture
from . import _emit, accumulate, actoffload, bucket, ddp, ready, recompute, schedule, unshard, zero
from .program import Program, ShardContext

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
MODES = ("step", "local", "last", "acc")
"""``step``: one micro-batch, reduced. ``local``/``last``: the first k-1 / the last of k micro-batches
of a strategy that keeps whole gradients (ddp, zero1). ``acc``: a micro-batch of zero2/zero3 whose
shards are added into running sums. See passes/accumulate.py."""


def shard_step(cap: Capture, strategy: str, ctx: ShardContext, mode: str = "step") -> Program:
    """Rewrite a captured step for ``strategy`` on the data-parallel axis described by ``ctx``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    whole = strategy in ("ddp", "zero1")
    if mode not in MODES or (mode in ("local", "last") and not whole) or (mode == "acc" and whole):
        raise ValueError(f"mode {mode!r} does not apply to {strategy}: local/last are for ddp and zero1, acc for zero2/zero3")
    if ctx.compute_dtype_grads and ctx.ws == 1 and mode == "step" and ctx.reduce_dtype is not None:
        ctx = dataclasses.replace(ctx, reduce_dtype=None)
    if ctx.graph_budget is not None:
        if strategy == "zero3":
            return unshard.plan(cap, ctx, mode, lambda c: shard_step(cap, strategy, c, mode))
        _, prog, peak = unshard.fit(lambda c: shard_step(cap, strategy, c, mode),
                                    dataclasses.replace(ctx, graph_budget=None), ctx.graph_budget)
        prog.predicted_graph_peak = peak
        return prog
    prog = _rewrite(cap, copy.deepcopy(cap.gm), strategy, ctx, mode)
    if ctx.recompute:
        prog.recomputed = recompute.apply(prog.gm)
    starts = _emit.collectives(prog.gm)
    if ctx.shard_bucket_bytes == "auto" and strategy != "ddp" and starts and ctx.ws > 1:
        return _auto_buckets(prog, ctx, mode, starts)
    return _finish(prog, ctx, mode, ctx.shard_bucket_bytes if strategy != "ddp" and starts else 0)


def _finish(prog: Program, ctx: ShardContext, mode: str, bucket_bytes, sweep_cap: bool = True) -> Program:
    """Bucket (``bucket_bytes``: 0 none, None twice the largest parameter), then schedule (with
    ``sweep_cap``, under the in-flight cap the cost model picks: ``_schedule``)."""
    starts = _emit.collectives(prog.gm)
    if bucket_bytes != 0 and starts:
        limit = bucket_bytes or 2 * max(s.meta["sw"]["full_bytes"] for s in starts)
        prog.buckets = bucket.bucket(prog.gm, ctx.ws, limit)
        starts = _emit.collectives(prog.gm)
    if mode == "acc":
        prog = accumulate.into_inputs(prog)
    if ctx.schedule and starts:
        _schedule(prog, ctx, starts, sweep_cap)
    if ctx.offload_activations:
        names = ctx.offload_activations if ctx.offload_activations is not True \
            else {n.name for n, _ in actoffload.candidates(prog.gm)}
        prog.offloaded = actoffload.apply(prog.gm, names, ctx.node_time or (lambda n: 0.0),
                                          ctx.fetch_time or (lambda b: 0.0))
    if ctx.param_ready:
        ready.insert(prog, ctx.param_ready)
    return prog


CAP_FACTORS = (2, 4, 8, 16)
"""In-flight caps the scheduler tries, in multiples of the largest collective's payload."""


def _schedule(prog: Program, ctx: ShardContext, starts, sweep: bool) -> None:
    """Schedule ``prog.gm`` in place for latency hiding. The cap on bytes in flight is
    ``ctx.max_in_flight`` if set; else, where the cost model and more than one collective in
    flight are at hand (not gloo) and ``sweep`` is on, the cap among ``CAP_FACTORS`` times the
    largest payload that ``ctx.estimate`` predicts fastest while the predicted peak stays within
    ``ctx.bucket_peak_slack`` of the smallest cap's; else twice the largest payload. A larger cap
    issues all-gathers further ahead: what a layer whose weights take longer to gather than to
    use needs (an MoE's experts), at the price of the gathered weights living longer. Time need not
    fall steadily with the cap, so every cap is tried until one is over the slack (the peak only
    grows); ties go to the smaller cap, and the same graph gives the same choice on every rank."""
    largest = max(schedule._payload(s) for s in starts)
    if ctx.max_in_flight or not sweep or ctx.estimate is None or ctx.max_ops_in_flight == 1:
        prog.schedule = schedule.schedule(prog.gm, ctx.max_in_flight or 2 * largest, ctx.max_ops_in_flight)
        return
    rows, tried = [], []
    for k in CAP_FACTORS:
        gm = copy.deepcopy(prog.gm)
        summary = schedule.schedule(gm, k * largest, ctx.max_ops_in_flight)
        t, peak = ctx.estimate(gm)
        if rows and peak > ctx.bucket_peak_slack * rows[0][2]:
            rows.append([k * largest, t, peak, False])  # shown, not chosen
            break
        rows.append([k * largest, t, peak, False])
        tried.append((gm, summary))
    i = min(range(len(tried)), key=lambda j: (rows[j][1], j))
    rows[i][3] = True
    prog.gm, prog.schedule = tried[i]
    prog.schedule["cap_choice"] = [tuple(r) for r in rows]


def _auto_buckets(prog: Program, ctx: ShardContext, mode: str, starts) -> Program:
    """Try bucket sizes (none, then 1, 2, 4, 8 and 16 times the largest parameter), finish each
    program and keep the one ``ctx.estimate`` predicts fastest among those whose predicted peak is
    within ``ctx.bucket_peak_slack`` of the unbucketed one. The sweep stops at the first size that
    is slower than a smaller one or over the slack (time falls, then rises, with bucket size: fewer
    latencies against less overlap; the peak only grows). Deterministic: same graph, same choice."""
    if ctx.estimate is None:
        raise ValueError("shard_bucket_bytes='auto' needs ShardContext.estimate (the cost model)")
    largest = max(s.meta["sw"]["full_bytes"] for s in starts)
    rows, progs = [], []
    for k in (0, 1, 2, 4, 8, 16):
        p = copy.copy(prog)
        p.gm = copy.deepcopy(prog.gm)
        p = _finish(p, ctx, mode, k * largest, sweep_cap=False)
        t, peak = ctx.estimate(p.gm)
        rows.append([k * largest, t, peak, False])
        progs.append(p)
        if k and (t > min(r[1] for r in rows[:-1]) or peak > ctx.bucket_peak_slack * rows[0][2]):
            break  # slower than a smaller size, or over the memory slack: larger ones will not do better
    base_peak = rows[0][2]
    ok = [i for i, r in enumerate(rows) if r[2] <= ctx.bucket_peak_slack * base_peak]
    best = min(ok, key=lambda i: (rows[i][1], i))
    rows[best][3] = True
    # the chosen size finished again, the in-flight cap now swept too (one sweep, not one per size)
    chosen = copy.copy(prog)
    chosen.gm = copy.deepcopy(prog.gm)
    chosen = _finish(chosen, ctx, mode, rows[best][0])
    chosen.bucket_choice = [tuple(r) for r in rows]
    return chosen


def _rewrite(cap: Capture, gm, strategy: str, ctx: ShardContext, mode: str) -> Program:
    if mode == "local":
        return accumulate.local(cap, gm, ctx, strategy)
    if mode == "last":
        accumulate.add_accumulators(cap, gm, ctx)
    if strategy == "ddp":
        return ddp.apply(cap, gm, ctx)
    if strategy in ("zero1", "zero2"):
        prog = zero.apply_zero12(cap, gm, ctx, strategy)
    else:
        prog = zero.apply_zero3(cap, gm, ctx)
    return prog


__all__ = ["CAP_FACTORS", "MODES", "Program", "STRATEGIES", "ShardContext", "shard_step"]
