"""Sweeps of ``shardwise plan``: one estimate per value of an axis, as a table and a plot; and the two
built-in questions users ask (gradient synchronisation by interconnect; latency tolerance)."""

from __future__ import annotations

import dataclasses

from .clusters import cluster
from .estimate import Strategy, estimate
from .models import ModelSpec, model

AXES = ("cluster", "model", "tp", "pp", "zero", "shard", "micro_batch", "global_batch", "seq", "recompute", "virtual",
        "ep", "cp")


def parse(spec: str) -> tuple[str, list]:
    """``tp=1,2,4,8`` -> ("tp", [1, 2, 4, 8])."""
    key, _, vals = spec.partition("=")
    key = key.replace("-", "_")
    if key not in AXES or not vals:
        raise ValueError(f"--sweep {spec!r}: use AXIS=V1,V2,... with AXIS one of {', '.join(AXES)}, or a built-in "
                         "sweep: grad-sync, latency")
    return key, [v if key in ("cluster", "model", "recompute") else int(v) for v in vals.split(",")]


def run(key: str, values: list, m: ModelSpec, cluster_spec: str, st: Strategy, fabric: str | None = None) -> list[dict]:
    rows = []
    for v in values:
        mm = model(v) if key == "model" else m
        cc = v if key == "cluster" else cluster_spec
        ss = st if key in ("model", "cluster") else dataclasses.replace(st, **{key: v})
        try:
            e = estimate(mm, cluster(cc, fabric), ss)
            rows.append({key: v, "step_s": e.step_s, "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu, "mfu": e.mfu,
                         "memory_gb": e.memory["total"] / 1e9, "fits": e.fits, "compute_s": e.compute_s,
                         "comm_s": e.tp_exposed_s + e.ep_exposed_s + e.dp_exposed_s, "bubble_s": e.pp_bubble_s})
        except ValueError as err:
            rows.append({key: v, "error": str(err)})
    return rows


def grad_sync(m: ModelSpec) -> list[dict]:
    """Time to all-reduce the model's bf16 gradients over 8 accelerators joined by NVLink, by a TPU
    torus, and by InfiniBand between nodes (one GPU per node)."""
    nbytes = 2.0 * m.params()
    cases = [("8 H100 in one node (NVLink/NVSwitch)", "dgx-h100:1", 1),
             ("8 TPU v5p chips (2x2x2 torus)", "tpu-v5p:2x2x2", 1),
             ("8 TPU v4 chips (2x2x2 torus)", "tpu-v4:2x2x2", 1),
             ("8 H100 in 8 nodes (InfiniBand NDR)", "dgx-h100:8", 8)]
    return [{"interconnect": label, "grad_gb": nbytes / 1e9,
             "all_reduce_s": cluster(spec).collective_s("all_reduce", nbytes, 8, inner)}
            for label, spec, inner in cases]


def latency(models=("llama3-8b", "llama3-70b", "llama3-405b"), gpus=(8, 64, 512, 4096), bucket_mb: float = 25.0,
            seq: int = 8192) -> list[dict]:
    """The per-message latency a data-parallel gradient reduction tolerates before it stops hiding behind the backward:
    ZeRO-3/FSDP over NDR InfiniBand, one sequence per GPU, gradients reduced in ``bucket_mb`` buckets by rings of ``n -
    1`` steps each (reduce-scatter) — the latency at which the reduction takes as long as the backward."""
    rows = []
    for name in models:
        m = model(name)
        for n in gpus:
            c = cluster(f"dgx-h100:{max(1, n // 8)}")
            e = estimate(m, c, Strategy(zero=3, seq=seq))
            bwd = e.compute_s * 2 / 3  # the backward is two thirds of forward + backward
            nbytes = 2.0 * m.params()
            buckets = max(1.0, nbytes / (bucket_mb * 2**20))
            # reduce-scatter + all-gather (one all-reduce's worth) of every gradient, level by level:
            # a bandwidth part, and the latency-bearing steps of each bucket
            _, bw, per_bucket = c.collective_parts("all_reduce", nbytes, n)
            steps = per_bucket * buckets
            tol = (bwd - bw) / steps if steps else None
            rows.append({"model": name, "gpus": n, "backward_s": bwd, "comm_bandwidth_s": bw,
                         "tolerated_latency_us": tol * 1e6 if tol and tol > 0 else None})
    return rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table of already formatted cells."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    return markdown_table(keys, [[fmt(r.get(k)) for k in keys] for r in rows])


def plot(rows: list[dict], key: str, path: str, title: str) -> str:
    from matplotlib.figure import Figure  # no pyplot: a figure for a file needs no backend or display

    ok = [r for r in rows if "step_s" in r]
    fig = Figure(figsize=(max(5, 0.9 * len(ok) + 2), 3.8))
    ax = fig.subplots()
    xs = range(len(ok))
    ax.bar(xs, [r["tokens_per_s_per_gpu"] for r in ok], color=["tab:blue" if r["fits"] else "tab:red" for r in ok])
    for x, r in zip(xs, ok):
        ax.text(x, r["tokens_per_s_per_gpu"], f"{r['step_s']:.2f} s\n{r['memory_gb']:.0f} GB\nMFU {r['mfu']:.0%}",
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [str(r[key]) for r in ok], fontsize=8)
    ax.set(xlabel=key, ylabel="tokens/s per GPU (red: does not fit)")
    ax.set_title(title, fontsize=8)
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
