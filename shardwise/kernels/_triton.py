"""The Triton kernels of ag_gemm.py and gemm_rs.py, and the symmetric-memory plumbing around them.

**All-gather + GEMM.** Each rank copies its shard into its symmetric buffer; after a barrier, a side
stream pulls every peer's shard into a stacked buffer ``[ranks, *shard]`` with the copy engines,
nearest peer first, and after each copy sets that shard's flag with a stream memory write (no SM
needed). A persistent GEMM runs meanwhile on the main stream: its tiles start on this rank's own
shard and follow the copies' order, each waiting for its shard's flag. Row ``m`` of the stacked
buffer (shard ``j``, outer index ``o``, row ``s`` of ``inner``) lands in row
``o * ranks * inner + j * inner + s`` of the output: the gathered rows in their model order, for a
gather along any dim (``outer``: the dims before it, ``inner``: it and those after, but the last).

**GEMM + reduce-scatter.** A persistent GEMM computes the tiles bound for the next rank first and
this rank's last, storing each into the symmetric receive buffer of the rank it belongs to (slot
``rank``) and counting it there with a release atomic; each rank then sums its ``ranks`` slots once
every peer's count is in, at memory bandwidth, into its block. A barrier at each call's start keeps
a peer from writing a slot that is still being summed.

Tiles never straddle two ranks' rows: the launchers refuse (``applies``) shapes whose rows per rank
are not a multiple of the tile height; the fused pass then keeps the decomposed path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import BLOCK_M, applies


def config(n: int, k: int) -> dict:
    """The tile shape and launch of the products (fixed per shape, never autotuned: every rank must
    tile alike, since a reduce-scatter's counts are numbers of tiles)."""
    return dict(BLOCK_N=256 if n >= 2048 else 128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _traced_as(kind: str):
    """Launch metadata: the name, FLOPs and bytes a profiler's trace shows for a launch."""
    def meta(grid, kernel, args):
        m, n, k, size = args["M"], args["N"], args["K"], args["c_ptr"].element_size()
        return {"name": f"shardwise.{kind} {m}x{k}x{n} over {args['ranks']}", "flops": 2.0 * m * n * k,
                "bytes": (m * k + k * n + m * n) * size}
    return meta


@triton.jit
def _tile(t, num_pid_m, num_pid_n, first_m, GROUP_M: tl.constexpr):
    """Tile ``t``'s (pid_m, pid_n): grouped order (GROUP_M rows of tiles share their columns of B),
    the rows rotated to start at ``first_m``."""
    width = GROUP_M * num_pid_n
    group = t // width
    top = group * GROUP_M
    size = tl.minimum(num_pid_m - top, GROUP_M)
    pid_m = top + (t % width) % size
    pid_n = (t % width) // size
    return (pid_m + first_m) % num_pid_m, pid_n


@triton.jit
def _product(a_ptr, b_ptr, sam, sak, sbk, sbn, a_row0, rows, pid_n, N, K, PRECISION: tl.constexpr, TMA: tl.constexpr,
             B_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile of A @ B in fp32: A's rows ``rows`` (or, with TMA descriptors, the ``BLOCK_M`` rows from
    ``a_row0``), B's columns of tile ``pid_n``. ``B_T``: B is the transpose of a row-major matrix."""
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:
            a = a_ptr.load([a_row0, k0])
            b = b_ptr.load([pid_n * BLOCK_N, k0]).T if B_T else b_ptr.load([k0, pid_n * BLOCK_N])
        else:
            a = tl.load(a_ptr + rows[:, None] * sam + (k0 + rk)[None, :] * sak, mask=(k0 + rk)[None, :] < K, other=0.0)
            b = tl.load(b_ptr + (k0 + rk)[:, None] * sbk + rn[None, :] * sbn,
                        mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit(launch_metadata=_traced_as("ag_gemm"))
def _ag_gemm_kernel(a_ptr, b_ptr, c_ptr, flags_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                    rank, ranks, inner, rows_per_rank, WAIT: tl.constexpr, PRECISION: tl.constexpr,
                    TMA: tl.constexpr, B_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    first_m = rank * (rows_per_rank // BLOCK_M)
    for t in range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = _tile(t, num_pid_m, num_pid_n, first_m, GROUP_M)
        j = (pid_m * BLOCK_M) // rows_per_rank
        if WAIT:
            if j != rank:
                while tl.atomic_add(flags_ptr + j, 0, sem="acquire", scope="gpu") == 0:
                    pass
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = _product(a_ptr, b_ptr, sam, sak, sbk, sbn, pid_m * BLOCK_M, rm, pid_n, N, K, PRECISION, TMA, B_T,
                       BLOCK_M, BLOCK_N, BLOCK_K)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rem = rm - j * rows_per_rank
        out = (rem // inner) * (ranks * inner) + j * inner + rem % inner
        tl.store(c_ptr + out[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(launch_metadata=_traced_as("gemm_rs"))
def _gemm_rs_kernel(a_ptr, b_ptr, c_ptr, recv_ptrs, count_ptrs, M, N, K, sam, sak, sbk, sbn, scm, scn,
                    rank, ranks, inner, rows_per_rank, HAS_C: tl.constexpr, PRECISION: tl.constexpr,
                    TMA: tl.constexpr, B_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    first_m = ((rank + 1) % ranks) * (rows_per_rank // BLOCK_M)  # the next rank's tiles first, ours last
    for t in range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = _tile(t, num_pid_m, num_pid_n, first_m, GROUP_M)
        j = (pid_m * BLOCK_M) // rows_per_rank  # the rank these rows belong to
        row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M) - j * rows_per_rank  # within its block
        src = (row // inner) * (ranks * inner) + j * inner + row % inner  # the model's row
        row0 = pid_m * BLOCK_M - j * rows_per_rank  # (TMA: a tile's rows are consecutive, inner % BLOCK_M == 0)
        acc = _product(a_ptr, b_ptr, sam, sak, sbk, sbn, (row0 // inner) * (ranks * inner) + j * inner + row0 % inner,
                       src, pid_n, N, K, PRECISION, TMA, B_T, BLOCK_M, BLOCK_N, BLOCK_K)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_C:
            acc += tl.load(c_ptr + src[:, None] * scm + rn[None, :] * scn, mask=rn[None, :] < N, other=0.0)
        dest = tl.load(recv_ptrs + j).to(tl.pointer_type(c_ptr.dtype.element_ty))
        slot = (rank * rows_per_rank + row)[:, None] * N + rn[None, :]
        tl.store(dest + slot, acc.to(c_ptr.dtype.element_ty), mask=rn[None, :] < N)
        count = tl.load(count_ptrs + j).to(tl.pointer_type(tl.int32))
        tl.atomic_add(count + rank, 1, sem="release", scope="sys")


@triton.jit
def _reduce_kernel(recv_ptr, count_ptr, out_ptr, numel, ranks, expected, BLOCK: tl.constexpr):
    for j in range(0, ranks):
        while tl.atomic_add(count_ptr + j, 0, sem="acquire", scope="sys") < expected:
            pass
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, ranks):
        acc += tl.load(recv_ptr + j * numel + offs, mask=offs < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < numel)


def product(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, cfg: dict | None = None):
    """A launcher of ``c = a @ w`` by the kernels' product alone (one rank, nothing to wait for), its
    operands' descriptors made once: timing it times the device, not the host's set-up."""
    m, k, n = a.shape[0], a.shape[1], w.shape[1]
    cfg = cfg or config(n, k)
    A, B, tma, b_t = _operands(a, w, cfg, True)
    grid = (_programs(triton.cdiv(m, BLOCK_M) * triton.cdiv(n, cfg["BLOCK_N"]), a.device, 1),)
    args = (A, B, c, a, m, n, k, *a.stride(), *w.stride(), *c.stride(), 0, 1, m, m)
    kw = dict(WAIT=False, PRECISION=_precision(a.dtype), TMA=tma, B_T=b_t, BLOCK_M=BLOCK_M, **cfg)
    return lambda: _ag_gemm_kernel[grid](*args, **kw)


def product_share(m: int, k: int, n: int, device) -> float:
    """The kernels' bf16 product rate over cuBLAS's on an (m, k) by (k, n) product (``w`` the transpose
    of a row-major weight, as the model's products read it): medians of timed runs."""
    from triton.testing import do_bench

    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
    c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    lib = do_bench(lambda: torch.mm(a, w, out=c), warmup=25, rep=100, return_mode="median")
    return lib / do_bench(product(a, w, c), warmup=25, rep=100, return_mode="median")


# -- symmetric memory -------------------------------------------------------------------------------

HEAD = 256
"""Bytes at the front of each symmetric buffer: GEMM+RS's tile counts, one int32 per source rank
(zeroed when the buffer is made, and by each call once its sum is done). The data follows."""


class _Workspace:
    """One process group's symmetric buffer (grown as needed: a collective, which every rank reaches
    alike, since every rank runs the same program), its side stream and the AG shards' flags."""

    def __init__(self, name: str, device: torch.device):
        self.name, self.device, self.bytes, self.handle = name, device, 0, None
        self.side = torch.cuda.Stream(device)
        self.flags = torch.zeros(HEAD // 4, dtype=torch.int32, device=device)

    def reserve(self, nbytes: int):
        """The handle of a buffer with ``nbytes`` of data after its head."""
        if HEAD + nbytes > self.bytes:
            from torch.distributed import _symmetric_memory as symm

            self.bytes = max(HEAD + nbytes, 2 * self.bytes)
            self.buf = symm.empty(self.bytes, dtype=torch.uint8, device=self.device)
            self.buf[:HEAD].zero_()
            self.handle = symm.rendezvous(self.buf, self.name)
            self.ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=self.device)
            self.data_ptrs = self.ptrs + HEAD
            self.counts = self.handle.get_buffer(self.handle.rank, (self.handle.world_size,), torch.int32)
        return self.handle

    def data(self, rank: int, shape, dtype) -> torch.Tensor:
        """Rank ``rank``'s data region as a tensor of ``shape``."""
        return self.handle.get_buffer(rank, tuple(shape), dtype, HEAD // dtype.itemsize)


_SPACES: dict[tuple, _Workspace] = {}


def _space(name: str, device: torch.device) -> _Workspace:
    key = (name, device)
    if key not in _SPACES:
        _SPACES[key] = _Workspace(name, device)
    return _SPACES[key]


def _flag(flags: torch.Tensor, index: int) -> None:
    """Set ``flags[index]`` to 1 from the current stream, without a kernel."""
    flags = flags.view(torch.uint32)
    write = getattr(torch.ops.symm_mem, "stream_write_value32_", None)
    if write is None:
        torch._C._distributed_c10d._SymmetricMemory.stream_write_value32(flags, index, 1)
    else:
        write(flags, index, 1)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _programs(tiles: int, device, ranks: int) -> int:
    """Persistent programs: one per SM, less two where a tile may wait for a copy (room for any
    kernel the copies need)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, sms - (2 if ranks > 1 else 0)))


USE_TMA = True
"""Load the products' operands through TMA descriptors where the device and the layouts allow (Hopper)."""


_HOPPER: dict = {}


def _hopper(device) -> bool:
    """Whether ``device`` has TMA (compute capability 9 or more), asked once per device."""
    if device not in _HOPPER:
        _HOPPER[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _HOPPER[device]


def _operands(a: torch.Tensor, w: torch.Tensor, cfg: dict, rows_whole: bool) -> tuple:
    """(A, B, TMA, B_T) as the kernels take them: TMA descriptors where ``USE_TMA``, the device is a
    Hopper and the layouts allow (row-major, 16-byte rows; ``rows_whole``: a tile's rows are
    consecutive rows of A), else the tensors. ``B_T``: ``w`` is the transpose of a row-major matrix."""
    b_t = w.stride(0) == 1 and w.stride(1) != 1
    b = w.t() if b_t else w
    ok = (USE_TMA and rows_whole and _hopper(a.device) and a.is_contiguous()
          and b.is_contiguous() and all(t.shape[-1] * t.element_size() % 16 == 0 for t in (a, b)))
    if not ok:
        return a, w, False, b_t
    from triton.tools.tensor_descriptor import TensorDescriptor

    bk, bn = cfg["BLOCK_K"], cfg["BLOCK_N"]
    return (TensorDescriptor.from_tensor(a, [BLOCK_M, bk]),
            TensorDescriptor.from_tensor(b, [bn, bk] if b_t else [bk, bn]), True, b_t)


def _rank_rows(shape, dim: int) -> tuple[int, int]:
    """(outer, inner) of a shard's rows: the dims before ``dim``, and ``dim`` with those after but the last."""
    return math.prod(shape[:dim]), math.prod(shape[dim:-1])


def ag_gemm(x: torch.Tensor, ws: list[torch.Tensor], dim: int, name: str) -> list[torch.Tensor]:
    from .ring import group

    pg = group(name)
    rank, ranks = pg.rank(), pg.size()
    outer, inner = _rank_rows(x.shape, dim)
    rows, k = outer * inner, x.shape[-1]
    if not applies(rows, x.element_size()):
        raise ValueError(f"ag_gemm: {rows} rows per rank of {x.dtype} (tiles of {BLOCK_M} rows, bf16/fp16/fp32)")
    stacked = torch.empty((ranks, *x.shape), dtype=x.dtype, device=x.device)
    main = torch.cuda.current_stream(x.device)
    space = _space(name, x.device) if ranks > 1 else None
    if space is not None:
        h = space.reserve(x.numel() * x.element_size())
        h.barrier(channel=0)  # every peer has pulled the last call's shard from our buffer
        space.data(rank, x.shape, x.dtype).copy_(x)
        h.barrier(channel=1)  # every shard is in its rank's buffer
        space.side.wait_stream(main)
        with torch.cuda.stream(space.side):  # copy engines; enqueued before the product that waits on them
            for step in range(1, ranks):
                j = (rank + step) % ranks
                stacked[j].copy_(space.data(j, x.shape, x.dtype))
                _flag(space.flags, j)
    stacked[rank].copy_(x)
    a = stacked.view(ranks * rows, k)
    outs = []
    for w in ws:
        n = w.shape[1]
        c = torch.empty((ranks * rows, n), dtype=x.dtype, device=x.device)
        cfg = config(n, k)
        tiles = triton.cdiv(ranks * rows, BLOCK_M) * triton.cdiv(n, cfg["BLOCK_N"])
        A, B, tma, b_t = _operands(a, w, cfg, True)
        _ag_gemm_kernel[(_programs(tiles, x.device, ranks),)](
            A, B, c, space.flags if space else a, ranks * rows, n, k, *a.stride(), *w.stride(), *c.stride(),
            rank, ranks, inner, rows, WAIT=space is not None, PRECISION=_precision(x.dtype), TMA=tma, B_T=b_t,
            BLOCK_M=BLOCK_M, **cfg)
        outs.append(c)
    if space is not None:
        main.wait_stream(space.side)
        space.flags.zero_()
    shape = list(x.shape)
    shape[dim] *= ranks
    # the shards side by side along ``dim``: the stacked buffer itself where no dim precedes it
    return [(stacked if outer == 1 else stacked.movedim(0, dim)).reshape(shape), *outs]


def gemm_rs(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, shape: list[int], dim: int,
            name: str) -> torch.Tensor:
    from .ring import group

    pg = group(name)
    rank, ranks = pg.rank(), pg.size()
    local = list(shape)
    local[dim] //= ranks
    outer, inner = _rank_rows(local, dim)
    rows, k, n = outer * inner, a.shape[-1], w.shape[1]
    if not applies(rows, a.element_size()):
        raise ValueError(f"gemm_rs: {rows} rows per rank of {a.dtype} (tiles of {BLOCK_M} rows, bf16/fp16/fp32)")
    space = _space(name, a.device)
    h = space.reserve(ranks * rows * n * a.element_size())
    if ranks > 1:
        h.barrier(channel=0)  # every rank has summed the last call's slots
    cfg = config(n, k)
    tiles = triton.cdiv(ranks * rows, BLOCK_M) * triton.cdiv(n, cfg["BLOCK_N"])
    c2 = c.reshape(a.shape[0], n) if c is not None else a
    A, B, tma, b_t = _operands(a, w, cfg, inner % BLOCK_M == 0)
    _gemm_rs_kernel[(_programs(tiles, a.device, 1),)](
        A, B, c2, space.data_ptrs, space.ptrs, a.shape[0], n, k, *a.stride(), *w.stride(), *c2.stride(),
        rank, ranks, inner, rows, HAS_C=c is not None, PRECISION=_precision(a.dtype), TMA=tma, B_T=b_t,
        BLOCK_M=BLOCK_M, **cfg)
    out = torch.empty(local, dtype=a.dtype, device=a.device)
    recv = space.data(rank, (ranks, rows * n), a.dtype)
    expected = (rows // BLOCK_M) * triton.cdiv(n, cfg["BLOCK_N"])
    _reduce_kernel[(triton.cdiv(rows * n, 4096),)](recv, space.counts, out, rows * n, ranks, expected, BLOCK=4096)
    space.counts.zero_()
    return out
