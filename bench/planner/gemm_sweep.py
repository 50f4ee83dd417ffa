"""Achieved bf16 FLOP rate of a transformer layer's matrix products (forward and backward, as
torch.mm runs them through cuBLAS) and of its attention (torch SDPA, flash), per model width,
tensor-parallel split and tokens per micro-batch: the measurements the planner's GEMM-shape
efficiency is fitted on (costmodel.Device.efficiency). Run on a GPU:
    python bench/planner/gemm_sweep.py OUT.json [--fp8]

``--fp8`` also times each product as Transformer Engine's FP8 recipes run it on Hopper (torch._scaled_mm, cuBLASLt):
E4M3 activations and weights in the forward, E5M2 output gradients in the backward, one scale per tensor, bf16 out;
and the cast that makes each FP8 operand (a bf16 tensor's absolute maximum, then the scaled cast, as current scaling
does), reported apart as bytes moved per second.
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


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_operands(M, K, N, a_dtype, b_dtype, dev):
    """FP8 operands of an (M, K) x (K, N) product as cuBLASLt's FP8 kernels take them (the second column-major)."""
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16).to(a_dtype)
    b = torch.randn(N, K, device=dev, dtype=torch.bfloat16).to(b_dtype).t()
    return a, b


def fp8_layer(d, heads, kv, ffn, tp, m, dev, one):
    """(FLOPs, seconds) of one layer's twelve products in FP8: forward E4M3 x E4M3, input gradient E5M2 x E4M3, weight
    gradient E4M3 x E5M2 (cuBLASLt has no E5M2 x E5M2)."""
    flops = secs = 0.0
    kinds = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
    for i, (M, K, N) in enumerate(layer_products(d, heads, kv, ffn, tp, m)):
        a, b = fp8_operands(M, K, N, *kinds[i % 3], dev)
        try:
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        except RuntimeError:  # a build without that pairing: time it as E4M3 x E4M3
            a, b = fp8_operands(M, K, N, E4M3, E4M3, dev)
        secs += timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        flops += 2.0 * M * K * N
    return flops, secs


def cast_rate(dev, n=64 * 2**20):
    """Bytes/s of current scaling's cast of a bf16 tensor to FP8: its absolute maximum, then the scaled cast (read 2 B
    twice, write 1 B an element)."""
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)

    def cast():
        scale = 448.0 / x.abs().amax().float()
        return (x.float() * scale).to(E4M3)
    return 5.0 * n / timed(torch.compile(cast))


def main(path, fp8=False):
    dev = torch.device("cuda")
    one = torch.ones((), device=dev)
    rows = [{"kind": "fp8_cast", "bytes_per_s": cast_rate(dev)}] if fp8 else []
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
                if fp8:
                    f8, s8 = fp8_layer(d, heads, kv if kv >= tp else tp, ffn, tp, m, dev, one)
                    rows.append({"kind": "layer_matmul_fp8", "model": name, "width": d, "tp": tp, "tokens": m,
                                 "flops": f8, "seconds": s8, "tflops": f8 / s8 / 1e12, "vs_bf16": secs / s8})
        print(name, f"{time.time() - t0:.0f}s", flush=True)
        save(path, rows, fp8)  # after each shape: a run cut short keeps what it measured
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
    save(path, rows, fp8)
    print(f"{len(rows)} rows in {time.time() - t0:.0f}s")


def save(path, rows, fp8):
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "command": "python bench/planner/gemm_sweep.py" + (" --fp8" if fp8 else ""),
            "date": time.strftime("%Y-%m-%d")}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], "--fp8" in sys.argv[2:])
