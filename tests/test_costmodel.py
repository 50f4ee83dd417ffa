"""The cost model: α-β collectives, fitting, roofline compute and the two-lane step simulation."""

import dataclasses
import json

import harness

import pytest
import torch

from test_graph import captured, sw_nodes
from shardwise.costmodel import DEVICES, PRESETS, LinkProfile, bus_factor, fit, flops, node_time, simulate
from shardwise.sharding.collective import Collective, mark
from shardwise.costmodel import CostModel
from shardwise.passes import CAP_FACTORS, CAP_TIE, ShardContext, shard_step
from shardwise.passes import schedule as sched
from shardwise.passes.carveout import SMCarveout


def test_alpha_beta_matches_the_ring_formula():
    p = PRESETS["h200-nv18-x2"]  # `shardwise calibrate` over NCCL on our 2 H200s (2026-11-30)
    gib = 2**30
    # all-gather of 1 GiB over 2 ranks moves (n-1)/n of it at 279.5 GB/s bus bandwidth
    assert p.time("all_gather", gib, 2) == pytest.approx(71.72e-6 + gib * 0.5 / 279.51e9)
    assert p.time("all_reduce", gib, 2) == pytest.approx(75.69e-6 + gib * 1.0 / 290.22e9)
    assert bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8) and bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert p.time("all_reduce", gib, 1) == 0.0


def test_fit_recovers_alpha_and_bandwidth():
    alpha, bw, n = 25e-6, 200e9, 4
    samples = [(s, alpha + s * bus_factor("all_gather", n) / bw) for s in (2**k for k in range(10, 31, 2))]
    a, b = fit(samples, "all_gather", n)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)
    with pytest.raises(ValueError, match="do not grow with size"):
        fit([(1, 1.0), (2, 0.5)], "all_gather", 2)


def test_profile_round_trips_through_json(tmp_path):
    path = tmp_path / "p.json"
    PRESETS["nvlink-8gpu"].save(path)
    assert LinkProfile.load(path) == PRESETS["nvlink-8gpu"]
    bad = json.loads(path.read_text())
    bad["busbw"]["all_gather"] = 0
    with pytest.raises(ValueError, match="busbw > 0"):
        LinkProfile(bad["name"], bad["alpha"], bad["busbw"])


def test_roofline_counts_matmul_flops():
    _, cap = captured("llama")
    mms = [n for n in cap.gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default]
    n0 = mms[0]
    a, b = n0.args[0].meta["val"], n0.args[1].meta["val"]
    assert flops(n0) == 2 * a.shape[0] * a.shape[1] * b.shape[1]
    assert node_time(n0, DEVICES["h200"]) > 0


def test_simulation_hides_communication_behind_compute():
    _, cap = captured("llama")
    prog = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, max_in_flight=1 << 40))
    unsched = shard_step(cap, "zero3", ShardContext(4, "g", schedule=False))
    compute = lambda n: 1.0 if "mm" in str(n.target) else 0.0  # noqa: E731 - exact, deterministic estimators
    comm = lambda n: 0.5  # noqa: E731
    n_mm = sum(1 for n in cap.gm.graph.nodes if "mm" in str(n.target))
    n_coll = len(sw_nodes(prog.gm))
    tl_u = simulate(unsched.gm, compute, comm)
    tl_s = simulate(prog.gm, compute, comm)
    assert tl_u.compute_s == tl_s.compute_s == n_mm
    assert tl_u.comm_s == tl_s.comm_s == 0.5 * n_coll
    # unscheduled, every collective is waited for right after it starts: fully exposed
    assert tl_u.exposed_comm_s == pytest.approx(0.5 * n_coll)
    assert tl_s.exposed_comm_s < 0.5 * tl_u.exposed_comm_s
    assert tl_s.step_s < tl_u.step_s
    # with free communication the step is exactly the compute
    assert simulate(prog.gm, compute, lambda n: 0.0).step_s == n_mm


def test_explain_tables_collectives_with_predictions(pools):
    text = pools(2).run(harness.explain_text, "zero3")[0]
    assert "link profile: h200-nv18-x2" in text and "predicted step" in text and "exposed comm" in text
    rows = [line for line in text.splitlines() if line.strip().startswith(("all_gather", "reduce_scatter"))]
    assert len(rows) > 10
    # every row carries its mesh axis, phase, bytes and a positive predicted time
    for r in rows:
        kind, axis, phase, kib, pred = r.split()[:5]
        assert axis == "dp" and phase in ("fwd", "bwd") and float(kib.removesuffix("KiB")) > 0 and float(pred) > 0
    assert "blocks.0.attn.wq.weight" in text and "S(0)" in text


# -- cost-model-chosen buckets, memory liveness, measured time -------------------------------------

def _count_estimator(alpha, peak_of=None):
    """Deterministic stand-in for the cost model: alpha per collective, the liveness peak."""
    from shardwise.costmodel import liveness

    def est(gm):
        n = len(sw_nodes(gm))
        return alpha * n, (peak_of or (lambda g: liveness(g).peak))(gm)

    return est


def test_auto_buckets_pick_the_fastest_size_within_the_peak_slack():
    _, cap = captured("llama")
    per_param = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True))
    prog = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, shard_bucket_bytes="auto",
                                                 cost=CostModel.custom(estimate=_count_estimator(1.0)), bucket_peak_slack=100.0))
    rows = prog.bucket_choice
    assert rows[0][0] == 0 and sum(r[3] for r in rows) == 1
    chosen = next(r for r in rows if r[3])
    assert chosen[1] == min(r[1] for r in rows)  # fewest collectives wins when memory is free
    assert len(sw_nodes(prog.gm)) < len(sw_nodes(per_param.gm))
    assert len(sw_nodes(prog.gm)) == chosen[1]
    # a tight peak slack rules out buckets that raise the peak: only sizes within it can be chosen
    tight = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, shard_bucket_bytes="auto",
                                                  cost=CostModel.custom(estimate=_count_estimator(1.0)), bucket_peak_slack=1.0,
                                                  bucket_peak_floor=0))
    base = tight.bucket_choice[0][2]
    c = next(r for r in tight.bucket_choice if r[3])
    assert c[2] <= base
    # deterministic: the same graph gives the same choice and code
    again = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, shard_bucket_bytes="auto",
                                                  cost=CostModel.custom(estimate=_count_estimator(1.0)), bucket_peak_slack=100.0))
    assert again.gm.code == prog.gm.code


def _gather_bound_moe():
    """(the tiny MoE's capture, a stand-in cost model under which its expert weights take longer to
    gather than the products between them take: one unit per product, stretched by a carved
    product's SM share, bytes / 3000 per collective; its estimate, node time and collective time)."""
    from shardwise.costmodel import liveness

    _, cap = captured("moe")

    def compute(n):
        return 1.0 / n.meta.get("sm_share", 1.0) if "mm" in str(n.target) else 0.0

    def comm(n):
        return sched.payload(n) / 3000

    def est(gm):
        return simulate(gm, compute, comm).step_s, liveness(gm).peak

    return cap, est, compute, comm


def test_in_flight_cap_is_swept_where_gathers_outlast_the_compute_between_them():
    # an MoE's expert weights take longer to gather than the products between them take to run: with
    # two payloads in flight each gather is issued one ahead and the compute waits. The cost model
    # picks a larger cap, which issues the gathers further ahead (the graph change) and hides more
    from shardwise.costmodel import liveness

    cap, est, _, _ = _gather_bound_moe()
    prog = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, cost=CostModel.custom(estimate=est), bucket_peak_slack=100.0))
    rows = prog.schedule["cap_choice"]
    largest = max(sched.payload(s) for s in sw_nodes(prog.gm))
    assert [r[0] for r in rows] == [k * largest for k in CAP_FACTORS] and sum(r[3] for r in rows) == 1
    chosen = next(r for r in rows if r[3])
    # the smallest cap predicted within CAP_TIE of the fastest
    fastest = min(r[1] for r in rows)
    assert chosen[0] > rows[0][0] and chosen[1] < rows[0][1] and chosen[1] <= fastest * (1 + CAP_TIE)
    assert all(r[1] > fastest * (1 + CAP_TIE) for r in rows if r[0] < chosen[0])
    assert prog.schedule["max_in_flight"] == chosen[0]
    two = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, max_in_flight=rows[0][0]))
    assert sum(prog.schedule["prefetched"].values()) > sum(two.schedule["prefetched"].values())
    assert est(prog.gm) == (chosen[1], chosen[2]) and est(two.gm) == (rows[0][1], rows[0][2])
    # no memory to spare: a cap that raises the predicted peak is shown but not chosen
    tight = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, cost=CostModel.custom(estimate=est), bucket_peak_slack=1.0,
                                                  bucket_peak_floor=0))
    t_rows = tight.schedule["cap_choice"]
    assert all(r[2] <= t_rows[0][2] for r in t_rows if r[3]) and t_rows[-1][2] > t_rows[0][2]
    # gloo (one collective at a time) and an explicit cap are not swept
    for kw in ({"max_ops_in_flight": 1}, {"max_in_flight": 4 * largest}):
        fixed = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, cost=CostModel.custom(estimate=est), **kw))
        assert "cap_choice" not in fixed.schedule
    # predicted times equal but for rounding: the smallest cap, not a larger peak for nothing
    flat = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, bucket_peak_slack=100.0,
                                                 cost=CostModel.custom(estimate=lambda gm: (
                                                     1.0 - 1e-12 * liveness(gm).peak, liveness(gm).peak))))
    assert flat.schedule["cap_choice"][0][3] and flat.gm.code == two.gm.code
    # a predicted gain below CAP_TIE (1% per doubling, as measured runs showed to be noise) keeps the smallest
    small = shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, bucket_peak_slack=100.0,
                                                  cost=CostModel.custom(estimate=lambda gm: (
                                                      1.0 - 0.01 * (gm.code != two.gm.code), liveness(gm).peak))))
    assert small.schedule["cap_choice"][0][3] and small.gm.code == two.gm.code
    # with auto buckets (the default): buckets chosen, then the cap swept once, the same every time
    auto = [shard_step(cap, "zero3", ShardContext(4, "g", schedule=True, cost=CostModel.custom(estimate=est), shard_bucket_bytes="auto",
                                                  bucket_peak_slack=100.0)) for _ in range(2)]
    assert auto[0].bucket_choice and auto[0].schedule["cap_choice"] and auto[0].gm.code == auto[1].gm.code


def test_a_memory_budget_sweeps_the_cap_of_the_plan_it_keeps_under_the_budget():
    # the budget is the smallest cap's own peak: the plan fits as it is (no recomputation), and the
    # sweep may not take a cap whose peak is over the budget

    cap, est, _, _ = _gather_bound_moe()
    base = ShardContext(4, "g", schedule=True, cost=CostModel.custom(estimate=est), bucket_peak_slack=100.0, reserve=10**12)
    free = shard_step(cap, "zero3", base)
    assert next(r for r in free.schedule["cap_choice"] if r[3])[0] > free.schedule["cap_choice"][0][0]
    budget = free.schedule["cap_choice"][0][2]
    prog = shard_step(cap, "zero3", dataclasses.replace(base, graph_budget=budget))
    assert not prog.recomputed and prog.unsharded == []  # the reserve keeps nothing gathered
    rows = prog.schedule["cap_choice"]
    assert rows[0][3] and all(r[2] > budget for r in rows[1:])  # larger caps were over the budget
    assert prog.predicted_graph_peak <= budget
    roomy = shard_step(cap, "zero3", dataclasses.replace(base, graph_budget=10**12))
    assert next(r for r in roomy.schedule["cap_choice"] if r[3])[0] > rows[0][0]


def test_auto_buckets_need_the_cost_model():
    _, cap = captured("gpt")
    with pytest.raises(ValueError, match="estimate"):
        shard_step(cap, "zero3", ShardContext(4, "g", shard_bucket_bytes="auto"))


def test_liveness_frees_after_last_use_and_follows_aliases():
    import torch.fx as fx

    from shardwise.costmodel import liveness
    from shardwise.passes.emit import fake

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = fake([256], torch.float32, torch.device("cpu"))
    a = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))      # 1 KiB, alive until v's last use
    a.meta["val"] = fake([256], torch.float32, torch.device("cpu"))
    v = g.call_function(torch.ops.aten.view.default, (a, [16, 16]))  # an alias: no bytes of its own
    v.meta["val"] = fake([16, 16], torch.float32, torch.device("cpu"))
    b = g.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))      # 1 KiB
    b.meta["val"] = fake([256], torch.float32, torch.device("cpu"))
    c = g.call_function(torch.ops.aten.sum.default, (v,))          # last use of a (through v)
    c.meta["val"] = fake([], torch.float32, torch.device("cpu"))
    d = g.call_function(torch.ops.aten.add.Tensor, (b, c))
    d.meta["val"] = fake([256], torch.float32, torch.device("cpu"))
    g.output([d])
    live = liveness(fx.GraphModule(torch.nn.Module(), g))
    # a and b live together (2 KiB + the scalar), a dies at c, then b + d (the output) = 2 KiB + 4
    assert live.peak == 2048 + 4 and live.peak_at == c.name
    assert live.outputs == 1024
    assert sorted(live.at_peak) == sorted([(a.name, 1024), (b.name, 1024), (c.name, 4)])
    # fused (inductor): b feeds only an elementwise add, so it is computed inside it
    fused = liveness(fx.GraphModule(torch.nn.Module(), g), fused=True)
    assert fused.peak < live.peak


def test_fused_liveness_of_a_loss_follows_inductors_kernels():
    # cross-entropy on bf16 logits, forward and backward in one graph. Run op by op it holds three
    # fp32 logits-sized tensors (log-softmax, nll_loss's gradient, log-softmax's gradient); inductor
    # computes all three inside the kernel that writes the bf16 gradient, and writes it into the
    # logits' buffer, which dies there: one logits-sized buffer, not two, not three.
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardwise.costmodel import liveness

    def step(x, w, t):
        (g,) = torch.autograd.grad(F.cross_entropy((x @ w).float(), t), w)
        return g

    N, D, V = 64, 16, 512
    gm = make_fx(step, tracing_mode="fake")(torch.randn(N, D, dtype=torch.bfloat16),
                                            torch.randn(D, V, dtype=torch.bfloat16, requires_grad=True),
                                            torch.randint(0, V, (N,)))
    logits = N * V * 2
    eager = liveness(gm)
    assert eager.peak == 3 * 2 * logits
    assert [b for _, b in eager.at_peak] == [2 * logits] * 3
    separate = liveness(gm, fused=True, inplace=False, cpu_code=False)
    assert logits * 2 <= separate.peak < logits * 2 + 64
    fused = liveness(gm, fused=True, cpu_code=False)
    assert fused.peak == logits + D * V * 2  # the gradient in the logits' buffer, then the weight's gradient
    assert not any(b >= 2 * logits for _, b in fused.at_peak)
    for live in (eager, separate, fused):  # what is listed at the peak is the peak, each buffer once
        assert sum(b for _, b in live.at_peak) == live.peak


def test_fused_liveness_stores_what_feeds_a_matrix_product_through_a_view():
    # inductor realizes a library kernel's input: an elementwise result reshaped into a matmul is a
    # buffer of its own, however few consumers it has; one that only feeds elementwise code is not
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardwise.costmodel import liveness

    def f(x, w):
        h = x * 2
        return (h.view(64, 32) @ w) + (x * 3).sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 32, 32), torch.randn(32, 8))
    live = liveness(gm, fused=True, cpu_code=False)
    muls = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    # x * 2 (8 KiB) stored and alive with the product (2 KiB); x * 3 summed in the same kernel
    assert live.peak == 64 * 32 * 4 + 64 * 8 * 4
    assert sorted(live.at_peak) == sorted([(muls[0].name, 64 * 32 * 4), ("mm", 64 * 8 * 4)])


def test_fused_liveness_in_cpu_code_and_the_embedding_gradients_fp32_buffer():
    # C++ code stores a result with two consumers in different kernels that holds a heavy op (tanh);
    # GPU code recomputes it in each (on CPU inductor's code holds the 4 tiles, checked with
    # runtime.memory.inductor_wrapper_peak). A bf16 embedding gradient is accumulated in an fp32
    # buffer of inductor's own beside the bf16 result.
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardwise.costmodel import liveness

    def f(x, w, v):
        m = x @ w
        d = m.tanh()
        a = (d * 2) @ v
        return ((d + 1) * a).sum(), m

    gm = make_fx(f, tracing_mode="fake")(torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64))
    tile = 64 * 64 * 4
    assert liveness(gm, fused=True, cpu_code=True).peak == 4 * tile  # m, tanh(m), 2·tanh(m), the product
    assert liveness(gm, fused=True, cpu_code=False).peak == 3 * tile

    def emb(w, idx):
        (g,) = torch.autograd.grad(F.embedding(idx, w).float().square().sum(), w)
        return g

    V, D = 1000, 64
    gm = make_fx(emb, tracing_mode="fake")(torch.randn(V, D, dtype=torch.bfloat16, requires_grad=True),
                                           torch.randint(0, V, (128,)))
    live = liveness(gm, fused=True, cpu_code=False)
    assert live.outputs == V * D * 2  # the gradient leaves the graph in bf16
    assert dict(live.at_peak)["embedding_dense_backward (scratch)"] == V * D * 4


def test_interval_arithmetic_of_exposed_communication():
    from shardwise.runtime.profile import merge, subtract

    comm = merge([(0, 10), (5, 12), (20, 30)])
    assert comm == [(0, 12), (20, 30)]
    comp = merge([(2, 4), (8, 25)])
    # exposed: [0,2) + [4,8) + [25,30) = 2 + 4 + 5
    assert subtract(comm, comp) == 11


def test_exposed_communication_by_collective_kind_and_place():
    from shardwise.runtime.profile import merge, nccl_kind, exposed_by_kernel

    assert nccl_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "all_gather"
    assert nccl_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "reduce_scatter"
    assert nccl_kind("ncclKernel_AllReduce_RING_LL_Sum_float") == "all_reduce"
    # µs: an all-gather at the head with nothing to hide behind, one hidden, a reduce-scatter at the tail
    # (the profiler's list may hold a kernel twice: it counts once)
    comm = [(0, 1000, "all_gather"), (2000, 3000, "all_gather"), (9000, 9600, "reduce_scatter")] * 2
    comp = merge([(1000, 9200)])
    by, top = exposed_by_kernel(comm, comp)
    assert by == {"all_gather": 1000, "reduce_scatter": 400}
    assert top == [{"kind": "all_gather", "at_ms": 0.0, "exposed_ms": 1.0, "kernel_ms": 1.0},
                   {"kind": "reduce_scatter", "at_ms": 9.0, "exposed_ms": 0.4, "kernel_ms": 0.6}]


def test_gathers_held_back_by_a_running_product():
    # µs. The MoE forward's pattern: a gather ends, the product that needed it starts at once and takes
    # every SM, the next gather (queued long before) starts only as that product ends
    from shardwise.runtime.profile import gathers_held_back

    comm = [(0, 2000, "all_gather"), (3500, 5500, "all_gather"), (5500, 7500, "all_gather")] * 2
    comp = [(2010, 3480), (5510, 6990), (7000, 7100)]
    assert gathers_held_back(comm, comp) == (1, 1500)  # the second; the third ran back to back
    # not held: the link idle with no product across the gap, a short kernel, a reduce-scatter
    # (it waits for the gradient a product makes), a gather far from the product's end
    assert gathers_held_back(comm, [(2500, 3480)]) == (0, 0)
    assert gathers_held_back(comm, [(2010, 2150), (2150, 3480)]) == (0, 0)
    assert gathers_held_back([(0, 2000, "reduce_scatter"), (3500, 5500, "reduce_scatter")], comp) == (0, 0)
    assert gathers_held_back(comm, [(2010, 3000)]) == (0, 0)


def test_measured_compute_and_exposed_comm(pools):
    res = pools(2).run(harness.measured_prediction)
    (times0, pred0, meas0), (times1, _, _) = res
    assert times0 == times1  # reduced across ranks: every rank holds the same numbers
    assert pred0["compute_source"] == "measured" and pred0["step_s"] > 0
    assert meas0["exposed_s"] > 0 and 0 < meas0["exposed_pct"] < 100  # gloo: blocked in waits


def test_host_link_measures_and_bounds_a_streamed_step(tmp_path):
    import torch

    from shardwise.costmodel import LinkProfile, PRESETS
    from shardwise.costmodel.hostlink import HostLink, measure

    h = measure(torch.device("cpu"), 8 * 2**20, iters=2)
    assert h.h2d > 0 and h.d2h > 0 and h.both > 0
    link = HostLink(50e9, 40e9, 80e9)
    # one direction alone bounds it, or both together when the sum exceeds what the link carries at once
    assert link.stream_time(10e9, 0) == 10e9 / 50e9
    assert link.stream_time(0, 10e9) == 10e9 / 40e9
    assert link.stream_time(20e9, 20e9) == 40e9 / 80e9
    p = PRESETS["cpu-gloo"]
    prof = LinkProfile(p.name, p.alpha, p.busbw, p.source, {"h2d": 1e9, "d2h": 2e9, "both": 2.5e9})
    prof.save(tmp_path / "p.json")
    back = LinkProfile.load(tmp_path / "p.json")
    assert back.host_link().both == 2.5e9 and PRESETS["cpu-gloo"].host_link() is None


def test_liveness_mode_follows_the_executor_and_host_copies():
    # inductor's code is modelled fused, and with in-place reuse unless the graph copies values to
    # the host on a side stream (compile_graph turns reuse off there); the FX executor runs op by op
    import torch.fx as fx

    from shardwise.runtime.ops import TO_HOST

    def graph(copy_out: bool) -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
        g.output(g.call_function(TO_HOST, (y,)) if copy_out else y)
        return fx.GraphModule(torch.nn.Module(), g)

    inductor, fx_exec = (CostModel.for_job(None, "cpu", fused=f) for f in (True, False))
    assert inductor.liveness_mode(graph(False)) == {"fused": True, "inplace": True}
    assert inductor.liveness_mode(graph(True)) == {"fused": True, "inplace": False}
    assert fx_exec.liveness_mode(graph(False)) == {"fused": False, "inplace": False}


def test_the_carveout_is_applied_to_the_chosen_program_not_to_the_candidates():
    # the cost model charges a carved product for the SMs it gives up but does not credit the overlap
    # it buys, so carving the candidates would push the cap and bucket choices away from overlap: the
    # choices are made uncarved and the program they settle on is carved afterwards
    cap, est, compute, comm = _gather_bound_moe()
    kw = dict(schedule=True, cost=CostModel.custom(compute, comm, est), shard_bucket_bytes="auto",
              bucket_peak_slack=100.0)
    plain = shard_step(cap, "zero3", ShardContext(4, "g", **kw))
    carved = shard_step(cap, "zero3", ShardContext(4, "g", sm_carveout=SMCarveout(24, 48), **kw))
    assert carved.carved > 0 and plain.carved == 0
    assert carved.schedule["cap_choice"] == plain.schedule["cap_choice"]
    assert carved.bucket_choice == plain.bucket_choice
    assert [n.name for n in carved.gm.graph.nodes] == [n.name for n in plain.gm.graph.nodes]
    # and carved, the same program is predicted slower without the SM contention model (its cost
    # counted, the contention it removes not)
    assert est(carved.gm)[0] > est(plain.gm)[0]


def _prefetch_two(hold_share: dict, cast_s: float = 0.0):
    """Two gathers issued up front, each waited for right before the product that needs it: compute
    1 s per product, 1 s per gather; ``hold_share``: the share of the SMs each product leaves free;
    ``cast_s``: a kernel of that many seconds between the first wait and its product."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    starts = []
    for i in range(2):
        c = g.call_function(torch.ops.aten.clone.default, (x,), name=f"gather{i}")
        mark(c, Collective("all_gather", 0, 0, 2, params=(f"w{i}",)))
        starts.append(c)
    y = x
    for i, c in enumerate(starts):
        w = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (c,))
        if i == 0:
            w = g.call_function(torch.ops.aten.relu.default, (w,), name="cast")
        y = g.call_function(torch.ops.aten.mm.default, (y, w), name=f"product{i}")
    g.output(y)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    times = {"product0": 1.0, "product1": 1.0, "cast": cast_s}
    return [simulate(gm, lambda n: times.get(n.name, 0.0), lambda n: 1.0, free)
            for free in (None, lambda n: hold_share.get(n.name, 1.0))]


def test_sm_contention_holds_a_collective_back_behind_a_product_that_fills_every_sm():
    # without contention the second gather runs beside the first product: step 3 s, 1 s exposed
    plain, held = _prefetch_two({"product0": 0.0})
    assert (plain.step_s, plain.exposed_comm_s) == (3.0, 1.0)
    # product0 holds every SM: gather1, due when gather0 ends (as product0 starts), starts when it ends
    assert (held.step_s, held.exposed_comm_s) == (4.0, 2.0)
    assert [(s, e) for lane, _, s, e in held.events if lane == "comm"] == [(0.0, 1.0), (1.0 + 1.0, 3.0)]
    # a short kernel between: the gather is due 10 µs before the product starts, within RACE_S,
    # and still loses the SMs to it; due 1 ms before, it starts first and runs beside the product
    _, raced = _prefetch_two({"product0": 0.0}, cast_s=10e-6)
    assert [e for lane, _, _, e in raced.events if lane == "comm"] == [1.0, 1.0 + 10e-6 + 2.0]
    _, ahead = _prefetch_two({"product0": 0.0}, cast_s=1e-3)
    assert [(s, e) for lane, _, s, e in ahead.events if lane == "comm"] == [(0.0, 1.0), (1.0, 2.0)]
    # a product leaving half the SMs the gather needs: it runs beside, twice as long
    _, half = _prefetch_two({"product0": 0.5})
    assert [(s, e) for lane, _, s, e in half.events if lane == "comm"] == [(0.0, 1.0), (1.0, 3.0)]
    # a product leaving every SM it needs: as without contention
    _, free = _prefetch_two({"product0": 1.0})
    assert (free.step_s, sorted(free.events)) == (plain.step_s, sorted(plain.events))


def test_auto_carveout_carves_where_the_contention_model_predicts_a_faster_step(monkeypatch):
    from shardwise.passes import carveout
    from shardwise.runtime.ops import CARVED

    # the tiny MoE's products are far below one tile per SM: count every product as filling the SMs
    monkeypatch.setattr(carveout, "TILE", 1)
    cap, est, compute, comm = _gather_bound_moe()
    kw = dict(schedule=True, cost=CostModel.custom(compute, comm, est))
    auto = carveout.SMCarveout(32, 64, auto=True)  # a carved product keeps half the SMs: twice as long
    plain = shard_step(cap, "zero3", ShardContext(4, "g", **kw))
    carved = shard_step(cap, "zero3", ShardContext(4, "g", sm_carveout=auto, **kw))
    # gather-bound: uncarved, each product holds the next gather back; carved, they overlap
    before, after, keep = carved.carve_choice
    assert keep and carved.carved > 0 and after <= before * (1 - carveout.CARVE_TIE), carved.carve_choice
    assert before == simulate(plain.gm, compute, comm, carveout.contention(auto)).step_s
    assert any(n.target in CARVED.values() for n in carved.gm.graph.nodes)
    # where the collectives are short, holding them back costs little and carving costs the products
    # their SMs: not carved, and the program is the uncarved one
    fast = dict(kw, cost=CostModel.custom(compute, lambda n: sched.payload(n) / 3e6, est))
    plain = shard_step(cap, "zero3", ShardContext(4, "g", **fast))
    kept = shard_step(cap, "zero3", ShardContext(4, "g", sm_carveout=auto, **fast))
    assert kept.carve_choice[2] is False and kept.carved == 0 and kept.carve_choice[1] > kept.carve_choice[0]
    assert str(kept.gm.graph) == str(plain.gm.graph) and kept.gm.code == plain.gm.code
    assert not any("sm_share" in n.meta or "sw_product" in n.meta for n in kept.gm.graph.nodes)
    # a product's free share: none for a product filling the SMs, carved SMs over the need for a
    # carved one, all for anything else
    free = carveout.contention(auto)
    kinds = {}
    for n in carved.gm.graph.nodes:
        if n.op == "call_function" and (n.target in CARVED or n.target in CARVED.values()
                                        or n.target is torch.ops.aten.add.Tensor):
            kinds[n.target in CARVED.values(), n.target is torch.ops.aten.add.Tensor] = free(n)
    assert kinds[True, False] == 1.0 and kinds[False, True] == 1.0
    # a carved product leaving 32 SMs, for a collective that needs 64: half
    assert carveout.contention(carveout.SMCarveout(32, 64, need=64))(
        next(n for n in carved.gm.graph.nodes if n.target in CARVED.values())) == 0.5
    # off CUDA the collectives take no SMs: "auto" never carves; a number carves, inert (share 1)
    from shardwise.passes.carveout import choose as choose_carveout

    assert choose_carveout("auto", torch.device("cpu")) is None
    assert choose_carveout(16, torch.device("cpu")) == SMCarveout(16, 0) and SMCarveout(16, 0).share == 1.0


def test_auto_carveout_is_on_only_where_it_was_measured(monkeypatch):
    # "auto" carves over NCCL on Hopper-class NVIDIA GPUs of more than 64 SMs, with the scheduler on;
    # anywhere else it keeps every SM, while a number is honoured wherever the API exists
    import types

    from shardwise.passes.carveout import CARVE_MIN_S
    from shardwise.passes.carveout import choose as choose_carveout

    gpu = {"major": 9, "multi_processor_count": 132}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(**gpu))
    cuda = torch.device("cuda", 0)
    assert choose_carveout("auto", cuda, "nccl") == SMCarveout(32, 132, CARVE_MIN_S, auto=True)
    assert choose_carveout("auto", cuda, "gloo") is None  # several ranks on one GPU over gloo
    assert choose_carveout("auto", cuda, "nccl", schedule=False) is None  # the unscheduled baseline
    assert choose_carveout(24, cuda, "gloo", schedule=False) == SMCarveout(24, 132, CARVE_MIN_S)
    gpu["major"] = 8  # an A100: not measured
    assert choose_carveout("auto", cuda, "nccl") is None and choose_carveout(24, cuda).sms == 24
    gpu.update(major=9, multi_processor_count=64)
    assert choose_carveout("auto", cuda, "nccl") is None
    gpu["multi_processor_count"] = 132
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert choose_carveout("auto", cuda, "nccl") is None


def test_roofline_counts_no_time_for_views_and_python_helpers():
    # detach is a view; keep_alive (passes/schedule.py) is a Python no-op: neither runs a kernel
    from shardwise.passes.schedule import keep_alive

    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(1024, 1024)
    d = g.call_function(torch.ops.aten.detach.default, (x,))
    d.meta["val"] = torch.empty(1024, 1024)
    k = g.call_function(keep_alive, (x, d))
    r = g.call_function(torch.ops.aten.relu.default, (d,))
    r.meta["val"] = torch.empty(1024, 1024)
    c = g.call_function(torch.ops.aten.cat.default, ([x, d],))  # a copy, though its name ends in "t.default"
    c.meta["val"] = torch.empty(2048, 1024)
    h = DEVICES["h200"]
    assert node_time(d, h) == 0.0 and node_time(k, h) == 0.0
    assert node_time(r, h) == 2 * 1024 * 1024 * 4 / h.bandwidth
    assert node_time(c, h) == 4 * 1024 * 1024 * 4 / h.bandwidth
