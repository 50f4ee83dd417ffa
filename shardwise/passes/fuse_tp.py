"""Tensor-parallel products fused with their collectives, in the tp-local step (issue 26).

The tp partition (passes/tp.py) marks each value it moves (``meta["tp_moved"]``). Three patterns of the partitioned
graph, forward and backward alike, become one op each (runtime/ops.py):

- an all-gather whose whole value is read, as rows of its last dim, by products ``g @ w`` (sequence parallelism's gather
  before a column-parallel pair; the gathered gradient before a row-parallel product's backward):
  ``ag_mm(shard, [w, ...])`` returns the gathered value too, for its other readers (a weight gradient's product);
- a product whose partial sum is reduce-scattered (sequence parallelism's row-parallel product, a column-parallel pair's
  input gradient): ``mm_rs``;
- a product whose partial sum is all-reduced (the same without sequence parallelism): ``mm_ar``, each block of rows
  reduced while the next is multiplied.

Each site runs ``plain`` (left as it is), ``ring`` (the decomposed path, kernels/ring.py) or ``kernel`` (the Triton
kernels; all-gather and reduce-scatter, CUDA): the one the cost model predicts fastest (costmodel/fused.py), unless it
gains less than ``FUSE_TIE`` over plain, or the one ``mode`` forces. ``explain`` prints each site's choice and
predictions."""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from ..costmodel.fused import Fused
from ..kernels import applies
from ..runtime.ops import FUSED
from . import emit

aten = torch.ops.aten
MODES = ("auto", "off", "ring", "kernel")
FUSE_TIE = 0.02
"""A fused site predicted faster than plain by less than this share of plain's time stays plain."""
AR_CHUNKS = 4
"""Blocks of rows a product all-reduced block by block is cut in."""
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _product_of(v: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """(the product, the value added to it) whose sum ``v`` is, read by nothing else: ``v`` the product
    or a view of it, or ``v = u + product`` (partial sums added before their one reduction)."""
    if len(v.users) != 1:
        return None
    if v.target is aten.add.Tensor and len(v.args) == 2 and not v.kwargs and all(isinstance(a, fx.Node) for a in v.args):
        for i in (0, 1):
            found = _product_of(v.args[i])
            if found is not None and found[1] is None and v.args[1 - i].meta["val"].shape == v.meta["val"].shape:
                return found[0], v.args[1 - i]
        return None
    mm = v.args[0] if v.target in _VIEWS else v
    return (mm, None) if mm.target is aten.mm.default and len(mm.users) == 1 else None


def _readers(whole: fx.Node) -> list[fx.Node]:
    """The products that read ``whole`` as rows of its last dim: ``mm(view(whole, [-1, k]), w)``."""
    k = whole.meta["val"].shape[-1]
    rows = [whole] if whole.meta["val"].dim() == 2 else [
        u for u in whole.users if u.target in _VIEWS and list(u.meta["val"].shape) == [whole.meta["val"].numel() // k, k]]
    return [m for r in rows for m in r.users if m.target is aten.mm.default and m.args[0] is r]


def _weight(w: fx.Node, names: dict) -> str:
    """The parameter a product's right operand is (through views and casts), else the operand's name."""
    while w.op == "call_function" and w.target in (*_VIEWS, aten.t.default, aten.transpose.int, aten._to_copy.default):
        w = w.args[0]
    return names.get(w.name, w.name)


def sites(gm: fx.GraphModule, names: dict | None = None) -> list[tuple[fx.Node, fx.Node, Fused, list[fx.Node]]]:
    """(the moved value, the value it was moved from, what fusing it would run, the products it
    takes) for each site of ``gm`` (``names``: parameter names by placeholder name, for the label)."""
    nodes, out = {n.name: n for n in gm.graph.nodes}, []
    for n in gm.graph.nodes:
        if "tp_moved" not in n.meta:
            continue
        src, dim, group, c = n.meta["tp_moved"]
        if (x := nodes.get(src)) is None:
            continue
        if c.kind == "all_gather":
            mms = _readers(n)
            if dim == n.meta["val"].dim() - 1 or not mms:
                continue
        else:
            if (found := _product_of(x)) is None:
                continue
            mms = [found[0]]
        v = mms[0].args[0].meta["val"]
        dims = tuple((math.prod(m.meta["val"].shape[:-1]) if c.kind != "all_gather" else v.shape[0],
                      v.shape[-1], m.meta["val"].shape[-1]) for m in mms)
        label = ",".join(_weight(m.args[1], names or {}) for m in mms)
        out.append((n, x, Fused("plain", c.kind, c.full_bytes, c.ranks, dims, v.dtype.itemsize,
                             AR_CHUNKS if c.kind == "all_reduce" else 1, f"{c.reason} -> {label}"), mms))
    return out


def apply(cap, mode: str, cost, kernel_ok: bool) -> list[dict]:
    """Fuse the sites of the tp-local step ``cap`` (a Capture) as ``mode`` says (module docstring);
    ``kernel_ok``: the Triton kernels run here. Returns one row per site: what it moves, each
    implementation's predicted seconds, the one taken."""
    gm = cap.gm
    if mode not in MODES:
        raise ValueError(f"tp_fuse must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "kernel" and not kernel_ok:
        raise ValueError("tp_fuse='kernel' runs Triton kernels over symmetric memory: it needs CUDA, Triton "
                         "and torch symmetric memory; use tp_fuse='ring' (any device) or 'auto'")
    rows, phs = [], gm.graph.find_nodes(op="placeholder")[: cap.n_params]
    found = sites(gm, {ph.name: n for ph, n in zip(phs, cap.param_names)}) if mode != "off" else []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for moved, x, f, mms in found:
        kernel = kernel_ok and f.kind != "all_reduce" and applies(f.products[0][0] // f.ranks, f.itemsize)
        impls = ["plain", "ring"] + (["kernel"] if kernel else [])
        predicted = {i: cost.fused_time(f, i) for i in impls} if cost is not None else {}
        if mode == "auto":
            best = min(impls, key=lambda i: predicted[i]) if predicted else "plain"
            take = best if predicted and predicted[best] < (1 - FUSE_TIE) * predicted["plain"] else "plain"
        else:
            take = mode if mode in impls else "ring"
        rows.append({"site": f.label, "kind": f.kind, "bytes": f.full_bytes, "predicted": predicted, "impl": take})
        if take != "plain":
            _rewrite(gm.graph, moved, x, dataclasses.replace(f, impl=take), min(mms, key=order.__getitem__), mms)
    if any(r["impl"] != "plain" for r in rows):
        emit.restore_topological_order(gm.graph)
        gm.graph.lint()
        gm.recompile()
    for n in gm.graph.nodes:
        n.meta.pop("tp_moved", None)
    return rows


def _rewrite(g: fx.Graph, moved: fx.Node, x: fx.Node, f: Fused, first: fx.Node, mms: list[fx.Node]) -> None:
    """``moved`` (``x`` moved by its collective) and the products ``mms`` made one op, where ``first`` was."""
    _, dim, group, _ = moved.meta["tp_moved"]
    with g.inserting_before(first):
        if f.kind == "all_gather":
            fused = g.call_function(FUSED[f.kind], (x, [m.args[1] for m in mms], dim, group, f.impl))
            fused.meta["val"] = [moved.meta["val"], *(m.meta["val"] for m in mms)]
            whole = emit.node(g, operator.getitem, (fused, 0), moved.meta["val"])
            for i, m in enumerate(mms):
                m.replace_all_uses_with(emit.node(g, operator.getitem, (fused, i + 1), m.meta["val"]))
            moved.replace_all_uses_with(whole)
        else:
            (mm,) = mms
            a, w = mm.args
            add = _product_of(x)[1]
            args = ((a, w, add, list(x.meta["val"].shape), dim, group, f.impl) if f.kind == "reduce_scatter"
                    else (a, w, add, f.chunks, group))
            fused = emit.node(g, FUSED[f.kind], args, mm.meta["val"] if f.kind == "all_reduce" else moved.meta["val"])
            out = fused if f.kind == "reduce_scatter" else emit.reshape(g, fused, moved.meta["val"].shape)
            moved.replace_all_uses_with(out)
    fused.meta["tp_fused"] = f
    _erase_unread([moved, x, *mms])


def _erase_unread(nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` where nothing reads them, and then what only they read (the collective's chain:
    FX keeps collectives as side effects, so dead-code elimination does not)."""
    while nodes:
        n = nodes.pop()
        if n.op == "call_function" and not n.users:
            ins = n.all_input_nodes
            n.graph.erase_node(n)
            nodes.extend(ins)
