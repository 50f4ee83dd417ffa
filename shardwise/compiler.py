"""The compile driver: capture → passes → hash → agree → executable, one program per batch signature and mode.

For a batch it has not seen (its structure, constants, shapes and dtypes) and a mode (``eval``, or one of passes.MODES),
the compiler traces the single-device step (capture/), rewrites it for the strategy under the memory plan's share of the
budget (passes/pipeline.py), hashes the captured graph and the final plan and has every rank agree on both (DESIGN.md
invariant 2), then builds what runs it (runtime/executor.py). A compile error on one rank is told to the others before
it is raised, so none waits in a collective for it."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import time
import warnings

import torch.distributed as dist
from torch.fx._lazy_graph_module import _use_lazy_graph_module as lazy_graphs

from .capture import batch_signature, capture_step, flatten_batch
from .config import JobConfig
from .passes import ShardContext, shard_step
from .passes.carveout import choose as carveout_settings
from .runtime.executor import Compiled, executable
from .sharding import annotate


def rank_free(code: str, groups: dict[str, str] | None = None) -> str:
    """Graph code without device indices (rank r runs the same plan on ``cuda:r``) and with each process group named
    by its mesh axis (``groups``: group name -> axis): other dp or tp lines run the same plan over their own groups."""
    code = re.sub(r"device\(type='(\w+)', index=\d+\)", r"device(type='\1')", code)
    for name, axis in (groups or {}).items():
        code = code.replace(repr(name), f"<{axis}>")
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
        # the graph reads the device shards in the compute dtype; the fp32 masters are on the host. At one rank nothing
        # is reduced: the gradients stay in the compute dtype and are cast chunk by chunk in the streamed update (the
        # same values; half the device bytes). Not under clipping, whose norm is taken over the master-dtype gradients.
        ctx = dataclasses.replace(ctx, master_dtype=mp.param_dtype,
                                  compute_dtype_grads=dp == 1 and upd.clip_grad_norm is None)
    named = dict(model.named_parameters())
    if off.offload_optimizer or upd.overlap_update:
        # the update of one step may still run when the next starts: its graph waits for each
        # parameter before its first reader (passes/ready.py; no-ops where nothing is pending)
        ctx = dataclasses.replace(ctx, param_ready=frozenset(n for n, p in named.items() if p.requires_grad))
    if mem.keep_gathered is not None:
        if unknown := sorted(mem.keep_gathered - set(named)):
            raise ValueError(f"keep_gathered names parameters the model does not have: {unknown[:5]}")
        ctx = dataclasses.replace(ctx, keep_gathered=mem.keep_gathered)
    return ctx


class TensorParallelAxis:
    """The mesh's tp axis as the compiler partitions for it: its ranks, this rank's coordinate, its
    group, the plan asked for (``tp_plan``), whether the activations between its regions lie in
    sequence shards, and, once the first step is captured, each parameter's placement on it."""

    def __init__(self, ranks: int, rank: int, group, plan, sequence_parallel: bool = False,
                 allow_replicate: bool = False, vocab_parallel: bool | None = None, fuse: str = "auto"):
        self.ranks, self.rank, self.group, self.plan = ranks, rank, group, plan
        self.sequence_parallel, self.allow_replicate = sequence_parallel, allow_replicate
        self.vocab_parallel = vocab_parallel
        self.placements: dict | None = None
        self.gather: str | None = None
        """Which operand products of two shards gather (sharding/propagate.py ``GATHER``), once chosen."""
        self.gather_choice: dict | None = None
        """The cost model's weighing of the two, where their plans differ."""
        self.head_choice: list[dict] = []
        """Megatron's plan: the LM head's predicted step and peak, vocab-parallel and whole, and which was kept."""
        self.fuse, self.fuse_choice = fuse, []
        """``tp_fuse``; each fused-product site of the last program partitioned (passes/fuse_tp.py ``apply``)."""
        self._index: dict[str, object] = {}

    def rank_input(self, name: str, device):
        """The value of a rank input of a tp-local program (passes/tp.py): ``tp_index_<size>`` is this
        rank's indices into a dim of that size, ``tp_index_<size>x<blocks>`` into one cut in blocks."""
        from .sharding import Shard

        if name not in self._index:
            size, _, blocks = name.rsplit("_", 1)[1].partition("x")
            self._index[name] = Shard(0, int(blocks or 1)).indices(int(size), self.rank, self.ranks).to(device)
        return self._index[name]


class ExpertParallelAxis:
    """The mesh's ep axis as the compiler partitions for it (passes/ep.py): its ranks, this rank's
    coordinate, its group and, once the first step is captured, each expert parameter's placement."""

    def __init__(self, ranks: int, rank: int, group, plan=None, capacity: float | str | None = None, split: int = 1):
        self.ranks, self.rank, self.group, self.plan, self.capacity = ranks, rank, group, plan, capacity
        self.split = split
        """Parts each micro-batch is traced as (``JobConfig.ep_split``; "auto" until the first program chose)."""
        self.split_choice: dict[int, float] | None = None
        """Under "auto": the predicted step of the first program traced whole (1) and in halves (2)."""
        self.placements: dict | None = None
        self.factor: float | None = None if capacity in (None, "dropless") else capacity
        """Hugging Face experts' capacity factor (None: dropless), chosen with the first program where
        the user left it open (``capacity`` None: passes/ep.py ``dispatch_choice``)."""
        self.dispatch_choice: dict | None = None
        """That choice: both dispatches' predicted step and graph peak, the room the graph had, which won."""


def expert_parallel_axis(mesh, config: JobConfig) -> ExpertParallelAxis | None:
    """The job's ep axis, or None where the mesh has none; what does not compose with it yet refused."""
    ranks = mesh.size("ep")
    if ranks == 1:
        if config.ep_plan is not None or config.ep_capacity_factor is not None or config.ep_split != 1:
            raise ValueError("ep_plan, ep_capacity_factor and ep_split apply to a mesh with an ep axis, e.g. "
                             "sw.mesh(dp=2, ep=2)")
        return None
    groups = {"offload_optimizer": config.offload, "overlap_update": config.update}
    for name in NOT_WITH_TP:
        if getattr(groups[name], name) not in (None, False):
            raise ValueError(f"{name} does not compose with expert parallelism yet (mesh ep={ranks}): leave it "
                             "off, or use a mesh of dp alone")
    return ExpertParallelAxis(ranks, mesh.rank("ep"), mesh.group("ep"), config.ep_plan, config.ep_capacity_factor,
                              config.ep_split)


NOT_WITH_TP = ("offload_optimizer", "overlap_update")
"""Options that do not compose with tensor parallelism yet."""


def tensor_parallel_axis(mesh, config: JobConfig) -> TensorParallelAxis | None:
    """The job's tp axis, or None where the mesh has none; options that do not compose with it yet refused."""
    ranks = mesh.size("tp")
    if ranks == 1:
        if config.tp_plan is not None:
            raise ValueError("tp_plan applies to a mesh with a tp axis, e.g. sw.mesh(dp=2, tp=2)")
        if config.sequence_parallel:
            raise ValueError("sequence_parallel shards along the tp axis: use a mesh with one, e.g. sw.mesh(tp=2)")
        if config.vocab_parallel is not None:
            raise ValueError("vocab_parallel cuts the LM head over the tp axis: use a mesh with one, e.g. sw.mesh(tp=2)")
        if config.tp_fuse != "auto":
            raise ValueError("tp_fuse fuses products with the tp axis' collectives: use a mesh with one, e.g. sw.mesh(tp=2)")
        return None
    groups = {"offload_optimizer": config.offload, "overlap_update": config.update}
    for name in NOT_WITH_TP:
        if getattr(groups[name], name) not in (None, False):
            raise ValueError(f"{name} does not compose with tensor parallelism yet (mesh tp={ranks}): leave it "
                             "off, or use a mesh of dp alone")
    return TensorParallelAxis(ranks, mesh.rank("tp"), mesh.group("tp"), "megatron" if config.tp_plan is None else config.tp_plan,
                              config.sequence_parallel, config.allow_replicate, config.vocab_parallel,
                              config.tp_fuse)


class Compiler:
    """Compiled programs of one job, by ``(batch signature, mode)``."""

    def __init__(self, model, strategy: str, ctx: ShardContext, agree, plan, device, param_dtype, loss_fn=None,
                 inductor: bool = False, tp: TensorParallelAxis | None = None, on_tp_plan=None):
        self.model, self.strategy, self.ctx = model, strategy, ctx
        self.agree, self.plan, self.device = agree, plan, device
        self.param_dtype, self.loss_fn, self.inductor = param_dtype, loss_fn, inductor
        self.tp, self.on_tp_plan = tp, on_tp_plan
        self.ep: ExpertParallelAxis | None = None
        """The ep axis (passes/ep.py), set by the job; its plan is taken by ``on_tp_plan`` too."""
        self.programs: dict[tuple, Compiled] = {}
        self.replanned: dict[tuple, Compiled] = {}
        """Programs of a plan being made again (a budget's check): kept where the new plan is the same."""
        self.recompiles_avoided = 0
        """Training programs a re-plan made again unchanged (their compiled code kept)."""
        self.written: set[str] = set()
        """Buffers the compiled programs write in place (BatchNorm's statistics): their captures' own."""
        self.compiles: list[tuple[str, str, float]] = []
        """Each compilation: (batch signature, mode, seconds it took on this rank)."""
        self.model_inputs = None
        """What of each batch the model is called with (``JobConfig.model_inputs``)."""
        self.on_compile = None
        """Called as a compilation starts (the watchdog then allows the step longer)."""

    def get(self, batch, mode: str) -> Compiled:
        """The program for this batch and mode, compiled if new; every rank first agrees on the
        batch's signature (a collective: every rank calls it alike)."""
        tensors, consts, spec = flatten_batch(batch)
        sig = batch_signature(spec, consts, tensors)
        self.agree.same(sig, "batch")
        key = (sig, mode)
        if key not in self.programs:
            t0 = time.perf_counter()
            with lazy_graphs(True):  # a graph's code is made when it first runs: candidates never run
                self._compile(key, batch, tensors, mode)
            self.written.update(self.programs[key].program.capture.written_buffers)
            self.compiles.append((sig, mode, time.perf_counter() - t0))
            self._warn_shapes()
        return self.programs[key]

    def _warn_shapes(self) -> None:
        """Each new batch shape compiles a program: at 4 shapes, and at each doubling, say what it costs."""
        n = len({sig for sig, mode, _ in self.compiles if mode != "eval"})
        if n >= 4 and n & (n - 1) == 0 and self.compiles[-1][1] != "eval":
            spent = sum(s for *_, s in self.compiles)
            warnings.warn(
                f"{n} batch shapes compiled so far, {spent:.1f} s of compiling ({self.compiles[-1][2]:.1f} s the "
                "last): every new shape traces, plans and compiles a program of its own. Keep shapes fixed (pad "
                "sequences to one length, drop the last partial batch) or bucket lengths into a few sizes",
                stacklevel=4)

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
        return self.ctx if share is None else dataclasses.replace(self.ctx, graph_budget=share[0], reserve=share[1])

    def _unplanned(self) -> bool:
        """Whether a model-parallel axis (tp, ep) has no placements yet: the first program is compiling."""
        return any(a is not None and a.placements is None for a in (self.tp, self.ep))

    def _partition(self, cap):
        """(The tp-local step (passes/tp.py), its placements, its product policy); the first fixes the plan for all."""
        from .kernels import available
        from .passes import fuse_tp
        from .passes import tp as tp_pass

        tp = self.tp
        placements = tp.placements
        if placements is None:
            plan = tp.plan
            if plan == "megatron":
                if tp.vocab_parallel is None:  # the cost model weighs the head split against it whole
                    weigh, tp.head_choice = tp_pass.head_choice(cap, self.ctx.cost, tp.ranks, tp.group.group_name,
                                                                tp.sequence_parallel, self.ctx.stage,
                                                                tp.allow_replicate)
                else:
                    def weigh(split, whole):
                        return tp.vocab_parallel
                plan = tp_pass.megatron_plan(cap, tp.ranks, weigh)
            placements = tp_pass.seeds_of(cap, plan, tp.ranks)
        args = (cap, placements, tp.ranks, tp.group.group_name, tp.sequence_parallel, self.ctx.stage, tp.allow_replicate)
        if tp.gather is None and tp.sequence_parallel:
            # products of two shards (sequence parallelism's) gather the activation or the smaller
            # operand: the cost model weighs both plans once, and every later program follows
            gather, local, tp.gather_choice = tp_pass.gather_choice(*args[:2], self.ctx.cost, *args[2:])
        else:
            gather = tp.gather or "activation"
            local = tp_pass.partition(*args, gather=gather)[0]
        # products beside their tp collectives fused (ring or Triton kernels) where predicted faster;
        # the kernels' symmetric workspace is not in the memory plan yet, so not under a budget
        if tp.fuse == "kernel" and self.plan.budget is not None:
            raise ValueError("tp_fuse='kernel': the kernels' symmetric-memory workspace is not in the memory plan "
                             "yet, so it cannot run under memory_budget; use tp_fuse='ring' or 'auto', or no budget")
        kernel = available(self.device) and self.plan.budget is None and (
            tp.fuse == "kernel" or dist.get_backend(tp.group) == "nccl")
        tp.fuse_choice = fuse_tp.apply(local, tp.fuse, self.ctx.cost, kernel)
        return local, placements, gather

    def _traced_ep(self, batch, train: bool, tensors):
        """(The ep-local step of Hugging Face experts traced through ``hf_forwards``, the placements); its
        dispatch the user's or, left open, ``dispatch_choice``'s by the room the graph has. With a tp axis its
        last step (the ZeRO of the other parameters over ep, the means over ep) waits for the tp partition."""
        from .passes import ep as ep_pass

        ep = self.ep

        def trace(factor):
            forwards, shapes, counts = ep_pass.hf_forwards(self.model, ep.ranks, ep.rank, ep.group, ep.plan, factor)
            cap = capture_step(self.model, batch, loss_fn=self.loss_fn, model_inputs=self.model_inputs,
                               param_dtype=self.param_dtype, train=train, with_grads=train, device=self.device,
                               forwards=forwards, shapes=shapes, split=ep.split)
            return ep_pass.finish_traced(cap, counts, ep.ranks, ep.group.group_name, self.ctx.stage, factor,
                                         shard_shared=self.strategy != "ddp", split=ep.split, local=self.tp is None)

        if ep.capacity is not None or ep.dispatch_choice is not None:
            return trace(ep.factor)
        counts = ep_pass.hf_forwards(self.model, ep.ranks, ep.rank, ep.group, ep.plan)[2]
        shapes = self.plan.state.shapes
        total = sum(s.numel() for s in shapes.values()) or 1
        experts = sum(shapes[n].numel() for n in counts if n in shapes)
        room = self.plan.graph_room(tensors, 1 - experts / total * (1 - 1 / ep.ranks))
        result, ep.dispatch_choice = ep_pass.dispatch_choice(trace, self.ctx.cost, room)
        ep.factor = ep.dispatch_choice["factor"]
        return result

    def _agree(self, prog) -> None:
        """The captured single-device graph and the final plan (the rewritten, bucketed, scheduled
        program, whose node order is the order of collectives) must be the same on every rank."""
        groups = {self.ctx.group: "dp", **({self.tp.group.group_name: "tp"} if self.tp else {}),
                  **({self.ep.group.group_name: "ep"} if self.ep else {})}
        cap_hash = hashlib.sha256(rank_free(prog.capture.gm.code, groups).encode()).hexdigest()[:16]
        plan_hash = hashlib.sha256(rank_free(prog.gm.code, groups).encode()).hexdigest()[:16]
        self.agree.same(f"capture {cap_hash} plan {plan_hash}", "graph")
        prog.hashes = {"capture": cap_hash, "plan": plan_hash}

    def _told(self, fn):
        """``fn()``; where it raises, the other ranks are told before it is raised here, so that none
        waits for this one in a collective (this rank's own error says more than the disagreement)."""
        try:
            return fn()
        except Exception as e:
            with contextlib.suppress(RuntimeError):
                self.agree.same(f"compile error on this rank: {type(e).__name__}: {e}", "graph")
            raise

    def _compile(self, key, batch, tensors, mode: str) -> None:
        train = mode != "eval"
        if self.on_compile is not None:
            self.on_compile()

        def first():
            from .passes import ep as ep_pass

            traced_ep = self.ep is not None and bool(ep_pass.hf_experts(self.model, self.ep.plan))
            if self.ep is not None and self.ep.capacity is not None and not traced_ep:
                raise ValueError("ep_capacity_factor applies to Hugging Face experts; the built-in MoE takes its "
                                 "capacity from its config (capacity_factor=...)")
            placements, gather = {}, None  # by axis
            if traced_ep:  # experts split as traced (Hugging Face's)
                cap, placements["ep"] = self._traced_ep(batch, train, tensors)
            else:
                cap = capture_step(self.model, batch, loss_fn=self.loss_fn, model_inputs=self.model_inputs,
                                   param_dtype=self.param_dtype, train=train, with_grads=train, device=self.device,
                                   split=self.ep.split if self.ep is not None else 1)
            if self.tp is not None:
                cap, placements["tp"], gather = self._partition(cap)
            elif annotate.strip(cap.gm.graph):  # sw.shard marks mean nothing without a tp axis
                cap.gm.recompile()
            if traced_ep and self.tp is not None:  # the traced split's last step, on the tp-local step
                cap, placements["ep"] = ep_pass.finish_local(cap, placements["ep"], self.ep.ranks,
                                                             self.ep.group.group_name, self.ctx.stage,
                                                             self.strategy != "ddp", self.ep.split)
            if self.ep is not None and not traced_ep:  # experts split by the graph's rewrite (of the tp-local step)
                # the other parameters (their tp shards) cut over ep too: ZeRO over dp x ep
                cap, placements["ep"] = ep_pass.partition(cap, self.ep.ranks, self.ep.group.group_name, self.ctx.stage,
                                                          self.ep.plan, shard_shared=self.strategy != "ddp",
                                                          split=self.ep.split)
            if self.ep is not None and self.ep.placements not in (None, placements["ep"]):
                raise ValueError(f"the parameters split over ep in this batch's graph ({sorted(placements['ep'])}) "
                                 f"are not those of the first step's ({sorted(self.ep.placements)})")
            # the first tp (ep) program under a budget is planned again once the state holds its shards
            # (below): the one every rank agrees on first needs no budget's search
            first_tp = bool(placements) and self._unplanned()
            ctx = self.ctx if first_tp and self.plan.budget is not None else self._context(tensors, train)
            return cap, placements, gather, shard_step(cap, self.strategy, ctx, "step" if mode == "eval" else mode)

        ep = self.ep
        if ep is not None and ep.split == "auto":  # whole and in halves (where the rows split): the faster kept
            tried = {}
            for k in (1, 2) if next((t.shape[0] for t in tensors if t.dim()), 1) % 2 == 0 else (1,):
                ep.split = k
                tried[k] = self._told(first)
            ep.split_choice = {k: self.ctx.cost.estimate(r[3].gm)[0] for k, r in tried.items()}
            ep.split = min(ep.split_choice, key=ep.split_choice.get)
            # the tp partition keeps its choices (fusion) on the axis: the winner traced again where it was not last
            cap, placements, gather, prog = self._told(first) if self.tp and ep.split != k else tried[ep.split]
        else:
            cap, placements, gather, prog = self._told(first)
        self._agree(prog)
        if placements and self._unplanned():
            # the first program compiled on every rank: the state takes its tp shards only now, so
            # a refused job leaves the model whole
            self.on_tp_plan(placements, gather)
            if train and self.plan.budget is not None:
                # the budget's share was taken from the whole state: plan again from the tp shards'
                prog = self._told(lambda: shard_step(cap, self.strategy, self._context(tensors, train), mode))
                self._agree(prog)
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
