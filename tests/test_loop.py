"""The training loop people already write, against the single-device loop that means the same:
4 micro-batches of accumulation, global-norm clipping that clips, a cosine schedule with warm-up,
two parameter groups by name, eval, and an exported state dict that loads into the original model."""

import pytest
import torch

import harness
from shardwise.models import build

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


# every strategy on 2 ranks in fp64 and on 4 in fp32 (each rank count and precision once per strategy)
@pytest.mark.parametrize("ws,dtype,steps,tol", [(2, "fp64", 4, 1e-10), (4, "fp32", 10, 1e-5)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_loop_parity(pools, strategy, ws, dtype, steps, tol):
    ref_losses, ref_norms, ref_eval, ref_sd = harness.loop_reference("llama", dtype, ws, steps)
    losses, norms, ev, sd = pools(ws).run(harness.loop_run, "llama", strategy, dtype, steps)[0]
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= tol
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) <= tol  # the global norm, before clipping
    assert sum(n > harness.LOOP["clip"] for n in ref_norms) >= steps // 2  # the threshold really clips
    assert abs(ev - ref_eval) / ref_eval <= tol
    assert harness.rel_param_err(sd, ref_sd) <= tol
    # the export loads into the original single-device model and gives the reference's eval loss
    single = build("llama", "tiny").to(harness.DTYPES[dtype])
    single.load_state_dict(sd)
    single.eval()
    with torch.no_grad():
        ev1 = sum(float(single(*harness.make_batch("llama", 10_000 + r, r))) for r in range(ws)) / ws
    assert abs(ev1 - ref_eval) / ref_eval <= tol
