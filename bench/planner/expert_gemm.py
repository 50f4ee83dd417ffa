"""Achieved FLOP rate of an MoE layer's expert products at their own shapes, bf16 (torch.mm) and FP8 (as
Transformer Engine's recipes run them: torch._scaled_mm, cuBLASLt, E4M3 forward, E5M2 output gradients), per model
width, expert MLP width on one rank (the expert's ffn / its tensor-parallel cut) and tokens an expert receives per
micro-batch. Each point runs one rank's local experts as a loop of products (4 experts, each its six products: gate+up
and down, forward, input and weight gradients), as a grouped GEMM made of separate GEMMs does. Run on a GPU:
    cd bench/planner && python expert_gemm.py OUT.json
"""

import json
import sys
import time

import torch

from gemm_sweep import E4M3, E5M2, fp8_operands, timed

WIDTHS = (2048, 4096, 7168)  # Qwen3-30B-A3B; Qwen3-235B-A22B and Mixtral; DeepSeek-V3 and Kimi K2
FFNS = (256, 768, 1536, 2048, 4096, 14336)  # an expert's MLP on one rank
TOKENS = (128, 256, 512, 1280, 2048, 4096, 8192)  # routed copies an expert receives per micro-batch
EXPERTS = 4
MAX_FLOPS = 1.5e13  # points of more FLOPs (a few tens of ms a run) are left out: the sweep stays within minutes


def expert_products(d, f, m):
    """The (M, K, N) of one gated expert's forward and backward products."""
    shapes = []
    for k, n in ((d, 2 * f), (f, d)):
        shapes += [(m, k, n), (m, n, k), (k, m, n)]  # forward, input gradient, weight gradient
    return shapes


def point(d, f, m, dev, one, fp8):
    flops, ops = 0.0, []
    kinds = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
    for i, (M, K, N) in enumerate(expert_products(d, f, m)):
        for _ in range(EXPERTS):
            if fp8:
                a, b = fp8_operands(M, K, N, *kinds[i % 3], dev)
                ops.append(lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            else:
                a, b = (torch.randn(M, K, device=dev, dtype=torch.bfloat16),
                        torch.randn(K, N, device=dev, dtype=torch.bfloat16))
                ops.append(lambda a=a, b=b: torch.mm(a, b))
            flops += 2.0 * M * K * N

    def run():
        for op in ops:
            op()
    return flops, timed(run)  # the operands are freed on return, for the next point's


def main(path):
    dev = torch.device("cuda")
    one = torch.ones((), device=dev)
    rows, t0 = [], time.time()
    for fp8 in (False, True):
        for d in WIDTHS:
            for f in FFNS:
                for m in TOKENS:
                    if 72.0 * m * d * f > MAX_FLOPS:  # 4 experts x 3 products x 6·m·d·f
                        continue
                    flops, secs = point(d, f, m, dev, one, fp8)
                    rows.append({"kind": "expert_fp8" if fp8 else "expert", "width": d, "ffn": f, "tokens": m,
                                 "experts": EXPERTS, "flops": flops, "seconds": secs, "tflops": flops / secs / 1e12})
            print("fp8" if fp8 else "bf16", d, f"{time.time() - t0:.0f}s", flush=True)
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "command": "cd bench/planner && python expert_gemm.py OUT.json", "date": time.strftime("%Y-%m-%d")}
            with open(path, "w") as fh:
                json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
