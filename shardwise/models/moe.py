"""Llama-style decoder whose FFN is a dropless top-2 mixture of experts with static shapes.

Every expert runs on every token and its output is weighted by the router's gate, which is zero
for experts outside a token's top 2. Nothing is dropped and no shape depends on the routing, so
the whole step traces to one graph (data-dependent dispatch would not).
"""

from __future__ import annotations

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

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"MoEConfig: top_k={self.top_k} must be in [1, n_expert={self.n_expert}]")


class MoEFFN(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_expert, bias=False)
        e, d, f = cfg.n_expert, cfg.d_model, cfg.ffn
        self.w1 = nn.Parameter(torch.randn(e, d, f) * 0.02)
        self.w3 = nn.Parameter(torch.randn(e, d, f) * 0.02)
        self.w2 = nn.Parameter(torch.randn(e, f, d) * 0.02)

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)  # [b, t, e]
        top, idx = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        h = F.silu(torch.einsum("btd,edf->ebtf", x, self.w1)) * torch.einsum("btd,edf->ebtf", x, self.w3)
        y = torch.einsum("ebtf,efd->ebtd", h, self.w2)
        return torch.einsum("ebtd,bte->btd", y, gates)


class MoEBlock(LlamaBlock):
    def make_ffn(self, cfg):
        return MoEFFN(cfg)


class MoE(Llama):
    block_cls = MoEBlock
