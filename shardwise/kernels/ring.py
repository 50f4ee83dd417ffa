"""The portable decomposed path: a product and its tensor-parallel collective as a ring of
point-to-point steps in plain torch, each step's product running while the next step's transfer
is in flight (XLA's windowed einsum, torch's micro-pipelined TP). It runs on any process group
(gloo on CPUs, NCCL on GPUs; gloo ranks on a GPU stage their transfers through the host), so the
CPU tests run the fused rewrite through it, and on GPUs it is the fallback where the Triton
kernels (ag_gemm.py, gemm_rs.py) do not apply.

Each function is the ``*_reference`` of its kernel module in one process's terms: this rank's
shard in, this rank's result out, computed as the reference computes it, shard by shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group(name: str):
    """The process group of a functional collective's group name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _exchange(pg, send: torch.Tensor, recv: torch.Tensor) -> list:
    """Send ``send`` to the next rank of ``pg`` and receive ``recv`` from the previous one, started
    (the works to wait). Gloo moves host tensors: a device tensor goes through a host copy."""
    r, p = pg.rank(), pg.size()
    stage = send.device.type != "cpu" and dist.get_backend(pg) == "gloo"
    s = send.cpu() if stage else send
    into = torch.empty(recv.shape, dtype=recv.dtype) if stage else recv
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, dist.get_global_rank(pg, (r + 1) % p), pg),
                                    dist.P2POp(dist.irecv, into, dist.get_global_rank(pg, (r - 1) % p), pg)])
    return [works, (s, into, recv) if stage else None]


def _finish(pending: list) -> None:
    works, staged = pending
    for w in works:
        w.wait()
    if staged is not None:
        staged[2].copy_(staged[1])


def _rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` over ``x``'s last dim, in ``x``'s shape otherwise."""
    return torch.mm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[1])


def ag_mm(x: torch.Tensor, ws: list[torch.Tensor], dim: int, name: str) -> list[torch.Tensor]:
    """``[g, *(g2 @ w for w in ws)]`` where ``g`` is ``x`` all-gathered along ``dim`` over group
    ``name`` and ``g2`` is ``g`` as rows of its last dim: ``p`` steps, in step ``s`` the shard of rank
    ``r - s`` multiplied while the next one arrives."""
    pg = group(name)
    r, p, size = pg.rank(), pg.size(), x.shape[dim]
    shape = list(x.shape)
    shape[dim] *= p
    g = x.new_empty(shape)
    outs = [x.new_empty([*shape[:-1], w.shape[1]]) for w in ws]
    cur = x.contiguous()
    for s in range(p):
        src = (r - s) % p
        pending = _exchange(pg, cur, nxt := torch.empty_like(cur)) if s < p - 1 else None
        g.narrow(dim, src * size, size).copy_(cur)
        for o, w in zip(outs, ws):
            o.narrow(dim, src * size, size).copy_(_rows(cur, w))
        if pending is not None:
            _finish(pending)
            cur = nxt
    return [g, *(o.view(-1, o.shape[-1]) for o in outs)]


def mm_rs(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, shape: list[int], dim: int,
          name: str) -> torch.Tensor:
    """This rank's piece of ``(a @ w).view(shape) + c`` sum-reduced over group ``name`` and cut along
    ``dim``: a ring of ``p`` steps, in step ``s`` the block bound for rank ``r - s - 1`` multiplied,
    the sum arriving for it added, and passed on while the next block is multiplied."""
    pg = group(name)
    r, p = pg.rank(), pg.size()
    size = shape[dim] // p
    rows = a.view(*shape[:-1], a.shape[-1])
    pending = acc = None
    for s in range(p):
        block = ((r - s - 1) % p) * size
        y = _rows(rows.narrow(dim, block, size), w)
        if c is not None:
            y += c.view(shape).narrow(dim, block, size)
        if pending is not None:
            _finish(pending)
            y += acc
        if s == p - 1:
            return y
        pending = _exchange(pg, y, acc := torch.empty_like(y))
    raise AssertionError("unreachable")


def mm_ar(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, chunks: int, name: str) -> torch.Tensor:
    """``a @ w + c`` sum-reduced over group ``name``, in ``chunks`` blocks of rows: each block's
    all-reduce runs while the next block is multiplied."""
    pg = group(name)
    out = a.new_empty((a.shape[0], w.shape[1]))
    c = c.reshape(out.shape) if c is not None else None
    stage = a.device.type != "cpu" and dist.get_backend(pg) == "gloo"
    works = []
    for rows in torch.arange(a.shape[0]).tensor_split(min(chunks, a.shape[0])):
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        y = torch.mm(a[lo:hi], w, out=out[lo:hi]) if c is None else torch.addmm(c[lo:hi], a[lo:hi], w, out=out[lo:hi])
        y = y.cpu() if stage else y
        works.append((dist.all_reduce(y, group=pg, async_op=True), y, lo, hi))
    for work, y, lo, hi in works:
        work.wait()
        if stage:
            out[lo:hi].copy_(y)
    return out
