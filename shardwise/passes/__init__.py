"""Graph rewrites. A strategy pass turns the captured single-device step into this rank's program."""

from __future__ import annotations

import copy

from ..capture import Capture
from . import accumulate, ddp, zero
from .program import Program, ShardContext

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
MODES = ("step", "local", "last")
"""``step``: one micro-batch, reduced. ``local``/``last``: the first k-1 / the last of k micro-batches
of a strategy that keeps whole gradients (ddp, zero1); see passes/accumulate.py."""


def shard_step(cap: Capture, strategy: str, ctx: ShardContext, mode: str = "step") -> Program:
    """Rewrite a captured step for ``strategy`` on the data-parallel axis described by ``ctx``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if mode not in MODES or (mode != "step" and strategy not in ("ddp", "zero1")):
        raise ValueError(f"mode {mode!r} is not one of {MODES} for {strategy} (local/last are for ddp and zero1)")
    gm = copy.deepcopy(cap.gm)
    if mode == "local":
        return accumulate.local(cap, gm, ctx, strategy)
    if mode == "last":
        accumulate.add_accumulators(cap, gm, ctx)
    if strategy == "ddp":
        return ddp.apply(cap, gm, ctx)
    if strategy in ("zero1", "zero2"):
        return zero.apply_zero12(cap, gm, ctx, strategy)
    return zero.apply_zero3(cap, gm, ctx)


__all__ = ["MODES", "Program", "STRATEGIES", "ShardContext", "shard_step"]
