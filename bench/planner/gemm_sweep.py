"""Achieved bf16 FLOP rate of a transformer layer's matrix products (forward and backward, as
torch.mm runs them through cuBLAS) and of its attention (torch SDPA, flash), per model width,
tensor-parallel split and tokens per micro-batch: the measurements the planner's GEMM-shape
efficiency is fitted on (costmodel.Device.efficiency). Run on a GPU:
    python bench/planner/gemm_sweep.py OUT.json
"""

import json
import sys
import time

import torch
import torch.nn.functional as F

# (name, width, heads, kv heads, mlp width): Llama 3 8B / 70B / 405B and narrower and wider neighbours
SHAPES = [("1.1b", 2048, 16, 8, 8192), ("8b", 4096, 32, 8, 14336), ("13b", 5120, 40, 40, 13824),
          ("70b", 8192, 64, 8, 28672), ("175b", 12288, 96, 96, 49152), ("405b", 16384, 128, 8, 53248)]
TPS = (1, 2, 4, 8)
TOKENS = (2048, 4096, 8192, 16384)


def timed(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def layer_products(d, heads, kv, ffn, tp, m):
    """The (M, K, N) of each product of one layer's forward and backward on one tensor-parallel rank."""
    hd = d // heads
    outs = [(d, (heads + 2 * kv) * hd // tp), (heads * hd // tp, d), (d, 2 * ffn // tp), (ffn // tp, d)]
    shapes = []
    for k, n in outs:
        shapes += [(m, k, n), (m, n, k), (k, m, n)]  # forward, input gradient, weight gradient
    return shapes


def main(path):
    dev = torch.device("cuda")
    rows = []
    t0 = time.time()
    for name, d, heads, kv, ffn in SHAPES:
        for tp in TPS:
            if heads % tp or kv % tp and kv >= tp:
                continue
            for m in TOKENS:
                flops = secs = 0.0
                for M, K, N in layer_products(d, heads, kv if kv >= tp else tp, ffn, tp, m):
                    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                    b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
                    secs += timed(lambda: torch.mm(a, b))
                    flops += 2.0 * M * K * N
                rows.append({"kind": "layer_matmul", "model": name, "width": d, "tp": tp, "tokens": m,
                             "flops": flops, "seconds": secs, "tflops": flops / secs / 1e12})
        print(name, f"{time.time() - t0:.0f}s", flush=True)
    for heads, hd in ((32, 128), (64, 128), (16, 128)):
        for seq in (2048, 4096, 8192):
            b = max(1, 16384 // seq)
            q, k, v = (torch.randn(b, heads, seq, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))

            def step():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(torch.ones_like(o))
            secs = timed(step, 5)
            flops = 3.5 * 2 * 2 * b * heads * seq * seq * hd / 2  # causal: half of fwd 4·b·h·s²·d, bwd 2.5x
            rows.append({"kind": "attention", "heads": heads, "head_dim": hd, "seq": seq, "batch": b,
                         "flops": flops, "seconds": secs, "tflops": flops / secs / 1e12})
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "command": "python bench/planner/gemm_sweep.py", "date": time.strftime("%Y-%m-%d")}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{len(rows)} rows in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main(sys.argv[1])
