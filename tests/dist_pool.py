"""Persistent spawned gloo ranks for tests: start once per world size, run many functions."""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker(rank: int, ws: int, store: str, backend: str, inq, outq) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # a file store, not a TCP port: pools of concurrent test runs can never meet by picking the same port
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=120))
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            outq.put((rank, True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outq.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


class RemoteError(Exception):
    def __init__(self, rank, name, msg, tb):
        super().__init__(f"rank {rank}: {name}: {msg}\n{tb}")
        self.rank, self.name, self.msg = rank, name, msg


class Pool:
    """``ws`` ranks (gloo, or NCCL one GPU each) in spawned processes; ``run(fn, ...)`` calls ``fn`` on every rank."""

    def __init__(self, ws: int, backend: str = "gloo"):
        self.ws = ws
        ctx = mp.get_context("spawn")
        self.tmp = tempfile.mkdtemp(prefix="shardwise-pool-")
        store = os.path.join(self.tmp, "store")
        self.inqs = [ctx.Queue() for _ in range(ws)]
        self.outq = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, ws, store, backend, self.inqs[r], self.outq), daemon=True) for r in range(ws)]
        for p in self.procs:
            p.start()

    def run_all(self, fn, *args, timeout: float = 600, **kwargs) -> list:
        """Per-rank results, or per-rank (exception name, message, traceback) where a rank raised."""
        for q in self.inqs:
            q.put((fn, args, kwargs))
        res = [None] * self.ws
        for _ in range(self.ws):
            r, ok, val = self.outq.get(timeout=timeout)
            res[r] = (ok, val)
        return res

    def run_until_dead(self, fn, *args, timeout: float = 300, **kwargs) -> list:
        """Start ``fn`` on every rank and wait until every rank's process has ended (a function that
        kills its process); returns their exit codes."""
        import time

        for q in self.inqs:
            q.put((fn, args, kwargs))
        t0 = time.monotonic()
        while any(p.is_alive() for p in self.procs):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"ranks still alive after {timeout} s")
            time.sleep(0.1)
        return [p.exitcode for p in self.procs]

    def run(self, fn, *args, **kwargs) -> list:
        res = self.run_all(fn, *args, **kwargs)
        for r, (ok, val) in enumerate(res):
            if not ok:
                raise RemoteError(r, *val)
        return [v for _, v in res]

    def close(self) -> None:
        for q in self.inqs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)
