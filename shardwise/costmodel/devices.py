"""The one device table: datasheet peaks, the rates measured on our machines, the planner's fitted shares.

Two views of one device read from it. The compiler's roofline times each node at ``flops`` (the matrix-product rate:
measured where we have the device) and ``bandwidth`` (the measured copy rate). The planner times a whole step's products
at the datasheet ``peak_flops`` times its fitted share (``efficiency``), or, where we measured the device's products and
attention by shape (the H200), at a fitted share of those rates (``product_rate``, ``attention_rate``); the memory-bound
kernels at ``mem_eff`` of ``hbm_bw``. MFU is quoted against ``peak_flops``, as the literature does."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import numpy as np

from .hostlink import HostLink

H200_EFF_MAX = 0.859
"""H200: the share of its measured product and attention rates (``HOPPER_PRODUCTS``, ``HOPPER_ATTENTION``) a whole
step holds, fitted on one run only: plain torch.compile of the 1.1B Llama shape on one H200, batch 4x2048, bf16,
multi-tensor AdamW, 0.1257 s/step (bench/results/2026-11-29-h200-llama1b-ws1.json). Every other H200 row of the
planner's validation is blind (bench/results/2026-12-05-plan-measured-rates.md)."""
H100_EFF_MAX = 0.546
"""H100: one share of the datasheet peak for a whole step, the same run's under the model without measured rates. An
H100 with today's software runs the same products as the H200 (median 1.03x, bench/results/2026-12-05-h100-gemm-shapes
.json), but the H100 rows we validate on ran 2023-24 software (torchtitan, MosaicML, MaxText), which those rates predict
5-15% fast: the H100 takes the table once rows of today's software on H100s are in the validation."""

with open(os.path.join(os.path.dirname(__file__), "hopper_rates.json")) as f:
    HOPPER_PRODUCTS, HOPPER_FP8_PRODUCTS = ({int(w): {int(t): tuple(r) for t, r in by_tp.items()} for w, by_tp in
                                            table.items()} for table in json.load(f).values())
"""Measured product rates (hopper_rates.json), TFLOP/s by model width, then tp, at 2048, 4096, 8192 and 16384 tokens per
micro-batch. ``HOPPER_PRODUCTS``: one H200's bf16 ``torch.mm`` rate over a Llama-style layer's twelve products (forward,
input and weight gradients of QKV, output, gate+up, down) on one tensor-parallel rank (bench/results/2026-12-02-h200-
gemm-shapes.md). ``HOPPER_FP8_PRODUCTS``: the same twelve in FP8 as Transformer Engine's recipes run them on a Hopper
(E4M3 forward, E5M2 output gradients, one scale per tensor, bf16 out; ``torch._scaled_mm``, cuBLASLt) on one H100:
1.15-1.99x its bf16 rates of the same run, 1.8x at the large shapes (bench/results/2026-12-06-plan-fp8.md)."""
FP8_EFF_MAX = {"te": 0.728, "torchao": 0.676}
"""The share of ``HOPPER_FP8_PRODUCTS`` a whole FP8 step holds, by recipe, each fitted on one run only. ``te``
(Transformer Engine): NeMo's Llama 3 70B on 64 H100s (Megatron-Bridge, container 26.02, tp=4 pp=8 virtual 5, batch
256); its 12 other rows are blind (bench/results/2026-12-06-plan-fp8.md). ``torchao`` (torchao's Float8 training of
2024-12, dynamic scaling): torchtitan's Llama 3.1 8B FSDP on 8 H100s, Table 1 (bench/results/2026-12-06-plan-torchao
.md); planner/data/runs.toml."""
FP8_CAST_BYTES = 6.0
"""HBM bytes per element of an FP8 operand made in a step: current scaling reads the bf16 tensor for its maximum, then
again to cast it (2 + 2), and writes it and its transpose for the other product that reads it (1 + 1)."""
HOPPER_ATTENTION = {2048: 393, 4096: 483, 8192: 537}
"""Causal flash attention (SDPA, forward + backward, head dim 128) on one H200 by sequence, TFLOP/s executed (the
causal half), the mean over 16, 32 and 64 heads (the same file)."""
TRITON_2022_H100, TRITON_2022_A100 = 159.5e12, 88.0e12
ATTENTION_KERNELS = {"triton-2022": {"h100": TRITON_2022_H100, "h100-hbm2e": TRITON_2022_H100,
                                     "a100": TRITON_2022_A100, "a100-40gb": TRITON_2022_A100}}
"""Attention kernels other than a device's own flash attention, FLOP/s (executed: the causal half) a whole step holds,
by kernel and device, each fitted on one run only. ``triton-2022``: the Triton FlashAttention of 2022 that MosaicML's
MPT runs (llm-foundry's ``attn_impl: triton``, its benchmark tables' default); fitted on MPT 1B at 3x8192 tokens on 8
H100s and on 8 A100 80GB (the A100 40GB has the same SMs). Over all 191 rows of those BF16 tables (8-128 GPUs,
sequences 512-65,536) it takes the planner from 62 within 10% to 127
(bench/results/2026-12-07-plan-attention-kernel.md)."""
PEAK_REF = 989e12
"""The datasheet peak of the H200 the tables were measured on: a device of another peak scales them by its own."""
FSDP2_GATHER_IN, FSDP2_REDUCE_IN, FSDP2_UPDATE = 13.5, 1.45, 1.17
"""FSDP2 as measured at 2 and 8 ranks on one H100 (bench/planner/fsdp2_ranks.py), at the memory-bound rate: B of time
per local parameter per gather of its copy-in (an fp32 cast and a copy, multi-tensor: 6 + 4 B moved); ``chunk_cat``'s
time over its bytes (gradients into the reduce-scatter's buffer); its fused AdamW over shards against whole tensors."""


with open(os.path.join(os.path.dirname(__file__), "expert_rates.json")) as f:
    EXPERT_RATES = json.load(f)
"""An MoE rank's experts as separate products (4 experts, each forward and both gradients) on one H100, TFLOP/s by
dtype, model width, an expert's MLP width on the rank, then tokens an expert receives (bench/planner/expert_gemm.py)."""


def expert_share(width: int, ffn: int, tokens: float, fp8: bool = False) -> float:
    """The rate of an expert's products at its shape over the best measured at its width (``EXPERT_RATES``): experts
    of small MLPs on a few hundred tokens run at a fraction of a dense layer's rate."""
    near = lambda keys, x: min(keys, key=lambda k: abs(np.log2(int(k) / x)))  # noqa: E731
    by_ffn = EXPERT_RATES["fp8" if fp8 else "bf16"][near(EXPERT_RATES["bf16"], width)]
    rates = by_ffn[near(by_ffn, ffn)]
    return _log_interp(tokens, EXPERT_RATES["tokens"][:len(rates)], rates) / max(max(r) for r in by_ffn.values())


def _log_interp(x: float, xs, ys) -> float:
    """``ys`` at ``x`` on the log2 scale of ``xs`` (ascending), held flat beyond the ends."""
    return float(np.interp(np.log2(x), np.log2(xs), ys))


# PCIe 5.0 x16 as measured from one H200 (costmodel.hostlink.measure, 512 MiB pinned copies,
# 2026-11-29): 54.8 GB/s in, 54.3 GB/s out, 88.2 GB/s both at once
PCIE5 = HostLink(54.8e9, 54.3e9, 88.2e9, "H200 PCIe 5.0 x16, measured 2026-11-29")
# the CPU "host tier" is a second buffer pool in the same memory: a copy each way (rough)
CPU_POOL = HostLink(10e9, 10e9, 10e9, "CPU memcpy (rough default)")


@dataclass(frozen=True)
class Device:
    """One accelerator (or the CPU), as both the roofline and the planner see it."""

    name: str
    flops: float
    """FLOP/s of dense matrix products at the compute dtype: the roofline's compute ceiling."""
    bandwidth: float
    """Bytes/s of device memory the roofline charges memory-bound nodes at (a measured copy)."""
    peak_flops: float | None = None
    """Dense bf16 FLOP/s from the datasheet (MFU is quoted against it); None for the CPU."""
    hbm_bytes: float | None = None
    """Device memory, bytes."""
    hbm_bw: float | None = None
    """Datasheet memory bandwidth, bytes/s."""
    eff_max: float = 0.683
    """The matrix products' achieved share of ``peak_flops`` in a whole step (the planner's), as
    ``eff_max · x / (x + eff_x0)`` with ``x`` = hidden size / tensor-parallel size. The A100's is fitted on two runs of
    Korthikanti et al. 2022 (the 22B and 175B models with selective recomputation, Table 5); with the memory-bound
    kernels counted on their own (``mem_eff``) the fit wants no dependence on the width (``eff_x0`` = 0). The H100's
    is fitted on one run of ours (``H100_EFF_MAX``), TPU v5p and v5e on one of MaxText's each; the other TPUs use the
    A100's until runs of theirs are fitted. Where ``products`` is set (the H200), the share of those measured rates."""
    eff_x0: float = 0.0
    mem_eff: float = 0.8
    """Share of ``hbm_bw`` the memory-bound kernels reach in the planner (an assumption, not fitted)."""
    host: HostLink | None = None
    """The link to host memory, where measured (optimizer and activation offload)."""
    label: str = ""
    """The name the planner prints (e.g. "H200 SXM")."""
    match: tuple[str, ...] = ()
    """Substrings of ``torch.cuda.get_device_name`` (lower case) that mean this device."""
    products: dict | None = None
    """Measured product rates by model width, tp and tokens (``HOPPER_PRODUCTS``); None: ``efficiency``'s share of the
    peak. Where set, ``eff_max`` is the share of these rates (and of ``attention``'s) a whole step holds."""
    attention: dict | None = None
    """Measured causal flash attention rates by sequence (``HOPPER_ATTENTION``)."""
    fp8_products: dict | None = None
    """Measured FP8 product rates by shape (``HOPPER_FP8_PRODUCTS``); None: FP8 is not planned on this device."""
    clock: float = 1.0
    """The share of its clocks a power cap leaves (planner clusters' ``@W``): every product rate scales by it."""
    tdp: float | None = None
    """Board power at which the fitted shares hold, watts (a power-capped part: planner clusters' ``@W``)."""

    def efficiency(self, width: float) -> float:
        return self.clock * self.eff_max * width / (width + self.eff_x0)

    def product_rate(self, width: int, tp: int, tokens: float, fp8: str | None = None) -> float:
        """FLOP/s a whole step holds on the matrix products of a model ``width`` wide cut ``tp`` ways, ``tokens`` per
        micro-batch: ``eff_max`` of the measured rate of the nearest width and tp (``products``; ``fp8_products`` at
        the FP8 recipe's share), else of the peak."""
        table = self.fp8_products if fp8 else self.products
        if table is None:
            return self.peak_flops * self.efficiency(width / tp)
        w = min(table, key=lambda k: abs(np.log2(k / width)))
        t = min(table[w], key=lambda k: abs(np.log2(k / tp)))
        share = FP8_EFF_MAX[fp8] if fp8 else None
        return _log_interp(tokens, (2048, 4096, 8192, 16384), table[w][t]) * self.scale(share)

    def today(self) -> "Device":
        """A Hopper as its measured tables (products, attention; the H200's) at the share a step holds of them: how
        the planner runs Transformer Engine's FP8 jobs, whose published rows all ran its releases of 2024 or later."""
        return replace(self, products=HOPPER_PRODUCTS, attention=HOPPER_ATTENTION, eff_max=H200_EFF_MAX)

    def attention_rate(self, seq: int) -> float | None:
        """FLOP/s (executed) a whole step holds on causal flash attention over sequences of ``seq`` tokens; None where
        not measured (the planner then counts attention among the products)."""
        if self.attention is None:
            return None
        xs = sorted(self.attention)
        return _log_interp(seq, xs, [self.attention[x] for x in xs]) * self.scale()

    def kernel_rate(self, kernel: str) -> float:
        """FLOP/s (executed) a whole step holds on attention by ``kernel`` (``ATTENTION_KERNELS``) on this device."""
        rate = ATTENTION_KERNELS[kernel].get(self.name)
        if rate is None:
            raise ValueError(f"attention {kernel}: its rate is known on {', '.join(ATTENTION_KERNELS[kernel])}, not "
                             f"{self.label}; leave --attention out to plan the device's own flash attention")
        return rate * self.clock

    def scale(self, share: float | None = None) -> float:  # a measured table's TFLOP/s to this device's in a step
        return 1e12 * self.clock * (share or self.eff_max) * self.peak_flops / PEAK_REF


def _datasheet(name, label, peak, hbm_bytes, hbm_bw, eff_max=0.683, **kw) -> Device:
    """A device known from its datasheet alone: the roofline uses the planner's achieved rates."""
    return Device(name, peak * eff_max, hbm_bw * 0.8, peak, hbm_bytes, hbm_bw, eff_max=eff_max, label=label, **kw)


DEVICES = {
    # measured on this workplace's H200s (DESIGN.md reference figures): 790 TFLOP/s bf16 GEMM, 4.3 TB/s copy
    "h200": Device("h200", 790e12, 4.3e12, 989e12, 141e9, 4.8e12, eff_max=H200_EFF_MAX, host=PCIE5,
                   products=HOPPER_PRODUCTS, attention=HOPPER_ATTENTION, fp8_products=HOPPER_FP8_PRODUCTS,
                   label="H200 SXM", match=("h200",), tdp=700.0),
    # about 0.7 of the datasheet's 989 TFLOP/s, 3.35 TB/s
    "h100": Device("h100", 700e12, 3.0e12, 989e12, 80e9, 3.35e12, eff_max=H100_EFF_MAX, label="H100 SXM",
                   match=("h100",), tdp=700.0, fp8_products=HOPPER_FP8_PRODUCTS),
    "h100-pcie": _datasheet("h100-pcie", "H100 PCIe", 756e12, 80e9, 2.0e12, eff_max=H100_EFF_MAX),
    "a100": Device("a100", 250e12, 1.6e12, 312e12, 80e9, 2.0e12, label="A100 SXM 80GB", match=("a100",), tdp=400.0),
    # TPUs (Cloud TPU documentation, jax-ml/scaling-book). v5p's share is fitted on one run: MaxText's 32B
    # model on v5p-128; v5e's on its 16B model on one v5e-256 with full remat, planned as per-layer
    # (block) recomputation (planner/validation.py); v3, v4 and v6e use the A100's
    "tpu-v3": _datasheet("tpu-v3", "TPU v3", 123e12, 32e9, 0.9e12),
    "tpu-v4": _datasheet("tpu-v4", "TPU v4", 275e12, 32e9, 1.2e12),
    "tpu-v5p": _datasheet("tpu-v5p", "TPU v5p", 459e12, 95e9, 2.76e12, eff_max=0.753),
    "tpu-v5e": _datasheet("tpu-v5e", "TPU v5e", 197e12, 16e9, 0.82e12, eff_max=0.824),
    "tpu-v6e": _datasheet("tpu-v6e", "TPU v6e", 918e12, 32e9, 1.64e12),
    "cpu": Device("cpu", 50e9, 10e9, host=CPU_POOL, label="CPU")}
# the H100 SXM with 96 GB of HBM2e at 2.4 TB/s (Meta's Grand Teton hosts, torchtitan's benchmarks)
DEVICES["h100-hbm2e"] = replace(DEVICES["h100"], name="h100-hbm2e", bandwidth=1.92e12, hbm_bytes=96e9, hbm_bw=2.4e12,
                                label="H100 SXM 96 GB HBM2e", match=())
DEVICES["a100-40gb"] = replace(DEVICES["a100"], name="a100-40gb", bandwidth=1.24e12, hbm_bytes=40e9, hbm_bw=1.555e12,
                               label="A100 SXM 40GB", match=())  # HBM2 at 1.555 TB/s; its copy rate scaled alike


def cuda_device(name: str) -> Device:
    """The table's entry for a CUDA device name (``torch.cuda.get_device_name``); the H200 if none matches."""
    return next((d for d in DEVICES.values() if any(m in name.lower() for m in d.match)), DEVICES["h200"])
