"""The parity matrix on a CUDA GPU: NCCL at ws=1, two gloo ranks sharing the GPU at ws=2.

Skipped by name on machines without a GPU; run on the GPU machine (see bench/gpu_spine.sh).
"""

import pytest
import torch

import harness
from harness import check

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


@needs_cuda
@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_parity_nccl_ws1(pools, strategy, name):
    check(pools, name, strategy, "fp64", 1, steps=4, device="cuda", backend="nccl", loss_tol=1e-10, param_tol=1e-10)


@needs_cuda
@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_parity_gloo_ws2_shared_gpu(pools, strategy, name):
    check(pools, name, strategy, "fp64", 2, steps=4, device="cuda", backend="gloo", loss_tol=1e-10, param_tol=1e-10)


@needs_cuda
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_cuda_fp32_parity_ws2(pools, strategy):
    # against single-device training on the same GPU (CPU kernels round differently); TF32 stays off
    over = (("bias", False),)
    # the reference steps torch's default (multi-tensor) AdamW; shardwise's fused kernel rounds fp32
    # differently (the fp64 tests hold it to the reference), so compare like with like here
    check(pools, "gpt", strategy, "fp32", 2, steps=10, over=over, device="cuda", ref_device="cuda",
          loss_tol=1e-5, param_tol=1e-5, fused_optimizer=False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_parity_nccl_ws2(pools, strategy, name):
    # two GPUs over NCCL, scheduler on (several collectives in flight on NCCL's stream)
    check(pools, name, strategy, "fp64", 2, steps=4, device="cuda", backend="nccl", loss_tol=1e-10, param_tol=1e-10)


@needs_cuda
def test_cuda_offload_streams_match_device_state():
    # the streamed update (pinned host buffers, H2D/D2H streams, events) against the state kept on
    # the GPU: bit-identical under bf16 compute
    import shardwise as sw
    from harness import adamw, make_batch, make_model

    res = []
    for offload in (False, "all"):
        job = sw.compile(make_model("llama", "fp32").cuda(), optimizer=adamw, strategy="zero3",
                         mesh=sw.mesh(dp=1, device="cuda"), offload_optimizer=offload, offload_chunk_mb=1 / 64,
                         offload_host_update=False, mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16),
                         fused_optimizer=False)  # the streamed update runs the factory's kernel: compare like with like
        losses = [float(job.step(tuple(t.cuda() for t in make_batch("llama", s, 0)))) for s in range(4)]
        res.append((losses, job.full_state_dict()))
        if offload:
            assert all(p.is_pinned() for p in job.state.master.values())
            assert len(job.state.streamer.chunks) > 1
    assert res[0][0] == res[1][0]
    assert all(torch.equal(res[0][1][k], res[1][1][k]) for k in res[0][1])


@needs_cuda
def test_cuda_offload_keeps_on_the_device_what_the_first_step_leaves_room_for():
    # the first steps run with all state on the host; their measured (reserved) peak sets how much
    # state stays on the GPU under the budget; training stays bit-identical to keeping it all on the GPU
    import shardwise as sw
    from harness import adamw, make_batch, make_model

    def run(**kw):
        job = sw.compile(make_model("llama", "fp32").cuda(), optimizer=adamw, strategy="zero3",
                         mesh=sw.mesh(dp=1, device="cuda"), offload_chunk_mb=1 / 64, offload_host_update=False,
                         mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16), fused_optimizer=False, **kw)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        losses = [float(job.step(tuple(t.cuda() for t in make_batch("llama", s, 0)))) for s in range(4)]
        return job, losses, job.full_state_dict()

    all_host, _, _ = run(offload_optimizer="all")
    state = all_host.state.streamer.host_bytes()
    peak_all = torch.cuda.max_memory_reserved()  # what residency is fitted against
    del all_host
    job, losses, sd = run(offload_optimizer=True, memory_budget=peak_all + state // 2)
    kept = job.state.streamer.device_bytes()
    assert job.residency_peak is not None and 0 < kept < state
    assert torch.cuda.max_memory_allocated() <= job.memory_budget
    _, ref_losses, ref_sd = run(offload_optimizer=False)
    assert losses == ref_losses and all(torch.equal(sd[k], ref_sd[k]) for k in sd)


@needs_cuda
def test_cuda_optimizer_runs_fused_unless_the_factory_chose():
    # on CUDA shardwise steps a fresh Adam/AdamW/SGD with torch's fused kernel; a factory that chose
    # foreach (or fused_optimizer=False) keeps its own
    import shardwise as sw
    from harness import adamw, make_model
    from shardwise.runtime.state import optimizer_kind

    kinds = {}
    for name, factory, fused in (("auto", adamw, None), ("chose", lambda p: torch.optim.AdamW(p, foreach=True), None),
                                 ("off", adamw, False)):
        job = sw.compile(make_model("llama", "fp32").cuda(), optimizer=factory, strategy="zero3",
                         mesh=sw.mesh(dp=1, device="cuda"), fused_optimizer=fused)
        kinds[name] = optimizer_kind(job.optimizer)
    assert kinds == {"auto": "AdamW (fused)", "chose": "AdamW (foreach)", "off": "AdamW (foreach)"}


@needs_cuda
@pytest.mark.parametrize("executor", ["fx", "inductor"])
def test_cuda_activation_offload_matches_keeping_them(executor):
    # saved activations copied to pinned host memory and back on their own streams: bit-identical to
    # keeping them on the GPU under the FX executor; under inductor the copies end fusions (a value
    # kept in fp32 inside one kernel is then stored in bf16), so equal to bf16 rounding
    from harness import adamw, make_model

    # Adam turns a rounding difference in a near-zero gradient into a step of about lr on that element
    # (measured: 3-8% of the weights' norm after 4 steps, with either optimizer kernel), so the
    # inductor case steps plain SGD, whose update is the gradient itself, and compares the updates
    opt = adamw if executor == "fx" else (lambda ps: torch.optim.SGD(ps, lr=0.5))
    init = make_model("llama", "fp32").state_dict()
    res = []
    for off in (False, True):
        job, losses, sd = _bf16_llama_steps(executor, opt, offload_activations=off)
        res.append((losses, sd))
        assert bool(job.programs()[0].offloaded) == off
    if executor == "fx":
        assert res[0][0] == res[1][0]
        assert all(torch.equal(res[0][1][k], res[1][1][k]) for k in res[0][1])
    else:
        assert res[1][0] == pytest.approx(res[0][0], rel=1e-3)
        for k in res[0][1]:
            a, b = (res[i][1][k].double().cpu() - init[k].double() for i in (0, 1))
            assert a.norm() > 0 and (a - b).norm() <= 5e-2 * a.norm(), k


@needs_cuda
def test_cuda_host_update_matches_the_streamed_update():
    # part of the update on the host's cores (a worker thread; weights sent up per parameter, the
    # next step's forward waiting for each) and, with "auto", the split the measured host rate picks:
    # the same training as the streamed update, to fp32 rounding (a fused CPU AdamW vs the GPU's)
    import shardwise as sw
    from harness import adamw, make_batch, make_model

    res = {}
    init = make_model("llama", "fp32").state_dict()
    for share in (False, 0.5, "auto"):
        job = sw.compile(make_model("llama", "fp32").cuda(), optimizer=adamw, strategy="zero3",
                         mesh=sw.mesh(dp=1, device="cuda"), offload_optimizer="all", offload_chunk_mb=1 / 64,
                         offload_host_update=share, mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
        losses = [float(job.step(tuple(t.cuda() for t in make_batch("llama", s, 0)))) for s in range(4)]
        res[share] = (losses, job.full_state_dict(), job.state.streamer)
    assert 0 < len(res[0.5][2].host) < len(res[0.5][2].params)
    assert res["auto"][2].host_rate > 0
    for share in (0.5, "auto"):
        assert res[share][0] == pytest.approx(res[False][0], rel=1e-3)
        # the updates agree to 1e-3 of their size: the host's AdamW rounds differently from the
        # GPU's, by how much depends on the host's vector units (7.9e-5 of a weight on one machine)
        for k in res[False][1]:
            a, b = (res[x][1][k].double().cpu() - init[k].double() for x in (False, share))
            assert a.norm() > 0 and (a - b).norm() <= 1e-3 * a.norm(), (share, k, float((a - b).norm() / a.norm()))


@needs_cuda
@pytest.mark.parametrize("executor", ["fx", "inductor"])
def test_cuda_overlapped_update_matches_the_plain_one(executor):
    # the update on its own stream, chunk by chunk, the next step's graph waiting per parameter: the
    # same losses, evaluation and weights, bit for bit, as the update run after the step on the
    # compute stream. Each chunk first sleeps on the update's stream (about 10 ms), so a missing wait
    # would let the next graph read half-updated weights.
    # Bit for bit needs deterministic kernels: inductor's embedding and norm-weight gradients
    # accumulate with atomics, whose order changes when the update's kernels share the GPU (measured:
    # 4 weights differ in the last bits without this, none with it; two plain runs agree either way)
    registry = getattr(torch._C._distributed_c10d, "_get_work_registry_size", None)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        res = [_overlapped_update_run(executor, overlap, registry) for overlap in (False, True)]
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    assert res[0][0] == res[1][0]
    assert all(torch.equal(res[0][1][k], res[1][1][k]) for k in res[0][1])


def _overlapped_update_run(executor, overlap, registry):
    from harness import adamw, make_batch

    job = _bf16_llama_job(executor, adamw, overlap_update=overlap)
    if overlap:
        step = job.optimizer.step

        def slow_step(*a, **k):
            torch.cuda._sleep(int(2e7))
            return step(*a, **k)

        job.optimizer.step = slow_step
    out = []
    for s in range(4):
        batch = tuple(t.cuda() for t in make_batch("llama", s, 0))
        out.append(float(job.step(batch)))
        if overlap and registry is not None and s == 0:
            assert registry() == len(job.updater.ready_names) > 0  # a work per parameter the graph reads
        out.append(float(job.eval_step(batch)))  # reads the weights the update is still writing
    sd = job.full_state_dict()
    assert (job.updater.stream is not None) == overlap
    if registry is not None:
        assert registry() == 0  # full_state_dict drained: nothing left registered
    return out, sd


def _bf16_llama_job(executor, optimizer, **kw):
    """The tiny llama compiled for one GPU, zero3, bf16 compute."""
    import shardwise as sw
    from harness import make_model

    return sw.compile(make_model("llama", "fp32").cuda(), optimizer=optimizer, strategy="zero3",
                      mesh=sw.mesh(dp=1, device="cuda"), compile=executor,
                      mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16), **kw)


def _bf16_llama_steps(executor, optimizer, steps=4, **kw):
    """(job, losses, full state) of the tiny llama trained ``steps`` steps on one GPU, zero3, bf16 compute."""
    from harness import make_batch

    job = _bf16_llama_job(executor, optimizer, **kw)
    losses = [float(job.step(tuple(t.cuda() for t in make_batch("llama", s, 0)))) for s in range(steps)]
    return job, losses, job.full_state_dict()


@needs_cuda
def test_cuda_carved_products_match_and_put_the_settings_back():
    # a carved product runs through cuBLASLt with SMs left free: the same product to bf16 rounding,
    # and the carveout and the preferred BLAS library are as they were after it returns
    from shardwise.runtime.ops import CARVED

    aten = torch.ops.aten
    a = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 512, 128, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    before = (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library())
    tol = dict(rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(CARVED[aten.bmm.default](a, b, 16), torch.bmm(a, b), **tol)
    torch.testing.assert_close(CARVED[aten.mm.default](a[0], b[0], 16), a[0] @ b[0], **tol)
    torch.testing.assert_close(CARVED[aten.addmm.default](bias, a[0], b[0], 16), torch.addmm(bias, a[0], b[0]), **tol)
    assert (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()) == before
    # settings other than the defaults are put back too, also when the product raises
    torch._C._set_sm_carveout_experimental(8)
    torch.backends.cuda.preferred_blas_library("cublas")
    other = (8, torch.backends.cuda.preferred_blas_library())
    try:
        CARVED[aten.mm.default](a[0], b[0], 16)
        assert (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()) == other
        with pytest.raises(RuntimeError):
            CARVED[aten.mm.default](a[0], b[0][:5], 16)  # shapes that do not multiply
        assert (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()) == other
    finally:
        torch._C._set_sm_carveout_experimental(before[0])
        torch.backends.cuda.preferred_blas_library(before[1])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("name", ["llama", "moe"])
def test_cuda_parity_nccl_ws2choose_carveout(pools, name):
    # products beside NCCL collectives run with 16 SMs left free: training matches single-device.
    # The test models' products are shorter than the 20 µs a product must take to be carved: carve all
    pool = pools(2, "nccl")
    old = pool.run(harness.set_carve_min_s, 0.0)[0]
    try:
        check(pools, name, "zero3", "fp64", 2, steps=3, device="cuda", backend="nccl", matmul_sm_carveout=16,
              loss_tol=1e-10, param_tol=1e-10)
    finally:
        pool.run(harness.set_carve_min_s, old)
    assert check.counts["carved"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_parity_nccl_ws2_auto_carveout_by_default(pools):
    # with no matmul_sm_carveout the cost model weighs carving 32 SMs (every product a candidate
    # here) and keeps the program it predicts faster: the decision is taken and recorded, and the
    # job trains to single-device parity. (The test model's products are too small to fill the SMs,
    # so the model keeps them whole; the carved path's parity is the test above.)
    from shardwise.passes.carveout import choose as choose_carveout

    if choose_carveout("auto", torch.device("cuda", 0)) is None:
        pytest.skip("auto does not carve on this GPU or torch (Hopper-class, > 64 SMs, the carveout API)")
    pool = pools(2, "nccl")
    old = pool.run(harness.set_carve_min_s, 0.0)[0]
    try:
        check(pools, "moe", "zero3", "fp64", 2, steps=3, device="cuda", backend="nccl",
              loss_tol=1e-10, param_tol=1e-10)
    finally:
        pool.run(harness.set_carve_min_s, old)
    before, after, carved = check.counts["carve_choice"]
    assert before > 0 and after > 0 and carved == (check.counts["carved"] > 0), check.counts


@needs_cuda
@pytest.mark.parametrize("name,strategy,sp", [("llama", "zero3", True), ("gpt", "ddp", True), ("llama", "ddp", False)])
def test_cuda_tensor_parallel_gloo_ranks_sharing_the_gpu(pools, name, strategy, sp):
    """tp=2 on CUDA tensors, two gloo ranks on the one GPU (host-staged collectives): correctness of
    the tp-local step and its kernels on the device, not speed (one GPU cannot host two NCCL ranks)."""
    ref_losses, ref_sd = harness.reference(name, "fp64", 1, 3)
    losses, sd, info = pools(2, "gloo").run(harness.tp_run, name, strategy, "fp64", 3, 2, device="cuda",
                                            sequence_parallel=sp)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-10
    assert harness.rel_param_err(sd, ref_sd) <= 1e-10
    assert info["tp"]["reduce_scatter" if sp else "all_reduce"] > 0


@needs_cuda
@pytest.mark.parametrize("sp", [False, True])
def test_cuda_fused_tp_products_gloo_ranks_sharing_the_gpu(pools, sp):
    """The decomposed path (kernels/ring.py) on CUDA tensors over gloo (staged through the host): fp64
    parity with one device."""
    ref_losses, ref_sd = harness.reference("llama", "fp64", 1, 3)
    losses, sd, info = pools(2, "gloo").run(harness.tp_run, "llama", "ddp", "fp64", 3, 2, device="cuda",
                                            sequence_parallel=sp, tp_fuse="ring", vocab_parallel=False)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-10
    assert harness.rel_param_err(sd, ref_sd) <= 1e-10
    assert info["fuse"] and all(r["impl"] == "ring" for r in info["fuse"])


@needs_cuda
@pytest.mark.parametrize("executor", ["fx", "inductor"])
def test_cuda_fused_tp_kernels_gloo_ranks_sharing_the_gpu(pools, executor):
    """The Triton kernels over symmetric memory, two ranks on the one GPU: the fp32 step (products in
    IEEE fp32) trains as the unfused one does, every all-gather and reduce-scatter site on a kernel."""
    off, _ = pools(2, "gloo").run(harness.tp_fused_kernel_run, "off", executor=executor)[0]
    got, impls = pools(2, "gloo").run(harness.tp_fused_kernel_run, "kernel", executor=executor)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, off)) <= 1e-5, (got, off)
    assert impls.count("kernel") >= 8 and set(impls) <= {"kernel", "ring"}, impls


@needs_cuda
@pytest.mark.parametrize("kw", [{}, {"offload_optimizer": "all", "offload_chunk_mb": 1 / 64,
                                     "offload_host_update": False}], ids=["fused-adamw", "offload"])
def test_cuda_a_checkpoint_resumes_bit_identical(tmp_path, kw):
    """On the GPU: the fused AdamW's step counts go back to the device (the kernel reads them there)
    and an offloaded state into its pinned host buffers, in a job that has stepped and a fresh one.
    (The host update's share is measured at the first step, so runs with it may split the update
    differently, and the host's kernel rounds apart from the device's: it is left out here.)"""
    import shardwise as sw
    from harness import adamw, make_batch, make_model

    def job_of(seed):
        return sw.compile(make_model("llama", "fp32", seed=seed).cuda(), optimizer=adamw, strategy="zero3",
                          mesh=sw.mesh(dp=1, device="cuda"), **kw)

    def batch(s):
        return tuple(t.cuda() for t in make_batch("llama", s, 0))

    full = job_of(0)
    losses = [float(full.step(batch(s))) for s in range(2)]
    full.save(str(tmp_path / "ck"))
    losses += [float(full.step(batch(s))) for s in (2, 3)]
    want = full.full_state_dict()
    for warm in (False, True):
        job = job_of(1)
        if warm:
            job.step(batch(9))
        job.load(str(tmp_path / "ck"))
        assert [float(job.step(batch(s))) for s in (2, 3)] == losses[2:], warm
        got = job.full_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), warm
        if kw:
            assert all(p.is_pinned() for p in job.state.master.values())
            assert all(v.is_pinned() for s in job.optimizer.state.values() for v in s.values() if v.dim())
        else:
            steps = {s["step"].device.type for s in job.optimizer.state.values()}
            assert steps == {"cuda"}, steps


@needs_cuda
@pytest.mark.parametrize("strategy,split", [("ddp", 1), ("zero3", 1), ("zero3", 2)])
def test_cuda_expert_parallel_gloo_ranks_sharing_the_gpu(pools, strategy, split):
    """ep=2 on CUDA tensors, two gloo ranks on the one GPU (the all-to-alls staged through the host):
    the ep-local step on the device, against single-device training of both ranks' batches (with
    ``split``, each batch as two interleaved halves: no drops then, so that the halves' capacities
    change nothing)."""
    over = (("capacity_factor", 1.0 if split == 1 else 2.0),)  # with drops, unless split
    ref_losses, ref_sd = harness.reference("moe", "fp64", 2, 3, over)
    losses, sd, info = pools(2, "gloo").run(harness.ep_run, strategy, 3, 2, dict(over)["capacity_factor"],
                                            device="cuda", ep_split=split)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-10
    assert harness.rel_param_err(sd, ref_sd) <= 1e-10
    assert info["phases"][("ep", "all_to_all", "fwd")] == 2 * info["n_layer"] * split


@needs_cuda
@pytest.mark.parametrize("sp", [False, True])
def test_cuda_expert_and_tensor_parallel_gloo_ranks_sharing_the_gpu(pools, sp):
    """ep=2 x tp=2 on CUDA tensors, four gloo ranks on the one GPU, zero3 (the experts cut over ep and
    tp, the rest over tp and ep), with and without sequence parallelism: against single-device
    training of the two batches."""
    ref_losses, ref_sd = harness.reference("moe", "fp64", 2, 3, (("capacity_factor", 2.0),))
    losses, sd, counts, _ = pools(4, "gloo").run(harness.ep_tp_run, "zero3", 3, device="cuda",
                                                 sequence_parallel=sp)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-10
    assert harness.rel_param_err(sd, ref_sd) <= 1e-10
    assert counts[("ep", "all_to_all", "fwd")] == 4 and counts[("tp", "all_reduce", "fwd")] > 0, counts


@needs_cuda
def test_cuda_hf_experts_split_over_ep_gloo_ranks_sharing_the_gpu(pools):
    """HF Mixtral's experts (bf16's kernel path aside: fp32 through the reference) on ep=2, two gloo
    ranks on the one GPU: the traced gathers and reduce-scatter staged through the host."""
    pytest.importorskip("transformers")
    import transformers

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")
    ref_losses, ref_sd = harness.hf_reference("mixtral-grouped_mm", 2, 4, "fp32")
    losses, sd, comm, _, _ = pools(2, "gloo").run(harness.hf_ep_run, "mixtral-grouped_mm", "zero3", 4, 2, "cuda")[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    errs = [((sd[k] - ref_sd[k]).norm() / ref_sd[k].norm()).item() for k in ref_sd if not k.endswith("k_proj.bias")]
    assert max(errs) <= 1e-4  # the GPU's kernels round apart from the CPU reference's
    assert comm[("reduce_scatter", "fwd")] == 2
