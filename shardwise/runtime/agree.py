"""Rank agreement (DESIGN.md invariant 2): every rank holds the same batch signature, graph and plan, or every rank
stops with an error that names what differs on which ranks.

Control messages travel over gloo even when the data is on NCCL: they are small host values, and a rank that has failed
to compile must still be able to tell the others without touching the device."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from ..errors import BatchMismatchError, PlanMismatchError, RankMismatchError


def signature_hash(sig: str) -> int:
    return int.from_bytes(hashlib.sha256(sig.encode()).digest()[:7], "little")


class Agreement:
    """Agreement over the ranks of ``group`` on a gloo control group of the same ranks."""

    def __init__(self, group: dist.ProcessGroup):
        self.ranks = dist.get_world_size(group)
        self.ctrl = group if dist.get_backend(group) == "gloo" else dist.new_group(dist.get_process_group_ranks(group),
                                                                                   backend="gloo")
        self.doing = ""
        """What this rank is doing (``job.step (step 6)``): agreed with each batch signature."""

    def same(self, sig: str, what: str) -> None:
        """All ranks hold the same ``sig`` (a batch signature or a graph hash), or all raise:
        ``BatchMismatchError`` for a batch, ``PlanMismatchError`` for a graph."""
        if self.ranks == 1:
            return
        if what == "batch" and self.doing:
            sig = f"{self.doing} | {sig}"
        mine = torch.tensor([signature_hash(sig)], dtype=torch.int64)
        allh = [torch.empty_like(mine) for _ in range(self.ranks)]
        dist.all_gather(allh, mine, group=self.ctrl)
        if all(bool(h == allh[0]) for h in allh):
            return
        descs: list[Any] = [None] * self.ranks
        dist.all_gather_object(descs, sig[:400], group=self.ctrl)
        doing = [d.split(" | ", 1)[0] if " | " in d else "" for d in descs]
        if what == "batch" and len(set(doing)) > 1:
            by: dict[str, list[int]] = {}
            for r, d in enumerate(doing):
                by.setdefault(d, []).append(r)
            raise RankMismatchError(
                "ranks are doing different things: " + "; ".join(f"ranks {rs} in {d}" for d, rs in by.items())
                + ". Every rank must call job.step and job.eval_step alike: the same number of steps, "
                "eval_step on every rank or on none")
        descs = [d.split(" | ", 1)[1] if " | " in d else d for d in descs]
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(descs):
            groups.setdefault(d, []).append(r)
        detail = "; ".join(f"ranks {rs}: {d}" for d, rs in groups.items())
        if what == "batch":
            raise BatchMismatchError(
                f"batch shapes differ across ranks ({detail}). Every rank must pass a batch with the same "
                "structure, shapes and dtypes in each step: pad, or drop the last partial batch.")
        raise PlanMismatchError(f"the compiled {what} differs across ranks ({detail}); every rank must compile "
                                "the same plan")

    def max(self, *values: float) -> list[int]:
        """Each value's maximum over the ranks, as ints (a collective on the control group)."""
        v = torch.tensor(values, dtype=torch.float64)
        if self.ranks > 1:
            dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.ctrl)
        return [int(x) for x in v]

    def max_float(self, value: float) -> float:
        v = torch.tensor([value], dtype=torch.float64)
        if self.ranks > 1:
            dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.ctrl)
        return float(v)
