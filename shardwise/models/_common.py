"""Pieces shared by the built-in models."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class DecoderConfig:
    """What every built-in decoder's config has."""

    vocab: int = 256
    """Vocabulary size."""
    seq: int = 64
    """Maximum sequence length (the size of the position or rotary tables)."""
    d_model: int = 128
    """Hidden size."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention (query) heads; must divide d_model."""
    checkpoint: bool = False
    """Wrap each block in non-reentrant torch.utils.checkpoint."""


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; half-precision logits are upcast to fp32 first, wider ones kept."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq: int, head_dim: int, theta: float = 10000.0):
    """cos/sin tables [seq, head_dim/2] for rotary embeddings (kept as non-persistent buffers)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, t, hd]; rotate pairs (first half, second half) of the head dimension."""
    t = x.shape[2]
    cos, sin = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Grouped-query causal attention with rotary positions (Llama style, no biases)."""

    def __init__(self, d_model: int, n_head: int, n_kv_head: int):
        super().__init__()
        if d_model % n_head or n_head % n_kv_head:
            raise ValueError(f"Attention: n_head={n_head} must divide d_model={d_model} and n_kv_head={n_kv_head} "
                             "must divide n_head")
        self.n_head, self.n_kv, self.hd = n_head, n_kv_head, d_model // n_head
        self.wq = nn.Linear(d_model, n_head * self.hd, bias=False)
        self.wk = nn.Linear(d_model, n_kv_head * self.hd, bias=False)
        self.wv = nn.Linear(d_model, n_kv_head * self.hd, bias=False)
        self.wo = nn.Linear(n_head * self.hd, d_model, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_head, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_head // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, ffn, bias=False)
        self.w3 = nn.Linear(d_model, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def init_weights(model: nn.Module, n_layer: int) -> None:
    """Normal(0, 0.02) for matrices and embeddings, scaled down for residual outputs."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02 / (2 * n_layer) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02)
