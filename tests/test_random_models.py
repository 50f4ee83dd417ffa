"""Parity on models hypothesis draws (issue 23): depth, widths, activations, tied weights, a frozen
layer, a dense expert mixture or not; zero3 and ddp on 2 ranks against single-device training (fp64)."""

import harness
from hypothesis import given, settings
from hypothesis import strategies as st

SPECS = st.tuples(st.lists(st.sampled_from([4, 6, 8]), min_size=1, max_size=3),
                  st.sampled_from(["relu", "gelu", "tanh", "silu"]), st.booleans(), st.integers(-1, 2), st.booleans())


@settings(max_examples=5, deadline=None, derandomize=True, database=None)
@given(spec=SPECS)
def test_random_models_train_as_on_one_device(pools, spec):
    ref_losses, ref_sd = harness.random_reference(spec, 2)
    for strategy in ("zero3", "ddp"):
        losses, sd = pools(2).run(harness.random_run, spec, strategy)[0]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-10, (spec, strategy, losses, ref_losses)
        assert sd.keys() == ref_sd.keys()
        err = max(float((sd[k] - ref_sd[k]).abs().max()) for k in ref_sd)
        assert err <= 1e-10, (spec, strategy, err)
