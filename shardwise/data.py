"""Training data for the CLI: a deterministic synthetic token stream, or bytes of any text file.

Every rank draws its own batches: batch ``(step, rank)`` is a pure function of the seed, so runs repeat exactly and no
two ranks see the same sample."""

from __future__ import annotations

import os

import numpy as np
import torch


class SyntheticStream:
    """Sequences from a fixed random bigram "language" with a few likely successors per token.

    Its entropy is far below ``log(vocab)``, so a model's loss falls visibly within a few dozen steps."""

    def __init__(self, vocab: int, seq: int, batch: int, seed: int = 0, branching: int = 4):
        self.succ = torch.randint(0, vocab, (vocab, branching), generator=torch.Generator().manual_seed(seed))
        self.vocab, self.seq, self.batch, self.seed = vocab, seq, batch, seed

    def get(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed + 1) * 1_000_003 + step * 65_537 + rank)
        tok = torch.empty(self.batch, self.seq + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, self.vocab, (self.batch,), generator=g)
        choice = torch.randint(0, self.succ.shape[1], (self.batch, self.seq), generator=g)
        for t in range(self.seq):
            tok[:, t + 1] = self.succ[tok[:, t], choice[:, t]]
        return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


class ByteFile:
    """Byte-level windows (vocab 256) from a text file; rank r samples from the r-th of ws equal slices."""

    def __init__(self, path: str, seq: int, batch: int, rank: int, ws: int, seed: int = 0):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--data {path!r}: no such file")
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        n = len(self.data)
        need = ws * (seq + 2)
        if n < need:
            raise ValueError(f"--data {path!r} has {n} bytes; {ws} ranks with sequences of {seq} need at least "
                             f"{need} (use a larger file or a smaller --seq)")
        per = n // ws
        self.lo, self.hi = rank * per, (rank + 1) * per
        self.seq, self.batch, self.seed, self.rank = seq, batch, seed, rank

    def get(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = np.random.default_rng([self.seed, step, rank])
        starts = g.integers(self.lo, self.hi - self.seq - 1, size=self.batch)
        tok = torch.from_numpy(np.stack([self.data[s : s + self.seq + 1] for s in starts]).astype(np.int64))
        return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
