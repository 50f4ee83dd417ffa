"""Tensor parallelism: the captured single-device step partitioned over the tp axis of the mesh.

The plan seeds parameters' placements (``tp_plan``); propagation places every other value of the joint graph
(sharding/propagate.py); this pass then makes the program each tp rank runs:

1. ``addmm`` becomes ``mm`` + ``add`` first, so that a row-parallel product's partial sum is reduced before its bias is
   added once;
2. each value a reader needs in another placement gets its collective on the tp group, right after the value is made:
   P→R all-reduce, S→R all-gather, P→S reduce-scatter; R→S is this rank's slice, taken with ``index_select`` on an input
   that holds this rank's indices (``Capture.rank_inputs``), so that every rank runs the same code; R→P keeps the value
   on the first rank only (a bias added to a partial sum), by the same input;
3. every size an op was traced with (views, expands) becomes the local one, and the values are traced again on local
   fake inputs.

The result is a Capture of the tp-local step, its parameters the tp shards, which the data-parallel strategy passes then
shard as they would a single device's (ZeRO-3 shards the tp shard over dp)."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math

import torch
import torch.fx as fx

from ..capture import Capture, forward_nodes
from ..sharding import Partial, Replicate, Shard
from ..sharding.annotate import parse
from ..sharding.ops import info
from ..sharding.propagate import Propagation, propagate
from ..sharding.rules import marks
from ..sharding.rules.base import ShardingError
from ..sharding.rules.pointwise import is_pointwise
from . import emit, tp_ops

aten = torch.ops.aten
_SIZED = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
          aten.slice_backward.default, aten.select_backward.default)


def seeds_of(cap: Capture, plan: dict, ranks: int = 1) -> dict[str, object]:
    """Each parameter's placement on the tp axis from ``plan`` ({name glob: placement}, the first glob
    that matches wins; the rest replicated). A glob that names no parameter, or a shard on a dim the
    parameter lacks or the ``ranks`` do not divide, is an error."""
    out = {}
    for g in plan:
        if not any(fnmatch.fnmatch(n, g) for n in cap.param_names):
            raise ValueError(f"tp_plan: {g!r} names no parameter of the model (some of them: "
                             f"{', '.join(cap.param_names[:6])}, ...)")
    for n, shape in zip(cap.param_names, cap.param_shapes):
        g, p = next(((g, p) for g, p in plan.items() if fnmatch.fnmatch(n, g)), (None, Replicate()))
        if isinstance(p, Shard) and not (-len(shape) <= p.dim < len(shape) and shape[p.dim] % (ranks * p.groups) == 0):
            cut = f"{p.groups} blocks of {ranks} tp ranks" if p.groups > 1 else f"{ranks} tp ranks"
            why = (f"it has {len(shape)} dims" if not -len(shape) <= p.dim < len(shape)
                   else f"its dim {p.dim} has {shape[p.dim]} entries, which {cut} do not divide")
            raise ValueError(f"tp_plan: {g!r} -> {p} cannot shard {n} of shape {tuple(shape)}: {why}")
        out[n] = p.moved(p.dim % len(shape)) if isinstance(p, Shard) else p
    return out


def local_shape(shape, p, ranks: int) -> list[int]:
    s = list(shape)
    if isinstance(p, Shard):
        s[p.dim] //= ranks
    return s


def _decompose_addmm(g: fx.Graph) -> None:
    for n in list(g.nodes):
        if n.target is aten.addmm.default and not n.kwargs:
            bias, a, b = n.args
            with g.inserting_before(n):
                mm = emit.node(g, aten.mm.default, (a, b), n.meta["val"])
                add = emit.node(g, aten.add.Tensor, (mm, bias), n.meta["val"])
            n.replace_all_uses_with(add)
            g.erase_node(n)


def sequence_marks(g: fx.Graph, fwd: set, ranks: int) -> dict:
    """Sequence parallelism's marks: every lookup of the forward (token and position embeddings) is
    cut along its indices' last dim, the sequence, where it is made, so the residual stream between
    the tensor-parallel regions lies in sequence shards. The positions were computed from the whole
    sequence before the cut (the single-device graph's ``arange``), so RoPE and learned positions
    are right. Returns {shape: Shard}: the stream's shapes, by which its gradients are known."""
    prefer = {}
    for n in list(g.nodes):
        if n in fwd and n.target is aten.embedding.default:
            v = n.meta["val"]
            d = v.dim() - 2
            if d < 0 or v.shape[d] % ranks:
                raise ValueError(f"sequence_parallel: the sequence of {n.name} (shape {tuple(v.shape)}, dim {d}) "
                                 f"has {v.shape[d] if d >= 0 else 1} tokens, which {ranks} tp ranks do not divide: "
                                 "use a sequence length that tp divides, or sequence_parallel=False")
            marks.insert(g, n, Shard(d))
            prefer[tuple(v.shape)] = Shard(d)
    return prefer


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
          aten.permute.default)


def _merge_views(g: fx.Graph) -> None:
    """One node for equal views of one value (a norm's output viewed alike for q, k and v): a gather it needs is made
    once for all its readers."""
    seen: dict[tuple, fx.Node] = {}

    def key(a):
        return tuple(key(x) for x in a) if isinstance(a, (list, tuple)) else a

    for n in list(g.nodes):
        if n.op == "call_function" and n.target in _VIEWS and not n.kwargs:
            k = (n.target, key(n.args))
            if k in seen:
                n.replace_all_uses_with(seen[k])
                g.erase_node(n)
            else:
                seen[k] = n


def _prepared(cap: Capture) -> tuple[fx.GraphModule, fx.Graph, list[fx.Node], dict[fx.Node, str]]:
    """A copy of the captured step as the tp passes read it (``addmm`` split, equal views merged):
    (its module, graph, placeholders, and the parameters' placeholders by name)."""
    gm = copy.deepcopy(cap.gm)
    g = gm.graph
    _decompose_addmm(g)
    _merge_views(g)
    phs = g.find_nodes(op="placeholder")
    return gm, g, phs, dict(zip(phs[: cap.n_params], cap.param_names))


def partition(cap: Capture, plan: dict, ranks: int, group: str, sequence_parallel: bool = False,
              stage: str | None = None, allow_replicate: bool = False,
              gather: str = "activation") -> tuple[Capture, Propagation]:
    """The tp-local step of ``cap`` under ``plan`` over ``ranks`` ranks of process group ``group`` (with
    ``sequence_parallel``, the activations between the regions in sequence shards; ``gather``: which operand a product
    of two shards gathers, sharding/propagate.py). Returns (its Capture, the propagation it was made from)."""
    gm, g, phs, params = _prepared(cap)
    by_name = seeds_of(cap, plan, ranks)
    seeds = {ph: by_name[name] for ph, name in params.items()}
    grads = [ph for ph, t in zip(params, cap.trainable) if t]
    outputs = [Replicate()] + [seeds[ph] for ph in grads]
    for n in g.find_nodes(op="call_function", target=torch.ops.shardwise.shard_hint.default):
        n.target, n.args = marks.mark, (n.args[0], parse(n.args[1]))  # the model's own marks (sw.shard)
    prefer = sequence_marks(g, forward_nodes(gm), ranks) if sequence_parallel else None
    fwd = forward_nodes(gm)  # with the marks sequence parallelism inserted
    prop = propagate(gm, seeds, ranks, outputs, names=params, prefer=prefer, allow_replicate=allow_replicate,
                     gather=gather)
    pl = prop.placements
    index_inputs: dict[tuple, fx.Node] = {}
    device = next((p.meta["val"].device for p in phs if isinstance(p.meta.get("val"), torch.Tensor)), "cpu")

    def index_of(d_size: int, groups: int = 1) -> fx.Node:
        """The input of this rank's indices into a dim of ``d_size`` cut in ``groups`` blocks (one per size and cut)."""
        if (d_size, groups) not in index_inputs:
            with g.inserting_before(g.find_nodes(op="placeholder")[-1].next):
                ph = g.placeholder(f"tp_index_{d_size}" + (f"x{groups}" if groups > 1 else ""))
            ph.meta["val"] = emit.fake([d_size // ranks], torch.long, device)
            index_inputs[(d_size, groups)] = ph
        return index_inputs[(d_size, groups)]

    # a gradient output's parameter, to name in the collective that places it
    out_node = g.find_nodes(op="output")[0]
    grad_of = {a: params[ph] for a, ph in zip(out_node.args[0][1:], grads) if isinstance(a, fx.Node)}
    # the collectives, one per value and placement it is moved to, right after the value is made;
    # the partial gradients of whole parameters (under sequence parallelism: the norms', the
    # embedding's) are summed in one all-reduce of them all, after the last is made
    grad_sums = []
    gathered: dict[fx.Node, fx.Node] = {}  # a value -> its whole copy
    for r in prop.collectives():
        readers = [x.node for x in prop.reshards if x.arg is r.arg and x.dst == r.dst]
        if r.kind == "all_reduce" and readers == [out_node] and r.arg in grad_of:
            grad_sums.append(r.arg)
            continue
        phase = "fwd" if r.arg in fwd else "bwd"
        # what explain says of the collective: the move, the value and the ops that need it
        ops = {"output" if u.op == "output" else str(u.target).removeprefix("aten.").split(".")[0] for u in readers}
        reason = f"{r.src}->{r.dst} {r.arg.name} for {','.join(sorted(ops))}"
        if r.kind == "all_gather":
            # views of one value gathered alike (dy and dy^T for a product's two gradients): the value
            # is gathered once and each view taken again on the whole copy
            chain, root = [], r.arg
            while root.target in _VIEWS and isinstance(pl.get(root.args[0]), Shard):
                chain.append(root)
                root = root.args[0]
            if root not in gathered:
                at = root if root.op != "placeholder" else g.find_nodes(op="placeholder")[-1]
                with g.inserting_before(at.next):
                    gathered[root] = _reshard(g, root, pl[root], Replicate(), ranks, group, index_of, phase, stage, reason)
            new = gathered[root]
            with g.inserting_before(new.next):
                for v in reversed(chain):
                    new = emit.node(g, v.target, (new, *v.args[1:]), v.meta["val"])
            gathered[r.arg] = new
        else:
            at = r.arg if r.arg.op != "placeholder" else g.find_nodes(op="placeholder")[-1]
            with g.inserting_before(at.next):
                new = _reshard(g, r.arg, r.src, r.dst, ranks, group, index_of, phase, stage, reason)
        for u in readers:
            u.replace_input_with(r.arg, new)
        pl[new] = r.dst
    summed = emit.sum_after_last(g, grad_sums, ranks, group, axis="tp", params=[grad_of[x] for x in grad_sums],
                                 stage=stage)
    for x, y in zip(grad_sums, summed):
        out_node.replace_input_with(x, y)
        pl[y] = Replicate()
    tp_ops.rewrite(g, pl, fwd, ranks, group, stage, index_of)
    marks.remove(g)
    # local sizes where ops were traced with the whole ones
    for n in g.nodes:
        if n.op == "call_function" and n.target in _SIZED and isinstance(pl.get(n), Shard):
            n.args = (n.args[0], local_shape(n.args[1], pl[n], ranks), *n.args[2:])
        elif n.target in (aten.split.Tensor, aten.split_with_sizes.default) and isinstance(pl.get(n.args[0]), Shard) \
                and pl[n.args[0]].groups > 1 and pl[n.args[0]].dim == _split_dim(n):
            k = n.args[1]
            n.args = (n.args[0], [x // ranks for x in k] if isinstance(k, (list, tuple)) else k // ranks, *n.args[2:])
        elif n.target is aten.embedding_dense_backward.default and pl.get(n) == Shard(0):
            n.args = (n.args[0], n.args[1], n.args[2] // ranks, *n.args[3:])
    # the inputs' local values, and every value traced again on them
    emit.retrace(gm, lambda ph, shape: local_shape(shape, pl.get(ph, Replicate()), ranks))
    local = dataclasses.replace(cap, gm=gm, param_shapes=[torch.Size(local_shape(s, by_name[n], ranks))
                                                           for n, s in zip(cap.param_names, cap.param_shapes)],
                                rank_inputs=[ph.name for ph in index_inputs.values()])
    return local, prop


def _split_dim(n: fx.Node) -> int:
    return (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % n.args[0].meta["val"].dim()


def _reshard(g, x, src, dst, ranks, group, index_of, phase, stage=None, reason=""):
    """The node that moves ``x`` from ``src`` to ``dst`` on the tp axis, in ``phase`` of the step."""
    v = x.meta["val"]
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        c = emit.collective("all_reduce", v.numel() * v.dtype.itemsize, ranks, phase, axis="tp", reason=reason)
        return _moved(emit.start_and_wait(g, emit.c10d.all_reduce.default, (emit.contiguous(g, x), "sum", group),
                                          list(v.shape), v.dtype, v.device, c, stage), x, None, group, c)
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return _gather(g, x, src, ranks, group, phase, stage, reason)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return _scatter(g, x, dst, ranks, group, phase, stage, reason)
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        # the value on the first rank, zeros on the others: this rank's index into a dim of ``ranks`` entries: its rank
        first = emit.node(g, aten.eq.Scalar, (index_of(ranks), 0), emit.fake([1], torch.bool, v.device))
        first = emit.node(g, aten.view.default, (first, []), emit.fake([], torch.bool, v.device))
        return emit.node(g, aten.mul.Tensor, (x, first), emit.fake(list(v.shape), v.dtype, v.device))
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return emit.node(g, aten.index_select.default, (x, dst.dim, index_of(v.shape[dst.dim], dst.groups)),
                         emit.fake(local_shape(v.shape, dst, ranks), v.dtype, v.device))
    raise NotImplementedError(f"tp: moving {x.name} from {src} to {dst} is not built yet")


def _gather(g, x, p, ranks, group, phase, stage=None, reason=""):
    """All-gather of shard ``p``: the pieces meet along dim 0, so another dim is moved there first
    and back after; the pieces of a cut in blocks are put back in block order between."""
    v = x.meta["val"]  # the global value: local along the dim
    d, local = p.dim, local_shape(v.shape, p, ranks)
    perm = [d] + [i for i in range(len(local)) if i != d]
    y = emit.contiguous(g, x) if d == 0 else _contiguous(
        g, emit.node(g, aten.permute.default, (x, perm), emit.fake([local[i] for i in perm], v.dtype, v.device)))
    moved = [local[i] for i in perm]
    full = [moved[0] * ranks, *moved[1:]]
    c = emit.collective("all_gather", math.prod(full) * v.dtype.itemsize, ranks, phase, axis="tp", reason=reason)
    out = emit.start_and_wait(g, emit.c10d.all_gather_into_tensor.default, (y, ranks, group), full, v.dtype,
                              v.device, c, stage)
    if p.groups > 1:  # [rank, block, piece] -> [block, rank, piece]
        k = p.groups
        split = [ranks, k, moved[0] // k, *moved[1:]]
        out = emit.node(g, aten.view.default, (out, split), emit.fake(split, v.dtype, v.device))
        out = emit.node(g, aten.transpose.int, (out, 0, 1), emit.fake([k, ranks, *split[2:]], v.dtype, v.device))
        out = emit.node(g, aten.reshape.default, (out, full), emit.fake(full, v.dtype, v.device))
    if d != 0:
        back = [perm.index(i) for i in range(len(perm))]
        out = _contiguous(g, emit.node(g, aten.permute.default, (out, back), emit.fake(list(v.shape), v.dtype, v.device)))
    return _moved(out, x, d, group, c) if p.groups == 1 else out


def _scatter(g, x, p, ranks, group, phase, stage=None, reason=""):
    """Reduce-scatter of a partial sum to shard ``p``: its dim is moved to dim 0, where the pieces
    are cut (a cut in blocks: each rank's pieces of every block put side by side first), and back after."""
    v, d = x.meta["val"], p.dim
    perm = [d] + [i for i in range(v.dim()) if i != d]
    moved = [v.shape[i] for i in perm]
    y = x if d == 0 else emit.node(g, aten.permute.default, (x, perm), emit.fake(moved, v.dtype, v.device))
    if p.groups > 1:  # [block, rank, piece] -> [rank, block, piece]
        k = p.groups
        split = [k, ranks, moved[0] // (k * ranks), *moved[1:]]
        y = emit.node(g, aten.reshape.default, (y, split), emit.fake(split, v.dtype, v.device))
        y = emit.node(g, aten.transpose.int, (y, 0, 1), emit.fake([ranks, k, *split[2:]], v.dtype, v.device))
        y = emit.node(g, aten.reshape.default, (y, moved), emit.fake(moved, v.dtype, v.device))
    else:
        y = emit.contiguous(g, y) if d == 0 else _contiguous(g, y)
    local = [moved[0] // ranks, *moved[1:]]
    c = emit.collective("reduce_scatter", math.prod(moved) * v.dtype.itemsize, ranks, phase, axis="tp", reason=reason)
    out = emit.start_and_wait(g, emit.c10d.reduce_scatter_tensor.default, (y, "sum", ranks, group), local, v.dtype,
                              v.device, c, stage)
    if d != 0:
        out = _contiguous(g, emit.node(g, aten.permute.default, (out, [perm.index(i) for i in range(len(perm))]),
                                       emit.fake(local_shape(v.shape, p, ranks), v.dtype, v.device)))
    return _moved(out, x, d, group, c) if p.groups == 1 else out


def _moved(out: fx.Node, x: fx.Node, dim, group: str, c) -> fx.Node:
    """``out``, the value ``x`` moved by collective ``c`` on ``group`` (along ``dim``), marked so:
    the fused products' pass (passes/fuse_tp.py) finds the products beside it by the mark."""
    out.meta["tp_moved"] = (x.name, dim, group, c)
    return out


def _contiguous(g, x):
    """A permuted collective's result laid out in order again (views of it follow)."""
    return emit.node(g, aten.clone.default, (x,), x.meta["val"], memory_format=torch.contiguous_format)


_PRODUCTS = (aten.mm.default, aten.bmm.default, *((aten._grouped_mm.default,) if hasattr(aten, "_grouped_mm") else ()))


def _gate(a: fx.Node) -> bool:
    """A value broadcast along the last dim (one per token: an expert's mask, a routing weight)."""
    return a.meta["val"].shape[-1:] == (1,)


def _fused_blocks(mm: fx.Node) -> int:
    """How many equal blocks a product's output is split into along its last dim, through its bias and views that keep
    that dim (a fused q|k|v: 3), or 1: its weight is then cut in as many blocks, each rank holding its heads of each."""
    n = mm
    while len(n.users) == 1:
        (u,) = n.users
        last = n.meta["val"].shape[-1]
        if u.target in (aten.split.Tensor, aten.split_with_sizes.default):
            sizes = [v.shape[-1] for v in u.meta["val"]]
            if _split_dim(u) == n.meta["val"].dim() - 1 and len(sizes) > 1 and len(set(sizes)) == 1:
                return len(sizes)
            return 1
        gate = u.target is aten.mul.Tensor and all(a is n or _gate(a) for a in u.all_input_nodes)  # experts' masks
        if not (gate or u.target in (aten.add.Tensor, aten.view.default, aten._unsafe_view.default,
                                     aten.reshape.default)) or u.meta["val"].shape[-1] != last:
            return 1
        n = u
    return 1


def megatron_plan(cap: Capture, ranks: int = 2, weigh=None) -> dict[str, object]:
    """Megatron's pairs, found from the graph (module names play no part). A product of activations by a weight starts a
    column-parallel region; the region grows through every forward op that is not a reduction, a norm, a loss or a
    lookup and whose activation inputs all lie in it (RoPE's tables and the weights are constants: any op may read
    them); a product whose activation operand lies in a region is row-parallel, and ends it. The region's products'
    weights split along their output dim, the row-parallel ones' along their input dim. Propagating the plan finds what
    would need a gather between a pair's products: such a column stays whole (KV heads fewer than the ranks), and a pair
    that needs one on every path, or at its row product, is left whole. A product whose output is split in equal blocks
    (GPT-2's fused q|k|v) has its weight cut in as many blocks (``Shard(d, groups=3)``), so each rank's piece holds its
    heads of q, of k and of v. Of the products that end in no row-parallel one, the LM head (its output the
    log-softmax's classes, its weight untied) is cut by classes (vocab-parallel, passes/tp_ops.py) where
    ``weigh(with, without)`` (the two plans; see ``head_choice``) keeps it so; the others stay whole. An untied
    embedding of the batch's tokens (not positions) is cut by rows (vocab-parallel) where a ``weigh`` keeps that so."""
    gm, g, phs, names = _prepared(cap)
    fwd = forward_nodes(gm)
    activation = set(phs[cap.n_params + len(cap.buffer_names):])  # the batch, then what it reaches
    for n in g.nodes:
        if n.op == "call_function" and any(a in activation for a in n.all_input_nodes):
            activation.add(n)
    linear = {}  # product node -> (weight name, the weight's dim that is the product's output dim)
    in_dim = {}  # product node -> the weight's dim that the product contracts
    for n in g.nodes:
        if n in fwd and n.target in _PRODUCTS:
            # a matrix, or one per expert (a batched or grouped product of a 3-dim weight: its dims 1 and 2)
            nd = 2 if n.target is aten.mm.default else 3
            # the weight's contracted and output dims, followed back to the parameter through transposes and an
            # expert's matrix taken from a 3-dim one (Hugging Face's experts: select of dim 0, or index of dim 0)
            dims, w = [nd - 2, nd - 1], n.args[1]
            while w.op == "call_function" and (w.target in (aten.t.default, aten.transpose.int) or (
                    w.target is aten.select.int and w.args[1] == 0) or (w.target is aten.index.Tensor
                                                                        and len(w.args[1]) == 1)):
                if w.target is aten.select.int:
                    dims = [d + 1 for d in dims]
                elif w.target is not aten.index.Tensor:  # a transpose
                    a, b = (0, 1) if w.target is aten.t.default else (d % w.meta["val"].dim() for d in w.args[1:])
                    dims = [{a: b, b: a}.get(d, d) for d in dims]
                w = w.args[0]
            if w in names and w.meta["val"].dim() >= nd and min(dims) == w.meta["val"].dim() - 2:  # its last two
                linear[n], in_dim[n] = (names[w], dims[1]), dims[0]
    stop = (aten.sum.dim_IntList, aten.mean.dim, aten.native_layer_norm.default, aten._log_softmax.default,
            aten._softmax.default, aten.embedding.default, aten.nll_loss_forward.default)
    region: dict[fx.Node, frozenset] = {}  # node -> the column-parallel products whose region holds it
    rows: dict[fx.Node, frozenset] = {}
    for n in g.nodes:
        if n not in fwd or n.op != "call_function":
            continue
        if n in linear:
            x = n.args[0]
            if x in region:
                rows[n] = region[x]
            else:
                region[n] = frozenset([n])
            continue
        acts = [a for a in n.all_input_nodes if a in activation]
        ruled = info(n.target).rule is not None or is_pointwise(n)  # an op without a rule ends a region
        acts = [a for a in acts if not (is_pointwise(n) and a not in region and _gate(a))]  # a gate may join it
        if n.target not in stop and ruled and acts and all(a in region for a in acts):
            region[n] = frozenset().union(*(region[a] for a in acts))
    plan: dict[str, object] = {}
    # a column-parallel product's bias (the add right after it) splits with its output
    bias = {n.args[0]: names[n.args[1]] for n in g.nodes if n.target is aten.add.Tensor and n.args[0] in linear
            and isinstance(n.args[1], fx.Node) and n.args[1] in names and n.args[1].meta["val"].dim() == 1}

    def add(row, cols):
        for c in cols:
            k = _fused_blocks(c)
            plan[linear[c][0]] = Shard(linear[c][1], k)
            if c in bias:
                plan[bias[c]] = Shard(0, k)  # its one dim is the product's output dim
        plan[linear[row][0]] = Shard(in_dim[row])

    for row, cols in rows.items():
        add(row, cols)
    # a column whose region needs a gather before the row-parallel product stays whole (its values
    # are then sliced where they meet the others': replicated KV heads where the tp ranks outnumber
    # them); a pair whose every column (or whose row product's input) does is left whole
    for _ in range(sum(len(cols) + 1 for cols in rows.values())):
        prop = propagate(gm, {ph: plan.get(names[ph], Replicate()) for ph in names}, ranks)
        bad = {r.node for r in prop.collectives()
               if r.kind in ("all_gather", "reduce_scatter", "all_to_all") and r.node in fwd}
        hit = {c for b in bad for c in region.get(b, frozenset())}
        if not hit:
            break
        for row, cols in list(rows.items()):
            if not (lost := cols & hit):
                continue
            gone = lost if lost != cols and not (bad & {row}) else (row, *cols)
            for c in gone:
                plan.pop(linear[c][0], None)
                plan.pop(bias.get(c), None)
            if row in gone:
                rows.pop(row)
            else:
                rows[row] = cols - lost
        for row, cols in rows.items():
            add(row, cols)
    # the LM head, vocab-parallel: a product no pair holds whose output is the log-softmax's classes,
    # its weight read by nothing else (a head tied to the embedding stays whole), the classes cut evenly
    used = {c for cols in rows.values() for c in cols} | set(rows)
    placeholder = {nm: ph for ph, nm in names.items()}
    for c, (name, out_dim) in linear.items():
        w = placeholder[name]
        if c not in used and _reaches_log_softmax(c) and w.meta["val"].shape[out_dim] % ranks == 0 \
                and sum(1 for u in w.users if u in fwd) == 1:
            split = {**plan, name: Shard(out_dim)}
            if weigh is None or weigh(split, plan):
                plan = split
    # an untied embedding of the batch's tokens, vocab-parallel where ``weigh`` keeps it so (its rows
    # cut evenly; the lookup a partial sum: sharding/rules/embedding.py)
    for n in g.find_nodes(op="call_function", target=aten.embedding.default):
        w = n.args[0]
        if n in fwd and w in names and n.args[1] in activation and w.meta["val"].shape[0] % ranks == 0 \
                and names[w] not in plan and sum(1 for u in w.users if u in fwd) == 1:  # tokens, not positions
            split = {**plan, names[w]: Shard(0)}
            if weigh is not None and weigh(split, plan):
                plan = split
    return plan


HEAD_TIE = 0.02
"""A whole table predicted faster than the vocab-parallel one by less than this fraction of the step does not count as
faster: the split one holds 1/tp of it and of its optimizer state (and, for the head, of the logits)."""


def gather_choice(cap: Capture, plan: dict, cost, ranks: int, group: str, sequence_parallel: bool = False,
                  stage: str | None = None, allow_replicate: bool = False) -> tuple[str, Capture, dict | None]:
    """Which operand the products of two shards gather, by the cost model: the step partitioned with the activation
    gathered (Megatron's sequence parallelism) and with the operand whose move sends fewer bytes; where their
    collectives differ, both are simulated and the second is taken only if predicted faster by more than ``HEAD_TIE``.
    Returns (the policy, its tp-local step, the weighing or None where both plans are one)."""
    args = (cap, plan, ranks, group, sequence_parallel, stage, allow_replicate)
    local, prop = partition(*args)
    try:
        alt, alt_prop = partition(*args, gather="fewer_bytes")
    except (NotImplementedError, ShardingError):  # a move the second plan needs is not built: not a choice
        return "activation", local, None
    if [str(r) for r in alt_prop.collectives()] == [str(r) for r in prop.collectives()]:
        return "activation", local, None
    (t0, p0), (t1, p1) = cost.estimate(local.gm), cost.estimate(alt.gm)
    take = t1 < (1 - HEAD_TIE) * t0
    seen = {"activation_s": t0, "activation_peak": p0, "fewer_bytes_s": t1, "fewer_bytes_peak": p1,
            "gather": "fewer_bytes" if take else "activation",
            "differ": sum(1 for r in alt_prop.collectives()) - sum(1 for r in prop.collectives())}
    return seen["gather"], (alt if take else local), seen


def head_choice(cap: Capture, cost, ranks: int, group: str, sequence_parallel: bool = False,
                stage: str | None = None, allow_replicate: bool = False):
    """Megatron's ``weigh`` by the cost model: each plan's tp-local step partitioned and simulated
    (``cost.estimate``: step time, peak); the vocab-parallel table (head or embedding) is kept unless
    the whole one is predicted faster by more than ``HEAD_TIE``. Returns (weigh, the list each
    weighing is recorded in: the parameter's name, both predictions and which was kept)."""
    seen: list[dict] = []
    estimates: dict[tuple, tuple[float, int]] = {}  # the embedding's "whole" is the head's chosen plan

    def estimate(plan: dict) -> tuple[float, int]:
        key = tuple(sorted((k, str(v)) for k, v in plan.items()))
        if key not in estimates:
            local = partition(cap, plan, ranks, group, sequence_parallel, stage, allow_replicate)[0]
            estimates[key] = cost.estimate(local.gm)
        return estimates[key]

    def weigh(split: dict, whole: dict) -> bool:
        t = {"split": estimate(split), "whole": estimate(whole)}
        keep = t["whole"][0] >= (1 - HEAD_TIE) * t["split"][0]
        (name,) = set(split) - set(whole)
        seen.append({"head": name, "split_s": t["split"][0], "split_peak": t["split"][1],
                     "whole_s": t["whole"][0], "whole_peak": t["whole"][1], "vocab_parallel": keep})
        return keep

    return weigh, seen


def _reaches_log_softmax(mm: fx.Node) -> bool:
    """Whether a product's output reaches a log-softmax over its last dim through views and casts."""
    n = mm
    while len(n.users) == 1:
        (u,) = n.users
        if u.target is aten._log_softmax.default:
            return u.args[1] % u.meta["val"].dim() == u.meta["val"].dim() - 1
        if u.target not in (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default) \
                or u.meta["val"].shape[-1] != n.meta["val"].shape[-1]:
            return False
        n = u
    return False
