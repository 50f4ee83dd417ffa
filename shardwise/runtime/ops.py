"""The custom ops and graph helpers the passes insert, and the works their waits wait on.

The passes put these in the step graph; the FX executor and inductor run them alike (custom ops are
library kernels to inductor, run in the graph's order). Each op registers what the cost model needs
to know about it in the op registry (sharding/ops.py).

**Activation offload** (passes/actoffload.py). ``shardwise::to_host(x)`` starts copying ``x`` into a
pinned host buffer on a copy-out stream and returns that buffer at once; ``shardwise::to_device(h, like)``
starts copying it back on a copy-in stream (once the copy out has finished) into a buffer made on the
compute stream, and registers on that buffer a work the graph's ``wait_tensor`` before the value's first
reader waits for. The compute stream never waits for the copy out, and waits for the copy in only where
the value is read (the pass starts it early enough to hide behind compute). The copy stream records its
use of ``x`` (the allocator then cannot hand ``x``'s memory to the compute stream before the copy has
read it) and the host allocator keeps each pinned buffer until the copies that use it have finished.
Both ops are functional (they return new tensors). On CPU the host is a second buffer pool: plain
copies, the same graph and the same code path.

**SM-carved products** (passes/carveout.py). Hopper's cuBLAS products are persistent kernels: one block
per SM on every SM. A collective kernel queued behind one gets no SM until it ends, so a gather and the
product beside it take turns instead of overlapping (bench/results/2026-11-30-h200x2-sitting6-summary.md,
the MoE forward). torch's experimental SM carveout makes cuBLASLt size a product for fewer SMs. Each op
here runs one product with the carveout set, through cuBLASLt (the path that honours it on every torch we
support), and puts both settings back before it returns (also when it raises). The carveout pass swaps
them in for the products the cost model predicts to run beside a collective. A product is one extern
call under inductor too, so the setting cannot leak onto another kernel. On CPU they are the plain
products.

**Readiness** (passes/ready.py, runtime/update.py, runtime/offload.py): ``ReadyWork`` and
``HostReadyWork`` are works registered on a tensor; the graph's ``wait_tensor`` on it waits for them.
**keep_alive** (passes/schedule.py): a no-op that holds a collective's input until its wait."""

from __future__ import annotations

import math
from concurrent.futures import Future
from contextlib import contextmanager

import torch
import torch.distributed
import torch.fx as fx

from ..sharding import ops


# -- activation offload ---------------------------------------------------------------------------

_streams: dict[tuple, torch.cuda.Stream] = {}
_out_done: dict[int, torch.cuda.Event] = {}  # host buffer address -> its copy out has finished


def _copy_stream(device: torch.device, direction: str) -> torch.cuda.Stream:
    """One stream per direction and device: PCIe is full duplex, so copies back in the backward do not
    queue behind the forward's copies out."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), direction)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(key[0])
    return _streams[key]


@torch.library.custom_op("shardwise::to_host", mutates_args=())
def to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cuda":
        return x.clone()
    cur, side = torch.cuda.current_stream(x.device), _copy_stream(x.device, "out")
    h = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    side.wait_stream(cur)  # x is complete
    with torch.cuda.stream(side):
        h.copy_(x, non_blocking=True)
        done = side.record_event()
    _out_done[h.data_ptr()] = done
    x.record_stream(side)
    return h


@to_host.register_fake
def _(x):
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("shardwise::to_device", mutates_args=())
def to_device(h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``h`` back on ``like``'s device (``like`` only names the device: any tensor there)."""
    if like.device.type != "cuda":
        return h.clone()
    from torch._C._distributed_c10d import _register_work

    cur, side = torch.cuda.current_stream(like.device), _copy_stream(like.device, "in")
    y = torch.empty(h.shape, dtype=h.dtype, device=like.device)  # made on the compute stream
    side.wait_stream(cur)  # y's memory is free on the compute stream's timeline
    out = _out_done.pop(h.data_ptr(), None)
    if out is not None:
        side.wait_event(out)  # h has arrived
    with torch.cuda.stream(side):
        y.copy_(h, non_blocking=True)
        done = side.record_event()
    # the compute stream waits where the value is first read: the graph's wait_tensor there
    _register_work(y, ReadyWork(done))
    return y


@to_device.register_fake
def _(h, like):
    return torch.empty(h.shape, dtype=h.dtype, device=like.device)


TO_HOST, TO_DEVICE = torch.ops.shardwise.to_host.default, torch.ops.shardwise.to_device.default

ops.register(TO_HOST, to_host=True)


# -- SM-carved products ---------------------------------------------------------------------------

@contextmanager
def _carved(x: torch.Tensor, sms: int):
    if x.device.type != "cuda" or sms <= 0:
        yield
        return
    blas, before = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)
        torch.backends.cuda.preferred_blas_library(blas)


def _custom_op(name: str):
    """A custom op whose inputs may come in any strides (a product takes any): inductor then need
    not copy an input into a fixed layout for it."""
    tags = (torch.Tag.flexible_layout,) if hasattr(torch.Tag, "flexible_layout") else ()
    try:
        return torch.library.custom_op(name, mutates_args=(), tags=tags)
    except TypeError:  # a torch whose custom_op takes no tags
        return torch.library.custom_op(name, mutates_args=())


@_custom_op("shardwise::carved_mm")
def carved_mm(a: torch.Tensor, b: torch.Tensor, sms: int) -> torch.Tensor:
    with _carved(a, sms):
        return torch.mm(a, b)


@_custom_op("shardwise::carved_bmm")
def carved_bmm(a: torch.Tensor, b: torch.Tensor, sms: int) -> torch.Tensor:
    with _carved(a, sms):
        return torch.bmm(a, b)


@_custom_op("shardwise::carved_addmm")
def carved_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sms: int) -> torch.Tensor:
    with _carved(a, sms):
        return torch.addmm(bias, a, b)


for _op, _plain in ((carved_mm, torch.mm), (carved_bmm, torch.bmm), (carved_addmm, torch.addmm)):
    _op.register_fake(lambda *args, _plain=_plain: _plain(*args[:-1]))  # the plain product's result, on fakes

aten = torch.ops.aten
CARVED = {aten.mm.default: torch.ops.shardwise.carved_mm.default,
          aten.bmm.default: torch.ops.shardwise.carved_bmm.default,
          aten.addmm.default: torch.ops.shardwise.carved_addmm.default}
"""Each product the carveout pass swaps, and its carved op (same arguments, then the SMs)."""
for _product, _twin in CARVED.items():
    ops.register(_product, carved=_twin)
    ops.register(_twin, carves=_product, flops=ops.info(_product).flops, extern=True)


# -- tensor-parallel products fused with their collectives (passes/fuse_tp.py) ---------------------
# ``impl`` "ring": the decomposed path in plain torch (kernels/ring.py), on any process group;
# "kernel": the Triton kernels over symmetric memory (kernels/ag_gemm.py, kernels/gemm_rs.py), CUDA.

@_custom_op("shardwise::ag_mm")
def ag_mm(x: torch.Tensor, ws: list[torch.Tensor], dim: int, group: str, impl: str) -> list[torch.Tensor]:
    """``x`` all-gathered along ``dim`` over ``group``, and that (as rows of its last dim) times each of ``ws``."""
    if impl == "kernel":
        from ..kernels.ag_gemm import ag_gemm

        return ag_gemm(x, ws, dim, group)
    from ..kernels import ring

    return ring.ag_mm(x, ws, dim, group)


@ag_mm.register_fake
def _(x, ws, dim, group, impl):
    from torch.distributed.distributed_c10d import _resolve_process_group

    shape = list(x.shape)
    shape[dim] *= _resolve_process_group(group).size()
    return [x.new_empty(shape), *(x.new_empty((math.prod(shape[:-1]), w.shape[1])) for w in ws)]


@_custom_op("shardwise::mm_rs")
def mm_rs(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, shape: list[int], dim: int, group: str,
          impl: str) -> torch.Tensor:
    """This rank's piece of ``(a @ w).view(shape) + c`` summed over ``group`` and cut along ``dim``."""
    if impl == "kernel":
        from ..kernels.gemm_rs import gemm_rs

        return gemm_rs(a, w, c, shape, dim, group)
    from ..kernels import ring

    return ring.mm_rs(a, w, c, shape, dim, group)


@mm_rs.register_fake
def _(a, w, c, shape, dim, group, impl):
    from torch.distributed.distributed_c10d import _resolve_process_group

    out = list(shape)
    out[dim] //= _resolve_process_group(group).size()
    return a.new_empty(out)


@_custom_op("shardwise::mm_ar")
def mm_ar(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, chunks: int, group: str) -> torch.Tensor:
    """``a @ w + c`` summed over ``group``, each of ``chunks`` blocks of rows reduced while the next is multiplied."""
    from ..kernels import ring

    return ring.mm_ar(a, w, c, chunks, group)


@mm_ar.register_fake
def _(a, w, c, chunks, group):
    return a.new_empty((a.shape[0], w.shape[1]))


def _fused_flops(n: fx.Node) -> float:
    f = n.meta.get("tp_fused")
    return sum(2.0 * m * k * q for m, k, q in f.products) if f is not None else 0.0


FUSED = {"all_gather": torch.ops.shardwise.ag_mm.default, "reduce_scatter": torch.ops.shardwise.mm_rs.default,
         "all_reduce": torch.ops.shardwise.mm_ar.default}
"""The fused op of each tp collective a product feeds or is fed by."""
ops.register(*FUSED.values(), flops=_fused_flops, extern=True)


# -- readiness ------------------------------------------------------------------------------------

class ReadyWork(torch.distributed.Work):
    """A work whose ``wait`` makes the current stream wait for one parameter's update event."""

    def __init__(self, event):
        super().__init__()
        self.event = event

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


class HostReadyWork(torch.distributed.Work):
    """A work whose ``wait`` blocks the host until the host update has sent one parameter's weights,
    then makes the current stream wait for that copy."""

    def __init__(self, published: Future):
        super().__init__()
        self.published = published

    def wait(self, timeout=None) -> bool:
        ev = self.published.result(timeout.total_seconds() if timeout else None)
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
        return True


# -- keep_alive --------------------------------------------------------------------------------------

def keep_alive(*tensors) -> None:
    """A no-op whose only job is to hold a collective's input until its wait (passes/schedule.py)."""


fx.node.has_side_effect(keep_alive)
ops.register(keep_alive, free=True)  # the roofline charges it nothing
