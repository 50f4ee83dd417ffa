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
from .config import MixedPrecision
from .errors import (BatchMismatchError, BudgetError, CaptureError, CheckpointError, MeshError, OutsideStepError,
                     PlanMismatchError, RankFailure, RankMismatchError, ShardwiseError)
from .job import Job, compile
from .runtime.mesh import Mesh, mesh
from .sharding import Partial, Replicate, Shard
from .sharding.annotate import shard

__version__ = "0.1.0"
__all__ = ["BatchMismatchError", "BudgetError", "CaptureError", "CheckpointError", "Job", "Mesh", "MeshError", "MixedPrecision",
           "OutsideStepError", "Partial", "PlanMismatchError", "RankFailure", "RankMismatchError", "Replicate", "Shard", "ShardwiseError", "compile", "mesh", "models", "plan",
           "shard"]


def plan(model: str, cluster: str, **strategy):
    """Predict one training step of ``model`` (a preset or a Hugging Face config.json) on ``cluster``
    (e.g. ``"dgx-h100:32"``) under a strategy (planner.Strategy's fields: tp, pp, zero, micro_batch,
    global_batch, seq, recompute, ...), without a GPU: step time, memory per GPU, tokens/s, MFU.

    Example::

        >>> import shardwise as sw
        >>> est = sw.plan("llama3-8b", "dgx-h100:1", zero=3, micro_batch=1, seq=8192)
        >>> est.gpus, est.fits
        (8, True)
    """
    from .planner.clusters import cluster as make_cluster
    from .planner.estimate import Strategy, estimate
    from .planner.models import model as make_model

    return estimate(make_model(model), make_cluster(cluster), Strategy(**strategy))
