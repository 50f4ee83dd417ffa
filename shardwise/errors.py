"""Every error shardwise raises for something a user did or can change, each naming the rule and the values.

They subclass the built-in type a caller would catch anyway (``ValueError`` for bad input, ``RuntimeError`` for a step
that cannot go on), so ``except ValueError`` keeps working."""

from __future__ import annotations


class ShardwiseError(Exception):
    """Base of shardwise's own errors."""


class CaptureError(ShardwiseError, RuntimeError):
    """The training step could not be traced into one graph (the construct and where it is named)."""


class BudgetError(ShardwiseError, ValueError):
    """The step does not fit the memory budget even with every parameter sharded (the numbers named)."""


class MeshError(ShardwiseError, ValueError):
    """A mesh that does not cover the job's ranks, or an axis this version does not run yet."""


class BatchMismatchError(ShardwiseError, ValueError):
    """Ranks passed batches of different structure, shapes or dtypes in one step."""


class PlanMismatchError(ShardwiseError, RuntimeError):
    """Ranks compiled different graphs or plans (or one failed to compile): every rank stops."""


class CheckpointError(ShardwiseError, ValueError):
    """A checkpoint that cannot be loaded into this job: missing, partial, foreign, or of another model."""


class OutsideStepError(ShardwiseError, RuntimeError):
    """The job's model or optimizer was trained outside ``job.step`` (which would not train right)."""


class RankFailure(ShardwiseError, RuntimeError):
    """Another rank failed, stalled, died or is doing something else (named, with the step)."""


class RankMismatchError(ShardwiseError, RuntimeError):
    """Ranks called different methods of the job, or different numbers of steps, at one point."""


def size_text(n: float) -> str:
    """Bytes in the largest unit (up to GiB) of which there is at least one: messages never say 0.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


__all__ = ["BatchMismatchError", "BudgetError", "CaptureError", "CheckpointError", "MeshError", "OutsideStepError", "PlanMismatchError",
           "RankFailure", "RankMismatchError", "ShardwiseError"]
