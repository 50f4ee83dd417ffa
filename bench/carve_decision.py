"""What ``matmul_sm_carveout="auto"`` decides for a built-in model on two H200s, computed on a CPU.

The step is captured on fake tensors with the weights on the meta device (no memory for them), sharded
zero3 over 2 ranks, and the carveout pass asked to choose with a job's cost model (the H200 roofline,
the link profile given).
Attention is traced as the flash-attention op CUDA runs (on the meta device torch would trace its
math decomposition instead, a graph the GPU never runs).

    python bench/carve_decision.py moe 8x7b-8l 1 bench/results/2026-11-30-h200x2-sitting7-link-nccl-ws2.json
    python bench/carve_decision.py llama 8b 2 bench/results/2026-11-30-h200x2-sitting7-link-nccl-ws2.json

A fifth argument shards over that many ranks instead of 2 (the link profile's α-β times then taken
at that many ranks).
"""

import sys

import torch

from shardwise.capture import capture_step
from shardwise.costmodel import CostModel
from shardwise.models import build
from shardwise.passes import ShardContext, shard_step
from shardwise.passes.carveout import SMCarveout


def _flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    if attn_mask is not None or kw:
        raise ValueError("carve_decision: the built-in models' attention takes no mask")
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal)[0]


def main(name: str, size: str, batch: int, link: str, ws: int = 2) -> None:
    with torch.device("meta"):
        model = build(name, size)
    torch.nn.functional.scaled_dot_product_attention = _flash  # what CUDA dispatches these shapes to
    seq = model.cfg.seq
    tokens = torch.empty((batch, seq), dtype=torch.long, device="meta")
    cap = capture_step(model, (tokens, tokens), param_dtype=torch.bfloat16, device=torch.device("meta"))
    # the cost model of a job on one H200 of that machine, as the job builds it (the FX executor's liveness)
    cost = CostModel.for_job(link, "cuda", "nccl", "NVIDIA H200")
    ctx = ShardContext(ws, "g", cost=cost, param_dtype=torch.bfloat16, schedule=True, shard_bucket_bytes="auto",
                       sm_carveout=SMCarveout(32, 132, 20e-6, auto=True))
    prog = shard_step(cap, "zero3", ctx)
    plain, carved, keep = prog.carve_choice
    tl = cost.simulate(prog.gm)
    print(f"{name} {size} on {ws} ranks, the program chosen: predicted graph {tl.step_s * 1e3:.1f} ms, exposed "
          f"communication {tl.exposed_pct:.1f}% (without SM contention), cap {prog.schedule['max_in_flight'] / 2**20:.0f} MiB")
    print(f"{name} {size} batch {batch}x{seq} on {ws} H200s: predicted graph {plain * 1e3:.1f} ms uncarved, "
          f"{carved * 1e3:.1f} ms with 32 SMs carved out of the products beside a collective: "
          + (f"carve ({prog.carved} products)" if keep else "do not carve"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *(int(a) for a in sys.argv[5:6]))
