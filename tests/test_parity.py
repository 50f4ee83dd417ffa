"""Parity of every strategy with single-device training (DESIGN.md invariant 1)."""

import pytest
import torch

import harness
from harness import check

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


# every strategy and model on 2 ranks; 1 and 4 ranks for each strategy on one model each (the suite
# keeps to its time on 2 cores; tests/test_random_models.py draws further models)
FP64 = [(s, n, 2) for s in STRATEGIES for n in ("gpt", "llama", "moe")] + \
    [("ddp", "moe", 4), ("zero2", "llama", 4), ("zero3", "moe", 4), ("zero3", "gpt", 1)]


@pytest.mark.parametrize("strategy, name, ws", FP64)
def test_parity_fp64(pools, strategy, name, ws):
    check(pools, name, strategy, "fp64", ws, steps=5, loss_tol=1e-10, param_tol=1e-10)


@pytest.mark.parametrize("strategy, name, ws", [(s, "llama", 2) for s in STRATEGIES] +
                         [("zero3", "gpt", 4)])
def test_parity_fp32_20_steps(pools, strategy, name, ws):
    # MoE is held to fp64 only: near-ties flip top-2 routing under fp32 rounding. GPT runs without
    # biases here: its key bias has a gradient that is exactly zero in exact arithmetic (softmax
    # ignores a shift shared by a row), so in fp32 it is pure rounding noise, which AdamW scales up
    # to full-size updates; any change of summation order (4 ranks reduce in another order than
    # one process) then moves it. fp64 covers the biased model.
    over = (("bias", False),) if name == "gpt" else ()
    check(pools, name, strategy, "fp32", ws, steps=20, over=over, loss_tol=1e-5, param_tol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_activation_checkpointing(pools, strategy):
    over = (("checkpoint", True),)
    check(pools, "llama", strategy, "fp64", 2, steps=4, over=over, loss_tol=1e-10, param_tol=1e-10)


def test_parity_untied_gpt_zero3(pools):
    check(pools, "gpt", "zero3", "fp64", 2, steps=3, over=(("tie", False),), loss_tol=1e-10, param_tol=1e-10)


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch<2.13 inductor allocates the CPU flash-attention backward's logsumexp in fp32 for fp64 inputs",
)
@pytest.mark.parametrize("strategy", ["zero3"])
def test_parity_inductor(pools, strategy):
    # inductor fuses kernels and reorders reductions, so fp32 rounding differs from eager by design;
    # fp64 holds the compiled graph to the exact bound
    check(pools, "gpt", strategy, "fp64", 2, steps=4, compile="inductor", over=(("n_layer", 1),), loss_tol=1e-10,
          param_tol=1e-10)


@pytest.mark.parametrize("strategy, name, ws, micro",
                         [("zero1", "gpt", 2, 3), ("zero1", "moe", 2, 1), ("zero2", "llama", 2, 3), ("zero2", "moe", 2, 3),
                          ("zero3", "gpt", 2, 3), ("zero3", "moe", 2, 3), ("zero3", "llama", 4, 1), ("zero2", "gpt", 4, 3)])
def test_parity_bucketed(pools, strategy, name, ws, micro):
    # buckets of twice the largest parameter (shard_bucket_mb=None), with and without accumulation
    check(pools, name, strategy, "fp64", ws, steps=3, micro=micro, shard_bucket_mb=None, loss_tol=1e-10,
          param_tol=1e-10)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_parity_unscheduled(pools, strategy):
    # the scheduler is on everywhere else in this file; off, each collective is waited for at once
    check(pools, "llama", strategy, "fp64", 2, steps=3, schedule=False, loss_tol=1e-10, param_tol=1e-10)


def test_paritychoose_carveout(pools):
    # products beside a collective run as their carved twins (passes/carveout.py): the same products
    # (on CPU the carveout itself does not apply; tests/test_cuda.py holds it to parity on GPUs)
    check(pools, "moe", "zero3", "fp64", 2, steps=3, matmul_sm_carveout=16, loss_tol=1e-10, param_tol=1e-10)
    assert check.counts["carved"] > 0


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch<2.13 inductor allocates the CPU flash-attention backward's logsumexp in fp32 for fp64 inputs",
)
def test_parity_sm_carveout_inductor(pools):
    # the dispatched MoE (capacity factor 1: tokens over capacity dropped) compiled by inductor, its
    # batched expert products (bmm) and its matrix products carved
    check(pools, "moe", "zero3", "fp64", 2, steps=3, compile="inductor", matmul_sm_carveout=16,
          over=(("capacity_factor", 1.0), ("n_layer", 1)), loss_tol=1e-10, param_tol=1e-10)
    assert check.counts["carved"] > 0


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_batchnorm_cnn_trains_with_its_running_statistics(pools, strategy):
    """BatchNorm's running statistics and num_batches_tracked, written in place in the step, are
    written into the job's buffers (as eager training does) and averaged over the dp ranks."""
    losses, ev, sd, writes, written = pools(2).run(harness.bn_run, strategy)[0]
    # the graph change: the ops that write the buffers stay in the sharded program, marked, in place
    assert writes == {"bn1.num_batches_tracked", "bn1.running_mean", "bn2.num_batches_tracked", "bn2.running_mean"}
    assert sorted(written) == sorted(f"bn{i}.{b}" for i in (1, 2) for b in ("num_batches_tracked", "running_mean",
                                                                             "running_var"))
    rl, rev, rsd = harness.bn_reference(2)
    assert max(abs(a - b) for a, b in zip(losses, rl)) <= 1e-10 and abs(ev - rev) <= 1e-10, (losses, rl, ev, rev)
    assert rsd.keys() == sd.keys() and sd["bn1.num_batches_tracked"] == 3
    assert max(float((sd[k].double() - rsd[k].double()).abs().max()) for k in rsd) <= 1e-10
    assert float((rsd["bn2.running_var"] - 1).abs().max()) > 0.05  # the statistics moved
