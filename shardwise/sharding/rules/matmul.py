"""Matrix products, as einsums: ``mk,kn->mn`` (mm), ``bmk,bkn->bmn`` (bmm).

A dim that only one operand has (m, n) or both keep (the batch b) carries its shard to the output; the contracted dim k
sharded on both operands gives partial sums (the row-parallel product). A replicated operand is sliced locally to match
a shard of the other one on k. Column-parallel: ``x @ W`` with W sharded on n. Row-parallel: ``x_k @ W_k`` gives a
partial result, reduced once where its first nonlinear reader needs it whole."""

from __future__ import annotations

import contextvars

import torch

from ..ops import register
from ..placements import Partial, Shard
from .base import R, val

aten = torch.ops.aten

FEWER_BYTES = contextvars.ContextVar("shardwise_matmul_fewer_bytes", default=False)
"""How a product of two operands sharded on different dims is resolved: by default the left operand
(the activation in ``x @ W``) is gathered unless only that leaves a partial to reduce (so the
weight's shard stays: Megatron's sequence parallelism); set, the operand whose move sends fewer
bytes (with the partial output's reduction counted) is gathered. sharding/propagate.py sets it for
one propagation (``gather="fewer_bytes"``), and the compiler has the cost model weigh both plans."""


def _bytes(n) -> int:
    v = n.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _einsum(a_dims: str, b_dims: str, out_dims: str, node, place):
    a, b = node.args[0], node.args[1]
    pa, pb = place(a), place(b)
    reduced = {}
    if isinstance(pa, Partial) or isinstance(pb, Partial):  # linear in each operand: partial times replicated
        if isinstance(pa, Partial) and pb == R or isinstance(pb, Partial) and pa == R:
            return {}, Partial()
        # a partial beside a shard (or another partial) is reduced first; the product then goes on
        # as it would on the whole value (a column-parallel product of a reduced sum)
        reduced = {x: R for x in (a, b) if isinstance(place(x), Partial)}
        pa, pb = (R if a in reduced else pa), (R if b in reduced else pb)
    need, out = _placed(a_dims, b_dims, out_dims, node, pa, pb)
    return {**reduced, **need}, out  # a reduced operand that is then sliced: one reduce-scatter


def _placed(a_dims, b_dims, out_dims, node, pa, pb):
    a, b = node.args[0], node.args[1]
    la = a_dims[pa.dim] if isinstance(pa, Shard) else None
    lb = b_dims[pb.dim] if isinstance(pb, Shard) else None
    contracted = set(a_dims) & set(b_dims) - set(out_dims)
    if la is None and lb is None:
        return {}, R
    if la is not None and lb is not None and (la != lb or pa.groups != pb.groups):
        # different letters (or cuts): gather one operand, the one that leaves the output whole-
        # summed (no partial to reduce after); the left one where both do (the right is the weight
        # in ``x @ W``, whose shard stays: sequence parallelism gathers the activation)
        out_a, out_b = _out(lb, pb, out_dims, contracted), _out(la, pa, out_dims, contracted)  # a / b gathered
        if FEWER_BYTES.get():
            cost_a = _bytes(a) + (_bytes(node) if out_a == Partial() else 0)
            cost_b = _bytes(b) + (_bytes(node) if out_b == Partial() else 0)
            if cost_a != cost_b:
                return ({a: R}, out_a) if cost_a < cost_b else ({b: R}, out_b)
        return ({a: R}, out_a) if out_a != Partial() else ({b: R}, out_b)
    letter, p = (la, pa) if la is not None else (lb, pb)
    need = {}
    if letter in contracted or letter in set(a_dims) & set(b_dims):  # both operands have it
        for x, dims, q in ((a, a_dims, pa), (b, b_dims, pb)):
            if q == R:
                need[x] = p.moved(dims.index(letter))  # the replicated operand's local slice
    return need, _out(letter, p, out_dims, contracted)


def _out(letter, p, out_dims, contracted):
    return Partial() if letter in contracted else p.moved(out_dims.index(letter))


def mm(node, place, ranks):
    return _einsum("mk", "kn", "mn", node, place)


def bmm(node, place, ranks):
    return _einsum("bmk", "bkn", "bmn", node, place)


def grouped_mm(node, place, ranks):
    """torch's grouped product, ``offs`` the groups' row ends: ``mk,gkn->mn`` (each row by its group's matrix: the
    experts' products) or, in the backward, ``km,mn->gkn`` (each group's weight gradient). A cut of the rows would cut
    the groups the offsets name, so an operand cut there is gathered; the rest is a product as any."""
    a, b = node.args[0], node.args[1]
    dims = ("mk", "gkn", "mn") if val(b).dim() == 3 else ("km", "mn", "gkn")
    if any(isinstance(place(x), Shard) and d[place(x).dim] in "mg" for x, d in zip((a, b), dims)):
        return {x: R for x in (a, b) if place(x) != R}, R
    return _einsum(*dims, node, place)


register(aten.mm.default, rule=mm)
if hasattr(aten, "_grouped_mm"):
    register(aten._grouped_mm.default, rule=grouped_mm)
register(aten.bmm.default, rule=bmm)
