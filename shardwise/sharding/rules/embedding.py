"""Embedding lookups and their gradient: the table whole (or split along the embedding dim: the
lookup's output is split along its last dim); the indices' shard passes to the rows looked up."""

from __future__ import annotations

import torch

from ..ops import register
from ..placements import Partial, Shard
from .base import R, val

aten = torch.ops.aten


def embedding(node, place, ranks):
    w, idx = node.args[0], node.args[1]
    pw, pi = place(w), place(idx)
    if isinstance(pw, Shard) and pw.dim == 1 and pi == R:
        return {}, Shard(val(node).dim() - 1)
    need = {w: R} if pw != R else {}
    if isinstance(pi, Shard):
        return need, pi
    return need | ({idx: R} if pi != R else {}), R


def embedding_backward(node, place, ranks):
    grad, idx = node.args[0], node.args[1]
    pg, pi = place(grad), place(idx)
    nd = val(grad).dim()
    if isinstance(pg, Shard) and pg.dim == nd - 1 and pi == R:
        return {}, Shard(1)
    if isinstance(pg, Shard) and pg.dim < nd - 1 and pi in (pg, R):
        # each rank's tokens add into the whole table (whole indices: this rank's slice of them)
        return ({idx: pg} if pi == R else {}), Partial()
    return {a: R for a in (grad, idx) if place(a) != R}, R


register(aten.embedding.default, rule=embedding)
register(aten.embedding_dense_backward.default, rule=embedding_backward)
