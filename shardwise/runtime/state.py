"""Training state on one rank: the parameters each strategy keeps, the master shards, the optimizer.

What lives where, per strategy (``Ψ`` = parameter count, ``N`` = data-parallel ranks):

=========  ==========================================  =================  =============
strategy   parameters kept whole                       optimizer updates  its state
=========  ==========================================  =================  =============
ddp        the model's own parameters                  whole parameters   whole
zero1/2    the model's (or a compute-dtype copy)       fp32 shards Ψ/N    sharded
zero3      none: the model's weights go to ``meta``    fp32 shards Ψ/N    sharded
=========  ==========================================  =================  =============

Under a tp axis (``TensorParallel``) every parameter above is this rank's tp shard and the model's own weights go to
``meta``. ``keep_model`` keeps them (a state made before the tp plan is known); ``reuse`` moves that state's optimizer
over to this one."""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..costmodel.collectives import sent_bytes
from ..sharding import ShardLayout

# zero1/2 gather a parameter at least this large straight into its storage; smaller ones share a bucket
IN_PLACE_BYTES = 64 * 1024

# Optimizers whose update of one element reads only that element's parameter, gradient and state,
# so they give the same result on a shard as on the whole tensor (amsgrad, maximize, weight decay and
# momentum too); a class of the user's says so with ``shardwise_elementwise = True``.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.Adadelta, torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam,
                          torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop)


class ShardedState:
    """Holds this rank's parameters and optimizer for one strategy; see the module table."""

    def __init__(self, model: nn.Module, strategy: str, layouts: dict[str, ShardLayout], rank: int,
                 optimizer_factory: Callable, param_dtype: torch.dtype | None, offload: bool = False,
                 offload_chunk_bytes: int = 64 * 2**20, offload_overlap: bool = True, fused: bool | None = None,
                 tp: TensorParallel | None = None, reuse: ShardedState | None = None, keep_model: bool = False):
        self.strategy, self.layouts, self.rank, self.tp = strategy, layouts, rank, tp
        params = dict(model.named_parameters())
        if tp is not None:  # this rank's tp shard of each split parameter, the others as they are
            params = {n: tp.local(n, p) for n, p in params.items()}
        self.names = list(params)
        self.trainable = {n: p.requires_grad for n, p in params.items()}
        self.shapes = {n: p.shape for n, p in params.items()}
        self.dtypes = {n: p.dtype for n, p in params.items()}
        self.full: dict[str, torch.Tensor] = {}
        self.master: dict[str, torch.Tensor] = {}
        self.compute: dict[str, torch.Tensor] = {}  # offload: the device shards the graph reads
        self.device, self.offload = next(iter(params.values())).device, offload
        if offload and strategy != "zero3":
            raise ValueError(f"optimizer offload is built for zero3 so far, not {strategy}")
        if strategy == "ddp":
            self.full = dict(params)
            opt_tensors = [(n, p) for n, p in params.items() if p.requires_grad]
        else:
            for n, p in params.items():
                shard = layouts[n].shard(p.detach(), rank)
                if offload:
                    keep = param_dtype is None or not p.is_floating_point()
                    self.compute[n] = shard.clone() if keep else shard.to(param_dtype)
                    shard = torch.empty(shard.shape, dtype=shard.dtype, device="cpu",
                                        pin_memory=self.device.type == "cuda").copy_(shard)
                self.master[n] = nn.Parameter(shard, requires_grad=p.requires_grad)
            if strategy in ("zero1", "zero2"):
                for n, p in params.items():
                    keep = param_dtype is None or not p.is_floating_point()
                    self.full[n] = p.detach() if keep else p.detach().to(param_dtype)
            opt_tensors = [(n, t) for n, t in self.master.items() if t.requires_grad]
        if not opt_tensors:
            raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
        self.opt_tensors = dict(opt_tensors)
        self.grad_names = [n for n in self.names if self.trainable[n]]
        # reuse: the optimizer of a state made before the tp plan was known, moved over
        self.optimizer = (transplant(reuse.optimizer, reuse.opt_tensors, opt_tensors) if reuse is not None
                          else optimizer_factory(opt_tensors))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer= must be a factory returning a torch.optim.Optimizer, got "
                            f"{type(self.optimizer).__name__}; "
                            "e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)")
        if offload and fused:
            raise ValueError("fused_optimizer=True does not apply under offload_optimizer: the offloaded "
                             "update streams the state through the device chunk by chunk (runtime/offload.py)")
        if not offload and reuse is None:
            self.optimizer = fused_twin(self.optimizer, fused)
        self.streamer = None
        if offload:
            from .offload import StreamedOptimizer

            self.streamer = StreamedOptimizer(self.optimizer, dict(opt_tensors), self.compute, self.device,
                                              offload_chunk_bytes, overlap=offload_overlap)
        if strategy != "ddp" and not (getattr(self.optimizer, "shardwise_elementwise", False)
                                      or type(self.optimizer) in ELEMENTWISE_OPTIMIZERS):
            raise ValueError(f"{type(self.optimizer).__name__} is not known to be elementwise, so it cannot run on "
                             f"{strategy} shards (its update of one element may read others). Use one of "
                             f"{', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}, strategy='ddp', or mark a "
                             "class whose update is elementwise with `shardwise_elementwise = True`.")
        if not keep_model and (tp is not None or strategy != "ddp" and (strategy == "zero3" or param_dtype is not None)):
            # the whole weights now live only as shards (and, for zero1/2, compute copies): released
            # last, once nothing above can refuse the job, so a refused job leaves the model as it was
            release_to_meta(model)

    def param_inputs(self, full_input: bool, dtypes: dict[str, torch.dtype]) -> list[torch.Tensor]:
        """The parameter inputs of the step graph, in capture order."""
        src = self.full if full_input else (self.compute if self.offload else self.master)
        if bad := [n for n in self.names if src[n].dtype != dtypes[n]]:
            n = bad[0]
            raise RuntimeError(f"internal: parameter {n} is stored as {src[n].dtype}, the graph expects {dtypes[n]}")
        return [src[n].detach() for n in self.names]

    def set_grads(self, grads: dict[str, torch.Tensor]) -> None:
        for n, g in grads.items():
            t = self.opt_tensors[n]
            if g.dtype != t.dtype or g.stride() != t.stride():
                # the parameter's dtype and layout: a graph may return a gradient with other strides
                # (an einsum's), which fused optimizer kernels reject on CUDA and misapply on CPU
                g = torch.empty_like(t, memory_format=torch.preserve_format).copy_(g)
            t.grad = g

    @torch.no_grad()
    def clip_grad_norm_(self, grads: dict[str, torch.Tensor], max_norm: float, group: dist.ProcessGroup,
                        ranks: int) -> tuple[torch.Tensor, int]:
        """Scale gradients so that their global 2-norm is at most ``max_norm``; returns (norm, bytes sent).

        Whole gradients (ddp) are the same on every rank: the norm is local. Shards need one all-reduce of this rank's
        sum of squares (padding rows are zero and add nothing). The scale is ``torch.nn.utils.clip_grad_norm_``'s:
        ``min(1, max_norm / (norm + 1e-6))``."""
        gs, tp, sent = list(grads.values()), self.tp, 0
        if tp is None and (self.strategy == "ddp" or ranks == 1):
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs]))
        else:
            # a model-parallel shard's squares add over its axis' ranks; a gradient whole (and the same)
            # on every rank of an axis counts once (a 1/ranks share from each)
            axes = tp.axes if tp is not None else []
            sq = torch.stack([torch.linalg.vector_norm(g) ** 2 / math.prod(a.ranks for a in axes if not a.sharded(n))
                              for n, g in grads.items()]).sum().reshape(1)
            for grp, n in ((group, ranks if self.strategy != "ddp" else 1), *((a.group, a.ranks) for a in axes)):
                if n > 1:
                    sq = _all_reduce(sq, grp)
                    sent += sent_bytes("all_reduce", sq.element_size(), n)
            total = sq.reshape(()).sqrt()
        torch._foreach_mul_(gs, torch.clamp(max_norm / (total + 1e-6), max=1.0).to(gs[0].dtype))
        return total, sent

    @torch.no_grad()
    def sync_full_from_master(self, group: dist.ProcessGroup, ranks: int) -> int:
        """zero1/2: all-gather the updated master shards into the whole compute copies.

        A parameter whose rows split evenly is gathered straight into its own storage (no temporary); the small or
        padded rest go through one flat all-gather per dtype. Returns the bytes this rank sent."""
        if self.strategy not in ("zero1", "zero2"):
            return 0
        c10d, sent = torch.ops._c10d_functional, 0
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n in self.names:
            if not self.trainable[n]:
                continue
            full, lay = self.full[n], self.layouts[n]
            shard = self.master[n].detach().to(full.dtype)
            sent += sent_bytes("all_gather", ranks * shard.numel() * shard.element_size(), ranks)
            if ranks == 1:
                full.copy_(lay.unshard(shard))
            elif self._gathers_in_place(n, group):
                c10d.wait_tensor(c10d.all_gather_into_tensor_out(shard, ranks, group.group_name, out=full.view(lay.padded_shape)))
            else:
                by_dtype.setdefault(full.dtype, []).append(n)
        for dtype, names in by_dtype.items():
            flat = torch.cat([self.master[n].detach().reshape(-1).to(dtype) for n in names])
            per_rank, off = _all_gather(flat, ranks, group).view(ranks, -1), 0
            for n in names:
                lay = self.layouts[n]
                self.full[n].copy_(lay.unshard(per_rank[:, off : off + lay.local_numel].reshape(lay.padded_shape)))
                off += lay.local_numel
        return sent

    def _gathers_in_place(self, name: str, group: dist.ProcessGroup) -> bool:
        """Whether ``sync_full_from_master`` gathers ``name`` straight into its whole storage (rows split
        evenly, contiguous, large enough, no host staging) rather than through the flat buffer."""
        full, lay = self.full[name], self.layouts[name]
        return (lay.pad_rows == 0 and full.is_contiguous() and full.numel() * full.element_size() >= IN_PLACE_BYTES
                and not _host_staged(group, full))

    def sync_transient_bytes(self, group: dist.ProcessGroup, ranks: int) -> int:
        """Bytes ``sync_full_from_master`` allocates at once: the flat shards of the parameters not
        gathered in place, and their gathered copy (ranks times as large)."""
        if self.strategy not in ("zero1", "zero2") or ranks == 1:
            return 0
        flat = sum(self.layouts[n].local_numel * self.full[n].element_size() for n in self.names
                   if self.trainable[n] and not self._gathers_in_place(n, group))
        return (ranks + 1) * flat

    def full_state_dict(self, model: nn.Module, group: dist.ProcessGroup, ranks: int, keep: bool) -> dict[str, torch.Tensor]:
        """The whole model's weights and persistent buffers, keyed as ``model.state_dict()``, on the CPU (``{}``
        where not ``keep``). A collective: gathered a parameter at a time, so the whole model is never on one device."""
        from torch.nn.utils.stateless import _reparametrize_module

        whole: dict[str, torch.Tensor] = {}
        for name, _ in model.named_parameters():  # tied parameters once
            full = self.gather_full(name, group, ranks)
            if keep:
                whole[name] = full.cpu().clone()
        if not keep:
            return {}
        # the module's own state_dict over the whole weights, so that its hooks (a fused weight saved
        # as parts, renamed keys) run on real tensors, not on the meta ones a zero3 module holds
        with _reparametrize_module(model, whole, tie_weights=True):
            sd = model.state_dict()
        ours = {w.untyped_storage().data_ptr() for w in whole.values()}  # gathered copies: no second copy
        return {k: v if v.device.type == "cpu" and v.untyped_storage().data_ptr() in ours else v.detach().cpu().clone()
                for k, v in sd.items()}

    @torch.no_grad()
    def gather_full(self, name: str, group: dist.ProcessGroup, ranks: int) -> torch.Tensor:
        """The whole value of parameter ``name`` (a collective): its dp shards gathered, then its tp ones."""
        held = self.full[name] if self.strategy == "ddp" else self.master[name]
        local = self.dp_whole(name, held.detach(), group, ranks)
        return self.tp.gather(name, local) if self.tp is not None else local

    def dp_whole(self, name: str, t: torch.Tensor, group: dist.ProcessGroup, ranks: int) -> torch.Tensor:
        """``t``, held as parameter ``name`` is held (its dp shard, or whole under ddp), gathered over the
        dp ranks (a collective except under ddp): its tp shard where there is a tp axis."""
        if self.strategy == "ddp":
            return t
        t, lay = t.to(self.device), self.layouts[name]
        return lay.unshard(t if ranks == 1 else _all_gather(t.contiguous(), ranks, group))

    @torch.no_grad()
    def take_state(self, saved: dict[str, dict], old: ShardedState, group: dist.ProcessGroup, ranks: int) -> None:
        """The optimizer state ``old`` held (``saved``: by parameter name, as ``old`` held it: before the
        tp plan, whole on the tp axis) made this state's: each tensor gathered over dp one at a time,
        cut to this rank's tp shard and dp shard of it. Collective."""
        for name, st in saved.items():
            p, moved = self.opt_tensors[name], {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.shape == old.opt_tensors[name].shape:
                    whole = old.dp_whole(name, v, group, ranks).reshape(old.shapes[name])
                    piece = self.tp.piece(name, whole) if self.tp is not None else whole
                    v = piece.reshape(p.shape) if self.strategy == "ddp" else self.layouts[name].shard(piece, self.rank)
                    v = v.to(device=p.device, dtype=p.dtype if v.is_floating_point() else v.dtype)
                moved[k] = v
            self.optimizer.state[p] = moved


class ParallelAxes:
    """Several model-parallel axes (tp and ep) as one for the state (``TensorParallel`` is a single one): a
    parameter is cut on any of them, in their order (an expert over ep by experts and over tp within each, an
    attention weight over tp and, under ZeRO, its tp shard's rows over ep)."""

    def __init__(self, axes: list[TensorParallel]):
        self.axes = axes

    def along(self, name: str, whole: tuple) -> list[torch.Tensor | None]:
        """Per dim of parameter ``name`` (``whole`` its whole shape), where this rank's entries lie in
        the whole tensor (None: all of that dim)."""
        at, sizes = [None] * len(whole), list(whole)
        for a in self.axes:
            d = a.dim(name)
            if d is not None:
                sub = a.placements[name].indices(sizes[d], a.rank, a.ranks)
                at[d], sizes[d] = (sub if at[d] is None else at[d][sub]), sizes[d] // a.ranks
        return at

    def factor(self, name: str, d: int) -> int:
        """How many pieces the axes cut dim ``d`` of parameter ``name`` in."""
        return math.prod(a.ranks for a in self.axes if a.dim(name) == d)

    def local(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return p if not self.sharded(name) else nn.Parameter(self.piece(name, p.detach()), requires_grad=p.requires_grad)

    def piece(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        for a in self.axes:
            whole = a.piece(name, whole)
        return whole

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        for a in reversed(self.axes):
            local = a.gather(name, local)
        return local

    def sharded(self, name: str) -> bool:
        return any(a.sharded(name) for a in self.axes)


class TensorParallel(ParallelAxes):
    """A job's model-parallel axis (tp, or ep) as the state sees it, the one axis of its ``axes``: each
    parameter's placement on it, its ranks, this rank's coordinate, its process group and name (``label``)."""

    def __init__(self, placements: dict, ranks: int, rank: int, group: dist.ProcessGroup, label: str = "tp"):
        self.placements, self.ranks, self.rank, self.group, self.label = placements, ranks, rank, group, label
        self.axes = [self]

    def dim(self, name: str) -> int | None:
        return getattr(self.placements.get(name), "dim", None)

    def piece(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's tp shard of ``whole``, a tensor shaped as parameter ``name`` (a new tensor)."""
        d = self.dim(name)
        return whole.clone() if d is None else self.placements[name].local(whole, self.rank, self.ranks).contiguous()

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        d = self.dim(name)
        if d is None:
            return local
        pieces = _all_gather(local.movedim(d, 0).contiguous(), self.ranks, self.group).movedim(0, d)
        return self.placements[name].whole(pieces, self.ranks)

    def sharded(self, name: str) -> bool:
        return self.dim(name) is not None


def transplant(opt: torch.optim.Optimizer, old: dict[str, torch.Tensor], named: list) -> torch.optim.Optimizer:
    """``opt``, built over the tensors ``old`` (by name) before its first step, over ``named``'s tensors of the same
    names instead: its groups, hyperparameters and identity kept, so schedulers and references to it hold."""
    if opt.state:
        raise RuntimeError("internal: the optimizer has state already; its tensors cannot be replaced")
    name_of, new = {id(t): n for n, t in old.items()}, dict(named)
    for g in opt.param_groups:
        g["params"] = [new[name_of[id(p)]] for p in g["params"]]
    return opt


def _host_staged(group: dist.ProcessGroup, x: torch.Tensor) -> bool:
    return dist.get_backend(group) == "gloo" and x.device.type != "cpu"


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``x`` over ``group`` (functional collective, waited; through the host on gloo)."""
    c10d, host = torch.ops._c10d_functional, _host_staged(group, x)
    return c10d.wait_tensor(c10d.all_reduce(x.cpu() if host else x, "sum", group.group_name)).to(x.device)


def _all_gather(x: torch.Tensor, ranks: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenation along dim 0 of ``x`` from every rank (functional collective, waited; through the host on gloo)."""
    c10d = torch.ops._c10d_functional
    x_in = x.cpu() if _host_staged(group, x) else x
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x_in, ranks, group.group_name)).to(x.device)


def release_to_meta(model: nn.Module) -> None:
    """Swap every parameter for a ``meta`` one of the same shape (tied parameters stay tied)."""
    new: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for k, p in mod._parameters.items():
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                mod._parameters[k] = new[id(p)]


# torch optimizers with a fused kernel: one pass over parameter, gradient and state per update,
# where the multi-tensor (foreach) path makes several (AdamW: about three times the bytes)
FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def fused_twin(opt: torch.optim.Optimizer, want: bool | None) -> torch.optim.Optimizer:
    """``opt`` rebuilt with torch's fused kernel (``fused=True``), or ``opt`` itself.

    ``want``: None (auto) fuses a fresh Adam, AdamW or SGD whose tensors are all on CUDA and whose ``foreach`` and
    ``fused`` were left unset (a user's choice is kept); True fuses or raises why it cannot; False keeps ``opt``. Same
    groups and hyperparameters; only the kernel differs (fp32 rounding may differ in the last bit)."""
    if want is False or opt.defaults.get("fused"):
        return opt
    d, ps = opt.defaults, [p for g in opt.param_groups for p in g["params"]]
    if want is None and (d.get("foreach") is not None or d.get("fused") is not None
                         or any(p.device.type != "cuda" for p in ps)):
        return opt
    why = None
    if type(opt) not in FUSED_OPTIMIZERS:
        why = (f"{type(opt).__name__} has no fused kernel in torch "
               f"({', '.join(c.__name__ for c in FUSED_OPTIMIZERS)} have)")
    elif opt.state:
        why = "the optimizer has state already (fusing rebuilds it before its first step)"
    elif d.get("differentiable"):
        why = "differentiable=True has no fused kernel"
    elif d.get("foreach"):
        why = "the optimizer was built with foreach=True"
    elif any(not p.is_floating_point() for p in ps):
        why = "a trainable tensor is not floating point"
    if why is not None:
        if want:
            raise ValueError(f"fused_optimizer=True: cannot fuse {type(opt).__name__}: {why}; pass "
                             "fused_optimizer=None (fuse where possible) or False")
        return opt
    takes = inspect.signature(type(opt).__init__).parameters
    kwargs = {**{k: v for k, v in d.items() if k in takes}, "fused": True, "foreach": None}
    fused = type(opt)([{**g, "fused": True, "foreach": None} for g in opt.param_groups], **kwargs)
    fused.register_load_state_dict_post_hook(_stay_fused)
    return fused


def _stay_fused(opt: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of a state saved by another kernel: the loaded groups say which kernel
    saved them, so set the fused one again, with its ``step`` counters where it keeps them."""
    for g in opt.param_groups:
        g["fused"], g["foreach"] = True, None
        for p in g["params"]:
            st = opt.state.get(p, {})
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)


def optimizer_kind(opt: torch.optim.Optimizer) -> str:
    """The optimizer and the kernel its step runs: ``AdamW (fused)``, ``(foreach)`` or ``(for-loop)``."""
    from ..costmodel.optimizer import optimizer_kernel

    d = getattr(opt, "defaults", None) or {}
    if "fused" not in d and "foreach" not in d:
        return type(opt).__name__
    ps = [p for g in opt.param_groups for p in g["params"]]
    return f"{type(opt).__name__} ({optimizer_kernel(d, ps[0].device.type if ps else 'cpu')})"
