"""The fused tp kernels (shardwise/kernels) on one GPU, issue 26's single-GPU record:

1. correctness: ``ag_gemm`` and ``gemm_rs`` on 1, 2 and 4 ranks sharing the GPU (gloo groups,
   ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), against the pure-torch references over every
   rank's operands, several calls in a row (buffers, flags and counts reused), gathers along dim 0
   and along the sequence of [batch, seq, k], with and without an addend, bf16 and fp32;
2. speed at one rank: the kernels' product against cuBLAS ``torch.mm`` on Llama 3 8B / 70B
   tensor-parallel shapes (bf16), each tile configuration tried, TMA descriptors on and off.

    python bench/fused_kernels.py --out bench/results/<date>-h200-fused-kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Llama 3: 8B hidden 4096, ffn 14336, q|k|v 6144; 70B hidden 8192, ffn 28672, q|k|v 10240
SHAPES = [  # (name, kind, k, n) of one rank's product at its tp split
    ("8b tp2 gate", "ag", 4096, 7168), ("8b tp2 qkv", "ag", 4096, 3072), ("8b tp2 down", "rs", 7168, 4096),
    ("8b tp2 o", "rs", 2048, 4096), ("70b tp8 gate", "ag", 8192, 3584), ("70b tp8 down", "rs", 3584, 8192),
    ("70b tp2 gate", "ag", 8192, 14336), ("70b tp2 down", "rs", 14336, 8192),
]
TOKENS = (4096, 8192, 16384)


def _rel(x, y):
    return float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30))


def check(rank: int, ranks: int, store: str, out: dict) -> None:
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    from shardwise.kernels import ag_gemm, gemm_rs

    name = dist.group.WORLD.group_name
    g = torch.Generator(device="cuda").manual_seed(100 + rank)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    def everyone(t):
        host = [torch.empty_like(t, device="cpu") for _ in range(ranks)]
        dist.all_gather(host, t.cpu().contiguous())
        return [h.cuda() for h in host]

    rows = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for call in range(3):
            for dim, shape in ((0, (256, 3, 512)), (1, (2, 128, 512)), (0, (384, 512))):
                x = rand(*shape, dtype=dtype)
                ws = [everyone(rand(640, 512, dtype=dtype))[0].t(), everyone(rand(512, 384, dtype=dtype))[0]]
                got, ref = ag_gemm.ag_gemm(x, ws, dim, name), ag_gemm.reference(everyone(x), ws, dim)
                rows.append(("ag_gemm", str(dtype), dim, shape, call, torch.equal(got[0], ref[0]),
                             max(_rel(a, b) for a, b in zip(got[1:], ref[1:])), tol))
                full = [s * (ranks if i == dim else 1) for i, s in enumerate(shape[:-1])] + [384]
                for addend in (False, True):
                    a = rand(x.numel() // 512 * ranks, 512, dtype=dtype)
                    w = everyone(rand(384, 512, dtype=dtype))[0].t() if call % 2 else rand(512, 384, dtype=dtype)
                    c = rand(*full, dtype=dtype) if addend else None
                    mine = gemm_rs.gemm_rs(a, w, c, full, dim, name)
                    parts = list(zip(everyone(a), everyone(w.contiguous()), everyone(c) if addend else [None] * ranks))
                    ref = gemm_rs.reference([(p[0].float(), p[1].float(), None if p[2] is None else p[2].float())
                                             for p in parts], full, dim)[rank]
                    rows.append(("gemm_rs", str(dtype), dim, shape, call, addend, _rel(mine, ref), tol))
    torch.cuda.synchronize()
    out[rank] = rows
    dist.destroy_process_group()


def correctness(ranks: int) -> list:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as m:
        out = m.dict()
        mp.spawn(check, args=(ranks, os.path.join(tmp, "store"), out), nprocs=ranks)
        return [(ranks, r, *row) for r in range(ranks) for row in out[r]]


def speed() -> list:
    """Each shape at each token count: cuBLAS, and the kernel's product under each configuration."""
    from triton.testing import do_bench

    from shardwise.kernels import _triton as K

    results = []
    for label, kind, k, n in SHAPES:
        for m in TOKENS:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # t(W), as the model's products read it
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            flops = 2.0 * m * n * k
            cublas = do_bench(lambda: torch.mm(a, w, out=c), warmup=25, rep=200, return_mode="median")
            ref = torch.mm(a, w)
            best = None
            for bn in (128, 256):
                for stages in (3, 4):
                    for tma in (True, False):
                        cfg = dict(BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=stages)
                        K.USE_TMA = tma
                        used = K._operands(a, w, cfg, True)[2]

                        run = K.product(a, w, c, cfg)
                        try:
                            c.fill_(float("nan"))  # poisoned: an element the kernel does not write fails the check
                            run()
                            err = _rel(c, ref)
                            ms = do_bench(run, warmup=25, rep=200, return_mode="median")
                        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
                            print(f"{label} m={m} bn={bn} stages={stages} tma={tma}: {type(e).__name__}: {e}"[:300])
                            continue
                        row = dict(shape=label, kind=kind, m=m, k=k, n=n, block_n=bn, stages=stages, tma=used,
                                   ms=ms, cublas_ms=cublas, ratio=cublas / ms, tflops=flops / ms / 1e9,
                                   cublas_tflops=flops / cublas / 1e9, rel_err=err,
                                   default=cfg == K.config(n, k) and tma)
                        results.append(row)
                        if best is None or ms < best["ms"]:
                            best = row
            K.USE_TMA = True
            launcher = _launcher(kind, a, w, m, n, k)
            best["launcher_ratio"] = cublas / do_bench(launcher, warmup=25, rep=200, return_mode="median")
            best["launcher_host_us"] = _host_us(launcher)
            print(f"{label:14s} m={m:6d}: cuBLAS {flops / cublas / 1e9:6.1f} TFLOP/s, kernel best "
                  f"{best['tflops']:6.1f} ({best['ratio']:.3f}x; bn={best['block_n']} stages={best['stages']} "
                  f"tma={best['tma']}), err {best['rel_err']:.1e}; whole launcher at one rank "
                  f"{best['launcher_ratio']:.3f}x, {best['launcher_host_us']:.0f} µs of host time a call", flush=True)
    return results


def _host_us(fn, calls: int = 50) -> float:
    """Host microseconds per call (launches queue behind the device; synchronized before and after)."""
    import time

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _launcher(kind: str, a, w, m, n, k):
    """The whole launcher at one rank (its gathered copy, or its store into the symmetric buffer and
    the sum of the received blocks, beside the product)."""
    from shardwise.kernels import ag_gemm, gemm_rs

    name = dist.group.WORLD.group_name
    if kind == "ag":
        return lambda: ag_gemm.ag_gemm(a, [w], 0, name)
    return lambda: gemm_rs.gemm_rs(a, w, None, [m, n], 0, name)


def reduction() -> list:
    """The GEMM+RS sum of the received blocks alone (counts already in), GB/s read and written."""
    import triton
    from triton.testing import do_bench

    from shardwise.kernels import _triton as K

    rows = []
    for ranks, numel in ((2, 4096 * 4096), (4, 4096 * 4096), (8, 2048 * 8192)):
        recv = torch.randn(ranks, numel, device="cuda", dtype=torch.bfloat16)
        counts = torch.full((ranks,), 1, device="cuda", dtype=torch.int32)
        out = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        ms = do_bench(lambda: K._reduce_kernel[(triton.cdiv(numel, 4096),)](recv, counts, out, numel, ranks, 1,
                                                                              BLOCK=4096), return_mode="median")
        ok = _rel(out, recv.float().sum(0)) < 1e-2
        copy = do_bench(lambda: out.copy_(recv[0]), return_mode="median")
        rows.append(dict(ranks=ranks, numel=numel, ms=ms, gbps=(ranks + 1) * numel * 2 / ms / 1e6, ok=ok,
                         copy_gbps=2 * numel * 2 / copy / 1e6))
        print(f"sum of {ranks} blocks of {numel * 2 / 2**20:.0f} MiB: {rows[-1]['gbps']:.0f} GB/s (a copy: "
              f"{rows[-1]['copy_gbps']:.0f} GB/s), correct={ok}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--ranks", default="1,2,4", help="rank counts of the correctness checks, e.g. 2 (none: '')")
    args = p.parse_args()
    record = {"name": "fused tp kernels, one GPU", "machine": torch.cuda.get_device_name(0),
              "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
              "command": " ".join([sys.executable, *sys.argv]), "correctness": [], "speed": []}
    for ranks in [int(r) for r in args.ranks.split(",") if r]:
        rows = correctness(ranks)
        record["correctness"] += rows
        bad = [r for r in rows if (r[2] == "ag_gemm" and not r[7]) or r[-2] > r[-1]]
        worst = max(r[-2] for r in rows)
        print(f"correctness at {ranks} rank(s) on one GPU: {len(rows)} checks, {len(bad)} failed, worst rel err "
              f"{worst:.2e}", flush=True)
        for r in bad[:5]:
            print("  FAILED", r)
    if not args.skip_speed:
        with tempfile.TemporaryDirectory() as tmp:  # a group of one rank for the launchers
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
            record["speed"] = speed()
            record["reduction"] = reduction()
            dist.destroy_process_group()
        from shardwise.costmodel.fused import CALIBRATION_SHAPES
        from shardwise.kernels._triton import product_share

        record["calibration"] = [[*s, product_share(*s, "cuda")] for s in CALIBRATION_SHAPES]
        print("calibrate's product shares (m, k, n, share):", record["calibration"])
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
