"""HF transformers models, built from tiny configs with random weights: zero3 parity at ws=2."""

import pytest
import torch

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


@pytest.mark.parametrize("kind,steps", [("mixtral-grouped_mm", 20), ("qwen2_moe", 20), ("mixtral-batched_mm", 4),
                                        ("mixtral-eager", 4)])
def test_hf_moe_models_train_unmodified_under_zero3(pools, kind, steps):
    """Mixtral's experts through each implementation transformers has (grouped_mm: traced through a
    reference of plain ops where its tracing rule refuses fp32; the per-expert loop, whose nonzero
    cannot be traced: through its grouped_mm path, the same math) and Qwen2-MoE (with a shared
    expert), fp32 (torch's grouped_mm takes no fp64), 2 ranks, against eager single-device training.
    The attention's k bias is left out: its gradient is zero but for rounding (softmax ignores a
    per-row shift), which AdamW makes visible."""
    import transformers

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")
    ref_losses, ref_sd = harness.hf_reference(kind, 2, steps, "fp32")
    losses, sd = pools(2).run(harness.hf_run, kind, "zero3", steps, "fp32")[0]
    assert set(sd) == set(ref_sd)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    errs = {k: ((sd[k] - ref_sd[k]).norm() / ref_sd[k].norm().clamp_min(1e-30)).item() for k in ref_sd
            if ref_sd[k].is_floating_point() and not k.endswith("k_proj.bias")}
    assert max(errs.values()) <= 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def test_hf_experts_traced_by_their_static_path_leave_the_model_as_it_was():
    """The graph change: the per-expert loop's data-dependent nonzero is gone (its grouped path is
    traced), and so are grouped products in fp32 (their reference of plain products); the model's
    experts implementation is put back."""
    import torch
    import transformers

    from shardwise.capture import capture_step

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")

    model = harness.make_hf("mixtral-eager", "fp32")
    cap = capture_step(model, harness.hf_batch(0, 0))
    targets = {n.target for n in cap.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.nonzero.default not in targets and torch.ops.aten._grouped_mm.default not in targets
    assert torch.ops.aten.searchsorted.Tensor in targets  # rows to their experts
    assert model.config._experts_implementation == "eager"


@pytest.mark.parametrize("kind,steps", [("mixtral-grouped_mm", 20), ("qwen2_moe", 20), ("mixtral-eager", 4),
                                        ("mixtral-grouped_mm-aux", 4)])
def test_hf_moe_models_with_expert_parallelism(pools, kind, steps):
    """ep=2 (zero3 on a dp axis of one): each rank holds half of every layer's experts; the pairs of
    both ranks are gathered to every rank's experts (dropless: the group sizes follow the routing)
    and the outputs summed back by a reduce-scatter, one of each per layer (their transposes in the
    backward). Against eager single-device fp32 training of both ranks' batches; with Mixtral's
    load-balancing loss (``output_router_logits``) too, which each rank computes on its own tokens."""
    import transformers

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")
    ref_losses, ref_sd = harness.hf_reference(kind, 2, steps, "fp32")
    losses, sd, comm, shapes, explain = pools(2).run(harness.hf_ep_run, kind, "zero3", steps)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    errs = {k: ((sd[k] - ref_sd[k]).norm() / ref_sd[k].norm().clamp_min(1e-30)).item() for k in ref_sd
            if ref_sd[k].is_floating_point() and not k.endswith("k_proj.bias")}
    assert max(errs.values()) <= 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    assert shapes and all(s[0] == 2 for s in shapes.values())  # 2 of the 4 experts on each rank
    layers = 2
    assert comm[("all_gather", "fwd")] == 3 * layers and comm[("reduce_scatter", "fwd")] == layers, comm
    rows = [ln.split() for ln in explain.splitlines() if ln.strip().startswith("model.layers.")
            and "dropless" in ln]
    assert len(rows) == layers and rows[0][1:5] == ["dropless", "4", "2", "-"], explain


def test_hf_experts_under_ep_on_a_split_batch(pools):
    """ep_split=2 with Mixtral (dropless): each rank's batch traced as two halves, interleaved; the
    loss the halves' mean, as eager fp32 training of the whole batches (both halves count the same
    tokens). Each half gathers its own pairs: twice the dispatch collectives."""
    import transformers

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")
    kind, steps = "mixtral-grouped_mm", 4
    ref_losses, ref_sd = harness.hf_reference(kind, 2, steps, "fp32")
    losses, sd, comm, _, _ = pools(2).run(harness.hf_ep_run, kind, "zero3", steps, ep_split=2)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    errs = [((sd[k] - ref_sd[k]).norm() / ref_sd[k].norm()).item() for k in ref_sd if not k.endswith("k_proj.bias")]
    assert max(errs) <= 1e-5, max(errs)
    assert comm[("all_gather", "fwd")] == 2 * 3 * 2 and comm[("reduce_scatter", "fwd")] == 2 * 2, comm


def test_an_ep_collective_starts_as_soon_as_its_input_is_made_so_the_shared_expert_overlaps_it(pools):
    """The graph change: Qwen2-MoE computes its shared expert before its routed ones; the gather of
    the tokens for the routed experts is started before the shared expert's products, and first
    read after them."""
    import transformers

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")
    start, shared, read = pools(2).run(harness.hf_ep_overlap)[0]
    assert start < shared < read, (start, shared, read)


def test_hf_experts_under_ep_with_a_capacity_exchange(pools):
    """ep_capacity_factor: the pairs go to their experts' ranks by all-to-alls of fixed [E, capacity, d]
    blocks (two per layer forward, two backward) instead of being gathered to every rank. With room for
    every pair (factor 4 = 2 x E/k) it trains as eager HF does (nothing dropped); with factor 1 it
    drops pairs as one device does under the same rule."""
    import transformers

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")
    kind, steps = "mixtral-grouped_mm", 6
    for factor, (ref_losses, ref_sd) in ((4.0, harness.hf_reference(kind, 2, steps, "fp32")),
                                         (1.0, harness.hf_reference(kind, 2, steps, "fp32", capacity=1.0))):
        losses, sd, comm, _, explain = pools(2).run(harness.hf_ep_run, kind, "zero3", steps,
                                                    ep_capacity_factor=factor)[0]
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5, factor
        errs = [((sd[k] - ref_sd[k]).norm() / ref_sd[k].norm()).item() for k in ref_sd if not k.endswith("k_proj.bias")]
        assert max(errs) <= 1e-5, (factor, max(errs))
        # and the loss's all-reduce (the other weights are ZeRO-sharded over ep: no gradient all-reduce)
        assert comm == {("all_to_all", "fwd"): 4, ("all_to_all", "bwd"): 4, ("all_reduce", "bwd"): 1}, comm
        row = next(ln.split() for ln in explain.splitlines() if ln.strip().startswith("model.layers.0.mlp.experts "))
        assert row[1:5] == ["capacity", "4", "2", "x" + format(factor, "g")], row
        assert (int(row[-1]) > 0) == (factor == 1.0), row  # the pairs this rank dropped in the last step
    drops = harness.hf_reference(kind, 2, 1, "fp32", capacity=1.0)[0][0] != harness.hf_reference(kind, 2, 1, "fp32")[0][0]
    assert drops  # factor 1 does drop pairs here: the second comparison is not the first again


def test_the_cost_model_keeps_hf_experts_dropless_where_it_fits_and_takes_capacity_where_not(pools):
    """ep_capacity_factor left open: dropless while its predicted graph peak fits the graph's room (the
    budget less the state the rank will hold), else GShard's capacity rule at 1.25 (its pairs past
    capacity dropped), which then trains as one device does under that rule; explain says which and
    why."""
    import transformers

    from shardwise.passes.ep import DEFAULT_CAPACITY

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")
    kind, steps, big = "mixtral-grouped_mm", 4, 8 * 2**30
    _, _, roomy, explain = pools(2).run(harness.hf_ep_dispatch, kind, 1, big)[0]
    assert roomy["dispatch"] == "dropless" and roomy["room"] > roomy["dropless_peak"] > 0, roomy
    assert "dropless, by the cost model: its graph peak" in explain, explain
    # a budget whose room is 90% of what dropless needs
    tight = big - roomy["room"] + int(0.9 * roomy["dropless_peak"])
    losses, sd, choice, explain = pools(2).run(harness.hf_ep_dispatch, kind, steps, tight)[0]
    assert choice["dispatch"] == "capacity" and choice["factor"] == DEFAULT_CAPACITY, choice
    assert choice["capacity_peak"] < choice["room"] < choice["dropless_peak"], choice
    assert f"capacity x{DEFAULT_CAPACITY:g}, by the cost model: dropless needs" in explain, explain
    ref_losses, ref_sd = harness.hf_reference(kind, 2, steps, "fp32", capacity=DEFAULT_CAPACITY)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    errs = [((sd[k] - ref_sd[k]).norm() / ref_sd[k].norm()).item() for k in ref_sd if not k.endswith("k_proj.bias")]
    assert max(errs) <= 1e-5, max(errs)


@pytest.mark.parametrize("kind", ["mixtral-grouped_mm", "mixtral-eager"])
def test_hf_experts_cut_over_tp_within_each_expert(pools, kind):
    """Hugging Face's experts on tp=2 (fp64, no ep): the plan found from the graph follows each expert's matrix back
    to its 3-dim parameter (a select of it in the loop and in the grouped products' traced path), cuts gate_up in its
    gate and up halves (each rank holds its rows of both) and down by its input dim, and the masked rows' partial
    sums add up over the experts: one all-reduce a layer for the experts each way, beside the attention's (in the
    backward each expert's input gradient stays partial through its mask into the sum over the experts). The same
    training as one device (to the fp32 rounding of HF's loss)."""
    import transformers

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")
    ref_losses, ref_sd = harness.hf_reference("mixtral-eager", 1, 3)  # grouped_mm's kernel takes no fp64 eagerly
    losses, sd, counts, shapes = pools(2).run(harness.hf_tp_run, kind, "zero3", 3, 2)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-6
    assert harness.rel_param_err(sd, ref_sd) <= 1e-6
    e, two_f, h = ref_sd["model.layers.0.mlp.experts.gate_up_proj"].shape
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (e, two_f // 2, h), shapes
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (e, h, two_f // 4), shapes
    # 2 layers, each the attention's and the experts'; 4: the vocab-parallel embedding's and head's (as HF Llama's)
    assert counts[("all_reduce", "fwd")] == 2 * 2 + 4 and counts[("all_reduce", "bwd")] == 6, counts


def test_hf_experts_on_torchs_grouped_kernel_cut_over_tp(pools):
    """In bf16 HF Mixtral's experts run torch's grouped product itself (``aten._grouped_mm``, its CPU kernel here):
    on tp=2 the plan cuts them within each expert through it (sharding/rules/matmul.py ``grouped_mm``), one forward
    and one backward reduction a layer for the experts (as the traced fp32 path has). bf16
    through AdamW moves the smallest weights apart by rounding (tp with the experts whole does alike), so the losses
    are what is compared: within 5e-4 of one rank's over 3 steps (measured 1.6e-4)."""
    import transformers

    if not (hasattr(transformers.PreTrainedModel, "set_experts_implementation") and hasattr(torch.ops.aten,
                                                                                              "_grouped_mm")):
        pytest.skip("needs transformers' experts implementations (5.x) and torch's grouped product")
    ref, _ = pools(1).run(harness.hf_run, "mixtral-grouped_mm", "zero3", 3, "bf16")[0]
    losses, _, counts, shapes = pools(2).run(harness.hf_tp_run, "mixtral-grouped_mm", "zero3", 3, 2, "bf16")[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) <= 5e-4, (losses, ref)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 48, 32), shapes  # whole: (4, 96, 32)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (4, 32, 24), shapes  # whole: (4, 32, 48)
    assert counts[("all_reduce", "fwd")] == 2 * 2 + 4 and counts[("all_reduce", "bwd")] == 6, counts


@pytest.mark.parametrize("kind,sp,factor", [("mixtral-grouped_mm", True, None), ("qwen2_moe", False, 1.0)])
def test_hf_experts_on_a_mesh_of_ep_and_tp(pools, kind, sp, factor):
    """ep=2 x tp=2 under zero3: the experts split over ep as traced (each rank 2 of the 4), and over tp within each
    expert as the attention (and Qwen's shared expert) are, by the plan found from the graph; then their tp shards'
    rows over ep (ZeRO over dp x ep). Mixtral dropless with sequence parallelism; Qwen2-MoE under the capacity rule at
    factor 1, its pairs past capacity dropped as one device drops them. The same training as eager fp32 on one
    device, to fp32 rounding: the tp ranks' partial sums add in another order, which AdamW's per-tensor scaling
    shows most on the experts' small gradients (1.0e-5 after 4 steps here; 3e-6 on tp alone, 4e-6 on ep alone)."""
    import transformers

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations (5.x has)")
    steps = 4
    ref_losses, ref_sd = harness.hf_reference(kind, 2, steps, "fp32", capacity=factor)
    losses, sd, comm, shapes = pools(4).run(harness.hf_ep_tp_run, kind, "zero3", steps, sequence_parallel=sp,
                                            ep_capacity_factor=factor)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-6
    errs = {k: ((sd[k] - ref_sd[k]).norm() / ref_sd[k].norm().clamp_min(1e-30)).item() for k in ref_sd
            if ref_sd[k].is_floating_point() and not k.endswith("k_proj.bias")}
    assert max(errs.values()) <= 3e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    # the graph change: this rank's 2 experts cut over tp within each (gate_up in its gate and up halves' rows, down by
    # its input columns), q_proj's rows cut over tp and then over ep
    e, two_f, h = ref_sd["model.layers.0.mlp.experts.gate_up_proj"].shape
    assert e == 4 and shapes["model.layers.0.mlp.experts.gate_up_proj"] == (2, two_f // 2, h), shapes
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (2, h, two_f // 4), shapes
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32 // 4, 32), shapes
    # the ep dispatch as on ep alone (per layer, dropless: three gathers to the experts and one reduce-scatter back;
    # capacity: one all-to-all there and one back), the tp axis's own collectives beside it
    if factor is None:
        assert comm[("ep", "all_gather", "fwd", False)] == 6 and comm[("ep", "reduce_scatter", "fwd", False)] == 2
    else:
        assert comm[("ep", "all_to_all", "fwd", False)] == 4 and ("ep", "all_gather", "fwd", False) not in comm
    assert comm[("tp", "reduce_scatter" if sp else "all_reduce", "fwd", False)] >= 2, comm
