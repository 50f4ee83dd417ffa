"""Embedding lookups and their gradient: the table whole (or split along the embedding dim: the
lookup's output is split along its last dim); the indices' shard passes to the rows looked up.
A table cut by rows (vocab-parallel, ``S(0)``) looks up whole indices: each rank finds the tokens
among its rows, zeros for the others, so the output is a partial sum (passes/tp_ops.py rewrites the
lookup, and the gradient, which each rank makes for its rows from the whole output gradient)."""

from __future__ import annotations

import torch

from ..ops import register
from ..placements import Partial, Shard
from .base import R, val

aten = torch.ops.aten


def vocab_parallel(pw) -> bool:
    """Whether a table's placement is a cut of its rows in one block per rank."""
    return isinstance(pw, Shard) and pw.dim == 0 and pw.groups == 1


def embedding(node, place, ranks):
    w, idx = node.args[0], node.args[1]
    pw, pi = place(w), place(idx)
    if vocab_parallel(pw):
        return ({idx: R} if pi != R else {}), Partial()
    if isinstance(pw, Shard) and pw.dim == 1 and pi == R:
        return {}, Shard(val(node).dim() - 1)
    need = {w: R} if pw != R else {}
    return (need, pi) if isinstance(pi, Shard) else (need | ({idx: R} if pi != R else {}), R)


def _table(node):
    """The table of the forward lookup whose gradient ``node`` is (the same indices and rows), or None."""
    idx, rows = node.args[1], node.args[2]
    return next((u.args[0] for u in idx.users
                 if u.target is aten.embedding.default and val(u.args[0]).shape[0] == rows), None)


def embedding_backward(node, place, ranks):
    grad, idx = node.args[0], node.args[1]
    pg, pi = place(grad), place(idx)
    nd, table = val(grad).dim(), _table(node)
    if table is not None and vocab_parallel(place(table)):  # each rank's rows, from every token's gradient
        return {a: R for a in (grad, idx) if place(a) != R}, Shard(0)
    if isinstance(pg, Shard) and pg.dim == nd - 1 and pi == R:
        return {}, Shard(1)
    if isinstance(pg, Shard) and pg.dim < nd - 1 and pi in (pg, R):
        # each rank's tokens add into the whole table (whole indices: this rank's slice of them)
        return ({idx: pg} if pi == R else {}), Partial()
    return {a: R for a in (grad, idx) if place(a) != R}, R


register(aten.embedding.default, rule=embedding)
register(aten.embedding_dense_backward.default, rule=embedding_backward)
