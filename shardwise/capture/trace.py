"""Trace the single-device training step (forward, loss, backward) whole, as one ATen FX graph.

The graph's inputs are, in order: every parameter (full, deduplicated as ``named_parameters`` yields them, so tied
weights appear once), every buffer, then the leaves of the batch. Its outputs are ``[loss, *grads]`` with one gradient
per trainable parameter. Tracing runs on fake tensors, so no parameter memory is touched.

Forward and ``autograd.grad`` run inside one reparametrization context: computing the gradient outside it gives wrong
gradients, and ``torch.func.grad`` cannot trace through non-reentrant activation checkpointing."""

from __future__ import annotations

import contextlib
import contextvars
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ..errors import CaptureError


@dataclass
class Capture:
    """A traced step and what its inputs and outputs mean."""

    gm: fx.GraphModule
    param_names: list[str]
    """All parameters, in graph-input order (tied weights once)."""
    trainable: list[bool]
    """Whether each parameter gets a gradient (``requires_grad``)."""
    buffer_names: list[str]
    batch_spec: Any
    """pytree spec of the batch; its tensor leaves follow the buffers as graph inputs."""
    batch_consts: list[Any]
    """The batch's non-tensor leaves (None where the leaf is a tensor), baked into the graph."""
    param_shapes: list[torch.Size] = field(default_factory=list)
    param_dtype: torch.dtype | None = None
    """dtype the parameters were traced with (the compute dtype)."""
    written_buffers: list[str] = field(default_factory=list)
    """Buffers the step writes in place (BatchNorm's running statistics and ``num_batches_tracked``):
    the program writes them into the job's buffers as it runs (check_no_input_mutation)."""
    rank_inputs: list[str] = field(default_factory=list)
    """Inputs after the batch's whose values differ by rank (a tensor-parallel rank's indices into a
    dim it slices: passes/tp.py), named ``tp_index_<size>``; the runtime supplies them."""
    moe_layers: list[dict] = field(default_factory=list)
    """The MoE layers whose experts the ep axis splits (passes/ep.py): each one's expert parameters,
    expert count, ep ranks, token slots per expert per rank (capacity) and the all-to-all's bytes."""

    @property
    def n_params(self) -> int:
        return len(self.param_names)

    @property
    def grad_names(self) -> list[str]:
        return [n for n, t in zip(self.param_names, self.trainable) if t]

    def signature(self) -> str:
        return batch_signature(self.batch_spec, self.batch_consts, None)


def flatten_batch(batch) -> tuple[list[torch.Tensor], list[Any], Any]:
    """Split a batch into tensor leaves, constant leaves and its pytree spec."""
    leaves, spec = pytree.tree_flatten(batch)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    return tensors, [None if isinstance(x, torch.Tensor) else x for x in leaves], spec


def batch_signature(spec, consts, tensors: list[torch.Tensor] | None) -> str:
    """A string that changes whenever the traced graph would: structure, constants, shapes, dtypes."""
    parts = [str(spec), repr(consts)]
    if tensors is not None:
        parts += [f"{tuple(t.shape)}:{t.dtype}" for t in tensors]
    return "|".join(parts)


TRACING = contextvars.ContextVar("shardwise_tracing", default=False)
"""True while shardwise itself calls the model (capture traces it on fake tensors): the guard on
``job.model`` (runtime/guard.py) lets these calls through."""


@contextlib.contextmanager
def tracing():
    token = TRACING.set(True)
    try:
        yield
    finally:
        TRACING.reset(token)


def select_inputs(batch, which):
    """What of ``batch`` the model is called with (``model_inputs=``): all of it (None), the element at
    an index or key (``0``, ``"pixel_values"``), the elements at several (``(0, 1)``, passed as
    positional arguments; keys as keyword arguments), or what a function of the batch returns."""
    if which is None:
        return batch
    if callable(which):
        return which(batch)

    def pick(k):
        try:
            return batch[k]
        except (IndexError, KeyError, TypeError):
            have = list(batch.keys()) if isinstance(batch, dict) else (
                f"{len(batch)} elements" if isinstance(batch, (tuple, list)) else type(batch).__name__)
            raise CaptureError(f"model_inputs={which!r}: the batch has no {k!r} (it has {have}); give indices "
                               "or keys of the batch, or a function batch -> model inputs") from None

    if isinstance(which, (tuple, list)):
        return {k: pick(k) for k in which} if all(isinstance(k, str) for k in which) else tuple(pick(k) for k in which)
    return (pick(which),)


def call_model(model: nn.Module, batch):
    """Call the model the way DESIGN.md promises: ``model(**batch)`` for a dict, ``model(*batch)`` else."""
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def extract_loss(out, batch, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(out, batch)
    elif isinstance(out, torch.Tensor):
        loss = out
    elif getattr(out, "loss", None) is not None:
        loss = out.loss
    elif isinstance(out, dict) and out.get("loss") is not None:
        loss = out["loss"]
    else:
        raise CaptureError(f"the model returned {type(out).__name__}, not a loss: its forward must return a scalar "
                           "tensor or an object with .loss (as HF models do when given labels), or pass "
                           "loss_fn=(outputs, batch) -> loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        where = "loss_fn returned" if loss_fn is not None else "the model returned"
        raise CaptureError(f"{where} {got}, not a loss (a scalar tensor): make forward return the loss, or pass "
                           "loss_fn=(outputs, batch) -> scalar (e.g. cross-entropy of logits and targets, reduced "
                           "with .mean())")
    return loss.reshape(())


def _user_frame(exc: BaseException) -> str:
    """The innermost frame of the traceback that is not inside torch or shardwise."""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        f = fr.filename.replace("\\", "/")
        if "/torch/" not in f and "/shardwise/capture/" not in f and "/shardwise/runtime/" not in f:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "unknown location"


@contextlib.contextmanager
def _forwards(forwards: dict | None):
    """Each module of ``forwards`` called through its function meanwhile."""
    forwards = forwards or {}
    own = {m: m.__dict__.get("forward") for m in forwards}  # a forward set on the instance, kept
    try:
        for m, fn in forwards.items():
            m.forward = fn
        yield
    finally:
        for m, fn in own.items():
            if fn is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = fn


def _traced(step, args, model: nn.Module) -> fx.GraphModule:
    """``make_fx`` of the step. Where it fails on a construct that has a static-shape path of the same math, it is
    traced again with that path: Hugging Face experts looping over experts (a data-dependent ``nonzero``) through their
    ``grouped_mm`` implementation, grouped products in a dtype their tracing rule refuses through ``_grouped_by_rows``,
    and counts of a fixed length (``bincount`` with ``minlength``) as that length."""
    try:
        with _quiet_meta_failures():  # the error is raised (and named) by the caller, once
            return make_fx(step, tracing_mode="real")(*args)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - retried once, else raised
        looped = _hf_looped_experts(model) if _data_dependent(e) else []
        if not looped and not _grouped_dtype_refused(e) and not (_data_dependent(e) and "bincount" in str(e)):
            raise
    with _hf_experts_as(looped, "grouped_mm"), _grouped_products_by_reference(), _counts_of_fixed_size(), \
            _quiet_meta_failures():
        return make_fx(step, tracing_mode="real")(*args)


@contextlib.contextmanager
def _counts_of_fixed_size():
    """``torch.bincount(x, minlength=n)`` (1-d, no weights) as ``n`` counts by ``scatter_add`` while the step is traced
    (Mixtral's load-balancing loss in transformers 5.17): a value past ``n`` is an index error, not a longer result."""
    real = torch.bincount

    def bincount(x, weights=None, minlength=0):
        if weights is not None or minlength <= 0 or x.dim() != 1:
            return real(x, weights, minlength)
        return torch.zeros(minlength, dtype=torch.int64, device=x.device).scatter_add(
            0, x.to(torch.int64), torch.ones_like(x, dtype=torch.int64))

    torch.bincount = bincount
    try:
        yield
    finally:
        torch.bincount = real


def _data_dependent(e: BaseException) -> bool:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) or \
        "data-dependent" in str(e).lower() or "DataDependent" in type(e).__name__


def hf_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The Hugging Face experts modules of ``model`` (``use_experts_implementation``'s: the attributes
    its wrapper sets, in transformers 5.17 and 5.24 alike): (name, module)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "num_experts")]


def _hf_looped_experts(model: nn.Module) -> list[nn.Module]:
    """Hugging Face experts modules set to their per-expert loop."""
    return [m for _, m in hf_experts(model)
            if getattr(getattr(m, "config", None), "_experts_implementation", None) == "eager"]


@contextlib.contextmanager
def _hf_experts_as(mods: list[nn.Module], impl: str):
    """The experts ``mods`` run their ``impl`` implementation meanwhile (their configs put back after)."""
    configs = {id(m.config): m.config for m in mods}
    saved = {k: c._experts_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._experts_implementation = impl
        yield
    finally:
        for k, c in configs.items():
            c._experts_implementation = saved[k]


def _grouped_by_rows(mat_a, mat_b, offs):
    """``grouped_mm(mat_a, mat_b, offs=offs)`` for a 2-d ``mat_a`` ([rows, k], rows grouped in order, group ``g`` ending
    at ``offs[g]``) and a 3-d ``mat_b`` ([groups, k, n]), in plain ops with static shapes: every group's product on
    every row, each row keeping its own group's (the other terms are exact zeros). ``groups`` times the FLOPs: the
    reference path where the kernel's tracing rule refuses the dtype or device (its meta kernel takes bf16 only). The
    rows are masked before each product, not after: cut over tp, a row-parallel product's partial sums then add up
    across the groups and are reduced once."""
    rows = torch.arange(mat_a.shape[0], device=mat_a.device)
    group = torch.searchsorted(offs.to(torch.int64), rows, right=True)
    out = None
    for g in range(mat_b.shape[0]):
        part = (mat_a * (group == g).unsqueeze(1).to(mat_a.dtype)) @ mat_b[g]
        out = part if out is None else out + part
    return out


@contextlib.contextmanager
def _grouped_products_by_reference():
    """``torch.nn.functional.grouped_mm`` and ``torch._grouped_mm`` of a 2-d by 3-d product through
    ``_grouped_by_rows`` (others as they are), while the step is traced."""
    import torch.nn.functional as F

    patched = [(mod, name, getattr(mod, name)) for mod, name in ((F, "grouped_mm"), (torch, "_grouped_mm"))
               if getattr(mod, name, None) is not None]

    def wrap(real):
        def grouped(mat_a, mat_b, *args, offs=None, bias=None, out_dtype=None, **kw):
            if offs is None and args:
                offs, args = args[0], args[1:]
            if mat_a.dim() == 2 and mat_b.dim() == 3 and offs is not None and bias is None and not args and not kw \
                    and mat_a.dtype != torch.bfloat16:  # the kernel's tracing rule takes bf16
                out = _grouped_by_rows(mat_a, mat_b, offs)
                return out if out_dtype is None else out.to(out_dtype)
            return real(mat_a, mat_b, *args, offs=offs, bias=bias, out_dtype=out_dtype, **kw)
        return grouped

    try:
        for mod, name, fn in patched:
            setattr(mod, name, wrap(fn))
        yield
    finally:
        for mod, name, fn in patched:
            setattr(mod, name, fn)


@contextlib.contextmanager
def _quiet_meta_failures():
    """Fake tensors log every op whose meta kernel raises, with its traceback, before it is raised:
    a capture that fails says so once, in its CaptureError (a first trace that is retried, not at all)."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _grouped_dtype_refused(e: BaseException) -> bool:
    """Whether tracing failed on the grouped product's dtype rule (its meta kernel: bf16 only)."""
    while e is not None:
        if "Expected inputs of BF16 type" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def capture_step(model: nn.Module, batch, *, loss_fn: Callable | None = None, model_inputs=None,
                 param_dtype: torch.dtype | None = None, train: bool = True, with_grads: bool = True,
                 device: torch.device | None = None, forwards: dict | None = None, shapes: dict | None = None,
                 split: int = 1) -> Capture:
    """Trace ``loss = model(batch); grads = d loss / d params`` on fake tensors into one graph.

    Parameters released to the ``meta`` device (as zero3 does with the full weights) are traced as if on ``device``.
    ``forwards`` ({module: function}) traces those modules through the functions instead of their own forwards, and
    ``shapes`` ({parameter name: shape}) traces those parameters with those shapes: a partition that must be made while
    tracing (passes/ep.py, for experts whose dispatch the graph cannot show statically) says so. ``split`` > 1 runs the
    model on that many equal parts of the batch (its tensors cut along dim 0), the loss their mean: parts that share no
    values until the loss, which a scheduler can interleave (passes/ep.py).

    Example::

        >>> import torch, shardwise.models as M
        >>> from shardwise.capture import capture_step
        >>> m = M.build("gpt", "tiny")
        >>> x = torch.randint(0, 64, (2, 16))
        >>> cap = capture_step(m, (x, x))
        >>> len(cap.gm.graph.find_nodes(op="placeholder")) == cap.n_params + len(cap.buffer_names) + 2
        True
    """
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    pnames, bnames = list(params), list(buffers)
    trainable = [params[n].requires_grad for n in pnames]
    tensors, consts, spec = flatten_batch(batch)
    n_p, n_b = len(pnames), len(bnames)
    rows = next((t.shape[0] for t in tensors if t.dim()), None)
    if split > 1 and (rows is None or rows % split):
        raise CaptureError(f"a batch split in {split} needs a batch dim (dim 0 of its tensors) that {split} divides, "
                           f"got {rows}: use a batch of a multiple of {split} rows, or no split")
    dropped = [n for n in bnames if split > 1 and n.rpartition(".")[2] == "dropped"]  # models/moe.py, passes/ep.py

    def parts(b):
        if split == 1:
            return [b]
        return [pytree.tree_map(lambda t, i=i: t.tensor_split(split)[i] if isinstance(t, torch.Tensor) and t.dim()
                                and t.shape[0] == rows else t, b) for i in range(split)]

    def step(*flat):
        p_in, b_in, t_in = flat[:n_p], flat[n_p : n_p + n_b], list(flat[n_p + n_b :])
        it = iter(t_in)
        b = pytree.tree_unflatten([next(it) if c is None else c for c in consts], spec)
        state = {**dict(zip(pnames, p_in)), **dict(zip(bnames, b_in))}
        with _reparametrize_module(model, state, tie_weights=True), tracing(), _forwards(forwards):
            losses, counts = [], []  # a split batch: each part's ``dropped`` counts, their sum the batch's
            for part in parts(b):
                losses.append(extract_loss(call_model(model, select_inputs(part, model_inputs)), part, loss_fn))
                counts.append([model.get_buffer(n).clone() for n in dropped])
            for i, n in enumerate(dropped):
                model.get_buffer(n).copy_(sum(c[i] for c in counts))
            loss = losses[0] if split == 1 else sum(losses) / split
            if not with_grads:
                return [loss]
            wrt = [p for p, t in zip(p_in, trainable) if t]
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(wrt, grads)]
        return [loss, *grads]

    from torch._subclasses.fake_tensor import FakeTensorMode

    was_training = model.training
    model.train(train)
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as fm:

            def fake(t: torch.Tensor, dtype=None, requires_grad=False):
                dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
                dev = device if (t.is_meta and device is not None) else t.device
                f = torch.empty_strided(t.shape, t.stride(), dtype=dt, device=dev)
                return f.requires_grad_(requires_grad and with_grads)

            shaped = {n: torch.empty(tuple(shape), dtype=params[n].dtype, device="meta" if device is not None
                                     else params[n].device) for n, shape in (shapes or {}).items()}
            f_params = [fake(shaped.get(n, params[n]), param_dtype, tr) for n, tr in zip(pnames, trainable)]
            f_bufs = [fm.from_tensor(buffers[n]) for n in bnames]
            f_batch = [fm.from_tensor(t) for t in tensors]
            try:
                gm = _traced(step, (*f_params, *f_bufs, *f_batch), model)
            except CaptureError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with the construct and where it is
                data_dependent = _data_dependent(e)
                hint = (" Data-dependent shapes (nonzero, boolean masks, .item() in control flow) cannot be traced "
                        "to one static graph; rewrite the construct with static shapes (built-in MoE layers are "
                        "dropless, or dispatch to a fixed capacity, for this reason).") if data_dependent else ""
                if isinstance(e, TypeError) and "forward()" in str(e) and model_inputs is None:
                    hint = (" The model is called with the whole batch (model(*batch), or model(**batch) for a dict); "
                            "if its forward takes only part of it, say which: model_inputs=0 for a batch (x, y), with "
                            "loss_fn=(outputs, batch) -> loss to reach the labels.")
                raise CaptureError(f"cannot trace {type(model).__name__}'s training step whole: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''} — at {_user_frame(e)}.{hint}") from e
    finally:
        model.train(was_training)
    cap = Capture(gm=gm, param_names=pnames, trainable=trainable, buffer_names=bnames, batch_spec=spec,
                  batch_consts=consts, param_dtype=param_dtype,
                  param_shapes=[torch.Size((shapes or {}).get(n, params[n].shape)) for n in pnames])
    check_no_input_mutation(cap)
    return cap


def placeholder_names(cap: Capture) -> list[str]:
    """A readable name for each graph input: the parameter/buffer name or ``batch[i]``."""
    return cap.param_names + cap.buffer_names + [f"batch[{i}]" for i in range(sum(c is None for c in cap.batch_consts))]


def check_no_input_mutation(cap: Capture) -> None:
    """In-place writes to a parameter or batch tensor would not be replayed per shard: refuse them. A buffer written in
    place (BatchNorm's running statistics) is the model's own state: the op writes into the job's buffer as the program
    runs, as it would in eager training, and the buffer is recorded in ``cap.written_buffers``."""
    phs = cap.gm.graph.find_nodes(op="placeholder")
    names = dict(zip(phs, placeholder_names(cap)))
    buffers, written = set(phs[cap.n_params:cap.n_params + len(cap.buffer_names)]), []
    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is torch.ops.aten.native_batch_norm.default and node.args[5]:
            # its schema does not mark the running statistics it updates in training as written
            if hidden := [a for a in node.args[3:5] if a in buffers]:
                node.meta["sw_writes_buffer"] = names[hidden[0]]
                written += [names[a] for a in hidden]
        for arg, a in zip(node.target._schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and a in names:
                if a in buffers:
                    node.meta["sw_writes_buffer"] = names[a]
                    written.append(names[a])
                    continue
                raise CaptureError(f"the step writes in place to {names[a]!r} ({node.target}, node {node.name}); a "
                                   "parameter or batch tensor written in place is not supported (a rank holds only "
                                   "its shard of a parameter). Compute a new tensor instead of writing into the input.")
    cap.written_buffers = list(dict.fromkeys(written))


def forward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes the loss depends on: the forward pass. Everything else (the gradients' own work) is backward."""
    seen: set[fx.Node] = set()
    stack = [gm.graph.find_nodes(op="output")[0].args[0][0]]  # the loss
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen
