"""Expert parallelism (issue 24): the built-in MoE's experts split over the ep axis, tokens sent to
them and back by all-to-all; parity with single-device training, the graph change, the memory."""

import re

import harness
import pytest
import torch

from shardwise.config import JobConfig


def _parity(pools, strategy, ep, ws, cf=2.0, steps=3, **kw):
    """Losses and final weights of dp x ep training against single-device training that averages the
    ws ranks' micro-batches (each dispatched under its own capacity, as each rank dispatches)."""
    over = (("capacity_factor", cf),)
    ref, ref_sd = harness.reference("moe", "fp64", ws, steps, over)
    losses, sd, info = pools(ws).run(harness.ep_run, strategy, steps, ep, cf, **kw)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) <= 1e-10, (losses, ref)
    assert harness.rel_param_err(sd, ref_sd) <= 1e-10
    assert harness.rel_param_err(sd, harness.make_model("moe", "fp64").state_dict()) > 1e-3  # it trained
    return info


@pytest.mark.parametrize("strategy,ep,ws", [("ddp", 2, 2), ("zero3", 2, 2), ("ddp", 2, 4), ("zero2", 2, 4), ("zero3", 2, 4)])
def test_expert_parallel_parity_fp64(pools, strategy, ep, ws):
    """ep=2 alone and dp=2 x ep=2, the dp strategy on the rest; nothing dropped (capacity 2 = E/k)."""
    info = _parity(pools, strategy, ep, ws)
    assert info["shapes"]["blocks.0.ffn.w1"][0] == 4 // ep  # this rank's experts only
    assert info["dropped"] == {"blocks.0.ffn.dropped": 0, "blocks.1.ffn.dropped": 0}


def test_expert_parallel_with_dropped_tokens_equals_one_device_under_the_same_capacity_rule(pools):
    """Capacity 1: pairs past an expert's capacity are dropped on each rank as one device drops them,
    counted, and told by explain per MoE layer."""
    info = _parity(pools, "zero3", 2, 2, cf=1.0)
    assert all(n > 0 for n in info["dropped"].values()) and len(info["dropped"]) == 2
    rows = [ln.split() for ln in info["explain"].splitlines() if ln.strip().startswith("blocks.0.ffn ")]
    # dispatch, experts, per rank, capacity (32 tokens' 2 choices over 4 experts), ..., dropped
    assert rows and rows[0][1:5] == ["capacity", "4", "2", "16"] and rows[0][-1] == str(info["dropped"]["blocks.0.ffn.dropped"])


def test_an_ep_plan_names_the_experts_to_split(pools):
    """ep_plan: only the first layer's experts split over ep; the second's stay whole on every ep
    rank, their gradients averaged as the other parameters' are. Same numbers as one device."""
    info = _parity(pools, "zero2", 2, 2, ep_plan=["blocks.0.ffn.w*"])
    assert info["moe_params"] == ["blocks.0.ffn.w1", "blocks.0.ffn.w2", "blocks.0.ffn.w3"], info["moe_params"]
    assert sum(v for (axis, kind, _), v in info["phases"].items() if kind == "all_to_all") == 4  # one layer's
    # the second layer's experts are ZeRO-sharded over ep as the other parameters are: gathered whole
    assert info["ep_params"][("all_gather", "fwd", "blocks.1.ffn.w1")] == 1
    assert not any(p.startswith("blocks.0.ffn.w") for _, _, p in info["ep_params"])


def test_expert_parallel_gradient_accumulation_parity(pools):
    """Two micro-batches per step with drops (zero3 on a dp axis of one): the ep collectives run in
    every micro-batch's program, the dp reduction once."""
    over = (("capacity_factor", 1.0),)
    ref, ref_sd = harness.reference("moe", "fp64", 2, 3, over, micro=2)
    losses, sd, _ = pools(2).run(harness.train_run, "moe", "zero3", "fp64", 3, over, None, 2, mesh_kw=(("ep", 2),))[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) <= 1e-10
    assert harness.rel_param_err(sd, ref_sd) <= 1e-10


def test_one_dispatch_and_one_combine_all_to_all_per_moe_layer_and_no_expert_gathered_across_ep(pools):
    """The graph change: per MoE layer, an all-to-all sends the tokens to their experts and one brings
    the outputs back in the forward, and the backward has their two transposes, all on the ep axis;
    no expert parameter is all-gathered over ep. Under zero3 every other parameter is ZeRO-sharded
    over dp x ep: gathered over ep before its forward use and again for its backward one, its
    gradient reduce-scattered over ep (the loss all-reduced). Under ddp the others stay whole, their
    gradients summed over ep in one all-reduce."""
    _, _, info = pools(4).run(harness.ep_run, "zero3", 1, 2)[0]
    layers = info["n_layer"]
    ep = {k: v for k, v in info["phases"].items() if k[0] == "ep" and k[1] != "all_gather" and k[1] != "reduce_scatter"}
    assert ep == {("ep", "all_to_all", "fwd"): 2 * layers, ("ep", "all_to_all", "bwd"): 2 * layers,
                  ("ep", "all_reduce", "bwd"): 1}, ep
    shared = [n for n in info["shapes"] if n not in info["moe_params"]]
    # per layer its norms, attention and router; the embedding, last norm and head
    assert len(info["moe_params"]) == 3 * layers and len(shared) == 7 * layers + 3
    want = {(k, ph, n): 1 for n in shared for k, ph in (("all_gather", "fwd"), ("reduce_scatter", "bwd"))}
    assert {k: v for k, v in info["ep_params"].items() if k[1] == "fwd" or k[0] == "reduce_scatter"} == want
    again = {n for k, ph, n in info["ep_params"] if (k, ph) == ("all_gather", "bwd")}
    assert {n for n in shared if n.endswith(("wq.weight", "wo.weight", "head.weight"))} <= again <= set(shared)
    assert all(info["shapes"][n][0] * 2 == harness.make_model("moe", "fp64").get_parameter(n).shape[0] for n in shared)
    assert info["phases"][("dp", "all_gather", "fwd")] > 0
    # the gathers over ep are bucketed as the dp ones are (the cost model's size): fewer than the parameters
    assert len(info["products_under_ep_gathers"]) < len(want) // 2 + len(again), info["products_under_ep_gathers"]
    # one per parameter without buckets: the gather over ep, which reads zero3's gather over dp, is prefetched
    # too, products run while half of them are in flight (one collective at a time on gloo)
    _, _, info = pools(4).run(harness.ep_run, "zero3", 1, 2, shard_bucket_mb=0)[0]
    under = info["products_under_ep_gathers"]
    assert len(under) == len(want) // 2 + len(again) == 33 and sum(n > 0 for n in under) >= 16, under
    _, _, info = pools(4).run(harness.ep_run, "ddp", 1, 2)[0]
    assert {k: v for k, v in info["phases"].items() if k[0] == "ep" and k[1] != "all_to_all"} == {("ep", "all_reduce", "bwd"): 2}


def test_expert_parameters_and_their_optimizer_state_per_rank_fall_by_ep(pools):
    """Measured on the state each rank holds: two ranks as dp=2, then as ep=2, under ddp (under
    zero3 dp=4 and dp=2 x ep=2 hold alike, 1/4 each; ep spares the gathers)."""
    dp2 = pools(2).run(harness.ep_run, "ddp", 1, 1)[0][2]["expert_bytes"]
    ep2 = pools(2).run(harness.ep_run, "ddp", 1, 2)[0][2]["expert_bytes"]
    assert ep2 * 2 == dp2, (dp2, ep2)


def test_under_zero3_the_other_parameters_and_their_state_are_sharded_over_dp_x_ep(pools):
    """Measured: on ep=2 (a dp axis of one) zero3 holds half of the non-expert parameters and their
    optimizer state, as zero3 on dp=2 does, rather than all of them."""
    whole = pools(2).run(harness.ep_run, "ddp", 1, 2)[0][2]["shared_bytes"]
    dp2 = pools(2).run(harness.ep_run, "zero3", 1, 1)[0][2]["shared_bytes"]
    ep2 = pools(2).run(harness.ep_run, "zero3", 1, 2)[0][2]["shared_bytes"]
    assert ep2 == dp2 and ep2 * 2 == whole, (whole, dp2, ep2)


def test_an_expert_parallel_checkpoint_resumes_with_or_without_ep(pools, tmp_path):
    """Saved by ep=2 under zero3 (each rank's experts as pieces of the whole tensors), resumed under
    zero2 and zero3 on ep=2 and under zero2 on dp=2: the next step as the uninterrupted run's."""
    path = str(tmp_path / "ck")
    pools(2).run(harness.ep_run, "zero3", 3, 2, 2.0, save=path)
    full, sd_full, _ = pools(2).run(harness.ep_run, "zero3", 4, 2, 2.0)[0]
    for ep, strategy in ((2, "zero2"), (2, "zero3"), (1, "zero2")):
        loss, sd = pools(2).run(harness.ep_resumed, path, ep, 3, strategy)[0]
        assert abs(loss - full[3]) <= 1e-12 * abs(full[3]) and harness.rel_param_err(sd, sd_full) <= 1e-12, (ep, strategy)


@pytest.mark.parametrize("strategy,split,sp", [("ddp", 1, False), ("zero3", 1, False), ("zero3", 2, False),
                                               ("zero3", 1, True)])
def test_expert_and_tensor_parallelism_together(pools, strategy, split, sp):
    """ep=2 x tp=2 (4 ranks): the attention cut over tp (Megatron's plan), the experts over ep by
    experts and over tp within each (w1, w3 by columns, w2 by rows: each rank holds 1/4 of them), under
    zero3 the attention's tp shards and the other parameters cut over ep as well (ZeRO over ep), each
    tp pair taking one batch (with ``split``, as two interleaved halves; with ``sp``, its tokens in
    sequence shards between the tp products); fp64 parity with one device averaging the two batches.
    The graph has the MoE layers' all-to-alls on ep (each half's) and, per layer, an all-reduce on tp
    after the attention's row product and one of the experts' outputs (under sp: a reduce-scatter
    after the attention, and the capacity dispatch's gathers of the sharded tokens, its positions
    being a running sum over all of them; every op placed by a rule, none read whole by
    ``allow_replicate``; its activations kept in host memory between forward and backward)."""
    steps = 3
    ref, ref_sd = harness.reference("moe", "fp64", 2, steps, (("capacity_factor", 2.0),))
    kw = {"sequence_parallel": True, "offload_activations": True} if sp else {"ep_split": split}
    losses, sd, counts, explain = pools(4).run(harness.ep_tp_run, strategy, steps, **kw)[0]
    assert sp == ("activations kept in host memory" in explain), explain
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) <= 1e-10, (losses, ref)
    assert harness.rel_param_err(sd, ref_sd) <= 1e-10
    assert counts[("ep", "all_to_all", "fwd")] == 4 * split and counts[("ep", "all_to_all", "bwd")] == 4 * split, counts
    if sp:  # the experts' all-reduces, and the dropped counts' (a sum over the token shards)
        assert counts[("tp", "reduce_scatter", "fwd")] == 2 and counts[("tp", "all_reduce", "fwd")] == 4, counts
        assert counts[("tp", "all_gather", "fwd")] >= 2 * 4, counts
    else:
        assert counts[("tp", "all_reduce", "fwd")] == 4 * split and counts[("tp", "reduce_scatter", "fwd")] == 0, counts
    rows = {ln.split()[0]: " ".join(ln.split()) for ln in explain.splitlines() if ln.startswith("  blocks.0.")}
    w1, w2 = rows["blocks.0.ffn.w1"], rows["blocks.0.ffn.w2"]
    assert "(2, 32, 16)" in w1 and "tp S(2) ep S(0)" in w1 and "(2, 16, 32)" in w2 and "tp S(1) ep S(0)" in w2, rows
    # under ZeRO the other parameters' tp shards are cut over ep too (ZeRO over dp x ep)
    wq = rows["blocks.0.attn.wq.weight"]
    assert ("(16, 32)" in wq and "tp S(0) ep R" in wq) if strategy == "ddp" else ("(8, 32)" in wq and "tp S(0) ep S(0)" in wq), rows


@pytest.mark.parametrize("ws,tp", [(2, None), (4, 2)])
def test_expert_parallel_training_loop_parity(pools, ws, tp):
    """Accumulation, the global grad-norm clip (each axis' shards' squares added once, what is whole on
    an axis once), the schedule and eval, zero3 on ep=2 and on ep=2 x tp=2."""
    over = (("capacity_factor", 2.0),)
    ref_losses, ref_norms, ref_eval, ref_sd = harness.loop_reference("moe", "fp64", 2, 3, over)
    losses, norms, ev, sd = pools(ws).run(harness.loop_run, "moe", "zero3", "fp64", 3, tp, over, 2)[0]
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= 1e-10
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) <= 1e-10
    assert sum(n > harness.LOOP["clip"] for n in ref_norms) >= 2  # the threshold really clips
    assert abs(ev - ref_eval) / ref_eval <= 1e-10
    assert harness.rel_param_err(sd, ref_sd) <= 1e-10


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_split_batch_overlaps_one_halfs_all_to_alls_with_the_others_compute(pools, strategy):
    """ep_split=2: each rank's batch traced as two halves whose work is interleaved. The graph change:
    without it no matrix product runs while a forward all-to-all is in flight (each layer's next
    product needs it); with it the other half's products do, under most of them. Same numbers as
    one device (no drops: each half's capacity holds all its pairs)."""
    whole, halves = _parity(pools, strategy, 2, 2), _parity(pools, strategy, 2, 2, ep_split=2)
    plain, split = whole["products_under_all_to_all"], halves["products_under_all_to_all"]
    assert len(plain) == 4 and not any(plain), plain
    assert len(split) == 8 and sum(n > 0 for n in split) >= 6, split

    def moe_rows(info):  # explain's row per MoE layer: (name, forward bytes sent per rank)
        return [(r[0], r[5]) for r in (ln.split() for ln in info["explain"].splitlines()) if r[:1] in (["blocks.0.ffn"],
                                                                                                  ["blocks.1.ffn"])]

    # one row per layer either way, its two halves' collectives sending what the whole batch's did
    assert moe_rows(halves) == moe_rows(whole) and len(moe_rows(whole)) == 2, (moe_rows(whole), moe_rows(halves))


def test_ep_split_auto_keeps_what_the_cost_model_predicts_faster(pools):
    """ep_split="auto": the first program traced whole and in halves, the faster predicted step kept; explain gives
    both predictions; the program run is the chosen one (4 forward all-to-alls whole, 8 in halves), with the numbers
    of one device."""
    info = _parity(pools, "zero3", 2, 2, ep_split="auto")
    line = next(ln for ln in info["explain"].splitlines() if "ep_split=auto" in ln)
    chosen = int(re.search(r"ep_split=auto: (\d) part", line)[1])
    predicted = {int(k): float(t) for t, k in re.findall(r"([\d.]+) ms as (\d)", line)}
    assert sorted(predicted) == [1, 2] and chosen == min(predicted, key=predicted.get), line
    assert len(info["products_under_all_to_all"]) == 4 * chosen, info["products_under_all_to_all"]
    with pytest.raises(ValueError, match="ep_split must be a number of batch parts >= 1 .* or 'auto'"):
        JobConfig(ep_split="halves")


def test_a_split_batch_counts_the_pairs_every_part_dropped(pools):
    """ep_split=2 under capacity 1: each half is dispatched alone, and a layer's ``dropped`` is what its
    two halves dropped together (as one device counts them running the halves one by one), not the
    last half's alone."""
    info = pools(2).run(harness.ep_run, "zero3", 1, 2, 1.0, ep_split=2)[0][2]
    model = harness.make_model("moe", "fp64", capacity_factor=1.0)
    x, _ = harness.make_batch("moe", 0, 0)
    halves = []
    with torch.no_grad():
        for part in x.tensor_split(2):
            model(part)
            halves.append({f"blocks.{i}.ffn.dropped": int(b.ffn.dropped) for i, b in enumerate(model.blocks)})
    assert all(h[k] > 0 for h in halves for k in h), halves  # each half drops: the last alone would miss some
    assert info["dropped"] == {k: halves[0][k] + halves[1][k] for k in halves[0]}, (info["dropped"], halves)


def test_an_ep_x_tp_checkpoint_resumes_on_ep_x_tp_and_on_ep(pools, tmp_path):
    """Saved by ep=2 x tp=2 under zero3 (the experts' ep pieces, the attention's tp pieces), resumed on
    the same mesh and, by the two batches' ranks alone, on ep=2: the next step as the uninterrupted run's."""
    path = str(tmp_path / "ck")
    full, sd_full, _, _ = pools(4).run(harness.ep_tp_run, "zero3", 4, save=path, save_after=3)[0]
    loss, sd = pools(4).run(harness.ep_resumed, path, 2, 3, "zero3", 2)[0]
    assert abs(loss - full[3]) <= 1e-12 * abs(full[3]) and harness.rel_param_err(sd, sd_full) <= 1e-12
    loss, sd = pools(2).run(harness.ep_resumed, path, 2, 3, "zero2")[0]
    assert abs(loss - full[3]) <= 1e-10 * abs(full[3]) and harness.rel_param_err(sd, sd_full) <= 1e-10


@pytest.mark.parametrize("case,ranks,says", [
    ("dense", 2, "mesh ep=2: shardwise finds no experts in the model"),
    ("uneven", 2, "ep=2 does not divide the 3 experts of blocks.0.ffn.w1: use an ep that divides"),
    ("plan-none", 2, "ep_plan: 'blocks.*.attn.*' names no expert parameter: it names ['blocks.0.attn.wq.weight'"),
    ("plan-typo", 2, "ep_plan: 'blocks.*.moe.*' names no expert parameter: it names no parameter of the model"),
    ("capacity", 2, "ep_capacity_factor applies to Hugging Face experts; the built-in MoE takes its capacity"),
    ("split", 2, "a batch split in 3 needs a batch dim (dim 0 of its tensors) that 3 divides, got 2"),
])
def test_bad_ep_jobs_are_refused_by_name(pools, case, ranks, says):
    results = pools(ranks).run_all(harness.ep_refused, case)
    assert all(not ok and says in val[1] for ok, val in results), results
