"""The options of ``shardwise.compile``, grouped and validated: one keyword-only dataclass per concern.

``compile()`` keeps its flat keyword arguments (what users write) and builds a ``JobConfig`` from them; each field is
named as its keyword, so an error names the option to fix. Values are checked here, before any process group or device
is touched; what depends on the device (a budget given as a fraction, the SM carveout) is resolved when the job is
built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
"""What the data-parallel axis does with parameters, gradients and optimizer state."""

EXECUTORS = (None, "fx", "inductor")
"""What runs the rewritten graph: the FX GraphModule (None or "fx"), or inductor's compiled code."""

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
    """Precision policy, as FSDP2's ``MixedPrecisionPolicy``: master weights stay in their dtype.

    Example::

        >>> import torch, shardwise as sw
        >>> sw.MixedPrecision(param_dtype="bf16").param_dtype
        torch.bfloat16
    """

    param_dtype: torch.dtype | str | None = None
    """dtype parameters are gathered and computed in (e.g. ``torch.bfloat16``); None: their own dtype."""
    reduce_dtype: torch.dtype | str | None = torch.float32
    """dtype gradients are reduced in; None: the compute dtype."""

    def __post_init__(self):
        object.__setattr__(self, "param_dtype", _dtype(self.param_dtype, "param_dtype"))
        object.__setattr__(self, "reduce_dtype", _dtype(self.reduce_dtype, "reduce_dtype"))


@dataclass(frozen=True, kw_only=True)
class ScheduleOptions:
    """Buckets and the latency-hiding schedule of the collectives."""

    bucket_mb: float = 25.0
    """ddp: close an all-reduce bucket at this many MiB."""
    shard_bucket_mb: float | str | None = "auto"
    """zero: all-gather/reduce-scatter buckets: "auto" (the size the cost model predicts fastest without raising the
    predicted peak by more than 10%), a number of MiB, 0 (one collective per parameter) or None (twice the largest)."""
    schedule: bool = True
    """Reorder collectives for latency hiding (passes/schedule.py)."""
    max_in_flight_mb: float | None = None
    """Cap on the MiB of collectives in flight; None: the cost model sweeps 2-16x the largest one."""
    max_in_flight_ops: int | None = None
    """Cap on the collectives started and not yet waited for; None: none (gloo always runs one)."""

    def __post_init__(self):
        b = self.shard_bucket_mb
        if b is not None and b != "auto" and not (isinstance(b, (int, float)) and b >= 0):
            raise ValueError(f"shard_bucket_mb must be 'auto', None or a number >= 0, got {b!r}")
        ops = self.max_in_flight_ops
        if ops is not None and (not isinstance(ops, int) or ops < 1):
            raise ValueError(f"max_in_flight_ops must be a positive int or None, got {ops!r}")
        if self.max_in_flight_mb is not None and not self.max_in_flight_mb > 0:
            raise ValueError(f"max_in_flight_mb must be positive or None, got {self.max_in_flight_mb!r}")

    @property
    def shard_bucket_bytes(self) -> int | str | None:
        b = self.shard_bucket_mb
        return b if b in (None, "auto") else int(b * 2**20)


@dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """The memory plan: a budget to fit, and the rewrites that make a step fit."""

    memory_budget: int | float | None = None
    """Bytes (an int), or a fraction in (0, 1] of what this process may use on its device."""
    keep_gathered: frozenset | None = None
    """zero3: parameters kept gathered from forward to backward whatever the budget."""
    recompute: bool = False
    """Recompute cheap elementwise activations in the backward (passes/recompute.py)."""
    offload_activations: bool = False
    """Keep the activations the backward reads in host memory (passes/actoffload.py)."""

    def __post_init__(self):
        b = self.memory_budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or b <= 0):
            raise ValueError(f"memory_budget must be a positive number of bytes or a fraction in (0, 1], got {b!r}")
        if isinstance(b, float) and b > 1:
            raise ValueError(f"memory_budget={b!r}: a float is a fraction of device memory and must be <= 1; "
                             "pass bytes as an int")
        if self.keep_gathered is not None:
            object.__setattr__(self, "keep_gathered", frozenset(self.keep_gathered))


@dataclass(frozen=True, kw_only=True)
class OffloadOptions:
    """Optimizer state in host memory (zero3), streamed through the device or updated on the host."""

    offload_optimizer: bool | str = False
    """True: keep on the device what fits beside the step, the rest on the host; "all": all on the host."""
    offload_chunk_mb: float = 64
    """MiB of master weights streamed through the device at a time."""
    offload_overlap: bool = True
    """CUDA: the next step starts while the update streams (each parameter's first reader waits for it)."""
    offload_host_update: bool | float | str = "auto"
    """Share of the offloaded state the host's cores update: "auto" (the cost model splits, on CUDA),
    a number in (0, 1], True (all) or False (none)."""

    def __post_init__(self):
        if self.offload_optimizer not in (False, True, "all"):
            raise ValueError(f"offload_optimizer must be False, True (keep what fits on the device) or 'all', "
                             f"got {self.offload_optimizer!r}")
        if not self.offload_chunk_mb > 0:
            raise ValueError(f"offload_chunk_mb must be positive, got {self.offload_chunk_mb!r}")
        h = self.offload_host_update
        if h is True:
            object.__setattr__(self, "offload_host_update", 1.0)
        elif not (h in ("auto", False) or (isinstance(h, (int, float)) and 0 < h <= 1)):
            raise ValueError(f"offload_host_update must be 'auto', False, True or a share in (0, 1] of the "
                             f"offloaded state to update on the host, got {h!r}")


@dataclass(frozen=True, kw_only=True)
class UpdateOptions:
    """How the optimizer step runs."""

    clip_grad_norm: float | None = None
    """Clip the global gradient norm (over every shard on every rank) to this, as torch's clip_grad_norm_."""
    fused_optimizer: bool | None = None
    """None: torch's fused kernel on CUDA where the factory left foreach/fused unset; True: require it; False: never."""
    overlap_update: bool = False
    """zero3, state on the device: update in chunks in forward order, beside the next step's forward (CUDA)."""

    def __post_init__(self):
        c = self.clip_grad_norm
        if c is not None and not c > 0:
            raise ValueError(f"clip_grad_norm must be a positive number (or None for no clipping), got {c!r}")
        if self.fused_optimizer not in (None, True, False):
            raise ValueError(f"fused_optimizer must be None (fuse where torch can, on CUDA), True or False, "
                             f"got {self.fused_optimizer!r}")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything ``compile()`` was asked for, checked for consistency across the groups."""

    strategy: str = "zero3"
    """ddp | zero1 | zero2 | zero3: what the dp axis does."""
    executor: str | None = None
    """None or "fx": the FX executor; "inductor": inductor's compiled code (``compile=`` of ``compile()``)."""
    loss_fn: Callable | None = None
    """``loss_fn(outputs, batch)``, where the model's forward does not return the loss."""
    model_inputs: object = None
    """What of each batch the model is called with (capture/trace.py ``select_inputs``): None, all of
    it; an index or key (``0``: a classifier's ``model(x)`` of a batch ``(x, y)``, whose labels reach
    only ``loss_fn``); several (a tuple); or a function of the batch."""
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    offload: OffloadOptions = field(default_factory=OffloadOptions)
    update: UpdateOptions = field(default_factory=UpdateOptions)
    matmul_sm_carveout: int | str | None = "auto"
    """SMs the products beside a collective leave free (CUDA): "auto", a number, or None."""
    link_profile: object = None
    """The link the cost model times collectives on: a preset name, a ``shardwise calibrate`` JSON or a ``LinkProfile``;
    None: the backend's preset."""
    tp_plan: str | dict | None = None
    """Where the mesh has a tp axis: ``"megatron"`` (the default there: column/row-parallel pairs found
    from the graph, passes/tp.py) or ``{parameter-name glob: sw.Shard(dim) | sw.Replicate()}``."""
    sequence_parallel: bool = False
    """With a tp axis: the activations between the tensor-parallel regions (the residual stream, its
    norms) lie in sequence shards; all-gather before each column-parallel product, reduce-scatter after
    each row-parallel one, in place of the all-reduces."""
    allow_replicate: bool = False
    """With a tp axis: an op no sharding rule knows runs on whole inputs (gathered, named in a warning), not failing."""
    vocab_parallel: bool | None = None
    """Megatron's plan: the untied LM head cut by classes (True), whole (False), or whichever the cost
    model predicts faster (None; passes/tp.py ``head_choice``)."""
    tp_fuse: str = "auto"
    """With a tp axis: each product beside its tp collective (an all-gather it reads, a reduce-scatter or all-reduce of
    its result) run fused with it (passes/fuse_tp.py): "auto" as the cost model predicts fastest, "off", "ring" (the
    decomposed path, any device) or "kernel" (Triton over symmetric memory, CUDA)."""
    ep_plan: list | tuple | None = None
    """Where the mesh has an ep axis: parameter-name globs of the expert parameters to split over it
    (each ``[experts, ...]``); None: those found from the graph (passes/ep.py)."""
    ep_capacity_factor: float | str | None = None
    """Where the ep axis splits Hugging Face experts, how their pairs reach them: a number is GShard's capacity rule
    with this factor (pairs past an expert's capacity dropped; all-to-alls of fixed blocks); ``"dropless"`` the gather
    of every pair to every rank (buffers for the worst case); None dropless where its predicted graph peak fits the
    memory (the budget's graph share, or the GPU's), else capacity at ``DEFAULT_CAPACITY`` (passes/ep.py
    ``dispatch_choice``; explain says which and why). The built-in MoE sets its own (``capacity_factor``)."""
    ep_split: int | str = 1
    """With an ep axis: each micro-batch traced as this many parts (rows), interleaved so one part's ep
    collectives run under another's compute (passes/ep.py ``interleave``); each dispatched alone. ``"auto"``: traced
    whole and in halves, the faster step the cost model predicts kept (explain says both)."""
    timeout: float | None = 100.0
    """Seconds a step or eval may wait on other ranks; six times that while it compiles (a save, load or export is
    watched for a rank that raises, not for time). A rank that waits longer leaves with a message naming the rank that
    failed, stalled or is elsewhere and the step (runtime/watchdog.py); None: no watch."""

    def __post_init__(self):
        mi = self.model_inputs
        ok = lambda k: isinstance(k, (int, str)) and not isinstance(k, bool)  # noqa: E731
        if not (mi is None or callable(mi) or ok(mi) or isinstance(mi, (tuple, list)) and mi and all(map(ok, mi))):
            raise ValueError(f"model_inputs must be an index or key of the batch, a tuple of them, or a function of "
                             f"the batch; got {mi!r}")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or self.timeout <= 0):
            raise ValueError(f"timeout must be a number of seconds > 0, or None for no watch; got {self.timeout!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"compile={self.executor!r} is not supported: choose one of {EXECUTORS}")
        if self.executor == "fx":
            object.__setattr__(self, "executor", None)
        off, upd = self.offload.offload_optimizer, self.update
        if off and self.strategy != "zero3":
            raise ValueError(f"offload_optimizer is built for zero3 so far, not {self.strategy}: use strategy='zero3'")
        if upd.overlap_update and (self.strategy != "zero3" or off):
            raise ValueError("overlap_update is built for zero3 with the optimizer state on the device "
                             f"(strategy={self.strategy!r}, offload_optimizer={off!r}); offload_optimizer "
                             "overlaps its own update (offload_overlap)")
        if self.tp_plan is not None and self.tp_plan != "megatron" and not isinstance(self.tp_plan, dict):
            raise ValueError(f"tp_plan must be 'megatron' or a dict of parameter-name globs to sw.Shard(dim) or "
                             f"sw.Replicate(), got {self.tp_plan!r}")
        if isinstance(self.tp_plan, dict):
            from .sharding import Replicate, Shard

            if bad := {k: v for k, v in self.tp_plan.items() if not isinstance(v, (Shard, Replicate))}:
                raise ValueError(f"tp_plan: each placement must be sw.Shard(dim) or sw.Replicate(), got {bad}")
        if self.tp_fuse not in ("auto", "off", "ring", "kernel"):
            raise ValueError(f"tp_fuse must be 'auto', 'off', 'ring' or 'kernel', got {self.tp_fuse!r}")
        if self.vocab_parallel not in (None, True, False):
            raise ValueError(f"vocab_parallel must be True, False or None (the cost model chooses), "
                             f"got {self.vocab_parallel!r}")
        if self.ep_plan is not None and (isinstance(self.ep_plan, str) or not all(isinstance(g, str) for g in self.ep_plan)
                                         or not self.ep_plan):
            raise ValueError(f"ep_plan must be a non-empty list of parameter-name globs (e.g. ['*.experts.*']), "
                             f"got {self.ep_plan!r}")
        if self.ep_split != "auto" and (not isinstance(self.ep_split, int) or isinstance(self.ep_split, bool)
                                        or self.ep_split < 1):
            raise ValueError(f"ep_split must be a number of batch parts >= 1 (2 overlaps one half's all-to-alls "
                             f"with the other's compute) or 'auto' (the cost model's choice), got {self.ep_split!r}")
        c = self.ep_capacity_factor
        if c is not None and c != "dropless" and not (isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0):
            raise ValueError(f"ep_capacity_factor must be a positive number (1.25 is common), 'dropless', or None "
                             f"(dropless where it fits the memory), got {c!r}")
        if self.vocab_parallel is not None and self.tp_plan not in (None, "megatron"):
            raise ValueError("vocab_parallel chooses for Megatron's plan; a tp_plan by hand places the head "
                             "itself (e.g. {'head.weight': sw.Shard(0)})")
        if self.memory.keep_gathered is not None and self.strategy != "zero3":
            raise ValueError(f"keep_gathered applies to zero3 (every parameter is gathered), not {self.strategy}")

    @property
    def whole_grads(self) -> bool:
        """Strategies that keep whole gradients across micro-batches (ddp, zero1)."""
        return self.strategy in ("ddp", "zero1")
