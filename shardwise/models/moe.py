"""Llama-style decoder whose FFN is a top-k mixture of experts with static shapes.

Two ways to run the experts, both one traced graph (no shape depends on the routing):

- ``capacity_factor=None`` (default): dropless and dense. Every expert runs on every token, its output
  weighted by the router's gate (zero outside a token's top k). Exact, and E/k times the expert FLOPs
  of a real MoE layer: for small models and tests.
- ``capacity_factor=c``: GShard/Switch dispatch. Each expert takes at most ``ceil(c * tokens * k / E)``
  (token, choice) pairs of the micro-batch, first choices first, in token order; a pair past capacity
  is dropped (the residual carries the token; the buffer ``dropped`` counts them per micro-batch). The
  kept tokens are gathered into an ``[E, capacity, d]`` buffer for batched products, and each token
  gathers its outputs back, weighted by its gates: ``c`` times a real MoE layer's expert FLOPs. With
  ``c >= E / k`` nothing is dropped and the result equals the dense path's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import Llama, LlamaBlock, LlamaConfig


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A Llama config whose FFN is a mixture of experts; ``ffn`` is each expert's hidden size."""

    n_expert: int = 4
    """Number of experts."""
    top_k: int = 2
    """Experts per token."""
    capacity_factor: float | None = None
    """None: every expert runs on every token (dense, dropless). A number: each expert takes this
    many times its even share of the micro-batch's (token, choice) pairs, the rest are dropped."""

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"MoEConfig: top_k={self.top_k} must be in [1, n_expert={self.n_expert}]")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig: capacity_factor={self.capacity_factor} must be a positive number "
                             "(1.25 is common) or None (dense, dropless)")


class MoEFFN(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.n_expert = cfg.n_expert
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.d_model, cfg.n_expert, bias=False)
        e, d, f = cfg.n_expert, cfg.d_model, cfg.ffn
        self.w1 = nn.Parameter(torch.randn(e, d, f) * 0.02)
        self.w3 = nn.Parameter(torch.randn(e, d, f) * 0.02)
        self.w2 = nn.Parameter(torch.randn(e, f, d) * 0.02)
        # the capacity dispatch's (token, choice) pairs dropped in the last micro-batch (not saved)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.long), persistent=False)

    def capacity(self, tokens: int) -> int:
        """(token, choice) pairs each expert takes from a micro-batch of ``tokens`` tokens."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_expert)

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)  # [b, t, e]
        top, idx = probs.topk(self.top_k, dim=-1)
        gate = top / top.sum(-1, keepdim=True)
        if self.capacity_factor is None:
            gates = torch.zeros_like(probs).scatter(-1, idx, gate)
            h = F.silu(torch.einsum("btd,edf->ebtf", x, self.w1)) * torch.einsum("btd,edf->ebtf", x, self.w3)
            return torch.einsum("ebtd,bte->btd", torch.einsum("ebtf,efd->ebtd", h, self.w2), gates)
        return self._dispatched(x, idx, gate)

    def _dispatched(self, x, idx, gate):
        b, t, d = x.shape
        n, k, e = b * t, self.top_k, self.n_expert
        cap = self.capacity(n)
        # (token, choice) pairs choice-major: every token's first choice queues before any second one
        choice = idx.reshape(n, k).t().reshape(-1)  # [k*n] expert of each pair
        onehot = F.one_hot(choice, e)
        pos = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place in its expert's queue
        dump = e * cap  # one extra slot, never read, for the pairs past capacity
        self.dropped.copy_((pos >= cap).sum())
        slot = torch.where(pos < cap, choice * cap + pos, torch.full_like(pos, dump))
        # which token fills each slot (n: a zero row), then the experts as batched products
        token = torch.arange(n, device=x.device).repeat(k)
        filler = torch.full((dump + 1,), n, dtype=token.dtype, device=x.device).scatter(0, slot, token)[:dump]
        xe = torch.cat([x.reshape(n, d), x.new_zeros(1, d)]).index_select(0, filler).view(e, cap, d)
        h = F.silu(torch.bmm(xe, self.w1)) * torch.bmm(xe, self.w3)
        ye = torch.cat([torch.bmm(h, self.w2).reshape(dump, d), x.new_zeros(1, d)])
        # each token gathers its k pairs' expert outputs (a dropped pair gets the zero row), weighted
        # by their gates. Token-major, so every operand and the backward's products are contiguous
        # (choice-major, the backward's product of the expanded gradient and the transposed gates
        # is laid out choice-inner, and a graph that views it as rows fails when run eagerly)
        pair = slot.view(k, n).t().reshape(-1)
        return (ye.index_select(0, pair).view(n, k, d) * gate.reshape(n, k, 1)).sum(1).view(b, t, d)


class MoEBlock(LlamaBlock):
    def make_ffn(self, cfg):
        return MoEFFN(cfg)


class MoE(Llama):
    block_cls = MoEBlock
