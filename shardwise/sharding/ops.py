"""What shardwise knows about each ATen op, in one registry keyed by op overload (or by packet, for every overload of
it): whether it only re-views its input, whether zero3 may rebuild it on a backward gather, how inductor treats it (a
library kernel, a composite it decomposes, a heavy op its C++ code stores rather than recomputes), its FLOPs, and its
SM-carved twin. Passes (zero3's view chains, recomputation, the carveout) and the cost model (roofline, liveness) read
the same entries; the tensor-parallel pass will add propagation rules here.

    >>> import torch
    >>> from shardwise.sharding import ops
    >>> ops.info(torch.ops.aten.t.default).view
    True
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

aten = torch.ops.aten
WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclass(frozen=True)
class OpInfo:
    view: bool = False
    """Its output is a view of its input: no data moves (the roofline charges nothing for bytes)."""
    chain: bool = False
    """A re-view or re-type of one tensor: zero3 rebuilds a chain of these on a backward gather
    instead of keeping the forward's result alive."""
    extern: bool = False
    """Inductor hands it to a library kernel (or a collective): its inputs must exist as buffers."""
    fusible: bool = False
    """A composite inductor decomposes into elementwise code around small reductions."""
    heavy: bool = False
    """Inductor's C++ code stores a result with several consumers whose code holds this op rather
    than recomputing it in each (torch 2.13's ``should_realize_on_reuse``)."""
    inplace: bool = False
    """A composite whose kernel inductor lets write into a dying input's buffer, as elementwise ones."""
    flops: Callable[[fx.Node], float] | None = None
    """Floating-point operations of one call (products and attention)."""
    carved: object = None
    """The twin that runs this product with SMs left free for communication (runtime/carveout.py)."""
    carves: object = None
    """For a carved twin: the product it runs (its FLOPs and layouts are the product's)."""
    to_host: bool = False
    """Copies its input to host memory on a side stream (activation offload, runtime/ops.py)."""
    rule: Callable | None = None
    """Its sharding rule on one mesh axis (sharding/rules/): (node, placement of an input, ranks) ->
    (placements it needs its inputs in, its output's placement)."""
    free: bool = False
    """Runs no kernel the roofline charges: a collective (the link model times it), a wait, a pick from
    a tuple, a Python no-op the passes insert (``keep_alive``)."""


_PROPS: dict = {}  # target (an overload, or a packet for all its overloads) -> the fields registered for it
_INFO: dict = {}  # target -> its merged OpInfo (the packet's fields, then the overload's)
_NONE = OpInfo()


def register(*targets, **props) -> None:
    """Add ``props`` (OpInfo fields) to each target: an OpOverload, or an OpOverloadPacket for all
    its overloads. Targets this torch lacks are skipped by name (``"aten.foo"``)."""
    for t in targets:
        if isinstance(t, str):
            t = getattr(aten, t.removeprefix("aten."), None)
            if t is None:
                continue
        _PROPS.setdefault(t, {}).update(props)
    _INFO.clear()


def info(target) -> OpInfo:
    """The registry's entry for a call target (an empty entry for what it does not know)."""
    got = _INFO.get(target)
    if got is None:
        try:
            props = {**_PROPS.get(getattr(target, "overloadpacket", None), {}), **_PROPS.get(target, {})}
        except TypeError:  # an unhashable target: nothing is registered for it
            return _NONE
        got = _INFO[target] = dataclasses.replace(_NONE, **props) if props else _NONE
    return got


def elementwise(n: fx.Node) -> bool:
    """An ATen elementwise op (tagged pointwise, or a cast): cheap to recompute, fused by inductor into its readers."""
    t = n.target
    return n.op == "call_function" and (t is aten._to_copy.default or torch.Tag.pointwise in getattr(t, "tags", ()))


def aliases_input(node: fx.Node) -> bool:
    """True when ``node``'s result shares storage with its first tensor argument."""
    t = node.target
    if t is operator.getitem or t is WAIT or t is aten._unsafe_view.default:
        return True  # a wait returns the collective's own output buffer
    if (schema := getattr(t, "_schema", None)) is None:
        return True  # a Python helper (keep_alive and the like) returns nothing that allocates
    return bool(schema.returns) and schema.returns[0].alias_info is not None


def tensor_bytes(v) -> int:
    """Bytes of a tensor (or of the tensors of a list or tuple); 0 for anything else."""
    if isinstance(v, torch.Tensor):
        return math.prod(v.shape) * v.dtype.itemsize
    return sum(tensor_bytes(x) for x in v) if isinstance(v, (list, tuple)) else 0


# -- views and re-typings -------------------------------------------------------------------------

register(*(f"aten.{n}" for n in ("view", "_unsafe_view", "view_as", "_reshape_alias", "alias", "detach", "t",
                                  "transpose", "permute", "expand", "expand_as", "slice", "select", "unsqueeze",
                                  "squeeze", "as_strided", "split", "split_with_sizes", "unbind", "narrow", "diagonal",
                                  "unflatten", "view_as_real", "view_as_complex")), view=True)
register(aten.t.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
         aten.transpose.int, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
         aten.slice.Tensor, aten.select.int, aten.alias.default, aten.detach.default, aten._to_copy.default,
         torch.ops.prims.convert_element_type.default, aten.clone.default, chain=True)


c10d = torch.ops._c10d_functional
register(operator.getitem, *(getattr(c10d, n) for n in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                                                        "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
                                                        "all_reduce", "all_reduce_coalesced", "all_to_all_single",
                                                        "broadcast", "wait_tensor") if hasattr(c10d, n)), free=True)


# -- products and attention: FLOPs, library kernels -------------------------------------------------

def _product_flops(node: fx.Node) -> float:
    ins = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
    out = node.meta.get("val")
    k = ins[-2].shape[-1]  # the contracted dim of the left operand
    return 2.0 * (math.prod(out.shape) if isinstance(out, torch.Tensor) else 0) * k


def _attention_flops(node: fx.Node) -> float:
    ins = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
    q, k = ins[0], ins[1]
    fwd = 4.0 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * q.shape[-1]
    return fwd * (2.5 if "backward" in str(node.target) else 1.0)


register(aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, flops=_product_flops)
_ATTENTION = ("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
              "_scaled_dot_product_attention_math_for_mps", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_fused_attention_overrideable",
              "_scaled_dot_product_fused_attention_overrideable_backward")
register(*(f"aten.{n}" for n in _ATTENTION), flops=_attention_flops, extern=True)
register(*(f"aten.{n}" for n in ("mm", "bmm", "addmm", "baddbmm", "addbmm", "_scaled_mm", "_int_mm", "convolution",
                                  "convolution_backward", "_convolution")), extern=True)


# -- inductor's treatment of composites ------------------------------------------------------------

# composite ops inductor decomposes into elementwise code around small reductions (row maxima and
# sums): a loss's log-softmax, its gradient and the scatter of nll_loss's gradient never exist as
# whole tensors when their consumers fuse them (measured: a 1.1B Llama's fp32 logits-sized
# tensors were absent from the H200's live blocks at the peak, 2026-11-30)
register(aten._log_softmax.default, aten._softmax.default, aten._log_softmax_backward_data.default,
         aten._softmax_backward_data.default, aten.nll_loss_backward.default, fusible=True)
# the aten ops whose decompositions hold a heavy op (exp, log, log10, log1p, log2, sigmoid, tanh)
# where their result is computed (log-softmax's log is taken of its small row sums, which are
# stored: measured, its result is not); gelu holds tanh only in its tanh approximation (``heavy``)
register(aten.exp.default, aten.log.default, aten.log10.default, aten.log1p.default, aten.log2.default,
         aten.sigmoid.default, aten.tanh.default, aten.silu.default, aten.silu_backward.default,
         aten.gelu_backward.default, aten._softmax.default, aten._log_softmax_backward_data.default,
         aten.softplus.default, aten.elu.default, heavy=True)
# seen in inductor's code for a loss's gradient; a softmax's result gets a buffer of its own
register(aten._log_softmax.default, aten._log_softmax_backward_data.default, aten.nll_loss_backward.default,
         inplace=True)


def heavy(n: fx.Node) -> bool:
    """Whether inductor's C++ code for ``n`` holds a heavy op (``OpInfo.heavy``)."""
    if n.target is aten.gelu.default:  # the tanh approximation holds tanh; the exact one, erf
        return n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none") == "tanh"
    return info(n.target).heavy


def extern(n: fx.Node) -> bool:
    """Inductor runs ``n`` as a library kernel or a fallback (a custom op, a collective)."""
    if n.op != "call_function":
        return False
    return getattr(n.target, "namespace", "aten") not in ("aten", "prims") or info(n.target).extern


def flops(node: fx.Node) -> float:
    """Floating-point operations of one ATen node (matrix products and attention; 0 elsewhere)."""
    f = info(node.target).flops
    return f(node) if f is not None else 0.0
