"""HF transformers models, built from tiny configs with random weights: zero3 parity at ws=2."""

import pytest

import harness

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_zero3_parity(pools, kind):
    steps = 4
    ref_losses, ref_sd = harness.hf_reference(kind, 2, steps)
    losses, sd = pools(2).run(harness.hf_run, kind, "zero3", steps)[0]
    assert set(sd) == set(ref_sd)  # same keys as model.state_dict(), tied head included
    # HF computes the loss from logits upcast with .float(), so the reported loss is fp32 even in an
    # fp64 model (its mean over ranks rounds in fp32); the parameters are held to the fp64 bound
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-6
    for k in ref_sd:
        if ref_sd[k].is_floating_point():
            err = ((sd[k] - ref_sd[k]).norm() / ref_sd[k].norm().clamp_min(1e-30)).item()
            assert err <= 1e-10, (k, err)
    if kind == "gpt2":  # tied weights came back as one tensor
        assert (sd["lm_head.weight"] == sd["transformer.wte.weight"]).all()
