"""The README's demo command and its options, run as a user runs them."""

import os
import re
import subprocess
import sys

import pytest


def run_cli(*args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


STEP = re.compile(
    r"step\s+(\d+)/(\d+)\s+loss (\d+\.\d+)\s+tok/s\s+[\d,]+\s+[\d.]+ ms\s+(?:peak/rank \[(.*?)\]\s+)?sent/rank ([\d.]+ \w+)"
)


def test_train_demo_loss_goes_down():
    out = run_cli("train", "--model", "llama", "--size", "tiny", "--strategy", "zero3", "--nproc", "2",
                  "--steps", "25", "--lr", "1e-2", "--mem-every", "5")
    steps = [STEP.search(line) for line in out.splitlines() if line.startswith("step")]
    assert len(steps) == 25 and all(steps)
    assert steps[0].group(4) is None and "[-" not in out  # no peak before one is measured (no "[- -]")
    assert "USDT" not in out
    losses = [float(m.group(3)) for m in steps]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    # measured per-rank peaks (two ranks) and non-zero bytes sent
    mem = steps[5].group(4).split(" @")[0]
    assert len(re.findall(r"[\d.]+ (?:B|KiB|MiB|GiB)", mem)) == 2
    assert float(steps[-1].group(5).split()[0]) > 0


def test_train_with_tensor_and_sequence_parallelism(capsys):
    # 2 ranks, both on the tp axis (zero3 over a dp axis of one), the residual stream in sequence shards
    out = run_cli("train", "--model", "llama", "--size", "tiny", "--strategy", "zero3", "--nproc", "2", "--tp", "2",
                  "--sp", "--steps", "8", "--lr", "1e-2", "--clip", "1.0")
    assert "tp=2" in out
    losses = [float(m.group(3)) for m in (STEP.search(ln) for ln in out.splitlines() if ln.startswith("step")) if m]
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    p = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--size", "tiny", "--nproc", "2", "--sp",
                        "--steps", "1"], capture_output=True, text=True)
    assert p.returncode != 0 and "--sp shards the sequence over the tensor-parallel ranks: give --tp N" in p.stderr
    from shardwise.cli import main

    with pytest.raises(SystemExit):  # told before any rank starts
        main(["train", "--size", "tiny", "--nproc", "2", "--vocab-parallel", "on"])
    assert "--vocab-parallel cuts the LM head over the tensor-parallel ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # by the job's own check, before any rank starts
        main(["train", "--model", "moe", "--size", "tiny", "--nproc", "2", "--ep", "2", "--ep-split", "halves"])
    assert "ep_split must be a number of batch parts >= 1" in capsys.readouterr().err


def test_train_with_expert_parallelism(tmp_path):
    # 2 ranks on the ep axis: each takes batches of its own and holds 2 of the 4 experts of each layer
    out = run_cli("train", "--model", "moe", "--size", "tiny", "--strategy", "zero3", "--nproc", "2", "--ep", "2",
                  "--capacity-factor", "1.25", "--steps", "8", "--lr", "1e-2")
    assert "mesh(dp=1, ep=2" in out and "batch 8x16 per rank" in out
    losses = [float(m.group(3)) for m in (STEP.search(ln) for ln in out.splitlines() if ln.startswith("step")) if m]
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    # bench: shardwise with ep=2 and without, beside FSDP2, in one record
    ep = "shardwise:ep=2+carveout=16"
    out = run_cli("bench", "--model", "moe", "--size", "tiny", "--capacity-factor", "1.25", "--nproc", "2",
                  "--systems", f"shardwise,{ep},fsdp2", "--steps", "1", "--warmup", "1", "--out", str(tmp_path))
    import json

    with open(next(tmp_path.glob("*.json"))) as f:
        rec = json.load(f)
    rows = {r["system"]: r for r in rec["results"]}
    assert set(rows) == {"shardwise", ep, "fsdp2"} and all(r["step_s"] for r in rows.values()), rows
    # carveout=16: the products predicted beside a collective were carved (inert on CPU); not without it
    assert rows[ep]["schedule"]["carved_products"] > 0 and rows["shardwise"]["schedule"]["carved_products"] == 0
    # shardwise's rows may take an ep axis beside a tp one (the compiler builds ep x tp: test_ep.py)
    from shardwise.bench.config import BenchConfig

    BenchConfig(model="moe", tp=2, systems=["shardwise", "shardwise:ep=2"])


def test_train_checkpoints_and_resumes_bit_identical(tmp_path, capsys):
    """--checkpoint-every/--resume with accumulation, clipping and a cosine schedule: the resumed run's
    last losses and exported weights are the uninterrupted run's, bit for bit."""
    import shutil

    import torch

    from shardwise.cli import main

    d = str(tmp_path / "ck")
    args = ["train", "--model", "gpt", "--size", "tiny", "--nproc", "2", "--steps", "6", "--grad-accum", "2",
            "--clip", "1.0", "--lr-schedule", "cosine", "--warmup", "2", "--checkpoint-dir", d, "--checkpoint-every", "3",
            "--checkpoint-keep", "0"]
    full = run_cli(*args, "--export", str(tmp_path / "a.pt"))
    assert "checkpoint after step 3: " in full and sorted(os.listdir(d)) == ["step-00000003", "step-00000006"]
    shutil.rmtree(os.path.join(d, "step-00000006"))  # as if killed after step 3's checkpoint
    resumed = run_cli(*args, "--export", str(tmp_path / "b.pt"), "--resume")
    assert f"resumed from {d}/step-00000003: step 3, data position 6, saved by 2 ranks" in resumed
    lines = lambda out: [ln[:30] for ln in out.splitlines() if ln.startswith("step")]  # noqa: E731
    assert lines(resumed) == lines(full)[3:]
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for extra, says in ((["--steps", "7"], "already holds step-00000006: pass --resume"),
                        (["--steps", "7", "--checkpoint-dir", str(tmp_path / "none"), "--resume"], "no published checkpoint"),
                        (["--resume"], "--resume needs --checkpoint-dir")):
        base = args[:args.index("--checkpoint-dir")] if "--checkpoint-dir" in extra or extra == ["--resume"] else args
        with pytest.raises(SystemExit):  # told before any rank starts
            main(base + extra)
        assert says in capsys.readouterr().err


def test_train_on_a_text_file(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = run_cli("train", "--model", "gpt", "--size", "tiny", "--strategy", "ddp", "--nproc", "2", "--steps", "3",
                  "--data", str(f))
    assert "done: loss" in out and out.count("\nstep") == 3


def test_train_rejects_a_missing_file(tmp_path):
    p = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--size", "tiny", "--nproc", "1",
                        "--steps", "1", "--data", str(tmp_path / "nope.txt")], capture_output=True, text=True)
    assert p.returncode != 0 and "no such file" in p.stderr


def test_help_documents_the_flags():
    out = run_cli("train", "--help")
    for flag in ["--model", "--strategy", "--nproc", "--steps", "--data", "--precision", "--compile", "--grad-accum",
                 "--clip", "--lr-schedule", "--warmup", "--eval-every", "--export"]:
        assert flag in out


def test_training_loop_flags_and_export(tmp_path):
    path = tmp_path / "out" / "model.pt"
    out = run_cli("train", "--model", "llama", "--size", "tiny", "--strategy", "zero2", "--nproc", "2", "--steps", "4",
                  "--grad-accum", "2", "--clip", "0.1", "--lr-schedule", "cosine", "--warmup", "2",
                  "--eval-every", "2", "--export", str(path))
    lines = [line for line in out.splitlines() if line.startswith("step")]
    assert len(lines) == 4 and all("gnorm" in line and " lr " in line for line in lines)
    lrs = [float(re.search(r" lr (\S+)", line).group(1)) for line in lines]
    assert lrs[0] < lrs[1] and lrs[3] < lrs[1]  # warm-up, then decay
    assert out.count("eval after step") == 2
    import torch

    from shardwise.models import build

    model = build("llama", "tiny")
    model.load_state_dict(torch.load(path))  # same keys and shapes as the single-device model
    assert not list(path.parent.glob(".tmp-*"))  # written atomically: no temporary left behind


def test_calibrate_writes_a_profile_that_compile_loads(tmp_path):
    out = tmp_path / "lp.json"
    text = run_cli("calibrate", "--nproc", "2", "--out", str(out), "--max-bytes", str(1 << 22), "--iters", "5")
    assert "wrote" in text and "all_gather:" in text
    from shardwise.costmodel import KINDS, LinkProfile

    prof = LinkProfile.load(out)
    assert all(prof.busbw[k] > 0 and prof.alpha[k] >= 0 for k in KINDS)
    assert "calibrate over 2 ranks (gloo, cpu)" in prof.source
    assert "all_to_all:" in text  # measured too: the ep axis's all-to-alls are predicted from it
    if "all_to_all" in prof.alpha:  # fitted where its times grow with size (gloo on a busy host: not always)
        assert prof.busbw["all_to_all"] > 0 and prof.time("all_to_all", 1 << 20, 2) > prof.alpha["all_to_all"]


def test_explain_prints_the_plan():
    out = run_cli("explain", "--model", "llama", "--size", "tiny", "--strategy", "zero3", "--nproc", "2",
                  "--link-profile", "nvlink-8gpu")
    assert "link profile: nvlink-8gpu" in out and "predicted step" in out
    assert "all_gather      dp fwd" in out and "reduce_scatter  dp bwd" in out and "S(0)" in out
    # what the predicted peak holds: its largest tensors by the node that made them
    live = re.search(r"graph peak \+([\d.]+) MiB at \S+\n    live then \(MiB\): (.*)", out)
    assert live, out
    sizes = [float(x) for x in re.findall(r" ([\d.]+)(?:,|$)", live.group(2))]
    assert abs(sum(sizes) - float(live.group(1))) <= 0.01 * len(sizes) + 0.01, live.group(0)


def test_explain_profiles_and_draws(tmp_path):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    out = run_cli("explain", "--model", "gpt", "--size", "tiny", "--strategy", "zero3", "--nproc", "2",
                  "--profile", "--png", str(png), "--trace", str(trace))
    assert "compute (measured)" in out and "predicted peak" in out and "buckets (auto, cost model)" in out
    m = re.search(r"exposed communication ([\d.]+) ms \(([\d.]+)%\)", out)
    assert m and float(m.group(1)) > 0, out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    import json

    assert json.loads(trace.read_text())["traceEvents"]


def test_bench_writes_json_and_plot(tmp_path):
    import json

    out = run_cli("bench", "--model", "gpt", "--size", "tiny", "--nproc", "2", "--steps", "2", "--warmup", "1",
                  "--systems", "shardwise,shardwise-noopt:bucket_mb=0+fused=1,ddp,fsdp2:fused=1",
                  "--out", str(tmp_path), "--link-profile", "cpu-gloo", "--trace-dir", str(tmp_path / "tr"),
                  "--name", "t")
    rec = json.loads((tmp_path / "t.json").read_text())
    assert rec["config"]["link_profile"] == "cpu-gloo"
    # one gzipped chrome trace per system, from rank 0
    traces = sorted(p.name for p in (tmp_path / "tr").iterdir())
    assert len(traces) == 4 and "shardwise-noopt_bucket_mb0_fused1.json.gz" in traces, traces
    import gzip

    assert json.loads(gzip.decompress((tmp_path / "tr" / "ddp.json.gz").read_bytes()))["traceEvents"]
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    for k in ("name", "date", "machine", "gpus", "versions", "command", "config", "results"):
        assert k in rec
    rows = {r["system"]: r for r in rec["results"]}
    noopt = "shardwise-noopt:bucket_mb=0+fused=1"
    assert set(rows) == {"shardwise", noopt, "ddp", "fsdp2:fused=1"}, out
    # each row names the optimizer kernel it ran: torch's CPU default, or the fused kernel asked for
    assert rows["shardwise"]["optimizer"] == rows["ddp"]["optimizer"] == "AdamW (for-loop)"
    assert rows[noopt]["optimizer"] == rows["fsdp2:fused=1"]["optimizer"] \
        == "AdamW (fused)"
    for r in rows.values():
        assert "error" not in r, r
        assert r["step_s"] > 0 and r["tokens_per_s_per_gpu"] == rec["config"]["batch"] * 16 / r["step_s"]
    for s in ("shardwise", noopt):
        assert rows[s]["pred_step_s"] > 0 and rows[s]["pred_peak_mem_gb"] > 0 and rows[s]["peak_mem_gb"] > 0
        assert rows[s]["exposed_comm_pct"] is not None
    assert rows["ddp"]["pred_step_s"] is None  # predictions are shardwise's own
    # the scheduled program's in-flight cap is recorded (gloo: one collective at a time, no cap sweep)
    sched = rows["shardwise"]["schedule"]
    assert sched["max_in_flight_mb"] > 0 and sched["max_ops"] == 1 and sched["cap_choice"] is None, sched
    assert "schedule" not in rows[noopt] and "schedule" not in rows["ddp"]
    assert sched["carved_products"] == 0  # no carveout asked (test_train_with_expert_parallelism asks one)
    # each warm-up step is timed and printed as it ends
    assert all(len(r["warmup_step_s"]) >= 1 and min(r["warmup_step_s"]) > 0 for r in rows.values())
    assert "ddp: warm-up step 1/1" in out
    # appending to a record of another configuration stops every rank (none is left waiting) and
    # leaves the record as it was
    before = (tmp_path / "t.json").read_text()
    p = subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "--model", "gpt", "--size", "tiny",
                        "--nproc", "2", "--batch", "3", "--systems", "ddp", "--out", str(tmp_path), "--name", "t",
                        "--append"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "another configuration" in p.stdout + p.stderr
    assert (tmp_path / "t.json").read_text() == before
    # a file that is not a bench record, or a trace directory that cannot be made, stops every rank
    # before any system runs (neither leaves a rank waiting in a collective)
    (tmp_path / "u.json").write_text("{}")
    for extra in (["--name", "u", "--append"], ["--name", "v", "--trace-dir", str(tmp_path / "u.json")]):
        p = subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "--model", "gpt", "--size", "tiny",
                            "--nproc", "2", "--systems", "ddp", "--out", str(tmp_path), *extra],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and ("not a bench record" in p.stdout + p.stderr
                                      or "cannot make the --trace-dir directory" in p.stdout + p.stderr), \
            p.stdout + p.stderr


def test_bench_runs_tp_against_torchs_fsdp2_and_tp(tmp_path):
    """``bench --tp 2 --sp``: shardwise on a tp mesh and torch's FSDP2 + TP (DTensor
    ``parallelize_module``, sequence parallel, vocab-parallel loss) train the same Llama on the same
    batches to the same loss; tokens per GPU count a tp group's shared batch once; a peer without
    tensor parallelism says so in its row."""
    import json

    out = run_cli("bench", "--model", "llama", "--size", "tiny", "--nproc", "2", "--tp", "2", "--sp", "--steps", "2",
                  "--warmup", "1", "--systems", "shardwise,shardwise:fuse=ring,fsdp2,ddp", "--out", str(tmp_path),
                  "--name", "t")
    rec = json.loads((tmp_path / "t.json").read_text())
    assert rec["config"]["tp"] == 2 and rec["config"]["sp"], rec["config"]
    rows = {r["system"]: r for r in rec["results"]}
    assert "no tensor parallelism" in rows["ddp"]["error"], out
    for s in ("shardwise", "fsdp2"):
        r = rows[s]
        assert "error" not in r, r
        assert r["tokens_per_s_per_gpu"] == pytest.approx(rec["config"]["batch"] * 16 / r["step_s"] / 2)
    assert rows["shardwise"]["loss"] == pytest.approx(rows["fsdp2"]["loss"], rel=1e-5)
    assert rows["shardwise"]["pred_step_s"] > 0
    # the tp products fused through the ring train alike
    assert rows["shardwise:fuse=ring"]["loss"] == pytest.approx(rows["shardwise"]["loss"], rel=1e-5)


def test_bench_rejects_unknown_systems_and_options(capsys):
    # told before any rank starts (in this process: the flags are checked before anything spawns)
    from shardwise.cli import main

    for args, says in (
        (["--systems", "shardwise,megatron"], "unknown system"),
        (["--systems", "shardwise:speed=11"], "bad option"),
        (["--systems", "ddp:fused=yes"], "fused takes a number"),
        (["--systems", "fsdp2:ratio=1"], "bad option"),
        (["--systems", "shardwise:carveout=most"], "carveout takes a number, auto or off"),
        (["--system-timeout", "-5"], "--system-timeout is seconds"),
        (["--link-profile", "/nonexistent.json"], "shardwise calibrate"),
        (["--tp", "0"], "--tp is the number of tensor-parallel ranks"),
        (["--ep", "2"], "give it to shardwise's rows as a system option, e.g. --systems shardwise,shardwise:ep=2"),
        (["--tp", "2", "--systems", "shardwise:ep=0"], "ep takes a number of ranks >= 1"),
        (["--tp", "2", "--systems", "shardwise:fuse=fast"], "fuse takes auto, off, ring or kernel"),
        (["--systems", "shardwise:fuse=ring"], "with --tp N (N > 1)"),
        (["--capacity-factor", "1.25"], "--capacity-factor sets the MoE's expert capacity: give it with --model moe"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["bench", "--nproc", "1", "--size", "tiny", *args])
        assert e.value.code != 0
        err = capsys.readouterr().err
        assert says in err, (args, err[-400:])


def test_bench_stops_a_system_past_its_timeout_and_runs_the_next(tmp_path):
    import json

    out = run_cli("bench", "--model", "gpt", "--size", "tiny", "--nproc", "2", "--steps", "1", "--warmup", "2",
                  "--systems", "ddp,fsdp2", "--system-timeout", "0", "--out", str(tmp_path), "--name", "t")
    rows = {r["system"]: r for r in json.loads((tmp_path / "t.json").read_text())["results"]}
    assert set(rows) == {"ddp", "fsdp2"}, out
    for r in rows.values():  # both stopped after their first warm-up step, on every rank
        assert r["error"].startswith("TimeoutError: warm-up step 1/2") and "--system-timeout 0 s" in r["error"], r


def test_bench_reads_dynamo_recompilation_reasons():
    # a system that keeps recompiling (DeepCompile did, in two GPU sittings) shows why in its row
    import torch

    from shardwise.bench import recompile_reasons

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2, backend="eager")
    seen: dict = {}
    f(torch.ones(3))
    assert recompile_reasons(seen) == []
    f(torch.ones(3, dtype=torch.float64))  # a dtype guard fails: compiled again
    new = recompile_reasons(seen)
    assert len(new) == 1 and "dtype" in new[0], new
    assert recompile_reasons(seen) == []  # each reason once
    torch._dynamo.reset()


def test_bench_rows_get_their_share_above_the_no_communication_ceiling():
    from shardwise.bench import over_ceiling

    rows = [{"system": "shardwise", "step_s": 0.125}, {"system": "compile", "step_s": 0.1},
            {"system": "deepspeed", "error": "not installed"}]
    assert over_ceiling(rows)
    assert rows[0]["over_ceiling_pct"] == pytest.approx(20.0)
    assert "over_ceiling_pct" not in rows[1] and "over_ceiling_pct" not in rows[2]
    assert not over_ceiling([{"system": "ddp", "step_s": 0.2}])  # no ceiling in the record: nothing added


def test_bench_rows_name_the_nccl_settings_they_ran_under():
    from shardwise.bench import label

    assert label({"system": "shardwise"}) == "shardwise"
    assert label({"system": "shardwise", "env": {"NCCL_NVLS_ENABLE": "0"}}) == "shardwise"
    lab = label({"system": "shardwise:carveout=24", "env": {"NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_HIGH_PRIORITY": "1"}})
    assert lab == "shardwise:carveout=24\nNCCL_HIGH_PRIORITY=1", lab
    # what every row of a record shares (the image's NCCL_VERSION, say) is not repeated under each bar
    env = {"NCCL_VERSION": "2.28.3-1", "NCCL_ASYNC_ERROR_HANDLING": "1"}
    common = frozenset(env.items())
    assert label({"system": "fsdp2", "env": env}, common) == "fsdp2"
    lab = label({"system": "shardwise", "env": dict(env, TORCH_NCCL_HIGH_PRIORITY="1")}, common)
    assert lab == "shardwise\nNCCL_HIGH_PRIORITY=1", lab


def test_memory_budget_takes_sizes_with_units(capsys):
    import argparse

    from shardwise.cli import main, memory_size

    assert memory_size("20GiB") == 20 * 2**30 and memory_size("512MiB") == 512 * 2**20
    assert memory_size("1.5GB") == 1_500_000_000 and memory_size("0.8") == 0.8
    assert memory_size("24") == 24 * 2**30  # a bare number above 1: GiB, as before
    for bad in ("20 parsecs", "-1", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_size(bad)
    with pytest.raises(SystemExit):  # told by the parser, before any rank starts
        main(["train", "--size", "tiny", "--memory-budget", "20 parsecs"])
    assert "is not a memory size: give e.g. 20GiB, 512MiB" in capsys.readouterr().err
