"""Selective unsharding under a memory budget: which zero3 parameters stay gathered from forward to backward.

First the plan must fit with every parameter resharded; if it does not, selective recomputation (passes/recompute.py) is
turned on, then saved activations are kept in host memory, largest first (passes/actoffload.py), and if it still does
not fit, ``BudgetError``.

A parameter kept gathered needs no backward all-gather but its whole weight lives from its forward use to its last
backward use, adding its bytes to the peak at the forward/backward boundary. The plan is a greedy with re-evaluation:
take parameters in reverse forward order (the last are needed again first) while their bytes fit the headroom under the
budget; then compile that plan and drop the most recently added until its simulated peak fits. Deterministic: the same
plan on every rank."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..capture import Capture
from ..errors import BudgetError
from ..errors import size_text as size
from .program import Program, ShardContext


def _too_big(peak: int, budget: int, strategy: str | None = None) -> BudgetError:
    ways = ["more ranks" + ("" if strategy == "zero3" else " or strategy='zero3'"),
            "a smaller micro-batch (accumulate more of them)", "activation checkpointing in the model"]
    if strategy in (None, "zero3"):
        ways.append("offload_optimizer=True (zero3) to move the optimizer state to host memory")
    return BudgetError(f"the step needs {size(peak)} for its graph on top of the resident state, "
                       f"{size(peak - budget)} more than the budget leaves ({size(budget)}); use "
                       + ", ".join(ways[:-1]) + f", or {ways[-1]}")


def fit(build: Callable[[ShardContext], Program], ctx: ShardContext,
        budget: int, strategy: str | None = None) -> tuple[ShardContext, Program, int]:
    """The plan of ``ctx`` made to fit ``budget``: as it is if it fits; else with selective recomputation (the
    activations it frees); else also keeping saved activations in host memory, largest first, built and re-checked after
    each batch that covers the remaining excess; else BudgetError. Returns (the context that built it, the program, its
    predicted peak)."""
    from . import actoffload

    prog = build(ctx)
    _, peak = ctx.cost.estimate(prog.gm)
    if peak > budget and not ctx.recompute:
        ctx = dataclasses.replace(ctx, recompute=True)
        prog = build(ctx)
        _, peak = ctx.cost.estimate(prog.gm)
    cands = [(n.name, b) for n, b in actoffload.candidates(prog.gm)]
    chosen: list[str] = []
    while peak > budget:
        excess, added = peak - budget, 0
        while cands and added < excess:
            name, b = cands.pop(0)
            chosen.append(name)
            added += b
        if not added:
            raise _too_big(peak, budget, strategy)
        ctx = dataclasses.replace(ctx, offload_activations=frozenset(chosen))
        prog = build(ctx)
        _, peak = ctx.cost.estimate(prog.gm)
    return ctx, prog, peak


def plan(cap: Capture, ctx: ShardContext, mode: str,
         build: Callable[[ShardContext], Program]) -> tuple[ShardContext, Program]:
    """The zero3 plan under ``ctx.graph_budget`` (module docstring): (the context that built it, the program)."""
    if ctx.cost is None:
        raise ValueError("a memory budget needs a cost model to estimate with (ShardContext.cost)")
    budget = ctx.graph_budget
    base_ctx, base, peak = fit(build, dataclasses.replace(ctx, graph_budget=None, keep_gathered=frozenset()),
                               budget, "zero3")
    if ctx.dp == 1:  # one rank gathers nothing: there is nothing to keep gathered
        base.unsharded, base.predicted_graph_peak = [], peak
        return base_ctx, base
    headroom = budget - peak - ctx.reserve  # what other uses hold first (ShardContext.reserve)
    phs = cap.gm.graph.find_nodes(op="placeholder")[: cap.n_params]
    nbytes = {n: ph.meta["val"].numel() * ph.meta["val"].element_size() for n, ph in zip(cap.param_names, phs)}
    keep: list[str] = []
    for name in reversed(cap.param_names):
        if nbytes[name] <= headroom:
            keep.append(name)
            headroom -= nbytes[name]
    # The predicted peak grows with the kept set, so the longest prefix of ``keep`` that fits is found by bisection (a
    # prefix that does not fit gives back its latest, earliest-in-forward, parameters). Every plan tried is a full
    # rewrite and a simulation, seconds on an 8B graph: log2 of them rather than one per parameter given back.
    best, fits, best_peak = base, 0, peak  # the empty prefix is the base plan, which fits
    if keep:
        prog = build(dataclasses.replace(base_ctx, keep_gathered=frozenset(keep)))
        _, p = ctx.cost.estimate(prog.gm)
        if p <= budget:
            best, fits, best_peak = prog, len(keep), p
        else:
            lo, hi = 0, len(keep) - 1  # the prefix of lo fits; none longer than hi does
            while lo < hi:
                k = (lo + hi + 1) // 2
                prog = build(dataclasses.replace(base_ctx, keep_gathered=frozenset(keep[:k])))
                _, p = ctx.cost.estimate(prog.gm)
                if p <= budget:
                    best, lo, best_peak = prog, k, p
                else:
                    hi = k - 1
            fits = lo
    best.unsharded, best.predicted_graph_peak = sorted(keep[:fits]), best_peak
    return dataclasses.replace(base_ctx, keep_gathered=frozenset(keep[:fits])), best
