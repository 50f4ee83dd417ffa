"""Device meshes on torch.distributed: process-group set-up and named mesh axes.

A mesh names its axes (``dp``, ``tp``, ...) outermost first, tensor parallel innermost so that its ranks are adjacent
(one node's GPUs); the product of the axis sizes is the world size. It is a torch ``DeviceMesh`` underneath, one process
group per axis."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import MeshError

AXES = ("dp", "ep", "tp")
"""Mesh axes in mesh order, outermost first (tensor parallel innermost: adjacent ranks)."""


INIT_TIMEOUT = 300.0
"""Seconds the ranks wait for each other to join the process group (torchtitan's default)."""


def ensure_process_group(init_timeout: float = INIT_TIMEOUT) -> None:
    """Join the job's process group: torchrun's environment if present, else a one-rank gloo group. Ranks that do not
    all join within ``init_timeout`` seconds are a ``MeshError`` saying how many joined and where; collectives keep
    torch's own (longer) timeout, as the job's watchdog holds its steps to the job's ``timeout``."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        use_cuda = torch.cuda.is_available() and os.environ.get("SHARDWISE_BACKEND", "") != "gloo"
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=init_timeout))
        except (RuntimeError, dist.DistError) as e:
            if "time" not in str(e).lower():
                raise
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            said = str(e).strip().splitlines()[0]
            raise MeshError(f"rank {os.environ['RANK']}: the {os.environ['WORLD_SIZE']} ranks did not all join the "
                            f"process group at {where} within init_timeout={init_timeout:g}s ({said}); start every "
                            "rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or raise init_timeout= "
                            "where starting takes longer") from None
        if hasattr(dist.distributed_c10d, "_set_pg_timeout"):  # the join's limit, not every collective's
            dist.distributed_c10d._set_pg_timeout(dist.default_pg_timeout)
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@dataclass(frozen=True)
class Mesh:
    """The devices a job runs on, by named axis (``AXES``, outermost first)."""

    device_mesh: DeviceMesh
    device: torch.device

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.device_mesh.mesh_dim_names)

    @property
    def shape(self) -> dict[str, int]:
        """Size of each axis, outermost first."""
        return {a: self.device_mesh.size(i) for i, a in enumerate(self.axes)}

    def size(self, axis: str) -> int:
        """Ranks along ``axis`` (1 for an axis the mesh does not have)."""
        return self.shape.get(axis, 1)

    def group(self, axis: str = "dp") -> dist.ProcessGroup:
        """The process group of this rank's line along ``axis``."""
        if axis not in self.axes:
            raise MeshError(f"the mesh has no {axis!r} axis (its axes: {', '.join(self.axes)})")
        return self.device_mesh.get_group(axis)

    def rank(self, axis: str = "dp") -> int:
        """This rank's coordinate along ``axis``."""
        return self.device_mesh.get_local_rank(axis) if axis in self.axes else 0

    @property
    def dp(self) -> int:
        """Ranks on the data-parallel axis."""
        return self.size("dp")

    @property
    def batch_ranks(self) -> int:
        """Ranks that each take a batch of their own: the dp and ep axes (a tp group shares one)."""
        return self.size("dp") * self.size("ep")

    def batch_rank(self) -> int:
        """Which of the ``batch_ranks`` batches this rank takes."""
        return self.rank("dp") * self.size("ep") + self.rank("ep")

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group(self.axes[0]))

    def __str__(self) -> str:
        axes = ", ".join(f"{a}={n}" for a, n in self.shape.items())
        return f"mesh({axes}, device={self.device.type}, backend={self.backend})"


def mesh(dp: int | None = None, tp: int | None = None, ep: int | None = None,
         device: str | torch.device | None = None, init_timeout: float = INIT_TIMEOUT) -> Mesh:
    """A mesh over every rank of the job, by named axes; their product must be the world size. An
    axis left out is 1, but ``dp`` takes the ranks the others leave.

    Starts the process group if none is running: from torchrun's environment (NCCL on GPUs,
    gloo on CPUs), or a one-rank gloo group in a plain single process; ranks that do not all join
    within ``init_timeout`` seconds get an error that says so.

    Example::

        >>> import shardwise as sw
        >>> m = sw.mesh(dp=1)
        >>> m.dp, m.axes
        (1, ('dp',))
    """
    given = {"dp": dp, "ep": ep, "tp": tp}
    for a, n in given.items():
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise MeshError(f"mesh: {a} must be a positive int, got {n!r}")
    want = math.prod(n for n in given.values() if n is not None)
    launch_hint = (f"launch with `torchrun --nproc-per-node {want} ...`, or `shardwise train --nproc {want}`, "
                   "or call torch.distributed.init_process_group first")
    described = ", ".join(f"{a}={n}" for a, n in given.items() if n is not None)
    if not dist.is_initialized() and want != 1 and "RANK" not in os.environ:
        raise MeshError(f"mesh({described}) needs {want} processes but this is a single process: {launch_hint}")
    if not init_timeout > 0:
        raise MeshError(f"mesh: init_timeout must be a positive number of seconds, got {init_timeout!r}")
    ensure_process_group(init_timeout)
    ws = dist.get_world_size()
    if ws == 1 and want != 1:
        raise MeshError(f"mesh({described}) needs {want} processes but this job has one: {launch_hint}")
    others = math.prod(n for a, n in given.items() if a != "dp" and n is not None)
    if dp is None:
        if ws % others:
            raise MeshError(f"mesh({described}): the other axes take {others} ranks, which does not divide the "
                            f"job's {ws}")
        dp = ws // others
    if dp * others != ws:
        raise MeshError(f"mesh({described}) does not cover the job: the world has {ws} ranks and the axes multiply "
                        f"to {dp * others}, so dp must equal {ws // others if ws % others == 0 else 'a divisor'} "
                        "(or be omitted)")
    backend = dist.get_backend()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    device, sizes = torch.device(device), {"dp": dp, "ep": ep or 1, "tp": tp or 1}
    names = tuple(a for a in AXES if a == "dp" or given[a] is not None)
    return Mesh(init_device_mesh(device.type, tuple(sizes[a] for a in names), mesh_dim_names=names), device)
