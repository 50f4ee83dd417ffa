"""Losses: the negative log-likelihood over a whole row of logits and a mean over the whole batch,
so every input whole (a vocab-parallel loss is the tensor-parallel pass's to build)."""

from __future__ import annotations

import torch

from ..ops import register
from .base import R, outputs_like, tensors

aten = torch.ops.aten


def whole(node, place, ranks):
    return {a: R for a in tensors(node) if place(a) != R}, outputs_like(node, R)


register(aten.nll_loss_forward.default, aten.nll_loss_backward.default, aten.nll_loss2d_forward.default,
         aten.nll_loss2d_backward.default, rule=whole)
