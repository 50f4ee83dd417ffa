"""The optimizer step as the cost model sees it: its state's bytes, its temporaries, its time.

The compiler's prediction and the planner's both time the update as memory-bound passes over the fp32 master bytes
(``update_time``): a fused Adam reads parameter, gradient and two moments and writes three (7 passes of the master's
bytes, 28 bytes a parameter); torch's multi-tensor and loop Adam make about 20 (decay, lerp, two for v, sqrt, div, add,
addcdiv)."""

from __future__ import annotations

import torch

PASSES = {"fused": 7, "unfused-adam": 20}
"""Passes over the master bytes one update makes."""


def optimizer_kernel(defaults: dict, device: str) -> str:
    """The kernel a torch optimizer's step runs, from its ``defaults``: ``fused``, ``foreach`` (the
    multi-tensor path, torch's default on CUDA) or ``for-loop`` (the default elsewhere)."""
    if defaults.get("fused"):
        return "fused"
    foreach = defaults.get("foreach")
    return "foreach" if foreach or (foreach is None and device == "cuda") else "for-loop"


def update_time(master_bytes: float, bandwidth: float, adam: bool = True, kernel: str = "fused") -> float:
    """Seconds of one update over ``master_bytes`` of master weights at ``bandwidth`` bytes/s."""
    return (PASSES["unfused-adam"] if adam and kernel != "fused" else PASSES["fused"]) * master_bytes / bandwidth


def optimizer_transient(opt: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's step allocates for itself on top of its state (a model, not a measure).

    torch's multi-tensor (``foreach``) Adam/AdamW — the default on CUDA — holds one whole-list temporary at a time: the
    bias-corrected ``sqrt(v)``. Every other update is in place, and the gradient copy that L2 decay or ``maximize``
    makes is dropped before that list is built (torch/optim/adam.py, ``_multi_tensor_adam``). On an H200 (1.1B Llama,
    one rank) the measured peak ruled out a second list. The single-tensor loop — the CPU default — holds two
    temporaries of one parameter plus the previous parameter's denominator. Other optimizers are modelled as Adam."""
    ps = [p for g in opt.param_groups for p in g["params"]]
    return step_temporaries([p.numel() * p.element_size() for p in ps], opt.defaults, ps[0].device.type) if ps else 0


def step_temporaries(per: list[int], defaults: dict, device: str) -> int:
    """``optimizer_transient`` of an optimizer over tensors of ``per`` bytes, by its ``defaults``."""
    kernel = optimizer_kernel(defaults, device)
    if kernel == "fused":
        return 0
    if kernel == "foreach":
        return sum(per)
    # the loop: sqrt(v) and its bias-corrected copy of one parameter, while the previous parameter's
    # denominator is still held by its loop variable
    return max(2 * n + (per[i - 1] if i else 0) for i, n in enumerate(per))


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state once it exists: measured where it does, else from the optimizer's kind."""
    if have := sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor)):
        return have
    # tensors of the parameter's size per parameter; each of these kinds also keeps a scalar ``step`` tensor
    kinds = {torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.Adamax: 2, torch.optim.NAdam: 2,
             torch.optim.RAdam: 2, torch.optim.Adagrad: 1, torch.optim.RMSprop: 1, torch.optim.Adadelta: 2}
    k = next((m for c, m in kinds.items() if isinstance(opt, c)), 0)
    step = 4 if k else 0
    if isinstance(opt, torch.optim.SGD) and opt.defaults.get("momentum"):
        k = 1
    return sum(k * p.numel() * p.element_size() + step for g in opt.param_groups for p in g["params"])
