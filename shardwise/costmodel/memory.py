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

from ..capture import elementwise
from .compute import _bytes

WAIT = torch.ops._c10d_functional.wait_tensor.default
aten = torch.ops.aten


# ops inductor hands to a library kernel (or a collective): their inputs must exist as buffers
_EXTERN = ("mm.", "bmm.", "addmm.", "baddbmm.", "scaled_dot_product", "convolution", "_c10d_functional")


def _extern(n: fx.Node) -> bool:
    return n.op == "call_function" and (n.meta.get("sw") is not None or any(k in str(n.target) for k in _EXTERN))


READS = 4
"""Inductor realizes (stores) an elementwise result with several consumers once it reads more than
this many buffers (its ``realize_reads_threshold``); below that each consumer recomputes it."""


def _inlined(n: fx.Node, out: fx.Node, reads: frozenset) -> bool:
    """Inductor computes this elementwise node inside its consumers' kernels rather than storing it:
    not a graph output, not the input of a library kernel, and one consumer or few buffers read."""
    if not elementwise(n) or out in n.users or any(_extern(u) for u in n.users):
        return False
    return len(n.users) == 1 or len(reads) <= READS


def _aliases_input(node: fx.Node) -> bool:
    """True when ``node``'s result shares storage with its first tensor argument."""
    t = node.target
    if t is operator.getitem or t is WAIT or t is aten._unsafe_view.default:
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
    at_peak: list[tuple[str, int]] = field(default_factory=list)
    """The storages live at the peak, largest first: (owning node, bytes)."""


def liveness(gm: fx.GraphModule, fused: bool = False) -> Liveness:
    """Simulate the live bytes of ``gm`` executed in node order (see the module docstring).

    ``fused`` models inductor's code instead of the FX executor's: an elementwise node whose result
    is not a graph output and feeds no library kernel (matrix product, attention, collective) is
    computed inside its consumers' kernels (see ``_inlined``), so it allocates nothing and instead
    keeps the buffers it reads alive until its consumers run. Composite ops inductor decomposes
    (softmax, layer norm) still count as stored. Measured on H200s (1.1B Llama, batch 4x2048, bf16,
    2026-11-30) it errs low instead: the graph's live peak was 1.2-1.6 GB above this simulation at
    one rank and at two (10.4 GB simulated at one rank), for reasons not yet found (the allocator's
    view of the peak is the next thing to read). On CPU it cannot be checked: inductor's wrapper
    allocates its buffers outside the dispatcher, where MemTracker does not see them. A model, not a
    measurement.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out = gm.graph.find_nodes(op="output")[0]
    owners: dict[fx.Node, frozenset] = {}
    size: dict[fx.Node, int] = {}
    # the graph's device: values elsewhere (activations offloaded to the host) take none of its memory
    dev = next((v.device.type for p in nodes if p.op == "placeholder"
                and (v := p.meta.get("val")) is not None and hasattr(v, "device")), None)
    for n in nodes:
        if n.op == "placeholder":
            owners[n] = frozenset()
        elif n.op == "call_function":
            src = next(iter(n.all_input_nodes), None)
            if _aliases_input(n) and src is not None:
                owners[n] = owners.get(src, frozenset())
            elif fused and _inlined(n, out, reads := frozenset().union(*(owners.get(a, frozenset())
                                                                       for a in n.all_input_nodes))):
                owners[n] = reads
            else:
                owners[n] = frozenset([n])
                v = n.meta.get("val")
                size[n] = 0 if n.meta.get("sw_host") or (dev is not None and getattr(v, "device", None) is not None
                                                         and v.device.type != dev) else _bytes(v)
    end = len(nodes)
    last: dict[fx.Node, int] = {o: pos[o] for o in size}
    outputs = set()
    for n in nodes:
        for a in n.all_input_nodes:
            for o in owners.get(a, ()):
                if n is out:
                    last[o] = end
                    outputs.add(o)
                else:
                    last[o] = max(last[o], pos[n])
    frees: dict[int, int] = {}
    for o, i in last.items():
        frees[i] = frees.get(i, 0) + size[o]
    live = peak = 0
    peak_at, peak_i = "", -1
    curve = []
    for i, n in enumerate(nodes):
        live += size.get(n, 0)
        if live > peak:
            peak, peak_at, peak_i = live, n.name, i
        live -= frees.get(i, 0)
        curve.append(live)
    at_peak = sorted(((o.name, b) for o, b in size.items() if b and pos[o] <= peak_i <= last[o]),
                     key=lambda r: -r[1])
    return Liveness(peak=peak, peak_at=peak_at, outputs=sum(size[o] for o in outputs), curve=curve,
                    at_peak=at_peak)


def optimizer_transient(opt: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's step allocates for itself on top of its state (a model, not a measure).

    torch's multi-tensor (``foreach``) Adam/AdamW — the default on CUDA — holds one whole-list
    temporary at a time: the bias-corrected ``sqrt(v)``. Every other update is in place, and the
    gradient copy that L2 decay or ``maximize`` makes is dropped before that list is built
    (torch/optim/adam.py, ``_multi_tensor_adam``). On an H200 (1.1B Llama, one rank) the measured
    peak ruled out a second list. The single-tensor loop — the CPU default — holds two temporaries
    of one parameter plus the previous parameter's denominator. Other optimizers are modelled as Adam.
    """
    ps = [p for g in opt.param_groups for p in g["params"]]
    if not ps:
        return 0
    return _step_temporaries([p.numel() * p.element_size() for p in ps], opt.defaults, ps[0].device.type)


def _step_temporaries(per: list[int], d: dict, device: str) -> int:
    if d.get("fused"):
        return 0
    foreach = d.get("foreach")
    if foreach is None:
        foreach = device == "cuda"
    if foreach:
        return sum(per)
    # the loop: sqrt(v) and its bias-corrected copy of one parameter, while the previous parameter's
    # denominator is still held by its loop variable
    return max(2 * n + (per[i - 1] if i else 0) for i, n in enumerate(per))


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
