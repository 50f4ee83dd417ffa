"""No hangs: every rank says in the job's store what it is doing, and a rank whose collective work
waits longer than the job's ``timeout`` finds out why and leaves with a message that names the rank
that failed, stalled or is elsewhere, and the step.

Each rank's thread posts its status (its last phase: ``step 6``, ``eval after step 5``, ``save``, ...;
in it, done, or failed with which error) to the store every ``beat`` seconds, and watches the phase:

- a rank that raises in a phase posts its error at once; every other rank in a phase sees it within
  a beat and leaves, naming it (the raising rank's own error reaches its caller);
- a phase longer than its limit (``timeout``; six times that while compiling) is explained from the
  others' statuses (silent for several beats: stopped, stalled or killed; alive but with fewer steps
  done, or in another phase) and this rank leaves.

Leaving is ``os._exit``: the main thread is blocked in a collective that Python cannot interrupt
(NCCL's own watchdog aborts the process likewise). A collective that fails instead (gloo's
"Connection closed by peer" when a peer died) is explained the same way by ``explain_failure``.
Control values only: the store carries a few hundred bytes per rank per beat, never tensors."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from ..errors import RankFailure

COMPILE_FACTOR = 6
"""A phase that compiles (capture, passes, inductor) may take this many timeouts."""


class Watchdog:
    """One per process: the phases of the jobs this rank runs, posted and watched (module docstring)."""

    def __init__(self, store, rank: int, world: int, beat: float = 1.0):
        self.store = dist.PrefixStore("shardwise-watch/", store)
        self.rank, self.world, self.beat = rank, world, beat
        self.lock = threading.Lock()
        self.status = {"job": 0, "seq": 0, "what": "start", "n": 0, "state": "done", "error": None}
        self.seq = 0
        """Phases this rank has begun: ranks that call the jobs alike are in phases of the same number."""
        self.since = time.monotonic()
        self.limit: float | None = None
        self.compiling = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardwise-watchdog", daemon=True)
        self._thread.start()

    # -- what this rank does (main thread) ---------------------------------------------------

    def begin(self, job: int, what: str, n: int, limit: float | None) -> None:
        with self.lock:
            self.seq += 1
            self.status = {"job": job, "seq": self.seq, "what": what, "n": n, "state": "in", "error": None}
            self.since, self.limit, self.compiling = time.monotonic(), limit, False
        # posted now (one small store write, tens of microseconds), so that a rank that stops in this phase is
        # reported in it; where the store's host is gone, the phase's limit will tell
        with contextlib.suppress(Exception):
            self._post()

    def end(self) -> None:
        with self.lock:
            if self.status["state"] == "in":
                self.status = {**self.status, "state": "done"}
            self.limit = None

    def fail(self, error: BaseException) -> None:
        """This rank raised in its phase: told to the others now, not at the next beat."""
        with self.lock:
            self.status = {**self.status, "state": "failed", "error": f"{type(error).__name__}: {error}"[:300]}
            self.limit = None
        with contextlib.suppress(Exception):  # the store itself may be what failed
            self._post()
            self.store.set(f"failed/{self.status['seq']}", str(self.rank))

    def compile_started(self) -> None:
        with self.lock:
            self.compiling = True

    # -- the thread --------------------------------------------------------------------------

    def _post(self) -> None:
        with self.lock:
            text = json.dumps({**self.status, "beat": time.time()})
        self.store.set(f"rank/{self.rank}", text)

    def _run(self) -> None:
        while not self._wake.wait(self.beat):
            with contextlib.suppress(Exception):  # where the store's host is gone, only the phase's limit can tell
                self._post()
            with self.lock:
                st, limit, since, compiling = dict(self.status), self.limit, self.since, self.compiling
            if st["state"] != "in" or time.monotonic() - since < 2 * self.beat:
                continue  # reads of the store only once this rank has waited a while
            failed = self._read(f"failed/{st['seq']}", wait=False)
            if failed is not None and int(failed) != self.rank and self._still_in(st):
                other = self._statuses().get(int(failed)) or {}
                self._leave(f"rank {failed} raised in {_phase(other) or 'its phase'}: {other.get('error')}; "
                            f"rank {self.rank} stops too (it was in {_phase(st)})")
            if limit is not None:
                lim = limit * (COMPILE_FACTOR if compiling else 1)
                if time.monotonic() - since > lim:
                    self._leave(f"{_phase(st)} did not finish on rank {self.rank} within {lim:.0f} s "
                                f"(timeout={limit:g}{f', x{COMPILE_FACTOR} while compiling' if compiling else ''}): "
                                + self.explain(st)[1])

    def _still_in(self, st: dict) -> bool:
        """Still in phase ``st`` a beat later: an error every rank raises (a disagreement) ends the
        phase here too, and this rank then leaves it by that error, not by ``os._exit``."""
        time.sleep(self.beat)
        with self.lock:
            return self.status["seq"] == st["seq"] and self.status["state"] == "in"

    def _read(self, key: str, wait: bool = True):
        try:
            return self.store.get(key).decode() if wait or self.store.check([key]) else None
        except Exception:  # noqa: BLE001
            return None

    def _statuses(self) -> dict[int, dict]:
        texts = {r: self._read(f"rank/{r}", wait=False) for r in range(self.world)}
        return {r: json.loads(t) for r, t in texts.items() if t is not None}

    def explain(self, mine: dict | None = None, tries: int = 6) -> tuple[bool, str]:
        """(whether a rank was named, what the other ranks were doing, from their statuses). A rank
        stopped a moment ago still looks alive: read again each beat, up to ``tries`` times."""
        for _ in range(tries - 1):
            found, text = self._explain(mine)
            if found:
                return found, text
            time.sleep(self.beat)
        return self._explain(mine)

    def _explain(self, mine: dict | None = None) -> tuple[bool, str]:
        """(whether a rank was named, the text). The store is read on a thread of its own: a store
        whose host has stopped does not answer."""
        mine = mine or dict(self.status)
        box: list = []
        reader = threading.Thread(target=lambda: box.append(self._statuses()), daemon=True)
        reader.start()
        reader.join(5 * self.beat + 2)
        if not box:
            return True, ("the job's store (on rank 0's host) does not answer: rank 0 has stopped, stalled or "
                    "died; see its own output")
        statuses, now, parts = box[0], time.time(), []
        for r in range(self.world):
            if r == self.rank:
                continue
            if (st := statuses.get(r)) is None:
                parts.append(f"rank {r} never reported (it did not start, or died before its first beat)")
                continue
            quiet = now - st["beat"]
            if st.get("state") == "failed":
                parts.append(f"rank {r} raised in {_phase(st)}: {st['error']}")
            elif quiet > 4 * self.beat:
                where = f"in {_phase(st)}" if st["state"] == "in" else f"after {_phase(st)}"
                parts.append(f"rank {r} has given no sign of life for {quiet:.0f} s ({where}): it was stopped, "
                             "stalled or killed")
            elif st["state"] != "in" or (st["job"], st["seq"]) != (mine["job"], mine["seq"]):
                where = f"is in {_phase(st)}" if st["state"] == "in" else f"is past {_phase(st)}, in no job phase"
                parts.append(f"rank {r} {where}: every rank must call the job's methods alike (the same number of "
                             "steps, eval_step on every rank or none)")
        if not parts:
            return False, ("every other rank is alive and in the same phase: a collective is slower than the "
                           "timeout (raise timeout= for long steps) or the transport is stuck")
        return True, "; ".join(parts)

    def _leave(self, message: str) -> None:
        sys.stderr.write(f"shardwise: rank {self.rank}: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(3)


def _phase(st: dict) -> str:
    if not st:
        return ""
    return f"{st['what']} {st['n']}" if st["what"] == "step" else f"{st['what']} (after step {st['n']})"


_WATCHDOG: Watchdog | None = None

_TRANSPORT = ("Connection closed", "Connection reset", "Connection refused", "Broken pipe", "timed out", "Timed out",
              "Gloo", "gloo", "NCCL", "Socket")


@contextlib.contextmanager
def watched(job, what: str):
    """``job``'s ``what`` ("step", "eval", "save", ...) as a watched phase of this rank: posted, held to
    the job's timeout, and, where it raises, told to the other ranks; a collective that failed
    because of another rank raises ``RankFailure`` naming that rank."""
    dog = job.watchdog
    if dog is None or (dog.status["state"] == "in" and dog.status["job"] == job.watch_id):
        yield  # no watch, or a phase within one (a save's state_dict, a step's measurement)
        return
    n = job.steps + (what == "step")
    # steps and evals are held to the timeout; a save, load or export takes as long as its bytes do
    # (a large model's blocking save, minutes): watched for a rank that raises, not for time
    dog.begin(job.watch_id, what, n, job.config.timeout if what in ("step", "eval") else None)
    job.agree.doing = {"step": f"job.step (step {n})", "eval": f"job.eval_step (after step {n})"}.get(what, "")
    try:
        yield
    except BaseException as e:
        if isinstance(e, getattr(dist, "DistError", ())) or any(t in str(e) for t in _TRANSPORT):
            # a collective that failed: because of another rank, if the statuses name one
            mine = dict(dog.status)
            found, why = dog.explain(mine)
            if found:
                raise RankFailure(f"{_phase(mine)} failed on rank {dog.rank}: {why}") from e
        dog.fail(e)
        raise
    finally:
        dog.end()
        job.agree.doing = ""


def watchdog(timeout: float | None) -> Watchdog | None:
    """This process's watchdog (started at the first job with a timeout over several ranks), beating
    at least five times per ``timeout``."""
    global _WATCHDOG
    if timeout is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    beat = min(1.0, timeout / 5)
    if _WATCHDOG is None:
        from torch.distributed.distributed_c10d import _get_default_store

        _WATCHDOG = Watchdog(_get_default_store(), dist.get_rank(), dist.get_world_size(), beat)
    _WATCHDOG.beat = beat
    return _WATCHDOG
