"""GPT-2 style decoder: learned positions, LayerNorm, GELU MLP, embedding tied to the output head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import DecoderConfig, next_token_loss


@dataclass(frozen=True)
class GPTConfig(DecoderConfig):
    dropout: float = 0.0
    """Dropout on attention output, MLP output and embeddings (training only)."""
    bias: bool = True
    """Biases in linear layers and LayerNorms (GPT-2 has them)."""
    tie: bool = True
    """Share the token embedding with the output head, as GPT-2 does."""

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: n_head={self.n_head} must divide d_model={self.d_model}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        return F.dropout(self.proj(y), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie:
            self.head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        if t > self.cfg.seq:
            raise ValueError(f"GPT: sequence length {t} exceeds the model's seq={self.cfg.seq}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        x = F.dropout(x, self.cfg.dropout, self.training)
        for blk in self.blocks:
            x = (torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
                 if self.cfg.checkpoint and self.training else blk(x))
        logits = self.head(self.ln_f(x))
        return logits if targets is None else next_token_loss(logits, targets)
