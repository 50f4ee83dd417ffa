"""``shardwise bench``: shardwise and its peers on the same model, batch and precision, in one run
(runner.py says what each row measures; config.py which systems and options there are; peers.py how each
peer is built; plot.py draws the record)."""

from .config import SYSTEMS, BenchConfig, options
from .plot import label, plot
from .runner import bench, flops_per_token, over_ceiling, recompile_reasons, run_system

__all__ = ["SYSTEMS", "BenchConfig", "bench", "flops_per_token", "label", "options", "over_ceiling", "plot",
           "recompile_reasons", "run_system"]
