"""Predictions of ``shardwise plan`` against published (and our own) measured runs.

Each run names its source. ``fitted`` marks the runs the efficiency curve was fitted on
(costmodel.Device.efficiency); every other run is predicted blind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..costmodel.collectives import bus_factor
from .clusters import cluster
from .estimate import Strategy, estimate
from .models import ModelSpec, model
from .sweep import markdown_table

KORTHIKANTI = "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models, " \
              "arXiv 2205.05198, Table 5 (A100 80GB, Selene)"
VTRAIN = "vTrain (Bang et al., MICRO 2024), github.com/VIA-Research/vTrain data/ground_truth_multi.csv: " \
         "Megatron-DeepSpeed on A100s, 800 Gb/s per 8-GPU node, full activation checkpointing"
OURS_H200 = "shardwise bench, bench/results/2026-11-29-h200-llama1b-ws1.json (plain torch.compile row)"
OURS_H200X2 = "shardwise bench, bench/results/2026-11-30-h200x2-llama1b-ws2.json (one sitting, NCCL-calibrated link)"
OURS_8B = "shardwise bench, bench/results/2026-11-30-h200x2-llama8b-ws2{,-ckpt}.json (two sittings, NCCL-calibrated link)"
OURS_8B_FUSED = "shardwise bench, bench/results/2026-11-30-h200x2-sitting4-llama8b-fused-{a,b}.json (fused AdamW, " \
    "two machines of one kind)"
OURS_MOE = "shardwise bench, bench/results/2026-11-30-h200x2-sitting5-moe8x7b-8l.json (fused AdamW; " \
    "predicted blind in bench/results/2026-11-30-h200x2-sitting3-summary.md)"
OURS_DC = "shardwise bench, bench/results/2026-11-30-h200x2-sitting6-llama8b-ckpt-dc.json (DeepSpeed 0.19.8's " \
    "DeepCompile: ZeRO-3 with its prefetch and selective-gather passes, fused Adam; predicted blind)"
TORCHTITAN = "torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3 (github.com/pytorch/torchtitan): " \
             "H100 SXM 96 GB HBM2e at a 500 W power limit, 400 Gb/s RDMA per GPU, sequence 8192 (its 8B config), " \
             "selective per-op activation checkpointing, bf16, torch of 2024-12-23"
LLAMA_1B = ModelSpec("llama-1.1b", 16, 2048, 16, 8, 8192, 32000, seq=2048)
LLAMA2_70B = ModelSpec("llama2-70b", 80, 8192, 64, 8, 28672, 32000, seq=4096)
MISTRAL_7B = ModelSpec("mistral-7b", 32, 4096, 32, 8, 14336, 32000, seq=8192)
# MaxText's gpt3-175b.yml: no dropout, vocabulary 50304, 16384 learned positions, heads of 128
GPT3_MAXTEXT = ModelSpec("gpt3-175b-maxtext", 96, 12288, 96, 96, 49152, 50304, seq=2048, gated=False, tied=True,
                         bias=True, learned_positions=16384, head_size=128)


MAXTEXT = "MaxText, MaxText/configs/v5p/README.md and the v5p/<size>.sh configs (github.com/AI-Hypercomputer/" \
          "maxtext): TFLOP/s per chip at sequence 2048, FSDP with tensor parallelism, flash attention, synthetic data"


def maxtext_model(scale: int) -> ModelSpec:
    # MaxText's base model (width 2048, 16 heads of 128, MLP 7168 gated, 16 layers, vocabulary 32000,
    # untied) grown by global_parameter_scale: each factor of 8 doubles heads and MLP, width, layers
    e, r = divmod(scale.bit_length() - 1, 3)
    heads, mlp, emb, layers = 2 ** (e + (r > 0)), 2 ** (e + (r > 0)), 2 ** (e + (r > 1)), 2 ** e
    return ModelSpec(f"maxtext-{scale}", 16 * layers, 2048 * emb, 16 * heads, 16 * heads, 7168 * mlp, 32000,
                     seq=2048, head_size=128)


def _maxtext_step(m: ModelSpec, per_chip: int, tflops: float) -> float:
    """Measured seconds per step: the chip's tokens x model FLOPs per token / its measured FLOP rate
    (MaxText counts FLOPs as the planner does today: 6 per weight and token + 12·L·(heads·head size)·T;
    its count of 2024 had the embedding in and half the attention term, a few percent apart, and which
    count each README number used is not stated)."""
    return per_chip * 2048 * m.flops_per_token(2048) / (tflops * 1e12)


def _v5p(label: str, scale: int, slice_: str, per_chip: int, remat: str, tp: int, tflops: float,
         fitted: bool = False) -> "Run":
    m = maxtext_model(scale)
    chips = cluster(f"tpu-v5p:{slice_}").gpus
    step = _maxtext_step(m, per_chip, tflops)
    return Run(f"{label} on TPU v5p {slice_} ({chips} chips), tp={tp} + FSDP, {per_chip}x2048 per chip, "
               f"{remat} remat", m, f"tpu-v5p:{slice_}",
               # MaxText's batch is per chip over all chips: a tensor-parallel group of tp chips runs tp x that
               Strategy(tp=tp, zero=3, micro_batch=per_chip * tp, global_batch=per_chip * chips, seq=2048,
                        recompute="selective" if remat == "minimal" else "block"), step, MAXTEXT,
               fitted=fitted)


MAXTEXT_V5E = "MaxText, MaxText/configs/v5e/README.md (1 to 32 v5e-256 slices) and the v5e/<size>.sh configs " \
              "(github.com/AI-Hypercomputer/maxtext): TFLOP/s per chip at sequence 2048, FSDP over a slice's 256 chips, " \
              "full remat, flash attention, synthetic data"


def _v5e(label: str, scale: int, per_chip: int, tflops: float, fitted: bool = False, slices: int = 1) -> "Run":
    # v5e-256 slices (16x16 tori), FSDP over each slice's chips, data parallel across slices over the
    # data-center network (MaxText's default for several slices), every layer rematerialized
    m = maxtext_model(scale)
    step = _maxtext_step(m, per_chip, tflops)
    many = slices > 1
    return Run(f"{label} on {f'{slices} x ' if many else ''}TPU v5e 16x16 ({256 * slices} chips), FSDP"
               f"{' in each slice, data parallel across' if many else ''}, {per_chip}x2048 per chip, full remat", m,
               "tpu-v5e:16x16" + (f"*{slices}" if many else ""),
               Strategy(zero=3, micro_batch=per_chip, global_batch=per_chip * 256 * slices, seq=2048,
                        recompute="block", shard=256 if many else None), step, MAXTEXT_V5E, fitted=fitted)


TPU_RECIPES = "AI-Hypercomputer/tpu-recipes, training/trillium/<model>-MaxText/.../README.md (MaxText on TPU v6e): " \
              "the step time its example log prints, with the tuning parameters the README gives"


def _v6e(label: str, m: ModelSpec, topology: str, per_chip: int, seq: int, recompute: str, step_s: float,
         capacity: float = 1.0) -> "Run":
    # one v6e slice (a 2-D torus), FSDP over its chips; the A100's share (no v6e run is fitted)
    chips = cluster(f"tpu-v6e:{topology}").gpus
    return Run(f"{label} on TPU v6e {topology} ({chips} chips), FSDP, {per_chip}x{seq} per chip", m,
               f"tpu-v6e:{topology}", Strategy(zero=3, micro_batch=per_chip, global_batch=per_chip * chips, seq=seq,
                                               recompute=recompute, capacity=capacity), step_s, TPU_RECIPES)


MAXTEXT_A3 = "MaxText, MaxText/configs/a3/llama_2_7b/README.md and 1vm.sh (github.com/AI-Hypercomputer/maxtext): " \
             "TFLOP/s per chip on one A3 VM (8 H100 80GB, NVLink), FSDP over the 8, per-device batch 4 x 4096, " \
             "minimal_flash remat, cuDNN flash attention, synthetic data"


def _a3_llama2_7b() -> "Run":
    # one A3 VM: 492 TFLOP/s per chip; its later rows (2-16 VMs) cross Google's GPUDirect-TCPX network,
    # whose bandwidth is not in our sources
    m = ModelSpec("llama2-7b", 32, 4096, 32, 32, 11008, 32000, seq=4096)
    # MaxText counted FLOPs then (April 2024) as 6 per parameter, embedding included, plus causal
    # attention (half of 12·L·d·T): the step its 492 TFLOP/s stand for
    step = 4 * 4096 * (6 * m.params() + 6 * m.layers * m.q_dim * 4096) / 492e12
    return Run("Llama 2 7B, one A3 (8 H100) under MaxText/XLA, FSDP, 4x4096 per GPU, minimal_flash remat", m,
               "dgx-h100:1", Strategy(zero=3, micro_batch=4, global_batch=32, seq=4096, recompute="selective"),
               step, MAXTEXT_A3)


# MaxText's v5e README, TFLOP/s per chip on 2 to 32 slices: (size, per-chip batch, {slices: TFLOP/s})
V5E_SLICES = [("16B", 16, 6, {2: 117, 4: 117, 8: 115, 16: 111, 32: 108}),
              ("32B", 32, 4, {2: 128, 4: 126, 8: 125, 16: 123, 32: 119}),
              ("64B", 64, 2, {2: 112, 4: 110, 8: 108, 16: 105, 32: 99})]


def _titan(gpus: int, compiled: bool, tps: float) -> "Run":
    # tokens/s per GPU at 2 sequences of 8192 per GPU -> seconds per step
    return Run(f"Llama 3.1 8B, {gpus} H100 (500 W), FSDP{' + torch.compile' if compiled else ' eager'}, 2x8192 per GPU",
               model("llama3-8b"), f"dgx-h100:{gpus // 8}",
               Strategy(zero=3, micro_batch=2, global_batch=2 * gpus, seq=8192, recompute="selective-op"),
               2 * 8192 / tps, TORCHTITAN)


def megatron_gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    # Megatron's GPT: vocabulary 51,200, sequence 2048, GELU MLP of 4h, biases, learned positions, tied head
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, 51200, seq=2048, gated=False, tied=True,
                     bias=True, learned_positions=2048, dropout=True)


@dataclass(frozen=True)
class Run:
    label: str
    model: ModelSpec
    cluster: str
    strategy: Strategy
    measured_step_s: float
    source: str
    fitted: bool = False


def _tab5(label, model, nodes, pp, batch, micro, virtual, full_s, seqsel_s, fitted_seqsel=False):
    # Megatron's 2022 attention: unfused (scores stored or recomputed, softmax kernels of their own)
    full = Strategy(tp=8, pp=pp, zero=0, micro_batch=micro, global_batch=batch, recompute="full", sp=False,
                    virtual=virtual, fused_attention=False)
    sel = Strategy(tp=8, pp=pp, zero=0, micro_batch=micro, global_batch=batch, recompute="selective", sp=True,
                   virtual=virtual, fused_attention=False)
    return [Run(f"{label}, full recomputation", model, f"dgx-a100:{nodes}", full, full_s, KORTHIKANTI),
            Run(f"{label}, sequence parallel + selective", model, f"dgx-a100:{nodes}", sel, seqsel_s, KORTHIKANTI,
                fitted_seqsel)]


RUNS: list[Run] = [
    *_tab5("22B, 8 GPUs, t=8", megatron_gpt("megatron-22b", 48, 6144, 64), 1, 1, 4, 4, 1, 1.42, 1.10, True),
    *_tab5("175B, 64 GPUs, t=8 p=8", megatron_gpt("gpt3-175b", 96, 12288, 96), 8, 8, 64, 1, 3, 18.13, 13.75, True),
    *_tab5("530B, 280 GPUs, t=8 p=35", megatron_gpt("mt-nlg-530b", 105, 20480, 128), 35, 35, 280, 1, 3, 49.05, 37.83),
    *_tab5("1T, 512 GPUs, t=8 p=64", megatron_gpt("megatron-1t", 128, 25600, 160), 64, 64, 512, 1, 1, 94.42, 71.49),
    # vTrain's fastest measured configuration of each model size (global batch, micro-batch, t, d, p)
    *[Run(f"{label} on {g} A100s, t={t} p={p} micro-batch {mb}, batch {gb}", megatron_gpt(f"gpt-{label}", L, h, a),
          f"a100-800g:{g // 8}", Strategy(tp=t, pp=p, zero=0, micro_batch=mb, global_batch=gb, recompute="full",
                                          sp=False, fused_attention=False), ms / 1e3, VTRAIN)
      for label, g, gb, mb, h, a, L, t, p, ms in [
          ("3.6B", 64, 512, 8, 3072, 32, 30, 1, 1, 3566.5),
          ("18.4B", 256, 1024, 8, 6144, 48, 40, 8, 1, 9603.6),
          ("39.1B", 512, 1536, 2, 8192, 64, 48, 4, 4, 13875.5),
          ("175B", 512, 1536, 2, 12288, 96, 96, 4, 32, 53909.6)]],
    Run("1.1B Llama, 1 H200, batch 4x2048, bf16, no recomputation (the Hopper ceiling is fitted on it)",
        LLAMA_1B, "h200:1", Strategy(zero=0, micro_batch=4, recompute="none"), 0.1257, OURS_H200, fitted=True),
    Run("1.1B Llama, 2 H200 over NVLink, ZeRO-3 (shardwise zero3), batch 4x2048 per GPU, bf16",
        LLAMA_1B, "h200-nv18-x2:1", Strategy(zero=3, micro_batch=4, global_batch=8, recompute="none"), 0.1318,
        OURS_H200X2),
    Run("1.1B Llama, 2 H200 over NVLink, weights gathered once per step (shardwise zero3 + memory plan), 4x2048 per GPU",
        LLAMA_1B, "h200-nv18-x2:1", Strategy(zero=2, micro_batch=4, global_batch=8, recompute="none"), 0.1244,
        OURS_H200X2),
    # the Llama 3 8B shape on the same two GPUs, 2x4096 per GPU; the planner's zero=2 stands for
    # shardwise's memory plan (weights gathered once per step, kept to the backward); checkpointing is
    # torch.utils.checkpoint per block in both systems (the planner's "block")
    *[Run(f"Llama 3 8B, 2 H200 over NVLink, {who}, 2x4096 per GPU, {'per-block checkpointing' if rc == 'block' else 'no recomputation'}",
          model("llama3-8b"), "h200-nv18-x2:1", Strategy(zero=z, micro_batch=2, global_batch=4, seq=4096, recompute=rc),
          s, OURS_8B)
      for who, z, rc, s in (("FSDP2 + torch.compile", 3, "none", 0.8363), ("FSDP2 + torch.compile", 3, "block", 1.1435),
                            ("shardwise zero3 + memory plan", 2, "none", 0.8148),
                            ("shardwise zero3 + memory plan", 2, "block", 0.9921))],
    # the same rows without recomputation, every system stepping torch's fused AdamW (the rows above
    # ran its multi-tensor one, about 20 passes over the fp32 state against the 7 the planner counts)
    *[Run(f"Llama 3 8B, 2 H200 over NVLink, {who} (fused AdamW), 2x4096 per GPU, no recomputation",
          model("llama3-8b"), "h200-nv18-x2:1", Strategy(zero=z, micro_batch=2, global_batch=4, seq=4096, recompute="none"),
          s, OURS_8B_FUSED)
      for who, z, s in (("FSDP2 + torch.compile", 3, 0.7991), ("shardwise zero3 + memory plan", 2, 0.7755))],
    Run("Llama 3 8B, 2 H200 over NVLink, DeepCompile (ZeRO-3 + its passes, fused Adam), 2x4096 per GPU, "
        "per-block checkpointing", model("llama3-8b"), "h200-nv18-x2:1",
        Strategy(zero=3, micro_batch=2, global_batch=4, seq=4096, recompute="block"), 0.9853, OURS_DC),
    # 8 of Mixtral 8x7B's 32 layers with capacity dispatch on the same two GPUs (shardwise's own row
    # is left out: its memory plan kept some of the weights gathered, between the planner's stages)
    Run("Mixtral 8x7B's layer x 8, capacity 1.25, 2 H200 over NVLink, FSDP2 + torch.compile (fused AdamW), "
        "1x4096 per GPU, no recomputation", dataclasses.replace(model("mixtral-8x7b"), name="mixtral-8x7b-8l", layers=8),
        "h200-nv18-x2:1", Strategy(zero=3, micro_batch=1, global_batch=2, seq=4096, recompute="none", capacity=1.25),
        0.3561, OURS_MOE),
    _a3_llama2_7b(),
    # tpu-recipes on v6e. Their custom remat policies rerun every layer but a few tensors moved to host
    # memory (the layer input, the attention projections' outputs); planned as block, the one policy
    # whose memory comes near a v6e chip's 32 GB (selective's plans need 126-925 GB per chip). The host
    # copies are not modelled. Mixtral: capacity 1.25 (dropping, dense dispatch)
    *[_v6e("Llama 3.1 8B, custom remat with host offload", model("llama3-8b"), t, b, 8192, "block", sec)
      for t, b, sec in (("2x4", 3, 3.443), ("4x4", 3, 3.393), ("4x8", 3, 3.495), ("8x8", 5, 5.652),
                        ("8x16", 4, 4.602), ("16x16", 4, 4.546))],
    *[_v6e("Llama 3.1 70B, custom remat with host offload", model("llama3-70b"), t, b, 8192, "block", sec)
      for t, b, sec in (("4x8", 2, 17.790), ("8x8", 2, 18.688), ("8x16", 4, 34.786), ("16x16", 5, 42.656))],
    # its log's 2 x 4096 tokens per chip (the config says 3 sequences)
    _v6e("Llama 2 70B, qkv_proj_offloaded remat", LLAMA2_70B, "16x16", 2, 4096, "block", 9.052),
    _v6e("Mistral 7B, custom remat with host offload", MISTRAL_7B, "2x4", 6, 8192, "block", 6.320),
    _v6e("GPT-3 175B, full remat", GPT3_MAXTEXT, "16x16", 3, 2048, "block", 17.182),
    _v6e("Mixtral 8x7B, capacity 1.25, custom remat with host offload", model("mixtral-8x7b"), "16x16", 12, 4096,
         "block", 13.484, capacity=1.25),
    _titan(8, True, 6667), _titan(8, False, 5762), _titan(128, True, 6514), _titan(128, False, 5605),
    _v5p("32B", 32, "4x4x4", 7, "minimal", 4, 328, fitted=True), _v5p("64B", 64, "4x4x4", 3, "minimal", 4, 323),
    _v5p("128B", 128, "4x4x8", 1, "minimal", 8, 315), _v5p("128B", 128, "4x8x8", 1, "minimal", 8, 316),
    _v5p("256B", 256, "8x8x8", 1, "minimal", 8, 308), _v5p("512B", 512, "8x8x8", 2, "full", 8, 294),
    _v5e("16B", 16, 6, 120, fitted=True), _v5e("32B", 32, 4, 132), _v5e("64B", 64, 2, 118),
    *[_v5e(label, scale, b, tf, slices=n) for label, scale, b, per in V5E_SLICES for n, tf in per.items()],
]


def vtrain_all() -> list[dict]:
    """Every multi-node run of vTrain's measurements whose tensor parallelism fits in a node (the
    planner keeps it there), predicted blind: {run, measured_s, predicted_s, error}."""
    import csv
    import os

    path = os.path.join(os.path.dirname(__file__), "data", "vtrain_ground_truth_multi.csv")
    rows = []
    with open(path, newline="", encoding="utf-8-sig") as f:
        for n in csv.DictReader(f):
            t, p, g = int(n["tensor parallelism"]), int(n["pipeline parallelism"]), int(n["# GPUs"])
            if t > 8:
                continue
            m = megatron_gpt(f"gpt-{n['Parameters (billion)']}B", int(n["# layers"]), int(n["hidden size"]),
                              int(n["attention heads"]))
            st = Strategy(tp=t, pp=p, zero=0, micro_batch=int(n["micro batch"]), global_batch=int(n["global batch"]),
                          recompute="full", sp=False, fused_attention=False)
            meas = float(n["iteration time (ms)"]) / 1e3
            pred = estimate(m, cluster(f"a100-800g:{g // 8}"), st).step_s
            rows.append({"run": f"{n['Parameters (billion)']}B t={t} p={p} d={n['data parallelism']} "
                                f"micro-batch {n['micro batch']}", "measured_s": meas, "predicted_s": pred,
                         "error": pred / meas - 1})
    return rows


def vtrain_summary(rows: list[dict]) -> str:
    errs = [abs(r["error"]) for r in rows]
    return (f"vTrain, all {len(rows)} multi-node runs with tensor parallelism inside a node (blind): "
            f"{sum(e <= 0.10 for e in errs)} within 10%, mean |error| {100 * sum(errs) / len(errs):.1f}%, "
            f"worst {100 * max(errs):.0f}%")


@dataclass(frozen=True)
class CollectiveRun:
    """A published nccl-tests bus bandwidth against the planner's collective model (clusters.py)."""

    label: str
    cluster: str
    kind: str
    gpus: int
    measured_busbw: float
    """nccl-tests' busbw, bytes/s, at its largest messages."""
    source: str
    input: bool = False
    """The figure the planner's link constant was taken from (not a prediction)."""


COLLECTIVE_RUNS: list[CollectiveRun] = [
    CollectiveRun("8 H100, NVLink4/NVSwitch, ring reduce-scatter (and all-gather, ring all-reduce)", "dgx-h100:1",
                  "reduce_scatter", 8, 370e9, "NVIDIA/nccl-tests#212", input=True),
    CollectiveRun("8 H100, NVLink4/NVSwitch, NVLS all-reduce", "dgx-h100:1", "all_reduce", 8, 480e9,
                  "NVIDIA/nccl-tests#212, #309", input=True),
    CollectiveRun("8 H200, all-reduce (NCCL 2.20.3)", "dgx-h200:1", "all_reduce", 8, 475e9, "NVIDIA/nccl-tests#272"),
    CollectiveRun("2 nodes of 8 H100, NDR 8x400G, all-reduce (NVLSTree)", "dgx-h100:2", "all_reduce", 16, 470e9,
                  "NVIDIA/nccl-tests#309"),
    CollectiveRun("4 nodes of 8 H100, NDR 8x400G, all-reduce", "dgx-h100:4", "all_reduce", 32, 365.84e9,
                  "NVIDIA/nccl-tests#309"),
    CollectiveRun("8 A100, NVLink3/NVSwitch, all-reduce at 1 GiB", "dgx-a100:1", "all_reduce", 8, 229e9,
                  "VIA-Research/vTrain trace/a100/AR_GPU8_1M_1024M_LUT", input=True),
    CollectiveRun("2 H200, NV18, all-gather (ours, `shardwise calibrate`)", "h200-nv18-x2:1", "all_gather", 2,
                  279.5e9, "bench/results/2026-11-30-h200x2-nccl-link.json", input=True),
]


def collective_table(runs: list[CollectiveRun] = COLLECTIVE_RUNS, nbytes: float = 8 * 2**30) -> list[dict]:
    """Predicted bus bandwidth (``nbytes`` / predicted time x nccl-tests' bus factor) per run."""
    rows = []
    for r in runs:
        t = cluster(r.cluster).collective_s(r.kind, nbytes, r.gpus)
        pred = nbytes / t * bus_factor(r.kind, r.gpus)
        rows.append({"run": r.label, "measured_gbs": r.measured_busbw / 1e9, "predicted_gbs": pred / 1e9,
                     "error": pred / r.measured_busbw - 1, "input": r.input, "source": r.source})
    return rows


def collective_markdown(rows: list[dict]) -> str:
    return markdown_table(["collective (bus bandwidth)", "measured GB/s", "predicted", "error", "input or blind", "source"],
                  [[r["run"], f"{r['measured_gbs']:.0f}", f"{r['predicted_gbs']:.0f}", f"{r['error']:+.1%}",
                    "input" if r["input"] else "blind", r["source"]] for r in rows])


@dataclass(frozen=True)
class MemoryRun:
    label: str
    model: ModelSpec
    cluster: str
    strategy: Strategy
    measured_gb: float
    """Peak ``torch.cuda.max_memory_allocated`` per GPU, 1e9 bytes."""
    source: str


OURS_H200_MEM = "shardwise bench, bench/results/2026-11-29-h200-llama1b-ws1.json (plain torch.compile row: " \
                "fp32 weights, gradients and AdamW state with bf16 autocast, torch SDPA flash attention)"

MEMORY_RUNS: list[MemoryRun] = [
    # 16 bytes of state per parameter either way (fp32 weight, gradient and two moments; the planner's
    # bf16 weight + bf16 gradient + fp32 master and moments), so the activations are what is tested
    MemoryRun("1.1B Llama, 1 H200, batch 4x2048, bf16 autocast, no recomputation",
              LLAMA_1B, "h200:1", Strategy(zero=0, micro_batch=4, recompute="none"), 28.949, OURS_H200_MEM),
    # the 8B shape on two H200s without recomputation (max_memory_allocated); with per-block
    # checkpointing every system peaked at 80.37 GB in AdamW's multi-tensor step (not in the planner)
    *[MemoryRun(f"Llama 3 8B, 2 H200, {who}, 2x4096 per GPU, no recomputation", model("llama3-8b"),
                "h200-nv18-x2:1", Strategy(zero=z, micro_batch=2, global_batch=4, seq=4096, recompute="none"), gb,
                OURS_8B) for who, z, gb in (("FSDP2 + torch.compile", 3, 97.070), ("shardwise zero3 + memory plan", 2, 107.262))],
    # torchtitan's figure is the allocator's peak reserved memory (GiB), with FSDP + torch.compile
    *[MemoryRun(f"Llama 3.1 8B, {g} H100, FSDP + torch.compile, 2x8192 per GPU, selective per-op checkpointing",
                model("llama3-8b"), f"dgx-h100:{g // 8}",
                Strategy(zero=3, micro_batch=2, global_batch=2 * g, seq=8192, recompute="selective-op"),
                gib * 2**30 / 1e9, TORCHTITAN + " (peak reserved)") for g, gib in ((8, 77.0), (128, 62.0))],
]


def memory_table(runs: list[MemoryRun] = MEMORY_RUNS) -> list[dict]:
    rows = []
    for r in runs:
        e = estimate(r.model, cluster(r.cluster), r.strategy)
        gb = e.memory["total"] / 1e9
        rows.append({"run": r.label, "measured_gb": r.measured_gb, "predicted_gb": gb,
                     "activations_gb": e.memory["activations"] / 1e9, "error": gb / r.measured_gb - 1,
                     "source": r.source})
    return rows


def memory_markdown(rows: list[dict]) -> str:
    return markdown_table(["run (peak memory per GPU)", "measured GB", "predicted GB (activations)", "error", "source"],
                  [[r["run"], f"{r['measured_gb']:.2f}", f"{r['predicted_gb']:.2f} ({r['activations_gb']:.2f})",
                    f"{r['error']:+.1%}", r["source"]] for r in rows])


def table(runs: list[Run] = RUNS) -> list[dict]:
    rows = []
    for r in runs:
        e = estimate(r.model, cluster(r.cluster), r.strategy)
        rows.append({"run": r.label, "measured_s": r.measured_step_s, "predicted_s": e.step_s,
                     "error": e.step_s / r.measured_step_s - 1, "fitted": r.fitted, "source": r.source})
    return rows


def markdown(rows: list[dict]) -> str:
    return markdown_table(["run", "measured s/step", "predicted", "error", "fitted or blind", "source"],
                  [[r["run"], f"{r['measured_s']:.4g}", f"{r['predicted_s']:.4g}", f"{r['error']:+.1%}",
                    "fitted" if r["fitted"] else "blind", r["source"]] for r in rows])
