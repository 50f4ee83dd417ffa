"""Simulated memory of a step: tensor liveness over the program's node order.

The FX executor (and eager code in general) frees a tensor once nothing refers to it. In a graph a tensor is referred to
by the node that made it and by every *alias* of it — views, in-place results, collective waits, ``getitem`` of a
multi-output op — until the last node reading any of them. So each storage is owned by the node that allocated it, lives
from that node to the last use of any alias, and graph outputs live to the end (they leave the graph: gradients, the
loss). Placeholders are the caller's tensors and are counted as resident state, not here.

Peak per rank = resident state + the most graph-made bytes live at once; the optimizer step after the graph holds the
gradients plus its own temporaries (costmodel/optimizer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..sharding.ops import WAIT, aliases_input, elementwise, extern, info, tensor_bytes
from ..sharding.ops import heavy as heavy_op

aten = torch.ops.aten

READS = 4
"""Inductor realizes (stores) an elementwise result with several consumers once it reads more than
this many buffers (its ``realize_reads_threshold``); below that each consumer recomputes it."""


def _fusible(n: fx.Node) -> bool:
    return elementwise(n) or info(n.target).fusible


def _consumers(n: fx.Node) -> tuple[list[fx.Node], set[fx.Node]]:
    """The nodes that read ``n``'s values, through views and other aliases of it, and the aliases (``n`` among them)."""
    aliases, found, stack = {n}, [], list(n.users)
    while stack:
        u = stack.pop()
        if u.op == "call_function" and u.target is not WAIT and aliases_input(u) \
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
    """Inductor computes this elementwise node inside its consumers' kernels rather than storing it: not a graph output,
    not the input of a library kernel (also through a view, or as the bias of a product inductor turns into addmm), and
    one consumer (the most any of its aliases has), or few buffers read and (in CPU code) no heavy op in its code."""
    if not _fusible(n):
        return False
    users, aliases = _consumers(n)
    if out in users or any(extern(u) or _addmm_input(n, u, cpu_code) for u in users):
        return False
    return max(len(a.users) for a in aliases) == 1 or (len(reads) <= READS and not heavy)


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


def liveness(gm: fx.GraphModule, fused: bool = False, cpu_code: bool | None = None, inplace: bool = True) -> Liveness:
    """Simulate the live bytes of ``gm`` executed in node order (see the module docstring).

    ``fused`` models inductor's code instead of the FX executor's:

    - an elementwise node, or a composite inductor decomposes into elementwise code around small reductions
      (log-softmax, softmax, their gradients, nll_loss's gradient), is computed inside its consumers' kernels where
      ``_inlined`` says so (never where it feeds a library kernel); it then allocates nothing and keeps the buffers it
      reads alive until its consumers run;
    - with ``inplace``, a stored elementwise result takes the buffer of an input of its size and dtype that dies in its
      kernel (the logits' buffer becomes their gradient's);
    - with ``cpu_code`` (default: the graph is on the CPU), a result with several consumers whose code holds a heavy op
      (exp, log, sigmoid, tanh) is stored, as inductor's C++ backend does;
    - a half-precision embedding gradient is accumulated in an fp32 buffer of inductor's own, alive until the kernels
      that cast it have run.

    Against inductor's generated code on CPU (``runtime.memory.inductor_wrapper_peak``, small Llama and GPT steps, bf16
    and fp32, checkpointed, zero3 and ddp) it is within 5%; on H200s (1.1B Llama, 2026-11-30) the measured peaks were
    0.4-2.5% from it (re-predicted after the sittings). A model, not a measurement."""
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
            # a fused tp product's outputs are tensors of their own, each freed when its readers are done
            parts = isinstance((src.meta.get("val") if src is not None else None), list) and "tp_fused" in src.meta
            if aliases_input(n) and src is not None and not parts:
                owners[n] = owners.get(src, frozenset())
                heavy[n] = heavy.get(src, False)
            elif fused and _inlined(n, out, reads := frozenset().union(*(owners.get(a, frozenset())
                                                                       for a in n.all_input_nodes)),
                                    h := cpu_code and (heavy_op(n)
                                                       or any(heavy.get(a, False) for a in n.all_input_nodes)),
                                    cpu_code):
                owners[n] = reads
                heavy[n] = h
            else:
                owners[n] = frozenset([n])
                if fused and (elementwise(n) or info(n.target).inplace):
                    kernel_reads[n] = reads
                v = n.meta.get("val")
                size[n] = 0 if n.meta.get("sw_host") or isinstance(v, list) and "tp_fused" in n.meta or (
                    dev is not None and getattr(v, "device", None) is not None and v.device.type != dev) else tensor_bytes(v)
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
    return Liveness(peak=peak, peak_at=peak_at, outputs=sum(size[o] for o in outputs), curve=curve, at_peak=at_peak)
