"""Ops whose tp-local program is not the op itself on local values (passes/tp.py calls ``rewrite``
once the reshards are in place): the loss on token shards (sequence parallelism) and the head's
log-softmax and loss on class shards (a vocab-parallel head, as Megatron's).

- ``nll_loss_forward`` on rows in shards: this rank's sum over the count of targets of every rank,
  so the ranks' losses add up to the mean; the count, whole, is what the gradient divides by.
- ``_log_softmax`` on classes in shards: the max and the sum of exponentials are reduced over the
  axis (two all-reduces of one value per row); its backward reduces its sum over the classes alike.
- ``nll_loss_forward``/``nll_loss_backward`` on classes in shards: each rank picks (and gives the gradient
  to) the targets among its classes (``tp_index_<classes>``); the loss is a partial sum, the count whole.
- ``embedding`` of a table cut by rows (vocab-parallel): each rank looks up the tokens among its rows
  and gives zeros for the others, a partial sum; its backward adds those tokens' gradients alone."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..sharding import Partial, Shard
from ..sharding.rules.embedding import vocab_parallel
from . import emit

aten = torch.ops.aten


def rewrite(g: fx.Graph, pl: dict, fwd: set, ranks: int, group: str, stage, index_of) -> None:
    def reduce(x, op, phase, why=""):
        v = x.meta["val"]
        c = emit.collective("all_reduce", v.numel() * v.dtype.itemsize, ranks, phase, axis="tp", reason=why)
        return emit.start_and_wait(g, emit.c10d.all_reduce.default, (x, op, group), list(v.shape), v.dtype,
                                   v.device, c, stage)

    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        phase = "fwd" if n in fwd else "bwd"
        x = n.args[0] if n.target is not aten.nll_loss_backward.default else n.args[1]
        p = pl.get(x)
        classes = isinstance(p, Shard) and p.groups == 1 and p.dim == x.meta["val"].dim() - 1 and p.dim > 0
        if n.target is aten.nll_loss_forward.default and isinstance(pl.get(n), tuple) and isinstance(pl[n][0], Partial):
            (_nll_on_classes if classes else _nll_on_rows)(g, n, reduce, phase, index_of)
        elif n.target is aten.nll_loss_backward.default and classes and isinstance(pl.get(n), Shard):
            pl[_nll_backward_on_classes(g, n, index_of)] = pl[n]
        elif n.target is aten._log_softmax.default and classes and pl.get(n) == p:
            pl[_log_softmax_on_classes(g, n, reduce, phase)] = p
        elif n.target is aten.embedding.default and vocab_parallel(pl.get(n.args[0])) and isinstance(pl.get(n), Partial):
            pl[_lookup_on_rows(g, n, ranks, index_of)] = pl[n]
        elif n.target is aten.embedding_dense_backward.default and pl.get(n) == Shard(0) and n.args[0] in pl \
                and not isinstance(pl[n.args[0]], Shard):
            pl[_lookup_backward_on_rows(g, n, ranks, index_of)] = pl[n]
        elif n.target is aten._log_softmax_backward_data.default and pl.get(n) == pl.get(n.args[0]) and \
                isinstance(pl.get(n), Shard) and n.args[2] % x.meta["val"].dim() == pl[n].dim:
            pl[_log_softmax_backward_on_classes(g, n, reduce, phase)] = pl[n]


def _swap(g, n, out):
    """``out`` in place of ``n``, which is erased."""
    n.replace_all_uses_with(out)
    g.erase_node(n)
    return out


def _replace_outputs(g, n, out, tw):
    for u in list(n.users):
        if u.target is operator.getitem:
            u.replace_all_uses_with(out if u.args[1] == 0 else tw)
            g.erase_node(u)
    g.erase_node(n)


def _nll_on_rows(g, n, reduce, phase, index_of):
    x, target, w, reduction, ignore = n.args
    v = n.meta["val"]
    with g.inserting_before(n):
        local = emit.node(g, aten.nll_loss_forward.default, (x, target, w, 2, ignore), v)  # 2: sum
        s_l = emit.node(g, operator.getitem, (local, 0), v[0])
        tw_l = emit.node(g, operator.getitem, (local, 1), v[1])
        tw = reduce(tw_l, "sum", phase, "the count of targets of the loss on token shards")
        out = emit.node(g, aten.div.Tensor, (s_l, tw), v[0]) if reduction == 1 else s_l
    _replace_outputs(g, n, out, tw)


def _hits(g, x, target, index_of):
    """[rows, local classes]: where each row's target is one of this rank's classes."""
    xv = x.meta["val"]
    mine = index_of(xv.shape[1])
    col = emit.node(g, aten.unsqueeze.default, (target, 1), emit.fake([xv.shape[0], 1], torch.long, xv.device))
    return emit.node(g, aten.eq.Tensor, (col, mine), emit.fake(list(xv.shape), torch.bool, xv.device))


def _nll_on_classes(g, n, reduce, phase, index_of):
    x, target, _, reduction, ignore = n.args
    v, xv = n.meta["val"], x.meta["val"]
    with g.inserting_before(n):
        hit = _hits(g, x, target, index_of)  # an ignored target (ignore_index) is no rank's class
        picked = emit.node(g, aten.where.ScalarOther, (hit, x, 0.0), xv)
        total = emit.node(g, aten.sum.default, (picked,), v[0])
        s_l = emit.node(g, aten.neg.default, (total,), v[0])
        valid = emit.node(g, aten.ne.Scalar, (target, ignore), emit.fake(list(target.meta["val"].shape), torch.bool, xv.device))
        tw = emit.node(g, aten.sum.dim_IntList, (valid, []), v[1], dtype=v[1].dtype)
        out = emit.node(g, aten.div.Tensor, (s_l, tw), v[0]) if reduction == 1 else s_l
    _replace_outputs(g, n, out, tw)


def _nll_backward_on_classes(g, n, index_of):
    grad, x, target, _, reduction, _, tw = n.args[:7]
    with g.inserting_before(n):
        hit = _hits(g, x, target, index_of)
        step = emit.node(g, aten.div.Tensor, (grad, tw), grad.meta["val"]) if reduction == 1 else grad
        neg = emit.node(g, aten.neg.default, (step,), grad.meta["val"])
        out = emit.node(g, aten.where.ScalarOther, (hit, neg, 0.0), x.meta["val"])
    return _swap(g, n, out)


def _log_softmax_on_classes(g, n, reduce, phase):
    x, d = n.args[0], n.args[1]
    v = x.meta["val"]
    row = [*v.shape[:-1], 1]
    with g.inserting_before(n):
        m_l = emit.node(g, aten.amax.default, (x, [d], True), emit.fake(row, v.dtype, v.device))
        m = reduce(m_l, "max", phase, "row max of the log-softmax over class shards")
        shifted = emit.node(g, aten.sub.Tensor, (x, m), v)
        e = emit.node(g, aten.exp.default, (shifted,), v)
        s_l = emit.node(g, aten.sum.dim_IntList, (e, [d], True), emit.fake(row, v.dtype, v.device))
        s = reduce(s_l, "sum", phase, "row sum of exponentials of the log-softmax over class shards")
        lse = emit.node(g, aten.log.default, (s,), emit.fake(row, v.dtype, v.device))
        out = emit.node(g, aten.sub.Tensor, (shifted, lse), n.meta["val"])
    return _swap(g, n, out)


def _log_softmax_backward_on_classes(g, n, reduce, phase):
    grad, out, d = n.args[0], n.args[1], n.args[2]
    v = grad.meta["val"]
    with g.inserting_before(n):
        s_l = emit.node(g, aten.sum.dim_IntList, (grad, [d], True), emit.fake([*v.shape[:-1], 1], v.dtype, v.device))
        s = reduce(s_l, "sum", phase, "row sum of the log-softmax gradient over class shards")
        p = emit.node(g, aten.exp.default, (out,), out.meta["val"])
        ps = emit.node(g, aten.mul.Tensor, (p, s), v)
        res = emit.node(g, aten.sub.Tensor, (grad, ps), n.meta["val"])
    return _swap(g, n, res)


def _mine(g, idx, rows: int, ranks: int, index_of, padding_idx: int = -1):
    """(where each token is one of this rank's rows, its row in this rank's block or 0)."""
    iv = idx.meta["val"]
    mine = index_of(rows)
    shape, dev = list(iv.shape), iv.device
    first = emit.node(g, aten.select.int, (mine, 0, 0), emit.fake([], torch.long, dev))
    local = emit.node(g, aten.sub.Tensor, (idx, first), emit.fake(shape, iv.dtype, dev))
    lo = emit.node(g, aten.ge.Scalar, (local, 0), emit.fake(shape, torch.bool, dev))
    hi = emit.node(g, aten.lt.Scalar, (local, rows // ranks), emit.fake(shape, torch.bool, dev))
    hit = emit.node(g, aten.logical_and.default, (lo, hi), emit.fake(shape, torch.bool, dev))
    if padding_idx >= 0:  # the padding row takes no gradient
        keep = emit.node(g, aten.ne.Scalar, (idx, padding_idx), emit.fake(shape, torch.bool, dev))
        hit = emit.node(g, aten.logical_and.default, (hit, keep), emit.fake(shape, torch.bool, dev))
    safe = emit.node(g, aten.where.ScalarOther, (hit, local, 0), emit.fake(shape, iv.dtype, dev))
    return emit.node(g, aten.unsqueeze.default, (hit, -1), emit.fake(shape + [1], torch.bool, dev)), safe


def _lookup_on_rows(g, n, ranks, index_of):
    w, idx = n.args[0], n.args[1]
    v = n.meta["val"]
    with g.inserting_before(n):
        col, safe = _mine(g, idx, w.meta["val"].shape[0], ranks, index_of)
        out = emit.node(g, aten.embedding.default, (w, safe, *n.args[2:]), v)
        res = emit.node(g, aten.where.ScalarOther, (col, out, 0.0), v)
    return _swap(g, n, res)


def _lookup_backward_on_rows(g, n, ranks, index_of):
    grad, idx, rows, padding_idx = n.args[:4]
    if len(n.args) > 4 and n.args[4]:
        raise ValueError("a vocab-parallel embedding with scale_grad_by_freq=True is not supported: each rank "
                         "would count only its own tokens; keep the embedding whole (vocab_parallel=False)")
    with g.inserting_before(n):
        col, safe = _mine(g, idx, rows, ranks, index_of, padding_idx)
        masked = emit.node(g, aten.where.ScalarOther, (col, grad, 0.0), grad.meta["val"])
        # the whole row count: the partition's local sizes divide it by the ranks (a table cut by rows)
        out = emit.node(g, aten.embedding_dense_backward.default, (masked, safe, rows, -1, False), n.meta["val"])
    return _swap(g, n, out)
