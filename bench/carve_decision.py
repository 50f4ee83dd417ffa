"""What ``matmul_sm_carveout="auto"`` decides for a built-in model on two H200s, computed on a CPU.

The step is captured on fake tensors with the weights on the meta device (no memory for them), sharded
zero3 over 2 ranks, and the carveout pass asked to choose with the H200 roofline and a link profile.
On the meta device attention is traced as its math decomposition, not the flash kernel CUDA runs,
so the roofline's step is longer than on the GPU (its choice is what to compare).

    python bench/carve_decision.py moe 8x7b-8l 1 bench/results/2026-11-30-h200x2-sitting7-link-nccl-ws2.json
    python bench/carve_decision.py llama 8b 2 bench/results/2026-11-30-h200x2-sitting7-link-nccl-ws2.json
"""

import sys

import torch

from shardwise.capture.trace import capture_step
from shardwise.costmodel import DEVICES, liveness, node_time, simulate
from shardwise.costmodel.collectives import LinkProfile
from shardwise.models import build
from shardwise.passes import ShardContext, shard_step
from shardwise.passes.carveout import SMCarveout


def main(name: str, size: str, batch: int, link: str, ws: int = 2) -> None:
    with torch.device("meta"):
        model = build(name, size)
    seq = model.cfg.seq
    tokens = torch.empty((batch, seq), dtype=torch.long, device="meta")
    cap = capture_step(model, (tokens, tokens), param_dtype=torch.bfloat16, device=torch.device("meta"))
    dev, lp = DEVICES["h200"], LinkProfile.load(link)

    def comm(n):
        return lp.time(n.meta["sw"]["kind"], n.meta["sw"]["full_bytes"], ws)

    def compute(n):
        return node_time(n, dev)

    ctx = ShardContext(ws, "g", param_dtype=torch.bfloat16, schedule=True, shard_bucket_bytes="auto", node_time=compute,
                       comm_time=comm, estimate=lambda gm: (simulate(gm, compute, comm).step_s, liveness(gm).peak),
                       sm_carveout=SMCarveout(32, 132, 20e-6, auto=True))
    prog = shard_step(cap, "zero3", ctx)
    plain, carved, keep = prog.carve_choice
    print(f"{name} {size} batch {batch}x{seq} on {ws} H200s: predicted graph {plain * 1e3:.1f} ms uncarved, "
          f"{carved * 1e3:.1f} ms with 32 SMs carved out of the products beside a collective: "
          + (f"carve ({prog.carved} products)" if keep else "do not carve"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
