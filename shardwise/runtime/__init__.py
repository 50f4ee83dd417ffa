"""Runs compiled steps: process groups and meshes, rank agreement, this rank's state and optimizer, the
executor, the update, offload, the custom ops the passes insert, profiling."""

from .mesh import Mesh, ensure_process_group, mesh
from .state import ELEMENTWISE_OPTIMIZERS, ShardedState

__all__ = ["ELEMENTWISE_OPTIMIZERS", "Mesh", "ShardedState", "ensure_process_group", "mesh"]
