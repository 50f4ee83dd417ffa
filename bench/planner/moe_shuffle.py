"""An MoE layer's token shuffles on one GPU, against the planner's count of their bytes (planner/estimate.py
``SHUFFLE_BYTES``): each routed copy of a token gathered into expert order, and read back to be weighted and summed
into its token (6·k·d bytes a token in the forward, bf16); where an all-to-all delivers the copies by source rank, a
sort by local expert after it and back before the combine (8·k·d more); the backward twice the forward. Per shape: the
forward and forward + backward of both, timed with CUDA events, beside the planner's time for the same bytes (the
device's HBM bandwidth at the planner's memory-bound share). Run on a GPU:
    python bench/planner/moe_shuffle.py OUT.json
"""

import json
import sys

import torch

from gemm_sweep import timed  # this folder's: CUDA-event time of a call after warm-ups

from shardwise.costmodel.devices import cuda_device
from shardwise.planner.estimate import SHUFFLE_BYTES

SHAPES = [("qwen3-30b-a3b", 2048, 128, 8), ("qwen3-235b-a22b", 4096, 128, 8), ("deepseek-v3", 7168, 256, 8)]
TOKENS, RANKS = 4096, 8  # a micro-batch's tokens on one rank; the ep ranks a sort spreads the experts over


def shuffles(x, w, src, back, sort, unsort):
    """Each routed copy gathered into expert order (``src``: the token of each copy; with the all-to-all's sort and
    unsort between), then put back in token order (``back``), weighted and summed into its token."""
    t, k = w.shape
    y = x[src]  # [t·k, d]
    if sort is not None:
        y = y[sort][unsort]
    return (y[back].view(t, k, -1) * w.unsqueeze(-1)).sum(1)


def case(d: int, experts: int, k: int, sorted_: bool, spec) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(TOKENS, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(TOKENS, k, device=dev, dtype=torch.bfloat16, generator=g)
    choice = torch.rand(TOKENS, experts, device=dev, generator=g).topk(k, dim=1).indices.flatten()  # k experts a token
    order = choice.argsort(stable=True)  # the copies in expert order
    src, back = order // k, order.argsort()
    sort = unsort = None
    if sorted_:  # received by source rank: sorted by local expert, a permutation of the copies, and back
        local = choice[order] % (experts // RANKS)
        sort = (local * TOKENS * k + torch.arange(TOKENS * k, device=dev)).argsort()
        unsort = sort.argsort()
    grad = torch.ones(TOKENS, d, device=dev, dtype=torch.bfloat16)
    fwd = timed(lambda: shuffles(x, w, src, back, sort, unsort))
    both = timed(lambda: shuffles(x, w, src, back, sort, unsort).backward(grad))
    planned = SHUFFLE_BYTES[sorted_] * k * d * TOKENS / (spec.hbm_bw * spec.mem_eff)
    return {"d": d, "experts": experts, "k": k, "sorted": sorted_, "forward_s": fwd, "forward_backward_s": both,
            "planned_forward_s": planned, "planned_forward_backward_s": 3 * planned}


if __name__ == "__main__":
    spec = cuda_device(torch.cuda.get_device_name())
    rows = [{"model": name, **case(d, e, k, s, spec)} for name, d, e, k in SHAPES for s in (False, True)]
    for r in rows:
        print(f"{r['model']:16s} sorted={r['sorted']!s:5s} forward {r['forward_s'] * 1e6:8.1f} us (planned "
              f"{r['planned_forward_s'] * 1e6:8.1f})  forward+backward {r['forward_backward_s'] * 1e6:8.1f} us "
              f"(planned {r['planned_forward_backward_s'] * 1e6:8.1f})")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": TOKENS, "rows": rows,
           "command": "python bench/planner/moe_shuffle.py " + " ".join(sys.argv[1:])}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
