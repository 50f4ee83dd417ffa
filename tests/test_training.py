"""What real models and training loops contain: frozen and tied parameters, dropout, accumulation,
ranks that start from different weights, eval, export."""

import copy

import pytest
import torch

import harness
from harness import check
from shardwise.models import build

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_parameters_stay_frozen(pools, strategy):
    over = (("freeze", ("tok.weight", "blocks.0.attn.wq.weight")),)
    sd, ref = check(pools, "llama", strategy, "fp64", 2, steps=3, over=over, loss_tol=1e-10, param_tol=1e-10)
    init = harness.make_model("llama", "fp64").state_dict()
    assert torch.equal(sd["tok.weight"], init["tok.weight"])
    assert torch.equal(sd["blocks.0.attn.wq.weight"], init["blocks.0.attn.wq.weight"])


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_ranks_start_from_rank0_weights(pools, strategy):
    # every rank builds its model from another seed; the job must train rank 0's weights
    check(pools, "gpt", strategy, "fp64", 2, steps=2, seed="rank", loss_tol=1e-10, param_tol=1e-10)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])  # zero1 and zero3: test_parity.py's bucketed cases
def test_gradient_accumulation_over_micro_batches(pools, strategy):
    check(pools, "gpt", strategy, "fp64", 2, steps=3, micro=3, loss_tol=1e-10, param_tol=1e-10)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_dropout_trains_and_eval_is_deterministic(pools, strategy):
    e0, e1, train = pools(2).run(harness.dropout_and_eval, strategy)[0]
    assert e0 == e1  # eval: dropout off, no state change
    assert all(torch.isfinite(torch.tensor(train)))
    # the first training step saw the same weights as eval, but dropout changed its loss
    assert abs(train[0] - e0) > 1e-6


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_eval_and_exported_state_dict_match_single_device(pools, strategy):
    steps = 3
    (evals, sd), _ = pools(2).run(harness.eval_and_export, strategy, steps)
    _, ref_sd = harness.reference("llama", "fp64", 2, steps)
    single = build("llama", "tiny").double()
    single.load_state_dict(sd)  # the exported weights load into the original single-device model
    single.eval()
    with torch.no_grad():
        ref_evals = [float(single(*harness.make_batch("llama", 100 + r, r))) for r in range(2)]
    assert abs(evals - sum(ref_evals) / 2) <= 1e-10 * abs(evals)  # eval loss is the mean over ranks
    assert harness.rel_param_err(sd, ref_sd) <= 1e-10


@pytest.mark.parametrize("name,ws", [("llama", 2), ("moe", 1)])
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_fused_optimizer_matches_single_device(pools, strategy, name, ws):
    # torch's fused AdamW kernel (shardwise's default on CUDA) against the reference's for-loop
    # AdamW: the same update, held to the fp64 bound. The dense MoE at one rank returns its expert
    # gradients with an einsum's strides, which the fused kernel needs laid out as the parameters
    check(pools, name, strategy, "fp64", ws, steps=4, fused_optimizer=True, loss_tol=1e-10, param_tol=1e-10)


def test_fused_optimizer_keeps_the_factorys_groups_and_hyperparameters():
    import shardwise as sw
    from shardwise.runtime.state import fused_twin, optimizer_kind

    named = list(harness.make_model("llama", "fp32").named_parameters())
    opt = torch.optim.AdamW([{"params": named[:2], "lr": 1e-3}, {"params": named[2:], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)
    assert fused_twin(opt, None) is opt and fused_twin(opt, False) is opt  # auto fuses on CUDA only
    fused = fused_twin(opt, True)
    assert type(fused) is torch.optim.AdamW and fused is not opt
    assert optimizer_kind(opt) == "AdamW (for-loop)" and optimizer_kind(fused) == "AdamW (fused)"
    assert len(fused.param_groups) == 2
    for a, b in zip(opt.param_groups, fused.param_groups):
        assert all(x is y for x, y in zip(a["params"], b["params"])) and len(a["params"]) == len(b["params"])
        for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "param_names"):
            assert a[k] == b[k], k
        assert b["fused"] is True
    # a state saved by the loop kernel loads into the fused twin, which stays fused and steps as the loop does
    ps = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)) for _ in range(2)]
    loop = torch.optim.AdamW(ps, lr=1e-2)
    twin = fused_twin(torch.optim.AdamW([p.detach().clone().requires_grad_() for p in ps], lr=1e-2), True)
    for step in range(2):
        for p, q in zip(ps, twin.param_groups[0]["params"]):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
            q.grad = p.grad.clone()
        loop.step()
        if step == 0:
            with torch.no_grad():
                for p, q in zip(ps, twin.param_groups[0]["params"]):
                    q.copy_(p)
            twin.load_state_dict(copy.deepcopy(loop.state_dict()))  # load_state_dict keeps the tensors given
            assert twin.param_groups[0]["fused"] is True and optimizer_kind(twin) == "AdamW (fused)"
    twin.step()
    assert all(torch.allclose(p, q, atol=1e-12) for p, q in zip(ps, twin.param_groups[0]["params"]))
    # through compile: the job's optimizer is the fused twin, and explain says which kernel runs
    job = sw.compile(harness.make_model("gpt", "fp32"), optimizer=harness.adamw, strategy="zero3",
                     mesh=sw.mesh(dp=1), fused_optimizer=True)
    assert job.optimizer.defaults["fused"] is True
    assert "optimizer: AdamW (fused)" in job.explain()
