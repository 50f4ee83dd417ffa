"""``shardwise plan``: model shapes, the multi-level collective model, the step and memory estimate."""

import dataclasses
import json
import re

import pytest

from shardwise.planner.clusters import cluster
from shardwise.planner.estimate import Strategy, estimate
from shardwise.planner.models import MODELS, ModelSpec, from_hf_config, model


@pytest.mark.parametrize("name,total,active", [
    ("llama3-8b", 8.03e9, 8.03e9), ("llama3-70b", 70.6e9, 70.6e9), ("llama3-405b", 405.9e9, 405.9e9),
    ("mixtral-8x7b", 46.7e9, 12.9e9), ("gpt3-175b", 174.6e9, 174.6e9)])
def test_presets_have_the_published_parameter_counts(name, total, active):
    # Meta's Llama 3 model cards, Mistral's Mixtral announcement, Brown et al. 2020 (175B)
    m = MODELS[name]
    assert abs(m.params() / total - 1) < 0.003 and abs(m.params(active=True) / active - 1) < 0.003


def test_hf_config(tmp_path):
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert from_hf_config(str(p)).params() == MODELS["llama3-8b"].params()
    p.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model(str(p))


def test_collectives_over_nodes_run_as_rings_at_the_slowest_level():
    c = cluster("dgx-h100:4")
    intra, inter = c.dims[0][1], c.dims[1][1]
    S = 1 << 30
    one_node = c.collective_s("all_gather", S, 8)
    assert one_node == pytest.approx(7 * intra.alpha + 7 / 8 * S / intra.busbw)
    # 32 ranks: rings through every rank, each leaving its node through its own NIC, so the network
    # level carries 8 NICs' worth (8 x 47 GB/s > NVLink's 370 GB/s: NVLink is the bottleneck);
    # latency: one ring through the 32 ranks (NCCL's tuner), its 31 steps 3 over the network and 28
    # over NVLink (7 in each of the 4 nodes)
    both = c.collective_s("all_gather", S, 32)
    slowest = min(intra.busbw, 8 * inter.busbw)
    assert both == pytest.approx(28 * intra.alpha + 3 * inter.alpha + 31 / 32 * S / slowest)
    assert c.collective_parts("all_gather", S, 32)[2] == 31
    # an all-reduce's latency level by level (NCCL takes trees and NVLS across nodes where rings are
    # slow to start): 2 x (7 + 3) steps; its bandwidth twice the all-gather's
    lat, bw, steps = c.collective_parts("all_reduce", S, 32)
    assert steps == 20 and lat == pytest.approx(2 * (7 * intra.alpha + 3 * inter.alpha))
    assert bw == pytest.approx(2 * c.collective_parts("all_gather", S, 32)[1])
    # nccl-tests#309 measured 366 GB/s all-reduce bus bandwidth on these 4 nodes; level by level on
    # shrinking data (the model before) predicted 222
    t = c.collective_s("all_reduce", 8 * S, 32)
    assert abs(8 * S / t * 2 * 31 / 32 / 365.84e9 - 1) < 0.05
    # ranks 8 apart (tensor parallel filling each node): every step crosses the network, one NIC each
    assert c.collective_s("all_gather", S, 4, inner=8) == pytest.approx(3 * inter.alpha + 3 / 4 * S / inter.busbw)


def test_estimates_move_the_way_the_strategy_says():
    m, c = MODELS["llama3-70b"], cluster("dgx-h100:8")
    base = dict(tp=8, seq=8192, global_batch=64)
    mem = {z: estimate(m, c, Strategy(zero=z, **base)).memory for z in (0, 1, 2, 3)}
    assert mem[0]["optimizer"] > mem[1]["optimizer"] and mem[1]["grads"] > mem[2]["grads"]
    assert mem[2]["weights"] > mem[3]["weights"]
    rec = {r: estimate(m, c, Strategy(recompute=r, fused_attention=False, **base)) for r in ("none", "selective", "full")}
    assert rec["none"].memory["activations"] > rec["selective"].memory["activations"] > rec["full"].memory["activations"]
    # fused attention keeps no scores: selective recomputation saves nothing more
    fused = {r: estimate(m, c, Strategy(recompute=r, **base)).memory["activations"] for r in ("none", "selective")}
    assert fused["none"] == fused["selective"] == rec["selective"].memory["activations"]
    assert rec["none"].compute_s < rec["selective"].compute_s < rec["full"].compute_s
    pp = [estimate(m, c, Strategy(tp=8, pp=4, seq=8192, global_batch=g)) for g in (16, 64)]
    assert pp[0].pp_bubble_s / pp[0].compute_s > pp[1].pp_bubble_s / pp[1].compute_s
    assert estimate(m, c, Strategy(seq=8192, global_batch=64)).tp_comm_s == 0


def test_bad_plans_are_refused_with_the_reason():
    m, c = MODELS["llama3-8b"], cluster("dgx-h100:1")
    with pytest.raises(ValueError, match="inside a node"):
        estimate(m, cluster("dgx-h100:2"), Strategy(tp=16))
    with pytest.raises(ValueError, match="global batch"):
        estimate(m, c, Strategy(global_batch=3))
    with pytest.raises(ValueError, match="unknown cluster"):
        cluster("dgx-z100:4")
    with pytest.raises(ValueError, match="recompute"):
        Strategy(recompute="some")


def test_cli_plan_json(capsys):
    from shardwise.cli import main

    main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--zero", "3", "--seq", "8192", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 8 and out["dp"] == 8 and 0 < out["mfu"] < 1 and out["memory"]["total"] > 0
    with pytest.raises(SystemExit, match="does not divide"):
        main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--tp", "3"])
    main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:4", "--zero", "3", "--shard", "8"])
    out = capsys.readouterr().out
    assert "zero3 sharded over groups of 8" in out and "memory per GPU" in out


def test_predictions_hold_the_published_runs_within_10pct():
    # bench/results/2026-11-30-plan-validation.md: the efficiency curve is fitted on two runs (22B and
    # 175B with selective recomputation); the others are predicted blind
    from shardwise.planner.validation import table

    rows = table()
    kor = [r for r in rows if r["source"] == "korthikanti"]
    # fitted: two Korthikanti runs (the A100 share), our one-H200 run (the H100's share, and the H200's of its
    # measured product and attention rates), MaxText's 32B (v5p's)
    # and 16B (v5e's), MaxText's 64B on 2 and 32 v5e slices (the data-center spine), torchtitan's eager
    # 8-GPU run (eager norms and rotary embedding), NeMo's Llama 3 70B in FP8 (TE's FP8 share), torchtitan's 8-GPU
    # Float8 run (torchao's), llm-foundry's MPT 1B at 3x8192 on 8 H100s and on 8 A100s (the triton-2022 attention's)
    assert len(kor) == 8 and sum(r["fitted"] for r in rows) == 12
    for r in kor:
        assert abs(r["error"]) <= 0.10, r
    # vTrain's fastest configurations, blind: the three large models within 10% (the 3.6B one is 27%
    # slow in the table: small models' non-matmul work is not in the efficiency curve)
    vt = {r["run"].split()[0]: r for r in rows if r["source"] == "vtrain"}
    for size in ("3.6B", "18.4B", "39.1B", "175B"):
        assert abs(vt[size]["error"]) <= 0.10, vt[size]
    # our two-H200 runs (ZeRO-3, and weights gathered once), blind on the calibrated NVLink figures, both within 10%
    # with the copies of shardwise's buckets counted (--framework shardwise; ZeRO-3 was 12.6% fast without them)
    ours = {"once" in r["run"]: r for r in rows if r["source"] == "ours_h200x2"}
    assert len(ours) == 2 and not any(r["fitted"] for r in ours.values())
    assert all(abs(r["error"]) <= 0.10 for r in ours.values()), ours
    # the 8B shape on the same two GPUs, blind, with and without per-block checkpointing (planned as
    # "block": the layer's forward but its down projection; as "full", a whole forward, shardwise's
    # checkpointed step was 12.5% slow)
    eight = {(r["run"].split(", ")[2], "checkpointing" in r["run"]): r["error"] for r in rows if r["source"] == "ours_8b"}
    assert len(eight) == 4, eight
    assert all(abs(e) <= 0.10 for e in eight.values()), eight
    # the rows without recomputation again, every system stepping the fused AdamW the planner counts (FSDP2's +1.8%
    # before its copy-in and sharded update were counted as measured at two ranks, +5.1% since; shardwise's +3.3%)
    fused = [r for r in rows if r["source"] == "ours_8b_fused"]
    assert len(fused) == 2 and all(abs(r["error"]) <= 0.10 and not r["fitted"] for r in fused), fused
    # and every one of our own step rows within 10% (the bar), Mixtral's layer x 8 under FSDP2 among them
    ours = [r for r in rows if r["source"].startswith("ours") and r["measured_s"]]
    assert len(ours) == 11 and all(abs(r["error"]) <= 0.10 for r in ours), [r for r in ours if abs(r["error"]) > 0.1]
    # DeepCompile on the same shape with per-block checkpointing (sitting 6), blind: -4.0%
    dc = [r for r in rows if r["source"] == "ours_dc"]
    assert len(dc) == 1 and abs(dc[0]["error"]) <= 0.10 and not dc[0]["fitted"], dc
    # MaxText (JAX/XLA) on one 8-H100 A3 VM, FSDP, blind on the H100 share fitted on our H200 run
    a3 = [r for r in rows if r["source"] == "maxtext_a3"]
    assert len(a3) == 1 and abs(a3[0]["error"]) <= 0.10, a3
    # tpu-recipes on TPU v6e (8-256 chips), blind with the A100's share: 11 of 14 within 10%; GPT-3
    # 175B is 20% fast, Llama 2 70B 12%, Mixtral 8x7B 12% (each 1-4 points faster since ZeRO-3 runs
    # on the per-layer timeline: it hides all but the first gathers and last reductions)
    v6e = {r["run"]: r["error"] for r in rows if r["source"] == "tpu_recipes"}
    assert len(v6e) == 14 and sum(abs(e) <= 0.10 for e in v6e.values()) >= 11, v6e
    # MaxText on TPU v5p slices of 64-512 chips, tensor parallel across torus axes, blind: the
    # selectively recomputed runs within 10% (its one fully rematerialized run, planned as per-layer
    # "block" recomputation, is 10.6% slow)
    tpu = [r for r in rows if r["source"] == "maxtext" and not r["fitted"] and "minimal" in r["run"] and " x " not in r["run"]]
    assert len(tpu) == 4
    for r in tpu:
        assert abs(r["error"]) <= 0.10, r
    # two slices over the data-center network, blind: 32B-128B on 64-128 chips a slice within 2%; 128B on 2 x 256 and
    # 256B on 2 x 512 chips 14% and 12% fast (one slice of each 4% and 8% fast)
    two = {r["run"].split(" on ")[0] + "/" + r["run"].split("(")[1].split()[0]: r["error"] for r in rows
           if r["source"] == "maxtext" and " x TPU v5p" in r["run"]}
    assert len(two) == 6 and all(abs(two[k]) <= 0.02 for k in ("32B/128", "64B/128", "128B/256")), two
    assert -0.15 < two["128B/512"] < -0.10 and -0.15 < two["256B/1024"] < -0.10, two
    # MaxText on one v5e-256 (a 2-D torus), FSDP over all of it with full remat: 32B and 64B blind
    one = [r for r in rows if r["source"] == "maxtext_v5e" and not r["fitted"] and " x TPU" not in r["run"]]
    assert len(one) == 2
    for r in one:
        assert abs(r["error"]) <= 0.10, r
    # and on 2-32 slices over the data-center network (FSDP in a slice, data parallel across): the 13
    # blind ones within 10% (10 of 15 were while the cross-slice all-reduce hid behind the backward on
    # the NICs' bandwidth alone; the spine is fitted on the 64B model's growth from 2 to 32 slices)
    many = {r["run"]: r for r in rows if r["source"] == "maxtext_v5e" and " x TPU" in r["run"]}
    blind = [r["error"] for r in many.values() if not r["fitted"]]
    assert len(many) == 15 and len(blind) == 13 and all(abs(e) <= 0.10 for e in blind), many
    # Megatron-Core in FP8 on DGX H100s (NeMo 24.07, Megatron-Bridge 25.11 to 26.06), 8 to 1024 GPUs, 5B to 405B:
    # the 13 blind rows (one an SFT step) within 10% on the FP8 share fitted on the fourteenth
    fp8 = [r for r in rows if r["source"] in ("nemo_2407", "megatron_bridge") and "Qwen3" not in r["run"]]
    assert len(fp8) == 14 and sum(r["fitted"] for r in fp8) == 1
    assert all(abs(r["error"]) <= 0.10 for r in fp8), fp8
    # its fine-grained MoE (Qwen3-30B-A3B: 128 experts of 768, 8 a token) blind: 25.11's row predicted 2.4x fast, the
    # 26.02.01 and 26.06 rows 1.2x and 1.6x (bench/results/2026-12-07-plan-moe-folding.md; 1.5x and 1.7x before the
    # experts' products ran at their shape's measured share); Qwen3-235B-A22B's two rows, ep 32 folded over tp x dp with
    # the all-to-alls overlapped, within 10%
    moe = [r["error"] for r in rows if "Qwen3-30B" in r["run"] and r["source"] == "megatron_bridge"]
    assert len(moe) == 3 and -0.7 < moe[0] < -0.55 and -0.2 < moe[1] < -0.15 and -0.4 < moe[2] < -0.3, moe
    big = [r["error"] for r in rows if "Qwen3-235B" in r["run"]]
    assert len(big) == 2 and all(abs(e) <= 0.10 for e in big), big
    # NeMo AutoModel's MoE rows over DeepEP, blind: Qwen3-30B-A3B on 8, DeepSeek-V3 on 256 H100s and (with its
    # pipeline split) Kimi K2 on 256 within 10%; DeepSeek-V3 on 1024 16% fast (bench/results/2026-12-06-plan-automodel.md)
    auto = {" ".join(r["run"].split()[:3]).rstrip(","): r for r in rows if r["source"] == "nemo_automodel"}
    assert sorted(auto) == ["DeepSeek-V3, 1024 H100", "DeepSeek-V3, 256 H100", "Kimi K2, 256", "Llama 3.1 70B",
                            "Qwen3-30B-A3B, 8 H100"]
    assert not any(r["fitted"] for r in auto.values())
    assert all(abs(auto[k]["error"]) <= 0.10 for k in ("Qwen3-30B-A3B, 8 H100", "DeepSeek-V3, 256 H100",
                                                        "Llama 3.1 70B", "Kimi K2, 256")), auto
    assert -0.20 < auto["DeepSeek-V3, 1024 H100"]["error"] < -0.15, auto


def test_wide_heads_and_tensor_parallel_across_torus_axes():
    from shardwise.planner.validation import maxtext_model

    # MaxText's 128B: 128 heads of 128 on a width of 8192, so queries are 16384 wide
    m = maxtext_model(128)
    assert (m.layers, m.hidden, m.heads, m.ffn) == (64, 8192, 128, 57344) and m.q_dim == 16384
    assert m.attention_params() == 8192 * 16384 * 2 + 2 * 8192 * 128 * 128
    assert abs(m.params() / 1e9 - 125.1) < 0.1
    # attention FLOPs follow the query width
    assert m.flops_per_token(2048) - 6 * (m.layers * (m.layer_params(True) - 2 * m.hidden) + m.vocab * m.hidden) \
        == 12 * 64 * 16384 * 2048
    # on a TPU slice tensor parallelism may span torus axes; on GPUs it stays inside a node
    est = estimate(m, cluster("tpu-v5p:4x4x8"), Strategy(tp=8, zero=3, micro_batch=8, global_batch=128, seq=2048))
    assert est.tp_comm_s > 0
    with pytest.raises(ValueError, match="inside a node"):
        estimate(m, cluster("dgx-h100:16"), Strategy(tp=16, zero=3, seq=2048))
    # groups must tile the torus: 8 ranks do not fit a 3-long axis, nor 12 a 4 x 4 x 12 slice's first two
    for spec, tp in (("tpu-v5p:3x4x4", 8), ("tpu-v5p:4x4x12", 12)):
        with pytest.raises(ValueError, match="do not tile"):
            estimate(m, cluster(spec), Strategy(tp=tp, zero=3, micro_batch=tp, seq=2048))


def test_collective_rows_hold_their_inputs_and_the_blind_multi_node_run():
    from shardwise.planner.validation import collective_table

    rows = {r["run"]: r for r in collective_table()}
    for r in rows.values():
        if r["input"]:  # the link constants were read off these: the formula must give them back
            assert abs(r["error"]) < 0.01, r
    assert abs(rows["4 nodes of 8 H100, NDR 8x400G, all-reduce"]["error"]) < 0.05
    # NVLink SHARP inside an NVSwitch node (its constant read off the H100 row) predicts the H200 node
    assert abs(rows["8 H200, all-reduce (NCCL 2.20.3)"]["error"]) < 0.05
    # across nodes NVLSTree (the switch reduces inside the node, each GPU's NIC all-reduces 1/8 of
    # the buffer on a tree): blind, within 10% (the rings alone were 21% low on 2 nodes); on 4 nodes
    # a NIC carries its share twice and the rings stay faster
    assert abs(rows["2 nodes of 8 H100, NDR 8x400G, all-reduce (NVLSTree)"]["error"]) < 0.10
    c2, S2 = cluster("dgx-h100:2"), 8 * 2**30
    assert c2.topology.nvls_tree_s(S2, *c2.levels(16)) == pytest.approx(S2 / 275e9)  # the switch sets it
    assert c2.collective_parts("all_reduce", S2, 16)[1] == pytest.approx(S2 / 275e9)
    c4 = cluster("dgx-h100:4")
    assert c4.topology.nvls_tree_s(S2, *c4.levels(32)) == pytest.approx(S2 / 8 * 2 / 47e9)  # the NICs set it
    assert c4.collective_parts("all_reduce", S2, 32)[1] < c4.topology.nvls_tree_s(S2, *c4.levels(32))
    c = cluster("dgx-h100:1")
    S = 1 << 30
    ring = 2 * 7 / 8 * S / c.dims[0][1].busbw
    nvls = c.collective_s("all_reduce", S, 8) - 14 * c.dims[0][1].alpha
    assert nvls == pytest.approx(S / 275e9) and nvls < ring
    assert cluster("dgx-a100:1").collective_s("all_reduce", S, 8) > ring  # no NVLS on NVLink3


def test_vtrain_runs_blind_with_the_memory_bound_kernels_counted():
    # all 103 of vTrain's multi-node A100 runs with tensor parallelism inside a node, predicted blind:
    # without the memory-bound kernels 67 were within 10% (mean |error| 11.2%, small models up to 47%
    # slow); with them 84 (7.5%)
    from shardwise.planner.validation import vtrain_all

    rows = vtrain_all()
    errs = [abs(r["error"]) for r in rows]
    assert len(rows) == 103
    assert sum(e <= 0.10 for e in errs) >= 80 and sum(errs) / len(errs) < 0.08


def test_memory_bound_kernels_weigh_more_on_small_and_unfused_models():
    from shardwise.planner.validation import megatron_gpt

    small, big = megatron_gpt("s", 30, 3072, 32), megatron_gpt("b", 96, 12288, 96)
    # flash attention moves no scores: 13·a·s bytes per token less per forward (and backward: x3)
    assert small.elementwise_bytes(2048, fused_attention=False) - small.elementwise_bytes(2048) == 3 * 13 * 32 * 2048
    # full recomputation repeats the forward's traffic, selective only the scores'
    e = lambda **k: small.elementwise_bytes(2048, fused_attention=False, **k)  # noqa: E731
    assert e(recompute="full") - e() == e() / 3
    assert e(recompute="selective") - e() == 13 * 32 * 2048
    c = cluster("a100-800g:8")

    def compute(m, **k):
        return estimate(m, c, Strategy(tp=8, micro_batch=1, global_batch=8, recompute="full", sp=False,
                                       fused_attention=False, **k)).compute_s

    # with the matrix products made free, what is left is the elementwise time: a larger share of
    # the small model's compute than of the large one's
    assert compute(small, efficiency=1e9) / compute(small) > compute(big, efficiency=1e9) / compute(big) > 0


def test_activation_memory_is_korthikantis_table_2_term_by_term():
    from shardwise.planner.models import ModelSpec

    # Megatron's GPT (ffn 4h, kv = h, dropout): the paper's per-layer bytes in units of s·b·h
    gpt = ModelSpec("gpt", 1, 12288, 96, 96, 4 * 12288, 51200, seq=2048, gated=False, dropout=True)
    s, b, h, a = 2048, 1, 12288, 96
    unit = s * b * h
    for t in (1, 2, 8):
        assert gpt.layer_activation_bytes(s, b, t, False, "none", False) / unit == pytest.approx(10 + 24 / t + 5 * a * s / (h * t))
        assert gpt.layer_activation_bytes(s, b, t, True, "none", False) / unit == pytest.approx((34 + 5 * a * s / h) / t)
        assert gpt.layer_activation_bytes(s, b, t, False, "selective", False) / unit == pytest.approx(10 + 24 / t)
        assert gpt.layer_activation_bytes(s, b, t, True, "selective", False) / unit == pytest.approx(34 / t)
        assert gpt.layer_activation_bytes(s, b, t, True, "full", False) / unit == pytest.approx(2 / t)
    # fused (flash) attention keeps no scores; a gated MLP keeps three ffn-wide tensors; GQA smaller K, V
    assert gpt.layer_activation_bytes(s, b, 1, False, "none", True) / unit == pytest.approx(34)
    llama = ModelSpec("l", 1, 4096, 32, 8, 14336, 128256)
    assert llama.layer_activation_bytes(s, b) == pytest.approx(s * b * (12 * 4096 + 4 * 1024 + 6 * 14336))


def test_predicted_peak_memory_holds_our_measured_runs():
    # the goal for our own runs: peak within 5% (bench/results/2026-12-04-plan-memory-peaks.md);
    # FSDP2 compiled and eager, DDP, shardwise, checkpointed or not, dense and MoE, on one and two H200s
    from shardwise.planner.validation import memory_table

    rows = [r for r in memory_table() if r["source"].startswith("ours")]
    assert len(rows) == 14
    for r in rows:
        assert abs(r["error"]) <= 0.05, r


def test_a_pytorch_stack_peaks_at_the_largest_of_three_moments():
    """PyTorch's layout (fp32 weights, gradients freed between steps): the forward's end holds no
    gradients; a checkpointed step with the multi-tensor AdamW peaks at its update."""
    m, c = MODELS["llama3-8b"], cluster("h200-nv18-x2:1")
    base = dict(zero=3, micro_batch=2, global_batch=4, seq=4096, recompute="none")
    mega, fsdp = (estimate(m, c, Strategy(**base, stack=k)) for k in ("megatron", "torch"))
    n = m.params() / 2  # ZeRO-3 over two GPUs
    assert mega.memory["total"] == pytest.approx(16 * n + mega.memory["activations"])
    # fp32 weights and moments, 16-bit copies of the root and two layers, activations: no gradients
    copies = 2 * (m.embedding_params() + m.head_params() + 2 * m.layer_params())
    assert fsdp.memory["total"] == pytest.approx(12 * n + copies + fsdp.memory["activations"])
    # torch.compile keeps 14·d where Korthikanti counts 8·d + 4·kv; eager 25.5·d and three fp32 logits
    tokens = 2 * 4096
    assert (fsdp.memory["activations"] - mega.memory["activations"]) / (tokens * m.layers) == pytest.approx(
        6 * 4096 - 4 * 1024)
    eager = estimate(m, c, Strategy(**base, stack="torch", eager=True))
    assert eager.memory["activations"] - fsdp.memory["activations"] == pytest.approx(
        11.5 * 4096 * tokens * m.layers + 8 * tokens * m.vocab)
    # checkpointed: the activations are small, so the update's fp32 temporary (foreach) sets the peak
    block = dict(base, recompute="block", stack="torch")
    foreach, fused = (estimate(m, c, Strategy(**block, foreach=f)) for f in (True, False))
    assert foreach.memory["total"] == pytest.approx(12 * n + 4 * n + 4 * n)
    assert fused.memory["total"] < foreach.memory["total"]
    assert "at the optimizer step" in foreach.formulas[-1] and "at the backward's end" in fused.formulas[-1]
    # autocast keeps a checkpointed layer's input in fp32; DDP keeps its gradient buckets across steps
    amp = estimate(m, c, Strategy(**dict(block, stack="torch-autocast"), foreach=True))
    assert m.layer_activation_bytes(4096, 2, recompute="block", stack="torch-autocast") == 4 * tokens * 4096
    ddp = estimate(MODELS["llama3-8b"], cluster("dgx-h100:1"), Strategy(zero=0, stack="torch-autocast"))
    assert "DDP's gradient buckets" in ddp.formulas[-1] and "DDP" not in amp.formulas[-1]
    with pytest.raises(ValueError, match="stack must be one of"):
        Strategy(stack="jax")


def test_cli_plan_validate(capsys):
    from shardwise.cli import main

    main(["plan", "--validate"])
    out = capsys.readouterr().out
    assert out.count("| blind |") >= 6 and "Korthikanti" in out and "peak memory per GPU" in out
    with pytest.raises(SystemExit, match="required"):
        main(["plan", "--model", "llama3-8b"])


def test_tpu_slices_are_tori_whose_full_axes_ring_both_ways():
    v5p = cluster("tpu-v5p:4x4x8")
    assert v5p.gpus == 128 and [n for n, _ in v5p.dims] == [4, 4, 8]
    S = 1 << 30
    # bandwidth-bound, an all-gather along one full axis takes about S / (2 x link): independent of its length
    ax = v5p.collective_s("all_gather", S, 4)
    assert ax == pytest.approx(3 * 1e-6 + 3 / 4 * S / 1.8e11)
    # over the whole slice, axis by axis on shrinking data
    assert v5p.collective_s("all_gather", S, 128) < 1.5 * v5p.collective_s("all_gather", S, 4)
    # an axis without its wraparound (not a multiple of 4) has half the bandwidth
    line = cluster("tpu-v5p:2x4x4")
    assert line.dims[0][1].busbw == 9e10 and line.dims[1][1].busbw == 1.8e11
    with pytest.raises(ValueError, match="3-D torus"):
        cluster("tpu-v5p:16x16")
    e = estimate(MODELS["llama3-8b"], cluster("tpu-v5e:16x16"), Strategy(zero=3, seq=8192))
    assert e.gpus == 256 and e.mfu > 0


def test_sweeps(tmp_path, capsys):
    from shardwise.cli import main
    from shardwise.planner import sweep

    key, vals = sweep.parse("tp=1,2,4,8")
    rows = sweep.run(key, vals, MODELS["llama3-70b"], "dgx-h100:8", Strategy(zero=3, seq=8192, global_batch=64))
    assert [r["tp"] for r in rows] == [1, 2, 4, 8]
    # more tensor parallelism: less memory per GPU, more communication
    assert rows[0]["memory_gb"] > rows[-1]["memory_gb"] and rows[0]["comm_s"] < rows[-1]["comm_s"]
    bad = sweep.run("tp", [3], MODELS["llama3-70b"], "dgx-h100:8", Strategy())
    assert "error" in bad[0]
    with pytest.raises(ValueError, match="AXIS"):
        sweep.parse("colour=red")
    sync = {r["interconnect"].split(" (")[0]: r["all_reduce_s"] for r in sweep.grad_sync(MODELS["llama3-8b"])}
    assert sync["8 H100 in one node"] < sync["8 H100 in 8 nodes"]
    lat = [r for r in sweep.latency(models=("llama3-8b",)) if r["tolerated_latency_us"]]
    assert all(a["tolerated_latency_us"] > b["tolerated_latency_us"] for a, b in zip(lat, lat[1:]))
    png = tmp_path / "s.png"
    main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--sweep", "zero=0,1,2,3", "--png", str(png)])
    assert png.exists() and "| zero |" in capsys.readouterr().out


def test_explain_and_a_16k_gpu_plan_in_well_under_10_seconds(capsys):
    import time

    from shardwise.cli import main

    t0 = time.perf_counter()
    main(["plan", "--model", "llama3-405b", "--cluster", "dgx-h100:2048", "--tp", "8", "--pp", "16", "--seq", "8192",
          "--global-batch", "2048", "--explain"])
    assert time.perf_counter() - t0 < 10
    out = capsys.readouterr().out
    assert "(16384 chips)" in out and ("bubble = (pp-1)·flushes/(m·v)·compute + the exposed exchanges with the next "
                                       "stage, max(100%·2·m·v, 2·(pp-1)·flushes) x ") in out
    assert "= (16-1)·1/(16·1)·" in out
    assert "efficiency = the accelerator's fitted share = 0.546" in out
    assert re.search(r"elementwise = tokens/dp · L/pp · [\d.e+]+ B/token/layer", out), out


def test_expert_parallel_spreads_the_experts_and_adds_all_to_alls():
    m, c = MODELS["mixtral-8x7b"], cluster("dgx-h100:8")
    base = dict(zero=1, seq=4096, global_batch=64)
    no_ep, ep = estimate(m, c, Strategy(**base)), estimate(m, c, Strategy(ep=8, **base))
    assert no_ep.ep_comm_s == 0 < ep.ep_comm_s
    # the experts are most of the weights: 8-way expert parallelism leaves about an eighth of them per GPU
    assert ep.memory["weights"] < 0.25 * no_ep.memory["weights"]
    with pytest.raises(ValueError, match="experts"):
        estimate(m, c, Strategy(ep=3, **base))
    with pytest.raises(ValueError, match="experts"):
        estimate(MODELS["llama3-8b"], c, Strategy(ep=2, **base))


def test_per_op_selective_checkpointing_keeps_half_the_products_and_recomputes_the_rest():
    # torchtitan's default policy: the layer input, Q, V, the attention output and the MLP's first and
    # last products kept; the other half of the layer's forward products recomputed in the backward
    m, c = MODELS["llama3-8b"], cluster("dgx-h100:1")
    s, b, h, kv, ffn = 8192, 2, 4096, 1024, 14336
    assert m.layer_activation_bytes(s, b, recompute="selective-op") == 2 * s * b * (2 * h + 2 * h + kv + ffn)
    base = dict(zero=3, micro_batch=2, seq=s)
    sel, op = (estimate(m, c, Strategy(recompute=r, **base)) for r in ("selective", "selective-op"))
    assert op.memory["activations"] < 0.6 * sel.memory["activations"]
    assert op.compute_s > sel.compute_s
    flops = next(f for f in op.formulas if f.startswith("flops/token"))
    assert f"selective-op: {32 * (m.layer_params(True) - 2 * h):.4g}" in flops


def test_pcie_only_nodes_and_communication_that_outlasts_compute():
    # a PCIe-only server: its rings cross the host (28 GB/s bus bandwidth, nccl#1639), 13x slower
    # than an NVSwitch node for the same all-gather, with no NVLink SHARP
    pcie, dgx = cluster("pcie-h100:1"), cluster("dgx-h100:1")
    S = 1 << 30
    assert pcie.collective_s("all_gather", S, 8) > 13 * dgx.collective_s("all_gather", S, 8)
    assert pcie.collective_s("all_reduce", S, 8) == pytest.approx(2 * pcie.collective_s("all_gather", S, 8), rel=1e-6)
    # there ZeRO-3's gathers and reductions outlast the step's compute: at least what outlasts it is
    # exposed (layer by layer, more: the forward waits for each gather, though the backward could hide
    # some), not only the last bucket's 10%
    m = model("llama3-8b")
    est = estimate(m, pcie, Strategy(zero=3, micro_batch=1, seq=8192))
    assert est.dp_comm_s > est.compute_s
    assert est.dp_exposed_s > 1.5 * (est.dp_comm_s - est.compute_s)
    assert est.step_s >= est.dp_comm_s
    # on the NVSwitch node the same gathers hide but for the first gathers and the last reductions
    fast = estimate(m, dgx, Strategy(zero=3, micro_batch=1, seq=8192))
    assert fast.dp_comm_s < fast.compute_s and 0 < fast.dp_exposed_s < 0.1 * fast.dp_comm_s
    # a share given is the least exposed
    floor = estimate(m, dgx, Strategy(zero=3, micro_batch=1, seq=8192, dp_exposed=0.2))
    assert floor.dp_exposed_s == pytest.approx(0.2 * fast.dp_comm_s)


def test_hybrid_sharding_shards_inside_groups_and_all_reduces_across_them():
    # HSDP: ZeRO-3 inside each node's 8 GPUs, the 16 nodes replicas of one another. State per GPU is
    # divided by 8, not 128; communication is the node's reduce-scatter and three all-gathers of the
    # gradients plus an all-reduce of each GPU's 1/8 shard across the 16 nodes
    m = model("llama3-8b")
    c = cluster("dgx-h100:16")
    full = estimate(m, c, Strategy(zero=3, micro_batch=1, seq=8192))
    hsdp = estimate(m, c, Strategy(zero=3, micro_batch=1, seq=8192, shard=8))
    for k in ("weights", "grads", "optimizer"):
        assert hsdp.memory[k] == pytest.approx(full.memory[k] * 128 / 8)
    # per layer (and once for the embedding and head), on the timeline: two gathers, a reduce-scatter
    # and the replicas' all-reduce of the shard
    root = m.embedding_params() + m.head_params() + m.hidden
    want = 0.0
    for n, g in ((m.layers, 2.0 * (m.params() - root) / m.layers), (1, 2.0 * root)):
        want += n * (c.collective_s("reduce_scatter", g, 8) + (2 if n > 1 else 1) * c.collective_s("all_gather", g, 8)
                     + c.collective_s("all_reduce", g / 8, 16, 8))
    assert hsdp.dp_comm_s == pytest.approx(want)
    assert c.levels(16, 8) == [(16, c.dims[1][1])]  # the replicas' all-reduce runs over InfiniBand alone
    with pytest.raises(ValueError, match="must divide the data-parallel size"):
        estimate(m, c, Strategy(zero=3, shard=12))
    with pytest.raises(ValueError, match="needs zero >= 1"):
        Strategy(zero=0, shard=8)


def test_multi_slice_tpu_clusters_join_slices_over_the_data_center_network():
    c = cluster("tpu-v5e:16x16*4")
    assert c.gpus == 1024 and [n for n, _ in c.dims] == [16, 16, 4]
    dcn = c.dims[2][1]
    assert dcn.busbw == pytest.approx(200e9 / 8 / 8)  # a host's 2 x 100 Gb/s shared by its 8 chips
    # a slice's chips all-reduce their shards with the other slices over the DCN alone
    assert c.levels(4, 256) == [(4, dcn)]
    S = 1 << 28
    assert c.collective_s("all_reduce", S, 4, 256) > 10 * c.collective_s("all_reduce", S, 16)
    # v5p's slices: 50 Gb/s per chip (its documentation); v4's data-center network is not known to the planner
    v5p = cluster("tpu-v5p:4x4x4*2")
    assert v5p.gpus == 128 and v5p.dims[3][1].busbw == pytest.approx(50e9 / 8)
    assert v5p.levels(2, 64) == [(2, v5p.dims[3][1])]
    with pytest.raises(ValueError, match="the data-center network between tpu-v4 slices is not known; multi-slice: "
                                         "tpu-v5e, tpu-v5p"):
        cluster("tpu-v4:4x4x4*2")
    with pytest.raises(ValueError, match="SLICES"):
        cluster("tpu-v5e:16x16*two")


def test_tpu_v3_is_a_2d_torus_of_its_datasheet():
    """TPU v3 (Cloud TPU's v3 page): 123 TFLOP/s bf16, 32 GB at 900 GB/s, a 32x32 2-D torus whose 6.4 TB/s bisection
    crosses 64 links (100 GB/s a link one way; a full axis rings both ways); a job on it plans like any TPU slice."""
    pod, part = cluster("tpu-v3:32x32"), cluster("tpu-v3:16x16")
    assert pod.gpus == 1024 and pod.accel.peak_flops == 123e12 and pod.accel.hbm_bw == 0.9e12
    assert pod.dims[0][1].busbw == 2e11 and part.dims[0][1].busbw == 1e11  # 16 chips a line: no wraparound
    e = estimate(model("llama3-8b"), pod, Strategy(zero=3, micro_batch=1, seq=2048, global_batch=1024))
    assert e.fits and 0.2 < e.mfu < 0.7
    with pytest.raises(ValueError, match="tpu-v3 is a 2-D torus: give 2 axis lengths"):
        cluster("tpu-v3:4x4x4")


def test_slices_share_one_data_center_spine_and_reduce_across_it_after_the_backward():
    from shardwise.planner.clusters import DCN_SPINE

    # up to 4 v5e-256 slices a chip has its host's NICs' share; beyond, the spine's share of the chips
    nic = 200e9 / 8 / 8
    assert cluster("tpu-v5e:16x16*4").dims[2][1].busbw == pytest.approx(nic)
    c32 = cluster("tpu-v5e:16x16*32")
    assert c32.dims[2][1].busbw == pytest.approx(DCN_SPINE / 8192) and DCN_SPINE / 8192 < nic / 6
    assert "spine" in str(c32)
    # the shards' all-reduce across the slices is exposed whole, after the backward (XLA's); one slice
    # has none, and a GPU cluster's replicas still reduce under the backward
    m, st = model("llama3-8b"), Strategy(zero=3, shard=256, micro_batch=2, seq=2048)
    one, many = estimate(m, cluster("tpu-v5e:16x16"), Strategy(zero=3, micro_batch=2, seq=2048)), estimate(m, c32, st)
    late = c32.collective_s("all_reduce", 2.0 * m.params() / 256, 32, 256)
    assert many.dp_exposed_s >= late > 0.1 * one.step_s and many.step_s - one.step_s >= 0.9 * late
    assert "all-reduced across the sharding groups after the backward" in "\n".join(many.formulas)
    gpu = estimate(m, cluster("dgx-h100:4"), Strategy(zero=3, shard=8, micro_batch=2, seq=2048))
    assert gpu.dp_exposed_s < 0.5 * gpu.dp_comm_s and "after the backward" not in "\n".join(gpu.formulas)


def test_an_eager_stack_moves_more_bytes_through_a_rotary_models_norms(capsys):
    from shardwise.cli import main
    from shardwise.planner.models import EAGER_BYTES

    # torchtitan without torch.compile: RMSNorm and the rotary embedding as decomposed fp32 ops
    m, c = model("llama3-8b"), cluster("dgx-h100:1@500W")
    st = Strategy(zero=3, micro_batch=2, global_batch=16, seq=8192, recompute="selective-op")
    compiled, eager = estimate(m, c, st), estimate(m, c, dataclasses.replace(st, eager=True))
    more = EAGER_BYTES * m.hidden * 4 * m.layers * 16 * 8192 / 8 / (c.accel.hbm_bw * c.accel.mem_eff)
    assert eager.compute_s - compiled.compute_s == pytest.approx(more)  # a forward, its backward, its rerun
    assert "eager: its norms and rotary embedding unfused" in "\n".join(eager.formulas)
    # a model of learned positions and LayerNorm (MPT) runs its kernels as counted
    mpt = dataclasses.replace(m, learned_positions=8192)
    assert estimate(mpt, c, dataclasses.replace(st, eager=True)).step_s == estimate(mpt, c, st).step_s
    main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--zero", "3", "--eager", "--explain"])
    assert "rotary embedding unfused" in capsys.readouterr().out


def test_a_named_attention_kernel_runs_its_executed_flops_at_its_rate(capsys):
    """MPT's Triton FlashAttention (llm-foundry's attn_impl: triton): the causal half of PaLM's 12·L·d·T a token at the
    kernel's rate on the device, the rest of the products at the device's share; known on A100s and H100s only."""
    from shardwise.cli import main
    from shardwise.costmodel.devices import ATTENTION_KERNELS

    mpt = ModelSpec("mpt-1b-8k", 24, 2048, 16, 16, 8192, 50368, seq=8192, gated=False, tied=True, bias=True,
                    learned_positions=8192)
    st = Strategy(zero=3, micro_batch=3, global_batch=96, seq=8192, recompute="none")
    for name in ("dgx-h100:1", "dgx-a100-40gb:1"):
        c = cluster(name)
        flash, triton = estimate(mpt, c, st), estimate(mpt, c, dataclasses.replace(st, attention="triton-2022"))
        attn, acc = 12.0 * mpt.layers * mpt.q_dim * 8192, c.accel
        per_gpu = 96 * 8192 / 8 * (7 / 12 * attn / ATTENTION_KERNELS["triton-2022"][acc.name]
                                   - attn / (acc.peak_flops * acc.efficiency(mpt.hidden)))
        assert triton.compute_s - flash.compute_s == pytest.approx(per_gpu, rel=1e-9) and per_gpu > 0
    assert any("triton-2022 attention at 160" in f for f in estimate(mpt, cluster("dgx-h100:1"), dataclasses.replace(
        st, attention="triton-2022")).formulas)
    with pytest.raises(ValueError, match="known on h100.*not H200"):
        estimate(mpt, cluster("dgx-h200:1"), dataclasses.replace(st, attention="triton-2022"))
    with pytest.raises(ValueError, match="unfused attention"):
        Strategy(attention="triton-2022", fused_attention=False)
    with pytest.raises(ValueError, match="attention must be one of"):
        Strategy(attention="xformers")
    main(["plan", "--model", "llama3-8b", "--cluster", "dgx-a100:1", "--zero", "3", "--attention", "triton-2022",
          "--explain"])
    assert "triton-2022 attention at 88" in capsys.readouterr().out


def test_llm_foundrys_whole_tables_hold_with_mpts_attention_kernel():
    """bench/planner/llm_foundry_all.py: all 191 rows of llm-foundry's BF16 tables (125M-70B, 8-128 GPUs, sequences
    512-65,536; 30 of them in the validation table, 2 fitted), 62 within 10% with the device's flash attention, 127 with
    MPT's Triton kernel at its rate (bench/results/2026-12-07-plan-attention-kernel.md)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "planner", "llm_foundry_all.py")
    spec = importlib.util.spec_from_file_location("llm_foundry_all", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = list(mod.rows())
    assert len(rows) == 191
    assert [sum(abs(mod.predict(r, a)) <= 0.10 for r in rows) for a in (None, "triton-2022")] == [62, 127]


def test_per_op_checkpointing_reruns_sequence_parallel_all_gathers():
    """torchtitan's per-op policy saves products' and reduce-scatters' outputs, not all-gathers': with sequence
    parallelism the backward regathers the attention's and the MLP's inputs (half an all-reduce each); without it,
    and without tp, nothing more."""
    m, c = MODELS["llama3-8b"], cluster("dgx-h100:1")
    st = Strategy(tp=8, zero=1, global_batch=4, seq=4096, recompute="none")
    none, op = (estimate(m, c, dataclasses.replace(st, recompute=rc)) for rc in ("none", "selective-op"))
    assert op.tp_comm_s == pytest.approx(none.tp_comm_s * 5 / 4)
    plain = [estimate(m, c, dataclasses.replace(st, sp=False, recompute=rc)).tp_comm_s for rc in ("none", "selective-op")]
    assert plain[0] == plain[1] > 0


def test_block_recomputation_reruns_each_layer_but_its_down_projection():
    # torch.utils.checkpoint per layer (FSDP2, shardwise's captured step; XLA's remat after dead-code
    # elimination): the backward needs the layer's last product only as the next layer's saved input
    m = MODELS["llama3-8b"]
    c = cluster("dgx-h100:1")
    est = {rc: estimate(m, c, Strategy(tp=8, zero=1, micro_batch=1, global_batch=1, seq=4096, recompute=rc, sp=False))
           for rc in ("none", "block", "full")}
    tokens, h, L = 4096, m.hidden, m.layers
    layer_matmul = m.layer_params(True) - 2 * h
    block = L * (2.0 * (layer_matmul - m.ffn * h) + 4.0 * m.q_dim * tokens)
    full = m.flops_per_token(tokens) / 3
    per_flop = tokens / 8 / (c.accel.peak_flops * c.accel.efficiency(h / 8))
    # the same elementwise work is redone under both; the products differ by the down projections
    # and the head, which block does not rerun
    assert est["full"].compute_s - est["block"].compute_s == pytest.approx((full - block) * per_flop, rel=1e-9)
    assert 0.70 < block / full < 0.75
    # one more tensor-parallel reduction per layer (the attention's), not two; the same activations kept
    assert est["block"].tp_comm_s == pytest.approx(est["none"].tp_comm_s * 5 / 4)
    assert est["full"].tp_comm_s == pytest.approx(est["none"].tp_comm_s * 6 / 4)
    # without sequence parallelism torch's checkpoint keeps the layer input whole on every rank
    per_layer = 2 * 4096 * m.hidden
    assert (est["block"].memory["activations"] - est["full"].memory["activations"]
            == pytest.approx(m.layers * per_layer * (1 - 1 / 8)))
    # with it, the rerun MLP input is all-gathered again: half a reduction more, and the input is split
    sp = {rc: estimate(m, c, Strategy(tp=8, zero=1, micro_batch=1, global_batch=1, seq=4096, recompute=rc))
          for rc in ("none", "block", "full")}
    assert sp["block"].tp_comm_s == pytest.approx(sp["none"].tp_comm_s * 5.5 / 4)
    assert sp["block"].memory["activations"] == sp["full"].memory["activations"]
    # an MoE layer's gate multiply keeps each expert's output, so block reruns the whole layer there
    moe = MODELS["mixtral-8x7b"]
    mo = {rc: estimate(moe, c, Strategy(tp=8, zero=1, micro_batch=1, global_batch=1, seq=4096, recompute=rc))
          for rc in ("block", "full")}
    assert mo["block"].compute_s < mo["full"].compute_s  # the head is not rerun
    assert mo["block"].tp_comm_s == pytest.approx(mo["full"].tp_comm_s)
    head = 2.0 * moe.vocab * moe.hidden * 4096 / 8 / (c.accel.peak_flops * c.accel.efficiency(moe.hidden / 8))
    assert mo["full"].compute_s - mo["block"].compute_s == pytest.approx(head, rel=1e-6)


def test_one_hot_dispatch_adds_gshards_dispatch_and_combine_products():
    """MaxText's dense MoE path (sparse_matmul=False): tokens reach the experts' capacity slots by one-hot einsums
    (BSM,BSEC->EBCM and back), 2·d·E·C FLOPs a token each, C = capacity·s·k/E: 5 such products in a step (2 forward,
    the dispatch's input gradient, the combine's two gradients), 7 where the layer's forward reruns."""
    m, c = model("mixtral-8x7b"), cluster("tpu-v6e:16x16")
    for rc, units in (("none", 5), ("block", 7)):
        st = Strategy(zero=3, micro_batch=2, global_batch=512, seq=4096, recompute=rc, capacity=1.25)
        plain, onehot = estimate(m, c, st), estimate(m, c, dataclasses.replace(st, onehot=True))
        per_token = 2 * 4096 * 8 * (1.25 * 4096 * 2 / 8) * units * 32  # d·E·C, 32 MoE layers
        extra = 512 * 4096 * per_token / 256 / (c.accel.peak_flops * c.accel.efficiency(4096))
        assert onehot.compute_s - plain.compute_s == pytest.approx(extra, rel=1e-9)
        assert onehot.mfu < plain.mfu and onehot.memory == plain.memory  # not model FLOPs; no memory of its own
    dense = estimate(model("llama3-8b"), c, Strategy(zero=3, global_batch=256, seq=4096, onehot=True))
    assert dense.compute_s == estimate(model("llama3-8b"), c, Strategy(zero=3, global_batch=256, seq=4096)).compute_s


def test_capacity_dispatch_pads_the_experts_compute_and_activations(monkeypatch):
    # Mixtral 8x7B's layer, 8 of its layers (the bench's moe 8x7b-8l): experts padded to 1.25x (their products at one
    # rate here: the measured share of their shape, which the padding also changes, has its own test)
    import shardwise.planner.estimate as est_mod

    monkeypatch.setattr(est_mod, "expert_share", lambda *a: 1.0)
    m = ModelSpec("mixtral-8x7b-8l", 8, 4096, 32, 8, 14336, 32000, seq=4096, experts=8, top_k=2)
    c = cluster("h200-nv18-x2:1")
    est = {cf: estimate(m, c, Strategy(zero=3, micro_batch=1, global_batch=2, seq=4096, recompute="none", capacity=cf))
           for cf in (1.0, 1.25)}
    tokens = 4096  # per GPU
    pad_flops = 6 * 8 * 2 * (3 * 4096 * 14336) * 0.25 * tokens
    per_flop = 1 / c.accel.product_rate(4096, 1, tokens)  # the H200's measured rate at the shape
    ew = 8 * tokens * 6 * 14336 * 2 * 0.25 * 4 / (c.accel.hbm_bw * c.accel.mem_eff)  # act bytes x (fwd + 2 bwd + 1)
    assert est[1.25].compute_s - est[1.0].compute_s == pytest.approx(pad_flops * per_flop + ew * 3 / 4, rel=1e-9)
    assert est[1.25].mfu < est[1.0].mfu  # padding is not model FLOPs
    # the expert activations kept (gate, up and their product per routed expert) grow by the factor
    assert est[1.25].memory["activations"] - est[1.0].memory["activations"] == pytest.approx(
        8 * 6 * tokens * 14336 * 2 * 0.25)
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        Strategy(capacity=0.8)


def test_the_experts_products_run_at_their_shapes_measured_share(monkeypatch):
    # Qwen3-30B-A3B's experts (MLP 768 on width 2048) on 16 H200s, ep 8: an expert receives 4096 x 8 ranks x top 8 / 128
    # experts = 2048 tokens a micro-batch, where the measured table (bench/planner/expert_gemm.py) runs its products at
    # 577 TFLOP/s of the 761 its width reaches: 6·k·(3·d·f) FLOPs a token and layer take 1 / 0.758 of their time
    import shardwise.planner.estimate as est_mod
    from shardwise.costmodel.devices import expert_share

    m = ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4, 768, 151936, seq=4096, experts=128, top_k=8, head_size=128)
    c, st = cluster("dgx-h200:2"), Strategy(ep=8, micro_batch=1, global_batch=64, seq=4096, recompute="none")
    share = expert_share(2048, 768, 2048)
    assert share == pytest.approx(577 / 761)
    shaped = estimate(m, c, st)
    assert any("the experts' at 0.76 of that" in f for f in shaped.formulas)
    monkeypatch.setattr(est_mod, "expert_share", lambda *a: 1.0)
    flat = estimate(m, c, st)
    routed = 6 * 48 * 8 * 3 * 2048 * 768 * 64 * 4096 / 16  # FLOPs of this GPU's experts a step
    rate = c.accel.product_rate(2048, 1, 4096)
    assert shaped.compute_s - flat.compute_s == pytest.approx(routed / rate * (1 / share - 1), rel=1e-9)
    assert not any("the experts'" in f for f in flat.formulas)
    # four times the tokens (8192 an expert) run near the width's best; FP8 has its own table: 538 of 1335 at 2048
    assert expert_share(2048, 768, 8192) == pytest.approx(695 / 761)
    assert expert_share(2048, 768, 2048, fp8=True) == pytest.approx(538 / 1335)


def test_validation_summary_counts():
    # bench/results/2026-12-04-plan-validation-growth.md gives these counts (66 runs, 61 blind, 50 within
    # 10% before llm-foundry's MPT benchmarks and MaxText's 128B on v5e and 1024B on v5p)
    from shardwise.planner.validation import table

    rows = table()
    blind = [r for r in rows if not r["fitted"]]
    assert (len(rows), len(blind)) == (156, 144)
    # 62 of 89 before the spine and the eager term, 70 before the H200's measured rates, 69 of 86 before the FP8 rows
    # (bench/results/2026-12-06-plan-fp8.md: NeMo's 12 blind ones all within 10%), 82 of 106 while torchtitan's Float8
    # rows ran Transformer Engine's recipe (7 misses, 7.5-54% fast); as torchao's (fitted on Table 1,
    # bench/results/2026-12-06-plan-torchao.md) only the CP 4 and CP 8 rows at 131k-262k tokens miss
    # 86 of 105 before the Llama 3 paper's two 405B rows, 88 of 107 before MaxText's 8 rows on two v5p slices (5 within);
    # Megatron-Bridge's two Qwen3-30B-A3B rows miss (3x fast); 93 of 117 before NeMo AutoModel's 4 MoE rows (DeepEP;
    # Qwen3-30B-A3B and DeepSeek-V3 on 256 within, DeepSeek-V3 on 1024 and Kimi K2 21% fast); 95 of 121 before
    # Megatron-Bridge's later rows (Qwen3-235B-A22B's two within, Qwen3-30B-A3B's ep 16 row 1.7x fast); 97 of 124 before
    # AutoModel's Llama 3.1 70B on 64 H100s (FSDP2 x CP 2, +7.5%); 98 of 125 before Megatron-Bridge's Llama 3 70B
    # SFT row, 99 before MaxText's one-hot dispatch (Mixtral on v6e -10.2% to +0.7%), 100 of 126 before torchtitan's
    # 2025 H200 file (Trainy: Llama 3.1 8B Float8 on 32 and 64 H200s, -4.1% and -5.8%), 102 of 128 before its async-TP
    # file (8 rows: 70B on 256 within but bf16 async TP, -13.3%; 8B on 64 with TP 8, 15-28% fast), 105 of 136 before
    # llm-foundry's A100 40GB table (10 rows by its rule, 5 within; 70B on 64 -33%), 110 of 146 before AutoModel's
    # pipeline split (Kimi K2 -17.6% to -8.0%: the 163,840-word output layer on the last of 8 ranks), 111 of 146 before
    # MPT's Triton attention had its own rate (two of its rows fitted; llm-foundry's 28 others 15 -> 20 within), 116
    # before shardwise's bucket copies were counted (its ZeRO-3 on two H200s -12.6% to -8.1%), 117 before FSDP2's copy-in
    # and sharded update were counted as measured at two ranks (our Mixtral layer x 8 -14.6% to -3.7%)
    assert sum(abs(r["error"]) <= 0.10 for r in blind) == 118 and 118 / 144 >= 0.80
    forty = [r for r in rows if "A100 40GB" in r["run"]]
    assert len(forty) == 10 and sum(abs(r["error"]) <= 0.10 for r in forty) == 7
    titan8 = [r for r in rows if r["source"] == "torchtitan" and "Float8" in r["run"]]
    assert len(titan8) == 8 and sum(r["fitted"] for r in titan8) == 1
    assert [r["run"] for r in titan8 if abs(r["error"]) > 0.10] == [r["run"] for r in titan8 if "CP 4" in r["run"]
                                                                     or "CP 8" in r["run"]], titan8


@pytest.mark.parametrize("size", ["22B", "175B", "530B"])
def test_search_agrees_with_the_published_tuning_of_megatron(size):
    """Korthikanti et al.'s layouts with sequence parallelism and selective recomputation (their tuned
    runs on A100s): searched over what Megatron then ran (no ZeRO, that recomputation, interleaving 1-4 deep), the top
    layout is predicted at most 5% faster than the published one, and no faster than any layout it weighed. Deeper
    interleaving is predicted 6% faster (22B: tp 2 pp 4 v 12; 175B: tp 4 pp 16 v 6): the planner charges the last
    stage's output layer nothing (bench/results/2026-12-06-plan-search-interleaving.md)."""
    from shardwise.planner.search import layouts, search
    from shardwise.planner.validation import RUNS

    run = next(r for r in RUNS if r.label.startswith(f"{size},") and "selective" in r.label)
    c, st = cluster(run.cluster), run.strategy
    published = estimate(run.model, c, st)
    base = Strategy(global_batch=st.global_batch, seq=st.seq, fused_attention=st.fused_attention)
    space = {"zero": [0], "recompute": [st.recompute], "virtual": [1, 2, 3, 4]}
    top, info = search(run.model, c, base, space=space)
    assert top and top[0].estimate.fits and info["fit"] >= len(top)
    assert top[0].estimate.step_s >= 0.95 * published.step_s, (top[0].strategy, top[0].estimate.step_s, published.step_s)
    assert top[0].estimate.step_s <= published.step_s  # the published layout is in the space
    assert any(s.tp == st.tp and s.pp == st.pp and s.virtual == st.virtual for s in layouts(run.model, c, base, space=space))
    assert [f.estimate.step_s for f in top] == sorted(f.estimate.step_s for f in top)


def test_cli_plan_search_lists_layouts_says_what_shardwise_runs_and_what_would_fit(capsys):
    from shardwise.cli import main

    main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:2", "--global-batch", "32", "--seq", "4096",
          "--search", "--search-space", "recompute=none", "--search-space", "pp=1", "--top", "3"])
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if re.match(r"\s*\d+\. tp=", ln)]
    assert len(rows) == 3 and all("recompute=none" in r and "pp=1" in r for r in rows), out
    assert all("shardwise: --strategy " in r for r in rows), out  # no pipeline, no recompute: shardwise runs it
    main(["plan", "--model", "llama3-405b", "--cluster", "dgx-h100:1", "--global-batch", "16", "--search"])
    out = capsys.readouterr().out
    assert "0 fit in 80 GB per GPU" in out and "none fits: the least memory is" in out, out
    assert re.search(r"fits on dgx-h100:(\d+): tp=", out), out
    main(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100:4", "--global-batch", "32", "--tp", "8"])
    out = capsys.readouterr().out
    assert "(DOES NOT FIT)" in out and re.search(r"fits instead: tp=\d", out), out
    with pytest.raises(SystemExit, match="needs the global batch"):
        main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:2", "--search"])


def test_deepseek_v3s_config_reads_as_latent_attention_and_dense_first_layers(tmp_path):
    """DeepSeek-V3's config.json (multi-head latent attention: queries through rank 1536, keys and values from a
    512-wide latent, 64 rotary dims a head; its first 3 of 61 layers dense): the published 671B parameters and 37B
    activated a token; its MLA attention is 187M weights a layer where standard attention of its shape would be 470M."""
    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
           "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048, "vocab_size": 129280,
           "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "max_position_embeddings": 163840, "tie_word_embeddings": False}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = from_hf_config(str(p))
    assert (m.q_lora, m.kv_lora, m.rope_dim, m.head_dim, m.dense_layers, m.dense_ffn) == (1536, 512, 64, 128, 3, 18432)
    assert abs(m.params() / 671e9 - 1) < 0.005 and abs(m.params(active=True) / 37e9 - 1) < 0.03, (m.params(), m.params(active=True))
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * (1 + 128 * 256) + 128 * 128 * 7168
    assert m.attention_params() == mla and dataclasses.replace(m, kv_lora=0, rope_dim=0).attention_params() == 4 * 7168 * 16384
    assert m.q_dim == 128 * 160  # attention's FLOPs on the mean of the query-key (192) and value (128) widths
    p.write_text(json.dumps({k: v for k, v in cfg.items() if k != "intermediate_size"}))  # the dense layers' width
    with pytest.raises(ValueError, match="missing 'intermediate_size'"):
        from_hf_config(str(p))
    p.write_text(json.dumps(cfg))
    # three dense layers: the routed experts of 58 layers; a plan on 256 H100s with ep 8 fits and holds them
    e = estimate(m, cluster("dgx-h100:32"), Strategy(tp=1, pp=8, ep=32, zero=1, micro_batch=1, global_batch=1024,
                                                     seq=4096, recompute="full"))
    assert e.step_s > 0 and e.memory["total"] < 80e9, e.memory


def test_hf_configs_of_gpt2_and_opt_are_read_as_their_own_mlp_and_positions(tmp_path):
    """GPT-2 small (124M) and OPT-125M from their config.json keys: a two-matrix MLP (4 x width where
    the file gives none), learned positions, biases, a tied head, dropout; the published counts."""
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "vocab_size": 50257,
            "n_positions": 1024, "resid_pdrop": 0.1, "activation_function": "gelu_new"}
    opt = {"model_type": "opt", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
           "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 2048, "dropout": 0.1,
           "enable_bias": True, "word_embed_proj_dim": 768}
    for cfg, total in ((gpt2, 124.44e6), (opt, 125.2e6)):
        p = tmp_path / "config.json"
        p.write_text(json.dumps(cfg))
        m = from_hf_config(str(p))
        assert not m.gated and m.tied and m.bias and m.dropout and m.ffn == 3072 and m.learned_positions > 0, m
        assert abs(m.params() - total) / total < 0.01, (cfg["model_type"], m.params())


def test_cli_plan_switches_for_attention_dropout_and_overlap(capsys):
    """--unfused-attention keeps the scores (more activation memory), --dropout on its masks, --tp-exposed 0
    hides the tensor-parallel communication (a shorter step); a share outside 0..1 is refused."""
    from shardwise.cli import main

    def run(*extra):
        main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--tp", "8", "--global-batch", "8",
              "--seq", "4096", "--recompute", "none", "--json", *extra])
        return json.loads(capsys.readouterr().out)

    base = run()
    assert run("--unfused-attention")["memory"]["activations"] > base["memory"]["activations"]
    assert run("--dropout", "on")["memory"]["activations"] > base["memory"]["activations"]
    hidden = run("--tp-exposed", "0")
    assert hidden["tp_exposed_s"] == 0 < base["tp_exposed_s"] and hidden["step_s"] < base["step_s"]
    torch = run("--stack", "torch")  # memory only: fp32 weights, no gradients held at the forward's end
    assert torch["memory"]["weights"] > base["memory"]["weights"] and torch["step_s"] == base["step_s"]
    assert run("--stack", "torch", "--foreach")["memory"]["total"] >= torch["memory"]["total"]
    with pytest.raises(SystemExit, match="--dp-exposed is a share of the communication, 0 to 1"):
        run("--dp-exposed", "1.5")


def test_deepeps_dispatch_sends_a_token_once_to_each_rank_and_node_its_experts_are_on():
    """DeepEP sends a token once to each rank holding one of its experts (across nodes once to each node, forwarded over
    NVLink), not once per expert. Qwen3-30B-A3B's 128 experts top-8 on ep=8 in one node: a balanced router reaches
    8·(1 - C(112, 8)/C(128, 8)) = 5.35 ranks of 8 a token; AutoModel's contiguous gate (token t to experts 8t..8t+7,
    16 a rank) 1. DeepSeek-V3 on ep=64 over 8 nodes: the contiguous gate's 8 experts lie on 2 ranks of one node."""
    import math

    qwen = ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4, 768, 151936, seq=4096, experts=128, top_k=8, head_size=128)
    c, base = cluster("dgx-h100:1"), dict(zero=3, ep=8, micro_batch=16, global_batch=128, seq=4096, recompute="block",
                                          rank_order="tp-ep-dp-pp")  # large enough that the latency is a small share
    a2a, balanced, contiguous = (estimate(qwen, c, Strategy(**base, **kw)).ep_comm_s for kw in (
        {}, {"dispatch": "deepep"}, {"dispatch": "deepep", "routing": "contiguous"}))
    reached = 8 * (1 - math.comb(112, 8) / math.comb(128, 8))
    assert balanced == pytest.approx(a2a * reached / 8, rel=0.05) and contiguous == pytest.approx(a2a / 8, rel=0.05)
    dsv3 = ModelSpec("deepseek-v3", 61, 7168, 128, 128, 2048, 129280, seq=4096, experts=256, top_k=8, shared_ffn=2048,
                     q_lora=1536, kv_lora=512, rope_dim=64, head_size=128, dense_layers=3, dense_ffn=18432)
    c, st = cluster("dgx-h100:32"), Strategy(pp=4, virtual=8, zero=3, ep=64, global_batch=512, seq=4096,
                                              recompute="block", rank_order="tp-ep-dp-pp")
    over_ib = estimate(dsv3, c, st).ep_comm_s
    once = estimate(dsv3, c, dataclasses.replace(st, dispatch="deepep", routing="contiguous")).ep_comm_s
    # the all-to-all charges a token's 8 copies (63/64 of them sent) at InfiniBand's rate, DeepEP its one node's (7/8)
    assert over_ib / once == pytest.approx(8 * 63 / 64 / (7 / 8), rel=0.05), (over_ib, once)
    with pytest.raises(ValueError, match="dispatch must be one of"):
        Strategy(dispatch="nccl")


def test_zero3_under_a_pipeline_keeps_a_stage_gathered_on_gpus_and_regathers_per_micro_batch_on_tpus():
    """ZeRO-3 with pp > 1. On GPUs (torch's pipelining with FSDP2) a stage is gathered at its first micro-batch's
    forward and kept to its last backward, its gradients kept whole and reduce-scattered once: ZeRO-1's communication
    and 16-bit weight copies, the stage's whole gradients at the backward's end, and the reduction exposed (after the
    drain, one chunk's at a time). On TPUs XLA gathers twice and reduces once per micro-batch, under all the compute."""
    m, c = model("llama3-70b"), cluster("dgx-h100:8")
    st = Strategy(tp=8, pp=4, zero=3, global_batch=64, seq=4096, stack="torch", recompute="none")
    z3, z1 = (estimate(m, c, dataclasses.replace(st, zero=z)) for z in (3, 1))
    assert z3.dp_comm_s == pytest.approx(z1.dp_comm_s) and z3.dp_exposed_s > z1.dp_exposed_s
    assert z3.memory["weights"] == pytest.approx(z1.memory["weights"]) and z3.memory["grads"] < z1.memory["grads"]
    stage = m.params() / (8 * 4)  # a GPU's tensor-parallel share of its stage: 16-bit copies whole, fp32 over dp 2
    assert z3.memory["weights"] == pytest.approx(2 * stage + 4 * stage / 2)
    two = estimate(m, c, dataclasses.replace(st, virtual=2))  # the last chunk's reduction: half of it
    assert two.dp_exposed_s < z3.dp_exposed_s
    mega = estimate(m, c, dataclasses.replace(st, stack="megatron"))  # Megatron's layout: the whole stage too
    assert mega.memory["weights"] == pytest.approx(estimate(m, c, dataclasses.replace(st, stack="megatron", zero=1))
                                                   .memory["weights"])
    tpu = cluster("tpu-v5p:4x4x8")
    small, big = (estimate(m, tpu, Strategy(tp=8, pp=2, zero=3, global_batch=gb, seq=4096)) for gb in (32, 64))
    assert big.micro_batches == 2 * small.micro_batches and big.dp_comm_s == pytest.approx(2 * small.dp_comm_s)
    assert small.dp_exposed_s == pytest.approx(0.1 * small.dp_comm_s)  # hidden under the compute but the floor


def test_automodels_pipeline_split_paces_the_step_by_its_fullest_rank():
    """NeMo AutoModel splits 61 layers over pp 8 x v 4 = 32 chunks as 2 each to the first 29 and 1 to the last 3, with
    the output layer on the last chunk: rank 7 holds 2 + 2 + 2 + 1 layers and the head, the others 7 or 8 layers. The
    fullest rank's work over the mean scales the compute; an even split (61 layers over 8 ranks is not even) does not."""
    m = ModelSpec("kimi-like", 61, 7168, 64, 64, 2048, 163840, seq=4096, experts=384, top_k=8, dense_layers=1,
                  dense_ffn=18432)
    c = cluster("dgx-h100:32")
    st = Strategy(pp=8, virtual=4, zero=3, ep=32, global_batch=512, seq=4096, recompute="block", stack="torch")
    even, split = estimate(m, c, st), estimate(m, c, dataclasses.replace(st, head_stage=True))
    head = 6.0 * m.vocab * m.hidden / ((m.flops_per_token(4096) - 6.0 * m.vocab * m.hidden) / 61)
    pace = (7 + head) * 8 / (61 + head)
    assert split.compute_s == pytest.approx(even.compute_s * pace, rel=1e-9) and pace > 1.1
    flat = dataclasses.replace(st, pp=1, virtual=1, ep=32)
    assert estimate(m, c, dataclasses.replace(flat, head_stage=True)).compute_s == estimate(m, c, flat).compute_s


def test_a_pipeline_flushed_per_local_batch_pays_its_bubble_each_time():
    """AutoModel runs torch's pipeline schedule once per local batch: gradient accumulation over 4 schedules fills
    and drains the pipeline 4 times."""
    m, c = model("llama3-70b"), cluster("dgx-h100:8")
    st = Strategy(tp=8, pp=4, virtual=2, global_batch=128, seq=4096)
    once, four = estimate(m, c, st), estimate(m, c, dataclasses.replace(st, flushes=4))
    assert four.compute_s == once.compute_s
    assert (four.pp_bubble_s - once.pp_bubble_s) == pytest.approx(3 * (4 - 1) / (64 * 2) * once.compute_s, rel=0.05)
    with pytest.raises(ValueError, match="flushes=3 does not divide the 64 micro-batches"):
        estimate(m, c, dataclasses.replace(st, flushes=3))
    with pytest.raises(ValueError, match="flushes must be at least 1, got 0"):
        Strategy(flushes=0)


def test_megatron_cores_rank_order_keeps_a_small_expert_group_inside_a_node():
    """Mixtral 8x7B on 8 DGX H100 nodes, tp=2 pp=4 ep=4: laid out tp-pp-dp, an ep group is 8 ranks
    apart (one per node: its all-to-alls cross InfiniBand); laid out tp-ep-dp-pp it is 2 apart (inside
    a node, over NVLink), and its all-to-alls take a fraction of the time."""
    m, c = model("mixtral-8x7b"), cluster("dgx-h100:8")
    st = Strategy(tp=2, pp=4, ep=4, zero=1, global_batch=64)
    apart = estimate(m, c, st)
    near = estimate(m, c, dataclasses.replace(st, rank_order="tp-ep-dp-pp"))
    assert 0 < near.ep_comm_s < 0.5 * apart.ep_comm_s, (near.ep_comm_s, apart.ep_comm_s)
    assert near.compute_s == apart.compute_s
    with pytest.raises(ValueError, match="rank_order must be one of"):
        Strategy(rank_order="dp-tp")


def test_a_custom_fabric_and_its_oversubscription(capsys):
    """--network: ZeRO-3 of Llama 3 70B over 32 nodes on a 25 GB/s-per-GPU fabric spends more time in
    data-parallel communication than on the preset's InfiniBand. Oversubscribed uplinks (4:1) slow an
    all-to-all whose group spans leaves (Mixtral's ep=8, one rank a node, over leaves of 4 nodes) but
    not one inside a leaf (leaves of 8); a ring crosses a leaf boundary with a few flows only, which
    the uplinks carry at full rate."""
    from shardwise.cli import main
    from shardwise.planner.clusters import cluster as make

    def plan(name, nodes, *extra, fabric=None):
        main(["plan", "--model", name, "--cluster", f"dgx-h100:{nodes}", "--global-batch", str(8 * nodes), "--seq",
              "4096", "--json", *extra, *(["--network", fabric] if fabric else [])])
        return json.loads(capsys.readouterr().out)

    ib, eth = plan("llama3-70b", 32, "--zero", "3")["dp_comm_s"], plan("llama3-70b", 32, "--zero", "3",
                                                                       fabric="bw=25,latency=10")["dp_comm_s"]
    assert ib < eth, (ib, eth)
    moe = ("mixtral-8x7b", 32, "--tp", "8", "--ep", "8")
    flat = plan(*moe, fabric="bw=25,latency=10")["ep_comm_s"]
    inside = plan(*moe, fabric="bw=25,latency=10,leaf=8,oversub=4")["ep_comm_s"]
    across = plan(*moe, fabric="bw=25,latency=10,leaf=4,oversub=4")["ep_comm_s"]
    assert 0 < flat == inside < across, (flat, inside, across)
    assert "spine (4:1 oversubscribed)" in str(make("dgx-h100:32", "bw=25,leaf=8,oversub=4"))
    with pytest.raises(SystemExit, match="for a leaf-spine fabric, both leaf=NODES and oversub=FACTOR"):
        main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:4", "--network", "bw=25,leaf=2"])


def test_sliding_window_shared_experts_and_fp32_gradient_reduction(tmp_path):
    """A Qwen1.5-MoE-A2.7B config.json: 60 experts of their own width and a shared expert, counted as
    published (14.3B in all, 2.7B active). Mistral's sliding window: attention FLOPs of the window,
    not of a longer sequence. Gradients reduced in fp32: twice the reduction's bytes and the
    gradients' memory, the same weights' gathers."""
    qwen = {"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
            "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
            "vocab_size": 151936, "max_position_embeddings": 8192, "tie_word_embeddings": False}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(qwen))
    m = from_hf_config(str(p))
    assert m.experts == 60 and m.ffn == 1408 and m.shared_ffn == 5632
    assert abs(m.params() / 14.3e9 - 1) < 0.01 and abs(m.params(active=True) / 2.7e9 - 1) < 0.01
    mistral = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
               "max_position_embeddings": 32768, "sliding_window": 4096}
    p.write_text(json.dumps(mistral))
    windowed = from_hf_config(str(p))
    whole = dataclasses.replace(windowed, window=0)
    attn = lambda mm, s: mm.flops_per_token(s) - mm.flops_per_token(1)  # noqa: E731
    assert attn(windowed, 32768) == pytest.approx(attn(whole, 4096), rel=1e-3) and attn(whole, 32768) > 7 * attn(windowed, 32768)
    assert windowed.flops_per_token(2048) == whole.flops_per_token(2048)  # a sequence inside the window
    c, st = cluster("dgx-h100:4"), Strategy(zero=3, global_batch=32, seq=4096)
    bf16, fp32 = estimate(model("llama3-8b"), c, st), estimate(model("llama3-8b"), c, dataclasses.replace(st, reduce_fp32=True))
    assert fp32.memory["grads"] == 2 * bf16.memory["grads"] and fp32.memory["weights"] == bf16.memory["weights"]
    assert bf16.dp_comm_s < fp32.dp_comm_s < 2 * bf16.dp_comm_s


def test_context_parallelism_cuts_the_sequence_and_passes_the_keys_and_values_around(capsys):
    """Llama 3 405B at 131,072 tokens a sequence (tp=8 pp=8, 8 sequences a step over 8 pipelines): on
    64 DGX H100 nodes without cp the activations do not fit; on 256 with cp=4 (the same pipelines,
    each sequence cut in four) each rank keeps a quarter of each layer's, the key/value collectives
    mostly hide under the attention's products, and ZeRO-1 shards over dp x cp. The search weighs cp
    where asked."""
    from shardwise.cli import main

    m = model("llama3-405b")
    st = Strategy(tp=8, pp=8, zero=1, global_batch=8, seq=131072, recompute="selective")
    none, cp4 = estimate(m, cluster("dgx-h100:64"), st), estimate(m, cluster("dgx-h100:256"), dataclasses.replace(st, cp=4))
    assert none.dp == cp4.dp == 8 and not none.fits and cp4.fits, (none.memory["total"], cp4.memory["total"])
    assert cp4.memory["activations"] == pytest.approx(none.memory["activations"] / 4, rel=0.02)
    assert 0 < cp4.cp_exposed_s < 0.5 * cp4.cp_comm_s and none.cp_comm_s == 0
    assert cp4.compute_s < none.compute_s / 3  # the same work over four times the GPUs
    assert cp4.memory["optimizer"] == pytest.approx(none.memory["optimizer"] / 4)
    with pytest.raises(ValueError, match="cp=3 does not divide the sequence"):
        estimate(m, cluster("dgx-h100:192"), dataclasses.replace(st, cp=3))
    main(["plan", "--model", "llama3-405b", "--cluster", "dgx-h100:256", "--global-batch", "8", "--seq", "131072",
          "--search", "--search-space", "cp=1,2,4,8", "--search-space", "recompute=selective", "--top", "1"])
    out = capsys.readouterr().out
    assert re.search(r" 1\. tp=\d+ sp pp=\d+.* cp=\d", out), out


def test_zero3_runs_layer_by_layer_on_the_two_lane_timeline():
    """Each layer's gathers (one layer ahead) and reduction on one link, the compute lane waiting for
    each layer's gather: a step whose gathers outlast the forward's layers is the link's in the
    forward, where the closed form would hide all it could behind the whole step."""
    from shardwise.costmodel import simulate
    from shardwise.planner.timeline import LayerCosts, _micro_batches, _seconds, zero3_step

    # 4 layers of 1 s forward, 2 s backward, 3 s gathers, free reductions: the forward runs at the
    # gathers' pace (4 x 3 + the last layer), the backward waits for each but the first's gather
    c = LayerCosts(4, fwd_s=1.0, bwd_s=2.0, head_s=0.0, gather_s=3.0, reduce_s=0.0, root_gather_s=0.0,
                   root_reduce_s=0.0)
    assert zero3_step(c, 1) == (27.0, 15.0, 24.0)  # step, exposed, on the link (the closed form: 24, 12)
    # micro-batches past the second add the second's increment: the same as simulating them all
    for costs in (LayerCosts(4, 1.0, 2.0, 0.5, 3.0, 0.7, 1.0, 0.3), LayerCosts(4, 5.0, 9.0, 0.5, 3.0, 0.7, 1.0, 0.3)):
        tl = simulate(_micro_batches(costs, 5), _seconds, _seconds)
        assert zero3_step(costs, 5) == pytest.approx((tl.step_s, tl.step_s - tl.compute_s, tl.comm_s))
    est = {n: estimate(model("llama3-8b"), cluster(f"dgx-h100:{n}"), Strategy(zero=3, global_batch=64, seq=8192))
           for n in (1, 8)}
    # on NVSwitch nodes and 8 x 400G the gathers hide behind the layers at 8 and at 64 GPUs alike
    assert all(0 < e.dp_exposed_s < 0.1 * e.dp_comm_s for e in est.values())
    assert "two-lane timeline" in "\n".join(est[8].formulas)
    assert "two-lane timeline" not in "\n".join(estimate(model("llama3-8b"), cluster("dgx-h100:1"),
                                                          Strategy(zero=2, seq=8192)).formulas)


def test_a_power_capped_cluster_runs_its_products_slower_by_the_cube_root_of_the_power():
    # torchtitan's H100s ran at a 500 W limit: clocks (and the products' rate) fall about as the cube
    # root of the power (dynamic power ~ f·V², V ~ f); memory and links are untouched
    m, st = model("llama3-8b"), Strategy(zero=3, micro_batch=2, seq=8192, recompute="selective-op")
    full, capped = cluster("dgx-h100:16"), cluster("dgx-h100:16@500W")
    assert capped.accel.clock == pytest.approx((500 / 700) ** (1 / 3)) and capped.accel.eff_max == full.accel.eff_max
    # FP8 on the measured tables keeps the cap
    assert capped.accel.today().product_rate(4096, 1, 8192, fp8="te") == pytest.approx(
        full.accel.today().product_rate(4096, 1, 8192, fp8="te") * (500 / 700) ** (1 / 3))
    assert capped.gpus == 128 and capped.dims == full.dims and "at 500 W" in str(capped)
    a, b = estimate(m, full, st), estimate(m, capped, st)
    assert b.step_s > a.step_s and b.optimizer_s == a.optimizer_s and b.memory == a.memory
    # torchtitan's compiled rows come within 10% so (they were 14-16% fast at full power)
    from shardwise.planner.validation import table

    titan = [r for r in table() if r["source"] == "torchtitan" and "compile" in r["run"] and "Float8" not in r["run"]]
    assert len(titan) == 2 and all(abs(r["error"]) <= 0.10 for r in titan), titan
    for bad in ("dgx-h100:1@900W", "dgx-h100:1@lots", "tpu-v5e:16x16@100"):
        with pytest.raises(ValueError, match="power cap"):
            cluster(bad)


def test_fsdp2s_copies_and_a_multi_tensor_update_cost_time_and_explain_says_so():
    # framework="fsdp2": per micro-batch each gathered 16-bit weight copied out of the all-gather's buffer (4 B, twice
    # under ZeRO-3), this rank's fp32 shard cast and copied into it (6 + 4 B over the group, twice, its multi-tensor
    # kernels measured at 13.5 B of time) and each 16-bit gradient copied into the reduce-scatter's buffer (2 + 2 B, its
    # chunk_cat measured at 1.45x), on the compute lane at the memory-bound kernels' rate; its fused update over the
    # shards 1.17x the same over whole tensors
    m, c = model("llama3-8b"), cluster("h200-nv18-x2:1")
    st = Strategy(zero=3, micro_batch=2, global_batch=8, seq=4096, recompute="none")
    base = estimate(m, c, st)
    fsdp2 = estimate(m, c, dataclasses.replace(st, framework="fsdp2"))
    per_param = 2 * (2 * (4 + 13.5 / 2) + 1.45 * (2 + 2))  # two micro-batches
    assert fsdp2.compute_s - base.compute_s == pytest.approx(per_param * m.params() / (c.accel.hbm_bw * c.accel.mem_eff))
    assert fsdp2.optimizer_s == pytest.approx(1.17 * base.optimizer_s)
    assert fsdp2.step_s > base.step_s and any("FSDP2's copy-in and copy-out kernels" in f for f in fsdp2.formulas)
    assert any("x 1.17 (FSDP2's shards)" in f for f in fsdp2.formulas)
    assert not any("FSDP2" in f for f in base.formulas)
    # shardwise's buckets copy alike (passes/bucket.py: shards concatenated in, members' rows copied out of the grid),
    # at the bytes they move, and its update is the plain one
    ours = estimate(m, c, dataclasses.replace(st, framework="shardwise"))
    per_param = 2 * (2 * (4 + 6 / 2) + 2 + 2)
    assert ours.compute_s - base.compute_s == pytest.approx(per_param * m.params() / (c.accel.hbm_bw * c.accel.mem_eff))
    assert ours.optimizer_s == base.optimizer_s and any("shardwise's copy-in" in f for f in ours.formulas)
    # the multi-tensor AdamW passes over the fp32 state 20 times where the fused kernel does 7
    foreach = estimate(m, c, dataclasses.replace(st, foreach=True))
    assert foreach.optimizer_s / base.optimizer_s == pytest.approx(20 / 7) and foreach.compute_s == base.compute_s
    assert any(f.startswith("optimizer (multi-tensor AdamW) = 80 B x") for f in foreach.formulas)
    with pytest.raises(ValueError, match="framework must be one of None, fsdp2, shardwise"):
        Strategy(framework="fsdp1")


def test_h200_products_run_at_the_measured_rate_of_their_shape():
    # bench/results/2026-12-02-h200-gemm-shapes.md: the products' TFLOP/s by width, tp and tokens per micro-batch,
    # a whole step holding eff_max of it; between measured token counts on the log scale, the nearest width and tp
    from shardwise.costmodel.devices import DEVICES, HOPPER_PRODUCTS

    h200 = DEVICES["h200"]
    unit = 1e12 * h200.eff_max
    assert h200.product_rate(4096, 1, 8192) == pytest.approx(684 * unit)
    assert h200.product_rate(4096, 1, 4096 * 2**0.5) == pytest.approx((696 + 684) / 2 * unit)
    assert h200.product_rate(4096, 1, 1024) == h200.product_rate(4096, 1, 2048) == pytest.approx(744 * unit)
    assert h200.product_rate(3000, 3, 65536) == pytest.approx(HOPPER_PRODUCTS[4096][4][-1] * unit)
    assert h200.attention_rate(4096) == pytest.approx(483 * unit)
    # the small shapes are slower: 256 columns a rank at 2048 tokens against the whole width
    assert h200.product_rate(2048, 8, 2048) < 0.6 * h200.product_rate(2048, 1, 2048)
    # a power cap scales the rates; a device measured by no table keeps its share of the peak
    capped = cluster("dgx-h200:1@500W").accel
    assert capped.product_rate(8192, 8, 8192) == pytest.approx(h200.product_rate(8192, 8, 8192) * (500 / 700) ** (1 / 3))
    for other in ("h100", "a100"):
        d = DEVICES[other]
        assert d.products is None and d.attention_rate(4096) is None
        assert d.product_rate(8192, 8, 8192) == d.peak_flops * d.efficiency(1024)
    # the estimate: the 8B on eight H200s at tp=8 with 2048 tokens a micro-batch runs its products at a smaller share
    # of the peak than at tp=1 with 8192, and explain names the rates and the shape
    m, c = model("llama3-8b"), cluster("dgx-h200:1")

    def share(st):
        line = next(f for f in estimate(m, c, st).formulas if f.startswith("efficiency = the products at"))
        return line, float(re.search(r": ([\d.]+) of peak", line).group(1))

    (one, a), (eight, b) = share(Strategy(micro_batch=2, seq=4096)), share(Strategy(tp=8, seq=2048))
    assert "width 4096, tp 1, 8192 tokens" in one and "width 4096, tp 8, 2048 tokens" in eight and b < 0.85 * a
    assert "flash attention at" in one and "flash attention" not in share(Strategy(fused_attention=False))[0]


def test_fp8_runs_the_layers_products_at_their_measured_fp8_rate_and_pays_for_the_casts(capsys):
    # Transformer Engine's FP8 recipe: the layers' products at the FP8 rate measured by shape (HOPPER_FP8_PRODUCTS),
    # the output layer's in bf16 and attention at its bf16 rate, on a Hopper as its measured tables (the H100's
    # bf16 rows keep their 2023-24 share); each FP8 operand cast from bf16 (FP8_CAST_BYTES an element)
    # held at FP8_EFF_MAX of the table (fitted on one NeMo row; the bf16 products at the H200's share)
    from shardwise.costmodel.devices import DEVICES, FP8_CAST_BYTES, FP8_EFF_MAX, H200_EFF_MAX, HOPPER_FP8_PRODUCTS

    h100 = DEVICES["h100"]
    today = h100.today()
    assert today.eff_max == H200_EFF_MAX and today.products is not None and h100.products is None
    assert today.product_rate(8192, 4, 8192, fp8="te") == pytest.approx(HOPPER_FP8_PRODUCTS[8192][4][2] * 1e12
                                                                          * FP8_EFF_MAX["te"])
    assert today.product_rate(8192, 4, 8192, fp8="te") > 1.3 * today.product_rate(8192, 4, 8192)
    m, c = model("llama3-70b"), cluster("dgx-h100:8")
    st = Strategy(tp=4, pp=8, virtual=5, global_batch=128, recompute="none")
    bf16, fp8 = estimate(m, c, st), estimate(m, c, dataclasses.replace(st, fp8="te"))
    assert fp8.compute_s < 0.8 * bf16.compute_s and fp8.tp_comm_s == bf16.tp_comm_s
    assert any("the layers' FP8 products at" in f for f in fp8.formulas)
    assert not any("FP8" in f for f in estimate(m, c, dataclasses.replace(st, fp8=None)).formulas)
    # the casts: an FP8 step with the cast bytes doubled is slower by the same bytes again at the memory-bound rate
    import shardwise.planner.estimate as est

    m8, c8 = model("llama3-8b"), cluster("dgx-h100:1")
    one = Strategy(global_batch=8, recompute="none", fp8="te")
    a = estimate(m8, c8, one)
    est.FP8_CAST_BYTES = 2 * FP8_CAST_BYTES
    try:
        b = estimate(m8, c8, one)
    finally:
        est.FP8_CAST_BYTES = FP8_CAST_BYTES
    elems = 4 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336  # per token and layer: h-wide operands, then the cut ones
    cast_s = 8 * 8192 / 8 * 32 * elems * FP8_CAST_BYTES / (c8.accel.hbm_bw * c8.accel.mem_eff)
    assert b.compute_s - a.compute_s == pytest.approx(cast_s)
    # no FP8 rates off Hopper: a clear refusal, from the CLI too
    with pytest.raises(ValueError, match="FP8 rates for Hopper GPUs"):
        estimate(m8, cluster("dgx-a100:1"), one)
    with pytest.raises(ValueError, match="fp8 with a given efficiency"):
        dataclasses.replace(one, efficiency=0.5)
    from shardwise.cli import main

    main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "8", "--recompute", "none",
          "--fp8", "--json"])
    assert json.loads(capsys.readouterr().out)["step_s"] == pytest.approx(a.step_s)
    # shardwise trains no FP8 yet: a search says so of an FP8 layout
    from shardwise.planner.search import runs_on_shardwise

    assert runs_on_shardwise(one) is None and runs_on_shardwise(dataclasses.replace(one, fp8=None)) is not None


def test_torchao_fp8_keeps_the_bf16_work_at_the_devices_share_and_its_products_at_its_own(capsys):
    # torchao's Float8 (torchtitan): on an H100 the bf16 work (attention, the output layer) stays at the H100's bf16
    # share, as its bf16 rows run; only the layers' products move, to the FP8 table at torchao's fitted share
    from shardwise.costmodel.devices import FP8_EFF_MAX, HOPPER_FP8_PRODUCTS

    m, c = model("llama3-8b"), cluster("h100-hbm2e:1@500W")
    st = Strategy(zero=3, micro_batch=2, global_batch=16, seq=8192, recompute="selective-op", framework="fsdp2")
    bf16, ao, te = (estimate(m, c, dataclasses.replace(st, fp8=r)) for r in (None, "torchao", "te"))
    assert c.accel.product_rate(4096, 1, 16384, "torchao") == pytest.approx(
        HOPPER_FP8_PRODUCTS[4096][1][3] * 1e12 * FP8_EFF_MAX["torchao"] * c.accel.clock)
    assert FP8_EFF_MAX["torchao"] < FP8_EFF_MAX["te"] and te.compute_s < ao.compute_s < 0.85 * bf16.compute_s
    # against bf16, only the layers' products (not attention, not the output layer) change rate, and the casts are paid
    from shardwise.costmodel.devices import FP8_CAST_BYTES

    a, tokens = c.accel, 16 * 8192
    head, attn = 6 * m.vocab * 4096, 12 * 32 * 4096 * 8192  # selective-op reruns half the products, no attention
    layers = m.flops_per_token(8192) + 32 * (m.layer_params(True) - 2 * 4096) - attn - head
    prate, frate = a.peak_flops * a.efficiency(4096), a.product_rate(4096, 1, 16384, "torchao")
    cast_s = tokens / 8 * 32 * FP8_CAST_BYTES * (6 * 4096 + 2 * 1024 + 3 * 14336) / (a.hbm_bw * a.mem_eff)
    assert bf16.compute_s - ao.compute_s == pytest.approx(tokens / 8 * layers * (1 / prate - 1 / frate) - cast_s)
    f = next(f for f in ao.formulas if f.startswith("efficiency ="))
    assert "the accelerator's fitted share" in f and "(0.676 of their FP8 rate, torchao)" in f
    assert f"attention {attn:.4g} / rate" in next(f for f in ao.formulas if f.startswith("matmul ="))
    from shardwise.cli import main

    main(["plan", "--model", "llama3-8b", "--cluster", "h100-hbm2e:1@500W", "--zero", "3", "--micro-batch", "2",
          "--global-batch", "16", "--recompute", "selective-op", "--framework", "fsdp2", "--fp8", "torchao", "--json"])
    assert json.loads(capsys.readouterr().out)["step_s"] == pytest.approx(ao.step_s)
    with pytest.raises(ValueError, match="fp8 must be one of None, te, torchao, got True"):
        Strategy(fp8=True)


def test_search_finds_nemos_tuned_fp8_layouts_of_llama_3_within_5pct():
    """NeMo's tuned Llama 3 layouts in FP8: 8B on 8 H100s (cp 2), 70B on 64 (24.07: tp 4 pp 4 cp 2 v 5; 25.11 and 26.02: tp 4 pp 8 v 5;
    SFT on 32, 26.06: tp 4 pp 4 v 5),
    405B on 1024 (tp 8 pp 8 cp 2 v 8: its 126 layers and the embedding and loss as 128 in 64 chunks), searched over what
    Megatron-Core runs there (ZeRO-1, no recomputation, their cp): the top layout's predicted step is within 5% of the
    published one's; for the 405B the top is the published layout itself."""
    from shardwise.planner.search import describe, search
    from shardwise.planner.validation import RUNS

    rows = [r for r in RUNS if r.source in ("nemo_2407", "megatron_bridge") and r.model.name.startswith("llama3-")]
    assert len(rows) == 7
    for r in rows:
        c, st = cluster(r.cluster), r.strategy
        published = estimate(r.model, c, st)
        top, _ = search(r.model, c, st, space={"zero": [1], "recompute": ["none"], "cp": [st.cp]})
        assert top[0].strategy.fp8 and top[0].estimate.fits
        assert abs(top[0].estimate.step_s / published.step_s - 1) <= 0.05, (r.label, top[0].strategy)
        if r.model.name == "llama3-405b":
            assert describe(top[0].strategy) == "tp=8 sp pp=8 v=8 zero1 cp=2 mb=1 recompute=none", top[0].strategy


def test_megatron_cores_moe_folding_spreads_whole_experts_over_tp_and_dp(capsys):
    """Megatron-Core's MoE parallel folding (Qwen3-235B-A22B's recipe: tp 2 x pp 8, ep 32 over each stage's tp 2 x dp 16
    ranks, expert tensor parallel 1). ep 32 cannot lie inside dp 16; folded, each rank holds 4 whole experts (a 32nd,
    where ep 16 inside dp with experts cut over tp holds an eighth of them twice over: the same bytes), the MoE layers
    have no tensor-parallel collectives (the attention's half remains) and shuffle a tp-th of the tokens (their own
    sequence-parallel part, not the tp group's gathered), and the experts' gradients are reduced over
    tp x dp / ep ranks (1; 2 folded over ep 16). Under --ep-overlap the all-to-alls hide under the other micro-batches' compute: exposed, what
    outlasts it."""
    from shardwise.cli import main

    q = ModelSpec("qwen3-235b-a22b", 94, 4096, 64, 4, 1536, 151936, seq=4096, experts=128, top_k=8, head_size=128)
    c = cluster("dgx-h100:32")
    base = dict(tp=2, pp=8, virtual=4, global_batch=2048, seq=4096, recompute="none", rank_order="tp-ep-dp-pp")
    with pytest.raises(ValueError, match="ep=32 must divide the model's 128 experts and the data-parallel size 16"):
        estimate(q, c, Strategy(**base, ep=32))
    inside, folded = estimate(q, c, Strategy(**base, ep=16)), estimate(q, c, Strategy(**base, ep=32, etp=1))
    assert folded.memory["weights"] == pytest.approx(inside.memory["weights"], rel=1e-9)
    assert folded.tp_comm_s == pytest.approx(inside.tp_comm_s / 2, rel=1e-9)  # every layer an MoE layer
    assert folded.compute_s < inside.compute_s  # its token shuffles on its own sequence-parallel tokens alone
    assert folded.ep_exposed_s == folded.ep_comm_s > 0
    half = estimate(q, c, Strategy(**base, ep=16, etp=1))  # folded over 16 of 32: each expert on 2 ranks
    assert half.dp_comm_s > folded.dp_comm_s == inside.dp_comm_s and half.memory["weights"] > folded.memory["weights"]
    overlap = estimate(q, c, Strategy(**base, ep=32, etp=1, ep_overlap=True))
    assert overlap.ep_exposed_s == pytest.approx(max(0.1 * overlap.ep_comm_s, overlap.ep_comm_s - overlap.compute_s))
    assert overlap.step_s == pytest.approx(folded.step_s - folded.ep_comm_s + overlap.ep_exposed_s, rel=1e-9)
    for bad, msg in ((dict(ep=32, etp=4), "etp=4: give 1 .each expert whole. or the tp size 2"),
                     (dict(ep=32, etp=1, rank_order="tp-pp-dp"), "rank_order tp-ep-dp-pp; got tp-pp-dp"),
                     (dict(ep=64, etp=1), "and ep x etp = 64 the 32 ranks of a stage .tp x cp x dp.")):
        with pytest.raises(ValueError, match=msg):
            estimate(q, c, Strategy(**{**base, **bad}))
    main(["plan", "--model", "mixtral-8x7b", "--cluster", "dgx-h100:2", "--tp", "2", "--ep", "8", "--etp", "1",
          "--ep-overlap", "--rank-order", "tp-ep-dp-pp", "--global-batch", "64", "--explain"])
    out = capsys.readouterr().out
    assert "ep=8 etp=1" in out and "exposed under the other micro-batches' compute" in out
    assert "the attention's half alone in 32 MoE layers of whole experts" in out


def test_search_folds_whole_experts_over_tp_where_etp_is_1():
    """With --etp 1 the search weighs ep over a stage's tp x dp ranks: Qwen3-235B-A22B on 256 H100s at tp 2 x pp 8 (the
    recipe's), ep 32 is among the layouts, and shardwise, which cuts its experts over tp, is not said to run it."""
    from shardwise.planner.search import describe, runs_on_shardwise, search

    q = ModelSpec("qwen3-235b-a22b", 94, 4096, 64, 4, 1536, 151936, seq=4096, experts=128, top_k=8, head_size=128)
    base = Strategy(global_batch=2048, seq=4096, etp=1, ep_overlap=True, rank_order="tp-ep-dp-pp")
    space = {"tp": [2], "pp": [8], "virtual": [4], "micro_batch": [1], "zero": [1], "recompute": ["none"]}
    top, _ = search(q, cluster("dgx-h100:32"), base, top=20, space=space)
    assert max(f.strategy.ep for f in top) == 32, [describe(f.strategy) for f in top]  # up to tp x dp
    folded = next(f.strategy for f in top if f.strategy.ep == 32)
    assert "ep=32 etp=1" in describe(folded) and runs_on_shardwise(folded) is None
    inside, _ = search(q, cluster("dgx-h100:32"), dataclasses.replace(base, etp=None), top=20, space=space)
    assert max(f.strategy.ep for f in inside) == 16  # ep inside dp 16


def test_an_moe_layers_token_shuffles_are_counted_by_their_bytes():
    """Each routed copy of a token is gathered into expert order and read back into its token (6 bytes a unit of width,
    forward); the all-to-all dispatcher also sorts the copies it receives by local expert and back (8 more); DeepEP
    delivers them in expert order. The backward moves twice the forward: Qwen3-30B-A3B (48 MoE layers, top-8 of 128,
    width 2048) on 8 H100s, ep 8, 16 x 4096 tokens a GPU."""
    from shardwise.planner.estimate import SHUFFLE_BYTES

    qwen = ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4, 768, 151936, seq=4096, experts=128, top_k=8, head_size=128)
    c = cluster("dgx-h100:1")
    base = dict(ep=8, micro_batch=16, global_batch=128, seq=4096, recompute="none", rank_order="tp-ep-dp-pp")
    a2a, deepep = (estimate(qwen, c, Strategy(**base, dispatch=d)) for d in ("alltoall", "deepep"))
    tokens = 16 * 4096
    sorts = tokens * 48 * 3 * (SHUFFLE_BYTES[True] - SHUFFLE_BYTES[False]) * 8 * 2048
    assert a2a.compute_s - deepep.compute_s == pytest.approx(sorts / (c.accel.hbm_bw * c.accel.mem_eff), rel=1e-9)
    assert SHUFFLE_BYTES == {False: 6, True: 14}
    one = [estimate(qwen, c, Strategy(**{**base, "ep": 1}, dispatch=d)).compute_s for d in ("alltoall", "deepep")]
    assert one[0] == one[1]  # no all-to-all, nothing to sort
