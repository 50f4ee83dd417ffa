"""Device meshes on torch.distributed: process-group set-up and the data-parallel axis."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def ensure_process_group() -> None:
    """Join the job's process group: torchrun's environment if present, else a one-rank gloo group."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        use_cuda = torch.cuda.is_available() and os.environ.get("SHARDWISE_BACKEND", "") != "gloo"
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo")
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@dataclass(frozen=True)
class Mesh:
    """The devices a job runs on, by named axis. Only a data-parallel axis ``dp`` exists so far."""

    device_mesh: DeviceMesh
    device: torch.device

    @property
    def dp(self) -> int:
        return self.device_mesh.size(0)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    @property
    def group_name(self) -> str:
        return self.group.group_name

    @property
    def rank(self) -> int:
        return self.device_mesh.get_local_rank("dp")

    def __str__(self) -> str:
        return f"mesh(dp={self.dp}, device={self.device.type}, backend={dist.get_backend(self.group)})"


def mesh(dp: int | None = None, device: str | torch.device | None = None) -> Mesh:
    """A mesh over every rank of the job, all on the ``dp`` axis.

    Starts the process group if none is running: from torchrun's environment (NCCL on GPUs,
    gloo on CPUs), or a one-rank gloo group in a plain single process.

    Example::

        >>> import shardwise as sw
        >>> m = sw.mesh(dp=1)
        >>> m.dp
        1
    """
    if dp is not None and (not isinstance(dp, int) or dp < 1):
        raise ValueError(f"mesh: dp must be a positive int, got {dp!r}")
    launch_hint = (
        f"launch with `torchrun --nproc-per-node {dp} ...`, or `shardwise train --nproc {dp}`, "
        "or call torch.distributed.init_process_group first"
    )
    if not dist.is_initialized() and dp not in (None, 1) and "RANK" not in os.environ:
        raise ValueError(f"mesh(dp={dp}) needs {dp} processes but this is a single process: {launch_hint}")
    ensure_process_group()
    ws = dist.get_world_size()
    if ws == 1 and dp not in (None, 1):
        raise ValueError(f"mesh(dp={dp}) needs {dp} processes but this job has one: {launch_hint}")
    if dp is None:
        dp = ws
    if dp != ws:
        raise ValueError(
            f"mesh(dp={dp}) does not cover the job: the world has {ws} ranks and dp is the only axis, "
            f"so dp must equal {ws} (or be omitted)"
        )
    backend = dist.get_backend()
    if device is None:
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    dm = init_device_mesh(device.type, (dp,), mesh_dim_names=("dp",))
    return Mesh(dm, device)
