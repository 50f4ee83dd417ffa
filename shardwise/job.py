"""``shardwise.compile`` and the ``Job`` it returns: a thin facade over the compiler (compiler.py), the memory
plan (budget.py), the runtime (runtime/: state, executor, update) and the cost model (costmodel/)."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .budget import MemoryPlan, budget_bytes
from .compiler import Compiler, batch_key, expert_parallel_axis, pass_context, tensor_parallel_axis
from .config import JobConfig, MemoryOptions, MixedPrecision, OffloadOptions, ScheduleOptions, UpdateOptions
from .costmodel import CostModel
from .errors import MeshError
from .held import Held
from .passes import Program
from .passes.zero import layouts_for
from .runtime.agree import Agreement
from .runtime.checkpoint import Checkpointing, wait_staged
from .runtime.executor import Compiled, Executor
from .runtime.guard import install, stepping
from .runtime.mesh import Mesh
from .runtime.mesh import mesh as make_mesh
from .runtime.state import ShardedState
from .runtime.update import Updater
from .runtime.watchdog import watchdog, watched

_JOBS = iter(range(1, 1 << 62))
"""Job numbers of this process: the same on every rank that builds its jobs alike."""


def compile(model: nn.Module, optimizer: Callable | None = None, strategy: str = "zero3", mesh: Mesh | None = None, *,
            loss_fn: Callable | None = None, model_inputs=None, mixed_precision: MixedPrecision | None = None,
            clip_grad_norm: float | None = None, compile: str | None = None,
            bucket_mb: float = 25.0, shard_bucket_mb: float | str | None = "auto", schedule: bool = True,
            max_in_flight_mb: float | None = None, max_in_flight_ops: int | None = None,
            memory_budget: int | float | None = None, keep_gathered=None, recompute: bool = False,
            offload_activations: bool = False,
            offload_optimizer: bool | str = False, offload_chunk_mb: float = 64, offload_overlap: bool = True,
            offload_host_update: bool | float | str = "auto",
            fused_optimizer: bool | None = None, overlap_update: bool = False,
            matmul_sm_carveout: int | str | None = "auto", link_profile=None,
            tp_plan=None, sequence_parallel: bool = False, allow_replicate: bool = False,
            vocab_parallel: bool | None = None, tp_fuse: str = "auto",
            ep_plan=None, ep_capacity_factor: float | str | None = None, ep_split: int | str = 1,
            timeout: float | None = 100.0) -> "Job":
    """Compile a single-device model and optimizer into a sharded training job.

    ``optimizer`` is a factory called with ``(name, tensor)`` pairs of this rank's trainable state
    (shards under zero1-3), like ``model.named_parameters()`` yields them, so groups can be built by
    name. The model's forward must return the loss (a scalar, or an object with ``.loss``), or pass
    ``loss_fn(outputs, batch)``; ``model_inputs`` says what of the batch the model takes (``0``: a
    classifier's ``model(x)``, its labels left to ``loss_fn``). ``strategy`` is what the data-parallel
    axis of ``mesh`` does (ddp, zero1, zero2, zero3); ``compile`` the executor (None or "fx": the FX
    graph op by op; "inductor"). Every other keyword is documented where it is validated, as a field of
    its group in config.py: precision (``MixedPrecision``), buckets and the schedule (``ScheduleOptions``:
    ``bucket_mb``, ``shard_bucket_mb``, ``schedule``, ``max_in_flight_mb``, ``max_in_flight_ops``), the
    memory plan (``MemoryOptions``: ``memory_budget``, ``keep_gathered``, ``recompute``,
    ``offload_activations``), optimizer offload (``OffloadOptions``), the update (``UpdateOptions``:
    ``clip_grad_norm``, ``fused_optimizer``, ``overlap_update``), the SM carveout, the link profile and,
    where ``mesh`` has a tp axis, ``tp_plan``, ``sequence_parallel``, ``allow_replicate``,
    ``vocab_parallel`` and ``tp_fuse``, where it has an ep axis ``ep_plan``, ``ep_capacity_factor`` and
    ``ep_split``, and the ``timeout`` a step may wait on other ranks (``JobConfig``). README.md says
    what each does and what it measured.

    Example::

        >>> import torch, shardwise as sw
        >>> model = sw.models.build("gpt", "tiny")
        >>> job = sw.compile(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        ...                  strategy="zero3", mesh=sw.mesh(dp=1))
        >>> x = torch.randint(0, 64, (2, 16))
        >>> float(job.step((x, x))) > 0
        True
    """
    config = JobConfig(
        strategy=strategy, executor=compile, loss_fn=loss_fn, model_inputs=model_inputs, mixed_precision=mixed_precision or MixedPrecision(),
        schedule=ScheduleOptions(bucket_mb=bucket_mb, shard_bucket_mb=shard_bucket_mb, schedule=schedule,
                                 max_in_flight_mb=max_in_flight_mb, max_in_flight_ops=max_in_flight_ops),
        memory=MemoryOptions(memory_budget=memory_budget, keep_gathered=keep_gathered, recompute=recompute,
                             offload_activations=offload_activations),
        offload=OffloadOptions(offload_optimizer=offload_optimizer, offload_chunk_mb=offload_chunk_mb,
                               offload_overlap=offload_overlap, offload_host_update=offload_host_update),
        update=UpdateOptions(clip_grad_norm=clip_grad_norm, fused_optimizer=fused_optimizer,
                             overlap_update=overlap_update),
        matmul_sm_carveout=matmul_sm_carveout, link_profile=link_profile, tp_plan=tp_plan,
        sequence_parallel=sequence_parallel, allow_replicate=allow_replicate, vocab_parallel=vocab_parallel,
        tp_fuse=tp_fuse, ep_plan=ep_plan, ep_capacity_factor=ep_capacity_factor, ep_split=ep_split,
        timeout=timeout)
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile: model must be a torch.nn.Module, got {type(model).__name__}")
    optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=3e-4))
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer= takes a factory, not an optimizer built on the full parameters: "
                        "pass e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)")
    return Job(model, optimizer, mesh if mesh is not None else make_mesh(), config)


class Job(Checkpointing, Held):
    """A compiled training job. Build it with :func:`shardwise.compile`. Checkpoints: ``save``, ``load``,
    ``state_dict``, ``load_state_dict`` (runtime/checkpoint.py ``Checkpointing``); what it holds and has
    learned: ``optimizer``, ``replans``, ``last_grad_norm``, ... (held.py ``Held``)."""

    def __init__(self, model: nn.Module, optimizer: Callable, mesh: Mesh, config: JobConfig):
        for axis, n in mesh.shape.items():
            if axis not in ("dp", "tp", "ep") and n > 1:
                raise MeshError(f"mesh axis {axis}={n}: this version shards the dp, ep and tp axes")
        self.model, self.mesh, self.config, self.strategy = model, mesh, config, config.strategy
        self.watch_id, self.watchdog, self.steps, self._stepping = next(_JOBS), watchdog(config.timeout), 0, 0
        dp, group = mesh.size("dp"), mesh.group("dp")
        self.group = group
        backend = dist.get_backend(group)
        self.agree = Agreement(dist.group.WORLD)
        self.tp, self.ep = tensor_parallel_axis(mesh, config), expert_parallel_axis(mesh, config)
        dev = mesh.device
        self.cost = CostModel.for_job(config.link_profile, dev.type, backend,
                                      torch.cuda.get_device_name(dev) if dev.type == "cuda" else "",
                                      fused=config.executor == "inductor")
        mp, mem, off, upd = config.mixed_precision, config.memory, config.offload, config.update
        # every option checked against the model and device before the model's weights are touched
        self.ctx = pass_context(config, model, dp, group.group_name, backend, dev, self.cost)
        devs = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
        if any(d.type != dev.type for d in devs):
            raise ValueError(f"the model's tensors are on {sorted(map(str, devs))} but the mesh runs on {dev}; "
                             f"move the model first: model.to({str(dev)!r})")
        if dist.get_world_size() > 1:  # every rank starts from rank 0's weights and buffers, as DDP does
            with torch.no_grad(), watched(self, "start"):
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t.data, src=0)
        named = list(model.named_parameters())
        self.layouts = layouts_for([n for n, _ in named], [p.shape for _, p in named],
                                   1 if self.strategy == "ddp" else dp)
        self.state = ShardedState(model, self.strategy, self.layouts, mesh.rank("dp"), optimizer, mp.param_dtype,
                                  offload=bool(off.offload_optimizer),
                                  offload_chunk_bytes=int(off.offload_chunk_mb * 2**20),
                                  offload_overlap=off.offload_overlap, fused=upd.fused_optimizer,
                                  keep_model=self.tp is not None or self.ep is not None)
        if self.ep is not None:  # after the broadcast: each rank's own (passes/ep.py)
            from .passes.ep import add_rank_buffers

            add_rank_buffers(model, self.ep.ranks, self.ep.rank, self.ep.capacity)
        self.buffers = dict(model.named_buffers())
        install(self)  # job.model and job.optimizer train only through job.step (runtime/guard.py)
        self.updater = Updater(self.state, dev, group, dp, upd.clip_grad_norm, upd.overlap_update)
        self.executor = Executor(self.state, self.buffers, dev, self.tp.rank_input if self.tp else None)
        self.plan = MemoryPlan(self.state, self.buffers, self.cost, self.agree, self.updater, dev, group, dp,
                               budget_bytes(mem.memory_budget, dev), off.offload_optimizer == "all",
                               off.offload_host_update, lambda: self.compiler.step_programs())
        self.compiler = Compiler(model, self.strategy, self.ctx, self.agree, self.plan, dev, mp.param_dtype,
                                 config.loss_fn, inductor=config.executor == "inductor", tp=self.tp,
                                 on_tp_plan=self._shard_tp)
        self.compiler.model_inputs, self.compiler.ep = config.model_inputs, self.ep
        self.compiler.on_compile = self.watchdog.compile_started if self.watchdog else None
        self.node_times: dict[tuple, dict[str, float]] = {}
        """Measured seconds per node of a program (``profile_compute``), by (batch signature, mode)."""
        self.last_comm_bytes = 0
        """Bytes this rank sent in the last step."""
        self.last_step_s: float | None = None
        self.last_compiles: list[tuple[str, str, float]] = []
        """What the last step compiled (a new batch shape): (signature, mode, seconds) each."""

    def _shard_tp(self, placements: dict, gather: str) -> None:
        """The tensor-parallel plan, or the ep axis's experts, is known (from the first captured step):
        the state is made again from the model's whole weights, this rank's shard of each split one,
        into the same optimizer (its groups, hyperparameters and schedulers kept; its state, where a
        checkpoint loaded before the first step gave it one, cut to the shards)."""
        from .runtime.state import ParallelAxes, TensorParallel

        named, old = list(self.model.named_parameters()), self.state
        axes = []
        for label, axis in (("tp", self.tp), ("ep", self.ep)):
            if axis is not None:
                axis.placements = placements[label]
                axes.append(TensorParallel(placements[label], axis.ranks, axis.rank, axis.group, label))
        if self.tp is not None:
            self.tp.gather = gather
        state = axes[0] if len(axes) == 1 else ParallelAxes(axes)
        shapes = [state.local(n, p).shape for n, p in named]
        self.layouts = layouts_for([n for n, _ in named], shapes, 1 if self.strategy == "ddp" else self.mesh.dp)
        name_of = {id(t): n for n, t in old.opt_tensors.items()}
        saved = {name_of[id(p)]: s for p, s in old.optimizer.state.items()}
        old.optimizer.state.clear()
        self.state = ShardedState(self.model, self.strategy, self.layouts, self.mesh.rank("dp"), None,
                                  self.config.mixed_precision.param_dtype, tp=state, reuse=old)
        self.state.take_state(saved, old, self.group, self.mesh.dp)
        for part in (self.executor, self.updater, self.plan):
            part.state = self.state
        install(self)

    # -- training ------------------------------------------------------------------------------

    def step(self, batch) -> torch.Tensor:
        """One optimizer step. ``batch`` is passed to the model as ``model(**batch)`` / ``model(*batch)``;
        a list of batches is a list of micro-batches whose gradients are averaged before the step.
        Returns the loss averaged over micro-batches and data-parallel ranks.

        Under a ``memory_budget`` step ``replan_at`` is measured against its prediction: when the
        measured peak (the maximum over ranks) is over the budget or more than 10% off, the plan is
        made again with the difference held back, the same on every rank (``job.replans``).

        Every rank must call it alike; one that waits on the others longer than ``timeout`` leaves with
        a message naming the rank that failed, stalled or is elsewhere (runtime/watchdog.py)."""
        with watched(self, "step"), stepping(self):
            return self._checked_step(batch)

    def _checked_step(self, batch) -> torch.Tensor:
        plan = self.plan
        if plan.residency_pending:  # offload on CUDA: the first steps' measured peak decides residency
            loss = plan.measure_residency(lambda: self._step(batch))
            if not plan.residency_pending:  # the plan changed: a budgeted plan is checked on the step after
                plan.replan_at = max(plan.replan_at, self.steps + 1)
            return loss
        if plan.budget is not None and self.steps + 1 == plan.replan_at and not isinstance(batch, list):
            from .runtime.memory import measure

            pred = self.predict_memory(batch)["peak"]
            loss, peak = measure(self, lambda: (self._step(batch), self.updater.drain())[0])
            if plan.check(pred, peak, self.steps):
                self.compiler.replan()  # the next step plans again (and compiles only a plan that changed)
            return loss
        return self._step(batch)

    def _step(self, batch) -> torch.Tensor:
        micro = batch if isinstance(batch, list) else [batch]
        if not micro:
            raise ValueError("step([]) got no micro-batches")
        t0, compiled = time.perf_counter(), len(self.compiler.compiles)
        self.executor.comm_bytes = 0
        if self.compiler.written or not self.compiler.programs:
            wait_staged(self)  # the forward writes (or, compiled now, may write) buffers a save is copying
        loss, grads = self.executor.forward_backward(micro, self.compiler.get, self.config.whole_grads)
        first = next(iter(self.compiler.programs.values())).program
        wait_staged(self)
        self.executor.sync_buffers(sorted(self.compiler.written), self.group, self.mesh.dp)
        sent = self.updater.step(dict(zip(self.state.grad_names, grads)), first)
        self.last_comm_bytes = self.executor.comm_bytes + sent
        self.last_step_s = time.perf_counter() - t0
        self.last_compiles = self.compiler.compiles[compiled:]
        self.steps += 1
        return loss.detach()

    def eval_step(self, batch) -> torch.Tensor:
        """Forward only, in eval mode (dropout off): the loss averaged over data-parallel ranks."""
        with watched(self, "eval"):
            return self.executor.run(self.compiler.get(batch, "eval"), batch)[0].detach()

    def synchronize(self) -> None:
        """Wait (on the current stream) for an update still running on a stream of its own
        (``overlap_update``, or the overlapped offload on CUDA). Every method of the job that reads
        the state does this itself; call it before reading ``job.optimizer`` or the shards yourself."""
        self.updater.drain()

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's weights and persistent buffers, keyed as ``model.state_dict()``.

        A collective: every rank must call it. With ``rank0_only`` the other ranks get ``{}``. Parameters are gathered
        one at a time onto the CPU, so the whole model is never on one device."""
        self.updater.drain()
        keep = not rank0_only or dist.get_rank() == 0
        with watched(self, "full_state_dict"):
            return self.state.full_state_dict(self.model, self.group, self.mesh.size("dp"), keep)

    # -- programs ------------------------------------------------------------------------------

    def programs(self) -> list[Program]:
        """The compiled programs, in the order they were compiled."""
        return [c.program for c in self.compiler.programs.values()]

    def compiled(self, batch, mode: str = "step") -> Compiled:
        """The compiled program (and what runs it) for ``batch``: an existing one without the per-step
        agreement of ranks (so introspection on one rank cannot hang), else compiled like a step."""
        return self.compiler.cached(batch, mode)

    # -- predictions and measurements ----------------------------------------------------------

    def predict_step(self, batch) -> dict[str, float]:
        """Predicted step time for ``batch``: the two-lane simulation of the step program — measured
        compute where ``profile_compute`` ran (roofline otherwise), α-β collectives — plus the optimizer
        phase (measured when ``time_optimizer`` was on for a step, else memory-bound roofline)."""
        prog = self.compiled(batch).program
        measured = self.node_times.get(batch_key(batch, "step"))
        tl = self.cost.simulate(prog.gm, measured)
        opt = self.predicted_update_s()
        step = self.cost.step_time(prog.gm, tl, opt, self.update_overlap())
        return {"step_s": step, "graph_s": tl.step_s, "compute_s": tl.compute_s, "optimizer_s": opt,
                "exposed_comm_s": tl.exposed_comm_s, "comm_s": tl.comm_s,
                "compute_source": "roofline" if measured is None else "measured", "timeline": tl}

    def predicted_update_s(self) -> float:
        """The optimizer phase's seconds (measured, or predicted: runtime/update.py)."""
        return self.updater.predicted_s(self.cost.device.bandwidth, self.cost.host)

    def update_overlap(self) -> str | None:
        """How a step's update overlaps the next step: None, "host" (offload), "device" (overlap_update)."""
        return ("host" if self.state.streamer is not None else "device") if self.updater.overlaps_next_step else None

    def predict_memory(self, batch) -> dict[str, int]:
        """Predicted peak bytes on this rank for a step on ``batch`` (one micro-batch), before running it.

        Resident state + the largest of: the graph's simulated live peak; its outputs (the gradients) plus the optimizer
        step's temporaries; zero1/2's gather of the updated shards back into whole weights. See budget.py and
        costmodel/memory.py."""
        from .capture import flatten_batch

        return self.plan.predict(self.compiled(batch).program, flatten_batch(batch)[0])

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: whole weights, master shards, buffers, optimizer state."""
        return self.plan.resident_bytes()

    def profile_compute(self, batch) -> dict[str, float]:
        """Measure each compute node of the step program for ``batch`` on this device (max over ranks; a collective:
        every rank must call it). The cost model uses these times instead of the roofline from then on."""
        from .capture import flatten_batch
        from .runtime.profile import node_times

        compiled = self.compiled(batch)
        inputs = self.executor.inputs(compiled.program, flatten_batch(batch)[0])
        times = node_times(compiled.program.gm, inputs, self.mesh.device, self.agree.ctrl)
        if self.config.executor == "inductor":
            # inductor fuses nodes, so their sum overstates its time: scale every node by the ratio of
            # the compiled program's measured time to that sum (exact at one rank, where the program is
            # all compute; with collectives the compiled time also holds what they expose)
            total, best = sum(times.values()), float("inf")
            rng = torch.get_rng_state()
            for _ in range(2):
                t0 = self.updater.clock(force=True)
                with torch.no_grad():
                    compiled.run(*inputs)
                best = min(best, self.updater.clock(force=True) - t0)
            torch.set_rng_state(rng)
            best = self.agree.max_float(best)
            if total > 0:
                times = {k: t * best / total for k, t in times.items()}
        self.node_times[batch_key(batch, "step")] = times
        return times

    def profile_step(self, batch, trace: str | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Run one real step under torch.profiler: (loss, {step_s, comm_s, exposed_s, exposed_pct});
        ``trace`` saves the chrome trace. Exposed communication: NCCL kernel time not overlapped by
        other kernels on GPUs; time blocked in collective waits on gloo."""
        from .runtime.profile import profiled

        return profiled(lambda: self.step(batch), self.mesh.device, trace)

    def explain(self) -> str:
        """The plan: strategy, mesh, placements, and per compiled program its collectives with bytes,
        predicted time and exposure, and the predicted step (report.py)."""
        from .report import explain

        return explain(self)
