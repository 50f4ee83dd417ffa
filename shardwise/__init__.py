"""shardwise: a compiler for distributed PyTorch training.

Trace the single-device step whole, shard it over a device mesh, insert the collectives, run it.

Example::

    >>> import torch, shardwise as sw
    >>> model = sw.models.build("llama", "tiny")
    >>> job = sw.compile(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), strategy="zero3",
    ...                  mesh=sw.mesh(dp=1))
    >>> x = torch.randint(0, 64, (2, 16))
    >>> loss = job.step((x, x))
"""

from . import models
from .job import Job, MixedPrecision, compile
from .runtime.mesh import Mesh, mesh

__version__ = "0.1.0"
__all__ = ["Job", "Mesh", "MixedPrecision", "compile", "mesh", "models"]
