"""Parameter readiness: the step may start before the last optimizer update has finished.

Under optimizer offload the update of step ``t`` streams through the device on its own streams. The next step's graph
need not wait for all of it: each parameter input gets a ``wait_tensor`` right before its first reader, and the runtime
registers on each refreshed compute shard a work whose ``wait`` makes the compute stream wait for that parameter's
update (runtime/offload.py), so the forward starts while the last layers are still being updated. ``wait_tensor``
returns its input (an alias, no copy, in the FX executor and under inductor alike) and is a no-op for a tensor with
nothing registered.

Inserted after scheduling, so the collective schedule is untouched; the cost model reads these waits as free (they are
not collectives)."""

from __future__ import annotations

from . import emit
from .program import Program


def insert(prog: Program, names: frozenset) -> int:
    """Put a readiness wait before the first reader of each parameter input in ``names``; returns how many were put."""
    g = prog.gm.graph
    phs = g.find_nodes(op="placeholder")[: prog.capture.n_params]
    pos, done = {n: i for i, n in enumerate(g.nodes)}, 0
    for name, ph in zip(prog.capture.param_names, phs):
        if name not in names or not ph.users:
            continue
        with g.inserting_before(min(ph.users, key=pos.__getitem__)):
            w = g.call_function(emit.WAIT, (ph,))
        w.meta["val"] = ph.meta.get("val")
        w.meta["sw_ready"] = name
        ph.replace_all_uses_with(w, delete_user_cb=lambda u: u is not w)
        done += 1
    if done:
        g.lint()
        prog.gm.recompile()
    return done
