"""Activation offload: two graph ops that move a saved activation to host memory and back.

``shardwise::to_host(x)`` starts copying ``x`` into a pinned host buffer on a copy-out stream and
returns that buffer at once; ``shardwise::to_device(h, like)`` starts copying it back on a copy-in
stream (once the copy out has finished) into a buffer made on the compute stream, and registers on that buffer a work the
graph's ``wait_tensor`` before the value's first reader waits for. The compute stream never waits
for the copy out, and waits for the copy in only where the value is read (passes/actoffload.py
starts it early enough for the copy to hide behind compute). The
copy stream records its use of ``x`` (the allocator then cannot hand ``x``'s memory to the compute
stream before the copy has read it) and the host allocator keeps each pinned buffer until the
copies that use it have finished.

On CPU the host is a second buffer pool: plain copies, the same graph and the same code path.
Both ops are functional (they return new tensors), so the FX executor and inductor run them alike;
inductor calls them as library kernels, in the graph's order.
"""

from __future__ import annotations

import torch

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
        done = torch.cuda.Event()
        done.record()
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

    from .offload import _Ready

    cur, side = torch.cuda.current_stream(like.device), _copy_stream(like.device, "in")
    y = torch.empty(h.shape, dtype=h.dtype, device=like.device)  # made on the compute stream
    side.wait_stream(cur)  # y's memory is free on the compute stream's timeline
    out = _out_done.pop(h.data_ptr(), None)
    if out is not None:
        side.wait_event(out)  # h has arrived
    with torch.cuda.stream(side):
        y.copy_(h, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    # the compute stream waits where the value is first read: the graph's wait_tensor there
    _register_work(y, _Ready(done))
    return y


@to_device.register_fake
def _(h, like):
    return torch.empty(h.shape, dtype=h.dtype, device=like.device)


TO_HOST = torch.ops.shardwise.to_host.default
TO_DEVICE = torch.ops.shardwise.to_device.default
