"""Sharded checkpoints of a job through ``torch.distributed.checkpoint`` (DCP), no format of our own.

``state_dict(job)`` describes what this rank holds as DTensors over the data-parallel axis of the job's ``DeviceMesh``:
each parameter with its whole shape (``Shard(0)`` under zero1-3, ``Replicate()`` under ddp) and each tensor of its
optimizer state alike, plus the optimizer's hyperparameters and the job's step counter. Under a tp axis, and for a state
held in host memory (offload), each tensor is ``Pieces`` (below). DCP writes each rank's blocks with their global
offsets, so a checkpoint loads on any mesh and under any strategy. A tp job before its first step holds its state whole
on the tp axis (the tp plan comes from the first step's graph): it loads so, and ``Job._shard_tp`` cuts it at that step.
A 0-dim parameter is stored as shape ``(1,)``, as the layouts hold it.

``save(job, path)`` writes under a temporary name next to ``path``, which rank 0 renames to ``path`` once every rank's
files and DCP's metadata are written, so a crash mid-save leaves the previous checkpoint as it was; ``load(job, path)``
checks that the checkpoint is complete and of this model before it reads a tensor. ``blocking=False`` saves through
DCP's ``async_save``: the step waits only for the copy to host memory, the files are written on a thread.

Beside the job's own state a checkpoint holds each rank's RNG states (torch, CUDA, Python, NumPy: restored when the
loading job has as many ranks) and ``extra``: objects of the training loop (an LR scheduler, a data position), each a
``state_dict()``/``load_state_dict()`` object or a plain value, the same on every rank."""

from __future__ import annotations

import io
import itertools
import json
import os
import random
import shutil
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import CheckpointError
from .watchdog import watched

FORMAT = 1
"""What ``job.meta`` records; a checkpoint of another format is refused by name."""


class Pieces:
    """A tensor of whole shape ``size`` of which this rank holds ``chunks``: (global offsets, view of the
    job's own storage) each. A tensor cut on tp as well as dp: a tp shard of a fused q/k/v weight is several
    blocks of the whole, and the dp cut of a tp shard is not the dp cut of the whole, which no DTensor
    placement says. DCP plans from the chunks (``__create_write_items__``, ``__create_chunk_list__``);
    ``SavePlanner`` and ``LoadPlanner`` find a chunk by its offsets."""

    def __init__(self, size: tuple[int, ...], chunks: list[tuple[torch.Size, torch.Tensor]]):
        self.whole, self.chunks = torch.Size(size), chunks

    def size(self) -> torch.Size:
        return self.whole

    def at(self, offsets) -> torch.Tensor:
        for off, t in self.chunks:
            if off == offsets:
                return t
        raise KeyError(f"internal: no piece at {tuple(offsets)} of a tensor of shape {tuple(self.whole)}")

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self.chunks]

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(t),
                                                      size=self.whole))
                for chunk, (_, t) in zip(self.__create_chunk_list__(), self.chunks)]


class SavePlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner, which also writes the chunks of a ``Pieces``."""

    def lookup_object(self, index):
        obj = self.state_dict.get(index.fqn)
        return obj.at(index.offset) if isinstance(obj, Pieces) else super().lookup_object(index)


class LoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, which also reads into the chunks of a ``Pieces``."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up puts None in place of every object of a type it does not know: it is given a
        # copy of the structure with a stand-in tensor for each Pieces, swapped back once flattened
        back: dict[int, Pieces] = {}

        def shield(obj):
            if isinstance(obj, dict):
                return {k: shield(v) for k, v in obj.items()}
            if isinstance(obj, Pieces):
                stand = torch.empty(0)
                back[id(stand)] = obj
                return stand
            return obj

        super().set_up_planner(shield(state_dict), metadata, is_coordinator)
        self.original_state_dict = state_dict  # where the bytes read are put
        self.state_dict = {k: back.get(id(v), v) for k, v in self.state_dict.items()}

    def lookup_tensor(self, index):
        obj = self.state_dict.get(index.fqn)
        return obj.at(index.offset) if isinstance(obj, Pieces) else super().lookup_tensor(index)


def _runs(glob: torch.Tensor) -> list[tuple[int, int, int]]:
    """(position, global index, length) of each run of consecutive global indices in ``glob``."""
    if len(glob) == 0:
        return []
    starts = [0, *(torch.nonzero(glob[1:] - glob[:-1] != 1).flatten() + 1).tolist(), len(glob)]
    return [(a, int(glob[a]), b - a) for a, b in itertools.pairwise(starts)]


def _whole(job, name: str) -> tuple[int, ...]:
    """The whole shape of parameter ``name`` as a checkpoint stores it (a 0-dim one as ``(1,)``)."""
    shape, tp = list(job.layouts[name].shape2), job.state.tp
    return tuple(n * (tp.factor(name, d) if tp is not None else 1) for d, n in enumerate(shape))


def _holdings(job, name: str, t: torch.Tensor) -> list[tuple[torch.Size, torch.Tensor]]:
    """(global offsets, view of ``t``) of each block of the whole tensor that ``t``, held as parameter
    ``name`` is held on this rank, has: its real dp rows of this rank's tp shard, cut where the tp
    shard's indices into the whole jump (between the q, k and v blocks of a fused weight)."""
    real, tp = _real(job, name, t), job.state.tp
    lo = 0 if job.strategy == "ddp" else job.mesh.rank("dp") * job.layouts[name].rows
    whole = _whole(job, name)
    at = tp.along(name, whole) if tp is not None else [None] * len(whole)
    pos = [torch.arange(n) + (lo if i == 0 else 0) for i, n in enumerate(real.shape)]  # in the tp shard
    runs = [_runs(at[i][p] if at[i] is not None else p) for i, p in enumerate(pos)]
    out = []
    for combo in itertools.product(*runs):
        view = real
        for i, (at, _, n) in enumerate(combo):
            view = view.narrow(i, at, n)
        out.append((torch.Size([g for _, g, _ in combo]), view))
    return out


def _sharded(job, name: str, t: torch.Tensor):
    """``t`` (held as parameter ``name`` is) as this rank's part of the whole tensor: a DTensor over the dp axis, or
    ``Pieces`` under a tp axis or off the mesh's device (offloaded state, which a DTensor would copy to the device)."""
    return (_dtensor(job, name, t) if job.state.tp is None and t.device.type == job.mesh.device.type
            else Pieces(_whole(job, name), _holdings(job, name, t)))


def _copy_in(job, name: str, dest: torch.Tensor, loaded) -> None:
    """Copy what ``dcp.load`` read into ``loaded`` (a ``_sharded`` of ``dest`` or of its twin) into ``dest``."""
    if isinstance(loaded, DTensor):
        _real(job, name, dest).copy_(loaded.to_local())
        return
    for (_, view), (_, got) in zip(_holdings(job, name, dest), loaded.chunks):
        if view.data_ptr() != got.data_ptr():
            view.copy_(got)


def _real(job, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of parameter ``name``'s (or its state's) whole value: the shard without padding."""
    lay = job.layouts[name]
    return (t.reshape(lay.shape2) if job.strategy == "ddp"
            else t[:max(0, min(lay.rows, lay.shape2[0] - job.mesh.rank("dp") * lay.rows))])


def _dtensor(job, name: str, t: torch.Tensor) -> DTensor:
    whole, dm = torch.Size(job.layouts[name].shape2), job.mesh.device_mesh
    place = [Replicate()] if job.strategy == "ddp" else [Shard(0)]
    return DTensor.from_local(_real(job, name, t), dm["dp"] if len(dm.mesh_dim_names) > 1 else dm, place,
                              run_check=False, shape=whole, stride=torch.empty(whole, device="meta").stride())


def _params(job) -> dict[str, torch.Tensor]:
    st = job.state
    return {n: (st.full[n] if job.strategy == "ddp" else st.master[n]) for n in st.names}


def _persistent_buffers(job) -> dict[str, torch.Tensor]:
    """The model's buffers that its ``state_dict`` holds (BatchNorm's statistics; not RoPE's tables)."""
    return {f"{prefix}.{b}" if prefix else b: t for prefix, mod in job.model.named_modules()
            for b, t in mod._buffers.items() if t is not None and b not in mod._non_persistent_buffers_set}


def _pack(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in st["python"]))
    kind, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def state_dict(job, extra: dict | None = None) -> dict:
    """This rank's part of the job's state, for ``dcp.save`` (module docstring)."""
    job.updater.drain()
    opt, st = job.optimizer, job.state
    by_tensor = {id(t): n for n, t in st.opt_tensors.items()}
    model, optim = {n: _sharded(job, n, t.detach()) for n, t in _params(job).items()}, {}
    for p, s in opt.state.items():
        name = by_tensor[id(p)]
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                optim[f"{name}.{k}"] = _sharded(job, name, v)
            else:  # a step count: the same on every rank
                optim[f"{name}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    meta = {"format": FORMAT, "strategy": job.strategy, "ranks": job.mesh.dp, "tp": job.mesh.size("tp"), "world": dist.get_world_size(),
            "steps": job.steps, "groups": groups, "optimizer": type(opt).__name__, "extra": sorted(extra or {})}
    try:  # one leaf: DCP keeps it whole (nested dicts it would cut into keys)
        meta = json.dumps(meta)
    except TypeError as e:
        raise TypeError(f"the optimizer's hyperparameters cannot be checkpointed ({e}): keep them numbers, "
                        "lists and strings") from None
    buffers = {n: t.detach() for n, t in _persistent_buffers(job).items()}  # the same on every rank
    try:
        packed = _pack({k: v.state_dict() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict") else v
                        for k, v in (extra or {}).items()})
    except Exception as e:  # noqa: BLE001 - named
        raise TypeError(f"extra= of a checkpoint holds what torch.save cannot write ({e}): give objects with "
                        "state_dict()/load_state_dict(), tensors, numbers, strings, lists and dicts") from None
    return {"model": model, "buffers": buffers, "optim": optim, "meta": meta, "extra": packed,
            f"rng.{dist.get_rank()}": _pack(_rng_state())}


def load_state_dict(job, sd: dict, extra: dict | None = None) -> dict:
    """Copy a loaded ``state_dict`` (one whose tensors ``dcp.load`` filled) into the job's state, and
    the training loop's objects saved beside it into ``extra``'s; returns the saved extra values."""
    st, opt = job.state, job.optimizer
    with torch.no_grad():
        for n, t in _params(job).items():
            _copy_in(job, n, t, sd["model"][n])
        saved_state: dict[str, dict] = {}
        for key, v in sd["optim"].items():
            owner, _, k = key.rpartition(".")
            saved_state.setdefault(owner, {})[k] = v
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        for n, p in st.opt_tensors.items():
            _take_state(job, n, p, saved_state.get(n, {}), group_of[id(p)])
        if st.streamer is not None:  # the device shards the step reads, from the host masters
            for n, c in st.compute.items():
                c.copy_(st.master[n].detach())
        meta = json.loads(sd["meta"])
        for g, saved in zip(opt.param_groups, meta["groups"]):
            g.update({k: tuple(v) if isinstance(g.get(k), tuple) else v for k, v in saved.items()})
        for n, t in _persistent_buffers(job).items():
            t.copy_(sd["buffers"][n])
        saved_extra = _load_extra(sd, extra)
        st.sync_full_from_master(job.group, job.mesh.dp)
        if job.strategy in ("zero1", "zero2"):  # the frozen parameters' whole copies too (no update gathers them)
            for n in st.names:
                if not st.trainable[n]:
                    st.full[n].copy_(st.gather_full(n, job.group, job.mesh.dp).to(st.full[n].dtype))
        if (job.tp or job.ep) is not None and st.tp is None:
            # before the first step: the model's whole weights, which its tp (ep) shards are cut from
            for n, p in job.model.named_parameters():
                p.copy_(st.gather_full(n, job.group, job.mesh.dp).reshape(p.shape))
    job.steps = meta["steps"]
    rng = sd.get(f"rng.{dist.get_rank()}")
    if rng is not None and meta.get("world") == dist.get_world_size():
        _set_rng_state(_unpack(rng))
    elif meta.get("world") != dist.get_world_size() and dist.get_rank() == 0:
        warnings.warn(f"the checkpoint was saved by {meta.get('world')} ranks and is loaded by "
                      f"{dist.get_world_size()}: its per-rank RNG states (dropout, sampling) are not carried "
                      "over; each rank keeps its own generator's state", stacklevel=3)
    return saved_extra


def _take_state(job, name: str, p: torch.Tensor, saved: dict, group: dict) -> None:
    """The optimizer state of ``p`` (parameter ``name``'s) from what a checkpoint held: copied into the
    tensors it has (an offloaded state's pinned host buffers, which the host update shares; a fused
    kernel's device step counts), else placed as torch's ``Optimizer.load_state_dict`` places state."""
    opt, streamer = job.optimizer, job.state.streamer
    if not saved:  # saved before its first step
        if streamer is None:
            opt.state.pop(p, None)
        else:  # offloaded Adam's state is made up front: back to what a first step finds
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    v.zero_()
        return
    cur = opt.state[p]
    for k in [k for k in cur if k not in saved]:
        del cur[k]
    for k, v in saved.items():
        old = cur.get(k)
        if isinstance(v, (DTensor, Pieces)):
            if not (isinstance(old, torch.Tensor) and old.shape == p.shape and old.dtype == p.dtype):
                old = (streamer._to_host(p) if streamer is not None and p.device.type == "cpu"
                       else torch.empty_like(p)).zero_()  # padding rows stay zero
            _copy_in(job, name, old, v)
            cur[k] = old
        elif isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == v.shape:
            old.copy_(v)
        elif isinstance(v, torch.Tensor) and k == "step" and (group.get("fused") or group.get("capturable")):
            cur[k] = v.to(device=p.device, dtype=torch.float32)
        else:
            cur[k] = v


def _load_extra(sd: dict, extra: dict | None) -> dict:
    saved = _unpack(sd["extra"]) if isinstance(sd.get("extra"), bytes) else {}
    if missing := sorted(set(extra or {}) - set(saved)):
        raise CheckpointError(f"the checkpoint holds no {missing} (it saved extra={sorted(saved)}): save them "
                              "with job.save(path, extra=...) or leave them out of load")
    for k, obj in (extra or {}).items():
        if hasattr(obj, "load_state_dict"):
            obj.load_state_dict(saved[k])
    return saved


def _template(job, meta: dict) -> dict:
    """The structure ``dcp.load`` fills: this job's pieces, the optimizer's state made for every key
    the checkpoint holds (a job that has taken no step has none yet)."""
    sd = state_dict(job)
    for key in [k for k in meta["optim_keys"] if k not in sd["optim"]]:
        name = key.rpartition(".")[0]
        sd["optim"][key] = (_sharded(job, name, torch.zeros_like(job.state.opt_tensors[name]))
                            if key in meta["sharded_keys"] else torch.zeros((), dtype=torch.float32))
    sd["optim"] = {k: v for k, v in sd["optim"].items() if k in meta["optim_keys"]}
    for k in [k for k in sd if k.startswith("rng.") and k not in meta["top"]]:
        del sd[k]  # saved by fewer ranks: this rank has no state to take
    if "extra" not in meta["top"]:
        del sd["extra"]
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
    items, mine = md.state_dict_metadata, {n: _whole(job, n) for n in job.state.names}
    saved = {k.split(".", 1)[1]: tuple(v.size) for k, v in items.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    wrong = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    if missing or extra or wrong:
        parts = [f"the model has {missing[:4]} the checkpoint lacks" if missing else "",
                 f"the checkpoint has {extra[:4]} the model lacks" if extra else "",
                 "shapes differ: " + ", ".join(f"{n} {saved[n]} saved, {mine[n]} here" for n in wrong[:4]) if wrong else ""]
        raise CheckpointError(f"the checkpoint at {path!r} is of another model: " + "; ".join(p for p in parts if p))
    if not isinstance(items.get("meta"), BytesStorageMetadata):
        raise CheckpointError(f"the directory {path!r} holds a DCP checkpoint that shardwise did not write "
                              "(no job metadata)")
    sharded = {k.split(".", 1)[1] for k, v in items.items() if k.startswith("optim.")
               and isinstance(v, TensorStorageMetadata) and len(v.size) > 0}
    return {"optim_keys": [k.split(".", 1)[1] for k in items if k.startswith("optim.")], "sharded_keys": sharded,
            "top": {k if k.startswith("rng.") else k.split(".")[0] for k in items}}


def _publish(tmp: str, path: str) -> None:
    """Rank 0, once every rank's pieces and DCP's metadata are written: ``tmp`` becomes ``path``
    (an older checkpoint there is replaced whole, never left half)."""
    old = path.rstrip("/") + ".old"
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    if os.path.exists(old):
        shutil.rmtree(old)


class PendingSave:
    """A save whose files are still being written on a thread (``save(..., blocking=False)``).
    ``wait()`` returns the path once rank 0 has published it (every rank's files are written then)."""

    def __init__(self, future, tmp: str, path: str, publish: bool, stall_s: float, staged=None):
        self.path, self.stall_s, self.error = path, stall_s, None
        """``stall_s``: how long the caller waited (planning; the copy to host memory where not overlapped)."""
        self._future, self.staged = future, staged
        """``staged``: done once the state is copied to host memory (the next update waits for it)."""
        if publish:
            future.add_done_callback(lambda f: self._publish(f, tmp))

    def _publish(self, f, tmp: str) -> None:
        try:
            f.result()
            _publish(tmp, self.path)
        except BaseException as e:  # noqa: BLE001 - given to wait()
            self.error = e

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> str:
        self._future.result()
        if self.error is not None:
            raise self.error
        return self.path


class HostStager:
    """DCP's ``AsyncStager`` for a job: this rank's pieces copied into host buffers kept across saves (pinned
    on CUDA, on their own stream, beside the next step; the update waits for it, ``wait_staged``). DCP's
    own stagers deep-copy the state each save, synchronously, and torch 2.11's cannot copy a DTensor."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pool = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.host.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
        return buf.copy_(t, non_blocking=self.cuda)

    def _stage(self, obj, key: str = ""):
        if isinstance(obj, dict):
            return {k: self._stage(v, f"{key}.{k}") for k, v in obj.items()}
        if isinstance(obj, DTensor):
            return DTensor.from_local(self._copy(key, obj.to_local()), obj.device_mesh, obj.placements,
                                      run_check=False, shape=obj.shape, stride=obj.stride())
        if isinstance(obj, Pieces):
            return Pieces(obj.whole, [(off, self._copy(f"{key}@{tuple(off)}", t)) for off, t in obj.chunks])
        return self._copy(key, obj) if isinstance(obj, torch.Tensor) else obj

    def stage(self, state_dict: dict):
        if not self.cuda:
            return self._stage(state_dict)  # host to host: copied before the step goes on
        from concurrent.futures import ThreadPoolExecutor

        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            staged = self._stage(state_dict)
            done = self.stream.record_event()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardwise-stage")
        return self.pool.submit(lambda: (done.synchronize(), staged)[1])


def wait_staged(job) -> None:
    """Before the state changes (the update; a forward that writes buffers): the last async save's copy is done."""
    pending = getattr(job, "_pending_save", None)
    if pending is not None and pending.staged is not None:
        pending.staged.result()
        pending.staged = None


def wait_saves(job) -> None:
    """Wait for the job's save still being written, and (every rank) for its publication."""
    pending, job._pending_save = getattr(job, "_pending_save", None), None
    if pending is not None:
        pending.wait()
        dist.barrier(job.ctrl)  # rank 0's rename is done before any rank reads or writes it again


def save(job, path: str, extra: dict | None = None, blocking: bool = True):
    """``Job.save``: written under ``<path>.partial``, renamed to ``path`` once complete. Returns ``path``, or
    with ``blocking=False`` a ``PendingSave`` (the next save, load or ``job.wait_saves()`` waits for it)."""
    wait_saves(job)
    t0 = time.perf_counter()
    sd = state_dict(job, extra)
    tmp, rank = path.rstrip("/") + ".partial", dist.get_rank()
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(tmp)), exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # what a crashed save left
    dist.barrier(job.ctrl)
    if not blocking:
        if getattr(job, "_save_group", None) is None:  # DCP's own collectives, off the step's groups
            job._save_group = dist.new_group(backend="gloo")
            job._stager = HostStager(job.mesh.device)
        fut = dcp.async_save(sd, checkpoint_id=tmp, process_group=job._save_group, async_stager=job._stager,
                             planner=SavePlanner())
        staged = None
        if hasattr(fut, "upload_completion"):  # staged on a thread: the step goes on meanwhile
            fut, staged = fut.upload_completion, fut.staging_completion
        job._pending_save = PendingSave(fut, tmp, path, rank == 0, time.perf_counter() - t0, staged)
        return job._pending_save
    dcp.save(sd, checkpoint_id=tmp, planner=SavePlanner())
    dist.barrier(job.ctrl)  # every rank's pieces and the metadata written
    if rank == 0:
        _publish(tmp, path)
    dist.barrier(job.ctrl)
    return path


def load(job, path: str, extra: dict | None = None) -> dict:
    """``Job.load``; the saved extra values are under ``"extra"`` of what it returns."""
    wait_saves(job)
    sd = _template(job, _check(job, path))
    dcp.load(sd, checkpoint_id=path, planner=LoadPlanner())
    saved = json.loads(sd["meta"])
    if saved.get("format") != FORMAT:
        raise CheckpointError(f"the checkpoint at {path!r} is of format {saved.get('format')!r}; this "
                              f"shardwise reads format {FORMAT}")
    if saved["optimizer"] != type(job.optimizer).__name__ or len(saved["groups"]) != len(job.optimizer.param_groups):
        raise CheckpointError(f"the checkpoint at {path!r} holds {saved['optimizer']} state of {len(saved['groups'])} "
                              f"parameter group(s); this job steps {type(job.optimizer).__name__} with "
                              f"{len(job.optimizer.param_groups)}: build the job with the same optimizer")
    saved["extra"] = load_state_dict(job, sd, extra)
    return saved


def _published(directory: str) -> list[str]:
    """The published checkpoints under ``directory`` (``step-N`` folders with DCP's metadata), oldest first."""
    if not os.path.isdir(directory):
        return []
    steps = sorted((int(d[5:]), d) for d in os.listdir(directory) if d.startswith("step-") and d[5:].isdigit()
                   and os.path.exists(os.path.join(directory, d, ".metadata")))
    return [os.path.join(directory, d) for _, d in steps]


def latest(directory: str) -> str | None:
    """The published checkpoint of the highest step under ``directory``, or None."""
    return next(reversed(_published(directory)), None)


def prune(directory: str, keep: int) -> None:
    """Rank 0: remove all but the ``keep`` newest published checkpoints under ``directory``."""
    for path in _published(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


class Checkpointing:
    """The checkpoint methods of ``Job`` (this module's functions on the job)."""

    def state_dict(self, extra: dict | None = None) -> dict:
        """This rank's part of the job's state for ``dcp.save`` (module docstring); under a tp axis or
        offload give ``dcp.save``/``dcp.load`` ``planner=SavePlanner()``/``LoadPlanner()`` of this module."""
        return state_dict(self, extra)

    def load_state_dict(self, sd: dict, extra: dict | None = None) -> dict:
        """Take the state ``dcp.load`` read into a ``state_dict()`` of this job."""
        return load_state_dict(self, sd, extra)

    def save(self, path: str, extra: dict | None = None, blocking: bool = True):
        """Write a sharded checkpoint to the directory ``path`` (a collective), published by rename once
        complete, so a crash mid-save leaves an older checkpoint at ``path`` as it was. ``extra``:
        the loop's objects to keep with it (``{"scheduler": sched}``; ``state_dict()`` objects or plain
        values). ``blocking=False``: DCP's async save, returning a ``PendingSave`` at once."""
        with watched(self, "save"):
            return save(self, path, extra, blocking)

    def wait_saves(self) -> None:
        """Wait until a save still being written (``blocking=False``) is published (a collective)."""
        wait_saves(self)

    def load(self, path: str, extra: dict | None = None) -> dict:
        """Load the checkpoint at ``path`` (a collective), resharded to this job's dp ranks and strategy;
        returns what it recorded (steps, strategy, ranks). A missing, partial or foreign checkpoint, or
        one of another model, is a ``CheckpointError`` naming the directory and what differs.
        ``extra``: the objects to restore from what ``save(extra=...)`` kept (``load_state_dict``)."""
        with watched(self, "load"):
            return load(self, path, extra)
