"""The pass pipeline: how a captured single-device step becomes this rank's program, in which order, and why.

``shard_step`` runs, for one strategy on the data-parallel axis:

1. the strategy rewrite (ddp.py, zero.py; accumulate.py for the micro-batches of a step): parameters enter as shards and
   are all-gathered, gradients are reduced. Everything after it sees the collectives, so it comes first;
2. recomputation (recompute.py), before bucketing: it copies forward nodes next to their backward readers, which changes
   what is live where but no collective;
3. bucketing (bucket.py): merges neighbouring collectives; it must see every per-parameter collective, and the scheduler
   must see the buckets (it moves them, not their members);
4. scheduling (schedule.py): the collective order and prefetch, pinned in the node order;
5. activation offload (actoffload.py) and readiness waits (ready.py), after the schedule: they add copies and waits that
   must not move a collective;
6. the SM carveout (carveout.py), last, on the program every choice settled on (below).

The choices are the cost model's (``ShardContext.cost``), each made on finished programs: the bucket size
(``_auto_buckets``), the in-flight cap (``_schedule``), the memory plan under a budget (unshard.py: recomputation,
activation offload, which parameters stay gathered). The same graph and cost model give the same choices on every rank.
"""

from __future__ import annotations

import copy
import dataclasses

from ..capture import Capture
from ..sharding.collective import collective_of
from . import accumulate, actoffload, bucket, carveout, ddp, emit, ready, recompute, schedule, unshard, zero
from .program import Program, ShardContext

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
MODES = ("step", "local", "last", "acc")
"""``step``: one micro-batch, reduced. ``local``/``last``: the first k-1 / the last of k micro-batches
of a strategy that keeps whole gradients (ddp, zero1). ``acc``: a micro-batch of zero2/zero3 whose
shards are added into running sums. See passes/accumulate.py."""


def shard_step(cap: Capture, strategy: str, ctx: ShardContext, mode: str = "step") -> Program:
    """Rewrite a captured step for ``strategy`` on the data-parallel axis described by ``ctx``.

    The SM carveout (``ctx.sm_carveout``) comes last: the choices before it are simulated without SM
    contention, where carving only costs, so carving the candidates would steer them away from overlap."""
    prog = _shard_step(cap, strategy, ctx, mode)
    if ctx.sm_carveout:
        if ctx.cost is None:
            raise ValueError("ShardContext.sm_carveout needs the cost model (ShardContext.cost)")
        prog.carved, prog.carve_choice = carveout.apply(prog.gm, ctx.sm_carveout, ctx.cost)
    return prog


def _shard_step(cap: Capture, strategy: str, ctx: ShardContext, mode: str) -> Program:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    whole = strategy in ("ddp", "zero1")
    if mode not in MODES or (mode in ("local", "last") and not whole) or (mode == "acc" and whole):
        raise ValueError(f"mode {mode!r} does not apply to {strategy}: local/last are for ddp and zero1, acc for zero2/zero3")
    if ctx.compute_dtype_grads and ctx.dp == 1 and mode == "step" and ctx.reduce_dtype is not None:
        ctx = dataclasses.replace(ctx, reduce_dtype=None)
    if ctx.graph_budget is not None:
        def build(c: ShardContext) -> Program:
            return _shard_step(cap, strategy, c, mode)

        # the budget's search builds every candidate under the smallest in-flight cap (its peaks then
        # grow with what it keeps); the plan it keeps is built again with the cap swept under the budget
        searching = dataclasses.replace(ctx, cap_sweep=False)
        if strategy == "zero3":
            used, prog = unshard.plan(cap, searching, mode, build)
        else:
            used, prog, peak = unshard.fit(build, dataclasses.replace(searching, graph_budget=None), ctx.graph_budget,
                                           strategy)
            prog.predicted_graph_peak = peak
        if not ctx.cap_sweep or prog.schedule is None or not _sweeps(ctx):
            return prog
        swept = build(dataclasses.replace(used, cap_sweep=True, peak_limit=ctx.graph_budget))
        swept.unsharded = prog.unsharded
        swept.predicted_graph_peak = ctx.cost.estimate(swept.gm)[1]
        return swept
    prog = _rewrite(cap, copy.deepcopy(cap.gm), strategy, ctx, mode)
    if ctx.recompute:
        prog.recomputed = recompute.apply(prog.gm)
    starts = bucket.candidates(prog.gm)
    if ctx.shard_bucket_bytes == "auto" and strategy != "ddp" and starts:
        return _auto_buckets(prog, ctx, mode, starts)
    return _finish(prog, ctx, mode, ctx.shard_bucket_bytes if strategy != "ddp" and starts else 0)


def _finish(prog: Program, ctx: ShardContext, mode: str, bucket_bytes, sweep_cap: bool = True,
            ref_peak: int | None = None) -> Program:
    """Bucket (``bucket_bytes``: 0 none, None twice the largest parameter), schedule, then keep activations on the host
    and put readiness waits where ``ctx`` asks. With ``sweep_cap`` (and ``ctx.cap_sweep``) the scheduler's in-flight cap
    is the cost model's pick (``_schedule``), memory slack measured from ``ref_peak`` (default: the smallest cap's)."""
    starts = bucket.candidates(prog.gm)
    if bucket_bytes != 0 and starts:
        prog.buckets = bucket.bucket(prog.gm, bucket_bytes or 2 * max(collective_of(s).full_bytes for s in starts))
    starts = emit.collectives(prog.gm)
    if mode == "acc":
        prog = accumulate.into_inputs(prog)
    if ctx.schedule and starts:
        return _schedule(prog, ctx, starts, sweep_cap and ctx.cap_sweep, ref_peak)
    return _after_schedule(prog, ctx)


def _after_schedule(prog: Program, ctx: ShardContext) -> Program:
    """Activation offload and readiness waits: the rewrites that follow the schedule."""
    if ctx.offload_activations:
        names = ctx.offload_activations if ctx.offload_activations is not True \
            else {n.name for n, _ in actoffload.candidates(prog.gm)}
        prog.offloaded = actoffload.apply(prog.gm, names, ctx.cost.node_time if ctx.cost else (lambda n: 0.0),
                                          ctx.cost.fetch_time if ctx.cost else (lambda b: 0.0))
    if ctx.param_ready:
        ready.insert(prog, ctx.param_ready)
    return prog


CAP_FACTORS = (2, 4, 8, 16)
"""In-flight caps the scheduler tries, in multiples of the largest collective's payload."""

CAP_TIE = 0.02
"""Caps predicted within this fraction of the fastest count as fast as it (the smallest is taken).
Measured on two H200s (bench/results/2026-11-30-h200x2-sitting6-summary.md): larger caps predicted
0.7% (Llama 8B) and 1.1% (Mixtral-shape MoE) faster ran 0.5-0.7% slower, and the machine-to-machine
spread of one configuration is about 1.5%; a gain the model cannot resolve is not worth the memory."""


def _copy(prog: Program) -> Program:
    """A candidate to finish: ``prog`` with a graph of its own (its other fields shared)."""
    p = copy.copy(prog)
    p.gm = copy.deepcopy(prog.gm)
    return p


def _sweeps(ctx: ShardContext) -> bool:
    """Whether the in-flight cap is the cost model's to choose: no cap given, the cost model at hand,
    and more than one collective allowed in flight (not gloo, not ``max_ops_in_flight=1``)."""
    return not ctx.max_in_flight and ctx.cost is not None and ctx.max_ops_in_flight != 1


def _peak_limit(ctx: ShardContext, base: int) -> float:
    """The predicted peak a bucket size or in-flight cap may reach from ``base``: the slack's share
    of it, or the floor's bytes over it, whichever is more (ShardContext.bucket_peak_floor)."""
    return max(ctx.bucket_peak_slack * base, base + ctx.bucket_peak_floor)


def _schedule(prog: Program, ctx: ShardContext, starts, sweep: bool, ref_peak: int | None) -> Program:
    """Schedule ``prog`` for latency hiding, then finish it (``_after_schedule``). The cap on bytes in flight is
    ``ctx.max_in_flight`` if set; else, where ``_sweeps`` and ``sweep``, the one of ``CAP_FACTORS`` times the largest
    payload predicted fastest on the finished program (within ``CAP_TIE``, ties to the smaller) whose peak stays within
    ``_peak_limit`` of ``ref_peak`` and under ``ctx.peak_limit``; else twice the largest payload. A larger cap gathers
    further ahead (what an MoE's experts need), at the price of gathered weights living longer. Roofline and link
    profile only: the same choice on every rank."""
    largest = max(schedule.payload(s) for s in starts)
    if not (sweep and _sweeps(ctx)):
        prog.schedule = schedule.schedule(prog.gm, ctx.max_in_flight or 2 * largest, ctx.max_ops_in_flight)
        return _after_schedule(prog, ctx)
    rows, tried = [], []
    for k in CAP_FACTORS:
        p = _copy(prog)
        p.schedule = schedule.schedule(p.gm, k * largest, ctx.max_ops_in_flight)
        p = _after_schedule(p, ctx)
        t, peak = ctx.cost.estimate(p.gm)
        limit = _peak_limit(ctx, ref_peak if ref_peak is not None else (rows[0][2] if rows else peak))
        ok = peak <= limit and (ctx.peak_limit is None or peak <= ctx.peak_limit)
        rows.append([k * largest, t, peak, False])
        if not ok and tried:
            break  # the peak only grows with the cap: larger ones will not fit either
        tried.append(p)
    fastest = min(r[1] for r in rows[:len(tried)])
    i = next(j for j in range(len(tried)) if rows[j][1] <= fastest * (1 + CAP_TIE))
    rows[i][3] = True
    tried[i].schedule["cap_choice"] = [tuple(r) for r in rows]
    return tried[i]


def _auto_buckets(prog: Program, ctx: ShardContext, mode: str, starts) -> Program:
    """Try bucket sizes (none, then 1, 2, 4, 8 and 16 times the largest parameter), finish each program and keep the one
    the cost model predicts fastest among those whose predicted peak is within ``_peak_limit`` of the unbucketed one.
    The sweep stops at the first size that is slower than a smaller one or over the slack (time falls, then rises, with
    bucket size: fewer latencies against less overlap; the peak only grows). Deterministic: same graph, same choice."""
    if ctx.cost is None:
        raise ValueError("shard_bucket_bytes='auto' needs a cost model to estimate with (ShardContext.cost)")
    largest = max(collective_of(s).full_bytes for s in starts)
    rows, progs = [], []
    for k in (0, 1, 2, 4, 8, 16):
        p = _finish(_copy(prog), ctx, mode, k * largest, sweep_cap=False)
        t, peak = ctx.cost.estimate(p.gm)
        rows.append([k * largest, t, peak, False])
        progs.append(p)
        if k and (t > min(r[1] for r in rows[:-1]) or peak > _peak_limit(ctx, rows[0][2])):
            break  # slower than a smaller size, or over the memory slack: larger ones will not do better
    base_peak = rows[0][2]
    best = min([i for i, r in enumerate(rows) if r[2] <= _peak_limit(ctx, base_peak)], key=lambda i: (rows[i][1], i))
    rows[best][3] = True
    chosen = progs[best]
    if ctx.cap_sweep and _sweeps(ctx):
        # the chosen size finished again, the in-flight cap now swept too (one sweep, not one per size)
        chosen = _finish(_copy(prog), ctx, mode, rows[best][0], ref_peak=base_peak)
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
        return zero.apply_zero12(cap, gm, ctx, strategy)
    return zero.apply_zero3(cap, gm, ctx)


__all__ = ["CAP_FACTORS", "CAP_TIE", "MODES", "Program", "STRATEGIES", "ShardContext", "shard_step"]
