"""``sw.shard(x, placement)``: a model marks an activation's placement on the tp axis (the GSPMD
``mark_sharding``), say ``sw.shard(h, sw.Shard(1))`` for sequence shards of ``h``.

Outside capture it returns ``x`` as it is. Captured, it is a ``shardwise::shard_hint`` node (an identity, its gradient
passed through), which the tp partition (passes/tp.py) turns into a mark that propagation honours: readers see the value
in that placement, whatever its producer left. Without a tp axis the compiler removes the nodes before anything runs.

    >>> import torch, shardwise as sw
    >>> x = torch.ones(2, 4)
    >>> sw.shard(x, sw.Shard(1)) is x   # eager: nothing to do
    True
    >>> parse(str(Shard(0, groups=3))), parse("R")
    (Shard(dim=0, groups=3), Replicate())
"""

from __future__ import annotations

import re

import torch

from .placements import Replicate, Shard


@torch.library.custom_op("shardwise::shard_hint", mutates_args=())
def shard_hint(x: torch.Tensor, placement: str) -> torch.Tensor:
    return x.clone()


@shard_hint.register_fake
def _(x, placement):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad, None


shard_hint.register_autograd(_backward)


def parse(text: str):
    """A placement from its short form: ``S(d)``, ``S(d)xK``, ``R``."""
    if text == "R":
        return Replicate()
    m = re.fullmatch(r"S\((-?\d+)\)(?:x(\d+))?", text)
    if not m:
        raise ValueError(f"sw.shard: {text!r} is not a placement (S(d), S(d)xK or R)")
    return Shard(int(m.group(1)), int(m.group(2) or 1))


def shard(x: torch.Tensor, placement) -> torch.Tensor:
    """``x``, to lie in ``placement`` (``sw.Shard(dim)`` or ``sw.Replicate()``) on the tp axis."""
    if not isinstance(placement, (Shard, Replicate)):
        raise ValueError(f"sw.shard: the placement must be sw.Shard(dim) or sw.Replicate(), got {placement!r}")
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(x, FakeTensor):
        return x
    if isinstance(placement, Shard):
        placement = placement.moved(placement.dim % x.dim())
    return shard_hint(x, str(placement))


def strip(g: torch.fx.Graph) -> int:
    """Every hint replaced by its value (a job without a tp axis); returns how many."""
    hints = list(g.find_nodes(op="call_function", target=torch.ops.shardwise.shard_hint.default))
    for n in hints:
        n.replace_all_uses_with(n.args[0])
        g.erase_node(n)
    return len(hints)
