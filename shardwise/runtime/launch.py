"""Start N local ranks when the job is not already under torchrun."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Callable

import torch.multiprocessing as mp


def under_launcher() -> bool:
    """True inside torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, nproc: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), SHARDWISE_BACKEND="gloo")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # torch read its thread count when this process imported it, before the line above: ranks that share the cores each
    # take their share of them (two ranks of two threads on two cores spin against each other in gloo's collectives)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:  # torch.fx's Interpreter builds a (disabled) tqdm bar, whose first use makes a process-shared
        # lock; this rank leaves by os._exit below, so that lock would be reported leaked at exit
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
    fn(*args)
    # The work is done and flushed; leave without running interpreter teardown, where gloo's
    # threads were seen to abort a finished rank now and then ("terminate called without an
    # active exception"), which spawn would report as a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, nproc: int, *args) -> None:
    """Run ``fn(*args)`` on ``nproc`` spawned CPU ranks joined by gloo; an error on any rank stops all.
    A rank that raises has its traceback printed and a rank that exits has its code said, once, and
    this process exits with that code (1 for an error): no traceback of the launcher's own."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process ..."
    try:
        mp.start_processes(_entry, args=(nproc, _free_port(), fn, args), nprocs=nproc, start_method="spawn")
    except mp.ProcessRaisedException as e:
        print(str(e).strip(), file=sys.stderr)
        raise SystemExit(1) from None
    except mp.ProcessExitedException as e:
        why = " (its reason is above)" if e.exit_code == 3 else ""
        print(f"shardwise: rank {e.error_index} exited with code {e.exit_code}{why}; the other ranks were stopped",
              file=sys.stderr)
        raise SystemExit(e.exit_code if isinstance(e.exit_code, int) and e.exit_code > 0 else 1) from None
