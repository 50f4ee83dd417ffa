"""``shardwise train``: its options, the checks made before any rank starts, and the loop each rank runs
(steps, measurements, checkpoints, evaluation, export)."""

from __future__ import annotations

import os
import sys
import time

from .cli import build_model, memory_kw, mesh_args, mesh_of, model_args, optimizer_args, tp_kw
from .errors import BudgetError, size_text


def train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a built-in model with a sharding strategy",
        description="Train a built-in model. Spawns --nproc gloo ranks on this machine unless run under torchrun, "
        "where it uses NCCL on GPUs. One line per step on rank 0: loss (mean over ranks), tokens/s, per-rank peak "
        "memory (CUDA max allocated; on CPU the MemTracker live-tensor peak, measured every --mem-every steps and "
        "marked with the step it was measured at), bytes each rank sent, the cost model's predicted step time (compute "
        "measured per node after step 2) and the exposed communication measured with torch.profiler at step 3.")
    model_args(p)
    optimizer_args(p)
    mesh_args(p)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (default 3e-3)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step, each of --batch sequences per rank (default 1)")
    p.add_argument("--clip", type=float, default=None,
                   help="clip the global gradient norm to this value; the step line shows the norm before clipping")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="cosine: linear warm-up over --warmup steps, then cosine decay to 10%% at --steps")
    p.add_argument("--warmup", type=int, default=0, help="warm-up steps of the cosine schedule (default 0)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="every K steps, the loss on held-out batches (eval mode, no state change); 0: never")
    p.add_argument("--export", default=None, help="after training, write the consolidated weights (keys of "
                   "model.state_dict()) to this file with torch.save, atomically")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write sharded checkpoints (DCP) to DIR/step-N: model, optimizer, LR schedule, step, RNG "
                        "and data position; each published by rename once complete")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="save every K steps (default 0: after the last step only)")
    p.add_argument("--checkpoint-keep", type=int, default=2, metavar="N",
                   help="keep the N newest checkpoints in DIR (default 2; 0 keeps all)")
    p.add_argument("--checkpoint-sync", action="store_true",
                   help="save blocking (default: asynchronously; the step waits only for the copy to host memory)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir, on any number of ranks")
    p.add_argument("--timeout", type=float, default=100.0, metavar="S",
                   help="seconds a step may wait on other ranks (six times that while compiling); a rank that waits "
                        "longer names the rank that failed or stalled and the step, and every rank exits (default 100)")
    p.add_argument("--compile", choices=["fx", "inductor"], default="fx", help="executor of the step graph")
    p.add_argument("--data", default=None, help="train byte-level on this text file (default: synthetic stream)")
    p.add_argument("--mem-every", type=int, default=10,
                   help="on CPU, measure the live-tensor peak with MemTracker every K steps (default 10)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA under torchrun when present, CPU for spawned ranks")


def check_train_args(parser, args) -> None:
    """Told before any rank starts: bad counts, and checkpoints that would be lost or are not there."""
    for flag in ("grad_accum", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.checkpoint_every < 0 or args.checkpoint_keep < 0:
        parser.error("--checkpoint-every and --checkpoint-keep must be >= 0")
    if not args.checkpoint_dir:
        if args.resume or args.checkpoint_every:
            parser.error(f"{'--resume' if args.resume else '--checkpoint-every'} needs --checkpoint-dir DIR")
        return
    from shardwise.runtime.checkpoint import latest

    last = latest(args.checkpoint_dir)
    if args.resume and last is None:
        parser.error(f"--resume: no published checkpoint in {args.checkpoint_dir!r} (no step-N folder with its "
                     "metadata); drop --resume to start a new run there")
    if not args.resume and last is not None:
        parser.error(f"{args.checkpoint_dir!r} already holds {os.path.basename(last)}: pass --resume to continue "
                     "from it, or give another --checkpoint-dir (a new run would replace its checkpoints)")


def save_atomic(obj, path: str) -> None:
    """torch.save to a temporary file beside ``path``, then rename: a reader never sees half a file."""
    import tempfile

    import torch

    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def train_main(args) -> None:
    import torch
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.data import ByteFile, SyntheticStream
    from shardwise.recipes import adamw_groups, cosine_with_warmup
    from shardwise.runtime.checkpoint import latest, prune
    from shardwise.runtime.memory import measure

    if args.device == "cpu":
        os.environ["SHARDWISE_BACKEND"] = "gloo"
    mesh = mesh_of(args)
    rank = dist.get_rank()
    drank, dws = mesh.batch_rank(), mesh.batch_ranks  # the ranks of one tp group read the same batches
    model, seq, mp = build_model(args, mesh, **({"vocab": 256} if args.data else {}))
    job = sw.compile(model, optimizer=lambda named: adamw_groups(named, lr=args.lr, weight_decay=0.1),
                     strategy=args.strategy, mesh=mesh, mixed_precision=mp, compile=args.compile,
                     clip_grad_norm=args.clip, timeout=args.timeout, **memory_kw(args), **tp_kw(args))
    job.replan_at = 4  # steps 2 and 3 are measured and profiled by this loop itself
    sched = cosine_with_warmup(job.optimizer, args.warmup, args.steps) if args.lr_schedule == "cosine" else None
    data = (ByteFile(args.data, seq, args.batch, drank, dws, args.seed) if args.data
            else SyntheticStream(model.cfg.vocab, seq, args.batch, args.seed))
    n = sum(p.numel() for p in model.parameters())
    start, pos, resumed = 0, 0, None  # pos: the next micro-batch index of the data stream
    if args.resume:
        path = latest(args.checkpoint_dir)
        meta = job.load(path, extra={"scheduler": sched} if sched is not None else None)
        start, pos = meta["steps"], meta["extra"]["data"]["position"]
        tp_was = f" x tp={meta['tp']}" if meta.get("tp", 1) > 1 else ""
        resumed = (f"resumed from {path}: step {start}, data position {pos}, saved by {meta['world']} ranks "
                   f"({meta['strategy']}, dp={meta['ranks']}{tp_was})")
        if start >= args.steps:
            if rank == 0:
                print(f"nothing to do: the checkpoint is at step {start} and --steps is {args.steps}", flush=True)
            dist.barrier()
            dist.destroy_process_group()
            return

    plan = None
    if args.grad_accum == 1:
        try:  # compiles the step program: the plan and its predicted peak exist before step 1
            plan = job.predict_memory(tuple(t.to(mesh.device) for t in data.get(pos, drank)))
        except BudgetError as e:
            if rank == 0:
                print(f"shardwise train: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    if rank == 0:
        print(f"shardwise train: {args.model}/{args.size} ({n / 1e6:.2f} M params) {args.strategy} on {mesh}, "
              f"batch {args.batch}x{seq} per rank, {args.precision}, executor {args.compile}", flush=True)
        if resumed:
            print(resumed, flush=True)
    if rank == 0 and plan is not None:
        prog = job.programs()[0]
        extra = ""
        if job.memory_budget is not None:
            extra += f" under a budget of {size_text(job.memory_budget)}"
        if prog.unsharded:
            extra += f"; {len(prog.unsharded)} parameters kept gathered"
        if prog.recomputed:
            extra += f"; {len(prog.recomputed)} activations recomputed"
        if prog.offloaded:
            extra += f"; {len(prog.offloaded)} activations kept in host memory"
        st = job.state.streamer
        if st is not None:
            parts = ([f"{size_text(st.host_bytes())} on the host (streamed)"] if st.host_bytes() else []) + \
                ([f"{size_text(st.device_bytes())} on the device"] if st.device_bytes() else [])
            extra += "; optimizer state " + ", ".join(parts) + (
                " (the first steps' measured peak decides what stays on the device)" if job.plan.residency_pending else "")
        print(f"plan: predicted peak {size_text(plan['peak'])} per rank{extra}", flush=True)
    peak, peak_step, first = None, None, None
    exposed, pred_ms = None, None
    k = args.grad_accum
    def checkpoint(step: int) -> None:
        path = f"{args.checkpoint_dir}/step-{step:08d}"
        extra = {"data": {"position": pos, "kind": "file" if args.data else "synthetic", "seed": args.seed}}
        if sched is not None:
            extra["scheduler"] = sched
        t0 = time.perf_counter()
        out = job.save(path, extra=extra, blocking=args.checkpoint_sync)
        stall = time.perf_counter() - t0
        if rank == 0:
            print(f"checkpoint after step {step}: {path} (the step waited {stall * 1e3:.0f} ms"
                  f"{'' if args.checkpoint_sync else '; written in the background'})", flush=True)
            if args.checkpoint_keep and not args.checkpoint_sync:
                out._future.add_done_callback(lambda f: prune(args.checkpoint_dir, args.checkpoint_keep))
            elif args.checkpoint_keep:
                prune(args.checkpoint_dir, args.checkpoint_keep)

    for step in range(start, args.steps):
        micro = [tuple(t.to(mesh.device) for t in data.get(pos + m, drank)) for m in range(k)]
        pos += k
        batch = micro if k > 1 else micro[0]
        t0 = time.perf_counter()
        ran = step - start  # steps this run has taken before this one
        if ran == 2:
            # one step under torch.profiler: the measured exposed communication of the step line
            loss, prof = job.profile_step(batch)
            exposed, exposed_step = prof["exposed_pct"], step + 1
        elif mesh.device.type != "cpu" or ran == 1 or (args.mem_every and step % args.mem_every == 0 and ran > 0):
            loss, peak = measure(job, lambda: job.step(batch))
            peak_step = step + 1
        else:
            loss = job.step(batch)
        lr = job.optimizer.param_groups[0]["lr"]
        if sched is not None:
            sched.step()
        loss_v = float(loss)
        dt = time.perf_counter() - t0
        if ran == 1 and k == 1:
            job.profile_compute(batch)  # measured compute (max over ranks) for the prediction
            pred_ms = job.predict_step(batch)["step_s"] * 1e3
        peaks = torch.tensor([peak if peak is not None else -1], dtype=torch.int64)
        allp = [torch.zeros_like(peaks) for _ in range(dist.get_world_size())]
        dist.all_gather(allp, peaks, group=job.ctrl)
        first = loss_v if first is None else first
        if rank == 0:
            mem = ""  # until a step is measured (on CPU, the second), no peak to show
            if peak_step is not None:
                at = "" if peak_step == step + 1 else f" @step {peak_step}"
                mem = "  peak/rank [" + " ".join(size_text(int(p)) for p in allp) + at + "]"
            tok_s = args.batch * seq * dws * k / dt
            extra = f"  lr {lr:.2e}" if sched is not None else ""
            if job.last_grad_norm is not None:
                extra += f"  gnorm {float(job.last_grad_norm):.3f}"
            if pred_ms is not None:
                extra += f"  pred_step {pred_ms:.1f} ms"
            if exposed is not None:
                extra += f"  exposed_comm {exposed:.0f}% @step {exposed_step}"
            top = max(int(p) for p in allp)
            if job.memory_budget is not None and peak_step == step + 1 and top > job.memory_budget:
                extra += f"  peak over the budget: {size_text(top)} > {size_text(job.memory_budget)}"
            if job.last_compiles:
                extra += f"  compiled a program for this batch shape ({sum(c[2] for c in job.last_compiles):.1f} s)"
            print(f"step {step + 1:4d}/{args.steps}  loss {loss_v:.4f}  tok/s {tok_s:9,.0f}  "
                  f"{dt * 1e3:7.1f} ms{mem}  sent/rank {size_text(job.last_comm_bytes)}{extra}", flush=True)
        if rank == 0 and job.replans and job.replans[-1]["step"] == step + 1:
            r = job.replans[-1]
            over = f", over the budget of {size_text(r['budget'])}" if r["over_budget"] else ""
            print(f"re-plan after step {step + 1}: measured peak {size_text(r['measured'])}{over} vs predicted "
                  f"{size_text(r['predicted'])}; holding back {size_text(r['held_back'])}", flush=True)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            # held-out batches: indices no training step draws
            ev = [float(job.eval_step(tuple(t.to(mesh.device) for t in data.get(10**9 + i, drank)))) for i in range(2)]
            if rank == 0:
                print(f"eval after step {step + 1}: loss {sum(ev) / len(ev):.4f}", flush=True)
        if args.checkpoint_dir and ((args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)
                                    or step + 1 == args.steps):
            checkpoint(step + 1)
    if args.checkpoint_dir:
        job.wait_saves()
    if rank == 0:
        print(f"done: loss {first:.4f} -> {loss_v:.4f} over steps {start + 1}..{args.steps}", flush=True)
    if args.export:
        sd = job.full_state_dict()  # every rank takes part; rank 0 receives the weights
        if rank == 0:
            save_atomic(sd, args.export)
            print(f"exported {len(sd)} tensors to {args.export}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
