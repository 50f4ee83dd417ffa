"""Llama style decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ._common import Attention, DecoderConfig, RMSNorm, SwiGLU, init_weights, next_token_loss, rope_tables


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    n_kv_head: int = 2
    """Key/value heads (grouped-query attention); must divide n_head."""
    ffn: int = 256
    """SwiGLU hidden size."""


class LlamaBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_head, cfg.n_kv_head)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.ffn = self.make_ffn(cfg)

    def make_ffn(self, cfg):
        return SwiGLU(cfg.d_model, cfg.ffn)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    block_cls = LlamaBlock

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(self.block_cls(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.seq, cfg.d_model // cfg.n_head)
        self.register_buffer("rope_cos", cos.float(), persistent=False)
        self.register_buffer("rope_sin", sin.float(), persistent=False)
        init_weights(self, cfg.n_layer)

    def forward(self, idx, targets=None):
        if idx.shape[1] > self.cfg.seq:
            raise ValueError(f"{type(self).__name__}: sequence length {idx.shape[1]} exceeds seq={self.cfg.seq}")
        x = self.tok(idx)
        for blk in self.blocks:
            x = (torch.utils.checkpoint.checkpoint(blk, x, self.rope_cos, self.rope_sin, use_reentrant=False)
                 if self.cfg.checkpoint and self.training else blk(x, self.rope_cos, self.rope_sin))
        logits = self.head(self.norm(x))
        return logits if targets is None else next_token_loss(logits, targets)
