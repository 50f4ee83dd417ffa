"""FSDP2's optimizer step and copy kernels on one GPU as one rank of a larger data-parallel group sees them: torch's
fake process group (``torch.testing._internal.distributed.fake_pg``: collectives are no-ops, the layout is the real
one) stands in for the other ranks, so one GPU holds rank 0's shards of a world of 2 (or more) exactly as a two-GPU run
does. Each case runs in a process of its own; per case: the update's time, its CUDA kernels by name (count, seconds),
the passes over the fp32 parameter bytes that time comes to at the measured copy rate, and the same for one forward
and backward's kernels. The plain case steps the same AdamW over plain tensors of the same model for comparison.
Run on a GPU:
    python bench/planner/fsdp2_ranks.py OUT.json [CASES, e.g. 2,3]
"""

import json
import sys
import time

import torch

from gemm_sweep import timed  # this folder's: CUDA-event time of a call after warm-ups

from shardwise.models import build

# (name, world, layers, fsdp2, compile[, model, size, sequences]): our measured rows' models cut to the layers one 80 GB
# GPU holds at that world; by default the bench's moe 8x7b-8l (Mixtral 8x7B's layer, capacity 1.25) on 1x4096 tokens
CASES = [("plain", 1, 2, False, False), ("fsdp2 world 1", 1, 2, True, False), ("fsdp2 world 2", 2, 3, True, False),
         ("fsdp2+compile world 2", 2, 3, True, True), ("fsdp2 world 8", 8, 8, True, False),
         ("llama 8b fsdp2+compile world 2", 2, 12, True, True, "llama", "8b", 2)]
TOKENS = 4096


def profiled(fn) -> dict[str, list]:
    """[count, seconds] per CUDA kernel name of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            c = out.setdefault(e.name[:400], [0, 0.0])
            c[0] += 1
            c[1] += e.device_time_total / 1e6
    return out


def copy_rate() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, read and write counted."""
    a = torch.empty(2**28, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / timed(lambda: b.copy_(a))


def built(arch: str, size: str, layers: int, fsdp: bool):
    """A built-in model made on the GPU (seconds, not a minute on the host), under FSDP2 with the bench's policy (bf16
    parameters, fp32 reduction; each block, then the root) where ``fsdp``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build(arch, size, n_layer=layers)
    if fsdp:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for blk in model.blocks:
            fully_shard(blk, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    return model


def is_copy(kernel: str) -> bool:
    """FSDP2's gradient copy-in and weight copy-out kernels (and the concatenation of the same work)."""
    return any(k in kernel for k in ("chunk_cat", "split_with_sizes", "CatArrayBatched"))


def case(i: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    name, world, layers, fsdp, compiled, arch, size, seqs = (*CASES[i], "moe", "8x7b-8l", 1)[:8]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    torch.cuda.set_device(0)
    copy_bw = copy_rate()
    model = built(arch, size, layers, fsdp)
    run = torch.compile(model) if compiled else model
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randint(0, model.cfg.vocab, (seqs, TOKENS), device="cuda")

    def fwd_bwd():
        with torch.autocast("cuda", torch.bfloat16, enabled=not fsdp):
            loss = run(x, x)
        loss.backward()

    for _ in range(2):
        fwd_bwd()
        opt.step()
    fwd_bwd()
    row = {"case": name, "model": f"{arch} {size}", "world": world, "layers": layers, "fsdp2": fsdp,
           "compile": compiled, "local_params": local, "copy_bw": copy_bw}
    row["update_s"] = timed(opt.step, reps=5)
    row["update_passes"] = row["update_s"] * copy_bw / (4.0 * local)
    upd = profiled(opt.step)
    row["update_kernels"] = sum(c for c, _ in upd.values())
    row["update_by_kernel"] = dict(sorted(upd.items(), key=lambda kv: -kv[1][1])[:8])
    opt.zero_grad(set_to_none=True)
    step = profiled(fwd_bwd)
    opt.zero_grad(set_to_none=True)

    def whole():
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)
    row["step_s"] = timed(whole, reps=3)  # the step without its collectives
    with torch.autocast("cuda", torch.bfloat16, enabled=not fsdp):
        fwd = profiled(lambda: run(x, x))
    row["forward_top"] = dict(sorted(fwd.items(), key=lambda kv: -kv[1][1])[:16])
    row["fwd_bwd_kernel_s"] = sum(s for _, s in step.values())
    copies = {k: v for k, v in step.items() if is_copy(k)}
    row["copy_s"] = sum(s for _, s in copies.values())
    row["copy_bytes_per_param"] = row["copy_s"] * copy_bw / local
    row["fwd_bwd_top"] = dict(sorted(step.items(), key=lambda kv: -kv[1][1])[:16])
    dist.destroy_process_group()
    return row


def each_in_a_process(script, cases, out, command, name=str):
    """Runs ``script --case i`` for each case in a process of its own (FSDP2's state outlives its module) and writes
    the JSON line each prints, with the machine, to ``out`` as it goes."""
    import subprocess

    rows = []
    for i in cases:
        t = time.time()
        r = subprocess.run([sys.executable, script, "--case", str(i)], capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("{")), None)
        rows.append(json.loads(line) if line else {"case": name(i), "error": r.stderr[-1500:]})
        print(json.dumps({k: v for k, v in rows[-1].items() if "top" not in k})[:900], f"{time.time() - t:.0f}s",
              flush=True)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": command,
                "date": time.strftime("%Y-%m-%d")}
        with open(out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--case":
        print(json.dumps(case(int(sys.argv[2]))), flush=True)
    else:
        each_in_a_process(__file__, [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else
                          range(len(CASES)), sys.argv[1], "python bench/planner/fsdp2_ranks.py OUT.json",
                          lambda i: CASES[i][0])
