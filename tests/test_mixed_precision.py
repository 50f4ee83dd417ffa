"""bf16 mixed precision tracks FSDP2 with the same MixedPrecisionPolicy (gloo, 2 ranks)."""

import pytest

import harness


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_bf16_tracks_fsdp2(pools, name, strategy):
    ours, theirs, errs = pools(2).run(harness.bf16_vs_fsdp2, name, 8, strategy)[0]
    # Both cast the fp32 master shard to bf16 before gathering, run the same ATen ops in bf16, cast
    # gradients to fp32 before reducing and step AdamW on fp32 shards; on CPU/gloo they agree to the
    # bit. The bound allows for reduction order only (1e-6 is ~1/4000 of a bf16 ulp at 1.0), so any
    # deviation in the precision policy (a cast in the wrong place) fails it.
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, theirs)) <= 1e-6, (ours, theirs)
    assert max(errs.values()) <= 1e-5, errs
    # and it really ran in bf16: fp32 training from the same start gives other losses
    fp32, _ = harness.reference(name, "fp32", 2, 8)
    assert max(abs(a - b) for a, b in zip(ours, fp32)) > 1e-4
