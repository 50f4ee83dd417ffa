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
from .config import JobConfig
from .passes import ShardContext, shard_step
from .passes.carveout import choose as carveout_settings
from .runtime.executor import Compiled, executable


def rank_free(code: str) -> str:
    """Graph code without device indices: rank r runs the same plan on ``cuda:r``."""
    code = re.sub(r"device\(type='(\w+)', index=\d+\)", r"device(type='\1')", code)
    return re.sub(r"'(cuda|xpu|hpu):\d+'", r"'\1'", code)


def batch_key(batch, mode: str) -> tuple:
    tensors, consts, spec = flatten_batch(batch)
    return batch_signature(spec, consts, tensors), mode


def pass_context(config: JobConfig, model, dp: int, group: str, backend: str, device, cost) -> ShardContext:
    """What the passes are told (passes/program.py ``ShardContext``): the data-parallel axis, the
    precision policy, the cost model and the options of ``config``, checked against the model."""
    mp, sch, mem, off, upd = config.mixed_precision, config.schedule, config.memory, config.offload, config.update
    ctx = ShardContext(
        dp, group, cost=cost, param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype if mp.param_dtype is not None else None,
        bucket_bytes=int(sch.bucket_mb * 2**20), shard_bucket_bytes=sch.shard_bucket_bytes, schedule=sch.schedule,
        max_in_flight=None if sch.max_in_flight_mb is None else int(sch.max_in_flight_mb * 2**20),
        # gloo: one at a time (see ShardContext.max_ops_in_flight)
        max_ops_in_flight=1 if backend == "gloo" else sch.max_in_flight_ops,
        # gloo moves only host tensors reliably: ranks on a GPU over gloo stage collectives on the CPU
        stage="cpu" if backend == "gloo" and device.type != "cpu" else None,
        recompute=mem.recompute, offload_activations=mem.offload_activations,
        sm_carveout=carveout_settings(config.matmul_sm_carveout, device, backend, sch.schedule))
    if off.offload_optimizer and mp.param_dtype is not None:
        # the graph reads the device shards in the compute dtype; the fp32 masters are on the host.
        # At one rank nothing is reduced: the gradients stay in the compute dtype and are cast
        # chunk by chunk in the streamed update (the same values; half the device bytes). Not
        # under clipping, whose norm is taken over the master-dtype gradients.
        ctx = dataclasses.replace(ctx, master_dtype=mp.param_dtype,
                                  compute_dtype_grads=dp == 1 and upd.clip_grad_norm is None)
    named = dict(model.named_parameters())
    if off.offload_optimizer or upd.overlap_update:
        # the update of one step may still run when the next starts: its graph waits for each
        # parameter before its first reader (passes/ready.py; no-ops where nothing is pending)
        ctx = dataclasses.replace(ctx, param_ready=frozenset(n for n, p in named.items() if p.requires_grad))
    if mem.keep_gathered is not None:
        unknown = sorted(mem.keep_gathered - set(named))
        if unknown:
            raise ValueError(f"keep_gathered names parameters the model does not have: {unknown[:5]}")
        ctx = dataclasses.replace(ctx, keep_gathered=mem.keep_gathered)
    return ctx


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
