"""No silent divergence: the model and optimizer a job holds train only through ``job.step``.

A job's model is the user's module, but its weights are the job's (under zero3 they are not in the
module at all: it holds ``meta`` tensors). A loop of one's own over it (``loss = job.model(x);
loss.backward(); opt.step()``) would not reduce gradients across ranks (ddp's ranks then drift
apart with no error) or would fail deep in a kernel (zero3: "Tensor on device meta"). So:

- calling ``job.model`` with gradients enabled outside the job's own tracing raises, saying to use
  ``job.step``; so does any call while it holds no weights (meta). Evaluation under ``torch.no_grad()``
  of a model that keeps its weights (ddp, fp32 zero1/2) works as always;
- ``job.optimizer.step()`` outside ``job.step`` raises likewise."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..capture.trace import TRACING
from ..errors import OutsideStepError


def _model_hook(job):
    def check(module: nn.Module, args, kwargs):
        if TRACING.get():
            return None
        p = next(module.parameters(), None)
        if p is not None and p.is_meta:
            raise OutsideStepError(f"job.model holds no weights here: under {job.strategy} they live sharded in the "
                                   "job. Train with job.step(batch), evaluate with job.eval_step(batch), and get the "
                                   "weights with job.full_state_dict()")
        if torch.is_grad_enabled():
            raise OutsideStepError(
                "job.model was called with gradients enabled outside job.step: a backward and optimizer step of "
                "your own would not reduce gradients across ranks (their weights would drift apart). Train with "
                "job.step(batch) (a list of micro-batches accumulates); for inference wrap the call in "
                "torch.no_grad(), or use job.eval_step(batch)")

    return check


def _optimizer_hook(job):
    def check(opt, args, kwargs):
        if not job._stepping:
            raise OutsideStepError("job.optimizer.step() was called outside job.step: the job reduces the gradients "
                                   "and steps the optimizer itself. Call job.step(batch) once per optimizer step")

    return check


def install(job) -> None:
    """Guard ``job.model`` and ``job.optimizer`` (again after the state is made anew; a guarded optimizer stays so)."""
    if not getattr(job.model, "_shardwise_guarded", False):
        job.model.register_forward_pre_hook(_model_hook(job), with_kwargs=True)
        job.model._shardwise_guarded = True
    opt = job.state.optimizer
    if not getattr(opt, "_shardwise_guarded", False):
        opt.register_step_pre_hook(_optimizer_hook(job))
        opt._shardwise_guarded = True


@contextlib.contextmanager
def stepping(job):
    """Inside ``job.step``: its own optimizer step is allowed."""
    job._stepping += 1
    try:
        yield
    finally:
        job._stepping -= 1
