"""What a ``Job`` holds and has learned, as read-only views (and two settings) over its parts: the
optimizer, the control group, the memory plan's budget and re-plans, the update's timings."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Held:
    """The properties of ``Job`` that read its parts (job.py builds the parts)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's trainable state (shards under zero1-3)."""
        return self.state.optimizer

    @property
    def ctrl(self) -> dist.ProcessGroup:
        """The gloo group of the job's ranks that control messages travel on."""
        return self.agree.ctrl

    @property
    def memory_budget(self) -> int | None:
        return self.plan.budget

    @property
    def replans(self) -> list[dict]:
        """Each time a measured step contradicted the memory plan: its step, predicted and measured peaks."""
        return self.plan.replans

    @property
    def replan_at(self) -> int:
        """The step whose measured peak checks a budgeted plan (default 2)."""
        return self.plan.replan_at

    @replan_at.setter
    def replan_at(self, step: int) -> None:
        self.plan.replan_at = step

    @property
    def recompiles_avoided(self) -> int:
        return self.compiler.recompiles_avoided

    @property
    def residency_peak(self) -> int | None:
        """Offload on CUDA: the measured peak of the first steps that decided what state stays on the device."""
        return self.plan.residency_peak

    @property
    def time_optimizer(self) -> bool:
        """Time the optimizer phase of each step (syncs the GPU); ``last_optimizer_s`` then holds it."""
        return self.updater.timed

    @time_optimizer.setter
    def time_optimizer(self, on: bool) -> None:
        self.updater.timed = on

    @property
    def last_optimizer_s(self) -> float | None:
        return self.updater.last_s

    @last_optimizer_s.setter
    def last_optimizer_s(self, s: float | None) -> None:
        self.updater.last_s = s

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """With ``clip_grad_norm``: the global gradient norm of the last step, before clipping."""
        return self.updater.last_grad_norm
