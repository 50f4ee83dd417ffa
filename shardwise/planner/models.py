"""Model shapes for ``shardwise plan``: presets of published models and Hugging Face ``config.json``s."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..costmodel.compute import flops_per_token


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as far as cost is concerned."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int = 4096
    gated: bool = True
    """SwiGLU-style MLP (three matrices) rather than two."""
    tied: bool = False
    """Output head shares the embedding."""
    experts: int = 1
    top_k: int = 1
    bias: bool = False
    learned_positions: int = 0
    """Rows of a learned position embedding (GPT-3), 0 for rotary."""
    dropout: bool = False
    """Dropout after attention and MLP (GPT-3, Megatron's GPT): its masks are kept for the backward."""
    head_size: int = 0
    """Width of one attention head; 0: hidden / heads. MaxText's scaled models keep 128 while the
    head count grows faster than the width, so their queries are wider than the model."""
    window: int = 0
    """Sliding-window attention (Mistral): each query attends to this many keys; 0: the whole sequence."""
    shared_ffn: int = 0
    """MoE: the inner width of the shared expert(s) every token also passes through (Qwen-MoE,
    DeepSeek), a gated MLP beside the routed ones; 0: none."""
    q_lora: int = 0
    kv_lora: int = 0
    rope_dim: int = 0
    """Multi-head latent attention (DeepSeek) where ``kv_lora`` > 0: the queries' bottleneck rank (0: none), the rank of
    the keys' and values' latent, the rotary width a query and key head add to ``head_size`` (a value head's width)."""
    dense_layers: int = 0
    dense_ffn: int = 0
    """MoE: the first ``dense_layers`` layers have a dense gated MLP ``dense_ffn`` wide (DeepSeek)."""

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output (heads x head size; MLA: their mean)."""
        return self.heads * (self.head_dim + self.rope_dim // 2)

    def attention_params(self) -> int:
        h, q, kv, n, r = self.hidden, self.q_dim, self.kv_heads * self.head_dim, self.heads, self.q_lora
        if self.kv_lora:  # MLA: the queries' bottleneck (and its norm), the latent and the shared rotary key, up, out
            qk = n * (self.head_dim + self.rope_dim)
            return ((h * r + r + r * qk) if r else h * qk) + h * (self.kv_lora + self.rope_dim) + self.kv_lora * (
                1 + 2 * n * self.head_dim) + n * self.head_dim * h
        return h * q + 2 * h * kv + q * h + (q + h + 2 * kv if self.bias else 0)

    def expert_params(self) -> int:
        """One MLP (one expert of an MoE layer)."""
        mats = 3 if self.gated else 2
        return mats * self.hidden * self.ffn + ((self.ffn + self.hidden) if self.bias else 0)

    def layer_params(self, active: bool = False) -> int:
        router = self.hidden * self.experts if self.experts > 1 else 0
        experts = self.top_k if active and self.experts > 1 else self.experts
        norms = 2 * self.hidden * (2 if self.bias else 1)
        shared = 3 * self.hidden * self.shared_ffn
        return self.attention_params() + experts * self.expert_params() + router + norms + shared

    def layers_params(self, active: bool = False) -> int:  # every layer's, the first dense_layers with a dense MLP
        dense = self.attention_params() + 3 * self.hidden * self.dense_ffn + 2 * self.hidden
        return (self.layers - self.dense_layers) * self.layer_params(active) + self.dense_layers * dense

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.learned_positions * self.hidden

    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def params(self, active: bool = False) -> int:
        """All parameters; ``active``: those one token passes through (MoE: ``top_k`` experts per layer)."""
        final_norm = self.hidden * (2 if self.bias else 1)
        return self.embedding_params() + self.head_params() + self.layers_params(active) + final_norm

    def flops_per_token(self, seq: int | None = None) -> float:
        """Training FLOPs per token: 6 per active weight a token multiplies (the embedding lookup is no multiply; a tied
        head still is one) plus 12·L·d·T for attention (PaLM's formula; d the query width, heads x head size; T the keys
        a query attends to: the window, where one is shorter than the sequence)."""
        matmul = self.layers_params(True) - self.layers * 2 * self.hidden + self.vocab * self.hidden
        seq = seq or self.seq
        return flops_per_token(matmul, self.layers, self.q_dim, min(seq, self.window) if self.window else seq)

    def layer_activation_bytes(self, seq: int, micro_batch: int, tp: int = 1, sp: bool = False,
                               recompute: str = "none", fused_attention: bool = True, capacity: float = 1.0,
                               stack: str = "megatron", eager: bool = False) -> float:
        """Bytes one layer keeps for its backward per micro-batch (16-bit activations, 1-byte dropout masks):
        Korthikanti et al. 2022's accounting (section 4, Table 2), term by term, so that it also holds for gated MLPs,
        grouped-query attention and models without dropout. Kept whole on every tensor-parallel rank unless sequence
        parallel: the two norm inputs and the inputs of the QKV and first MLP matmuls (8·sbh) and the dropout masks
        (2·sbh). Split over ``tp``: Q (2·sbh), K and V (2·sb·kv each), the attention output (2·sbh) and the MLP's inner
        activations (GeLU: its input and output, 4·sb·ffn; gated: gate, up and their product, 6·sb·ffn; MoE: per routed
        expert). The attention scores (5·a·s²·b) only when the attention is not fused (flash attention recomputes them)
        and not recomputed (``selective``). For Megatron's GPT (ffn = 4h, kv = h, dropout) this is the paper's ``sbh·(10
        + 24/t + 5as/(ht))``. Full recomputation keeps the layer's input alone (2·sbh/t), and so does per-layer
        ``block`` checkpointing (whole on every rank without sequence parallelism); per-op selective recomputation
        (``selective-op``) the layer's input, every other matrix product's output and the attention output. ``capacity``
        scales an MoE layer's expert activations (capacity dispatch pads each expert's buffer). A PyTorch ``stack``
        keeps what was measured of it (``TORCH_ACTIVATIONS``) in place of the hidden-sized terms and K and V; under
        autocast its residual stream, so a checkpointed layer's input, is fp32."""
        sb = seq * micro_batch
        sbh = sb * self.hidden
        torch, autocast = stack != "megatron", stack == "torch-autocast"
        if recompute == "full":
            return 2.0 * sbh / tp
        if recompute == "block":  # torch's checkpoint keeps the layer input whole unless sequence parallel
            return (4.0 if autocast else 2.0) * sbh / (tp if sp else 1)
        kv = self.kv_heads * self.head_dim
        if recompute == "selective-op":
            # the layer's input and the outputs it keeps: every other matrix product (Q, V, the MLP's
            # first and last) and the attention's; the last product's output is whole on every rank
            whole = 4.0 * sbh
            split = 2.0 * sb * (2 * self.q_dim + kv + self.ffn * self.top_k * capacity)
        else:
            whole = ((TORCH_ACTIVATIONS[eager, autocast] if torch else 8.0) + 2.0 * self.dropout) * sbh
            split = (4.0 * sb * self.q_dim + (0.0 if torch else 4.0 * sb * kv)
                     + (6.0 if self.gated else 4.0) * sb * self.ffn * self.top_k * capacity
                     + 6.0 * sb * self.shared_ffn)
            if recompute == "none" and not fused_attention:
                split += 5.0 * self.heads * seq * sb
        return (whole + split) / tp if sp else whole + split / tp

    def elementwise_bytes(self, seq: int, tp: int = 1, sp: bool = False, recompute: str = "none",
                          fused_attention: bool = True, capacity: float = 1.0, eager: bool = False) -> float:
        """HBM bytes one token moves through one layer's memory-bound (non-matmul) kernels on one
        tensor-parallel rank in a training step, counted from the kernels of an unfused 16-bit layer:

        - forward, hidden-sized: two norms (read + write, 4·h each), two residual adds with their dropout (read two,
          write one, mask: 7·h each; 6·h without dropout); whole on every rank unless sequence parallel;
        - forward, MLP activation: GeLU reads and writes ffn (4·ffn), a gated unit reads two and
          writes one (6·ffn; MoE: per routed expert); split over ``tp``;
        - forward, attention scores when not fused (flash attention has none): the score matmul's
          write, softmax's read and write, dropout's read, write and mask, the value matmul's read:
          13·a·s bytes (a heads, s the sequence; 8·a·s without dropout), split over ``tp``;
        - the backward moves about twice the forward; full and per-op selective recomputation add one
          forward, selective recomputation one forward of the attention scores.

        A model of what eager Megatron-style kernels move, not a measurement; compilers that fuse
        kernels move less (the accelerator's fitted ceiling absorbs some of that). ``eager``: a rotary
        model's norms and rotary embedding as PyTorch's decomposed ops in fp32 (``EAGER_BYTES``)."""
        h = self.hidden
        rotary = eager and not self.learned_positions
        hidden = (2 * 4 + 2 * (7 if self.dropout else 6) + EAGER_BYTES * rotary) * h / (tp if sp else 1)
        act = ((6.0 if self.gated else 4.0) * self.ffn * self.top_k * capacity + 6.0 * self.shared_ffn) / tp
        scores = 0.0 if fused_attention else (13.0 if self.dropout else 8.0) * self.heads * seq / tp
        fwd_e, fwd_s = hidden + act, scores
        return (fwd_e * (3 + (recompute in ("full", "block", "selective-op")))
                + fwd_s * (3 + (recompute in ("full", "block", "selective"))))

    def __str__(self) -> str:
        moe = f", {self.experts} experts top-{self.top_k}" if self.experts > 1 else ""
        return (f"{self.name}: {self.params() / 1e9:.1f}B params ({self.layers} layers, d={self.hidden}, "
                f"{self.heads} heads / {self.kv_heads} kv, ffn {self.ffn}, vocab {self.vocab}{moe})")


EAGER_BYTES = 85.0
"""Bytes per unit of width one token moves in one layer's forward beyond the fused count when a rotary
model's two RMSNorms and its rotary embedding run as eager PyTorch's decomposed ops (fp32 upcasts, a
kernel per op). Fitted on torchtitan's Llama 3.1 8B FSDP eager run on 8 H100s with HBM2e at 2.4 TB/s
(data/runs.toml; 140 while that run was planned at the SXM's 3.35 TB/s)."""


TORCH_ACTIVATIONS = {(False, False): 14.0, (True, False): 25.5, (False, True): 18.0, (True, True): 39.5}
"""Bytes per unit of width one token keeps in one layer for its backward under PyTorch, beside its queries (4·q) and MLP
(6·ffn), keyed (eager, autocast); measured on one H200 with Llama layers of width 2048 and 4096
(bench/results/2026-12-04-h200-activation-memory.md): torch.compile in bf16 keeps 14 where Korthikanti counts 8 (+
4·kv), eager PyTorch 25.5 (its decomposed norms' and rotary embedding's fp32 intermediates); autocast over fp32 weights
18 and 39.5 (an fp32 residual stream; its 16-bit copies of the weights are counted as weights)."""


MODELS = {
    # Llama 3 / 3.1 (Meta's model cards: 8.03B, 70.6B, 405.9B parameters)
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256, seq=8192),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256, seq=8192),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 8, 53248, 128256, seq=8192),
    # Mixtral 8x7B (46.7B total, 12.9B active per token)
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, seq=4096, experts=8, top_k=2),
    # GPT-3 175B (Brown et al. 2020): GELU MLP, biases, learned positions, tied embedding
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 96, 4 * 12288, 50257, seq=2048, gated=False, tied=True,
                           bias=True, learned_positions=2048, dropout=True)}


NON_GATED = {"gpt2", "gpt_bigcode", "gptj", "gpt_neox", "opt", "bloom", "falcon", "phi"}  # a two-matrix MLP
LEARNED_POSITIONS = {"gpt2", "gpt_bigcode", "opt"}  # the rest: rotary or ALiBi


def _first(c: dict, *keys, default=None):
    return next((c[k] for k in keys if c.get(k) is not None), default)


def from_hf_config(path: str, name: str | None = None) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json``: Llama, Mistral, Mixtral, Qwen-style keys, and GPT-2, OPT,
    BLOOM, GPT-J/NeoX, Falcon and Phi ones (``n_embd``, ``n_layer``, ``n_head``, ``n_inner``, ``ffn_dim``; a non-gated
    MLP, 4 x the width where no size is given; learned positions where the family has them; biases and a tied head as
    the family's defaults, where the file does not say); a sliding window (Mistral's ``sliding_window``), and MoE
    experts' own width and shared experts (Qwen-MoE's ``moe_intermediate_size`` and ``shared_expert_intermediate_size``;
    DeepSeek's ``n_routed_experts`` and ``n_shared_experts``)."""
    with open(path) as f:
        c = json.load(f)
    kind = c.get("model_type", "")
    plain = kind in NON_GATED
    hidden = _first(c, "hidden_size", "n_embd", "n_embed", "d_model")
    layers = _first(c, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(c, "num_attention_heads", "n_head")
    vocab = c.get("vocab_size")
    experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts", default=1)
    # an MoE's experts have a width of their own (Qwen-MoE, DeepSeek: moe_intermediate_size)
    ffn = _first(c, *(("moe_intermediate_size",) if experts > 1 else ()), "intermediate_size", "ffn_dim", "n_inner",
                 "ffn_hidden_size", default=4 * hidden if plain and hidden else None)
    shared = c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * (ffn or 0)
    window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    dense = (c.get("first_k_dense_replace") or 0) if experts > 1 else 0  # DeepSeek: dense MLPs first, and MLA
    missing = [k for k, v in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                              ("intermediate_size", ffn), ("vocab_size", vocab),  # and the dense first layers' width
                              ("intermediate_size", c.get("intermediate_size") if dense else 0)) if v is None]
    if missing:
        raise ValueError(f"{path}: not a decoder config shardwise plan understands (missing {missing[0]!r}); it needs "
                         "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size (or "
                         "GPT-2's n_embd, n_layer, n_head, n_inner; OPT's ffn_dim)")
    seq = _first(c, "max_position_embeddings", "n_positions", "seq_length", default=4096 if not plain else 2048)
    bias = bool(_first(c, "attention_bias", "enable_bias", "bias", default=plain and kind != "falcon"))
    dropout = any((_first(c, k, default=0) or 0) > 0 for k in ("resid_pdrop", "dropout", "hidden_dropout"))
    mla = dict(q_lora=c.get("q_lora_rank") or 0, kv_lora=c.get("kv_lora_rank") or 0, dense_layers=dense,
               rope_dim=c.get("qk_rope_head_dim") or 0, dense_ffn=dense and c["intermediate_size"])
    return ModelSpec(name or c.get("_name_or_path") or kind or "hf-model", layers, hidden, heads,
                     _first(c, "num_key_value_heads", "num_kv_heads", default=heads), ffn, vocab, seq=seq,
                     gated=not plain, tied=bool(c.get("tie_word_embeddings", plain)),
                     experts=experts, top_k=_first(c, "num_experts_per_tok", default=1), bias=bias,
                     learned_positions=seq if kind in LEARNED_POSITIONS else 0, dropout=dropout,
                     head_size=_first(c, "qk_nope_head_dim", "head_dim", default=0), window=window or 0,
                     shared_ffn=shared if experts > 1 else 0, **mla)


def model(name_or_path: str) -> ModelSpec:
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    if name_or_path.endswith(".json"):
        return from_hf_config(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: a preset ({', '.join(MODELS)}) or a config.json path")


def from_builtin(model) -> ModelSpec:
    """The ``ModelSpec`` of a built-in model (shardwise.models: GPT, Llama, MoE), from its config."""
    c = model.cfg
    gpt = hasattr(c, "tie")
    return ModelSpec(type(model).__name__.lower(), c.n_layer, c.d_model, c.n_head, getattr(c, "n_kv_head", c.n_head),
                     4 * c.d_model if gpt else c.ffn, c.vocab, seq=c.seq, gated=not gpt, tied=gpt and c.tie,
                     experts=getattr(c, "n_expert", 1), top_k=getattr(c, "top_k", 1) if hasattr(c, "n_expert") else 1,
                     bias=gpt and c.bias, learned_positions=c.seq if gpt else 0, dropout=gpt and c.dropout > 0)
