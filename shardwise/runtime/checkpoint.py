"""Sharded checkpoints of a job through ``torch.distributed.checkpoint`` (DCP), no format of our own.

``state_dict(job)`` describes what this rank holds as DTensors over the data-parallel axis of the
job's ``DeviceMesh``: each parameter with its whole shape (dim 0 cut as the shard layout cuts it,
``Shard(0)``, under zero1-3; ``Replicate()`` under ddp) and each tensor of its optimizer state alike,
plus the optimizer's hyperparameters and the job's step counter. DCP writes each rank's pieces
with their global offsets, so a checkpoint loads on any number of data-parallel ranks and under
any strategy: ``load_state_dict`` reads into the pieces the loading job holds, and DCP moves what
each rank needs. A 0-dim parameter is stored as shape ``(1,)``, as the layouts hold it.

``save(job, path)`` writes under a temporary name next to ``path`` and publishes it by rename once
DCP's metadata is written (rank 0, after every rank's write), so a crash mid-save leaves the
previous checkpoint at ``path`` as it was; ``load(job, path)`` checks that the checkpoint is
complete and of this model before it reads a tensor.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import CheckpointError

FORMAT = 1
"""What ``job.meta`` records; a checkpoint of another format is refused by name."""


def _mesh(job):
    dm = job.mesh.device_mesh
    return dm["dp"] if len(dm.mesh_dim_names) > 1 else dm


def _refuse(job) -> None:
    if job.tp is not None:
        raise NotImplementedError("checkpoints of tensor-parallel jobs are being built (issue 23): use "
                                  "job.full_state_dict() to export the whole weights for now")
    if job.state.streamer is not None:
        raise NotImplementedError("checkpoints under offload_optimizer are being built (issue 23): the "
                                  "optimizer state lives in host memory in chunks")


def _real(job, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of parameter ``name``'s (or its state's) whole value: the shard without padding."""
    lay = job.layouts[name]
    if job.strategy == "ddp":
        return t.reshape(lay.shape2)
    lo = job.mesh.rank("dp") * lay.rows
    n = max(0, min(lay.rows, lay.shape2[0] - lo))
    return t[:n]


def _dtensor(job, name: str, t: torch.Tensor) -> DTensor:
    lay = job.layouts[name]
    whole = torch.Size(lay.shape2)
    place = [Replicate()] if job.strategy == "ddp" else [Shard(0)]
    return DTensor.from_local(_real(job, name, t), _mesh(job), place, run_check=False, shape=whole,
                              stride=torch.empty(whole, device="meta").stride())


def _params(job) -> dict[str, torch.Tensor]:
    st = job.state
    return {n: (st.full[n] if job.strategy == "ddp" else st.master[n]) for n in st.names}


def _persistent_buffers(job) -> dict[str, torch.Tensor]:
    """The model's buffers that its ``state_dict`` holds (BatchNorm's statistics; not RoPE's tables)."""
    out = {}
    for prefix, mod in job.model.named_modules():
        for b, t in mod._buffers.items():
            if t is not None and b not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{b}" if prefix else b] = t
    return out


def state_dict(job) -> dict:
    """This rank's part of the job's state, for ``dcp.save`` (module docstring)."""
    _refuse(job)
    job.updater.drain()
    opt, st = job.optimizer, job.state
    by_tensor = {id(t): n for n, t in st.opt_tensors.items()}
    model = {n: _dtensor(job, n, t.detach()) for n, t in _params(job).items()}
    optim = {}
    for p, s in opt.state.items():
        name = by_tensor[id(p)]
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                optim[f"{name}.{k}"] = _dtensor(job, name, v)
            else:  # a step count: the same on every rank
                optim[f"{name}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    meta = {"format": FORMAT, "strategy": job.strategy, "ranks": job.mesh.dp, "steps": job.steps,
            "groups": groups, "optimizer": type(opt).__name__}
    try:  # one leaf: DCP keeps it whole (nested dicts it would cut into keys)
        meta = json.dumps(meta)
    except TypeError as e:
        raise TypeError(f"the optimizer's hyperparameters cannot be checkpointed ({e}): keep them numbers, "
                        "lists and strings") from None
    buffers = {n: t.detach() for n, t in _persistent_buffers(job).items()}  # the same on every rank
    return {"model": model, "buffers": buffers, "optim": optim, "meta": meta}


def load_state_dict(job, sd: dict) -> None:
    """Copy a loaded ``state_dict`` (one whose tensors ``dcp.load`` filled) into the job's state."""
    _refuse(job)
    st, opt = job.state, job.optimizer
    with torch.no_grad():
        for n, t in _params(job).items():
            _real(job, n, t).copy_(sd["model"][n].to_local())
        for p in st.opt_tensors.values():
            opt.state.pop(p, None)
        for n, p in st.opt_tensors.items():
            state = {}
            for key, v in sd["optim"].items():
                owner, _, k = key.rpartition(".")
                if owner != n:
                    continue
                if isinstance(v, DTensor):
                    full = torch.zeros_like(p)  # padding rows stay zero
                    _real(job, n, full).copy_(v.to_local())
                    state[k] = full
                else:
                    state[k] = v
            if state:
                opt.state[p] = state
        meta = json.loads(sd["meta"])
        for g, saved in zip(opt.param_groups, meta["groups"]):
            g.update({k: tuple(v) if isinstance(g.get(k), tuple) else v for k, v in saved.items()})
        for n, t in _persistent_buffers(job).items():
            t.copy_(sd["buffers"][n])
        st.sync_full_from_master(job.group, job.mesh.dp)
        if job.strategy in ("zero1", "zero2"):  # the frozen parameters' whole copies too (no update gathers them)
            for n in st.names:
                if not st.trainable[n]:
                    st.full[n].copy_(st.gather_full(n, job.group, job.mesh.dp).to(st.full[n].dtype))
    job.steps = meta["steps"]


def _template(job, meta: dict) -> dict:
    """The structure ``dcp.load`` fills: this job's pieces, the optimizer's state made for every key
    the checkpoint holds (a job that has taken no step has none yet)."""
    sd = state_dict(job)
    st = job.state
    for key in meta["optim_keys"]:
        name = key.rpartition(".")[0]
        if key in sd["optim"]:
            continue
        p = st.opt_tensors[name]
        if key in meta["sharded_keys"]:
            sd["optim"][key] = _dtensor(job, name, torch.zeros_like(p))
        else:
            sd["optim"][key] = torch.zeros((), dtype=torch.float32)
    sd["optim"] = {k: v for k, v in sd["optim"].items() if k in meta["optim_keys"]}
    return sd


def _check(job, path: str) -> dict:
    """The checkpoint's metadata, after checking that it is complete and of this model."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}: give the directory a save wrote")
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(f"the checkpoint at {path!r} is partial (no .metadata: its save did not finish); "
                              "load the one before it")
    try:
        md = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - a corrupt file, named
        raise CheckpointError(f"the checkpoint at {path!r} cannot be read ({type(e).__name__}: {e}); "
                              "its .metadata is corrupt: load another one") from None
    items = md.state_dict_metadata
    mine = {n: tuple(job.layouts[n].shape2) for n in job.state.names}
    saved = {k.split(".", 1)[1]: tuple(v.size) for k, v in items.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    wrong = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    if missing or extra or wrong:
        parts = [f"the model has {missing[:4]} the checkpoint lacks" if missing else "",
                 f"the checkpoint has {extra[:4]} the model lacks" if extra else "",
                 "shapes differ: " + ", ".join(f"{n} {saved[n]} saved, {mine[n]} here" for n in wrong[:4]) if wrong else ""]
        raise CheckpointError(f"the checkpoint at {path!r} is of another model: " + "; ".join(p for p in parts if p))
    optim_keys = [k.split(".", 1)[1] for k in items if k.startswith("optim.")]
    sharded = {k.split(".", 1)[1] for k, v in items.items() if k.startswith("optim.")
               and isinstance(v, TensorStorageMetadata) and len(v.size) > 0}
    if not isinstance(items.get("meta"), BytesStorageMetadata):
        raise CheckpointError(f"the directory {path!r} holds a DCP checkpoint that shardwise did not write "
                              "(no job metadata)")
    return {"optim_keys": optim_keys, "sharded_keys": sharded}


def save(job, path: str) -> str:
    """Write the job's state to the directory ``path`` (a collective), atomically: under
    ``<path>.partial`` first, renamed to ``path`` once complete (an older one there is replaced
    only then). Returns ``path``."""
    sd = state_dict(job)
    tmp = path.rstrip("/") + ".partial"
    rank = dist.get_rank()
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # what a crashed save left
    dist.barrier(job.ctrl)
    dcp.save(sd, checkpoint_id=tmp)
    dist.barrier(job.ctrl)  # every rank's pieces and the metadata written
    if rank == 0:
        old = path.rstrip("/") + ".old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    dist.barrier(job.ctrl)
    return path


def load(job, path: str) -> dict:
    """Load the checkpoint at ``path`` into the job (a collective), resharded to this job's ranks and
    strategy; returns its metadata (steps, strategy, ...)."""
    _refuse(job)
    meta = _check(job, path)
    sd = _template(job, meta)
    dcp.load(sd, checkpoint_id=path)
    saved = json.loads(sd["meta"])
    if saved.get("format") != FORMAT:
        raise CheckpointError(f"the checkpoint at {path!r} is of format {saved.get('format')!r}; this "
                              f"shardwise reads format {FORMAT}")
    if saved["optimizer"] != type(job.optimizer).__name__ or len(saved["groups"]) != len(job.optimizer.param_groups):
        raise CheckpointError(f"the checkpoint at {path!r} holds {saved['optimizer']} state of {len(saved['groups'])} "
                              f"parameter group(s); this job steps {type(job.optimizer).__name__} with "
                              f"{len(job.optimizer.param_groups)}: build the job with the same optimizer")
    load_state_dict(job, sd)
    return saved


class Checkpointing:
    """The checkpoint methods of ``Job`` (this module's functions on the job)."""

    def state_dict(self) -> dict:
        """This rank's part of the job's state for ``dcp.save``: each parameter and optimizer tensor a
        DTensor of its whole shape over the dp axis, the buffers, hyperparameters and step counter."""
        return state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Take the state ``dcp.load`` read into a ``state_dict()`` of this job."""
        load_state_dict(self, sd)

    def save(self, path: str) -> str:
        """Write a sharded checkpoint to the directory ``path`` (a collective), published by rename once
        complete, so a crash mid-save leaves an older checkpoint at ``path`` as it was."""
        return save(self, path)

    def load(self, path: str) -> dict:
        """Load the checkpoint at ``path`` (a collective), resharded to this job's dp ranks and strategy;
        returns what it recorded (steps, strategy, ranks). A missing, partial or foreign checkpoint, or
        one of another model, is a ``CheckpointError`` naming the directory and what differs."""
        return load(self, path)
