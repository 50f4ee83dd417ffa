"""The systems ``shardwise bench`` runs beside shardwise: torch.compile alone, DDP, FSDP2 (eager, compiled,
offloaded), DeepSpeed ZeRO-3 and DeepCompile; each gets the same model, built the same way."""

from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.distributed as dist

from .config import BenchConfig, options


def bench_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_model(cfg: BenchConfig, device):
    from ..models import build

    torch.manual_seed(cfg.seed)
    # initialised where it runs: on one host thread (torchrun's OMP_NUM_THREADS=1) the 1.1B shape's
    # initialisation takes 23 s on our CPU machine, so the 8B shape's a minute or more of each system's
    # set-up; every rank draws the same weights from the same seed on the same kind of device
    with torch.device(device):
        return build(cfg.model, cfg.size, checkpoint=cfg.checkpoint)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(cfg, device):
    if cfg.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def peer(system: str, cfg: BenchConfig, model, device):
    """(step function taking a batch and returning the loss, optimizer) for a peer system."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if system.split(":")[0] in ("deepspeed", "deepcompile"):
        return _deepspeed(system, cfg, model, device)
    kind = system.split(":")[0]
    if kind in ("fsdp2", "fsdp2-compile", "fsdp2-offload"):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if cfg.precision == "bf16" else MixedPrecisionPolicy()
        # fsdp2-offload: sharded parameters, gradients and the optimizer step on the host (pinned)
        off = CPUOffloadPolicy() if kind == "fsdp2-offload" else OffloadPolicy()
        for blk in model.blocks:
            fully_shard(blk, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)
        run = torch.compile(model) if kind == "fsdp2-compile" else model
        amp = False  # FSDP2 casts the parameters itself
    elif kind == "ddp":
        run = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        amp = cfg.precision == "bf16"
    else:  # compile: this rank alone, no communication
        run = torch.compile(model)
        amp = cfg.precision == "bf16"
    # fused=1: torch's fused AdamW kernel, the update shardwise runs on CUDA; default: torch's own
    # default (foreach on CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, **({"fused": True} if options(system).get("fused") else {}))

    def step(batch):
        with _autocast(cfg, device) if amp else contextlib.nullcontext():
            loss = run(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, opt


def _deepspeed(system, cfg, model, device):
    if device.type != "cuda" or importlib.util.find_spec("deepspeed") is None:
        raise RuntimeError("deepspeed is not installed on this CUDA machine (or this is not a CUDA machine)")
    import deepspeed

    opts = options(system)
    name = system.split(":")[0]
    zero: dict = {"stage": 3}
    conf = {"train_micro_batch_size_per_gpu": cfg.batch, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr}},
            "bf16": {"enabled": cfg.precision == "bf16"}}
    if name == "deepcompile":
        conf["compile"] = {"deepcompile": True, "offload_opt_states": bool(opts.get("ds_offload"))}
    elif opts.get("ds_offload"):
        # optimizer state in pinned host memory, stepped by DeepSpeed's CPU Adam; ratio < 1 keeps
        # that share of it on the host and the rest on the GPU (ZeRO-3 partial offload)
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": opts.get("ds_ratio", 1.0)}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    if name == "deepcompile":
        engine.compile()

    def step(batch):
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, opt


# options a shardwise system may carry after a colon: ``shardwise:ops=1+inflight_mb=64+bucket_mb=128``
