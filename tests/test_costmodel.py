"""The cost model: α-β collectives, fitting, roofline compute and the two-lane step simulation."""

import json

import harness

import pytest
import torch

from test_graph import captured, sw_nodes
from shardwise.costmodel import DEVICES, PRESETS, LinkProfile, bus_factor, fit, flops, node_time, simulate
from shardwise.passes import ShardContext, shard_step


def test_alpha_beta_matches_the_ring_formula():
    p = PRESETS["h200-nv18-x2"]
    gib = 2**30
    # all-gather of 1 GiB over 2 ranks moves (n-1)/n of it at 266 GB/s bus bandwidth
    assert p.time("all_gather", gib, 2) == pytest.approx(32e-6 + gib * 0.5 / 266e9)
    assert p.time("all_reduce", gib, 2) == pytest.approx(32e-6 + gib * 1.0 / 328e9)
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
    # every row carries its phase, bytes and a positive predicted time
    for r in rows:
        kind, phase, kib, pred = r.split()[:4]
        assert phase in ("fwd", "bwd") and float(kib.removesuffix("KiB")) > 0 and float(pred) > 0
    assert "blocks.0.attn.wq.weight" in text and "S(0)" in text
