"""Pictures of the cost model: the predicted timeline of a step (compute and communication lanes)."""

from __future__ import annotations

from .simulate import Timeline


def plot_timeline(tl: Timeline, path: str, title: str = "") -> str:
    """Write a PNG of ``tl``: compute above, communication below, exposed waits in red. Returns ``path``."""
    from matplotlib.figure import Figure  # no pyplot: a figure for a file needs no backend or display

    lanes = {"compute": (1.0, "tab:blue"), "comm": (0.0, "tab:orange"), "wait": (1.0, "tab:red")}
    fig = Figure(figsize=(12, 2.6))
    ax = fig.subplots()
    for lane, (y, color) in lanes.items():
        bars = [(a * 1e3, (b - a) * 1e3) for ln, _, a, b in tl.events if ln == lane and b > a]
        if bars:
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color, edgecolors="none", label=lane)
    ax.set_yticks([0, 1], ["communication", "compute"])
    ax.set_xlabel("ms")
    ax.set_xlim(0, max(tl.step_s * 1e3, 1e-6))
    head = f"predicted step {tl.step_s * 1e3:.2f} ms, exposed communication {tl.exposed_comm_s * 1e3:.2f} ms " \
           f"({tl.exposed_pct:.1f}%)"
    ax.set_title(f"{title}\n{head}" if title else head, fontsize=9)
    ax.legend(loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
