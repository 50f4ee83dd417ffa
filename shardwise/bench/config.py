"""``shardwise bench``'s configuration: the systems it runs, the options each takes, the run's settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

SYSTEMS = ("shardwise", "shardwise-noopt", "compile", "ddp", "fsdp2", "fsdp2-compile", "fsdp2-offload", "deepspeed",
           "deepcompile")

@dataclass
class BenchConfig:
    model: str = "gpt"
    """Built-in model (gpt, llama, moe)."""
    size: str = "small"
    """Model preset (tiny, small, 124m, 1b, 3b, 8b)."""
    batch: int = 8
    """Sequences per rank per step."""
    seq: int | None = None
    """Sequence length; None: the model's."""
    precision: str = "fp32"
    """fp32, or bf16 (bf16 compute, fp32 master weights, optimizer and reduction) for every system."""
    checkpoint: bool = False
    """Activation checkpointing per block, for every system."""
    strategy: str = "zero3"
    """shardwise's strategy."""
    executor: str = "auto"
    """shardwise's executor: fx, inductor, or auto (inductor on CUDA, fx on CPU)."""
    steps: int = 5
    """Timed steps per system."""
    warmup: int = 2
    """Untimed steps first (compilation happens here)."""
    lr: float = 1e-4
    seed: int = 0
    systems: list[str] = field(default_factory=lambda: ["shardwise", "shardwise-noopt", "compile", "ddp", "fsdp2"])
    memory_fraction: float | None = None
    """CUDA: cap every system at this fraction of device memory (``set_per_process_memory_fraction``)."""
    link_profile: str | None = None
    """shardwise's link profile: a preset name or a JSON file from ``shardwise calibrate``; None: the backend's."""
    trace_dir: str | None = None
    """Write rank 0's chrome trace of the profiled step of each system here (``<system>.json.gz``)."""
    memory_sites: bool = False
    """CUDA: record the allocator over one more step and add to each row the blocks live at its peak,
    grouped by where they were allocated (``memory_at_peak``)."""
    tp: int = 1
    """Tensor-parallel ranks (adjacent ranks; the rest are dp): shardwise runs on ``sw.mesh(tp=tp)``, the FSDP2 peers
    on torch's TP (DTensor ``parallelize_module``) over one 2-D mesh; each tp group trains on its dp rank's batches."""
    sp: bool = False
    """With ``tp``: sequence parallelism in every system that has it."""
    vocab_parallel: bool | None = None
    """With ``tp``: shardwise's LM head cut by classes (True), whole (False), or as its cost model chooses
    (None); torch's TP peers always run a vocab-parallel head and loss (``loss_parallel``)."""
    capacity_factor: float | None = None
    """The built-in MoE's capacity dispatch factor (None: its preset's), for every system alike (what a
    ``shardwise:ep=N`` row splits over its ep ranks)."""
    system_timeout: float | None = None
    """Stop a system whose warm-up is still running this many seconds after it began (checked after
    each warm-up step, agreed by every rank): its row gets the error, the next system runs."""

    def __post_init__(self):
        if bad := [s for s in self.systems if s.split(":")[0] not in SYSTEMS]:
            raise ValueError(f"bench: unknown system(s) {bad}: choose from {', '.join(SYSTEMS)}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"bench: precision must be fp32 or bf16, got {self.precision!r}")
        if self.executor not in ("auto", "fx", "inductor"):
            raise ValueError(f"bench: executor must be auto, fx or inductor, got {self.executor!r}")
        if self.system_timeout is not None and self.system_timeout < 0:
            raise ValueError(f"bench: --system-timeout is seconds a system's warm-up may run, >= 0; "
                             f"got {self.system_timeout}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"bench: --memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if self.link_profile is not None:
            from ..costmodel import PRESETS

            if self.link_profile not in PRESETS and not os.path.isfile(self.link_profile):
                raise ValueError(f"bench: --link-profile {self.link_profile!r} is neither a preset "
                                 f"({', '.join(PRESETS)}) nor a file: run `shardwise calibrate --out FILE` first")
        if self.tp < 1:
            raise ValueError(f"bench: --tp is the number of tensor-parallel ranks, >= 1; got {self.tp}")
        if self.sp and self.tp == 1:
            raise ValueError("bench: --sp shards the sequence over the tensor-parallel ranks: give --tp N (N > 1)")
        if self.vocab_parallel is not None and self.tp == 1:
            raise ValueError("bench: --vocab-parallel cuts the LM head over the tensor-parallel ranks: give --tp N")
        if self.capacity_factor is not None and self.model != "moe":
            raise ValueError(f"bench: --capacity-factor sets the MoE's expert capacity: give it with --model moe, "
                             f"not {self.model}")
        for s in self.systems:
            opts = options(s)  # every system's options parse (ep and fuse are shardwise's alone)
            if opts.get("ep", 1) < 1:
                raise ValueError(f"bench: {s!r}: ep takes a number of ranks >= 1")
            if opts.get("tp_fuse", "auto") not in ("auto", "off", "ring", "kernel") or ("tp_fuse" in opts and self.tp == 1):
                raise ValueError(f"bench: {s!r}: fuse takes auto, off, ring or kernel, with --tp N (N > 1)")
        if self.steps < 1 or self.warmup < 1:
            raise ValueError("bench: --steps and --warmup must be at least 1 (the first step compiles)")


# options a shardwise system may carry after a colon: ``shardwise:ops=1+inflight_mb=64+bucket_mb=128``
SHARDWISE_OPTIONS = {"ops": ("max_in_flight_ops", int), "inflight_mb": ("max_in_flight_mb", float),
            "bucket_mb": ("shard_bucket_mb", float), "executor": ("compile", str),
            "offload": ("offload_optimizer", lambda v: "all" if v == "all" else bool(int(v))),
            "chunk_mb": ("offload_chunk_mb", float), "overlap": ("offload_overlap", lambda v: bool(int(v))),
            "host": ("offload_host_update", lambda v: v if v == "auto" else (float(v) or False)),
            "recompute": ("recompute", lambda v: bool(int(v))),
            "act": ("offload_activations", lambda v: bool(int(v))),
            "budget_gb": ("memory_budget", lambda v: int(float(v) * 2**30)),
            "fused": ("fused_optimizer", lambda v: bool(int(v))),
            "overlap_update": ("overlap_update", lambda v: bool(int(v))),
            "carveout": ("matmul_sm_carveout", lambda v: v if v == "auto" else None if v == "off" else (int(v) or None)),
            "fuse": ("tp_fuse", str),  # with --tp: auto, off, ring or kernel (passes/fuse_tp.py)
            "ep": ("ep", int)}  # not a compile option: the mesh's ep axis (the row's ranks are dp x ep x tp)

# options of the torch peers (compile, ddp, fsdp2*): ``fsdp2:fused=1`` steps AdamW with its fused kernel
PEER_OPTIONS = {"fused": ("fused", lambda v: bool(int(v)))}

# options of the deepspeed systems: ``deepspeed:offload=1+ratio=0.7``, ``deepcompile:offload=1``
DS_OPTIONS = {"offload": ("ds_offload", lambda v: bool(int(v))), "ratio": ("ds_ratio", float)}


def options(system: str) -> dict:
    if ":" not in system:
        return {}
    table = (SHARDWISE_OPTIONS if system.startswith("shardwise") else
             DS_OPTIONS if system.startswith(("deepspeed", "deepcompile")) else PEER_OPTIONS)
    out = {}
    for item in system.split(":", 1)[1].split("+"):
        k, _, v = item.partition("=")
        if k not in table or not v:
            raise ValueError(f"bench: bad option {item!r} in {system!r}: use k=v with k in {', '.join(table)}")
        name, kind = table[k]
        try:
            out[name] = kind(v)
        except ValueError:
            takes = {"host": "a number or auto", "carveout": "a number, auto or off"}.get(k, "a number")
            raise ValueError(f"bench: bad value in {item!r} of {system!r}: {k} takes {takes}") from None
    if system.startswith("deepcompile") and "ds_ratio" in out:
        raise ValueError(f"bench: {system!r}: ratio is a ZeRO-3 offload setting; deepcompile takes offload=1 only")
    return out
