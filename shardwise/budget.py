"""The memory side of a job's plan (DESIGN.md invariant 3: a memory budget is a promise).

- what a step is predicted to hold (``predict``): the resident state plus the largest of the graph's
  simulated live peak, its outputs and the optimizer step's temporaries, and zero1/2's gather of the
  updated shards back into whole weights (costmodel/memory.py, costmodel/optimizer.py);
- the graph's share of ``memory_budget`` (``graph_budget``), which the passes plan to fit
  (passes/unshard.py), or ``BudgetError`` before anything runs;
- under optimizer offload, which state stays on the device (``plan_residency``): each byte kept
  there is a byte less to move each way per step;
- the check of a measured step against the plan (``check``): a peak over the budget or more than 10%
  off its prediction makes the plan again with the gap held back."""

from __future__ import annotations

import os
from typing import Callable

import torch

from .costmodel import optimizer_state_bytes, optimizer_transient
from .errors import BudgetError, size_text


def budget_bytes(budget, device: torch.device) -> int | None:
    """``memory_budget`` in bytes: an int is bytes; a float in (0, 1] a fraction of what the process
    may use — on CUDA the device memory times ``torch.cuda.set_per_process_memory_fraction``'s
    fraction, on CPU the machine's physical memory."""
    if budget is None or isinstance(budget, int):
        return budget
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        return int(total * getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(index) * budget)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * budget)


def _total(ts) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in ts if not t.is_meta}.values())


class MemoryPlan:
    """The memory plan of one rank's job: ``state`` (runtime/state.py), the job's ``cost`` model,
    ``agree`` (rank agreement), ``updater`` (the optimizer step), ``programs()`` (the compiled step
    programs, passes.Program) and ``budget`` (bytes, or None)."""

    def __init__(self, state, buffers, cost, agree, updater, device: torch.device, group, ranks: int,
                 budget: int | None, offload_all: bool, host_update, programs: Callable[[], list]):
        self.state, self.buffers, self.cost, self.agree, self.updater = state, buffers, cost, agree, updater
        self.device, self.group, self.ranks = device, group, ranks
        self.budget, self.offload_all, self.host_update, self.programs = budget, offload_all, host_update, programs
        self.slack = 0
        """Bytes the memory model under-predicted, learned from a measured step."""
        self.replans: list[dict] = []
        self.replan_at = 2
        """The step whose measured peak checks a budgeted plan."""
        self.residency_pending = 0
        """Offload on CUDA: steps left to measure before the measured peak decides residency."""
        self.residency_peak: int | None = None

    # -- prediction ----------------------------------------------------------------------------

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: whole weights, master shards, buffers, optimizer state
        (predicted from the optimizer's kind before its first step)."""
        st, s = self.state.streamer, self.state
        if st is not None:  # master and optimizer state in host memory, but the resident part
            return {"weights": _total(s.compute.values()), "master": 0, "buffers": _total(self.buffers.values()),
                    "optimizer": st.device_bytes(), "staging": st.staging_bytes()}
        return {"weights": _total(s.full.values()), "master": _total(s.master.values()),
                "buffers": _total(self.buffers.values()), "optimizer": optimizer_state_bytes(s.optimizer)}

    def liveness(self, prog):
        """The simulated liveness of ``prog`` as this job executes it, computed once per program."""
        if getattr(prog, "live", None) is None:
            prog.live = self.cost.liveness(prog.gm)
        return prog.live

    def predict(self, prog, tensors) -> dict[str, int]:
        res = self.resident_bytes()
        live = self.liveness(prog)
        on_dev = sum(t.numel() * t.element_size() for t in tensors if t.device == self.device)
        st = self.state.streamer
        after = live.outputs + (st.transient_bytes() if st is not None else optimizer_transient(self.state.optimizer))
        sync = self.state.sync_transient_bytes(self.group, self.ranks)
        peak = sum(res.values()) + on_dev + max(live.peak, after, sync)
        return {**res, "batch": on_dev, "graph_peak": live.peak, "graph_peak_at": live.peak_at,
                "grads": live.outputs, "optimizer_step": after, "gather_back": sync, "peak": peak}

    # -- the graph's share of the budget -------------------------------------------------------

    def graph_budget(self, tensors) -> tuple[int, int] | None:
        """(bytes the step graph may use, bytes of its headroom held for optimizer state kept on the
        device) under ``budget``; None without one."""
        if self.budget is None:
            return None
        st = self.state.streamer
        held = sum(self.resident_bytes().values()) - (st.device_bytes() if st is not None else 0)
        held += sum(t.numel() * t.element_size() for t in tensors if t.device == self.device)
        left = self.budget - held - self.slack
        if left <= 0:
            zero3 = self.state.strategy == "zero3"
            raise BudgetError(f"memory_budget {size_text(self.budget)} is less than the state this rank holds between "
                              f"steps ({size_text(held)}: weights, master shards, optimizer state); use more ranks"
                              + ("" if zero3 else " or strategy='zero3'")
                              + (", offload_optimizer=True (master shards and optimizer state in host memory)"
                                 if zero3 and st is None else "") + ", or raise the budget")
        # under offload, optimizer state claims the headroom before any parameter is kept gathered
        return left, (sum(st.param_bytes(n) for n in st.params) if st is not None and not self.offload_all else 0)

    def graph_room(self, tensors, shrink: float = 1.0) -> int | None:
        """Bytes a step graph may use: the budget (on CUDA without one, the device) less ``shrink`` of
        the state held (the share a plan made with this graph leaves) and ``tensors``; None: no limit."""
        limit = self.budget if self.budget is not None else (
            budget_bytes(1.0, self.device) if self.device.type == "cuda" else None)
        if limit is None:
            return None
        held = sum(self.resident_bytes().values()) * shrink
        held += sum(t.numel() * t.element_size() for t in tensors if t.device == self.device)
        return max(0, int(limit - held - self.slack))

    def check(self, predicted: int, measured: int, steps: int) -> bool:
        """Whether a measured step (after ``steps``) must remake the plan, its peak (max over ranks) over the
        budget or more than 10% off the prediction; the gap is then held back."""
        predicted, measured = self.agree.max(predicted, measured)
        if measured <= self.budget and abs(measured - predicted) <= 0.10 * predicted:
            return False
        self.slack = max(0, measured - predicted)
        self.replans.append({"step": steps, "predicted": predicted, "measured": measured, "held_back": self.slack,
                             "over_budget": measured > self.budget, "budget": self.budget})
        return True

    # -- optimizer state's residency under offload ----------------------------------------------

    def residency_budget(self) -> int | None:
        """Device bytes the offloaded optimizer may fill: ``budget``, else (CUDA) what this process
        may use; None on CPU without a budget (everything stays in the host pool)."""
        if self.budget is not None:
            return self.budget
        return budget_bytes(0.95, self.device) if self.device.type == "cuda" else None  # room: allocator rounding

    def plan_residency(self, prog, tensors) -> None:
        """Under offload, keep on the device the optimizer state that fits beside the step. On CUDA the
        first step runs with all of it on the host and its measured peak (max over ranks) decides: a step
        out of memory would be lost, a measured one cannot be wrong. On CPU the prediction decides."""
        st = self.state.streamer
        if st is None:
            return
        if self.residency_budget() is None or self.offload_all:
            self.plan_host()
            return
        self.updater.drain()
        st.set_resident(())
        prog.resident_state = []
        if self.device.type == "cuda":
            # with the update overlapped, the second step runs beside the first one's update: measure both
            self.residency_pending = 2 if st.overlap else 1
            return
        self.fit_residency(self.predict(prog, tensors)["peak"], lambda: self.predict(prog, tensors)["peak"])
        prog.resident_state = sorted(st.resident)

    def plan_host(self) -> None:
        """Which offloaded parameters the host updates (``offload_host_update``; runtime/offload.plan_host),
        at the slowest rank's measured rate, so every rank makes the same split."""
        st = self.state.streamer
        if st is None or self.host_update is False:
            return
        if st.grad_dtype is None and (progs := self.programs()):
            # the host's gradient buffers are made with the plan: in the step's dtype
            outs = progs[0].gm.graph.find_nodes(op="output")[0].args[0][1:]
            vals = [getattr(o, "meta", {}).get("val") for o in outs]
            st.grad_dtype = next((v.dtype for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
        if self.host_update != "auto":
            st.plan_host(self.cost.host, fraction=float(self.host_update))
        elif self.device.type == "cuda" and st.sliced:
            if st.host_rate is None:
                (per,) = self.agree.max(int(1e15 / st.measure_host_rate()))  # fs per element
                st.host_rate = 1e15 / per
            st.plan_host(self.cost.host, rate=st.host_rate)
        self.updater.last_s = None  # the update changed: measure it again

    def fit_residency(self, peak: int, check: Callable[[], int] | None = None, measured: bool = False) -> None:
        """Greedy over parameters in order: keep the state of each one that fits in the budget left above
        ``peak`` (the step's peak with nothing resident); with ``check`` (the predicted peak of the choice),
        drop the last taken until it fits. Same shard shapes and ``peak`` on every rank: the same choice.
        A ``measured`` peak of overlapped steps already holds what the running update keeps.

        Keeping state resident only shortens the update, so the gradients it holds while the next step
        runs can only be freed sooner: the peak measured with nothing resident bounds the rest."""
        st = self.state.streamer
        self.updater.drain()  # the state moves: no update may be running
        budget = self.residency_budget()
        left = budget - self.slack - peak
        if st.overlap and not measured:
            # the next graph runs while the update still holds the gradients and its temporaries
            left -= max((self.liveness(prog).outputs for prog in self.programs()), default=0) + st.transient_bytes()
        keep = []
        for n in st.params:
            b = st.param_bytes(n)
            if b <= left:
                keep.append(n)
                left -= b
        st.set_resident(keep)
        while keep and check is not None and check() + self.slack > budget:
            keep.pop()
            st.set_resident(keep)
        for prog in self.programs():
            prog.resident_state = sorted(keep)
        self.plan_host()

    def measure_residency(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Offload on CUDA: one of the first steps (two with the update overlapped, the second beside the
        first one's update), all state on the host; after the last, their peak decides residency."""
        if self.residency_peak is None:
            torch.cuda.empty_cache()  # the reserved peak then counts these steps' own blocks
            torch.cuda.reset_peak_memory_stats(self.device)
            self.residency_peak = 0
        loss = step()
        self.residency_pending -= 1
        if self.residency_pending:
            return loss
        self.updater.drain()
        # reserved, not allocated: what the allocator's rounding and fragmentation cost counts too
        (self.residency_peak,) = self.agree.max(torch.cuda.max_memory_reserved(self.device))
        self.fit_residency(self.residency_peak, measured=True)
        return loss
