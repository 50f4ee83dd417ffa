"""Graph rewrites. A strategy pass turns the captured single-device step into this rank's program."""

from __future__ import annotations

import copy

from ..capture import Capture
from . import ddp, zero
from .program import Program, ShardContext

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def shard_step(cap: Capture, strategy: str, ctx: ShardContext) -> Program:
    """Rewrite a captured step for ``strategy`` on the data-parallel axis described by ``ctx``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    gm = copy.deepcopy(cap.gm)
    if strategy == "ddp":
        return ddp.apply(cap, gm, ctx)
    if strategy in ("zero1", "zero2"):
        return zero.apply_zero12(cap, gm, ctx, strategy)
    return zero.apply_zero3(cap, gm, ctx)


__all__ = ["Program", "STRATEGIES", "ShardContext", "shard_step"]
