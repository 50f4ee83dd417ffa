"""Sharded checkpoints through DCP (issue 23): resume bit-exact at the same mesh, resharded to another
dp size and strategy, atomic publication, and the errors of bad checkpoints."""

import os

import harness
import pytest
import torch
from dist_pool import Pool


def _killed(fn, *args, **kw) -> list:
    """Exit codes of two fresh ranks running ``fn``, which SIGKILLs every rank."""
    pool = Pool(2)
    try:
        return pool.run_until_dead(fn, *args, **kw)
    finally:
        pool.close()


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_run_killed_after_a_save_resumes_bit_identical_to_the_uninterrupted_one(pools, tmp_path, strategy):
    """Two micro-batches per step, clipping and a cosine schedule (kept in the checkpoint); every rank
    SIGKILLed right after the save at step 2; the resumed steps 3 and 4 give the same floats."""
    full, sd_full, _ = pools(2).run(harness.ckpt_run, strategy, str(tmp_path / "a"), 4, save_at=2, loop=True)[0]
    path = str(tmp_path / "ck")
    assert _killed(harness.ckpt_run, strategy, path, 4, save_at=2, loop=True, die="after") == [-9, -9]
    assert os.path.exists(os.path.join(path, ".metadata")) and not os.path.exists(path + ".partial")
    resumed, sd, meta = pools(2).run(harness.ckpt_run, strategy, path, 4, resume=True, loop=True)[0]
    assert meta["steps"] == 2 and meta["strategy"] == strategy and meta["ranks"] == 2
    assert meta["extra"]["scheduler"]["last_epoch"] == 2
    assert resumed == {s: full[s] for s in (2, 3)}  # bitwise: the same floats
    assert all(torch.equal(sd[k], sd_full[k]) for k in sd_full)


def test_a_run_killed_between_the_write_and_the_publish_resumes_from_the_save_before(pools, tmp_path):
    """The save after step 2 has written every rank's pieces and DCP's metadata, under
    ``ck.partial``, when every rank is killed: ``ck`` still holds step 1's checkpoint, whole."""
    full, _, _ = pools(2).run(harness.ckpt_run, "zero3", str(tmp_path / "a"), 3, save_at=1)[0]
    path = str(tmp_path / "ck")
    pools(2).run(harness.ckpt_run, "zero3", path, 1, save_at=1)
    _killed(harness.ckpt_run, "zero3", path, 3, save_at=2, resume=True, die="in")
    assert os.path.exists(os.path.join(path + ".partial", ".metadata"))  # written, never published
    resumed, _, meta = pools(2).run(harness.ckpt_run, "zero3", path, 3, resume=True)[0]
    assert meta["steps"] == 1 and resumed == {s: full[s] for s in (1, 2)}


def test_a_zero3_checkpoint_of_two_ranks_resumes_on_one_under_ddp(pools, tmp_path):
    """Every tensor resharded on load: dp=2 zero3 -> dp=1 ddp, the one rank taking both ranks' batches
    as micro-batches (the same mean gradient): within fp32 rounding of the uninterrupted run."""
    path = str(tmp_path / "ck")
    full, sd_full, _ = pools(2).run(harness.ckpt_run, "zero3", path, 4, save_at=2)[0]
    resumed, sd, meta = pools(1).run(harness.ckpt_run, "ddp", path, 4, resume=True, micro_of=2)[0]
    assert meta["ranks"] == 2 and sorted(resumed) == [2, 3]
    assert max(abs(resumed[s] - full[s]) / abs(full[s]) for s in (2, 3)) <= 1e-5
    assert harness.rel_param_err(sd, sd_full) <= 1e-5


def test_a_zero2_checkpoint_of_two_ranks_resumes_on_four_under_zero3(pools, tmp_path):
    """dp=2 -> dp=4: each of the four ranks takes half of a saving rank's batch (the same mean gradient)."""
    path = str(tmp_path / "ck")
    full, sd_full, _ = pools(2).run(harness.ckpt_run, "zero2", path, 4, save_at=2)[0]
    resumed, sd, meta = pools(4).run(harness.ckpt_run, "zero3", path, 4, resume=True, half=True)[0]
    assert meta["ranks"] == 2 and meta["world"] == 2 and sorted(resumed) == [2, 3]
    assert max(abs(resumed[s] - full[s]) / abs(full[s]) for s in (2, 3)) <= 1e-5
    assert harness.rel_param_err(sd, sd_full) <= 1e-5


def test_a_dp4_checkpoint_resumes_on_dp2_and_dp2_x_tp2_and_a_tp_checkpoint_anywhere(pools, tmp_path):
    """dp=4 -> dp=2 (zero3 -> zero2), and dp=4 -> dp=2 x tp=2 (loaded before the tp plan exists, then
    cut to the tp shards at the first step), each dp rank taking two saving ranks' batches: within
    fp32 rounding of the uninterrupted run. The tp job's own checkpoint, written as pieces of the
    whole tensors, resumes on the same mesh bit for bit, and on dp=4 under ddp within rounding."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    full, sd_full, _ = pools(4).run(harness.ckpt_run, "zero3", a, 4, save_at=2)[0]
    two, sd, _ = pools(2).run(harness.ckpt_run, "zero2", a, 4, resume=True, micro_of=2)[0]  # dp=4 -> dp=2
    assert max(abs(two[s] - full[s]) / abs(full[s]) for s in (2, 3)) <= 1e-5
    assert harness.rel_param_err(sd, sd_full) <= 1e-5
    tp, sd_tp, meta = pools(4).run(harness.ckpt_run, "zero3", a, 4, resume=True, tp=2, micro_of=2,
                                   save_at=3, save_to=b)[0]
    assert meta["ranks"] == 4 and sorted(tp) == [2, 3]
    assert max(abs(tp[s] - full[s]) / abs(full[s]) for s in (2, 3)) <= 1e-5
    assert harness.rel_param_err(sd_tp, sd_full) <= 1e-5
    again, sd, meta = pools(4).run(harness.ckpt_run, "zero3", b, 4, resume=True, tp=2, micro_of=2)[0]
    assert meta["ranks"] == 2 and meta["tp"] == 2 and again == {3: tp[3]}
    assert all(torch.equal(sd[k], sd_tp[k]) for k in sd_tp)
    dp, sd, _ = pools(4).run(harness.ckpt_run, "ddp", b, 4, resume=True)[0]
    assert abs(dp[3] - full[3]) / abs(full[3]) <= 1e-5 and harness.rel_param_err(sd, sd_full) <= 1e-5


def test_a_tp_checkpoint_of_fused_qkv_loads_into_a_job_that_has_stepped_bit_identical(pools, tmp_path):
    """GPT's fused q/k/v weight is cut on tp in three blocks and on dp across them: several pieces per
    rank. Loaded into a job that has taken a step (its state already tp shards), the resumed steps
    give the same floats, with clipping and the schedule."""
    path = str(tmp_path / "ck")
    full, sd_full, _ = pools(4).run(harness.ckpt_run, "zero3", path, 3, save_at=1, tp=2, name="gpt", loop=True)[0]
    resumed, sd, meta = pools(4).run(harness.ckpt_run, "zero3", path, 3, resume=True, tp=2, name="gpt", loop=True,
                                     warm=True)[0]
    assert meta["steps"] == 1 and resumed == {s: full[s] for s in (1, 2)}
    assert all(torch.equal(sd[k], sd_full[k]) for k in sd_full)


def test_an_offloaded_optimizer_state_checkpoints_and_resumes_bit_identical(pools, tmp_path):
    """The state in host memory (half of it updated on the host): saved from its host buffers and
    loaded into them, in a job that has stepped and in one that does not offload."""
    path, off = str(tmp_path / "ck"), {"offload_optimizer": True, "offload_host_update": 0.5}
    full, sd_full, _ = pools(2).run(harness.ckpt_run, "zero3", path, 3, save_at=1, loop=True, **off)[0]
    for kw in ({**off, "warm": True}, {}):
        resumed, sd, _ = pools(2).run(harness.ckpt_run, "zero3", path, 3, resume=True, loop=True, **kw)[0]
        assert resumed == {s: full[s] for s in (1, 2)}, kw
        assert all(torch.equal(sd[k], sd_full[k]) for k in sd_full), kw


def test_a_save_is_published_only_once_complete(pools, tmp_path):
    """What a crashed save leaves (``<path>.partial``, no metadata) is never read: the checkpoint
    published before it loads, and the next save clears it and replaces the old one whole."""
    path = str(tmp_path / "ck")
    full, _, _ = pools(2).run(harness.ckpt_run, "zero3", path, 3, save_at=2)[0]
    os.makedirs(path + ".partial")
    with open(os.path.join(path + ".partial", "__0_0.distcp"), "wb") as f:
        f.write(b"half a shard")
    resumed, _, meta = pools(2).run(harness.ckpt_run, "zero3", path, 3, resume=True)[0]
    assert meta["steps"] == 2 and resumed[2] == full[2]
    pools(2).run(harness.ckpt_run, "zero3", path, 1, save_at=1)
    assert not os.path.exists(path + ".partial") and not os.path.exists(path + ".old")
    _, _, meta = pools(2).run(harness.ckpt_run, "zero3", path, 1, resume=True)[0]
    assert meta["steps"] == 1


def test_bad_checkpoints_are_refused_by_name(pools, tmp_path):
    def refused(p, **kw):
        (ok, val), = pools(1).run_all(harness.ckpt_run, "zero3", p, 1, resume=True, **kw)
        assert not ok and val[0] == "CheckpointError", val
        return val[1]

    path = str(tmp_path / "ck")
    pools(1).run(harness.ckpt_run, "zero3", path, 1, save_at=1)
    assert "no checkpoint at" in refused(str(tmp_path / "none"))
    says = refused(path, over=(("d_model", 16),))
    assert "of another model" in says and "shapes differ: blocks.0.attn.wk.weight (16, 32) saved, (8, 16) here" in says, says
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(3)}, checkpoint_id=str(tmp_path / "foreign"), no_dist=True)
    assert "the model has" in refused(str(tmp_path / "foreign"))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"not a pickle")
    assert "corrupt" in refused(path)
    os.remove(os.path.join(path, ".metadata"))  # a save that stopped before its metadata
    assert "partial" in refused(path)


class FusedQKV(torch.nn.Module):
    """A fused q/k/v weight that its state_dict hook saves as three (as HF conversions do)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(8, 24, bias=False), torch.nn.Linear(8, 1)
        self._register_state_dict_hook(FusedQKV.split)

    @staticmethod
    def split(mod, sd, prefix, local):
        for n, part in zip("qkv", sd.pop(prefix + "qkv.weight").chunk(3)):
            sd[prefix + n + ".weight"] = part
        return sd

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out(q * k + v).pow(2).mean()


def test_a_model_whose_state_dict_runs_hooks_exports_and_checkpoints_under_zero3(tmp_path):
    """Once full_state_dict ran the module's hooks on its meta tensors ("Cannot copy out of meta tensor")."""
    import copy

    import shardwise as sw

    torch.manual_seed(0)
    model = FusedQKV()
    ref = copy.deepcopy(model)
    job = sw.compile(model, strategy="zero3", mesh=sw.mesh(dp=1))
    sd, want = job.full_state_dict(), ref.state_dict()
    assert sorted(sd) == ["k.weight", "out.bias", "out.weight", "q.weight", "v.weight"]
    assert all(torch.equal(sd[k], want[k]) for k in want)
    job.step(torch.randn(2, 8))
    job.save(str(tmp_path / "ck"))
    again = sw.compile(copy.deepcopy(ref), strategy="zero3", mesh=sw.mesh(dp=1))
    assert again.load(str(tmp_path / "ck"))["steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(again.full_state_dict().values(), job.full_state_dict().values()))
