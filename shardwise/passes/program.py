"""The sharded step program a strategy pass produces, and the rewrites every strategy shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from ..capture import Capture
from ..sharding import ShardLayout
from ..sharding.collective import collective_of
from . import emit

if TYPE_CHECKING:
    from ..costmodel import CostModel
    from .carveout import SMCarveout


@dataclass(frozen=True)
class ShardContext:
    """What a strategy pass needs to know about the mesh, the precision policy and the cost model."""

    dp: int
    """Ranks on the data-parallel axis."""
    group: str
    """Process-group name of the data-parallel axis (as functional collectives take it)."""
    cost: CostModel | None = None
    """The cost model the passes' choices are made on (costmodel.CostModel, or a stand-in with its methods);
    None: the choices that need it are not made (an error where one is asked for)."""
    param_dtype: torch.dtype | None = None
    """Compute dtype of parameters (mixed precision), None to compute in the storage dtype."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are reduced in, None to reduce in the compute dtype."""
    master_dtype: torch.dtype = torch.float32
    """dtype of the master weights the optimizer updates when ``param_dtype`` is set."""
    bucket_bytes: int = 25 * 2**20
    """Largest all-reduce bucket (ddp)."""
    stage: str | None = None
    """Device to stage collective payloads on (``"cpu"`` for gloo ranks whose tensors are on a GPU)."""
    shard_bucket_bytes: int | str | None = 0
    """Close zero all-gather/reduce-scatter buckets at this many bytes (passes/bucket.py); 0: one collective per
    parameter; None: twice the largest parameter's; ``"auto"``: the size the cost model predicts fastest among
    candidates whose predicted peak stays within ``bucket_peak_slack`` (or ``bucket_peak_floor``) of none."""
    keep_gathered: frozenset = frozenset()
    """zero3 parameters whose forward all-gather is kept for the backward (selective unsharding):
    no backward all-gather, at the price of the whole weight living from forward to backward."""
    recompute: bool = False
    """Recompute cheap elementwise forward results in the backward instead of keeping them (passes/recompute.py)."""
    graph_budget: int | None = None
    """Bytes the step graph may use on top of resident state (``memory_budget`` minus what the job
    holds); with it, zero3 keeps gathered as many parameters as fit (passes/unshard.py)."""
    reserve: int = 0
    """Bytes of the budget's headroom held before parameters are kept gathered: optimizer state kept on
    the device under offload (a byte of it saves a host round trip per step, worth more than unsharding)."""
    compute_dtype_grads: bool = False
    """dp=1 single-micro-batch steps leave the gradients in the compute dtype (no reduction happens,
    so casting them in the graph only doubles their bytes); the optimizer casts them chunk by chunk."""
    offload_activations: frozenset | bool = frozenset()
    """Saved activations (node names) kept in host memory between forward and backward
    (passes/actoffload.py); True: every one the backward reads."""
    param_ready: frozenset = frozenset()
    """Parameters whose inputs get a readiness wait before their first reader (passes/ready.py):
    the optimizer update of the previous step may still be running when the step starts."""
    bucket_peak_slack: float = 1.10
    """``"auto"`` buckets (and the in-flight cap) may raise the graph's predicted peak by at most this
    factor over none, or by ``bucket_peak_floor`` bytes where that is more."""
    bucket_peak_floor: int = 2**20
    """Bytes of predicted peak any step may spend on buckets and prefetch whatever its size: 10% of a tiny
    model's megabyte is too little for any bucket, and each collective saved is a latency (about 0.2-1 ms
    on gloo). One MiB merges a tiny model's collectives into one per phase."""
    schedule: bool = True
    """Reorder for latency hiding (passes/schedule.py); off: each collective where its pass put it, waited at once."""
    max_in_flight: int | None = None
    """Cap on bytes of collectives in flight; None: the cost model's pick (passes/pipeline.py) or twice the largest."""
    cap_sweep: bool = True
    """Let the cost model choose the in-flight cap (where ``max_in_flight`` is None). A memory budget's
    search turns it off while it compares plans and sweeps the plan it keeps."""
    peak_limit: int | None = None
    """An in-flight cap whose predicted graph peak is above this is not chosen (the budget's)."""
    sm_carveout: SMCarveout | None = None
    """Matrix products beside a collective leave SMs free for it (passes/carveout.py ``SMCarveout``); None: every SM."""
    max_ops_in_flight: int | None = None
    """Cap on the number of collectives in flight; None: no cap. gloo needs 1: with two all-gathers
    of one gloo process group in flight, a rank sometimes waits forever for data its peers already
    sent (seen on 4 ranks within ~20 zero3 steps; one at a time ran 40 x 10 steps clean)."""


@dataclass
class Program:
    """A rewritten step graph: inputs ``[*params, *buffers, *batch]``, outputs ``[loss, *grads]``."""

    gm: fx.GraphModule
    strategy: str
    capture: Capture
    layouts: dict[str, ShardLayout]
    param_input: str
    """``full``: each parameter enters whole; ``shard``: it enters as this rank's Shard(0) piece."""
    grad_output: str
    """``full``: each gradient leaves whole (already averaged); ``shard``: as this rank's piece."""
    input_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    """dtype each parameter input is expected in (master fp32 when the graph casts it)."""
    buckets: int = 0
    """How many multi-parameter buckets the bucketing pass made."""
    bucket_choice: list | None = None
    """With ``shard_bucket_bytes="auto"``: (bucket bytes, predicted s, predicted peak, chosen) per candidate."""
    recomputed: list | None = None
    """Forward nodes the backward recomputes (passes/recompute.py), when that pass ran."""
    unsharded: list | None = None
    """Under a memory budget (zero3): the parameters kept gathered from forward to backward."""
    offloaded: list | None = None
    """Saved activations kept in host memory between forward and backward (passes/actoffload.py)."""
    carved: int = 0
    """Matrix products run beside a collective with SMs left free for it (passes/carveout.py)."""
    carve_choice: tuple | None = None
    """``matmul_sm_carveout="auto"``: (predicted step uncarved, carved, whether carved) by the SM contention model."""
    resident_state: list | None = None
    """Under optimizer offload with a budget: parameters whose master and state stay on the device."""
    predicted_graph_peak: int | None = None
    """Under a memory budget: the simulated peak of this program's graph."""
    hashes: dict | None = None
    """Hashes of the captured graph and of this program, agreed by every rank before the first step."""
    schedule: dict | None = None
    """What the scheduler did (cap, how far each all-gather was moved), or None if it did not run."""

    def collective_nodes(self) -> list[fx.Node]:
        return emit.collectives(self.gm)

    def comm_bytes(self) -> int:
        """Bytes one rank sends per step inside this graph (ring algorithms)."""
        return sum(collective_of(n).sent_bytes for n in self.collective_nodes())

    def counts(self, axis: str | None = None) -> dict[str, int]:
        """Collectives of the program by kind (all-gathers, reduce-scatters and all-reduces always,
        all-to-alls where there are any); ``axis``: only those over that mesh axis."""
        out = {k: 0 for k in ("all_gather", "reduce_scatter", "all_reduce")}
        for c in map(collective_of, self.collective_nodes()):
            if axis is None or c.axis == axis:
                out[c.kind] = out.get(c.kind, 0) + 1
        return out


def parts(gm: fx.GraphModule):
    """(placeholders, output node, loss node, grad nodes) of a captured step graph."""
    phs, out = list(gm.graph.find_nodes(op="placeholder")), gm.graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    return phs, out, outs[0], outs[1:]


def replace_uses(node: fx.Node, new: fx.Node, keep: set[fx.Node] = frozenset()) -> None:
    for user in list(node.users):
        if user is not new and user not in keep:
            user.replace_input_with(node, new)


def cast_placeholders(gm: fx.GraphModule, phs: list[fx.Node], store_dtype: torch.dtype) -> None:
    """The graph was traced with compute-dtype parameters; make them enter in ``store_dtype`` and cast."""
    g = gm.graph
    for ph in phs:
        v = ph.meta["val"]
        if not v.is_floating_point() or v.dtype == store_dtype:
            continue
        ph.meta["val"] = emit.fake(v.shape, store_dtype, v.device)
        if not ph.users:
            continue
        with g.inserting_before(ph.next):
            c = emit.cast(g, ph, v.dtype)  # back to the compute dtype it was traced in
        replace_uses(ph, c, {c})


def average_loss(gm: fx.GraphModule, ctx: ShardContext) -> None:
    """The returned loss is the mean over data-parallel ranks (what DDP users print after a reduce)."""
    g = gm.graph
    _, out, loss, _ = parts(gm)
    if ctx.dp == 1:
        return
    with g.inserting_before(out):
        flat = emit.reshape(g, loss, [1])
        (red,) = emit.all_reduce_many(g, [flat], ctx.dp, ctx.group, op="avg", phase="fwd", stage=ctx.stage)
        new = emit.reshape(g, red, [])
    out.args = ([new, *out.args[0][1:]],)


def set_outputs(gm: fx.GraphModule, loss: fx.Node, grads: list[fx.Node]) -> None:
    gm.graph.find_nodes(op="output")[0].args = ([loss, *grads],)


def input_dtypes(cap: Capture, gm: fx.GraphModule) -> dict[str, torch.dtype]:
    return {n: ph.meta["val"].dtype for n, ph in zip(cap.param_names, gm.graph.find_nodes(op="placeholder"))}


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
