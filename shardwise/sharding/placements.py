"""Placement value types used in plans and plan dumps: how a tensor lies along one mesh axis."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """Split along tensor dim ``dim`` into equal, zero-padded pieces, one per rank of the axis.

    With ``groups`` > 1 the dim is that many equal blocks (the q, k and v of a fused product's output;
    the sequences of a batch flattened into rows), each split into per-rank pieces: a rank holds its
    piece of every block, side by side in block order.

        >>> import torch
        >>> x = torch.arange(12)
        >>> Shard(0, groups=3).local(x, 1, 2).tolist()
        [2, 3, 6, 7, 10, 11]
        >>> pieces = torch.cat([Shard(0, groups=3).local(x, r, 2) for r in range(2)])
        >>> torch.equal(Shard(0, groups=3).whole(pieces, 2), x)
        True
    """

    dim: int = 0
    groups: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.groups == 1 else f"S({self.dim})x{self.groups}"

    def moved(self, dim: int) -> Shard:
        """The same cut of a dim that is now ``dim``."""
        return Shard(dim, self.groups)

    def local(self, full: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
        """This rank's piece of ``full`` (a new tensor)."""
        return torch.cat([b.chunk(ranks, self.dim)[rank] for b in full.chunk(self.groups, self.dim)], self.dim)

    def whole(self, pieces: torch.Tensor, ranks: int) -> torch.Tensor:
        """The full tensor from the ranks' pieces concatenated in rank order along the dim."""
        if self.groups == 1:
            return pieces
        parts = [p.chunk(self.groups, self.dim) for p in pieces.chunk(ranks, self.dim)]
        return torch.cat([parts[r][b] for b in range(self.groups) for r in range(ranks)], self.dim)

    def indices(self, size: int, rank: int, ranks: int) -> torch.Tensor:
        """The indices into a dim of ``size`` entries that this rank's piece holds."""
        return torch.arange(size).view(self.groups, ranks, -1)[:, rank].reshape(-1)


@dataclass(frozen=True)
class Replicate:
    """A full copy on every rank of the axis."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a summand (or, for ``avg``, a term of the mean); a reduction is pending."""

    op: str = "sum"

    def __str__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


@dataclass(frozen=True)
class ShardLayout:
    """A parameter of ``shape`` stored as padded ``Shard(0)`` over the ``ranks`` of a mesh axis (as FSDP2 stores it).

    Dim 0 is padded up to a multiple of ``ranks``; rank r holds rows ``[r*rows, (r+1)*rows)``. A 0-dim parameter is
    treated as shape ``(1,)``. Padding rows are zeros and stay zero under elementwise optimizers (zero gradient, zero
    state)."""

    shape: tuple[int, ...]
    ranks: int

    def __post_init__(self):
        if self.ranks < 1:
            raise ValueError(f"ShardLayout: ranks must be >= 1, got {self.ranks}")

    @property
    def shape2(self) -> tuple[int, ...]:
        return tuple(self.shape) if len(self.shape) else (1,)

    @property
    def rows(self) -> int:
        return math.ceil(self.shape2[0] / self.ranks)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.rows, *self.shape2[1:])

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return (self.rows * self.ranks, *self.shape2[1:])

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def pad_rows(self) -> int:
        return self.rows * self.ranks - self.shape2[0]

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's piece of ``full`` as a new contiguous tensor (padding rows zero)."""
        full = full.reshape(self.shape2)
        out, lo = full.new_zeros(self.local_shape), rank * self.rows
        hi = min(lo + self.rows, self.shape2[0])
        if hi > lo:
            out[: hi - lo].copy_(full[lo:hi])
        return out

    def unshard(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full tensor from the ``padded_shape`` concatenation of all shards."""
        return gathered[: self.shape2[0]].reshape(self.shape)

    def __str__(self) -> str:
        return str(Shard(0))
