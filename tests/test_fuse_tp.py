"""Products fused with their tensor-parallel collectives (issue 26): the decomposed path against the
kernels' references on real ranks, the rewrite's graph change, the cost model's choice, and training
through the rewrite as one device does."""

from collections import Counter

import harness
import pytest
import torch
from test_tp import _check

import shardwise as sw
from shardwise.costmodel import CostModel
from shardwise.costmodel.fused import Fused, fused_s
from shardwise.costmodel.devices import DEVICES
from shardwise.kernels import ag_gemm, gemm_rs
from shardwise.sharding.collective import collective_of


def ring_vs_reference(seed: int):
    """On every rank: the decomposed path (kernels/ring.py) against the kernels' references, on random
    operands of each rank, gathered to every rank to compute the reference. Returns the largest
    relative error."""
    import torch.distributed as dist

    from shardwise.kernels import ring

    r, p = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    g = torch.Generator().manual_seed(seed * 97 + r)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def everyone(t):
        out = [torch.empty_like(t) for _ in range(p)]
        dist.all_gather(out, t.contiguous())
        return out

    def err(x, y):
        return float((x - y).norm() / y.norm())

    worst = 0.0
    for dim in (0, 1):  # gathered and scattered along the rows' first dim, or the sequence of [batch, seq, k]
        x, ws = rand(3, 4, 8) if dim else rand(4, 3, 8), [rand(8, 5), rand(8, 6)]  # ws alike on every rank
        ws = [everyone(w)[0] for w in ws]
        got, ref = ring.ag_mm(x, ws, dim, name), ag_gemm.reference(everyone(x), ws, dim)
        worst = max(worst, *(err(a, b) for a, b in zip(got, ref)))
        shape = [3, 4 * p, 5] if dim else [4 * p, 3, 5]
        a, w, c = rand(12 * p, 8), rand(8, 5), rand(*shape)
        parts = list(zip(everyone(a), everyone(w), everyone(c)))
        worst = max(worst, err(ring.mm_rs(a, w, c, shape, dim, name), gemm_rs.reference(parts, shape, dim)[r]),
                    err(ring.mm_rs(a, w, None, shape, dim, name),
                        gemm_rs.reference([(a_, w_, None) for a_, w_, _ in parts], shape, dim)[r]))
    a, w, c = rand(10, 8), rand(8, 5), rand(10, 5)
    total = sum(a_ @ w_ + c_ for a_, w_, c_ in zip(everyone(a), everyone(w), everyone(c)))
    return max(worst, err(ring.mm_ar(a, w, c, 3, name), total))  # 3 blocks of 4, 3 and 3 rows


@pytest.mark.parametrize("ws", [2, 4])
def test_the_decomposed_path_computes_what_the_references_do(pools, ws):
    assert max(pools(ws).run(ring_vs_reference, 0)) <= 1e-14


def _fused_graph(sp: bool, head_split: bool, mode: str = "ring", cost=None):
    from shardwise.capture import capture_step
    from shardwise.passes import fuse_tp, tp

    torch.manual_seed(0)
    cap = capture_step(harness.make_model("llama", "fp64"), harness.make_batch("llama", 0, 0))
    local = tp.partition(cap, tp.megatron_plan(cap, 2, lambda split, whole: head_split), 2, "tp-group",
                         sequence_parallel=sp)[0]
    kinds = lambda: Counter((collective_of(n).kind, collective_of(n).phase)  # noqa: E731
                            for n in local.gm.graph.nodes if collective_of(n))
    before = kinds()
    rows = fuse_tp.apply(local, mode, cost or CostModel.for_job(None, "cpu"), False)
    fused = Counter(n.meta["tp_fused"].kind for n in local.gm.graph.nodes if "tp_fused" in n.meta)
    return before, kinds(), fused, rows, local.gm


def test_the_rewrite_fuses_each_product_beside_a_tp_collective():
    """The graph change on the tiny 2-layer Llama at tp=2. Under sequence parallelism each layer's two
    gathers before a column-parallel pair (q|k|v, gate|up) and the vocab-parallel head's become one
    ``ag_mm`` each with the products that read the gathered rows (5 forward), and so do the backward
    gathers of the row-parallel products' output gradients (4, the gathered value returned for the
    weight gradient's product too); each row-parallel product's reduce-scatter becomes ``mm_rs``
    (4 forward), as do the backward's input-gradient sums (4: the last product fused, the rest added
    in) and the head's input gradient (1). What is left on tp reads no product: the embedding's
    partial lookup and its gradient's gather, the head's row statistics, the loss, the norms' summed
    gradients. Without sequence parallelism every all-reduce of a product's sum is ``mm_ar``."""
    before, after, fused, rows, _ = _fused_graph(sp=True, head_split=True)
    assert fused == {"all_gather": 9, "reduce_scatter": 9} and len(rows) == 18
    assert rows[0]["site"].endswith("-> blocks.0.attn.wq.weight,blocks.0.attn.wk.weight,blocks.0.attn.wv.weight")
    assert after == {("reduce_scatter", "fwd"): 1, ("all_gather", "bwd"): 1, ("all_reduce", "fwd"): 3,
                     ("all_reduce", "bwd"): 2}
    assert before[("all_gather", "fwd")] == before[("reduce_scatter", "fwd")] == 5
    before, after, fused, rows, gm = _fused_graph(sp=False, head_split=False)
    assert before == {("all_reduce", "fwd"): 4, ("all_reduce", "bwd"): 4} and after == {}
    assert fused == {"all_reduce": 8} and all(r["impl"] == "ring" for r in rows)
    mm = torch.ops.aten.mm.default
    assert sum(n.target is mm for n in gm.graph.nodes) > 0  # the other products stay
    # with the head and embedding vocab-parallel the residual stream is a partial sum reduced once per
    # reader: those reductions read the stream, not a product alone, and stay
    _, after, fused, _, _ = _fused_graph(sp=False, head_split=True)
    assert fused == {"all_reduce": 6} and after == {("all_reduce", "fwd"): 7, ("all_reduce", "bwd"): 1}


class _Stub:
    def __init__(self, ring: float):
        self.times = {"plain": 1.0, "ring": ring}

    def fused_time(self, f, impl):
        return self.times[impl]


def test_auto_takes_what_the_cost_model_predicts_faster():
    _, _, fused, rows, _ = _fused_graph(sp=True, head_split=True, mode="auto", cost=_Stub(0.5))
    assert sum(fused.values()) == len(rows) == 18
    _, after, fused, rows, _ = _fused_graph(sp=True, head_split=True, mode="auto", cost=_Stub(0.99))
    assert not fused and all(r["impl"] == "plain" for r in rows)  # within FUSE_TIE: not worth it
    assert after[("all_gather", "fwd")] == 5
    _, _, fused, rows, _ = _fused_graph(sp=True, head_split=True, mode="off")
    assert not fused and not rows
    # the CPU's own cost model: each site as its predictions say
    _, _, fused, rows, _ = _fused_graph(sp=True, head_split=True, mode="auto")
    for r in rows:
        best = min(r["predicted"], key=r["predicted"].get)
        assert r["impl"] == (best if r["predicted"][best] < 0.98 * r["predicted"]["plain"] else "plain")
    assert sum(fused.values()) == sum(r["impl"] != "plain" for r in rows)


def test_the_fused_cost_model():
    """The ring runs p steps of one block each, a step the longer of its products and its transfer;
    the kernel keeps the product whole at its efficiency, the shards moving under it."""
    h200 = DEVICES["h200"]
    link = CostModel.for_job(None, "cuda", "nccl", "NVIDIA H200").link
    f = Fused("plain", "all_gather", 8192 * 4096 * 2, 2, ((8192, 4096, 14336 // 2),), 2)
    plain, ring, kernel = (fused_s(f, i, h200, link.time) for i in ("plain", "ring", "kernel"))
    mm = 2 * 8192 * 4096 * 7168 / h200.flops
    comm = link.time("all_gather", f.full_bytes, 2)
    assert plain == pytest.approx(mm + comm, rel=1e-6)
    assert ring == pytest.approx(mm / 2 + max(mm / 2, comm), rel=1e-3)
    eff = 0.985  # the kernels' measured share of cuBLAS at this product's FLOPs (4.8e11: KERNEL_EFFICIENCY)
    assert kernel == pytest.approx(max(mm / eff, mm / eff / 2 + comm) + 20e-6, rel=1e-3)
    assert ring < plain and kernel < plain  # on a shape like Llama 8B's, overlap pays
    tiny = Fused("plain", "all_gather", 64 * 256 * 2, 2, ((64, 256, 512),), 2)
    assert fused_s(tiny, "ring", h200, link.time) > fused_s(tiny, "plain", h200, link.time) * 0.98


@pytest.mark.parametrize("name,strategy,ws,sp,micro", [
    ("llama", "ddp", 2, False, 1), ("llama", "ddp", 2, True, 1), ("llama", "zero3", 4, True, 2),
    ("gpt", "zero2", 4, False, 1),
])
def test_fused_products_train_as_one_device(pools, name, strategy, ws, sp, micro):
    """fp64 parity through the decomposed path, against single-device training; zero3 gathers the
    weights the fused ops read over dp as it does a product's."""
    info = _check(pools, name, strategy, ws, 2, micro, sequence_parallel=sp, tp_fuse="ring", vocab_parallel=False)
    taken = Counter(r["kind"] for r in info["fuse"] if r["impl"] == "ring")
    assert taken and all(r["impl"] == "ring" for r in info["fuse"])
    if sp:
        assert taken["all_gather"] > 0 and taken["reduce_scatter"] > 0
    else:
        assert set(taken) == {"all_reduce"}
    assert "fused; predicted µs per way" in info["explain"]


def test_inductor_runs_the_fused_ops(pools):
    """Inductor calls the fused ops as library kernels (their list of outputs, their optional addend)."""
    info = _check(pools, "llama", "ddp", 2, 2, sequence_parallel=True, tp_fuse="ring", vocab_parallel=False,
                  compile="inductor", over=(("n_layer", 1),))  # one layer: inductor's compile is the test's time
    assert all(r["impl"] == "ring" for r in info["fuse"]) and len(info["fuse"]) == 8  # 4 kinds x 1 layer x 2


def test_a_calibrated_link_carries_the_kernels_rate(tmp_path):
    from shardwise.costmodel.collectives import PRESETS, LinkProfile

    slow = LinkProfile(**{**PRESETS["h200-nv18-x2"].__dict__, "fused": [[float("inf"), 0.5]]})
    slow.save(tmp_path / "link.json")
    assert LinkProfile.load(tmp_path / "link.json") == slow and "0.50 of the library's" in str(slow)
    f = Fused("kernel", "all_gather", 8192 * 4096 * 2, 2, ((8192, 4096, 7168),), 2)
    fast, halved = (CostModel.for_job(lp, "cuda", "nccl", "NVIDIA H200").fused_time(f, "kernel")
                    for lp in (None, str(tmp_path / "link.json")))
    assert halved > 1.8 * fast


def kernels_under_a_budget():
    model = harness.make_model("llama", "fp64")
    job = sw.compile(model, optimizer=harness.adamw, mesh=sw.mesh(tp=2), tp_fuse="kernel", memory_budget=2**30)
    try:
        job.step(harness.make_batch("llama", 0, 0))
    except ValueError as e:
        return str(e)
    return None


def test_tp_fuse_is_refused_where_it_cannot_run(pools):
    for says in pools(2).run(kernels_under_a_budget):
        assert "not in the memory plan yet" in says
    with pytest.raises(ValueError, match="tp_fuse must be"):
        sw.compile(harness.make_model("llama", "fp64"), optimizer=harness.adamw, tp_fuse="fast")
    with pytest.raises(ValueError, match="use a mesh with one"):
        sw.compile(harness.make_model("llama", "fp64"), optimizer=harness.adamw, tp_fuse="ring")
    with pytest.raises(ValueError, match="needs CUDA, Triton"):
        _fused_graph(sp=True, head_split=True, mode="kernel")
