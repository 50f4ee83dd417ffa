"""Training-loop pieces people reach for: learning-rate schedules and parameter groups by name."""

from __future__ import annotations

import math

import torch


def cosine_with_warmup(optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float = 0.1):
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` of the base rate at ``total``.

    A plain ``torch.optim.lr_scheduler.LambdaLR``; call ``.step()`` after each optimizer step.

    Example::

        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> sched = cosine_with_warmup(opt, warmup=2, total=10)
        >>> round(opt.param_groups[0]["lr"], 3)
        0.5
    """
    if warmup < 0 or total < 1:
        raise ValueError(f"cosine_with_warmup: need warmup >= 0 and total >= 1, got warmup={warmup}, total={total}")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def no_decay(name: str) -> bool:
    """Biases and normalisation weights: the parameters conventionally trained without weight decay."""
    return name.rsplit(".", 1)[-1] == "bias" or any(k in name for k in ("norm", "ln_", ".ln", "ln1", "ln2"))


def adamw_groups(named, lr: float, weight_decay: float = 0.1, **kw) -> torch.optim.AdamW:
    """AdamW with two groups by name: weight decay on matrices, none on biases and norms.

    Works as a ``shardwise.compile`` optimizer factory (it receives ``(name, shard)`` pairs) and on
    ``model.named_parameters()`` alike."""
    named = list(named)
    decay = [(n, p) for n, p in named if not no_decay(n)]
    plain = [(n, p) for n, p in named if no_decay(n)]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, **kw)
