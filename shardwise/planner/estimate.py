"""Whole-job prediction: model x strategy x cluster -> step time, memory per GPU, tokens/s, MFU.

Layout of ranks (Megatron's): tensor parallel innermost (inside a node), then pipeline stages,
then data parallel. Per step (one optimizer step of ``global_batch`` sequences):

- compute: FLOPs of the step (6 per active weight per token + attention, plus one more forward under full recomputation,
  all of it but each dense layer's down projection under block, the attention core under selective) over the GPUs, at
  the accelerator's fitted share of the datasheet peak (costmodel.Device.efficiency) or, where its products and flash
  attention were measured by shape (the H200), at a fitted share of those rates (the products' at the layer's width, tp
  and tokens per micro-batch, an MoE's experts at their own shape's measured share; attention's at the sequence, on the
  FLOPs it executes), plus the memory-bound kernels' bytes (norms, activations, residual adds, unfused attention
  scores: models.ModelSpec.elementwise_bytes) at its share of HBM bandwidth, and the framework's own kernels (FSDP2's
  copy-in and copy-out as measured, shardwise's by bytes);
- tensor parallel: per layer and micro-batch, two all-reduces of the layer's activations in the forward and two in the
  backward (four all-gathers / reduce-scatters with sequence parallelism, the same bytes), two more under full
  recomputation (block: one, 1.5 with sequence parallelism, where the rerun MLP input is all-gathered again); not
  overlapped (Megatron's default) unless ``tp_exposed`` says what share stays exposed (XLA on TPUs overlaps it);
- pipeline: the 1F1B bubble, ``(pp - 1) / (micro-batches · virtual stages)`` of the compute, and the exchanges between
  stages (2 per micro-batch and chunk, as exposed as tensor parallel's; the fill's and drain's always);
- data parallel: the gradient reduction (zero 0-2: all-reduce / reduce-scatter + all-gather of the updated shards),
  overlapped with the backward (with a pipeline, the last micro-batch's backward) but for the last bucket's share
  (``dp_exposed``), and all of what outlasts that compute; ZeRO-3 without a pipeline layer by layer on the two-lane
  simulation (timeline.py: each layer's gathers and reduction, one layer of prefetch, what the compute lane waits);
  under one, a stage gathered once a step and kept (torch's pipelining on GPUs) or per micro-batch (XLA's);
- optimizer: memory-bound AdamW over this GPU's shard at the memory-bound kernels' share of HBM
  bandwidth, 7 passes over its fp32 bytes fused, 20 multi-tensor (as measured: bench/planner/update_sweep.py).

Memory per GPU: bf16 weights and gradients and fp32 master + Adam moments (16 bytes per parameter, the ZeRO paper's
mixed-precision figure), divided as the ZeRO stage says; activations per layer per Korthikanti et al. 2022, term by term
(models.ModelSpec.layer_activation_bytes: their ``s·b·h·(34 + 5·a·s/h)`` for Megatron's GPT with the attention scores
kept, 34·s·b·h without them, 2·s·b·h under full and block recomputation; divided by ``tp`` with sequence parallelism),
times the micro-batches in flight on the first stage (1F1B: ``pp``), plus the fp32 logits of the loss (4·s·b·v/t) where
one stage holds the whole model. That is Megatron's layout, every part held at once. PyTorch's (``Strategy.stack``:
FSDP2, DDP, shardwise) holds fp32 weights, gradients and moments (4 + 4 + 8 bytes), makes 16-bit copies of the weights
for compute and frees the gradients after each step, so its peak is the largest of three moments: the forward's end
(copies and activations, counted as measured of torch.compile, eager PyTorch and autocast: models.TORCH_ACTIVATIONS),
the backward's end (copies and gradients) and the optimizer step (gradients and the multi-tensor AdamW's temporary).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..costmodel.devices import (ATTENTION_KERNELS, FP8_CAST_BYTES, FP8_EFF_MAX, FSDP2_GATHER_IN, FSDP2_REDUCE_IN,
                                 FSDP2_UPDATE, expert_share)
from ..costmodel.optimizer import PASSES, update_time
from .clusters import ClusterSpec
from .models import EAGER_BYTES, TORCH_ACTIVATIONS, ModelSpec
from .timeline import LayerCosts, zero3_step


RECOMPUTE = ("none", "selective", "selective-op", "block", "full")
RANK_ORDERS = ("tp-pp-dp", "tp-ep-dp-pp")
STACKS = ("megatron", "torch", "torch-autocast")
FRAMEWORKS = (None, "fsdp2", "shardwise")
FP8_RECIPES = (None, "te", "torchao")
DISPATCHES, ROUTINGS = ("alltoall", "deepep"), ("balanced", "contiguous")
DP_EXPOSED = 0.1
"""The closed form's least exposed share of the data-parallel communication (the last bucket's)."""
SHUFFLE_BYTES = {False: 6, True: 14}
"""Bytes per unit of width one routed copy of a token moves in an MoE layer's forward beside its experts' products:
gathered into expert order (read and write, 2 bytes each) and read back to be weighted and summed into its token (6);
where an all-to-all dispatcher delivers the copies by source rank, they are also sorted by local expert after the
dispatch and back before the combine (8 more). The backward moves twice the forward, a rerun forward once more."""


@dataclass(frozen=True)
class Strategy:
    tp: int = 1
    pp: int = 1
    zero: int = 1
    """ZeRO stage of the data-parallel axis: 0 (plain DP) to 3."""
    micro_batch: int = 1
    global_batch: int | None = None
    """Sequences per optimizer step over all data-parallel ranks (None: one micro-batch per rank)."""
    seq: int | None = None
    recompute: str = "selective"
    """none, selective (attention recomputed), selective-op (PyTorch's per-op selective checkpointing as torchtitan sets
    it: every other matrix product's output and the attention output kept, the rest of the layer's forward recomputed),
    block (``torch.utils.checkpoint`` around each layer, as FSDP2, torchtitan's full AC and shardwise's captured step
    do: the layer's forward but its last product, whose output the backward needs only as the next layer's saved input)
    or full (every layer's whole forward, Megatron's)."""
    sp: bool = True
    """Sequence parallelism alongside tensor parallelism."""
    virtual: int = 1
    """Interleaved pipeline stages per GPU."""
    cp: int = 1
    """Context parallelism: each sequence cut over ``cp`` ranks next to tp, keys and values passed
    around them under the attention's products (ring attention); gradients reduced over dp x cp."""
    ep: int = 1
    """Expert parallelism (MoE): each expert lives on one of ``ep`` data-parallel ranks; tokens reach
    it by an all-to-all, there and back."""
    etp: int | None = None
    """Megatron-Core's MoE parallel folding: the experts cut over ``etp`` ranks (1: whole, and the MoE layers without
    tensor-parallel collectives; or tp) and spread over ep x etp of a stage's tp x cp x dp ranks, in Megatron-Core's
    rank order. None: cut over tp as the other layers, ep inside dp."""
    ep_overlap: bool = False
    """Each MoE all-to-all under another micro-batch's compute (Megatron-Core's ``--overlap-moe-expert-parallel-comm``:
    one micro-batch's forward run with another's backward); exposed, what that compute does not cover."""
    efficiency: float | None = None
    """Achieved fraction of peak FLOP/s of the compute; None: the accelerator's fitted curve of the
    per-GPU matrix width (costmodel.Device.efficiency)."""
    dp_exposed: float | None = None
    """Share of the data-parallel communication not hidden behind the backward, at least; None: 0.1 (the last bucket's)
    in the closed form, and under ZeRO-3 without a pipeline what the per-layer timeline waits (timeline.py)."""
    tp_exposed: float | None = None
    """Share of the tensor-parallel communication not hidden; None: all of it on GPU clusters
    (Megatron's default), ``dp_exposed``'s share on TPUs, where XLA overlaps it with the matrix
    products (collective matmul, async collective fusion)."""
    fused_attention: bool = True
    """Flash-style attention: the s x s scores are not kept for the backward (Megatron's 2022 runs
    kept them unless recomputed)."""
    capacity: float = 1.0
    """MoE expert capacity factor: each expert computes (and keeps activations for) this many times
    its share of the routed tokens (GShard/Switch capacity dispatch pads to it; 1: exact top-k, as
    grouped GEMMs run). Model FLOPs and MFU count the routed tokens alone."""
    onehot: bool = False
    """Capacity dispatch as GShard's one-hot contractions (MaxText's dense MoE path, ``sparse_matmul=False``): each
    token into and out of the experts' ``capacity`` slots of its sequence by products of 2·d·E·C FLOPs a token, C =
    capacity·s·k/E; the backward runs the dispatch's once more, the combine's twice (its mask holds the router's
    weights), a rerun forward both again. Counted as compute, not as model FLOPs."""
    shard: int | None = None
    """Hybrid sharding (FSDP2's HSDP, MaxText's FSDP inside a slice with data parallelism across): ZeRO shards the state
    over groups of ``shard`` neighbouring data-parallel ranks, which replicate it across groups; each group's gradient
    shards are then all-reduced across the groups. None: one group of every data-parallel rank."""

    reduce_fp32: bool = False
    """Gradients held and reduced in fp32 (Megatron's ``--accumulate-allreduce-grads-in-fp32``); the
    weights still gathered in 16-bit."""
    eager: bool = False
    """The stack runs PyTorch eagerly, without fused norm and rotary kernels (torchtitan without
    torch.compile): those move more bytes (models.EAGER_BYTES)."""
    rank_order: str = "tp-pp-dp"
    """Rank numbering, innermost first: Megatron-LM's ``tp-pp-dp`` (an ep group ``tp·pp`` ranks apart)
    or Megatron-Core's ``tp-ep-dp-pp`` (ep next to tp, pipeline outermost)."""
    stack: str = "megatron"
    """Whose memory layout: ``megatron`` (16-bit weights and gradient buffers kept across steps, fp32
    master and moments: all of it held at once); ``torch`` (FSDP2, DDP, shardwise: fp32 weights,
    gradients and moments; 16-bit copies of the weights for compute; gradients freed after each step,
    so the forward holds none, and the peak is the larger of the forward's end, the backward's end
    and the optimizer step); ``torch-autocast`` (the same with torch.autocast over fp32 weights: the
    copies of every weight kept from forward to backward, an fp32 residual stream). Memory only."""
    foreach: bool = False
    """PyTorch's default multi-tensor AdamW in place of a fused kernel: its step passes over the fp32
    state about 20 times instead of 7 (costmodel/optimizer.py) and makes an fp32 temporary the size of
    the state it updates (the square root of the second moment)."""
    fp8: str | None = None
    """An FP8 recipe (Hopper only): the layers' products in FP8 at their measured rates times the recipe's share
    (costmodel.devices.FP8_EFF_MAX), each FP8 operand cast from bf16 (``FP8_CAST_BYTES``); attention and the output
    layer in bf16. ``te``: Transformer Engine (Megatron-Core, NeMo), the bf16 work at today's measured rates too;
    ``torchao``: torchao's Float8 training, the bf16 work at the device's bf16 share (PyTorch's own attention)."""
    framework: str | None = None
    """Whose data-parallel runtime, where it costs time of its own (``FRAMEWORKS``): ``fsdp2`` copies
    each gathered weight out of the all-gather's buffer and each gradient into the reduce-scatter's
    (its copy-in/copy-out kernels, as measured: ``FSDP2_GATHER_IN``); ``shardwise`` copies alike in its buckets
    (passes/bucket.py, by bytes). None: none counted (Megatron, MaxText)."""
    dispatch: str = "alltoall"
    """MoE tokens to their experts: ``alltoall`` (each routed copy sent: Megatron's dispatcher, shardwise's) or
    ``deepep`` (DeepEP: once to each rank holding one of its experts; across nodes once to each node, then NVLink)."""
    flushes: int = 1
    """Pipeline schedules a step, each filled and drained (NeMo AutoModel's accumulation); 1: one (Megatron's)."""
    routing: str = "balanced"
    """Experts a token picks: ``balanced`` (k at random, each as often) or ``contiguous`` (token t to experts t·k ..
    t·k+k-1: NeMo AutoModel's fake balanced gate)."""
    attention: str | None = None
    """The attention kernel where it is not the device's own flash attention (``ATTENTION_KERNELS``): ``triton-2022``,
    the Triton FlashAttention that MosaicML's MPT runs. Its executed FLOPs at that kernel's rate on the device."""
    head_stage: bool = False
    """Pipeline stages as NeMo AutoModel splits them for torch's pipelining: the layers evenly over pp x virtual chunks,
    one more to each of the first (the remainder), the output layer on the last; the rank with the most work paces the
    step. False: every rank an even share of the model's work."""

    def __post_init__(self):
        for k, kinds in (("framework", FRAMEWORKS), ("stack", STACKS), ("rank_order", RANK_ORDERS), ("recompute",
                         RECOMPUTE), ("fp8", FP8_RECIPES), ("dispatch", DISPATCHES), ("routing", ROUTINGS),
                         ("attention", (None, *ATTENTION_KERNELS))):
            if getattr(self, k) not in kinds:
                raise ValueError(f"{k} must be one of {', '.join(map(str, kinds))}, got {getattr(self, k)!r}")
        if not self.capacity >= 1.0:
            raise ValueError(f"capacity must be at least 1 (an expert's share of the routed tokens), got {self.capacity}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0..3, got {self.zero}")
        for k in ("tp", "pp", "micro_batch", "virtual", "ep", "cp", "flushes"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be at least 1, got {getattr(self, k)}")
        if self.fp8 and self.efficiency is not None:
            raise ValueError("fp8 with a given efficiency: the efficiency is a share of the bf16 peak and would replace "
                             "the FP8 rates; give one of them")
        if self.attention and (self.efficiency is not None or not self.fused_attention):
            raise ValueError(f"attention={self.attention} rates a fused kernel's FLOPs: it cannot go with "
                             + ("a given efficiency" if self.fused_attention else "unfused attention"))
        if self.shard is not None and (self.shard < 1 or self.zero == 0):
            raise ValueError(f"shard={self.shard}: a sharding group needs zero >= 1 and at least one rank")


@dataclass
class Estimate:
    gpus: int
    dp: int
    micro_batches: int
    step_s: float
    compute_s: float
    tp_comm_s: float
    tp_exposed_s: float
    ep_comm_s: float
    pp_bubble_s: float
    dp_comm_s: float
    dp_exposed_s: float
    optimizer_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory: dict
    """Bytes per GPU: weights, grads, optimizer, activations, total."""
    fits: bool
    formulas: list = field(default_factory=list)
    """Each term as its formula with the numbers put in (``shardwise plan --explain``)."""
    cp_comm_s: float = 0.0
    cp_exposed_s: float = 0.0
    ep_exposed_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def estimate(model: ModelSpec, cluster: ClusterSpec, st: Strategy) -> Estimate:
    gpus = cluster.gpus
    if gpus % (st.tp * st.pp * st.cp):
        what = "tp x pp" + (" x cp" if st.cp > 1 else "")
        raise ValueError(f"{what} = {st.tp * st.pp * st.cp} does not divide the {gpus} GPUs of {cluster.name}")
    if cluster.rings and st.tp > cluster.per_node:
        raise ValueError(f"tp={st.tp} spans nodes ({cluster.per_node} GPUs per node): keep tensor parallel "
                         "inside a node")
    if not cluster.rings:
        cluster.levels(st.tp)  # a TPU slice: tensor parallel over the leading torus axes, which must hold it
    if model.layers < st.pp * st.virtual:
        raise ValueError(f"{model.layers} layers cannot fill pp x virtual = {st.pp * st.virtual} stages")
    dp = gpus // (st.tp * st.pp * st.cp)
    sdp = dp * st.cp  # the ranks that hold the same parameters: their gradients are reduced together
    etp = st.tp if st.etp is None else st.etp  # the experts' tensor-parallel cut
    if st.etp is not None and (etp not in (1, st.tp) or st.rank_order != "tp-ep-dp-pp"):
        raise ValueError(f"etp={etp}: give 1 (each expert whole) or the tp size {st.tp}, with Megatron-Core's rank "
                         f"order, where its MoE folding lives (rank_order tp-ep-dp-pp; got {st.rank_order})")
    if st.ep > 1 and (model.experts % st.ep or (st.tp * sdp % (st.ep * etp) if st.etp else dp % st.ep)):
        raise ValueError(f"ep={st.ep} must divide the model's {model.experts} experts and " + (
            f"the data-parallel size {dp}" if st.etp is None else f"ep x etp = {st.ep * etp} the {st.tp * sdp} ranks "
            "of a stage (tp x cp x dp)"))
    edp = st.tp * sdp // (st.ep * etp)  # the ranks that hold the same experts
    if st.shard is not None and (dp % st.shard or (st.ep > 1 and edp % min(st.shard, edp))):
        raise ValueError(f"shard={st.shard} must divide the data-parallel size {dp}"
                         + (f" and its expert groups of {edp}" if st.ep > 1 else ""))
    seq = st.seq or model.seq
    if seq % st.cp:
        raise ValueError(f"cp={st.cp} does not divide the sequence of {seq} tokens")
    lseq = seq // st.cp  # this rank's part of each sequence
    gb = st.global_batch or dp * st.micro_batch
    if gb % (dp * st.micro_batch):
        raise ValueError(f"global batch {gb} is not a multiple of dp x micro-batch = {dp * st.micro_batch}")
    m = gb // (dp * st.micro_batch)  # micro-batches per step on each pipeline
    if m % st.flushes:
        raise ValueError(f"flushes={st.flushes} does not divide the {m} micro-batches of a step")
    tokens = gb * seq
    acc = cluster.accel
    if st.fp8:
        if acc.fp8_products is None:
            raise ValueError(f"fp8: the planner has FP8 rates for Hopper GPUs (H100, H200) only, not {acc.label}")
        acc = acc.today() if st.fp8 == "te" else acc
    h, L, b = model.hidden, model.layers, st.micro_batch

    # compute: the model's FLOPs (+ one forward of the layers under full recomputation, + attention
    # under selective) spread over every GPU
    fpt = model.flops_per_token(seq)
    layer_matmul = model.layers_params(True) / L - 2 * h  # weights a token multiplies in a layer
    extra = {"none": 0.0, "selective": 4.0 * L * model.q_dim * seq,
             "selective-op": L * layer_matmul,  # half of the layers' forward matrix products (2 FLOPs a weight)
             # the forward's products but a dense layer's down projection, and attention's forward (12·L·d·T / 3); an
             # MoE layer's gate multiply saves each expert's output, so the experts' down projections are rerun too
             "block": L * (2.0 * (layer_matmul - (model.ffn * h if model.experts == 1 else 0))
                           + 4.0 * model.q_dim * seq),
             "full": fpt / 3.0}[st.recompute]
    # capacity dispatch: the experts also compute on their padding (and rerun it where they are rerun)
    layer_rerun = st.recompute in ("full", "block")  # the backward reruns the layer's forward
    routed = 0.0  # an MoE's routed products a token at capacity 1: each of its k experts' forward, backward and rerun
    if model.experts > 1:
        expert_matmul = model.expert_params() - (model.ffn + h if model.bias else 0)
        routed = 6.0 * (L - model.dense_layers) * model.top_k * expert_matmul * (1 + layer_rerun / 3)
    pad = routed * (st.capacity - 1.0)
    if model.experts > 1 and st.onehot:  # the one-hot dispatch's and combine's products: 2 forward, 3 backward, 2 rerun
        pad += 2.0 * h * st.capacity * seq * model.top_k * (L - model.dense_layers) * (5 + 2 * layer_rerun)
    eff = st.efficiency if st.efficiency is not None else acc.efficiency(h / st.tp)
    matmul = tokens * (fpt + extra + pad) / gpus / (acc.peak_flops * eff)
    attn_rate = ((acc.kernel_rate(st.attention) if st.attention else acc.attention_rate(seq))
                 if st.efficiency is None and st.fused_attention else None)
    rated: list[str] = []
    if st.efficiency is None and (acc.products is not None or st.fp8 or st.attention):
        # measured rates: the products at their shape's (width, tp, tokens per micro-batch), flash attention at its
        # sequence's (or a named kernel at its rate), on the FLOPs it executes (the causal half: 7·d·T a token and layer
        # of PaLM's 12, and half of a rerun forward's 4); unmeasured, at the products' bf16 rate on PaLM's count
        attn = 12.0 * L * model.q_dim * (min(seq, model.window) if model.window else seq)
        attn_rerun = {"selective": 4.0 * L * model.q_dim * seq, "block": 4.0 * L * model.q_dim * seq,
                      "full": attn / 3.0}.get(st.recompute, 0.0)
        products, executed = fpt + extra + pad - attn - attn_rerun, 7.0 / 12.0 * attn + attn_rerun / 2.0
        prate = acc.product_rate(h, st.tp, b * lseq)
        # FP8: the layers' products at the FP8 rate, the output layer's (6·v·h a token) in bf16
        head, frate = (6.0 * model.vocab * h, acc.product_rate(h, st.tp, b * lseq, st.fp8)) if st.fp8 else (0.0, prate)
        attn_t = executed / attn_rate if attn_rate else (attn + attn_rerun) / prate
        matmul = tokens / gpus * ((products - head) / frate + head / prate + attn_t)
        share = 1.0
        if model.experts > 1:  # the experts' products at their own shape's share (an expert's MLP, tokens it receives)
            per = b * lseq / (st.tp if etp == 1 else 1) * max(st.ep, 1) * model.top_k * st.capacity / model.experts
            share = min(1.0, expert_share(h, model.ffn // etp, per, bool(st.fp8)))
            matmul += tokens / gpus * routed * st.capacity / frate * (1 / share - 1)
        eff = tokens * (fpt + extra + pad) / gpus / matmul / acc.peak_flops  # the share of peak it comes to
        rated = [f"efficiency = the products at {prate / 1e12:.0f} TFLOP/s (" + (
                     f"{acc.eff_max} of the rate measured at width {h}, tp {st.tp}, {b * lseq:g} tokens a micro-batch)"
                     if acc.products else "the accelerator's fitted share)")
                 + (f", {st.attention or 'flash'} attention at {attn_rate / 1e12:.0f} (executed FLOPs)"
                    if attn_rate else "")
                 + (f", the layers' FP8 products at {frate / 1e12:.0f} ({FP8_EFF_MAX[st.fp8]} of their FP8 rate, "
                    f"{st.fp8})" if st.fp8 else "")
                 + (f", the experts' at {share:.2f} of that (their shape's measured share)" if share < 1 else "")
                 + f": {eff:.3f} of peak",
                 f"matmul = tokens/gpus·(products {products:.4g} FLOP/token / rate + attention "
                 + (f"{executed:.4g} executed" if attn_rate else f"{attn + attn_rerun:.4g}")
                 + f" / rate) = {matmul:.4g} s"]
    # memory-bound kernels (norms, activations, residual adds, unfused attention scores) of this GPU's
    # layers on its pipeline's tokens, at the accelerator's elementwise share of HBM bandwidth
    ew_bytes = model.elementwise_bytes(seq, st.tp, st.sp, st.recompute, st.fused_attention, st.capacity, st.eager)
    if st.fp8:  # the FP8 operands: each product's input, and in the backward its output's gradient (whole: h-wide)
        k, kv = (model.top_k * st.capacity if model.experts > 1 else 1.0), model.kv_heads * model.head_dim
        cut = 2 * model.q_dim + 2 * kv + k * model.expert_params() / h  # split over tp (an expert's 2 or 3 x ffn)
        ew_bytes += FP8_CAST_BYTES * ((2 + 2 * k) * h + cut / st.tp)
    if model.experts > 1:  # an MoE layer's token shuffles (SHUFFLE_BYTES), where an all-to-all sorts them too
        sorts = st.dispatch == "alltoall" and 1 < st.ep < model.experts
        shuffles = SHUFFLE_BYTES[sorts] * model.top_k * h * (1 - model.dense_layers / L)
        ew_bytes += (3 + layer_rerun) * shuffles / (st.tp if etp == 1 and st.sp else 1)
    elementwise = tokens / sdp * (L / st.pp) * ew_bytes / (acc.hbm_bw * acc.mem_eff)
    compute, pace = matmul + elementwise, 1.0
    if st.head_stage and st.pp > 1:  # the fullest rank's layers, the output layer's products as layers' work, / the mean
        chunks, head = st.pp * st.virtual, 6.0 * model.vocab * h / ((fpt - 6.0 * model.vocab * h) / L)
        per = [L // chunks + (c < L % chunks) for c in range(chunks)]
        pace = max(sum(per[r::st.pp]) + head * (r == (chunks - 1) % st.pp) for r in range(st.pp)) * st.pp / (L + head)
        compute *= pace

    # tensor parallel: 4 collectives of b·s·h bf16 per layer per micro-batch (+2 under full recompute;
    # under block +1, the attention's, as the MLP's reduction follows the down projection, which is not
    # rerun; with sequence parallelism the rerun MLP input's all-gather adds half of one; MoE: +2; torchtitan's per-op
    # policy with sequence parallelism reruns both all-gathers, their outputs not saved: half of one each)
    tp_rerun = 2.0 if st.recompute == "full" or (st.recompute == "block" and model.experts > 1) else (
        (1.5 if st.sp and st.tp > 1 else 1.0) if st.recompute == "block" else
        1.0 if st.recompute == "selective-op" and st.sp and st.tp > 1 else 0.0)
    per_layer = 4 + tp_rerun
    layers_here = -(-L // st.pp)  # the fullest stage sets the pace when layers do not split evenly
    act_bytes = 2.0 * b * lseq * h
    one = cluster.collective_s("all_reduce", act_bytes, st.tp)
    # folded whole experts (etp 1): an MoE layer's tokens stay sequence-parallel, only its attention's collectives
    moe_here = layers_here * (L - model.dense_layers) / L if etp == 1 and model.experts > 1 else 0.0
    tp_comm = per_layer * (layers_here - moe_here / 2) * m * one

    # expert parallel: per MoE layer and micro-batch, an all-to-all to the experts and one back, in the
    # forward and in the backward (and the forward's again under full or block recomputation)
    ep_comm = 0.0
    if st.ep > 1:
        a2a_per_layer = 6 if layer_rerun else 4
        ep_apart = etp if st.etp else (st.tp if st.rank_order == "tp-ep-dp-pp" else st.tp * st.pp) * st.cp
        ep_comm = a2a_per_layer * layers_here * m * _dispatch_s(model, cluster, st, 2.0 * b * lseq * h / (
            st.tp if st.sp else 1), ep_apart)

    # context parallel: per layer and micro-batch the sequence's keys and values gathered (fwd, bwd,
    # a rerun) and their gradients reduce-scattered, under the attention's products
    cp_comm = cp_exposed = 0.0
    if st.cp > 1:
        kv_bytes = 4.0 * b * seq * model.kv_heads * model.head_dim / st.tp
        cp_apart = st.tp if st.rank_order == "tp-ep-dp-pp" else st.tp * st.pp
        cp_comm = (4 if layer_rerun else 3) * layers_here * m * cluster.collective_s("all_gather", kv_bytes, st.cp,
                                                                                       cp_apart)
        attn_s = matmul * 12.0 * L * model.q_dim * (min(seq, model.window) if model.window else seq) / (fpt + extra + pad)
        cp_exposed = max(DP_EXPOSED * cp_comm, cp_comm - attn_s)

    # pipeline: the 1F1B bubble (interleaved by `virtual`) and 2·m·v exchanges with the next stage, a micro-batch into
    # and its gradient out of each chunk: 1/tp of the activations (sp's shard, Megatron's scatter/gather) tp·cp ranks on
    # (tp·cp·dp with pp outermost), exposed as tensor parallel's share (overlapped alike), the fill's and drain's always
    tp_share = st.tp_exposed if st.tp_exposed is not None else (1.0 if cluster.rings else DP_EXPOSED)
    p2p_one = cluster.collective_s("all_to_all", 2 * act_bytes / st.tp, 2 if st.pp > 1 else 1,
                                   st.tp * st.cp * (1 if st.rank_order == "tp-pp-dp" else dp))
    p2p = max(tp_share * 2 * m * st.virtual, 2 * (st.pp - 1) * st.flushes) * p2p_one
    bubble = ((st.pp - 1) * st.flushes / (m * st.virtual) * compute if st.pp > 1 else 0.0) + p2p

    # data parallel: gradients of this stage's tensor-parallel shard; an expert's over the dp/ep
    # ranks that hold it, the rest over all dp ranks
    expert = (model.layers - model.dense_layers) * model.experts * model.expert_params() if model.experts > 1 else 0
    dense_params = (model.params() - expert) / (st.tp * st.pp)
    expert_params = expert / (etp * st.pp * st.ep)
    shard_params = whole = dense_params + expert_params
    gbytes = 4.0 if st.reduce_fp32 else 2.0  # per gradient element
    grad_bytes = gbytes * shard_params
    inner = st.tp * st.pp if st.rank_order == "tp-pp-dp" else st.tp  # how far apart a dp group's ranks are
    egroup = (edp, (etp if st.etp else inner) * st.ep)  # an expert's dp group: its size and how far apart
    groups = [(dense_params, sdp, inner), (expert_params, *egroup)]

    group = lambda n: n if st.shard is None else min(st.shard, n)  # noqa: E731 - a dp axis of n ranks' sharding group

    # the framework's own kernels on the compute lane: FSDP2 (and shardwise's buckets) per micro-batch copies each 16-bit
    # weight out of the all-gather's buffer (read and write: 4 B), casts this rank's fp32 shard into it
    # (6 B over the group; FSDP2: measured, FSDP2_GATHER_IN) and copies each 16-bit gradient into the reduce-scatter's
    # buffer (2 + gbytes; FSDP2: times FSDP2_REDUCE_IN)
    framework = 0.0
    if st.framework and st.zero >= 1:
        gathers = 2 if st.zero == 3 else 1  # ZeRO-3 gathers again for the backward
        gather_in, reduce_in = (FSDP2_GATHER_IN, FSDP2_REDUCE_IN) if st.framework == "fsdp2" else (6.0, 1.0)
        per_param = gathers * (4.0 + gather_in / group(sdp)) + reduce_in * (2.0 + gbytes)
        framework = m * shard_params * per_param / (acc.hbm_bw * acc.mem_eff)
        compute += framework

    def across(params, n, stride):  # hybrid sharding: a gradient shard all-reduced with its replicas
        s = group(n)
        return cluster.collective_s("all_reduce", gbytes * params / s, n // s, stride * s) if n > s and params else 0.0

    # ZeRO-3 under a pipeline: on GPUs (torch.distributed.pipelining with FSDP2, as torchtitan and AutoModel run it) a
    # stage's weights gathered at its first micro-batch's forward and kept to its last backward, its gradients kept
    # whole and reduce-scattered after it, a chunk at a time; XLA regathers and reduces for each micro-batch
    kept, regather = (st.zero == 3 and st.pp > 1 and cluster.rings), (st.zero == 3 and st.pp > 1 and not cluster.rings)

    def reduce(params, n, stride):  # the gradients reduced (gbytes each), the 16-bit weights gathered
        if st.zero == 0:
            return cluster.collective_s("all_reduce", gbytes * params, n, stride)
        s = group(n)
        return ((m if regather else 1) * cluster.collective_s("reduce_scatter", gbytes * params, s, stride)
                + cluster.collective_s("all_gather", 2.0 * params, s, stride) * (
                    2 * m if regather else 3 if st.zero == 3 and not kept else 1) + across(params, n, stride))

    dp_comm = sum(reduce(p, n, stride) for p, n, stride in groups if p > 0)
    # on TPUs XLA all-reduces the shards across the groups (slices, over the data-center network) once
    # the backward is done: exposed (MaxText's step grows with its slices as this does, data/runs.toml)
    late = sum(across(p, n, stride) for p, n, stride in groups) if not cluster.rings and st.zero else 0.0
    # it hides behind the compute it overlaps: zero3's gathers and reductions run through the whole
    # step, a gradient reduction through the backward (with a pipeline, the last micro-batch's only,
    # where the stage's gradients become ready); what does not fit there is exposed
    window = (compute / m if st.pp > 1 and not regather else compute) * (
        1.0 if st.zero == 3 and (st.pp == 1 or regather) else (0.75 if layer_rerun else 2 / 3))
    floor = DP_EXPOSED if st.dp_exposed is None else st.dp_exposed
    dp_exposed = max(floor * (dp_comm - late), dp_comm - late - window) + late
    if kept:  # the gathers under the first micro-batch's forward; the last chunk's reduction after the drain
        ag = sum(cluster.collective_s("all_gather", 2.0 * p, group(n), stride) for p, n, stride in groups if p > 0)
        dp_exposed = max(floor * ag, ag - compute / m / 3) + max(floor * (dp_comm - ag), (dp_comm - ag) / st.virtual)
    ep_exposed = max(DP_EXPOSED * ep_comm, ep_comm - compute) if st.ep_overlap else ep_comm
    stalls = tp_share * tp_comm + ep_exposed + cp_exposed  # the compute lane's own waits, inside its layers
    dp_formula = ""
    g = lambda x: f"{x:.4g}"  # noqa: E731
    if st.zero == 3 and st.pp == 1:  # per layer and micro-batch on the two-lane simulation
        costs = _layer_costs(model, cluster, st, compute / m, stalls / m, (fpt + extra + pad), dense_params,
                             expert_params, gbytes, group, sdp, inner, None if late else across, egroup)
        _, waited, dp_comm = zero3_step(costs, m)
        dp_exposed = max(waited, (st.dp_exposed or 0.0) * dp_comm) + late
        dp_comm += late
        dp_formula = (f"data parallel, per layer and micro-batch on the two-lane timeline (its weights gathered "
                      f"for the forward and again for the backward, one layer ahead; its gradients reduce-scattered "
                      f"after its backward): {costs.layers} layers x {m} micro-batches x (2 x {costs.gather_s * 1e3:.3g} "
                      f"+ {costs.reduce_s * 1e3:.3g}) ms against {costs.fwd_s * 1e3:.3g} ms forward and "
                      f"{costs.bwd_s * 1e3:.3g} ms backward a layer = {g(dp_comm - late)} s on the link, "
                      + (f"then the shards all-reduced across the sharding groups after the backward {g(late)} s, "
                         if late else "")
                      + f"exposed (the compute lane's waits and the last reductions) {g(dp_exposed)} s")

    # optimizer: a fused AdamW over the fp32 master of the parameters held (costmodel/optimizer.py:
    # read master, gradient and two moments, write three: 28 bytes a parameter)
    z = lambda stage, n: group(n) if st.zero >= stage else 1  # noqa: E731 - the sharding of a ZeRO stage
    opt_params = dense_params / z(1, sdp) + expert_params / z(1, edp)
    optimizer = update_time(4.0 * opt_params, acc.hbm_bw * acc.mem_eff, kernel="foreach" if st.foreach else "fused")
    sharded_update = st.framework == "fsdp2" and st.zero >= 1 and group(sdp) > 1 and not st.foreach  # measured fused
    optimizer *= FSDP2_UPDATE if sharded_update else 1.0

    step = compute + stalls + bubble + dp_exposed + optimizer

    # memory per GPU
    per_layer_act = model.layer_activation_bytes(lseq, b, st.tp, st.sp, st.recompute, st.fused_attention, st.capacity,
                                                 st.stack, st.eager)
    in_flight = min(st.pp, m) if st.pp > 1 else 1
    activations = per_layer_act * layers_here * in_flight
    if layer_rerun:  # one layer's working set is rebuilt at a time
        activations += model.layer_activation_bytes(lseq, b, st.tp, st.sp, "none", st.fused_attention, st.capacity,
                                                    st.stack, st.eager)
    # the loss's fp32 logits; eager PyTorch holds three at once in the loss's backward (the upcast's
    # log-softmax output, its gradient and the gradient of its input)
    logit_bytes = 12.0 if st.eager and st.stack != "megatron" else 4.0
    logits = logit_bytes * lseq * b * model.vocab / st.tp if st.pp == 1 else 0.0
    activations += logits
    held = lambda stage: dense_params / z(stage, sdp) + expert_params / z(stage, edp)  # noqa: E731 - 4: whole
    if st.stack == "megatron":  # every part held all through the step
        weights, grads, optim = 2.0 * held(4 if kept else 3), gbytes * held(4 if kept else 2), 12.0 * opt_params
        total = weights + grads + optim + activations
        peak, copies, buckets, phases = "", 0.0, 0.0, {}
    else:
        # the fp32 weights are the optimizer's own (sharded with its state: FSDP2, shardwise)
        weights, grads, optim = 4.0 * opt_params, 4.0 * held(2), 8.0 * opt_params
        # 16-bit copies for compute: all of them unless ZeRO-3; under ZeRO-3 the root's (embedding and
        # head, gathered to the backward, as FSDP2 holds its root's) and two layers' (one prefetched),
        # then in the backward a layer's whole gradient in 16 bits and in fp32 for its reduction
        experts = expert / (model.layers - model.dense_layers)
        layer = (model.layer_params() - experts) / st.tp + experts / (etp * st.ep)
        root = (model.embedding_params() + model.head_params()) / st.tp
        copies = 2.0 * (whole if st.zero < 3 or kept else root + 2 * layer)
        buckets = 4.0 * whole if st.zero == 0 and sdp > 1 else 0.0  # DDP's gradient buckets, kept across steps
        phases = {"the forward's end": copies + activations,
                  "the backward's end": copies + grads + (gbytes * whole if kept else 6.0 * layer * (st.zero == 3)),
                  "the optimizer step": grads + (4.0 * opt_params if st.foreach else 0.0)}
        peak = max(phases, key=phases.get)
        total = weights + optim + buckets + phases[peak]
        weights += copies
    mem = {"weights": weights, "grads": grads, "optimizer": optim, "activations": activations, "total": total}

    tps = tokens / step
    formulas = [
        f"flops/token = 6·(active matmul weights) + 12·L·d·T = {g(fpt)} (+ recompute {st.recompute}: {g(extra)})",
        *(rated or [
            "efficiency = " + ("given" if st.efficiency is not None else "the accelerator's fitted share"
                               if not acc.eff_x0 else f"{acc.eff_max}·x/(x+{acc.eff_x0}), x = d/tp = {h / st.tp:g}")
            + f" = {eff:.3f}",
            f"matmul = tokens·flops/token / (gpus·peak·eff) = {g(tokens)}·{g(fpt + extra)} / ({gpus}·"
            f"{g(acc.peak_flops)}·{eff:.3f}) = {g(matmul)} s"]),
        f"elementwise = tokens/dp · L/pp · {g(ew_bytes)} B/token/layer"
        + (f" (eager: its norms and rotary embedding unfused, +{EAGER_BYTES:g}·d a forward)"
           if st.eager and not model.learned_positions else "")
        + (f" (with the MoE layers' token shuffles, {SHUFFLE_BYTES[sorts]}·k·d a forward)" if model.experts > 1 else "")
        + f" / ({g(acc.hbm_bw)} B/s · {acc.mem_eff}) "
        f"= {g(elementwise)} s"
        + (f"; {'FSDP2' if st.framework == 'fsdp2' else st.framework}'s copy-in and copy-out kernels {g(framework)} s"
           if framework else "")
        + f"; compute = {g(compute)} s",
        f"tensor parallel = {per_layer:g} collectives x {layers_here} layers"
        + (f" (the attention's half alone in {moe_here:g} MoE layers of whole experts)" if moe_here else "")
        + f" x {m} micro-batches x t(all-reduce of "
        f"2·b·s·d = {g(act_bytes)} B over {st.tp}) {g(one)} s = {g(tp_comm)} s, exposed {tp_share:.0%}",
        f"bubble = (pp-1)·flushes/(m·v)·compute + the exposed exchanges with the next stage, max("
        f"{tp_share:.0%}·2·m·v, 2·(pp-1)·flushes) x {g(p2p_one)} s = ({st.pp}-1)·{st.flushes}/({m}·"
        f"{st.virtual})·{g(compute)} + {g(p2p)} = {g(bubble)} s",
        dp_formula or (f"data parallel ({'all-reduce' if st.zero == 0 else 'reduce-scatter + all-gather'}"
        + (f" x{m} micro-batches, the gather twice" if regather else "")
        + f" of {gbytes:g}·N/(tp·pp) = {g(grad_bytes)} B over {group(sdp)}"
        + (f", then all-reduce of 1/{group(sdp)} of it over the {sdp // group(sdp)} groups" if group(sdp) < sdp else "")
        + f") = {g(dp_comm)} s, exposed " + ("the gathers beyond a micro-batch's forward and the last chunk's reduction"
                                              if kept else f"max({floor:.0%}, what outlasts the {g(window)} s it overlaps)")
        + (f" + the all-reduce across the groups after the backward {g(late)} s" if late else "")
        + f" = {g(dp_exposed)} s"),
        f"optimizer ({'multi-tensor' if st.foreach else 'fused'} AdamW) = "
        f"{4 * PASSES['unfused-adam' if st.foreach else 'fused']} B x {g(opt_params)} params / ({g(acc.hbm_bw)} B/s · "
        f"{acc.mem_eff})" + (f" x {FSDP2_UPDATE} (FSDP2's shards)" if sharded_update else "") + f" = {g(optimizer)} s",
        f"activations/layer = {_activation_formula(model, st)}"
        f" = {g(per_layer_act)} B x {layers_here} layers x {in_flight} in flight"
        + (f" + logits {logit_bytes:g}·s·b·v/tp = {g(logits)} B" if logits else ""),
        (f"memory = 2·N' weights + {gbytes:g}·N' grads + 12·N' optimizer (N' = {g(shard_params)}, ZeRO-{st.zero}) "
         f"+ activations = {g(total)} B" if not peak else
         f"memory = fp32 weights {g(weights - copies)} + moments {g(optim)} (ZeRO-{st.zero})"
         + (f" + DDP's gradient buckets {g(buckets)}" if buckets else "") + f" + at {peak} {g(phases[peak])}, the "
         "largest of " + "; ".join(f"{k} {g(v)}" for k, v in phases.items()) + " (16-bit weight copies + activations; "
         "copies + gradients" + (" + the stage's whole gradients" if kept else " + a layer's gradient in 16 and 32 bits"
                                 if st.zero == 3 else "") + "; gradients" + (" + the foreach temporary" if st.foreach
                                                                             else "") + f") = {g(total)} B")]
    if pace > 1:
        formulas.insert(2, f"pipeline split (AutoModel's): the fullest rank's layers and output layer over the mean "
                           f"rank's paces the step: compute x{pace:.3f}")
    if st.cp > 1:
        formulas.insert(4, f"context parallel = {4 if layer_rerun else 3} collectives of the keys and values x "
                           f"{layers_here} layers x {m} micro-batches over {st.cp} ranks = {g(cp_comm)} s, exposed "
                           f"what outlasts the attention's products = {g(cp_exposed)} s")
    if st.ep > 1:
        formulas.insert(4, f"expert parallel = {a2a_per_layer} all-to-alls x {layers_here} layers x {m} micro-batches "
                           f"over {st.ep} ranks ({st.dispatch}" + (f", {st.routing} routing" if st.dispatch == "deepep"
                                                                   else "") + f") = {g(ep_comm)} s"
                           + (f", exposed under the other micro-batches' compute {g(ep_exposed)} s" if st.ep_overlap
                              else ""))
    return Estimate(gpus=gpus, dp=dp, micro_batches=m, step_s=step, compute_s=compute, tp_comm_s=tp_comm,
                    tp_exposed_s=tp_share * tp_comm, ep_comm_s=ep_comm, pp_bubble_s=bubble, dp_comm_s=dp_comm,
                    dp_exposed_s=dp_exposed, optimizer_s=optimizer, tokens_per_s=tps, tokens_per_s_per_gpu=tps / gpus,
                    mfu=model.flops_per_token(seq) * tps / (gpus * acc.peak_flops), memory=mem,
                    fits=total <= acc.hbm_bytes, formulas=formulas, cp_comm_s=cp_comm, cp_exposed_s=cp_exposed,
                    ep_exposed_s=ep_exposed)


def _dispatch_s(model: ModelSpec, cluster: ClusterSpec, st: Strategy, tokens: float, apart: int) -> float:
    """One all-to-all of an MoE layer's dispatch or combine, ``tokens`` the bytes of one copy of the micro-batch's."""
    E, k, g = model.experts, model.top_k, min(st.ep, max(1, cluster.per_node // apart))  # g: ep ranks in a node

    def reached(n):  # the groups of n neighbouring ep ranks one token's experts fall in, on average
        per = E * n // st.ep
        if st.routing == "contiguous":
            return sum(len({e % E // per for e in range(t * k, t * k + k)}) for t in range(E)) / E
        return st.ep / n * (1 - math.comb(E - per, k) / math.comb(E, k))
    if st.dispatch == "alltoall":
        return cluster.collective_s("all_to_all", tokens * k, st.ep, apart)
    return max(cluster.collective_s("all_to_all", tokens * reached(1), g, apart),  # NVLink: once to each rank
               cluster.collective_s("all_to_all", tokens * reached(g), st.ep // g, apart * g))  # RDMA: to each node


def _layer_costs(model: ModelSpec, cluster: ClusterSpec, st: Strategy, mb_s: float, stall_s: float, flops: float,
                 dense: float, expert: float, gbytes: float, group, sdp: int, inner: int, across,
                 ep_group: tuple) -> LayerCosts:
    """One micro-batch's pieces for timeline.zero3_step: its compute (``mb_s``; ``flops`` per token,
    recomputation included) split into the head's share and the layers', each layer's forward a third
    of its own products; each layer's collectives over the groups that hold its parts, with the
    all-reduce across the sharding groups (``across``; None where it runs after the backward); the experts' over
    ``ep_group`` (its size and stride)."""
    L, h = model.layers, model.hidden
    head_flops = 6.0 * model.vocab * h
    head_s = mb_s * head_flops / flops
    layer_s = (mb_s - head_s + stall_s) / L
    fwd = layer_s * (model.flops_per_token(st.seq) - head_flops) / 3 / (flops - head_flops)
    root = (model.embedding_params() + model.head_params() + h * (2 if model.bias else 1)) / st.tp

    def gather(params, n, stride):
        return cluster.collective_s("all_gather", 2.0 * params, group(n), stride) if params else 0.0

    def scatter(params, n, stride):
        s = group(n)
        rs = cluster.collective_s("reduce_scatter", gbytes * params, s, stride) if params else 0.0
        return rs + (across(params, n, stride) if across is not None else 0.0)

    return LayerCosts(L, fwd, layer_s - fwd, head_s,
                      gather((dense - root) / L, sdp, inner) + gather(expert / L, *ep_group),
                      scatter((dense - root) / L, sdp, inner) + scatter(expert / L, *ep_group),
                      gather(root, sdp, inner), scatter(root, sdp, inner))


def _activation_formula(model: ModelSpec, st: Strategy) -> str:
    """``ModelSpec.layer_activation_bytes`` as a formula, for ``--explain``."""
    torch = st.stack != "megatron"
    if st.recompute == "full":
        return "2·s·b·d/tp"
    if st.recompute == "block":
        return ("4" if st.stack == "torch-autocast" else "2") + "·s·b·d" + ("/tp" if st.sp else "")
    if st.recompute == "selective-op":
        whole, split = "4·s·b·d", "2·s·b·(2·q + kv + ffn)"
    else:
        whole = f"{(TORCH_ACTIVATIONS[st.eager, st.stack == 'torch-autocast'] if torch else 8) + 2 * model.dropout:g}·s·b·d"
        split = ("4·s·b·q + " + ("" if torch else "4·s·b·kv + ") + ("6" if model.gated else "4") + "·s·b·ffn"
                 + (" + 5·a·s²·b" if st.recompute == "none" and not st.fused_attention else ""))
    return f"({whole} + {split})/tp" if st.sp else f"{whole} + ({split})/tp"
