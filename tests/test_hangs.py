"""No hangs (issue 23): a rank that stops, raises or takes fewer steps makes every other rank leave
within the job's timeout, with a message naming that rank and the step; ranks calling different
methods get an error that says so, not a transport error."""

import re
import time

import harness
import pytest
from dist_pool import Pool

TIMEOUT = 2.0


def _left(case: str):
    """Start ``hang_run(case)`` on two fresh ranks; (seconds until rank 0's process ended, its exit code)."""
    pool = Pool(2)
    try:
        pool.run(harness.make_model, "llama", "fp32")  # both ranks up and importing done
        for q in pool.inqs:
            q.put((harness.hang_run, (case, TIMEOUT), {}))
        t0 = time.monotonic()
        while pool.procs[0].is_alive() and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        return time.monotonic() - t0, pool.procs[0].exitcode
    finally:
        for p in pool.procs:
            p.kill()
        pool.close()


@pytest.mark.parametrize("case,says", [
    ("stop", r"rank 1 has given no sign of life for \d s \(in step 3\): it was stopped, stalled or killed"),
    ("fewer", "rank 1 is past step 2, in no job phase"),
    ("raise", r"rank 1 raised in step 3: OSError: no space left on device"),
])
def test_a_rank_that_stops_takes_fewer_steps_or_raises_ends_the_others_within_the_timeout(capfd, case, says):
    took, code = _left(case)
    err = capfd.readouterr().err
    assert code == 3, (code, err[-2000:])
    assert "shardwise: rank 0:" in err and re.search(says, err), err[-2000:]
    if case != "raise":
        assert "step 3 did not finish on rank 0 within 2 s (timeout=2" in err, err[-2000:]
    # from the start of step 1 (compiled there, about 2 s): the timeout of step 3 and the beats that
    # make sure of a rank's silence; a rank that raised is seen within a beat or two
    assert took < (TIMEOUT if case != "raise" else 0) + 8, took


def test_ranks_calling_different_methods_are_told_so(pools):
    res = pools(2).run_all(harness.hang_run, "eval", TIMEOUT)
    for ok, val in res:
        assert not ok and val[0] == "RankMismatchError", val
        assert "ranks [0] in job.step (step 3); ranks [1] in job.eval_step (after step 2)" in val[1], val[1]


def test_ranks_that_do_not_all_join_the_process_group_get_an_error_within_the_init_timeout():
    """Rank 0 of two started alone: it leaves after ``init_timeout``, saying how many ranks joined."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    code = "import shardwise as sw; sw.mesh(init_timeout=2)"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0 and time.monotonic() - t0 < 60
    assert "MeshError: rank 0: the 2 ranks did not all join the process group at 127.0.0.1:" in out.stderr, out.stderr
    assert "within init_timeout=2s" in out.stderr and "1/2 clients joined" in out.stderr, out.stderr
