"""What every op family's rule shares: the placements, a node's fake value, dims made positive."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..placements import Partial, Replicate, Shard

R = Replicate()
P = Partial()


class ShardingError(ValueError):
    """No rule, or a placement that cannot be: the op, the node, the placements it met, and what to do."""


def val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def norm(p, ndim: int):
    """A placement with a negative shard dim made positive."""
    return p.moved(p.dim % ndim) if isinstance(p, Shard) and p.dim < 0 else p


def dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def tensors(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs, in argument order (lists flattened)."""
    return [x for a in node.args for x in (a if isinstance(a, (list, tuple)) else (a,))
            if isinstance(x, fx.Node) and val(x) is not None]


def outputs_like(node: fx.Node, p):
    """``p`` for each tensor output of a multi-output node (R for its scalars and index tensors)."""
    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        return tuple(p if isinstance(x, torch.Tensor) and x.dim() >= 1 else R for x in v)
    return p
