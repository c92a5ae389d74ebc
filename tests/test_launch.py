import time

import pytest
import torch
import torch.distributed as dist

from tbo.harness.launch import RankError, launch


def _sum_ranks(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return (rank, world, t.item(), torch.get_num_threads())


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def _hang(rank, world):
    time.sleep(3600)  # stuck, as far as any test can tell


@pytest.mark.dist
def test_launch_runs_every_rank_with_a_process_group():
    assert launch(_sum_ranks, 3) == [(0, 3, 6.0, 1), (1, 3, 6.0, 1), (2, 3, 6.0, 1)]


@pytest.mark.dist
def test_launch_reports_failing_rank():
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed.*rank one is broken"):
        launch(_fail_on_one, 2)


@pytest.mark.dist
def test_launch_deadline_instead_of_hang():
    """The 3 s deadline fires (its message says so), and launch returns with the stuck ranks killed. This test's own
    deadline turns a launch that waits for them (an hour) into a failure; it measures no time."""
    import multiprocessing
    import threading

    outcome = {}

    def run():
        try:
            launch(_hang, 2, timeout_s=3)
        except TimeoutError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "launch is still waiting for ranks past its 3 s deadline"
    assert outcome["error"] == "ranks [0, 1] did not finish within 3s"
    assert multiprocessing.active_children() == []  # killed and reaped, not left behind


def _vanish(rank, world):
    import os

    if rank == 1:
        os._exit(0)
    return rank


@pytest.mark.dist
def test_launch_reports_rank_that_vanished():
    with pytest.raises(RankError, match="rank 1 exited with code 0 without a result"):
        launch(_vanish, 2, timeout_s=60)


def _fail_then_exit(rank, world):
    if rank == 0:
        raise RuntimeError("rank zero's own error")
    time.sleep(5)  # outlives the grace checks, so rank 0's exit is noticed while its report is in hand
    return rank


@pytest.mark.dist
def test_launch_keeps_the_failing_ranks_traceback():
    with pytest.raises(RankError, match="rank zero's own error"):
        launch(_fail_then_exit, 2, failure_grace_s=8)


def _tensor_result(rank, world):
    return torch.full((4,), float(rank))


@pytest.mark.dist
def test_launch_copies_tensor_results_instead_of_sharing_them():
    """A rank's tensors come back as copies. Shared through torch's queue, the parent would fetch each storage's file
    descriptor from the rank after it returned, and a rank that has exited by then resets the connection."""
    results = launch(_tensor_result, 2)
    assert [r.tolist() for r in results] == [[0.0] * 4, [1.0] * 4]
    assert not any(r.is_shared() for r in results)


def test_a_failed_dp_rank_is_described_by_its_cause_before_its_tail():
    """`describe_failure` leads with each rank's exit code and the lines that say why it failed (vLLM's log prefix
    cut, traceback frames left out), so that a CI log cut in the middle still names the rank that went first: here
    a real process that logs a worker error and then dies of SIGKILL, beside one that exited cleanly."""
    import subprocess
    import sys

    from tbo.harness.vllm_dp import RankRun, describe_failure

    script = ("import os, sys\n"
              "print('(EngineCore_DP1 pid=7) ERROR 12-05 21:11:48 [core.py:1512] RuntimeError: Worker failed')\n"
              "print('  File \"x.py\", line 3, in f', file=sys.stderr)\n"
              "print('(EngineCore_DP1 pid=7) INFO 12-05 21:11:48 [engine.py:323] tbo: 0 of 0 steps')\n"
              "sys.stdout.flush(); os.kill(os.getpid(), 9)\n")
    dead = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    fine = subprocess.run([sys.executable, "-c", "print('TBO_DP_RESULT {}')"], capture_output=True, text=True)
    runs = [RankRun(0, None, fine.stdout, fine.stderr, returncode=fine.returncode),
            RankRun(1, None, dead.stdout, dead.stderr, returncode=dead.returncode)]
    assert runs[0].causes() == []
    assert runs[1].causes() == ["RuntimeError: Worker failed", "killed by signal 9"]
    head = describe_failure(runs).splitlines()[:2]
    assert head == ["rank 0 rc=0: no error line",
                    "rank 1 rc=-9: RuntimeError: Worker failed | killed by signal 9"]
