"""The mixture-of-experts model's capacity dispatch: what it computes, what it drops, what it traces to,
and that shardwise trains it as one device does."""

import math

import pytest
import torch

import shardwise as sw
from harness import check
from shardwise.bench import flops_per_token
from shardwise.capture import capture_step
from shardwise.models import build
from shardwise.runtime.executor import eager_safe


def pair(cf, **over):
    """The dense MoE and its capacity-dispatch twin with the same weights, in fp64."""
    torch.manual_seed(0)
    dense = build("moe", "tiny", **over).double()
    disp = build("moe", "tiny", capacity_factor=cf, **over).double()
    disp.load_state_dict(dense.state_dict())
    return dense, disp


def loss_and_grads(m, x):
    loss = m(x, x)
    return loss.detach(), torch.autograd.grad(loss, list(m.parameters()))


def test_dispatch_without_drops_equals_the_dense_experts():
    # capacity E/k: every (token, choice) pair fits, so the result is the dense path's
    dense, disp = pair(cf=2.0)  # tiny: 4 experts, top 2
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    (l0, g0), (l1, g1) = loss_and_grads(dense, x), loss_and_grads(disp, x)
    assert abs(float(l0 - l1)) < 1e-12
    assert max(float((a - b).abs().max()) for a, b in zip(g0, g1)) < 1e-12


def test_pairs_past_capacity_are_dropped_first_choices_first():
    torch.manual_seed(0)
    m = build("moe", "tiny", capacity_factor=0.5).double()
    ffn = m.blocks[0].ffn
    n, d = 8, m.cfg.d_model
    with torch.no_grad():
        ffn.router.weight.zero_()
        ffn.router.weight[0] = 1.0  # every token: expert 0 first, then 1 (ties among 1..3 broken by index)
        ffn.router.weight[1] = 0.5
    x = torch.rand(1, n, d, dtype=torch.float64) + 0.1
    cap = ffn.capacity(n)  # 0.5 * 8 * 2 / 4 = 2 pairs per expert
    assert cap == 2
    out = ffn(x)
    # by hand: tokens 0 and 1 get both their experts; the others' pairs are all past capacity
    probs = torch.softmax(ffn.router(x[0]), -1)
    top, idx = probs.topk(2, -1)
    assert idx[:, 0].eq(0).all() and idx[:, 1].eq(1).all()
    gate = top / top.sum(-1, keepdim=True)
    for i in range(n):
        want = torch.zeros(d, dtype=torch.float64)
        if i < cap:
            for j in range(2):
                e = int(idx[i, j])
                h = torch.nn.functional.silu(x[0, i] @ ffn.w1[e]) * (x[0, i] @ ffn.w3[e])
                want += gate[i, j] * (h @ ffn.w2[e])
        assert torch.allclose(out[0, i], want, atol=1e-12), i


def test_dispatch_runs_batched_expert_products_on_the_capacity_buffer():
    # the graph change: the dense path's einsums over every token and expert become bmm over
    # [experts, capacity, d]; forward FLOPs of the experts shrink to capacity x k / E of the dense
    from torch.utils.flop_counter import FlopCounterMode

    dense, disp = pair(cf=1.0)
    x = torch.randint(0, 64, (2, 16))
    gm = capture_step(disp, (x, x)).gm
    bmm = [n for n in gm.graph.nodes if n.target == torch.ops.aten.bmm.default]
    cap = disp.blocks[0].ffn.capacity(32)  # 1.0 * 32 tokens * 2 / 4 experts = 16
    shapes = {tuple(n.args[0].meta["val"].shape) for n in bmm}
    assert (4, cap, 32) in shapes, shapes  # [E, capacity, d] @ w1/w3
    flops = []
    for m in (dense, disp):
        with FlopCounterMode(display=False) as fc:
            m(x, x)
        flops.append(fc.get_total_flops())
    # 2 layers; tiny: d = ffn = 32, 4 experts, 32 tokens; 2 FLOPs per multiply-add
    dense_experts = 2 * 3 * 2 * 4 * 32 * 32 * 32 + 2 * 2 * 4 * 32 * 32  # three products + the gate einsum
    dispatched_experts = 2 * 3 * 2 * 4 * cap * 32 * 32  # three bmm over the capacity buffer
    assert flops[0] - flops[1] == dense_experts - dispatched_experts


def test_bench_flops_count_the_active_experts():
    # 6 per weight a token multiplies (not the embedding it looks up, nor the norms' scales; top_k of
    # the n_expert experts) + 12·L·d·T: the planner's count (costmodel.flops_per_token), MFU's numerator
    m = build("moe", "tiny")
    c = m.cfg
    total = sum(p.numel() for p in m.parameters())
    lookup = m.tok.weight.numel() + sum(p.numel() for p in m.parameters() if p.dim() == 1)
    experts = c.n_layer * 3 * c.n_expert * c.d_model * c.ffn
    want = 6 * (total - lookup - experts * (c.n_expert - c.top_k) / c.n_expert) + 12 * c.n_layer * c.d_model * 16
    assert flops_per_token(m, 16) == pytest.approx(want)


def test_bad_capacity_factor():
    with pytest.raises(ValueError, match="capacity_factor=0 must be a positive number"):
        build("moe", "tiny", capacity_factor=0)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_dispatched_moe_parity(pools, strategy):
    # pairs are dropped (capacity 1.0); each rank dispatches its own micro-batch, as the reference does
    check(pools, "moe", strategy, "fp64", 2, steps=3, over=(("capacity_factor", 1.0),), loss_tol=1e-10,
          param_tol=1e-10)


def test_dispatched_moe_runs_op_by_op_where_a_traced_view_is_not_one_in_eager():
    # with bf16 compute the dispatch's backward multiplies an expanded gradient by the transposed
    # gates: tracing saw a layout a view could read, the eager kernel lays the product out otherwise.
    # The FX executor and the node profiler run the graph with each view made a reshape (the same
    # view where one exists)
    torch.manual_seed(0)
    m = build("moe", "tiny", capacity_factor=1.25)
    x = torch.randint(0, 64, (2, 16))
    job = sw.compile(m, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), strategy="zero3", mesh=sw.mesh(dp=1),
                     mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
    losses = [float(job.step((x, x))) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    times = job.profile_compute((x, x))
    gm = job.programs()[0].gm
    views = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]
    assert views and all(v in times for v in views)  # every view ran, and was timed
    safe = eager_safe(gm)
    assert not any(n.target is torch.ops.aten.view.default for n in safe.graph.nodes)
    assert [n.name for n in safe.graph.nodes] == [n.name for n in gm.graph.nodes]


def test_a_router_loss_that_counts_expert_ids_with_bincount_traces_to_fixed_size_counts():
    """A load-balancing term that counts each expert's tokens with ``torch.bincount(ids, minlength=E)``
    (Mixtral's in transformers 5.17) has a data-dependent length; traced, it is E counts (a
    scatter_add), and the step's loss and gradients are eager's."""

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(8, 4, dtype=torch.float64)

        def forward(self, x):
            probs = self.router(x).softmax(-1)
            ids = probs.topk(2, -1).indices.reshape(-1)
            share = torch.bincount(ids, minlength=4).to(probs.dtype) / ids.numel()
            return (share * probs.mean(0)).sum() * 4 + probs.square().mean()

    torch.manual_seed(0)
    model, x = Routed(), torch.randn(16, 8, dtype=torch.float64)
    cap = capture_step(model, (x,))
    targets = {n.target for n in cap.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.bincount.default not in targets and torch.ops.aten.scatter_add.default in targets
    assert torch.bincount(torch.tensor([0, 5])).shape == (6,)  # put back as it was
    params = [p.detach() for p in model.parameters()]
    loss, *grads = eager_safe(cap.gm)(*params, x)
    ref = model(x)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    assert abs(float((loss - ref).detach())) < 1e-12
    assert max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)) < 1e-12
