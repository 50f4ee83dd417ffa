"""The systems ``shardwise bench`` runs beside shardwise: torch.compile alone, DDP, FSDP2 (eager, compiled,
offloaded), DeepSpeed ZeRO-3 and DeepCompile; each gets the same model, built the same way."""

from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.distributed as dist

from .config import BenchConfig, options


def bench_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def build_model(cfg: BenchConfig, device):
    from ..models import build

    torch.manual_seed(cfg.seed)
    # initialised where it runs: on one host thread (torchrun's OMP_NUM_THREADS=1) the 1.1B shape's
    # initialisation takes 23 s on our CPU machine, so the 8B shape's a minute or more of each system's
    # set-up; every rank draws the same weights from the same seed on the same kind of device
    with torch.device(device):
        over = {"capacity_factor": cfg.capacity_factor} if cfg.capacity_factor is not None else {}
        return build(cfg.model, cfg.size, checkpoint=cfg.checkpoint, **over)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peer(system: str, cfg: BenchConfig, model, device):
    """(step function taking a batch and returning the loss, optimizer) for a peer system."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    kind = system.split(":")[0]
    if cfg.tp > 1 and kind not in TP_PEERS:
        raise RuntimeError(f"{kind} has no tensor parallelism in this bench: with --tp run {', '.join(TP_PEERS)}")
    if kind in ("deepspeed", "deepcompile"):
        return _deepspeed(system, cfg, model, device)
    loss_ctx, amp = contextlib.nullcontext, cfg.precision == "bf16"  # bf16: autocast, except under FSDP2 (below)
    if kind in ("fsdp2", "fsdp2-compile", "fsdp2-offload"):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if cfg.precision == "bf16" else MixedPrecisionPolicy()
        # fsdp2-offload: sharded parameters, gradients and the optimizer step on the host (pinned)
        off = CPUOffloadPolicy() if kind == "fsdp2-offload" else OffloadPolicy()
        dp_mesh = None
        if cfg.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            dp_mesh, loss_ctx = tensor_parallel(model, cfg, device), loss_parallel
        for blk in model.blocks:
            fully_shard(blk, mesh=dp_mesh, mp_policy=mp, offload_policy=off)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=off)
        run = model
        if kind == "fsdp2-compile" and cfg.tp > 1:
            # each block compiled, as torchtitan does under TP (the whole model's graph mixes the
            # fake modes of the vocab-parallel embedding's DTensors under dynamo)
            for blk in model.blocks:
                blk.compile()
        elif kind == "fsdp2-compile":
            run = torch.compile(model)
        amp = False  # FSDP2 casts the parameters itself
    elif kind == "ddp":
        run = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:  # compile: this rank alone, no communication
        run = torch.compile(model)
    # fused=1: torch's fused AdamW kernel, the update shardwise runs on CUDA; default: torch's (foreach on CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, **({"fused": True} if options(system).get("fused") else {}))

    def step(batch):
        with loss_ctx():
            with torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext():
                loss = run(*batch)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

    return step, opt


TP_PEERS = ("compile", "fsdp2", "fsdp2-compile")
"""The peers a bench with --tp runs: FSDP2 over dp with torch's TP over tp, and compile's ceiling."""


def tensor_parallel(model, cfg: BenchConfig, device):
    """torch's own tensor parallelism on a built-in Llama, as torchtitan applies it: DTensor ``parallelize_module`` over
    the tp axis of a (dp, tp) ``DeviceMesh`` (tp innermost) — q/k/v and gate/up column-parallel, o and down
    row-parallel, the embedding row-parallel (vocab) and the head column-parallel into a vocab-parallel loss
    (``loss_parallel``); with ``cfg.sp`` the norms and the residual stream in sequence shards (``SequenceParallel``).
    Each attention module is told its local head counts. Returns the dp mesh for FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = cfg.tp
    if cfg.model != "llama":
        raise RuntimeError(f"the FSDP2+TP peer is written for the built-in llama, not {cfg.model}")
    c = model.cfg
    if c.n_kv_head % tp or c.n_head % tp:
        raise RuntimeError(f"torch's TP splits heads: n_head={c.n_head} and n_kv_head={c.n_kv_head} must be "
                           f"divisible by --tp {tp}")
    mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    seq = Shard(1) if cfg.sp else Replicate()
    parallelize_module(model, mesh["tp"], {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        **({"norm": SequenceParallel()} if cfg.sp else {}),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)})
    for blk in model.blocks:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=seq),
                "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(), "ffn.w2": RowwiseParallel(output_layouts=seq)}
        if cfg.sp:
            plan.update({"attn_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                    desired_input_layouts=(Replicate(), None, None)),
                         "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(blk, mesh["tp"], plan)
        blk.attn.n_head //= tp
        blk.attn.n_kv //= tp
    return mesh["dp"]


def _deepspeed(system, cfg, model, device):
    if device.type != "cuda" or importlib.util.find_spec("deepspeed") is None:
        raise RuntimeError("deepspeed is not installed on this CUDA machine (or this is not a CUDA machine)")
    import deepspeed

    opts, name = options(system), system.split(":")[0]
    zero: dict = {"stage": 3}
    conf = {"train_micro_batch_size_per_gpu": cfg.batch, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr}}, "bf16": {"enabled": cfg.precision == "bf16"}}
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
