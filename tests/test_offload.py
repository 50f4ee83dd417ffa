"""Optimizer state off the device (issue 5): the host tier and the streamed update, the part of the state
kept on the device, the update on the host's cores, and the update overlapped with the next step."""

import pytest

import harness
from harness import check


# -- optimizer state offload (host tier, streamed through the device in chunks) --------------------

@pytest.mark.parametrize("ws", [2, 4])
def test_parity_with_the_optimizer_offloaded(pools, ws):
    # chunks of 16 KiB: the update of the tiny llama runs as several streamed chunks
    check(pools, "llama", "zero3", "fp64", ws, steps=3, offload_optimizer=True, offload_chunk_mb=1 / 64,
          loss_tol=1e-10, param_tol=1e-10)


def test_offload_moves_state_to_the_host_pool_and_back(pools):
    for moved, host, on_device, chunks in pools(2).run(harness.offload_facts):
        assert chunks > 1 and host > 0 and on_device["optimizer"] == 0 and on_device["master"] == 0
        # per step: master + two moments in, and back out (the first step creates the moments)
        assert moved[1] - moved[0] == 2 * host


def test_offload_under_bf16_is_bit_identical_to_device_state():
    import torch

    import shardwise as sw
    from harness import adamw, make_batch, make_model

    res = []
    for offload in (False, "all"):
        job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                         offload_optimizer=offload, offload_chunk_mb=1 / 64, mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
        losses = [float(job.step(make_batch("llama", s, 0))) for s in range(4)]
        res.append((losses, job.full_state_dict()))
    assert res[0][0] == res[1][0]
    assert all(torch.equal(res[0][1][k], res[1][1][k]) for k in res[0][1])


def _half_resident_budget(pools):
    peak, host = pools(2).run(harness.predicted_peak, offload_optimizer=True, offload_chunk_mb=1 / 64)[0]
    return peak + host // 2, host


def test_offload_under_a_budget_keeps_what_fits_on_the_device(pools):
    budget, host_all = _half_resident_budget(pools)
    for kept, names, moved, host, dev in pools(2).run(harness.residency_facts, budget):
        assert 0 < len(kept) < len(names)
        # about half the state stays: what is kept is not moved, the rest is moved in and out
        assert host + dev == host_all and 0.3 * host_all < dev <= host_all // 2
        assert moved == 2 * host


def test_parity_with_part_of_the_optimizer_state_resident(pools):
    budget, _ = _half_resident_budget(pools)
    check(pools, "llama", "zero3", "fp64", 2, steps=3, offload_optimizer=True, offload_chunk_mb=1 / 64, memory_budget=budget,
          loss_tol=1e-10, param_tol=1e-10)


@pytest.mark.parametrize("ws,share", [(2, 0.5), (2, 1.0), (4, 0.5)])
def test_parity_with_part_of_the_update_on_the_host(pools, ws, share):
    check(pools, "llama", "zero3", "fp64", ws, steps=3, offload_optimizer=True, offload_chunk_mb=1 / 64,
          offload_host_update=share, loss_tol=1e-10, param_tol=1e-10)


def test_parity_with_resident_streamed_and_host_updated_state(pools):
    budget, _ = _half_resident_budget(pools)
    check(pools, "llama", "zero3", "fp64", 2, steps=3, offload_optimizer=True, offload_chunk_mb=1 / 64,
          memory_budget=budget, offload_host_update=0.5, loss_tol=1e-10, param_tol=1e-10)


# -- the host update (part of the offloaded state stepped on the host's cores) ----------------------

def test_the_host_update_moves_only_gradients_and_weights():
    import torch

    import shardwise as sw
    from harness import adamw, make_batch, make_model

    res = {}
    for share in (False, 0.5, 1.0):
        job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                         offload_optimizer="all", offload_chunk_mb=1 / 64, offload_host_update=share,
                         mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
        st = job.state.streamer
        losses = []
        for s in range(3):
            before = st.bytes_moved
            losses.append(float(job.step(make_batch("llama", s, 0))))
        res[share] = (losses, job.full_state_dict(), st.bytes_moved - before, st, job.explain())
    elems = sum(p.numel() for p in res[False][3].params.values())
    # streamed: fp32 master and two moments in and out (24 B/element); on the host: bf16 gradient
    # down and bf16 weights up (4 B/element)
    assert res[False][2] == 24 * elems and not res[False][3].host
    assert res[1.0][2] == 4 * elems and set(res[1.0][3].host) == set(res[1.0][3].params)
    assert res[1.0][3].chunks == [] and "updated on the host" in res[1.0][4]
    half = res[0.5][3]
    assert 0 < len(half.host) < len(half.params) and res[1.0][2] < res[0.5][2] < res[False][2]
    # the last parameters in forward order go to the host (the next forward reads them last)
    order = list(half.params)
    assert set(order[len(order) - len(half.host):]) == set(half.host)
    for share in (0.5, 1.0):
        # the same training: a fused host AdamW against the streamed one, equal to fp32 rounding
        assert res[share][0] == pytest.approx(res[False][0], rel=1e-6)
        assert all(torch.allclose(res[share][1][k], res[False][1][k], rtol=1e-6, atol=1e-7) for k in res[False][1])


def test_the_host_update_follows_a_learning_rate_schedule():
    import torch

    import shardwise as sw
    from harness import adamw, make_batch, make_model

    res = []
    for share in (False, 1.0):
        job = sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                         offload_optimizer="all", offload_host_update=share)
        sched = torch.optim.lr_scheduler.LambdaLR(job.optimizer, lambda s: [1.0, 0.0, 0.3][min(s, 2)])
        for s in range(4):
            job.step(make_batch("llama", s, 0))
            sched.step()  # after the job's step, as after optimizer.step()
        res.append(job.full_state_dict())
    assert all(torch.allclose(res[0][k], res[1][k], rtol=1e-10, atol=1e-12) for k in res[0])


def test_a_failing_host_update_surfaces_at_the_next_step_not_a_hang(monkeypatch):
    import torch

    import shardwise as sw
    from harness import adamw, make_batch, make_model
    from shardwise.runtime.offload import StreamedOptimizer

    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                     offload_optimizer="all", offload_host_update=0.5)
    job.step(make_batch("llama", 0, 0))

    def broken(self, arrived, published):
        raise RuntimeError("host update broke")

    monkeypatch.setattr(StreamedOptimizer, "run_host_update", broken)
    with pytest.raises(RuntimeError, match="host update broke"):
        job.step(make_batch("llama", 1, 0))
        job.step(make_batch("llama", 2, 0))
    # the readiness futures of the parameters it never reached carry the error (no wait hangs on them)
    with pytest.raises(RuntimeError, match="host update broke"):
        job.state.streamer.start_host({n: torch.zeros_like(job.state.compute[n]) for n in job.state.streamer.host},
                                       None)["head.weight"].result(timeout=10)


def test_the_cost_model_splits_the_update_between_link_and_host():
    import torch

    import shardwise as sw
    from harness import adamw, make_model
    from shardwise.costmodel.hostlink import HostLink

    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                     offload_optimizer="all", offload_host_update=False,
                     mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
    st = job.state.streamer
    elems = sum(p.numel() for p in st.params.values())
    link = HostLink(1e9, 1e9, 2e9)
    # a host far faster than the link takes everything; one far slower takes nothing
    assert set(st.plan_host(link, rate=1e15)) == set(st.params)
    assert st.plan_host(link, rate=1.0) == [] and not st.host
    # comparable speeds: a split, no slower than either extreme
    rate = elems / (24 * elems / 2e9)  # the host alone as fast as the link alone
    st.plan_host(link, rate=rate)
    both = st.update_time(link)
    assert 0 < len(st.host) < len(st.params)
    st.set_host(())
    alone = st.update_time(link)
    assert both < 0.75 * alone
    # the prediction is max(link time of what crosses it, host elements / rate)
    st.plan_host(link, rate=rate)
    up, down = st.transfer_bytes()
    assert st.update_time(link) == pytest.approx(max(link.stream_time(up, down), st.host_elements() / rate))


def test_one_rank_offload_keeps_gradients_in_the_compute_dtype():
    import torch

    # nothing is reduced at one rank: the streamed update casts each chunk's gradients itself
    assert harness.grad_dtypes() == {torch.float32}
    assert harness.grad_dtypes(offload_optimizer=True) == {torch.bfloat16}
    assert harness.grad_dtypes(offload_optimizer=True, clip_grad_norm=1.0) == {torch.float32}


def test_explain_shows_each_parameters_decisions():
    import shardwise as sw
    from harness import adamw, make_batch, make_model

    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                     offload_optimizer=True, keep_gathered=["head.weight"])
    job.step(make_batch("llama", 0, 0))
    rows = {ln.split()[0]: ln for ln in job.explain().splitlines() if ln.startswith("  ") and "S(0)" in ln}
    assert "kept gathered fwd->bwd" in rows["head.weight"] and "resharded after forward" in rows["norm.weight"]
    assert all("on host, streamed" in r for r in rows.values())


def test_offload_puts_a_readiness_wait_before_each_parameters_first_reader():
    import torch

    import shardwise as sw
    from harness import adamw, make_batch, make_model

    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                     offload_optimizer="all")
    job.step(make_batch("llama", 0, 0))
    gm = job.programs()[0].gm
    nodes = list(gm.graph.nodes)
    phs = gm.graph.find_nodes(op="placeholder")[: job.programs()[0].capture.n_params]
    waits = [n for n in nodes if n.meta.get("sw_ready")]
    assert len(waits) == len(phs)
    for ph in phs:
        (w,) = ph.users  # the wait is the parameter's only reader, every other reader reads it
        assert w.target is torch.ops._c10d_functional.wait_tensor.default and w.users
        assert nodes.index(w) < min(nodes.index(u) for u in w.users)
    plain = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1))
    plain.step(make_batch("llama", 0, 0))
    assert not any(n.meta.get("sw_ready") for n in plain.programs()[0].gm.graph.nodes)


# -- the update overlapped with the next step --------------------------------------------------------

def test_overlapped_update_is_predicted_to_hide_behind_the_next_forward():
    import shardwise as sw
    from harness import adamw, make_batch, make_model

    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                     offload_optimizer="all")
    b = make_batch("llama", 0, 0)
    job.step(b)
    job.last_optimizer_s = 1.0  # an update far longer than the step's graph
    serial = job.predict_step(b)
    job.state.streamer.overlap = True  # as on CUDA
    over = job.predict_step(b)
    # the forward hides behind the update: the step is the update plus the backward
    assert serial["step_s"] == serial["graph_s"] + 1.0
    assert serial["graph_s"] + 1.0 > over["step_s"] > 1.0


def test_on_device_overlapped_update_is_predicted_to_hide_only_in_the_forwards_idle_time(pools):
    # overlap_update's kernels share the SMs with the forward's: an update shorter than the forward's
    # idle compute time is hidden, a longer one costs what is left over (measured on H200: 0.4%)
    import harness

    idle, preds = pools(2).run(harness.overlapped_update_prediction)[0]
    assert idle > 0  # the forward waits for its all-gathers at ws=2
    (short, step_short, graph_short), (long_, step_long, graph_long) = preds
    assert step_short == pytest.approx(graph_short, rel=1e-9)
    assert step_long == pytest.approx(graph_long + long_ - idle, rel=1e-6)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_parity_with_the_update_overlapped(pools, name):
    # on the CPU the chunks run in order on the one stream: the same update as one step of the
    # optimizer over every parameter (elementwise, each parameter stepped once)
    check(pools, name, "zero3", "fp64", 2, steps=4, overlap_update=True, loss_tol=1e-10, param_tol=1e-10)


def test_overlapped_update_puts_a_readiness_wait_before_each_parameter_and_steps_in_chunks():
    import torch
    from harness import adamw, make_batch, make_model

    import shardwise as sw

    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                     overlap_update=True)
    batch = make_batch("llama", 0, 0)
    job.step(batch)
    gm = job.programs()[0].gm
    ready = [n.meta["sw_ready"] for n in gm.graph.nodes if "sw_ready" in n.meta]
    assert sorted(ready) == sorted(job.state.grad_names)
    chunks = job.updater.plan_chunks(job.programs()[0])
    assert 1 < len(chunks) <= 17 and [n for c in chunks for n in c] == ready  # in first-read order
    assert chunks[0][0] == "tok.weight"  # the first the next forward reads updates first
    plain = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1))
    plain.step(batch)
    assert not any("sw_ready" in n.meta for n in plain.programs()[0].gm.graph.nodes)
    a, b = job.full_state_dict(), plain.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # one rank, same kernels: the same weights


def test_overlap_update_is_refused_where_it_is_not_built():
    from harness import adamw, make_model

    import shardwise as sw

    for kw in ({"strategy": "zero1"}, {"strategy": "zero3", "offload_optimizer": True}):
        with pytest.raises(ValueError, match="overlap_update is built for zero3 with the optimizer state on the device"):
            sw.compile(make_model("gpt", "fp32"), optimizer=adamw, mesh=sw.mesh(dp=1), overlap_update=True, **kw)
