"""``shardwise`` command line: train, explain, calibrate, bench."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .config import JobConfig
from .errors import size_text


def _explain_parser(sub) -> None:
    p = sub.add_parser(
        "explain", help="compile a built-in model and print the plan: placements, collectives, predicted step",
        description="Compiles the model as `train` would (same flags), runs one step so every program "
        "exists, and prints job.explain() on rank 0: per-parameter placement, each collective with its "
        "bytes and predicted time, and the predicted step time (roofline compute, alpha-beta collectives).")
    model_args(p)
    optimizer_args(p)
    mesh_args(p)
    p.add_argument("--link-profile", default=None,
                   help="a JSON profile from `shardwise calibrate`, or a preset name (default: per backend)")
    p.add_argument("--profile", action="store_true",
                   help="measure each compute node on this device (max over ranks) instead of the roofline")
    p.add_argument("--png", default=None, help="write the predicted timeline of the step (compute and "
                   "communication lanes) to this PNG")
    p.add_argument("--trace", default=None, help="profile one real step with torch.profiler, write its chrome "
                   "trace here and print the measured exposed communication")
    p.add_argument("--compile", choices=["fx", "inductor"], default="fx", help="executor of the step graph")


def explain_main(args) -> None:
    import torch
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.data import SyntheticStream

    mesh = mesh_of(args)
    model, seq, mp = build_model(args, mesh)
    job = sw.compile(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), strategy=args.strategy, mesh=mesh,
                     mixed_precision=mp, link_profile=args.link_profile, compile=args.compile, **memory_kw(args),
                     **tp_kw(args))
    x, y = (t.to(mesh.device) for t in SyntheticStream(model.cfg.vocab, seq, args.batch, args.seed).get(0, mesh.rank("dp")))
    mem = job.predict_memory((x, y))  # before the first step: nothing has run yet
    job.time_optimizer = True
    job.step((x, y))
    job.step((x, y))
    if args.profile:
        job.profile_compute((x, y))
    pred = job.predict_step((x, y))
    text = job.explain()
    meas = None
    if args.trace:
        _, meas = job.profile_step((x, y), trace=args.trace if dist.get_rank() == 0 else None)
    from shardwise.runtime.memory import measure

    _, peak = measure(job, lambda: job.step((x, y)))
    if dist.get_rank() == 0:
        print(text)
        print(f"predicted step {pred['step_s'] * 1e3:.2f} ms = graph {pred['graph_s'] * 1e3:.2f} ms (compute "
              f"{pred['compute_source']}) + optimizer {pred['optimizer_s'] * 1e3:.2f} ms; measured last step "
              f"{job.last_step_s * 1e3:.2f} ms")
        print(f"predicted peak {size_text(mem['peak'])} per rank (resident {size_text(mem['peak'] - max(mem['graph_peak'], mem['optimizer_step'], mem['gather_back']) - mem['batch'])}"
              f" + step {size_text(max(mem['graph_peak'], mem['optimizer_step'], mem['gather_back']))}); measured {size_text(peak)}")
        if meas is not None:
            print(f"measured (torch.profiler): step {meas['step_s'] * 1e3:.2f} ms, exposed communication "
                  f"{meas['exposed_s'] * 1e3:.2f} ms ({meas['exposed_pct']:.1f}%); chrome trace: {args.trace}")
        if args.png:
            from shardwise.costmodel.plot import plot_timeline

            plot_timeline(pred["timeline"], args.png, f"{args.model}/{args.size} {args.strategy} ws={mesh.dp}")
            print(f"timeline: {args.png}")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


UNITS = {"B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
         "TB": 10**12}


def memory_size(text: str) -> int | float:
    """A ``--memory-budget``: a size with its unit (``20GiB``, ``512MiB``, ``1.5GB``: bytes), a fraction
    of the device's usable memory (``0.8``), or a bare number above 1 (GiB)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or (unit and unit not in UNITS):
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: give e.g. 20GiB, 512MiB, 1.5GB, or a "
                                         "fraction of the device's memory such as 0.8")
    v = float(m.group(1))
    if v <= 0:
        raise argparse.ArgumentTypeError(f"--memory-budget must be positive, got {text!r}")
    return int(v * UNITS[unit]) if unit else int(v * 2**30) if v > 1 else v


def memory_kw(args) -> dict:
    """compile() keywords of the shared memory flags."""
    budget = args.memory_budget
    return {"memory_budget": budget, "offload_optimizer": {None: False, "fit": True, "all": "all"}[args.offload_optimizer],
            "recompute": args.recompute, "offload_activations": args.offload_activations,
            "offload_host_update": args.host_update, "fused_optimizer": False if args.no_fused_optimizer else None,
            "overlap_update": args.overlap_update, "matmul_sm_carveout": args.matmul_sm_carveout}


def _host_share(v: str):
    if v == "auto":
        return v
    try:
        f = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a share in [0, 1], got {v!r}") from None
    if not 0 <= f <= 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a share in [0, 1], got {v!r}")
    return f or False


def carveout_arg(v: str):
    if v == "auto":
        return v
    if v in ("off", "0"):
        return None
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'off' or a number of SMs, got {v!r}") from None


def build_model(args, mesh, **overrides):
    """(model on the mesh's device, sequence length, precision policy) from the shared model flags."""
    import torch

    import shardwise as sw

    torch.manual_seed(args.seed)
    if getattr(args, "capacity_factor", None) is not None:
        if args.model != "moe":
            raise SystemExit(f"--capacity-factor sets the MoE's expert capacity: give it with --model moe, not {args.model}")
        overrides = {**overrides, "capacity_factor": args.capacity_factor}
    model = sw.models.build(args.model, args.size, **overrides)
    seq = args.seq or model.cfg.seq
    if seq > model.cfg.seq:
        raise SystemExit(f"--seq {seq} exceeds the model's maximum sequence length {model.cfg.seq}")
    if args.precision == "fp64":
        model = model.double()
    mp = sw.MixedPrecision(param_dtype=torch.bfloat16) if args.precision == "bf16" else None
    return model.to(mesh.device), seq, mp


def model_args(p) -> None:
    p.add_argument("--model", choices=["gpt", "llama", "moe"], default="gpt", help="built-in model (default gpt)")
    p.add_argument("--size", default="small", help="model preset: tiny, small, or a large shape (default small)")
    p.add_argument("--strategy", choices=["ddp", "zero1", "zero2", "zero3"], default="zero3", help="default zero3")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (default 2)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp64"], default="fp32",
                   help="fp32; bf16 = bf16 compute with fp32 master weights and fp32 reduction; fp64")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument("--capacity-factor", type=float, default=None, metavar="C",
                   help="--model moe: capacity dispatch, each expert taking C times its even share of the (token, "
                        "choice) pairs, the rest dropped (e.g. 1.25; what --ep splits); default: the preset's")
    p.add_argument("--memory-budget", type=memory_size, default=None, metavar="SIZE|FRACTION",
                   help="per-rank memory budget: a size (20GiB, 512MiB, 1.5GB; a bare number above 1 is GiB) or a "
                        "fraction of the device's usable memory (0.8); the plan keeps parameters gathered / "
                        "recomputes to fit, or stops with the numbers")
    p.add_argument("--offload-optimizer", nargs="?", const="fit", choices=["fit", "all"], default=None,
                   help="zero3: master weights and optimizer state in host memory, streamed for the update; "
                        "'fit' (the default when given) keeps on the device the part that fits, 'all' none")
    p.add_argument("--host-update", type=_host_share, default="auto", metavar="auto|0|SHARE",
                   help="with --offload-optimizer: the share of the offloaded state updated on the host's cores "
                        "(only gradients and weights cross the link); 'auto' (default): the cost model splits "
                        "it on CUDA; 0: none")
    p.add_argument("--recompute", action="store_true",
                   help="recompute cheap elementwise activations in the backward instead of keeping them")
    p.add_argument("--offload-activations", action="store_true",
                   help="keep the activations the backward reads in host memory between forward and backward")


def mesh_args(p) -> None:
    """The mesh of the jobs ``train`` and ``explain`` build: dp x tp over the ranks."""
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (adjacent ranks; --nproc / TP is the data-parallel size that "
                        "--strategy acts on): Megatron's column/row-parallel pairs found from the graph")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks: the experts of every MoE layer split over them, tokens sent to their "
                        "experts by all-to-all (the ep ranks take batches of their own, as dp ranks do)")
    p.add_argument("--ep-split", type=lambda v: int(v) if v.isdigit() else v, default=1, metavar="N|auto",
                   help="with --ep: each micro-batch as N interleaved parts (one's all-to-alls under another's "
                   "compute); auto: whole or in halves, the cost model's faster")
    p.add_argument("--sp", action="store_true",
                   help="with --tp: sequence parallelism (the residual stream and norms in sequence shards)")
    p.add_argument("--vocab-parallel", choices=["auto", "on", "off"], default="auto", help="with --tp: cut the untied "
                   "LM head by classes (on), keep it whole (off), or as the cost model predicts faster (auto, default)")
    p.add_argument("--tp-fuse", choices=["auto", "off", "ring", "kernel"], default="auto",
                   help="with --tp: products beside their tp collectives run fused with them (ring: decomposed, "
                        "any device; kernel: Triton over symmetric memory), or as the cost model predicts faster (auto)")
    p.add_argument("--init-timeout", type=float, default=300.0, metavar="S",
                   help="seconds the ranks wait for each other to join the process group (default 300)")


def mesh_of(args):
    import shardwise as sw

    if not args.init_timeout > 0:
        raise SystemExit(f"--init-timeout must be > 0 seconds, got {args.init_timeout}")
    if args.ep < 1 or args.tp < 1:
        raise SystemExit(f"--ep and --tp take a number of ranks >= 1, got --ep {args.ep} --tp {args.tp}")
    return sw.mesh(tp=args.tp if args.tp > 1 else None, ep=args.ep if args.ep > 1 else None,
                   init_timeout=args.init_timeout)


def tp_kw(args) -> dict:
    """compile() keywords of the tp and ep flags (``main`` has checked them)."""
    split = getattr(args, "ep_split", 1)
    return {**({"sequence_parallel": True} if args.sp else {}), **({"ep_split": split} if split != 1 else {}),
            **({"vocab_parallel": args.vocab_parallel == "on"} if args.vocab_parallel != "auto" else {}),
            **({"tp_fuse": args.tp_fuse} if args.tp > 1 else {})}


def optimizer_args(p) -> None:
    """Flags of the jobs ``train`` and ``explain`` build (bench sets them per system: ``shardwise:fused=0``)."""
    p.add_argument("--no-fused-optimizer", action="store_true",
                   help="step AdamW with torch's default kernel; by default shardwise uses the fused one on CUDA")
    p.add_argument("--overlap-update", action="store_true", help="zero3: update in chunks in forward order, on CUDA on "
                   "a stream of its own, the next step's forward starting while later chunks update")
    p.add_argument("--matmul-sm-carveout", type=carveout_arg, default="auto", metavar="auto|SMS|off",
                   help="CUDA: matrix products running beside a collective leave SMs free for its kernels; "
                        "auto (default): 32 where the cost model predicts a faster step; SMS: that many "
                        "wherever one runs beside a collective; off: every SM for the products")


def _bench_parser(sub) -> None:
    from shardwise.bench import SYSTEMS

    p = sub.add_parser(
        "bench", help="shardwise and its peers (torch.compile, DDP, FSDP2, DeepSpeed) on one model, in one run",
        description="Runs each system on the same built-in model, batch, precision and checkpointing setting, "
        "one after another on the same ranks, and writes JSON (step time, tokens/s per GPU, MFU, peak memory, "
        "exposed communication, shardwise's predictions) and a bar plot to --out. Under torchrun on GPUs it "
        "uses NCCL; otherwise it spawns --nproc gloo ranks on this machine.")
    model_args(p)
    mesh_args(p)
    p.add_argument("--systems", default="shardwise,shardwise-noopt,compile,ddp,fsdp2",
                   help=f"comma-separated, from: {', '.join(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per system (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system, compilation included (default 2)")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block, every system")
    p.add_argument("--compile", choices=["auto", "fx", "inductor"], default="auto",
                   help="shardwise's executor (auto: inductor on CUDA, fx on CPU)")
    p.add_argument("--out", default="bench/results", help="directory for the JSON and PNG (default bench/results)")
    p.add_argument("--name", default=None, help="run name (default: date-bench-model-size-wsN-device)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="CUDA: cap every system at this fraction of device memory, e.g. 0.2285 of an H200 = 32 GiB")
    p.add_argument("--append", action="store_true",
                   help="add the rows to the existing --name record (one sitting split over several commands)")
    p.add_argument("--link-profile", default=None,
                   help="shardwise's link profile: a JSON file from `shardwise calibrate` or a preset name")
    p.add_argument("--trace-dir", default=None,
                   help="write rank 0's chrome trace of each system's profiled step here (<system>.json.gz)")
    p.add_argument("--memory-sites", action="store_true",
                   help="CUDA: record one more step's allocations and list the blocks live at its peak by site")
    p.add_argument("--system-timeout", type=float, default=None, metavar="S",
                   help="stop a system whose warm-up runs past S seconds (checked after each warm-up step, "
                        "agreed by every rank); its row records why and the next system runs")


def bench_config(args):
    """The bench's configuration from the flags, validated (before any rank starts)."""
    from shardwise.bench import BenchConfig

    same = {f.name for f in dataclasses.fields(BenchConfig) if hasattr(args, f.name)} - {"systems", "vocab_parallel"}
    return BenchConfig(**{k: getattr(args, k) for k in same}, executor=args.compile,  # the flags named as its fields
                       systems=[s for s in args.systems.split(",") if s],
                       vocab_parallel=None if args.vocab_parallel == "auto" else args.vocab_parallel == "on")


def bench_main(args) -> None:
    import torch.distributed as dist

    from shardwise.bench import bench
    from shardwise.runtime.mesh import ensure_process_group

    cfg = bench_config(args)
    ensure_process_group(args.init_timeout)
    bench(cfg, args.out, args.name, command="shardwise " + " ".join(sys.argv[1:]), append=args.append)
    dist.barrier()
    dist.destroy_process_group()


def _calibrate_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="measure collective latency and bandwidth on this machine's process group",
        description="Times all-gather, reduce-scatter and all-reduce over message sizes on the current "
        "process group (gloo on spawned CPU ranks, NCCL under torchrun on GPUs, timed with CUDA events), "
        "fits alpha (latency) and bus bandwidth per collective, and writes a JSON profile that "
        "shardwise.compile(link_profile=PATH) and explain use.")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (default 2)")
    p.add_argument("--out", default="link_profile.json", help="where to write the profile (JSON)")
    p.add_argument("--min-bytes", type=int, default=1 << 10, help="smallest message (default 1 KiB)")
    p.add_argument("--max-bytes", type=int, default=1 << 24, help="largest message (default 16 MiB)")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per size (default 10)")
    p.add_argument("--name", default="measured", help="profile name")


def calibrate_main(args) -> None:
    import torch
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.costmodel import calibrate

    mesh = sw.mesh()
    sizes = [args.min_bytes * 4**i for i in range(64) if args.min_bytes * 4**i <= args.max_bytes]
    if len(sizes) < 2:
        raise SystemExit("calibrate: --max-bytes must be at least 4x --min-bytes (two sizes are needed to fit)")
    prof, samples = calibrate(mesh.group("dp"), mesh.device, sizes, args.iters, torch.float32, args.name)
    from shardwise.kernels import available

    if available(mesh.device):  # the fused tp kernels' product rate, per class (the slowest rank's)
        from shardwise.costmodel.fused import CALIBRATION_SHAPES, KERNEL_EFFICIENCY
        from shardwise.kernels.ag_gemm import product_share

        share = torch.tensor([product_share(*s, mesh.device) for s in CALIBRATION_SHAPES], device=mesh.device)
        dist.all_reduce(share, op=dist.ReduceOp.MIN)
        prof = dataclasses.replace(prof, fused=[[b, float(e)] for (b, _), e in zip(KERNEL_EFFICIENCY, share)])
    if dist.get_rank() == 0:
        prof.save(args.out)
        for k, rows in samples.items():
            print(k + ": " + "  ".join(f"{b / 1024:.0f}KiB {t * 1e6:.0f}µs" for b, t in rows))
        print(f"{prof}\nwrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="predict step time, memory per GPU and MFU of a job on a cluster (no GPU needed)",
        description="Predicts one optimizer step of a model on a cluster under a parallel strategy with "
        "shardwise's cost model: compute, tensor-parallel and data-parallel communication, pipeline bubble, "
        "optimizer; memory per GPU (weights, gradients, optimizer state, activations); tokens/s and MFU.")
    p.add_argument("--model", help="preset (llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, "
                   "gpt3-175b) or a Hugging Face config.json")
    p.add_argument("--cluster", help="NODE:COUNT, e.g. dgx-h100:32 (nodes of 8 GPUs); @WATTS caps power: dgx-h100:32@500W")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (inside a node)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage of the data-parallel axis")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: one micro-batch per rank)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--recompute", choices=["none", "selective", "selective-op", "block", "full"], default="selective",
                   help="selective: attention recomputed (Korthikanti); selective-op: torchtitan's per-op policy "
                   "(every other matrix product kept); block: torch.utils.checkpoint per layer (FSDP2, shardwise; "
                   "all of the layer's forward but its last product); full: each layer's whole forward (Megatron)")
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism with tensor parallelism")
    p.add_argument("--virtual", type=int, default=1, help="interleaved pipeline stages per GPU")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, default=None, help="Megatron-Core's MoE folding: the experts cut over etp ranks "
                   "(1: whole) and spread over ep x etp of a stage's tp x cp x dp ranks (default: cut as tp, ep in dp)")
    p.add_argument("--ep-overlap", action="store_true", help="each MoE all-to-all under another micro-batch's compute")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: each sequence cut over this many ranks (ring attention)")
    p.add_argument("--capacity", type=float, default=1.0, help="MoE expert capacity factor: experts compute on this "
                   "many times their routed tokens (capacity dispatch, e.g. 1.25; default 1: exact top-k)")
    p.add_argument("--onehot", action="store_true", help="MoE capacity dispatch by GShard's one-hot contractions "
                   "(MaxText's dense path): 2·d·E·C FLOPs a token into the experts' slots and out, and their gradients")
    p.add_argument("--shard", type=int, default=None,
                   help="hybrid sharding: ZeRO shards over groups of this many data-parallel ranks (e.g. a "
                        "node's GPUs) and the groups all-reduce their gradient shards (default: one group)")
    p.add_argument("--efficiency", type=float, default=None,
                   help="achieved fraction of peak FLOP/s (default: the accelerator's fitted curve)")
    p.add_argument("--network", default=None, metavar="bw=GB/s[,latency=us][,leaf=N,oversub=K]",
                   help="the fabric between nodes per GPU, in place of the preset's (RoCE, Ethernet, leaf-spine)")
    p.add_argument("--rank-order", choices=["tp-pp-dp", "tp-ep-dp-pp"], default="tp-pp-dp",
                   help="rank numbering, innermost first: Megatron-LM's (default) or Megatron-Core's")
    p.add_argument("--reduce-fp32", action="store_true", help="gradients kept and reduced in fp32")
    p.add_argument("--unfused-attention", action="store_true", help="no flash kernel: the scores kept for the backward")
    p.add_argument("--attention", choices=["triton-2022"], default=None, help="the attention kernel, where not the "
                   "device's own flash attention: triton-2022 (MosaicML MPT's Triton FlashAttention, attn_impl: triton)")
    p.add_argument("--eager", action="store_true",
                   help="the stack runs PyTorch eagerly: a rotary model's norms and rotary embedding unfused")
    p.add_argument("--stack", choices=["megatron", "torch", "torch-autocast"], default="megatron",
                   help="memory layout: Megatron's (16-bit weights and gradient buffers, fp32 master; default), "
                        "PyTorch's (FSDP2, DDP, shardwise: fp32 weights, gradients freed between steps), or "
                        "PyTorch's under torch.autocast")
    p.add_argument("--foreach", action="store_true",
                   help="torch's multi-tensor AdamW: about 20 passes over the fp32 state (fused: 7), an fp32 temporary")
    p.add_argument("--fp8", nargs="?", const="te", choices=["te", "torchao"], default=None,
                   help="the layers' products in FP8 (Hopper GPUs) by a recipe: te (Transformer Engine; the default) "
                   "or torchao (its Float8 training; the rest at the device's bf16 share)")
    p.add_argument("--framework", choices=["fsdp2", "shardwise"], default=None, help="count the data-parallel "
                   "runtime's own kernels: FSDP2's copy-in and copy-out as measured, or shardwise's buckets' by bytes")
    p.add_argument("--dispatch", choices=["alltoall", "deepep"], default="alltoall", help="MoE tokens to their "
                   "experts: an all-to-all of every routed copy, or DeepEP's (once to each rank and node reached)")
    p.add_argument("--routing", choices=["balanced", "contiguous"], default="balanced", help="experts a token picks: "
                   "at random, each as often; or token t to experts t·k..t·k+k-1")
    p.add_argument("--flushes", type=int, default=1, help="pipeline schedules a step, each filled and drained")
    p.add_argument("--head-stage", action="store_true", help="stages as NeMo AutoModel splits them: layers even over "
                   "pp x virtual, the remainder to the first, the output layer on the last (the fullest rank paces)")
    p.add_argument("--dropout", choices=["on", "off"], default=None, help="dropout masks kept (default: the model's)")
    p.add_argument("--tp-exposed", type=float, default=None, metavar="SHARE",
                   help="share of tp communication exposed (0: overlapped; default: all on GPUs, the dp share on TPUs)")
    p.add_argument("--dp-exposed", type=float, default=None, metavar="SHARE",
                   help="least share of dp communication exposed behind the backward (default 0.1; ZeRO-3 "
                        "without a pipeline: what its per-layer timeline waits)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--explain", action="store_true", help="print each term's formula with its numbers")
    p.add_argument("--sweep", default=None,
                   help="AXIS=V1,V2,... (cluster, model, tp, pp, zero, shard, micro-batch, global-batch, seq, recompute, "
                        "virtual): one estimate per value; or a built-in sweep: grad-sync, latency")
    p.add_argument("--png", default=None, help="with --sweep AXIS=...: write a plot there")
    p.add_argument("--search", action="store_true", help="the fastest layouts that fit --global-batch on --cluster, "
                   "and which shardwise runs today")
    p.add_argument("--search-space", action="append", default=[], metavar="AXIS=V1,V2",
                   help="with --search: keep an axis (tp, pp, virtual, micro-batch, zero, ep, cp, recompute) to these values")
    p.add_argument("--top", type=int, default=5, help="with --search: layouts to print (default 5)")
    p.add_argument("--validate", action="store_true",
                   help="print predictions against the published runs of the validation table (ignores the rest)")


def plan_main(args) -> None:
    import json

    from shardwise.planner.clusters import cluster
    from shardwise.planner.estimate import Strategy, estimate
    from shardwise.planner.models import model

    if args.validate:
        from shardwise.planner import validation as v

        print(v.summary(rows := v.table()), v.markdown(rows), v.vtrain_summary(v.vtrain_all()),
              v.collective_markdown(v.collective_table()), v.memory_markdown(v.memory_table()), sep="\n\n")
        return
    if args.sweep in ("grad-sync", "latency"):
        from shardwise.planner import sweep

        if args.sweep == "grad-sync" and not args.model:
            raise SystemExit("shardwise plan --sweep grad-sync: needs --model")
        rows = sweep.grad_sync(model(args.model)) if args.sweep == "grad-sync" else sweep.latency()
        print(json.dumps(rows, indent=1) if args.json else sweep.table(rows))
        return
    if not args.model or not args.cluster:
        raise SystemExit("shardwise plan: --model and --cluster are required (or --validate, --sweep grad-sync|latency)")
    try:
        m, c = model(args.model), cluster(args.cluster, args.network)
        if args.dropout is not None:
            m = dataclasses.replace(m, dropout=args.dropout == "on")
        for name in ("tp_exposed", "dp_exposed"):
            v = getattr(args, name)
            if v is not None and not 0 <= v <= 1:
                raise ValueError(f"--{name.replace('_', '-')} is a share of the communication, 0 to 1; got {v}")
        st = Strategy(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Strategy) if hasattr(args, f.name)},
                      sp=not args.no_sp, fused_attention=not args.unfused_attention)  # the flags named as its fields
        if args.search:
            return _plan_search(args, m, c, st)
        if args.sweep:
            from shardwise.planner import sweep

            key, values = sweep.parse(args.sweep)
            rows = sweep.run(key, values, m, args.cluster, st, args.network)
        else:
            e = estimate(m, c, st)
    except ValueError as err:
        raise SystemExit(f"shardwise plan: {err}") from None
    if args.sweep:
        print(json.dumps(rows, indent=1) if args.json else sweep.table(rows))
        if args.png:
            sweep.plot(rows, key, args.png, f"{m.name} on {args.cluster}, sweep over {key}")
            print(f"wrote {args.png}")
        return
    if args.json:
        print(json.dumps({"model": str(m), "cluster": str(c), "strategy": st.__dict__, **e.as_dict()}, indent=1))
        return
    gb = lambda x: f"{x / 1e9:.1f} GB"  # noqa: E731
    ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
    print(m)
    print(c)
    print(f"strategy: tp={st.tp} pp={st.pp} dp={e.dp} zero{st.zero}"
          + (f" sharded over groups of {st.shard}" if st.shard else "") + f", micro-batch {st.micro_batch} x "
          f"{e.micro_batches} per step, recompute {st.recompute}{', sp' if st.sp and st.tp > 1 else ''}"
          + (f", ep={st.ep}" if st.ep > 1 else "") + (f" etp={st.etp}" if st.etp and m.experts > 1 else "")
          + (f", cp={st.cp}" if st.cp > 1 else "")
          + (f", expert capacity {st.capacity:g}" if st.capacity != 1 else ""))
    tp = ms(e.tp_exposed_s) + (f" (of {ms(e.tp_comm_s)})" if e.tp_exposed_s < e.tp_comm_s else "")
    print(f"step {e.step_s:.3f} s = compute {ms(e.compute_s)} + exposed tensor-parallel comm {tp} + "
          + (f"expert all-to-all {ms(e.ep_exposed_s)} (of {ms(e.ep_comm_s)}) + " if st.ep > 1 else "")
          + (f"exposed context-parallel comm {ms(e.cp_exposed_s)} (of {ms(e.cp_comm_s)}) + " if st.cp > 1 else "") +
          f"pipeline bubble {ms(e.pp_bubble_s)} + exposed data-parallel comm {ms(e.dp_exposed_s)} "
          f"(of {ms(e.dp_comm_s)}) + optimizer {ms(e.optimizer_s)}")
    print(f"tokens/s {e.tokens_per_s:,.0f} ({e.tokens_per_s_per_gpu:,.0f} per GPU), MFU {e.mfu:.1%}")
    mem = e.memory
    print(f"memory per GPU {gb(mem['total'])} of {gb(c.accel.hbm_bytes)}{'' if e.fits else ' (DOES NOT FIT)'}: "
          f"weights {gb(mem['weights'])}, grads {gb(mem['grads'])}, optimizer {gb(mem['optimizer'])}, "
          f"activations {gb(mem['activations'])}")
    if not e.fits and st.global_batch is not None:
        from shardwise.planner.search import describe, search

        top, _ = search(m, c, st, top=1)
        print(f"fits instead: {describe(top[0].strategy)}, step {top[0].estimate.step_s:.3f} s, memory per GPU "
              f"{gb(top[0].estimate.memory['total'])} (plan --search lists more)" if top else
              "no layout of this batch fits this cluster: plan --search says on how many nodes one does")
    if args.explain:
        print("formulas:")
        for line in e.formulas:
            print("  " + line)


def _plan_search(args, m, c, st) -> None:
    """``plan --search``: the fastest layouts that fit, or, where none does, what would."""
    import json

    from shardwise.planner.search import describe, runs_on_shardwise, search, to_fit
    from shardwise.planner.sweep import parse

    space = dict(parse(spec) for spec in args.search_space)
    if set(space) - {"tp", "pp", "virtual", "micro_batch", "zero", "ep", "cp", "recompute"}:
        raise SystemExit(f"shardwise plan: --search-space {args.search_space}: an AXIS=V1,V2 of tp, pp, virtual, "
                         "micro-batch, zero, ep, cp, recompute")
    top, info = search(m, c, st, top=args.top, space=space)
    rows = [{"layout": describe(f.strategy), "step_s": f.estimate.step_s, "mfu": f.estimate.mfu,
             "memory_gb": f.estimate.memory["total"] / 1e9, "tokens_per_s_per_gpu": f.estimate.tokens_per_s_per_gpu,
             "shardwise": runs_on_shardwise(f.strategy)} for f in top]
    if args.json:
        print(json.dumps({"model": str(m), "cluster": str(c), "weighed": info["weighed"], "fit": info["fit"],
                          "seconds": info["seconds"], "top": rows}, indent=1))
        return
    print(f"{m}\n{c}\nsearched {info['weighed']} layouts of global batch {st.global_batch} in {info['seconds']:.1f} s; "
          f"{info['fit']} fit in {c.accel.hbm_bytes / 1e9:.0f} GB per GPU")
    why = "not yet (pp, hybrid shard, cp, fp8 or recompute)"
    for i, r in enumerate(rows, 1):
        print(f"{i:2d}. {r['layout']:55s} step {r['step_s']:.3f} s  MFU {r['mfu']:.1%}  {r['memory_gb']:.1f} GB  "
              f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU  shardwise: {r['shardwise'] or why}")
    if not rows:
        least = info["least"]
        if least is not None:
            print(f"none fits: the least memory is {least.estimate.memory['total'] / 1e9:.1f} GB per GPU "
                  f"({describe(least.strategy)})")
        more = to_fit(m, args.cluster, st, space=space, fabric=args.network)
        print(f"fits on {more[0]}: {describe(more[1].strategy)}, step {more[1].estimate.step_s:.3f} s, "
              f"{more[1].estimate.memory['total'] / 1e9:.1f} GB per GPU" if more else
              "no cluster of up to 64 times these nodes fits it: a smaller global batch or sequence would")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise", description="A compiler for distributed PyTorch training.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    from .cli_train import check_train_args, train_main, train_parser

    train_parser(sub)
    _explain_parser(sub)
    _calibrate_parser(sub)
    _bench_parser(sub)
    _plan_parser(sub)
    args = parser.parse_args(argv)
    if args.cmd == "plan":  # a prediction: no processes, no devices
        plan_main(args)
        return 0
    if args.cmd == "bench":
        if args.precision == "fp64":
            parser.error("bench: --precision must be fp32 or bf16")
        if args.ep > 1:
            parser.error("bench: --ep would apply to every system, and the peers have no expert parallelism: give it "
                         "to shardwise's rows as a system option, e.g. --systems shardwise,shardwise:ep=2,fsdp2")
    try:  # bad systems, options and settings (the bench's, --ep-split by the job's own check) told before any rank
        if args.cmd == "bench":
            bench_config(args)
        JobConfig(ep_split=getattr(args, "ep_split", 1))
    except ValueError as e:
        parser.error(str(e))
    if args.cmd == "train":
        check_train_args(parser, args)
    tp_only = [f"{f} {what} the tensor-parallel ranks: give --tp N (N > 1)" for f, what, on in (
        ("--sp", "shards the sequence over", getattr(args, "sp", False)),
        ("--vocab-parallel", "cuts the LM head over", getattr(args, "vocab_parallel", "auto") != "auto"),
        ("--tp-fuse", "fuses products with the collectives of", getattr(args, "tp_fuse", "auto") != "auto")) if on]
    if getattr(args, "tp", 1) <= 1 and tp_only:  # told here, before any rank starts
        parser.error(tp_only[0])
    if getattr(args, "ep_split", 1) != 1 and getattr(args, "ep", 1) <= 1:
        parser.error("--ep-split splits the batch for expert parallelism: give --ep N (N > 1) with it")
    fn = {"train": train_main, "explain": explain_main, "calibrate": calibrate_main, "bench": bench_main}[args.cmd]
    from shardwise.runtime.launch import spawn, under_launcher

    fn(args) if under_launcher() else spawn(fn, args.nproc, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
