"""The latency-hiding scheduler (passes/schedule.py): prefetch, late waits, the in-flight cap, determinism."""

import pytest

from test_graph import captured, sw_nodes
from shardwise.capture import forward_nodes
from shardwise.costmodel import CostModel
from shardwise.passes import ShardContext, shard_step
from shardwise.passes.carveout import SMCarveout
from shardwise.passes.schedule import WAIT, keep_alive, payload
from shardwise.sharding.collective import collective_of

WS = 4
BIG = 1 << 40


def order_of(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def in_flight_profile(gm):
    """Bytes of collectives started and not yet waited for, after each node."""
    flight, out = 0, []
    for n in gm.graph.nodes:
        if collective_of(n):
            flight += payload(n)
        elif n.op == "call_function" and n.target is WAIT:
            flight -= payload(n.args[0])
        out.append(flight)
    return out


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_unbounded_cap_starts_every_gather_before_compute(name):
    _, cap = captured(name)
    prog = shard_step(cap, "zero3", ShardContext(WS, "g", schedule=True, max_in_flight=BIG))
    pos = order_of(prog.gm)
    first_mm = min(pos[n] for n in prog.gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target))
    for s in sw_nodes(prog.gm, "all_gather"):
        assert pos[s] < first_mm
    # and each wait sits late: no matrix product runs between a wait and the first node that needs
    # it (waits retire in issue order, so an older one may be placed with a younger one's)
    nodes = list(prog.gm.graph.nodes)
    for w in (n for n in nodes if n.op == "call_function" and n.target is WAIT):
        first_user = min(pos[u] for u in w.users)
        between = nodes[pos[w] + 1 : first_user]
        assert not [b for b in between if b.op == "call_function" and "mm" in str(b.target)], (w, between)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_cap_on_bytes_in_flight_holds(strategy):
    _, cap = captured("llama")
    base = shard_step(cap, strategy, ShardContext(WS, "g", schedule=False))
    largest = max(payload(s) for s in sw_nodes(base.gm))
    for limit in (largest, 2 * largest, 5 * largest):
        prog = shard_step(cap, strategy, ShardContext(WS, "g", schedule=True, max_in_flight=limit))
        assert max(in_flight_profile(prog.gm)) <= limit
        assert prog.counts() == base.counts()  # moved, never added or dropped


def test_gathers_keep_their_order_and_prefetch_crosses_into_backward():
    _, cap = captured("llama")
    base = shard_step(cap, "zero3", ShardContext(WS, "g", schedule=False))
    prog = shard_step(cap, "zero3", ShardContext(WS, "g", schedule=True, max_in_flight=BIG))
    key = lambda s: (collective_of(s).param, collective_of(s).phase)  # noqa: E731
    assert [key(s) for s in sw_nodes(prog.gm, "all_gather")] == [key(s) for s in sw_nodes(base.gm, "all_gather")]
    fwd = forward_nodes(prog.gm)
    pos = order_of(prog.gm)
    last_fwd = max(pos[n] for n in fwd if n.op == "call_function")
    assert any(pos[s] < last_fwd for s in sw_nodes(prog.gm, "all_gather", "bwd"))
    assert prog.schedule["prefetched"]  # the summary says how far each gather moved


def test_reduce_scatters_start_where_gradients_are_produced():
    _, cap = captured("llama")
    prog = shard_step(cap, "zero3", ShardContext(WS, "g", schedule=True))
    nodes = list(prog.gm.graph.nodes)
    pos = order_of(prog.gm)
    for s in sw_nodes(prog.gm, "reduce_scatter"):
        between = nodes[pos[s.args[0]] + 1 : pos[s]]
        # right after its input: at most a pad/copy between, besides waits the in-flight cap forced
        work = [n for n in between if n.target not in (WAIT, keep_alive)]
        assert len(work) <= 2, (s, work)


def test_schedule_is_deterministic():
    _, cap = captured("gpt")
    a = shard_step(cap, "zero3", ShardContext(WS, "g", schedule=True))
    b = shard_step(cap, "zero3", ShardContext(WS, "g", schedule=True))
    assert a.gm.code == b.gm.code


def test_default_cap_is_twice_the_largest_collective():
    _, cap = captured("gpt")
    prog = shard_step(cap, "zero3", ShardContext(WS, "g", schedule=True))
    largest = max(payload(s) for s in sw_nodes(prog.gm))
    assert prog.schedule["max_in_flight"] == 2 * largest
    assert max(in_flight_profile(prog.gm)) <= 2 * largest


def test_cap_on_number_in_flight_holds_and_still_overlaps():
    # gloo runs one collective at a time (see ShardContext.max_ops_in_flight): never two started and
    # not waited for, yet the one in flight is still issued ahead of the compute it overlaps
    _, cap = captured("llama")
    prog = shard_step(cap, "zero3", ShardContext(WS, "g", schedule=True, max_ops_in_flight=1))
    count, most, overlapped = 0, 0, 0
    for n in prog.gm.graph.nodes:
        if collective_of(n):
            count += 1
            most = max(most, count)
        elif n.op == "call_function" and n.target is WAIT:
            count -= 1
        elif count and n.op == "call_function" and "mm" in str(n.target):
            overlapped += 1
    assert most == 1
    assert overlapped > 0
    assert prog.schedule["max_ops"] == 1


def test_inductor_keeps_the_scheduled_order():
    # compile only (nothing runs): inductor's generated code must start the all-gathers where the
    # schedule put them — all before the first wait with an unbounded cap — not next to their waits
    import re

    import torch

    from shardwise.runtime.inductor import compile_graph
    from shardwise.runtime.mesh import ensure_process_group
    import torch.distributed as dist

    ensure_process_group()
    _, cap = captured("gpt", n_layer=1)  # one layer: inductor's compile is the test's time
    prog = shard_step(cap, "zero3", ShardContext(2, dist.group.WORLD.group_name, schedule=True, max_in_flight=BIG))
    run = compile_graph(prog.gm)
    ins = [torch.zeros(p.meta["val"].shape, dtype=p.meta["val"].dtype) for p in prog.gm.graph.find_nodes(op="placeholder")]
    from torch._inductor.compile_fx import compile_fx
    from torch._functorch import config as ft_cfg
    from torch._inductor import config as ind_cfg
    from shardwise.runtime.inductor import KEEP_ORDER

    with torch.no_grad(), ft_cfg.patch(cse=False), ind_cfg.patch(**KEEP_ORDER):
        code = getattr(compile_fx(prog.gm, ins), "source_code", None)
    assert run.compiled is None  # compile_graph compiles lazily, on the first call
    if code is None:
        pytest.skip("this torch's compiled graph does not expose its source code")
    calls = [("AG" if "all_gather" in m.group(1) else "RS" if "reduce_scatter" in m.group(1) else "W")
             for m in re.finditer(r"_c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|wait_tensor)[\w.]*\(",
                                  "\n".join(ln for ln in code.splitlines() if not ln.strip().startswith("#")))]
    first_wait = calls.index("W")
    assert calls[:first_wait].count("AG") == len(sw_nodes(prog.gm, "all_gather")), calls[:40]


def _carved(strategy, min_s=0.0):
    """(carved program, plain program, the plain one's simulated timeline) of the tiny MoE under a
    stand-in cost model: every product 1 s, everything else free, every collective 0.5 s."""
    from shardwise.costmodel import simulate
    from shardwise.runtime.ops import CARVED

    def compute(n):
        return 1.0 if n.target in CARVED or n.target in CARVED.values() else 0.0

    def comm(n):
        return 0.5

    _, cap = captured("moe")
    # ddp: one all-reduce per gradient, started as the backward produces it
    kw = dict(schedule=True, bucket_bytes=1, cost=CostModel.custom(compute, comm))
    prog = shard_step(cap, strategy, ShardContext(2, "g", sm_carveout=SMCarveout(24, 120, min_s), **kw))
    plain = shard_step(cap, strategy, ShardContext(2, "g", **kw))
    return prog, plain, simulate(plain.gm, compute, comm)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_products_beside_a_collective_leave_sms_free(strategy):
    # the graph change: each matrix product the cost model predicts to overlap a collective on the
    # link becomes its carved twin (same arguments, then 24 SMs to leave free); a product with the
    # link idle beside it (ddp's forward, a zero3 product whose gather already ended) is left alone;
    # the collective schedule is untouched
    from shardwise.runtime.ops import CARVED

    prog, plain, tl = _carved(strategy)
    twins = {m.name: m for m in plain.gm.graph.nodes}
    comm = [(s, e) for lane, _, s, e in tl.events if lane == "comm"]
    runs = {name: (s, e) for lane, name, s, e in tl.events if lane == "compute"}
    carved = kept = 0
    for n in prog.gm.graph.nodes:
        if n.target in CARVED.values():
            s, e = runs[n.name]
            assert any(cs < e and s < ce for cs, ce in comm), n
            t = twins[n.name]
            names = lambda args: [getattr(a, "name", a) for a in args]
            assert CARVED[t.target] is n.target and names(n.args) == [*names(t.args), 24]
            assert n.meta["sm_share"] == 0.8
            carved += 1
        elif n.target in CARVED:
            s, e = runs[n.name]
            assert not any(cs < e and s < ce for cs, ce in comm), n  # a product beside a collective was missed
            kept += 1
    assert carved == prog.carved > 0 and kept > 0
    assert [n.name for n in prog.gm.graph.nodes] == [n.name for n in plain.gm.graph.nodes]
    assert prog.counts() == plain.counts()
    # the roofline predicts each carved product slower by CARVE_STRETCH of what its share of the SMs
    # (0.8) says: 1 + 0.4 * (1 / 0.8 - 1) = 1.1
    from shardwise.costmodel import Device, flops, node_time
    from shardwise.costmodel.compute import CARVE_STRETCH

    dev = Device(name="test", flops=1e12, bandwidth=1e18)
    for n in prog.gm.graph.nodes:
        if n.meta.get("sm_share"):
            t = twins[n.name]
            assert flops(n) == flops(t) > 0
            assert node_time(n, dev) == pytest.approx(node_time(t, dev) * (1 + CARVE_STRETCH * (1 / 0.8 - 1)))
    # products predicted shorter than the threshold keep every SM
    assert _carved(strategy, min_s=1.5)[0].carved == 0


def test_carved_products_compute_the_products_under_inductor_too():
    # the carved twins are ordinary ops: eager and inductor-compiled, they give the product (on CPU
    # the carveout does not apply; on CUDA tests/test_cuda.py runs them)
    import torch

    from shardwise.runtime.ops import CARVED

    a, b, c, bias = torch.randn(8, 16), torch.randn(16, 4), torch.randn(3, 8, 16), torch.randn(4)
    aten = torch.ops.aten
    assert torch.equal(CARVED[aten.mm.default](a, b, 16), a @ b)
    assert torch.equal(CARVED[aten.bmm.default](c, c.transpose(1, 2), 16), torch.bmm(c, c.transpose(1, 2)))
    assert torch.equal(CARVED[aten.addmm.default](bias, a, b, 16), torch.addmm(bias, a, b))
    f = torch.compile(lambda x, y: CARVED[aten.mm.default](x, y, 8).relu(), backend="inductor", fullgraph=True)
    torch.testing.assert_close(f(a, b), (a @ b).relu())
