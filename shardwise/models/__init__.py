"""Built-in reference models: GPT-2 style, Llama style and a top-k MoE (dense or capacity dispatch).

Each model's ``forward(idx, targets=None)`` returns the mean next-token cross-entropy when ``targets`` is given, logits
otherwise. ``build(name, size, **overrides)`` picks a preset."""

from __future__ import annotations

import dataclasses

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .moe import MoE, MoEConfig

PRESETS: dict[str, dict[str, dict]] = {
    "gpt": {
        "tiny": dict(vocab=64, seq=16, d_model=32, n_layer=2, n_head=4),
        "small": dict(vocab=256, seq=64, d_model=128, n_layer=4, n_head=4),
        "124m": dict(vocab=50304, seq=1024, d_model=768, n_layer=12, n_head=12),
    },
    "llama": {
        "tiny": dict(vocab=64, seq=16, d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn=48),
        "small": dict(vocab=256, seq=64, d_model=128, n_layer=4, n_head=4, n_kv_head=2, ffn=256),
        "1b": dict(vocab=32000, seq=2048, d_model=2048, n_layer=16, n_head=16, n_kv_head=8, ffn=8192),
        "3b": dict(vocab=128256, seq=2048, d_model=3072, n_layer=28, n_head=24, n_kv_head=8, ffn=8192),
        "8b": dict(vocab=128256, seq=4096, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, ffn=14336),
    },
    "moe": {
        "tiny": dict(vocab=64, seq=16, d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn=32, n_expert=4),
        "small": dict(vocab=256, seq=64, d_model=128, n_layer=4, n_head=4, n_kv_head=2, ffn=128, n_expert=4),
        "1b": dict(vocab=32000, seq=2048, d_model=1024, n_layer=12, n_head=16, n_kv_head=8, ffn=2816, n_expert=8),
        # Mixtral 8x7B's layer (8 experts, top 2, SwiGLU 14336, GQA 32/8) with 8 of its 32 layers and
        # GShard-style capacity dispatch, so the experts run a real MoE layer's FLOPs (x1.25)
        "8x7b-8l": dict(vocab=32000, seq=4096, d_model=4096, n_layer=8, n_head=32, n_kv_head=8, ffn=14336,
                        n_expert=8, top_k=2, capacity_factor=1.25),
    },
}

_CLASSES = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig), "moe": (MoE, MoEConfig)}


def build(name: str, size: str = "tiny", **overrides):
    """Build a built-in model from a preset, e.g. ``build("llama", "tiny", checkpoint=True)``."""
    if name not in _CLASSES:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(_CLASSES)}")
    if size not in PRESETS[name]:
        raise ValueError(f"unknown size {size!r} for model {name!r}: choose one of {sorted(PRESETS[name])}")
    cls, cfg_cls = _CLASSES[name]
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    if bad := set(overrides) - fields:
        raise ValueError(f"model {name!r} has no option(s) {sorted(bad)}; it has {sorted(fields)}")
    return cls(cfg_cls(**{**PRESETS[name][size], **overrides}))


__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MoE", "MoEConfig", "PRESETS", "build"]
