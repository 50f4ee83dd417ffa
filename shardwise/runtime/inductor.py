"""Run a rewritten step graph compiled by inductor, without letting inductor change the plan."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx


def compile_graph(gm: fx.GraphModule) -> Callable:
    """Compile ``gm`` with inductor on its first call's inputs; later calls reuse the kernels.

    The graph already holds its backward: compiled under ``no_grad`` with detached inputs. CSE is off so zero3's
    separate backward gathers are not merged back into the forward ones, and inductor's reorderings are off so they
    cannot undo our collective order (KEEP_ORDER)."""
    from torch._inductor import config as ind_cfg
    from torch._inductor.compile_fx import compile_fx
    from torch._functorch import config as ft_cfg

    compiled = None

    def run(*inputs):
        nonlocal compiled
        inputs = [x.detach() for x in inputs]
        if compiled is None:
            cfg = dict(KEEP_ORDER)
            if copies_out(gm):
                # a value copied out on a side stream (activation offload) must not be overwritten by
                # inductor's own buffer reuse while the copy reads it: its memory goes back through the
                # caching allocator instead, which honours the copy stream's use of it
                cfg.update(allow_buffer_reuse=False, inplace_buffers=False)
            with torch.no_grad(), ft_cfg.patch(cse=False), ind_cfg.patch(**cfg):
                compiled = compile_fx(gm, inputs)
            run.compiled = compiled
        with torch.no_grad():
            return compiled(*inputs)

    run.compiled = None
    return run


def copies_out(gm: fx.GraphModule) -> bool:
    """Whether the graph copies values to the host on a side stream (activation offload)."""
    from ..sharding.ops import info

    return any(info(n.target).to_host for n in gm.graph.nodes)


def _keep_order() -> dict:
    from torch._inductor import config as ind_cfg

    # reorder_for_locality moves each producer to just before its consumer: a weight gradient's
    # consumer is the graph's output, so every weight-gradient matmul went to the end of the step
    # and kept its inputs (an activation and its gradient, per layer) alive until then
    want = {"reorder_for_compute_comm_overlap": False, "reorder_for_peak_memory": False, "reorder_for_locality": False}
    return {k: v for k, v in want.items() if hasattr(ind_cfg, k)}


KEEP_ORDER = _keep_order()
"""inductor settings that would reorder the scheduled graph, turned off (those this torch has)."""
