"""Placements per tensor per mesh axis and how a parameter is laid out in shards."""

from .placements import Partial, Replicate, Shard, ShardLayout

__all__ = ["Partial", "Replicate", "Shard", "ShardLayout"]
