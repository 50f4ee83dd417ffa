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
    if n.op != "call_function":
        return False
    # a custom op (shardwise's own host copies and the like) runs as a fallback kernel too
    custom = getattr(n.target, "namespace", "aten") not in ("aten", "prims")
    return custom or n.meta.get("sw") is not None or any(k in str(n.target) for k in _EXTERN)


READS = 4
"""Inductor realizes (stores) an elementwise result with several consumers once it reads more than
this many buffers (its ``realize_reads_threshold``); below that each consumer recomputes it."""

# composite ops inductor decomposes into elementwise code around small reductions (row maxima and
# sums): a loss's log-softmax, its gradient and the scatter of nll_loss's gradient never exist as
# whole tensors when their consumers fuse them (measured: a 1.1B Llama's fp32 logits-sized
# tensors were absent from the H200's live blocks at the peak, 2026-11-30)
_FUSIBLE = (aten._log_softmax.default, aten._softmax.default, aten._log_softmax_backward_data.default,
            aten._softmax_backward_data.default, aten.nll_loss_backward.default)
# on CPU inductor stores a result with several consumers whose code holds a heavy op instead of
# recomputing it in each (torch 2.13's should_realize_on_reuse: exp, log, log10, log1p, log2, sigmoid,
# tanh); the aten ops whose decompositions hold one where their result is computed (log-softmax's
# log is taken of its small row sums, which are stored: measured, its result is not)
_HEAVY = (aten.exp.default, aten.log.default, aten.log10.default, aten.log1p.default, aten.log2.default,
          aten.sigmoid.default, aten.tanh.default, aten.silu.default, aten.silu_backward.default,
          aten.gelu_backward.default, aten._softmax.default,
          aten._log_softmax_backward_data.default, aten.softplus.default, aten.elu.default)


def _heavy(n: fx.Node) -> bool:
    if n.target is aten.gelu.default:  # the tanh approximation holds tanh; the exact one, erf
        return n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none") == "tanh"
    return n.target in _HEAVY


# composites whose kernel inductor lets write into a dying input's buffer, as elementwise ones (seen
# in its code for a loss's gradient; a softmax's result gets a buffer of its own)
_INPLACE = (aten._log_softmax.default, aten._log_softmax_backward_data.default, aten.nll_loss_backward.default)


def _fusible(n: fx.Node) -> bool:
    return elementwise(n) or n.target in _FUSIBLE


def _consumers(n: fx.Node) -> tuple[list[fx.Node], set[fx.Node]]:
    """The nodes that read ``n``'s values, looking through views and other aliases of it, and the
    aliases (``n`` among them)."""
    aliases, found, stack = {n}, [], list(n.users)
    while stack:
        u = stack.pop()
        if u.op == "call_function" and u.target is not WAIT and _aliases_input(u) \
                and next(iter(u.all_input_nodes), None) in aliases:
            if u not in aliases:
                aliases.add(u)
                stack.extend(u.users)
        elif u not in found:
            found.append(u)
    return found, aliases


def _addmm_input(n: fx.Node, u: fx.Node, cpu_code: bool) -> bool:
    """``u`` adds ``n`` to a matrix product, which inductor rewrites into one addmm kernel reading
    ``n`` as its bias: always in C++ code, on GPUs unless every user of the sum is elementwise."""
    if u.target is not aten.add.Tensor or not any(a is not n and a.op == "call_function" and a.target is aten.mm.default
                                                  for a in u.args if isinstance(a, fx.Node)):
        return False
    return cpu_code or not all(elementwise(w) for w in u.users)


def _inlined(n: fx.Node, out: fx.Node, reads: frozenset, heavy: bool = False, cpu_code: bool = False) -> bool:
    """Inductor computes this elementwise node inside its consumers' kernels rather than storing it:
    not a graph output, not the input of a library kernel (also through a view, or as the bias of
    a product inductor turns into addmm), and one consumer (the most any of its aliases has), or few
    buffers read and (in CPU code) no heavy op in its code."""
    if not _fusible(n):
        return False
    users, aliases = _consumers(n)
    if out in users or any(_extern(u) or _addmm_input(n, u, cpu_code) for u in users):
        return False
    return max(len(a.users) for a in aliases) == 1 or (len(reads) <= READS and not heavy)


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


def liveness(gm: fx.GraphModule, fused: bool = False, cpu_code: bool | None = None,
             inplace: bool = True) -> Liveness:
    """Simulate the live bytes of ``gm`` executed in node order (see the module docstring).

    ``fused`` models inductor's code instead of the FX executor's:

    - an elementwise node, or a composite inductor decomposes into elementwise code around small
      reductions (log-softmax, softmax, their gradients, nll_loss's gradient), is computed inside
      its consumers' kernels (see ``_inlined``) unless it is a graph output or feeds a library
      kernel (matrix product, attention, collective, a custom op) directly, through a view, or as
      the bias of a product inductor turns into addmm; it then allocates nothing and keeps the
      buffers it reads alive until its consumers run;
    - with ``inplace``, a stored elementwise result takes the buffer of an input of its size and
      dtype that dies in its kernel (the logits' buffer becomes their gradient's);
    - with ``cpu_code`` (default: the graph is on the CPU), a result with several consumers whose
      code holds a heavy op (exp, log, sigmoid, tanh) is stored, as inductor's C++ backend does;
    - a half-precision embedding gradient is accumulated in an fp32 buffer of inductor's own,
      alive until the kernels that cast it have run.

    Against inductor's generated code on CPU (``runtime.memory.inductor_wrapper_peak``, small Llama
    and GPT steps, bf16 and fp32, checkpointed, zero3 and ddp) it is within 5%; on H200s (1.1B
    Llama, 2026-11-30) the measured peaks were 0.4-2.5% from it (re-predicted after the sittings).
    A model, not a measurement.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out = gm.graph.find_nodes(op="output")[0]
    owners: dict[fx.Node, frozenset] = {}
    size: dict[fx.Node, int] = {}
    # the graph's device: values elsewhere (activations offloaded to the host) take none of its memory
    dev = next((v.device.type for p in nodes if p.op == "placeholder"
                and (v := p.meta.get("val")) is not None and hasattr(v, "device")), None)
    cpu_code = dev == "cpu" if cpu_code is None else cpu_code
    heavy: dict[fx.Node, bool] = {}  # an inlined value whose code holds a heavy op (CPU only)
    kernel_reads: dict[fx.Node, frozenset] = {}  # the buffers a stored elementwise result's kernel reads
    scratch: list[tuple[int, int, int]] = []  # buffers of inductor's own: (first node, last node, bytes)
    for n in nodes:
        if n.op == "placeholder":
            owners[n] = frozenset()
        elif n.op == "call_function":
            src = next(iter(n.all_input_nodes), None)
            if _aliases_input(n) and src is not None:
                owners[n] = owners.get(src, frozenset())
                heavy[n] = heavy.get(src, False)
            elif fused and _inlined(n, out, reads := frozenset().union(*(owners.get(a, frozenset())
                                                                       for a in n.all_input_nodes)),
                                    h := cpu_code and (_heavy(n)
                                                       or any(heavy.get(a, False) for a in n.all_input_nodes)),
                                    cpu_code):
                owners[n] = reads
                heavy[n] = h
            else:
                owners[n] = frozenset([n])
                if fused and (elementwise(n) or n.target in _INPLACE):
                    kernel_reads[n] = reads
                v = n.meta.get("val")
                size[n] = 0 if n.meta.get("sw_host") or (dev is not None and getattr(v, "device", None) is not None
                                                         and v.device.type != dev) else _bytes(v)
                if (fused and size[n] and n.target is aten.embedding_dense_backward.default
                        and getattr(v, "dtype", torch.float32).itemsize < 4):
                    # inductor's decomposition accumulates a half-precision gradient in an fp32
                    # buffer, which the kernels casting it read (the consumers, when they fuse the cast)
                    ends = [pos[u] for u in n.users] if all(_fusible(u) for u in n.users) and n.users else []
                    scratch.append((pos[n], max(ends, default=pos[n]), v.numel() * 4))
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
    # inductor writes a kernel's result into the buffer of an input of the same size and dtype that
    # dies in that kernel (its inplace_buffers): the logits' buffer takes their gradient, say
    reuse: dict[int, int] = {}
    reused: dict[int, fx.Node] = {}  # the input whose buffer the kernel at that position writes into
    if fused and inplace:
        for n, reads in kernel_reads.items():
            dt = getattr(n.meta.get("val"), "dtype", None)
            for o in reads:
                if (last[o] == pos[n] and o not in outputs and size[o] == size[n] and size[o]
                        and getattr(o.meta.get("val"), "dtype", None) == dt):
                    reuse[pos[n]] = size[o]
                    reused[pos[n]] = o
                    break
    held: dict[int, int] = {}
    for a, b, nbytes in scratch:
        held[a] = held.get(a, 0) + nbytes
        frees[b] = frees.get(b, 0) + nbytes
    live = peak = 0
    peak_at, peak_i = "", -1
    curve = []
    for i, n in enumerate(nodes):
        live += size.get(n, 0) + held.get(i, 0) - reuse.get(i, 0)
        if live > peak:
            peak, peak_at, peak_i = live, n.name, i
        live -= frees.get(i, 0) - reuse.get(i, 0)
        curve.append(live)
    # a buffer taken over at the peak by the kernel writing into it is listed once, as that kernel's
    at_peak = sorted([(o.name, b) for o, b in size.items()
                      if b and pos[o] <= peak_i <= last[o] and reused.get(peak_i) is not o]
                     + [(f"{nodes[a].name} (scratch)", b) for a, e, b in scratch if a <= peak_i <= e],
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


def optimizer_kernel(defaults: dict, device: str) -> str:
    """The kernel a torch optimizer's step runs, from its ``defaults``: ``fused``, ``foreach`` (the
    multi-tensor path, torch's default on CUDA) or ``for-loop`` (the default elsewhere)."""
    if defaults.get("fused"):
        return "fused"
    foreach = defaults.get("foreach")
    return "foreach" if foreach or (foreach is None and device == "cuda") else "for-loop"


def _step_temporaries(per: list[int], d: dict, device: str) -> int:
    kernel = optimizer_kernel(d, device)
    if kernel == "fused":
        return 0
    if kernel == "foreach":
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
