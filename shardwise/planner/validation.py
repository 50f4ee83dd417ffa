"""Predictions of ``shardwise plan`` against published (and our own) measured runs.

The runs are data (``data/runs.toml``): each names its source, its configuration and the number the source reports.
``fitted`` marks the few runs a constant was fitted on (costmodel.Device.efficiency); every other run is predicted
blind."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

from ..costmodel.collectives import bus_factor
from .clusters import cluster
from .estimate import Strategy, estimate
from .models import MODELS, ModelSpec, model
from .sweep import markdown_table

DATA = os.path.join(os.path.dirname(__file__), "data")


def megatron_gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    # Megatron's GPT: vocabulary 51,200, sequence 2048, GELU MLP of 4h, biases, learned positions, tied head
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, 51200, seq=2048, gated=False, tied=True,
                     bias=True, learned_positions=2048, dropout=True)


def maxtext_model(scale: int) -> ModelSpec:
    # MaxText's base model (width 2048, 16 heads of 128, MLP 7168 gated, 16 layers, vocabulary 32000,
    # untied) grown by global_parameter_scale: each factor of 8 doubles heads and MLP, width, layers
    e, r = divmod(scale.bit_length() - 1, 3)
    heads, mlp, emb, layers = 2 ** (e + (r > 0)), 2 ** (e + (r > 0)), 2 ** (e + (r > 1)), 2 ** e
    return ModelSpec(f"maxtext-{scale}", 16 * layers, 2048 * emb, 16 * heads, 16 * heads, 7168 * mlp, 32000,
                     seq=2048, head_size=128)


@dataclass(frozen=True)
class Run:
    label: str
    model: ModelSpec
    cluster: str
    strategy: Strategy
    measured_step_s: float
    source: str
    """The key of its source in data/runs.toml's [sources] (``SOURCES`` holds the text)."""
    fitted: bool = False


@dataclass(frozen=True)
class MemoryRun:
    label: str
    model: ModelSpec
    cluster: str
    strategy: Strategy
    measured_gb: float
    """Peak ``torch.cuda.max_memory_allocated`` per GPU, 1e9 bytes."""
    source: str


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


def _model(name: str, d: dict) -> ModelSpec:
    d = dict(d)
    if "megatron" in d:
        return megatron_gpt(name, *d["megatron"])
    if "maxtext" in d:
        return maxtext_model(d["maxtext"])
    if "preset" in d:
        return dataclasses.replace(MODELS[d.pop("preset")], name=name, **d)
    return ModelSpec(name, **d)


def _step_s(row: dict, m: ModelSpec, st: Strategy) -> float:
    """The reported number as seconds per step: tokens per device x FLOPs per token / the device's
    reported FLOP rate, or tokens per device / its reported token rate."""
    if "step_s" in row:
        return row["step_s"]
    seq = st.seq or m.seq
    tokens = st.global_batch / cluster(row["cluster"]).gpus * seq
    if "tokens_per_s_per_gpu" in row:
        return tokens / row["tokens_per_s_per_gpu"]
    if row.get("flops") == "maxtext-2024":
        per_token = 6 * m.params() + 6 * m.layers * m.q_dim * seq
    else:  # MaxText's count as the planner's: 6 per weight and token + 12·L·(heads·head size)·T
        per_token = m.flops_per_token(seq)
    return tokens * per_token / (row["tflops_per_chip"] * 1e12)


@functools.cache
def _load() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(os.path.join(DATA, "runs.toml"), "rb") as f:
        d = tomllib.load(f)
    models = {k: _model(k, v) for k, v in d["models"].items()}

    def spec(row):
        m = models.get(row["model"]) or model(row["model"])
        return m, Strategy(**row["strategy"])

    runs = [Run(r["label"], m, r["cluster"], st, _step_s(r, m, st), r["source"], r.get("fitted", False))
            for r in d["run"] for m, st in [spec(r)]]
    mem = [MemoryRun(r["label"], m, r["cluster"], st, r["peak_gb"], r["source"])
           for r in d["memory"] for m, st in [spec(r)]]
    col = [CollectiveRun(r["label"], r["cluster"], r["kind"], r["gpus"], r["busbw_gbs"] * 1e9, r["source"],
                         r.get("input", False)) for r in d["collective"]]
    return {"sources": d["sources"], "runs": runs, "memory": mem, "collective": col}


def __getattr__(name: str):
    key = {"SOURCES": "sources", "RUNS": "runs", "MEMORY_RUNS": "memory", "COLLECTIVE_RUNS": "collective"}.get(name)
    if key is None:
        raise AttributeError(name)
    return _load()[key]


def _source(key: str) -> str:
    return _load()["sources"].get(key, key)


def vtrain_all() -> list[dict]:
    """Every multi-node run of vTrain's measurements whose tensor parallelism fits in a node (the
    planner keeps it there), predicted blind: {run, measured_s, predicted_s, error}."""
    import csv

    rows = []
    with open(os.path.join(DATA, "vtrain_ground_truth_multi.csv"), newline="", encoding="utf-8-sig") as f:
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


def collective_table(runs: list[CollectiveRun] | None = None, nbytes: float = 8 * 2**30) -> list[dict]:
    """Predicted bus bandwidth (``nbytes`` / predicted time x nccl-tests' bus factor) per run."""
    return [{"run": r.label, "measured_gbs": r.measured_busbw / 1e9, "predicted_gbs": pred / 1e9,
             "error": pred / r.measured_busbw - 1, "input": r.input, "source": r.source}
            for r in (_load()["collective"] if runs is None else runs)
            for pred in [nbytes / cluster(r.cluster).collective_s(r.kind, nbytes, r.gpus) * bus_factor(r.kind, r.gpus)]]


def collective_markdown(rows: list[dict]) -> str:
    return markdown_table(["collective (bus bandwidth)", "measured GB/s", "predicted", "error", "input or blind", "source"],
                  [[r["run"], f"{r['measured_gbs']:.0f}", f"{r['predicted_gbs']:.0f}", f"{r['error']:+.1%}",
                    "input" if r["input"] else "blind", _source(r["source"])] for r in rows])


def memory_table(runs: list[MemoryRun] | None = None) -> list[dict]:
    return [{"run": r.label, "measured_gb": r.measured_gb, "predicted_gb": e.memory["total"] / 1e9,
             "activations_gb": e.memory["activations"] / 1e9, "error": e.memory["total"] / 1e9 / r.measured_gb - 1,
             "source": r.source}
            for r in (_load()["memory"] if runs is None else runs)
            for e in [estimate(r.model, cluster(r.cluster), r.strategy)]]


def memory_markdown(rows: list[dict]) -> str:
    return markdown_table(["run (peak memory per GPU)", "measured GB", "predicted GB (activations)", "error", "source"],
                  [[r["run"], f"{r['measured_gb']:.2f}", f"{r['predicted_gb']:.2f} ({r['activations_gb']:.2f})",
                    f"{r['error']:+.1%}", _source(r["source"])] for r in rows])


def table(runs: list[Run] | None = None) -> list[dict]:
    return [{"run": r.label, "measured_s": r.measured_step_s, "predicted_s": e.step_s,
             "error": e.step_s / r.measured_step_s - 1, "fitted": r.fitted, "source": r.source}
            for r in (_load()["runs"] if runs is None else runs)
            for e in [estimate(r.model, cluster(r.cluster), r.strategy)]]


def summary(rows: list[dict]) -> str:
    """How the blind rows hold: within 10%, the median |error|, how many sources."""
    blind = sorted(abs(r["error"]) for r in rows if not r["fitted"])
    return (f"{len(rows)} runs from {len({r['source'] for r in rows})} sources, {len(blind)} blind: "
            f"{sum(e <= 0.10 for e in blind)} within 10%, median |error| {100 * blind[len(blind) // 2]:.1f}%")


def markdown(rows: list[dict]) -> str:
    return markdown_table(["run", "measured s/step", "predicted", "error", "fitted or blind", "source"],
                  [[r["run"], f"{r['measured_s']:.4g}", f"{r['predicted_s']:.4g}", f"{r['error']:+.1%}",
                    "fitted" if r["fitted"] else "blind", _source(r["source"])] for r in rows])
