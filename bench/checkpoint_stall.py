"""Checkpoint cost at a real model's size (issue 23): blocking save, async save's stall, load.

One rank (zero3 over dp=1) trains the built-in Llama at the 1.1B shape in bf16 compute with fp32
master weights and AdamW state (16 bytes a parameter on disk). Measured: the steady step; a blocking
``job.save``; ``job.save(blocking=False)``, twice: how long the call took, how much longer the next step took
(its update waits for the copy to host memory, which overlaps its forward and backward), the steps
run while the files are written and their median time, the time until rank 0 published the
checkpoint; ``job.load``. Each checkpoint is removed after it is measured.

    python bench/checkpoint_stall.py --size 1b --out bench/results/DATE-h200-checkpoint-llama1b.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dir", default="/tmp/shardwise-ckpt-bench")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import shardwise as sw
    from shardwise.data import SyntheticStream
    from shardwise.models import build

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = sw.mesh(dp=1, device=dev)
    torch.manual_seed(0)
    with torch.device(dev):
        model = build("llama", args.size)
    n = sum(p.numel() for p in model.parameters())
    job = sw.compile(model, strategy="zero3", mesh=mesh,
                     mixed_precision=sw.MixedPrecision(param_dtype="bf16") if dev == "cuda" else None)
    data = SyntheticStream(model.cfg.vocab, args.seq, args.batch)
    step_no = [0]

    def step() -> float:
        x, y = (t.to(dev) for t in data.get(step_no[0], 0))
        step_no[0] += 1
        t0 = time.perf_counter()
        job.step((x, y))
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    base = sorted(step() for _ in range(5))[2]
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "step")
    t0 = time.perf_counter()
    job.save(path)
    blocking = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    t0 = time.perf_counter()
    job.load(path)
    load = time.perf_counter() - t0
    shutil.rmtree(path)
    saves, same = [], None
    for k in range(2):  # the second reuses the stager's host buffers (pinned on CUDA)
        snap = job.full_state_dict() if k == 1 else None  # the weights the checkpoint must hold
        t0 = time.perf_counter()
        pending = job.save(path, blocking=False)
        call = time.perf_counter() - t0
        during = [step()]  # its update waits until the state is copied to host memory
        while not pending.done():
            during.append(step())
        pending.wait()
        published = time.perf_counter() - t0
        job.wait_saves()
        if snap is not None:  # the steps during the write changed the weights; the checkpoint must not
            job.load(path)
            same = all(torch.equal(a, snap[k]) for k, a in job.full_state_dict().items())
        shutil.rmtree(path)
        saves.append({"call_s": call, "first_step_s": during[0], "stall_s": call + max(0.0, during[0] - base),
                      "published_s": published, "steps_during_write": len(during),
                      "median_step_s_during_write": sorted(during)[len(during) // 2]})
    shutil.rmtree(args.dir, ignore_errors=True)
    rec = {
        "what": "checkpoint save/load cost (bench/checkpoint_stall.py)",
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "model": f"llama/{args.size}", "params": n, "batch": f"{args.batch}x{args.seq}", "strategy": "zero3 dp=1",
        "checkpoint_bytes": size,
        "step_s": base,
        "blocking_save_s": blocking,
        "blocking_save_GBps": size / blocking / 1e9,
        "load_s": load,
        "async_saves": saves,
        "async_checkpoint_holds_the_weights_at_its_save": same,
    }
    print(json.dumps(rec, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
