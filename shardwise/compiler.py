"""The compile driver: capture → passes → hash → agree → executable, one program per batch signature and mode.

For a batch it has not seen (its structure, constants, shapes and dtypes) and a mode (``eval``, or
one of passes.MODES), the compiler traces the single-device step (capture/), rewrites it for the
strategy under the memory plan's share of the budget (passes/pipeline.py), hashes the captured graph
and the final plan and has every rank agree on both (DESIGN.md invariant 2), then builds what runs
it (runtime/executor.py). A compile error on one rank is told to the others before it is raised, so
none waits in a collective for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from .capture import batch_signature, capture_step, flatten_batch
from .passes import ShardContext, shard_step
from .runtime.executor import Compiled, executable


def rank_free(code: str) -> str:
    """Graph code without device indices: rank r runs the same plan on ``cuda:r``."""
    code = re.sub(r"device\(type='(\w+)', index=\d+\)", r"device(type='\1')", code)
    return re.sub(r"'(cuda|xpu|hpu):\d+'", r"'\1'", code)


def batch_key(batch, mode: str) -> tuple:
    tensors, consts, spec = flatten_batch(batch)
    return batch_signature(spec, consts, tensors), mode


class Compiler:
    """Compiled programs of one job, by ``(batch signature, mode)``."""

    def __init__(self, model, strategy: str, ctx: ShardContext, agree, plan, device, param_dtype, loss_fn=None,
                 inductor: bool = False):
        self.model, self.strategy, self.ctx = model, strategy, ctx
        self.agree, self.plan, self.device = agree, plan, device
        self.param_dtype, self.loss_fn, self.inductor = param_dtype, loss_fn, inductor
        self.programs: dict[tuple, Compiled] = {}
        self.replanned: dict[tuple, Compiled] = {}
        """Programs of a plan being made again (a budget's check): kept where the new plan is the same."""
        self.recompiles_avoided = 0
        """Training programs a re-plan made again unchanged (their compiled code kept)."""

    def get(self, batch, mode: str) -> Compiled:
        """The program for this batch and mode, compiled if new; every rank first agrees on the
        batch's signature (a collective: every rank calls it alike)."""
        tensors, consts, spec = flatten_batch(batch)
        sig = batch_signature(spec, consts, tensors)
        self.agree.same(sig, "batch")
        key = (sig, mode)
        if key not in self.programs:
            self._compile(key, batch, tensors, mode)
        return self.programs[key]

    def cached(self, batch, mode: str) -> Compiled:
        """An existing program without the per-step agreement (so introspection on one rank cannot
        hang), else compiled as in a step (a collective)."""
        return self.programs.get(batch_key(batch, mode)) or self.get(batch, mode)

    def step_programs(self) -> list:
        return [c.program for (_, mode), c in self.programs.items() if mode == "step"]

    def replan(self) -> None:
        """Make every plan again at its next use (compiling only what changed)."""
        self.replanned.update(self.programs)
        self.programs.clear()

    def _context(self, tensors, train: bool) -> ShardContext:
        """The pass context, with the graph's share of the memory budget when one is set."""
        share = self.plan.graph_budget(tensors) if train else None
        if share is None:
            return self.ctx
        return dataclasses.replace(self.ctx, graph_budget=share[0], reserve=share[1])

    def _compile(self, key, batch, tensors, mode: str) -> None:
        train = mode != "eval"
        try:
            cap = capture_step(self.model, batch, loss_fn=self.loss_fn, param_dtype=self.param_dtype, train=train,
                               with_grads=train, device=self.device)
            prog = shard_step(cap, self.strategy, self._context(tensors, train), "step" if mode == "eval" else mode)
        except Exception as e:
            # tell the other ranks before raising, so that none waits for this one in a collective;
            # this rank's own error says more than the disagreement, so it is the one raised here
            try:
                self.agree.same(f"compile error on this rank: {type(e).__name__}: {e}", "graph")
            except RuntimeError:
                pass
            raise
        # the captured single-device graph and the final plan (the rewritten, bucketed, scheduled
        # program, whose node order is the order of collectives) must be the same on every rank
        cap_hash = hashlib.sha256(rank_free(prog.capture.gm.code).encode()).hexdigest()[:16]
        plan_hash = hashlib.sha256(rank_free(prog.gm.code).encode()).hexdigest()[:16]
        self.agree.same(f"capture {cap_hash} plan {plan_hash}", "graph")
        prog.hashes = {"capture": cap_hash, "plan": plan_hash}
        old = self.replanned.pop(key, None)
        if old is not None and old.program.hashes == prog.hashes:
            # the plan made again is the same program (hashes agreed on every rank, so every rank
            # decides alike): keep its compiled code rather than compiling it again
            self.programs[key] = old
            self.recompiles_avoided += mode != "eval"  # eval programs ignore the budget: always kept
        else:
            self.programs[key] = Compiled(prog, executable(prog.gm, self.inductor))
        if mode == "step":
            self.plan.plan_residency(self.programs[key].program, tensors)
