"""``shardwise`` command line: train (more subcommands join as their issues land)."""

from __future__ import annotations

import argparse
import sys
import time


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a built-in model with a sharding strategy",
        description="Train a built-in model. Spawns --nproc gloo ranks on this machine unless run under "
        "torchrun, where it uses NCCL on GPUs. One line per step on rank 0: loss (mean over ranks), tokens/s, "
        "per-rank peak memory (CUDA max allocated; on CPU the MemTracker live-tensor peak, measured every "
        "--mem-every steps and marked with the step it was measured at), bytes each rank sent.",
    )
    p.add_argument("--model", choices=["gpt", "llama", "moe"], default="gpt", help="built-in model (default gpt)")
    p.add_argument("--size", default="small", help="model preset: tiny, small, or a large shape (default small)")
    p.add_argument("--strategy", choices=["ddp", "zero1", "zero2", "zero3"], default="zero3", help="default zero3")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (default 2)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp64"], default="fp32",
                   help="fp32; bf16 = bf16 compute with fp32 master weights and fp32 reduction; fp64")
    p.add_argument("--compile", choices=["fx", "inductor"], default="fx", help="executor of the step graph")
    p.add_argument("--data", default=None, help="train byte-level on this text file (default: synthetic stream)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument("--mem-every", type=int, default=10,
                   help="on CPU, measure the live-tensor peak with MemTracker every K steps (default 10)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA under torchrun when present, CPU for spawned ranks")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def train_main(args) -> None:
    import torch
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.data import ByteFile, SyntheticStream
    from shardwise.runtime.memory import measure

    if args.device == "cpu":
        import os

        os.environ["SHARDWISE_BACKEND"] = "gloo"
    mesh = sw.mesh()
    rank, ws = dist.get_rank(), dist.get_world_size()
    over = {"vocab": 256} if args.data else {}
    torch.manual_seed(args.seed)
    model = sw.models.build(args.model, args.size, **over)
    seq = args.seq or model.cfg.seq
    if seq > model.cfg.seq:
        raise SystemExit(f"--seq {seq} exceeds the model's maximum sequence length {model.cfg.seq}")
    if args.precision == "fp64":
        model = model.double()
    model = model.to(mesh.device)
    mp = sw.MixedPrecision(param_dtype=torch.bfloat16) if args.precision == "bf16" else None
    job = sw.compile(
        model,
        optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.1),
        strategy=args.strategy,
        mesh=mesh,
        mixed_precision=mp,
        compile=args.compile,
    )
    if args.data:
        data = ByteFile(args.data, seq, args.batch, rank, ws, args.seed)
    else:
        data = SyntheticStream(model.cfg.vocab, seq, args.batch, args.seed)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"shardwise train: {args.model}/{args.size} ({n / 1e6:.2f} M params) {args.strategy} on {mesh}, "
              f"batch {args.batch}x{seq} per rank, {args.precision}, executor {args.compile}", flush=True)
    peak, peak_step, first = None, None, None
    for step in range(args.steps):
        x, y = (t.to(mesh.device) for t in data.get(step, rank))
        t0 = time.perf_counter()
        on_cpu = mesh.device.type == "cpu"
        if not on_cpu or step == 1 or (args.mem_every and step % args.mem_every == 0 and step > 0):
            loss, peak = measure(job, lambda: job.step((x, y)))
            peak_step = step + 1
        else:
            loss = job.step((x, y))
        loss_v = float(loss)
        dt = time.perf_counter() - t0
        peaks = torch.tensor([peak if peak is not None else -1], dtype=torch.int64)
        allp = [torch.zeros_like(peaks) for _ in range(ws)]
        dist.all_gather(allp, peaks, group=job.ctrl)
        if first is None:
            first = loss_v
        if rank == 0:
            mem = " ".join(_fmt_bytes(int(p)) if int(p) >= 0 else "-" for p in allp)
            mem += "" if peak_step in (None, step + 1) else f" @step {peak_step}"
            tok_s = args.batch * seq * ws / dt
            print(f"step {step + 1:4d}/{args.steps}  loss {loss_v:.4f}  tok/s {tok_s:9,.0f}  "
                  f"{dt * 1e3:7.1f} ms  peak/rank [{mem}]  sent/rank {_fmt_bytes(job.last_comm_bytes)}", flush=True)
    if rank == 0:
        print(f"done: loss {first:.4f} -> {loss_v:.4f} over {args.steps} steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise", description="A compiler for distributed PyTorch training.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _train_parser(sub)
    args = parser.parse_args(argv)
    if args.cmd == "train":
        from shardwise.runtime.launch import spawn, under_launcher

        if under_launcher():
            train_main(args)
        else:
            spawn(train_main, args.nproc, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
