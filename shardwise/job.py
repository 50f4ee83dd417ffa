"""``shardwise.compile``: capture → shard → run. The public entry point and the compiled job."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .capture import batch_signature, capture_step, flatten_batch
from .capture.trace import signature_hash
from .passes import STRATEGIES, Program, ShardContext, _emit, shard_step
from .passes.zero import layouts_for
from .runtime.mesh import Mesh, mesh as make_mesh
from .runtime.state import ShardedState, optimizer_kind

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


def _dtype(x, what: str) -> torch.dtype | None:
    if x is None or isinstance(x, torch.dtype):
        return x
    if isinstance(x, str) and x in _DTYPES:
        return _DTYPES[x]
    raise ValueError(f"MixedPrecision.{what}: expected a torch.dtype or one of {sorted(_DTYPES)}, got {x!r}")


@dataclass(frozen=True)
class MixedPrecision:
    """Precision policy, as FSDP2's ``MixedPrecisionPolicy``: master weights stay in their dtype."""

    param_dtype: torch.dtype | str | None = None
    """dtype parameters are gathered and computed in (e.g. ``torch.bfloat16``); None: their own dtype."""
    reduce_dtype: torch.dtype | str | None = torch.float32
    """dtype gradients are reduced in; None: the compute dtype."""

    def __post_init__(self):
        object.__setattr__(self, "param_dtype", _dtype(self.param_dtype, "param_dtype"))
        object.__setattr__(self, "reduce_dtype", _dtype(self.reduce_dtype, "reduce_dtype"))


def _rank_free(code: str) -> str:
    """Graph code without device indices: rank r runs the same plan on ``cuda:r``."""
    code = re.sub(r"device\(type='(\w+)', index=\d+\)", r"device(type='\1')", code)
    return re.sub(r"'(cuda|xpu|hpu):\d+'", r"'\1'", code)


EXECUTORS = (None, "fx", "inductor")
"""What runs the rewritten graph: the FX GraphModule (None or "fx"), or inductor's compiled code."""


def compile(
    model: nn.Module,
    optimizer: Callable | None = None,
    strategy: str = "zero3",
    mesh: Mesh | None = None,
    *,
    loss_fn: Callable | None = None,
    mixed_precision: MixedPrecision | None = None,
    clip_grad_norm: float | None = None,
    compile: str | None = None,
    bucket_mb: float = 25.0,
    shard_bucket_mb: float | str | None = "auto",
    schedule: bool = True,
    max_in_flight_mb: float | None = None,
    max_in_flight_ops: int | None = None,
    memory_budget: int | float | None = None,
    keep_gathered=None,
    offload_optimizer: bool | str = False,
    offload_chunk_mb: float = 64,
    offload_overlap: bool = True,
    offload_host_update: bool | float | str = "auto",
    recompute: bool = False,
    offload_activations: bool = False,
    fused_optimizer: bool | None = None,
    overlap_update: bool = False,
    matmul_sm_carveout: int | str | None = "auto",
    link_profile=None,
) -> "Job":
    """Compile a single-device model and optimizer into a sharded training job.

    ``optimizer`` is a factory called with ``(name, tensor)`` pairs of this rank's trainable state
    (shards under zero1-3), like ``model.named_parameters()`` yields them, so groups can be built by
    name. The model's forward must return the loss (a scalar, or an object with ``.loss``), or pass
    ``loss_fn(outputs, batch)``. ``clip_grad_norm`` clips the global gradient norm (over every shard
    on every rank) as ``torch.nn.utils.clip_grad_norm_`` does on one device. ``bucket_mb`` closes
    ddp's all-reduce buckets; ``shard_bucket_mb`` the zero all-gather/reduce-scatter buckets ("auto", the
    default: the size the cost model predicts fastest without raising the predicted peak by more
    than 10%; 0: one collective per parameter; None: twice the largest parameter). ``link_profile`` is a preset name,
    a JSON file from ``shardwise calibrate`` or a ``LinkProfile``, for ``explain``. ``schedule``
    (on by default) reorders collectives for latency hiding (passes/schedule.py) under a cap of
    ``max_in_flight_mb`` (default: of 2, 4, 8 and 16 times the largest collective, the smallest the
    cost model predicts within 2% of the fastest, within 10% of the peak the bucket choice started
    from, and under a
    memory budget within the budget; with one collective at a time, twice the largest) and
    ``max_in_flight_ops`` collectives started and not yet waited for (default: no cap; on gloo
    always one).
    ``memory_budget`` (bytes, or a fraction of what this process may use on its device) makes the
    plan fit: under zero3 the parameters that fit stay gathered from forward to backward (no
    backward all-gather; passes/unshard.py); a step that cannot fit raises ``BudgetError`` with the
    numbers before anything runs. ``keep_gathered`` forces that decision for the named parameters.
    ``offload_optimizer`` (zero3) keeps master shards and optimizer state in host memory and streams
    them through the device for the update, ``offload_chunk_mb`` at a time (runtime/offload.py):
    True keeps on the device the part of the state that fits beside the step (under
    ``memory_budget``, or on CUDA what the process may use; each byte kept there is a byte not moved
    each way per step); ``"all"`` keeps all of it on the host. On CUDA the update runs on its own
    streams and the next step starts before it ends, each parameter's first reader waiting for that
    parameter (passes/ready.py); ``offload_overlap=False`` makes each step wait for the whole update.
    ``offload_host_update`` updates part of the offloaded state on the host's cores instead (Adam,
    AdamW: only gradients and compute weights cross the link): ``"auto"`` (default) lets the cost
    model split it on CUDA by the measured host update rate and host link (none on CPU, whose
    "host" is the device); a number in (0, 1] forces that share of the offloaded bytes; False: none.
    ``recompute`` recomputes cheap elementwise activations in the backward instead of keeping them
    (passes/recompute.py); ``offload_activations`` keeps every activation the backward reads in host
    memory between forward and backward, copied out and back on a stream of their own
    (passes/actoffload.py). A budget turns each on when needed, recomputation first, then offload
    of the largest activations. ``fused_optimizer`` runs the update with torch's fused kernel (one
    pass over parameter, gradient and state; the multi-tensor path moves about three times the bytes
    for AdamW): None (default) does so on CUDA for an Adam, AdamW or SGD built without ``foreach`` or
    ``fused``; True requires it; False runs the optimizer as the factory built it.
    ``overlap_update`` (zero3, state on the device) updates the parameters in chunks in forward order
    and, on CUDA, on a stream of its own: the step returns before the update ends and the next step's
    graph waits for each parameter where it first reads it (passes/ready.py), so its forward starts
    while later chunks are updated. Off by default: on the 8B shape on two H200s it took 0.4% off
    the step (0.7758 against 0.7790 s, one sitting). The forward's matrix-product kernels hold every
    SM whole (one block of 384 threads and 213 KB shared memory per SM), so the update's kernels
    take turns with them rather than running beside them; they hide only in the forward's idle time,
    and the step prediction counts them so. Inductor's atomic accumulations (the embedding's
    gradient) may round differently when the update shares the GPU; with
    ``torch.use_deterministic_algorithms(True)`` the overlapped steps match the plain ones bit for bit.
    The optimizer's ``step`` then runs once per chunk (step hooks fire each time), and the predicted
    peak does not count the gradients the update holds into the next step's forward.
    ``matmul_sm_carveout`` (CUDA) makes the matrix products the cost model predicts to run beside a
    collective (and to take at least 20 µs) leave SMs free, so the collective's kernels run beside
    them rather than after them (passes/carveout.py; cuBLASLt's SM-count target, through torch's
    experimental carveout). It pays for jobs whose gathers outlast the compute between them (an
    MoE's experts): there a product that takes every SM holds the next gather back. ``"auto"`` (the
    default): the cost model simulates the step with and without carving 32 SMs (what NCCL's
    kernels need on an H200), SM contention included, and carves only if that is predicted at least
    2% faster. It carves only over NCCL, with ``schedule`` on, on NVIDIA GPUs from Hopper on with
    more than 64 SMs and a torch that has the carveout (it was measured on H200s). On two H200s it
    carved the Mixtral-shape MoE (4.1-4.2% faster than every SM) and left the 8B shape whole (24 SMs
    carved had measured 0.9% slower there). A number carves that many SMs wherever a product runs
    beside a collective (on CPU too, where it does nothing); ``None`` keeps every SM for the products.

    Example::

        >>> import torch, shardwise as sw
        >>> model = sw.models.build("gpt", "tiny")
        >>> job = sw.compile(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        ...                  strategy="zero3", mesh=sw.mesh(dp=1))
        >>> x = torch.randint(0, 64, (2, 16))
        >>> float(job.step((x, x))) > 0
        True
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if compile not in EXECUTORS:
        raise ValueError(f"compile={compile!r} is not supported: choose one of {EXECUTORS}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is None:
        optimizer = lambda params: torch.optim.AdamW(params, lr=3e-4)  # noqa: E731
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer= takes a factory, not an optimizer built on the full parameters: "
            "pass e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)"
        )
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be a positive number (or None for no clipping), got {clip_grad_norm!r}")
    if shard_bucket_mb is not None and shard_bucket_mb != "auto" and not (
            isinstance(shard_bucket_mb, (int, float)) and shard_bucket_mb >= 0):
        raise ValueError(f"shard_bucket_mb must be 'auto', None or a number >= 0, got {shard_bucket_mb!r}")
    if max_in_flight_ops is not None and (not isinstance(max_in_flight_ops, int) or max_in_flight_ops < 1):
        raise ValueError(f"max_in_flight_ops must be a positive int or None, got {max_in_flight_ops!r}")
    if max_in_flight_mb is not None and not max_in_flight_mb > 0:
        raise ValueError(f"max_in_flight_mb must be positive or None, got {max_in_flight_mb!r}")
    if mesh is None:
        mesh = make_mesh()
    sm_carveout = _sm_carveout(matmul_sm_carveout, mesh.device, dist.get_backend(mesh.group), bool(schedule))
    if offload_optimizer not in (False, True, "all"):
        raise ValueError(f"offload_optimizer must be False, True (keep what fits on the device) or 'all', "
                         f"got {offload_optimizer!r}")
    if not offload_chunk_mb > 0:
        raise ValueError(f"offload_chunk_mb must be positive, got {offload_chunk_mb!r}")
    if offload_optimizer and strategy != "zero3":
        raise ValueError(f"offload_optimizer is built for zero3 so far, not {strategy}: use strategy='zero3'")
    if overlap_update and (strategy != "zero3" or offload_optimizer):
        raise ValueError("overlap_update is built for zero3 with the optimizer state on the device "
                         f"(strategy={strategy!r}, offload_optimizer={offload_optimizer!r}); offload_optimizer "
                         "overlaps its own update (offload_overlap)")
    if fused_optimizer not in (None, True, False):
        raise ValueError(f"fused_optimizer must be None (fuse where torch can, on CUDA), True or False, "
                         f"got {fused_optimizer!r}")
    if offload_host_update is True:
        offload_host_update = 1.0
    if not (offload_host_update in ("auto", False) or (
            isinstance(offload_host_update, (int, float)) and 0 < offload_host_update <= 1)):
        raise ValueError(f"offload_host_update must be 'auto', False, True or a share in (0, 1] of the "
                         f"offloaded state to update on the host, got {offload_host_update!r}")
    job = Job(model, optimizer, strategy, mesh, loss_fn, mixed_precision or MixedPrecision(), compile, bucket_mb,
              clip_grad_norm, shard_bucket_mb, schedule, max_in_flight_mb, max_in_flight_ops, offload_optimizer,
              offload_chunk_mb, offload_overlap, fused_optimizer, overlap_update)
    job.host_update = offload_host_update
    job.link_profile = link_profile
    job.memory_budget = _budget_bytes(memory_budget, mesh.device)
    if keep_gathered is not None:
        if strategy != "zero3":
            raise ValueError(f"keep_gathered applies to zero3 (every parameter is gathered), not {strategy}")
        unknown = sorted(set(keep_gathered) - set(job.layouts))
        if unknown:
            raise ValueError(f"keep_gathered names parameters the model does not have: {unknown[:5]}")
        job.ctx = dataclasses.replace(job.ctx, keep_gathered=frozenset(keep_gathered))
    if recompute:
        job.ctx = dataclasses.replace(job.ctx, recompute=True)
    if offload_activations:
        job.ctx = dataclasses.replace(job.ctx, offload_activations=True)
    if sm_carveout:
        job.ctx = dataclasses.replace(job.ctx, sm_carveout=sm_carveout)
    return job


CARVE_MIN_S = 20e-6
"""Products predicted shorter than this keep every SM (a carved call costs ~10 µs on the host)."""


def _sm_carveout(sms, device: torch.device, backend: str = "nccl", schedule: bool = True):
    """``matmul_sm_carveout`` checked, as the carveout pass's settings (passes/carveout.py)."""
    from .passes.carveout import COMM_SMS, SMCarveout

    if sms is None:
        return None
    auto = isinstance(sms, str) and sms == "auto"
    if not auto and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
        raise ValueError(f"matmul_sm_carveout must be a positive number of SMs (e.g. 32, what NCCL's kernels "
                         f"need on an H200), 'auto' (the cost model decides) or None, got {sms!r}")
    if device.type != "cuda":
        # gloo's collectives take no SMs: "auto" never carves; a number carves, inert, to show the pass at work
        return None if auto else SMCarveout(sms, 0)
    if auto and (backend != "nccl" or not schedule or torch.version.hip is not None):
        # gloo's collectives run on the host; the unscheduled baseline keeps every choice at its plain
        # setting; the contention model was measured on NVIDIA's cuBLAS and NCCL
        return None
    if not (hasattr(torch._C, "_set_sm_carveout_experimental") and hasattr(torch.backends.cuda, "preferred_blas_library")):
        if auto:
            return None
        raise ValueError(f"matmul_sm_carveout needs torch's experimental SM carveout and cuBLASLt, which torch "
                         f"{torch.__version__} does not have: leave it at None")
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    total = props.multi_processor_count
    if auto:
        # measured on Hopper, whose persistent products hold every SM; a GPU of 2 x COMM_SMS SMs or
        # fewer would give the collective half of them or more
        return SMCarveout(COMM_SMS, total, CARVE_MIN_S, auto=True) if props.major >= 9 and total > 2 * COMM_SMS else None
    if sms >= total:
        raise ValueError(f"matmul_sm_carveout={sms} leaves no SM to the products: this device has {total}; "
                         f"pass fewer (NCCL's kernels take 16-32)")
    return SMCarveout(sms, total, CARVE_MIN_S)


def _budget_bytes(budget, device: torch.device) -> int | None:
    """``memory_budget`` in bytes: an int is bytes; a float in (0, 1] a fraction of what the process
    may use — on CUDA the device memory times ``torch.cuda.set_per_process_memory_fraction``'s
    fraction, on CPU the machine's physical memory."""
    import os

    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes or a fraction in (0, 1], got {budget!r}")
    if isinstance(budget, int):
        return budget
    if budget > 1:
        raise ValueError(f"memory_budget={budget!r}: a float is a fraction of device memory and must be <= 1; "
                         "pass bytes as an int")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        frac = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(index)
        return int(total * frac * budget)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * budget)


def _choices(rows) -> str:
    """A cost-model choice's rows (size, predicted s, predicted peak, chosen) as ``explain`` prints them."""
    return "; ".join(f"{'*' if c else ''}{b / 2**20:.2f} MiB -> {t * 1e3:.2f} ms, peak {pk / 2**20:.1f} MiB"
                     for b, t, pk, c in rows)


class Job:
    """A compiled training job. Build it with :func:`shardwise.compile`."""

    def __init__(self, model, optimizer, strategy, mesh, loss_fn, mp, compile_mode, bucket_mb, clip_grad_norm=None,
                 shard_bucket_mb="auto", schedule=True, max_in_flight_mb=None, max_in_flight_ops=None,
                 offload_optimizer=False, offload_chunk_mb=64, offload_overlap=True, fused_optimizer=None,
                 overlap_update=False):
        self.model = model
        self.strategy = strategy
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.mp = mp
        self.compile_mode = None if compile_mode == "fx" else compile_mode
        self.ws, self.rank = mesh.dp, mesh.rank
        self.group = mesh.group
        # control messages (shape agreement, hashes) travel over gloo even when the data is on NCCL
        self.ctrl = self.group if dist.get_backend(self.group) == "gloo" else dist.new_group(backend="gloo")
        self.ctx = ShardContext(
            ws=self.ws,
            group=mesh.group_name,
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype if mp.param_dtype is not None else None,
            bucket_bytes=int(bucket_mb * 2**20),
            shard_bucket_bytes=shard_bucket_mb if shard_bucket_mb in (None, "auto") else int(shard_bucket_mb * 2**20),
            estimate=self._estimate,
            node_time=self._node_time,
            comm_time=self._comm_time,
            fetch_time=lambda nbytes: nbytes / self.host_link().h2d,
            schedule=schedule,
            max_in_flight=None if max_in_flight_mb is None else int(max_in_flight_mb * 2**20),
            # gloo: one at a time (see ShardContext.max_ops_in_flight)
            max_ops_in_flight=1 if dist.get_backend(self.group) == "gloo" else max_in_flight_ops,
            stage=self._stage(),
        )
        if offload_optimizer and mp.param_dtype is not None:
            # the graph reads the device shards in the compute dtype; the fp32 masters are on the host.
            # At one rank nothing is reduced: the gradients stay in the compute dtype and are cast
            # chunk by chunk in the streamed update (the same values; half the device bytes). Not
            # under clipping, whose norm is taken over the master-dtype gradients.
            self.ctx = dataclasses.replace(self.ctx, master_dtype=mp.param_dtype,
                                           compute_dtype_grads=self.ws == 1 and clip_grad_norm is None)
        self._check_model_device()
        self._broadcast_initial_state()
        named = list(model.named_parameters())
        self.layouts = layouts_for([n for n, _ in named], [p.shape for _, p in named], 1 if strategy == "ddp" else self.ws)
        self.state = ShardedState(model, strategy, self.layouts, self.rank, optimizer, mp.param_dtype,
                                  offload=bool(offload_optimizer), offload_chunk_bytes=int(offload_chunk_mb * 2**20),
                                  offload_overlap=offload_overlap, fused=fused_optimizer)
        self.offload_all = offload_optimizer == "all"
        self.overlap_update = bool(overlap_update)
        self._upd = None  # CUDA: the stream an overlapped on-device update runs on
        self._update_chunks: list[list[str]] | None = None
        self._ready_names: set[str] = set()
        if self.state.streamer is not None or self.overlap_update:
            # the update of one step may still run when the next starts: its graph waits for each
            # parameter before its first reader (passes/ready.py; no-ops where nothing is pending)
            self.ctx = dataclasses.replace(self.ctx, param_ready=frozenset(self.state.grad_names))
        if self.overlap_update:
            if mesh.device.type == "cuda":
                opt = self.state.optimizer
                if any(isinstance(g.get("lr"), torch.Tensor) for g in opt.param_groups):
                    raise ValueError("overlap_update: the optimizer's lr is a tensor, which a scheduler would "
                                     "change while the update still reads it; give lr as a float")
                self._upd = torch.cuda.Stream(mesh.device)
                # the optimizer's state is written on that stream: saving or loading it waits for it
                opt.register_state_dict_pre_hook(lambda *_: self._drain())
                opt.register_load_state_dict_pre_hook(lambda *_: self._drain())
        self.optimizer = self.state.optimizer
        self.buffers = dict(model.named_buffers())
        self._programs: dict[tuple, tuple[Program, Callable]] = {}
        # programs of a plan made again (a budget's check): reused where the new plan is the same code
        self._replanned: dict[tuple, tuple[Program, Callable]] = {}
        self.clip_grad_norm = clip_grad_norm
        self.link_profile = None  # a LinkProfile, a preset name or a JSON path from `shardwise calibrate`
        self.last_comm_bytes = 0
        self.last_grad_norm: torch.Tensor | None = None
        self.steps = 0
        self.memory_budget: int | None = None
        self.replan_at = 2  # the step whose measured peak checks a budgeted plan
        self.replans: list[dict] = []
        self.recompiles_avoided = 0  # training programs a re-plan made again unchanged (compiled code kept)
        self._memory_slack = 0  # bytes the memory model under-predicted, learned from a measured step
        self.time_optimizer = False  # set to time the optimizer phase of each step (syncs the GPU)
        self.last_optimizer_s: float | None = None
        self._node_times: dict[tuple, dict[str, float]] = {}
        self.host_update: bool | float | str = "auto"  # offload: the share updated on the host (see compile)
        # offload on CUDA: steps left to measure before the measured peak decides residency (0: none)
        self._residency_pending = 0
        self.residency_peak: int | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def _stage(self) -> str | None:
        """gloo moves only host tensors reliably: ranks on a GPU over gloo stage collectives on the CPU."""
        if dist.get_backend(self.group) == "gloo" and self.mesh.device.type != "cpu":
            return "cpu"
        return None

    def _check_model_device(self):
        devs = {p.device for p in self.model.parameters()} | {b.device for b in self.model.buffers()}
        bad = [d for d in devs if d.type != self.mesh.device.type]
        if bad:
            raise ValueError(
                f"the model's tensors are on {sorted(map(str, devs))} but the mesh runs on {self.mesh.device}; "
                f"move the model first: model.to({str(self.mesh.device)!r})"
            )

    @torch.no_grad()
    def _broadcast_initial_state(self):
        """Every rank starts from rank 0's weights and buffers, as DDP does."""
        if self.ws == 1:
            return
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(t.data, src=dist.get_global_rank(self.group, 0), group=self.group)

    # -- compilation ----------------------------------------------------------------------------

    def _agree(self, sig: str, what: str) -> None:
        """All ranks hold the same ``sig`` (a batch signature or a graph hash), or all raise."""
        if self.ws == 1:
            return
        mine = torch.tensor([signature_hash(sig)], dtype=torch.int64)
        allh = [torch.empty_like(mine) for _ in range(self.ws)]
        dist.all_gather(allh, mine, group=self.ctrl)
        if all(bool(h == allh[0]) for h in allh):
            return
        descs: list[Any] = [None] * self.ws
        dist.all_gather_object(descs, sig[:400], group=self.ctrl)
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(descs):
            groups.setdefault(d, []).append(r)
        detail = "; ".join(f"ranks {rs}: {d}" for d, rs in groups.items())
        if what == "batch":
            raise ValueError(
                f"batch shapes differ across ranks ({detail}). Every rank must pass a batch with the same "
                "structure, shapes and dtypes in each step: pad, or drop the last partial batch."
            )
        raise RuntimeError(f"the compiled {what} differs across ranks ({detail}); every rank must compile the same plan")

    def _program(self, batch, mode: str) -> tuple[Program, Callable]:
        """The compiled program for this batch's signature; ``mode`` is ``eval`` or one of passes.MODES."""
        tensors, consts, spec = flatten_batch(batch)
        sig = batch_signature(spec, consts, tensors)
        self._agree(sig, "batch")
        key = (sig, mode)
        train = mode != "eval"
        if key not in self._programs:
            try:
                cap = capture_step(
                    self.model,
                    batch,
                    loss_fn=self.loss_fn,
                    param_dtype=self.mp.param_dtype,
                    train=train,
                    with_grads=train,
                    device=self.mesh.device,
                )
                prog = shard_step(cap, self.strategy, self._budgeted_ctx(tensors, train),
                                  "step" if mode == "eval" else mode)
            except Exception as e:
                # tell the other ranks before raising, so that none waits for this one in a collective;
                # this rank's own error says more than the disagreement, so it is the one raised here
                try:
                    self._agree(f"compile error on this rank: {type(e).__name__}: {e}", "graph")
                except RuntimeError:
                    pass
                raise
            # the captured single-device graph and the final plan (the rewritten, bucketed, scheduled
            # program, whose node order is the order of collectives) must be the same on every rank
            cap_hash = hashlib.sha256(_rank_free(prog.capture.gm.code).encode()).hexdigest()[:16]
            plan_hash = hashlib.sha256(_rank_free(prog.gm.code).encode()).hexdigest()[:16]
            self._agree(f"capture {cap_hash} plan {plan_hash}", "graph")
            prog.hashes = {"capture": cap_hash, "plan": plan_hash}
            old = self._replanned.pop(key, None)
            if old is not None and old[0].hashes == prog.hashes:
                # the plan made again is the same program (hashes agreed on every rank, so every rank
                # decides alike): keep its compiled code rather than compiling it again
                self._programs[key] = old
                self.recompiles_avoided += mode != "eval"  # eval programs ignore the budget: always kept
            else:
                self._programs[key] = (prog, self._executor(prog))
            if mode == "step":
                self._plan_residency(self._programs[key][0], tensors)
        return self._programs[key]

    def _residency_budget(self) -> int | None:
        """Device bytes the offloaded optimizer may fill: ``memory_budget``, else (CUDA) what this
        process may use; None on CPU without a budget (everything stays in the host pool)."""
        if self.memory_budget is not None:
            return self.memory_budget
        if self.mesh.device.type == "cuda":
            return _budget_bytes(0.95, self.mesh.device)  # room for the allocator's rounding
        return None

    def _plan_residency(self, prog: Program, tensors) -> None:
        """Under offload, keep on the device the optimizer state that fits beside the step: each byte
        kept there is a byte less to move each way per step. On CUDA the first step runs with all of
        it on the host and its measured peak (the maximum over ranks) decides (``_fit_residency``):
        a step that ran out of memory would be lost, a measured one cannot be wrong. On CPU, where the
        host pool is the same memory, the prediction decides (the same code path, for the tests)."""
        st = self.state.streamer
        budget = self._residency_budget()
        if st is None:
            return
        if budget is None or self.offload_all:
            self._plan_host()
            return
        self._drain()
        st.set_resident(())
        prog.resident_state = []
        if self.mesh.device.type == "cuda":
            # with the update overlapped, the second step runs beside the first one's update: measure both
            self._residency_pending = 2 if st.overlap else 1
            return
        self._fit_residency(self._memory(prog, tensors)["peak"], lambda: self._memory(prog, tensors)["peak"])
        prog.resident_state = sorted(st.resident)

    def _plan_host(self) -> None:
        """Which offloaded parameters the host updates (``host_update``; runtime/offload.plan_host). The
        host update rate is measured on every rank and the slowest counts, so every rank, holding
        shards of the same shapes, makes the same split."""
        st = self.state.streamer
        if st is None or self.host_update is False:
            return
        if st.grad_dtype is None:  # the host's gradient buffers are made with the plan: in the step's dtype
            for (_, mode), (prog, _) in self._programs.items():
                if mode == "step":
                    outs = prog.gm.graph.find_nodes(op="output")[0].args[0][1:]
                    vals = [getattr(o, "meta", {}).get("val") for o in outs]
                    dts = [v.dtype for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()]
                    st.grad_dtype = dts[0] if dts else None
                    break
        if self.host_update != "auto":
            st.plan_host(self.host_link(), fraction=float(self.host_update))
        elif self.mesh.device.type == "cuda" and st.sliced:
            if st.host_rate is None:
                (per,) = self._max_over_ranks(int(1e15 / st.measure_host_rate()))  # fs per element
                st.host_rate = 1e15 / per
            st.plan_host(self.host_link(), rate=st.host_rate)
        self.last_optimizer_s = None  # the update changed: measure it again

    def _fit_residency(self, peak: int, check: Callable[[], int] | None = None, measured: bool = False) -> None:
        """Greedy over parameters in order: keep the state of each one that fits in the budget left
        above ``peak`` (the step's peak with nothing resident); with ``check`` (the predicted peak of
        the current choice), drop the last taken until it fits. Every rank holds shards of the same
        shapes and gets the same ``peak``, so every rank makes the same choice. A ``measured`` peak of
        overlapped steps already holds what the running update keeps; a predicted one does not.

        Keeping state resident only shortens the update, so the gradients it holds while the next step
        runs can only be freed sooner: the peak measured with nothing resident bounds the rest."""
        st = self.state.streamer
        self._drain()  # the state moves: no update may be running
        budget = self._residency_budget()
        left = budget - self._memory_slack - peak
        if st.overlap and not measured:
            # the next graph runs while the update still holds the gradients and its temporaries
            grads = max((self._liveness(prog).outputs for (_, mode), (prog, _) in self._programs.items()
                         if mode == "step"), default=0)
            left -= grads + st.transient_bytes()
        keep = []
        for n in st.params:
            b = st.param_bytes(n)
            if b <= left:
                keep.append(n)
                left -= b
        st.set_resident(keep)
        while keep and check is not None and check() + self._memory_slack > budget:
            keep.pop()
            st.set_resident(keep)
        for (_, mode), (prog, _) in self._programs.items():
            if mode == "step":
                prog.resident_state = sorted(keep)
        self._plan_host()

    def _budgeted_ctx(self, tensors, train: bool) -> ShardContext:
        """The pass context, with the graph's share of ``memory_budget`` when one is set."""
        if self.memory_budget is None or not train:
            return self.ctx
        from .passes.unshard import BudgetError

        st = self.state.streamer
        held = sum(self.resident_bytes().values()) - (st.device_bytes() if st is not None else 0)
        held += sum(t.numel() * t.element_size() for t in tensors if t.device == self.mesh.device)
        left = self.memory_budget - held - self._memory_slack
        if left <= 0:
            raise BudgetError(
                f"memory_budget {self.memory_budget / 2**20:.1f} MiB is less than the state this rank holds "
                f"between steps ({held / 2**20:.1f} MiB: weights, master shards, optimizer state); use more "
                "ranks or zero3, offload_optimizer=True (zero3: master shards and optimizer state in host "
                "memory), or raise the budget")
        # under offload, optimizer state claims the headroom before any parameter is kept gathered
        reserve = sum(st.param_bytes(n) for n in st.params) if st is not None and not self.offload_all else 0
        return dataclasses.replace(self.ctx, graph_budget=left, reserve=reserve)

    def _executor(self, prog: Program) -> Callable:
        if self.compile_mode != "inductor":
            return _emit.eager_safe(prog.gm).forward  # plain call: no module hooks (MemTracker counts module calls)
        from .runtime.inductor import compile_graph

        return compile_graph(prog.gm)

    def _inputs(self, prog: Program, tensors) -> list[torch.Tensor]:
        params = self.state.param_inputs(prog.param_input == "full", prog.input_dtypes)
        bufs = [self.buffers[n].detach() for n in prog.capture.buffer_names]
        return params + bufs + list(tensors)

    # -- running --------------------------------------------------------------------------------

    def _run(self, mode: str, batch, extra: list[torch.Tensor] = ()) -> list[torch.Tensor]:
        prog, run = self._program(batch, mode)
        tensors, _, _ = flatten_batch(batch)
        with torch.no_grad():
            outs = run(*self._inputs(prog, tensors), *extra)
        self.last_comm_bytes += prog.comm_bytes()
        return outs

    def _accumulators(self, batch, mode: str, n: int) -> list[torch.Tensor]:
        """Zeroed running sums shaped and typed as the last ``n`` inputs of the ``mode`` program."""
        prog, _ = self._program(batch, mode)
        phs = prog.gm.graph.find_nodes(op="placeholder")[-n:]
        return [torch.zeros(p.meta["val"].shape, dtype=p.meta["val"].dtype, device=self.mesh.device) for p in phs]

    def step(self, batch) -> torch.Tensor:
        """One optimizer step. ``batch`` is passed to the model as ``model(**batch)`` / ``model(*batch)``;
        a list of batches is a list of micro-batches whose gradients are averaged before the step.
        Returns the loss averaged over micro-batches and data-parallel ranks.

        Under a ``memory_budget`` step ``replan_at`` is measured against its prediction: when the
        measured peak (the maximum over ranks) is over the budget or more than 10% off, the plan is
        made again with the difference held back, the same on every rank (``job.replans``)."""
        if self._residency_pending:
            # offload on CUDA: the first step(s) run with all optimizer state on the host; their measured
            # peak sets how much of the state then stays on the device (see _plan_residency). With the
            # update overlapped that is two steps: the second runs beside the first one's update, so
            # the measured peak holds the gradients and buffers the update keeps while the next step runs.
            dev = self.mesh.device
            if self.residency_peak is None:
                torch.cuda.empty_cache()  # the reserved peak then counts these steps' own blocks
                torch.cuda.reset_peak_memory_stats(dev)
                self.residency_peak = 0
            loss = self._step(batch)
            self._residency_pending -= 1
            if self._residency_pending:
                return loss
            self._drain()
            # reserved, not allocated: what the allocator's rounding and fragmentation cost counts too
            (peak,) = self._max_over_ranks(torch.cuda.max_memory_reserved(dev))
            self.residency_peak = peak
            self._fit_residency(peak, measured=True)
            # the plan changed: a budgeted plan is checked on the step after
            self.replan_at = max(self.replan_at, self.steps + 1)
            return loss
        if (self.memory_budget is not None and self.steps + 1 == self.replan_at
                and not isinstance(batch, list)):
            from .runtime.memory import measure

            pred = self.predict_memory(batch)["peak"]
            loss, peak = measure(self, lambda: (self._step(batch), self._drain())[0])
            self._check_plan(pred, peak)
            return loss
        return self._step(batch)

    def _max_over_ranks(self, *values: int) -> list[int]:
        """Each value's maximum over the ranks (a collective on the control group)."""
        v = torch.tensor(values, dtype=torch.float64)
        if self.ws > 1:
            dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.ctrl)
        return [int(x) for x in v]

    def _check_plan(self, predicted: int, measured: int) -> None:
        predicted, measured = self._max_over_ranks(predicted, measured)
        if measured <= self.memory_budget and abs(measured - predicted) <= 0.10 * predicted:
            return
        self._memory_slack = max(0, measured - predicted)
        self.replans.append({"step": self.steps, "predicted": predicted, "measured": measured,  # steps done
                             "held_back": self._memory_slack})
        # the next step plans again under the corrected budget (and compiles only a plan that changed)
        self._replanned.update(self._programs)
        self._programs.clear()

    def _step(self, batch) -> torch.Tensor:
        micro = batch if isinstance(batch, list) else [batch]
        if not micro:
            raise ValueError("step([]) got no micro-batches")
        k = len(micro)
        t0 = time.perf_counter()
        self.last_comm_bytes = 0
        if k > 1 and self.strategy in ("ddp", "zero1"):
            # whole gradients summed locally (in place, in the graph); one reduction, in the last
            # micro-batch's program
            *sums, loss_sum = self._accumulators(micro[0], "local", len(self.state.grad_names) + 1)
            for mb in micro[:-1]:
                (loss_sum,) = self._run("local", mb, [*sums, loss_sum])
            outs = self._run("last", micro[-1], [*sums, loss_sum])
            del sums  # the whole sums are dead once reduced: free them before the optimizer step
            loss, grad_list = outs[0], list(outs[1:])
        elif k > 1:
            # zero2/zero3: each micro-batch reduce-scatters and adds its shards into the sums
            grad_list = self._accumulators(micro[0], "acc", len(self.state.grad_names))
            losses = [self._run("acc", mb, grad_list)[0] for mb in micro]
            loss = torch.stack(losses).sum()
        else:
            outs = self._run("step", micro[0])
            loss, grad_list = outs[0], list(outs[1:])
        if k > 1:
            loss = loss / k
            for g in grad_list:
                g.div_(k)
        grads = dict(zip(self.state.grad_names, grad_list))
        self.last_grad_norm = None
        if self.clip_grad_norm is not None:
            self.last_grad_norm, sent = self.state.clip_grad_norm_(grads, self.clip_grad_norm, self.group, self.ws)
            self.last_comm_bytes += sent
        t_opt = self._sync_clock()
        if self.state.streamer is not None:
            self.state.streamer.step(grads)
        elif self.overlap_update:
            self._step_overlapped(grads)
        else:
            self.state.set_grads(grads)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_comm_bytes += self.state.sync_full_from_master(self.group, self.ws)
        if self.time_optimizer:
            self._drain()  # the update's streams and its host part
            self.last_optimizer_s = self._sync_clock() - t_opt
        self.last_step_s = time.perf_counter() - t0
        self.steps += 1
        return loss.detach()

    def _drain(self) -> None:
        """Wait for an optimizer update still running on its own streams (offload or overlap_update on
        CUDA); the readiness works left on the parameters are taken off (their events have passed)."""
        if self.state.streamer is not None:
            self.state.streamer.drain()
        if self._upd is not None:
            torch.cuda.current_stream(self.mesh.device).wait_stream(self._upd)
            with torch.no_grad():
                for t in self.state.master.values():
                    torch.ops._c10d_functional.wait_tensor(t)

    def _chunks(self) -> list[list[str]]:
        """The trainable parameters in the order the step program first reads them (its readiness
        waits; those it never reads last), cut into about 16 chunks of equal bytes."""
        if self._update_chunks is None:
            prog = next(p for p, _ in self._programs.values())
            order = [n.meta["sw_ready"] for n in prog.gm.graph.nodes if "sw_ready" in n.meta]
            self._ready_names = set(order)
            names = [n for n in order if n in self.state.opt_tensors]
            names += [n for n in self.state.grad_names if n not in self._ready_names]
            size = {n: self.state.master[n].numel() * self.state.master[n].element_size() for n in names}
            target = sum(size.values()) / 16
            chunks, cur, acc = [], [], 0
            for n in names:
                cur.append(n)
                acc += size[n]
                if acc >= target:
                    chunks.append(cur)
                    cur, acc = [], 0
            self._update_chunks = chunks + ([cur] if cur else [])
        return self._update_chunks

    def _step_overlapped(self, grads: dict[str, torch.Tensor]) -> None:
        """The update chunk by chunk in first-read order (each chunk: its gradients set, the optimizer
        stepped, which skips parameters without one). On CUDA on ``self._upd``, after the step's graph;
        each chunk's parameters that the graph reads get a work whose wait makes the reading stream
        wait for the chunk's event (the next graph's readiness waits), and the gradients are kept from
        reuse until the update has read them."""
        upd = self._upd
        chunks = self._chunks()
        if upd is not None:
            from torch._C._distributed_c10d import _register_work

            from .runtime.offload import _Ready

            upd.wait_stream(torch.cuda.current_stream(self.mesh.device))
            for g in grads.values():  # before any chunk reads them: safe even if a chunk raises
                g.record_stream(upd)
        for chunk in chunks:
            with torch.cuda.stream(upd) if upd is not None else contextlib.nullcontext():
                try:
                    self.state.set_grads({n: grads[n] for n in chunk})
                    self.optimizer.step()
                finally:
                    for n in chunk:
                        self.state.opt_tensors[n].grad = None
                if upd is not None:
                    ev = torch.cuda.Event()
                    ev.record(upd)
            if upd is not None:
                for n in chunk:
                    if n in self._ready_names:  # a work nothing waits for would stay registered
                        _register_work(self.state.master[n], _Ready(ev))

    def synchronize(self) -> None:
        """Wait (on the current stream) for an update still running on a stream of its own
        (``overlap_update``, or the overlapped offload on CUDA). Every method of the job that reads
        the state does this itself; call it before reading ``job.optimizer`` or the shards yourself."""
        self._drain()

    def _sync_clock(self, force: bool = False) -> float:
        if (self.time_optimizer or force) and self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)
        return time.perf_counter()

    def eval_step(self, batch) -> torch.Tensor:
        """Forward only, in eval mode (dropout off): the loss averaged over data-parallel ranks."""
        return self._run("eval", batch)[0].detach()

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's weights and persistent buffers, keyed as ``model.state_dict()``.

        A collective: every rank must call it. With ``rank0_only`` the other ranks get ``{}``.
        Parameters are gathered one at a time onto the CPU, so the whole model is never on one device.
        """
        self._drain()
        canonical = {id(p): n for n, p in self.model.named_parameters()}
        keep = not rank0_only or self.rank == 0
        out: dict[str, torch.Tensor] = {}
        gathered: dict[str, torch.Tensor] = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            name = canonical.get(id(t))
            if name is None:
                if keep:
                    out[key] = t.detach().cpu().clone()
                continue
            if name not in gathered:
                full = self.state.gather_full(name, self.group, self.ws)
                gathered[name] = full.cpu().clone() if keep else full
            if keep:
                out[key] = gathered[name]
        return out

    # -- introspection --------------------------------------------------------------------------

    def programs(self) -> list[Program]:
        return [p for p, _ in self._programs.values()]

    def cost_inputs(self):
        """(link profile, device) the cost model uses for this job: a calibrated profile if one was
        given to ``compile(link_profile=...)``, else a preset for the backend. Kept until
        ``link_profile`` changes: the cost model asks once per node."""
        from .costmodel import DEVICES, PRESETS, LinkProfile

        cached = getattr(self, "_cost_inputs", None)
        if cached is not None and cached[0] is self.link_profile:
            return cached[1]
        lp = self.link_profile
        if isinstance(lp, str):
            lp = PRESETS[lp] if lp in PRESETS else LinkProfile.load(lp)
        if lp is None:
            lp = PRESETS["cpu-gloo" if dist.get_backend(self.group) == "gloo" else "h200-nv18-x2"]
        dev = DEVICES["cpu"]
        if self.mesh.device.type == "cuda":
            name = torch.cuda.get_device_name(self.mesh.device).lower()
            dev = next((d for k, d in DEVICES.items() if k in name), DEVICES["h200"])
        self._cost_inputs = (self.link_profile, (lp, dev))
        return lp, dev

    def _timeline(self, gm, measured: dict[str, float] | None = None):
        """(two-lane simulation of ``gm``, compute source): ``measured`` per-node seconds where given,
        else the roofline; collectives from the α-β link profile."""
        from .costmodel import node_time, simulate

        dev = self.cost_inputs()[1]
        compute = (lambda n: measured.get(n.name, 0.0)) if measured is not None else (lambda n: node_time(n, dev))
        tl = simulate(gm, compute, self._comm_time)
        return tl, "measured" if measured is not None else "roofline"

    def _node_time(self, n) -> float:
        """The roofline time of one node on this job's device (the cost model's compute estimate)."""
        from .costmodel import node_time

        return node_time(n, self.cost_inputs()[1])

    def _comm_time(self, n) -> float:
        """The α-β time of one collective start node on this job's link profile."""
        return self.cost_inputs()[0].time(n.meta["sw"]["kind"], n.meta["sw"]["full_bytes"], self.ws)

    def _estimate(self, gm) -> tuple[float, int]:
        """The cost model on a finished program (roofline compute, α-β collectives, liveness)."""
        from .costmodel import liveness

        return self._timeline(gm)[0].step_s, liveness(gm, **self._liveness_mode(gm)).peak

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: whole weights, master shards, buffers, optimizer state
        (predicted from the optimizer's kind before its first step)."""
        from .costmodel import optimizer_state_bytes

        def total(ts):
            seen = {id(t): t for t in ts if not t.is_meta}
            return sum(t.numel() * t.element_size() for t in seen.values())

        if self.state.streamer is not None:  # master and optimizer state in host memory, but the resident part
            st = self.state.streamer
            return {"weights": total(self.state.compute.values()), "master": 0,
                    "buffers": total(self.buffers.values()), "optimizer": st.device_bytes(),
                    "staging": st.staging_bytes()}
        return {"weights": total(self.state.full.values()), "master": total(self.state.master.values()),
                "buffers": total(self.buffers.values()), "optimizer": optimizer_state_bytes(self.optimizer)}

    def predict_memory(self, batch) -> dict[str, int]:
        """Predicted peak bytes on this rank for a step on ``batch`` (one micro-batch), before running it.

        Resident state + the largest of: the graph's simulated live peak; its outputs (the
        gradients) plus the optimizer step's temporaries; zero1/2's gather of the updated shards
        back into whole weights. See costmodel/memory.py.
        """
        prog, _ = self._compiled(batch, "step")
        tensors, _, _ = flatten_batch(batch)
        return self._memory(prog, tensors)

    def _liveness(self, prog: Program):
        """The simulated liveness of ``prog`` as this job executes it, computed once per program."""
        from .costmodel import liveness

        if getattr(prog, "_live", None) is None:
            prog._live = liveness(prog.gm, **self._liveness_mode(prog.gm))
        return prog._live

    def _liveness_mode(self, gm) -> dict:
        """How this job's executor allocates: inductor's fused kernels, which write a result into a
        dying input's buffer unless the graph copies values out (compile_graph turns that off)."""
        from .runtime.inductor import copies_out

        fused = self.compile_mode == "inductor"
        return {"fused": fused, "inplace": fused and not copies_out(gm)}

    def _memory(self, prog: Program, tensors) -> dict[str, int]:
        from .costmodel import optimizer_transient

        res = self.resident_bytes()
        live = self._liveness(prog)
        on_dev = sum(t.numel() * t.element_size() for t in tensors if t.device == self.mesh.device)
        st = self.state.streamer
        after = live.outputs + (st.transient_bytes() if st is not None else optimizer_transient(self.optimizer))
        sync = self.state.sync_transient_bytes(self.group, self.ws)
        peak = sum(res.values()) + on_dev + max(live.peak, after, sync)
        return {**res, "batch": on_dev, "graph_peak": live.peak, "graph_peak_at": live.peak_at,
                "grads": live.outputs, "optimizer_step": after, "gather_back": sync, "peak": peak}

    def profile_compute(self, batch) -> dict[str, float]:
        """Measure each compute node of the step program for ``batch`` on this device (max over ranks;
        a collective: every rank must call it). The cost model uses these times instead of the
        roofline from then on."""
        from .runtime.profile import node_times

        prog, run = self._compiled(batch, "step")
        tensors, _, _ = flatten_batch(batch)
        inputs = self._inputs(prog, tensors)
        times = node_times(prog.gm, inputs, self.mesh.device, self.ctrl)
        if self.compile_mode == "inductor":
            # inductor fuses nodes, so their sum overstates its time: scale every node by the ratio of
            # the compiled program's measured time to that sum (exact at one rank, where the program is
            # all compute; with collectives the compiled time also holds what they expose)
            total = sum(times.values())
            best = float("inf")
            rng = torch.get_rng_state()
            for _ in range(2):
                t0 = self._sync_clock(force=True)
                with torch.no_grad():
                    run(*inputs)
                best = min(best, self._sync_clock(force=True) - t0)
            torch.set_rng_state(rng)
            v = torch.tensor([best], dtype=torch.float64)
            if self.ws > 1:
                dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.ctrl)
            if total > 0:
                times = {k: t * float(v) / total for k, t in times.items()}
        self._node_times[self._key(batch, "step")] = times
        return times

    def _key(self, batch, mode):
        tensors, consts, spec = flatten_batch(batch)
        return (batch_signature(spec, consts, tensors), mode)

    def _compiled(self, batch, mode: str) -> tuple[Program, Callable]:
        """The program for ``batch``: an existing one without the per-step agreement of ranks (so
        introspection on one rank cannot hang), else compiled like a step (a collective)."""
        return self._programs.get(self._key(batch, mode)) or self._program(batch, mode)

    def predict_step(self, batch) -> dict[str, float]:
        """Predicted step time for ``batch``: the two-lane simulation of the step program — measured
        compute where ``profile_compute`` ran (roofline otherwise), α-β collectives — plus the optimizer
        phase (measured when ``time_optimizer`` was on for a step, else memory-bound roofline)."""
        prog, _ = self._compiled(batch, "step")
        tl, src = self._timeline(prog.gm, self._node_times.get(self._key(batch, "step")))
        opt = self._optimizer_s(self.cost_inputs()[1])
        step = self._step_with_update(prog, tl, opt)
        return {"step_s": step, "graph_s": tl.step_s, "compute_s": tl.compute_s, "optimizer_s": opt,
                "exposed_comm_s": tl.exposed_comm_s, "comm_s": tl.comm_s, "compute_source": src, "timeline": tl}

    def _update_overlaps(self) -> bool:
        """Whether a step's update runs beside the next step (overlap_update, or offload's overlap on CUDA)."""
        st = self.state.streamer
        return (st is not None and st.overlap) or self._upd is not None

    def _step_with_update(self, prog: Program, tl, opt: float) -> float:
        """A step of ``prog`` (simulated as ``tl``) with an update of ``opt`` seconds: after the graph, or,
        where the update overlaps the next step, beside its forward (passes/ready.py). Offload's update
        runs on the host and the copy engines: the step is its backward plus the longer of its forward
        and the update. overlap_update's runs on the same SMs as the forward, whose matrix products
        hold them whole: it hides only in the forward's idle compute time (waits for collectives)."""
        if not self._update_overlaps():
            return tl.step_s + opt
        from .capture import forward_nodes

        seen = {n.name for n in forward_nodes(prog.gm)}
        end = max((e for k, name, _, e in tl.events if k == "compute" and name in seen), default=0.0)
        if self.state.streamer is not None:
            return (tl.step_s - end) + max(end, opt)
        idle = sum(e - s for k, _, s, e in tl.events if k == "wait" and e <= end)  # compute lane waiting
        return tl.step_s + max(0.0, opt - idle)

    def host_link(self):
        """The host link the offload cost model uses: the link profile's measured one, else the
        H200 PCIe figures on CUDA, the CPU pool's on CPU (costmodel/hostlink.py)."""
        from .costmodel.hostlink import CPU_POOL, PCIE5

        lp, _ = self.cost_inputs()
        return lp.host_link() or (PCIE5 if self.mesh.device.type == "cuda" else CPU_POOL)

    def _optimizer_s(self, dev) -> float:
        """The optimizer phase: measured if a step ran with ``time_optimizer``, else a memory-bound
        roofline of AdamW (read parameter, gradient and two moments; write parameter and moments),
        and under offload at least the host link's time to move the host-resident state both ways."""
        if self.last_optimizer_s is not None:
            return self.last_optimizer_s
        nbytes = sum(t.numel() * t.element_size() for t in self.state.opt_tensors.values())
        # fused: read parameter, gradient and two moments, write three; torch's multi-tensor and loop
        # Adam make about 20 passes of a parameter's bytes (decay, lerp, two for v, sqrt, div, add, addcdiv)
        from .costmodel.memory import optimizer_kernel

        adam = isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW))
        unfused = adam and optimizer_kernel(self.optimizer.defaults, self.mesh.device.type) != "fused"
        update = (20 if unfused else 7) * nbytes / dev.bandwidth
        st = self.state.streamer
        if st is None:
            return update
        return max(update, st.update_time(self.host_link()))

    def profile_step(self, batch, trace: str | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Run one real step under torch.profiler: (loss, {step_s, comm_s, exposed_s, exposed_pct});
        ``trace`` saves the chrome trace. Exposed communication: NCCL kernel time not overlapped by
        other kernels on GPUs; time blocked in collective waits on gloo."""
        from .runtime.profile import profiled

        return profiled(lambda: self.step(batch), self.mesh.device, trace)

    def explain(self) -> str:
        """The plan: strategy, mesh, placements, and per compiled program its collectives with bytes,
        predicted time and exposure, and the predicted step (two-lane simulation of the schedule)."""
        lp, dev = self.cost_inputs()
        lines = [f"strategy={self.strategy} {self.mesh} precision={self.mp}", f"link profile: {lp}",
                 f"compute: roofline on {dev.name} ({dev.flops / 1e12:.1f} TFLOP/s, {dev.bandwidth / 1e9:.0f} GB/s)",
                 f"optimizer: {optimizer_kind(self.optimizer)}"]
        for (sig, mode), (prog, _) in self._programs.items():
            c = prog.counts()
            tl, src = self._timeline(prog.gm, self._node_times.get((sig, mode)))
            lines.append(
                f"program [{mode}] {prog.strategy}: {len(prog.gm.graph.nodes)} nodes; all_gather={c['all_gather']} "
                f"reduce_scatter={c['reduce_scatter']} all_reduce={c['all_reduce']}; {prog.comm_bytes() / 2**20:.2f} MiB "
                f"sent per rank; predicted graph {tl.step_s * 1e3:.2f} ms = compute ({src}) {tl.compute_s * 1e3:.2f} ms + "
                f"exposed comm {tl.exposed_comm_s * 1e3:.2f} ms ({tl.exposed_pct:.0f}%), comm busy {tl.comm_s * 1e3:.2f} ms"
            )
            if mode != "eval":
                from .passes.actoffload import candidates

                saved = candidates(prog.gm)
                big = ", ".join(f"{n.name} {tuple(n.meta['val'].shape)} {b / 2**20:.2f}" for n, b in saved[:6])
                lines.append(f"  activations saved for the backward: {len(saved)}, "
                             f"{sum(b for _, b in saved) / 2**20:.2f} MiB (views counted with their source); "
                             f"largest (MiB): {big}")
            if prog.recomputed:
                lines.append(f"  recomputed in backward ({len(prog.recomputed)}): {', '.join(prog.recomputed)[:300]}")
            if prog.carve_choice:
                plain, carved, keep = prog.carve_choice
                lines.append(f"  SM carveout (auto, cost model with SM contention): step {plain * 1e3:.2f} ms uncarved, "
                             f"{carved * 1e3:.2f} ms carved: " + ("carved" if keep else "not carved"))
            if prog.carved:
                c = self.ctx.sm_carveout
                lines.append(f"  matrix products beside a collective, leaving {c.sms} SMs free to it: {prog.carved} "
                             + (f"(a share of {c.share:.0%} of the SMs)" if c.total else "(inert off CUDA)"))
            if prog.offloaded:
                lines.append(f"  activations kept in host memory, fetched back early in the backward "
                             f"({len(prog.offloaded)}): {', '.join(prog.offloaded)[:300]}")
            if prog.unsharded is not None:
                lines.append(f"  memory budget {self.memory_budget / 2**20:.1f} MiB: kept gathered forward to backward "
                             f"({len(prog.unsharded)}): {', '.join(prog.unsharded)[:300]}")
            if prog.hashes:
                lines.append(f"  hashes (agreed by every rank): capture {prog.hashes['capture']} plan {prog.hashes['plan']}")
            if prog.bucket_choice:
                lines.append("  buckets (auto, cost model): " + _choices(prog.bucket_choice))
            if prog.schedule:
                ops = prog.schedule.get("max_ops")
                lines.append(f"  schedule: cap {prog.schedule['max_in_flight'] / 2**20:.2f} MiB in flight"
                             + (f", {ops} collective(s) at a time" if ops else ""))
                if prog.schedule.get("cap_choice"):
                    lines.append("  in-flight caps (cost model): " + _choices(prog.schedule["cap_choice"]))
            if mode == "step":
                opt = self._optimizer_s(dev)
                step = self._step_with_update(prog, tl, opt)
                if not self._update_overlaps():
                    lines.append(f"  predicted step {step * 1e3:.2f} ms = graph + optimizer {opt * 1e3:.2f} ms")
                else:
                    lines.append(f"  predicted step {step * 1e3:.2f} ms = graph {tl.step_s * 1e3:.2f} ms, its forward "
                                 f"beside the previous step's update ({opt * 1e3:.2f} ms)")

                live = self._liveness(prog)
                res = self.resident_bytes()
                lines.append(f"  memory: resident {sum(res.values()) / 2**20:.2f} MiB ("
                             + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in res.items())
                             + f"), graph peak +{live.peak / 2**20:.2f} MiB at {live.peak_at}")
                if live.at_peak:
                    top = live.at_peak[:6]
                    rest = live.peak - sum(b for _, b in top)
                    lines.append("    live then (MiB): " + ", ".join(f"{n} {b / 2**20:.2f}" for n, b in top)
                                 + (f", {len(live.at_peak) - len(top)} more {rest / 2**20:.2f}"
                                    if len(live.at_peak) > len(top) else ""))
                st = self.state.streamer
                if st is not None:
                    hl = self.host_link()
                    up, down = st.transfer_bytes()
                    lines.append(f"  optimizer offload: {st.host_bytes() / 2**20:.2f} MiB on the host; per step "
                                 f"{up / 2**20:.2f} MiB to the device, {down / 2**20:.2f} MiB back (>= "
                                 f"{hl.stream_time(up, down) * 1e3:.2f} ms over {hl}); "
                                 f"{st.device_bytes() / 2**20:.2f} MiB kept on the device; {len(st.chunks)} "
                                 f"chunks, {st.window}-slot staging ring {st.staging_bytes() / 2**20:.2f} MiB")
                    if st.host:
                        rate = f"{st.host_rate / 1e9:.2f} G elements/s measured" if st.host_rate else "rate not measured"
                        lines.append(f"  host update: {len(st.host)} parameters, {st.host_elements() / 1e6:.1f} M "
                                     f"elements on the host's cores ({rate}); predicted update "
                                     f"{st.update_time(hl) * 1e3:.2f} ms")
            lines.append(f"  {'collective':15s} {'phase':5s} {'sent/rank':>10s} {'pred µs':>9s}  param(s)")
            for n in prog.collective_nodes():
                sw = n.meta["sw"]
                p = sw.get("param")
                p = ",".join(p) if isinstance(p, list) else (p or "")
                lines.append(f"  {sw['kind']:15s} {sw['phase']:5s} {sw['bytes'] / 1024:8.1f}KiB {self._comm_time(n) * 1e6:9.1f}  {p[:60]}")
        lines.append("placements (dp axis) and memory decisions:")
        kept = set(self.ctx.keep_gathered)
        for prog in self.programs():
            kept |= set(prog.unsharded or ())
        for n, lay in self.layouts.items():
            place = "R" if self.strategy == "ddp" else str(lay)
            what = []
            if self.strategy == "zero3":
                what.append("kept gathered fwd->bwd" if n in kept else "resharded after forward")
            if self.state.streamer is not None:
                st = self.state.streamer
                what.append("master+optimizer state on the device" if n in st.resident
                            else "master+optimizer state on host, updated on the host" if n in st.host
                            else "master+optimizer state on host, streamed")
            lines.append(f"  {n:40s} {str(tuple(lay.shape)):20s} {place:8s} {'; '.join(what)}".rstrip())
        return "\n".join(lines)
