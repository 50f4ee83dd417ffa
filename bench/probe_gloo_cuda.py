"""Which functional collectives work on gloo with CUDA tensors (two ranks sharing one GPU)?"""

import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

c10d = torch.ops._c10d_functional


def run(rank, op):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + hash(op) % 300))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    threading.Timer(20, lambda: (print(f"{op}: HANG", flush=True), os._exit(3))).start()
    g = dist.group.WORLD.group_name
    x = torch.arange(8, dtype=torch.float64, device="cuda") + rank
    try:
        if op == "all_gather":
            y = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, g))
        elif op == "reduce_scatter":
            y = c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "avg", 2, g))
        elif op == "all_reduce":
            y = c10d.wait_tensor(c10d.all_reduce(x, "avg", g))
        elif op == "all_gather_out":
            out = torch.empty(16, dtype=x.dtype, device="cuda")
            y = c10d.wait_tensor(c10d.all_gather_into_tensor_out(x, 2, g, out=out))
        elif op == "rs_sum":
            y = c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", 2, g))
        torch.cuda.synchronize()
        if rank == 0:
            print(f"{op}: ok {y.tolist()}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{op}: rank {rank} {type(e).__name__}: {str(e)[:200]}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    for op in sys.argv[1:] or ["all_reduce", "all_gather", "all_gather_out", "reduce_scatter", "rs_sum"]:
        ctx = mp.get_context("spawn")
        ps = [ctx.Process(target=run, args=(r, op)) for r in range(2)]
        [p.start() for p in ps]
        [p.join(40) for p in ps]
