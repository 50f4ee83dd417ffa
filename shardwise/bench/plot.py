"""The bench record's bar plot: tokens/s per GPU per system, step time and peak memory on the bars."""

from __future__ import annotations


def _settings(env: dict, common: frozenset = frozenset()) -> list[str]:
    """The communication settings of ``env`` worth naming on a plot: not the ones every run sets
    alike (NVLS off, debug, the library's version), nor those in ``common``."""
    return [f"{k.removeprefix('TORCH_')}={v}" for k, v in env.items()
            if k not in ("NCCL_NVLS_ENABLE", "NCCL_DEBUG", "NCCL_VERSION") and (k, v) not in common]


def label(r: dict, common: frozenset = frozenset()) -> str:
    """A row's system, with the communication settings it ran under where they differ from the
    record's other rows (``common``: the (name, value) pairs every row shares)."""
    extra = _settings(r.get("env") or {}, common)
    return r["system"] + ("\n" + " ".join(extra) if extra else "")


def plot(rec: dict, path: str) -> str:
    """Bar plot of tokens/s per GPU per system, step time and peak memory written on the bars."""
    from matplotlib.figure import Figure  # no pyplot: a figure for a file needs no backend or display

    ok = [r for r in rec["results"] if r.get("tokens_per_s_per_gpu")]
    fig = Figure(figsize=(max(5, 1.3 * len(ok) + 2), 4))
    ax, xs = fig.subplots(), range(len(ok))
    ax.bar(xs, [r["tokens_per_s_per_gpu"] for r in ok], color=["tab:blue" if r["system"].startswith("shardwise")
                                                              else "tab:gray" for r in ok])
    for x, r in zip(xs, ok):
        pk = r.get("peak_mem_gb")
        mem = "" if pk is None else (f"\n{pk:.2f} GB" if pk >= 1 else f"\n{pk * 1e3:.1f} MB")
        ax.text(x, r["tokens_per_s_per_gpu"], f"{r['step_s'] * 1e3:.0f} ms{mem}", ha="center", va="bottom", fontsize=7)
    # settings every row shares go in the title (with one row: under its bar)
    common = (frozenset.intersection(*(frozenset((r.get("env") or {}).items()) for r in ok))
              if len(ok) > 1 else frozenset())
    ax.set_xticks(list(xs), [label(r, common) for r in ok], rotation=20, fontsize=8)
    ax.set_ylim(0, 1.25 * max((r["tokens_per_s_per_gpu"] for r in ok), default=1))
    ax.set_ylabel("tokens/s per GPU" if rec["gpus"] else "tokens/s per rank")
    c, shared = rec["config"], " ".join(_settings(dict(common)))
    ax.set_title(f"{c['model']}/{c['size']} batch {c['batch']}x{c['seq'] or 'default'} {c['precision']} "
                 f"ckpt={c['checkpoint']} ranks={c['ranks']}\n{rec['machine']}"
                 + (f"; every row: {shared}" if shared else ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
