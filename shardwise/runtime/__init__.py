"""Runs compiled steps: process groups and meshes, this rank's state and optimizer, executors."""

from .mesh import Mesh, ensure_process_group, mesh
from .state import ELEMENTWISE_OPTIMIZERS, ShardedState

__all__ = ["ELEMENTWISE_OPTIMIZERS", "Mesh", "ShardedState", "ensure_process_group", "mesh"]
