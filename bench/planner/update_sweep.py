"""What FSDP2 costs on one GPU beside the step's own compute: its optimizer step over sharded (DTensor) parameters
against the same AdamW over plain tensors, fused and multi-tensor, and its copy-in/copy-out kernels of one forward and
backward; the measurements the planner's ``framework = "fsdp2"`` term and its update passes are checked on. Per case:
the update's time, its CUDA kernels, and the passes over the fp32 parameter bytes that time comes to at the measured
copy rate; the copy kernels' time and the bytes per parameter they come to. Run on a GPU:
    python bench/planner/update_sweep.py OUT.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from fsdp2_ranks import built, copy_rate, each_in_a_process, is_copy, profiled  # this folder's
from gemm_sweep import timed  # this folder's: CUDA-event time of a call after warm-ups


CASES = [("llama", "8b", 4, 1024), ("moe", "8x7b-8l", 1, 1024)]  # (model, preset, layers, tokens)


def kernels(fn) -> dict[str, float]:
    """Seconds per CUDA kernel name of one call of ``fn``."""
    return {k: secs for k, (_, secs) in profiled(fn).items()}


def count(fn) -> int:
    return sum(n for n, _ in profiled(fn).values())


def case(name, size, layers, tokens, fsdp, kernel, copy_bw):
    model = built(name, size, layers, fsdp)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if kernel == "fused" else {"foreach": True}))
    vocab = model.cfg.vocab
    x = torch.randint(0, vocab, (1, tokens), device="cuda")

    def fwd_bwd():
        with torch.autocast("cuda", torch.bfloat16, enabled=not fsdp):
            loss = model(x, x)
        loss.backward()

    fwd_bwd()
    row = {"model": f"{name} {size} x{layers} layers", "fsdp2": fsdp, "kernel": kernel, "params": params}
    row["update_s"] = timed(opt.step, reps=5)
    row["update_kernels"] = count(opt.step)
    row["update_passes"] = row["update_s"] * copy_bw / (4.0 * params)
    if fsdp:
        per = kernels(fwd_bwd)
        copies = {k: v for k, v in per.items() if is_copy(k)}
        row["copy_kernels"] = {k[:80]: v for k, v in sorted(copies.items(), key=lambda kv: -kv[1])[:6]}
        row["copy_s"] = sum(copies.values())
        row["copy_bytes_per_param"] = row["copy_s"] * copy_bw / params
    return row


def one(i: int) -> None:
    """Case ``i`` of the sweep (model, FSDP2 or not, kernel) in this process: one JSON line."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    copy_bw = copy_rate()
    name, size, layers, tokens = CASES[i // 4]
    print(json.dumps({**case(name, size, layers, tokens, bool(i % 4 // 2), ("fused", "foreach")[i % 2], copy_bw),
                      "copy_bw": copy_bw}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--case":
        one(int(sys.argv[2]))
    else:
        each_in_a_process(__file__, range(4 * len(CASES)), sys.argv[1], "python bench/planner/update_sweep.py")
