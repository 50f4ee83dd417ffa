"""Simulated memory of a step: tensor liveness over the program's node order.

The FX executor (and eager code in general) frees a tensor once nothing refers to it. In a graph a
tensor is referred to by the node that made it and by every *alias* of it — views, in-place
results, collective waits, ``getitem`` of a multi-output op — until the last node reading any of
them. So each storage is owned by the node that allocated it, lives from that node to the last use
of any alias, and graph outputs live to the end (they leave the graph: gradients, the loss).
Placeholders are the caller's tensors and are counted as resident state, not here.

Peak per rank = resident state + the most graph-made bytes live at once; the optimizer step after
the graph holds the gradients plus its own temporaries (see ``optimizer_transient``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .compute import _bytes

WAIT = torch.ops._c10d_functional.wait_tensor.default


def _aliases_input(node: fx.Node) -> bool:
    """True when ``node``'s result shares storage with its first tensor argument."""
    t = node.target
    if t is operator.getitem or t is WAIT:
        return True  # a wait returns the collective's own output buffer
    schema = getattr(t, "_schema", None)
    if schema is None:
        # a Python helper (keep_alive and the like) returns nothing that allocates
        return True
    rets = schema.returns
    return bool(rets) and rets[0].alias_info is not None


@dataclass
class Liveness:
    peak: int
    """Most bytes of tensors made inside the graph live at once."""
    peak_at: str
    """Name of the node at which the peak occurs."""
    outputs: int
    """Bytes of the graph's outputs (they outlive it)."""
    curve: list[int] = field(default_factory=list)
    """Live bytes after each node, in node order."""


def liveness(gm: fx.GraphModule) -> Liveness:
    """Simulate the live bytes of ``gm`` executed in node order (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    owner: dict[fx.Node, fx.Node | None] = {}
    size: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder":
            owner[n] = None
        elif n.op == "call_function":
            src = next(iter(n.all_input_nodes), None)
            if _aliases_input(n) and src is not None:
                owner[n] = owner.get(src)
            else:
                owner[n] = n
                size[n] = _bytes(n.meta.get("val"))
    end = len(nodes)
    last: dict[fx.Node, int] = {o: pos[o] for o in size}
    out = gm.graph.find_nodes(op="output")[0]
    outputs = set()
    for n in nodes:
        for a in n.all_input_nodes:
            o = owner.get(a)
            if o is None:
                continue
            if n is out:
                last[o] = end
                outputs.add(o)
            else:
                last[o] = max(last[o], pos[n])
    frees: dict[int, int] = {}
    for o, i in last.items():
        frees[i] = frees.get(i, 0) + size[o]
    live = peak = 0
    peak_at = ""
    curve = []
    for i, n in enumerate(nodes):
        live += size.get(n, 0)
        if live > peak:
            peak, peak_at = live, n.name
        live -= frees.get(i, 0)
        curve.append(live)
    return Liveness(peak=peak, peak_at=peak_at, outputs=sum(size[o] for o in outputs), curve=curve)


def optimizer_transient(opt: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's step allocates for itself on top of its state (a model, not a measure).

    torch's multi-tensor (``foreach``) Adam/AdamW — the default on CUDA — builds whole-list
    temporaries (bias-corrected ``sqrt(v)`` and the update: two tensors per parameter); the
    single-tensor loop — the default on CPU — holds two temporaries of one parameter at a time.
    Other optimizers are modelled the same way.
    """
    ps = [p for g in opt.param_groups for p in g["params"]]
    if not ps:
        return 0
    per = [p.numel() * p.element_size() for p in ps]
    foreach = opt.defaults.get("foreach")
    fused = opt.defaults.get("fused")
    if fused:
        return 0
    if foreach is None:
        foreach = ps[0].device.type == "cuda"
    return 2 * sum(per) if foreach else 2 * max(per)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state once it exists: measured where it does, else from the optimizer's kind."""
    have = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))
    if have:
        return have
    # tensors of the parameter's size per parameter, and whether a scalar ``step`` tensor is kept too
    kinds = {torch.optim.Adam: (2, True), torch.optim.AdamW: (2, True), torch.optim.Adamax: (2, True),
             torch.optim.NAdam: (2, True), torch.optim.RAdam: (2, True), torch.optim.Adagrad: (1, True),
             torch.optim.RMSprop: (1, True), torch.optim.Adadelta: (2, True)}
    k, step = 0, False
    for c, (m, s) in kinds.items():
        if isinstance(opt, c):
            k, step = m, s
    if isinstance(opt, torch.optim.SGD) and opt.defaults.get("momentum"):
        k = 1
    ps = [p for g in opt.param_groups for p in g["params"]]
    return sum(k * p.numel() * p.element_size() + (4 if step else 0) for p in ps)
