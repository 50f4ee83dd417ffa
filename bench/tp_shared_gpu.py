"""Tensor parallelism at a real model's width on one GPU (issue 22): ranks over gloo sharing the GPU.

One GPU cannot host two NCCL ranks, so this measures what does not need two GPUs: the per-rank peak
(each process's own CUDA allocator, ``max_memory_allocated``) against shardwise's prediction for the
tp-local program, how it falls from tp=1 to tp=2 and with sequence parallelism, the losses against
the same model trained on one rank, and the cost model's choice of the LM head. Step times of the
gloo ranks are not speed (host-staged collectives) and are not reported.

    python bench/tp_shared_gpu.py --size 8b --layers 2 --batch 1 --seq 4096 --out OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, ws: int, store: str, args, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=1800))
    import shardwise as sw
    from shardwise.data import SyntheticStream
    from shardwise.models import build
    from shardwise.runtime.memory import measure

    dev = args.device
    cuda = dev == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    with torch.device(dev):
        model = build("llama", args.size, n_layer=args.layers)
    tp = ws if ws > 1 else None
    job = sw.compile(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), strategy="zero3",
                     mesh=sw.mesh(tp=tp, device=dev), mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16),
                     **({"sequence_parallel": True} if args.sp and tp else {}))
    data = SyntheticStream(model.cfg.vocab, args.seq, args.batch, 0)
    batches = [tuple(t.to(dev) for t in data.get(i, 0)) for i in range(args.steps)]
    losses = [float(job.step(batches[0]))]
    pred = job.predict_memory(batches[1])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    loss, peak = measure(job, lambda: float(job.step(batches[1])))
    losses.append(loss)
    losses += [float(job.step(b)) for b in batches[2:]]
    prog = job.programs()[0]
    row = {"ranks": ws, "sp": bool(args.sp and tp), "losses": losses, "peak_gb": peak / 1e9,
           "pred_peak_gb": pred["peak"] / 1e9, "pred_graph_peak_at": pred["graph_peak_at"],
           "peak_err_pct": 100 * (pred["peak"] - peak) / peak,
           "param_gb": sum(t.numel() * t.element_size() for t in job.state.opt_tensors.values()) / 1e9,
           "collectives": {axis: prog.counts(axis) for axis in ("dp", "tp")},
           "head_choice": job.tp.head_choice if job.tp else None}
    if rank == 0:
        q.put(row)
    dist.barrier()
    dist.destroy_process_group()


def run(ws: int, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [ctx.Process(target=_rank, args=(r, ws, store, args, q)) for r in range(ws)]
    for p in procs:
        p.start()
    row = q.get(timeout=3000)
    for p in procs:
        p.join()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cuda", help="cuda (the GPU the ranks share), or cpu for a smoke run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rec = {"command": "python bench/tp_shared_gpu.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
           "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__, "rows": []}
    for ws, sp in ((1, False), (2, False), (2, True)):
        args.sp = sp
        rec["rows"].append(run(ws, args))
        print(json.dumps(rec["rows"][-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
