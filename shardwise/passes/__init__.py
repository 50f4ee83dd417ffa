"""Graph rewrites, one file each. ``pipeline.shard_step`` runs them in order (pipeline.py says why that
order) and turns the captured single-device step into this rank's program."""

from .pipeline import CAP_FACTORS, CAP_TIE, MODES, STRATEGIES, shard_step
from .program import Program, ShardContext

__all__ = ["CAP_FACTORS", "CAP_TIE", "MODES", "STRATEGIES", "Program", "ShardContext", "shard_step"]
