"""The multi-rank harness itself: results in rank order, failures carry the rank's stderr, hangs time out."""
import os
import time

import pytest

from tests.mpi_harness import RankFailure, RankTimeout, run_ranks

pytestmark = pytest.mark.mpi


def body_allreduce(tag):
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="harness.sum")
    return {"rank": hvd.rank(), "size": hvd.size(), "sum": float(total), "tag": tag, "pid": os.getpid()}


def body_fail_on_rank1():
    import horovod.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        print("rank 1 about to fail", flush=True)
        raise ValueError("planted failure on rank 1")
    return hvd.rank()


def body_hang():
    import horovod.torch as hvd
    import torch

    hvd.init()
    if hvd.rank() == 0:  # only rank 0 enters the collective: a hang
        hvd.allreduce(torch.ones(1), name="harness.hang")
    else:
        time.sleep(3600)
    return hvd.rank()


@pytest.mark.parametrize("np", [2, 4])
def test_results_come_back_in_rank_order(np):
    res = run_ranks("tests.test_harness:body_allreduce", np=np, timeout=90, args=("x",))
    assert [r["rank"] for r in res] == list(range(np))
    assert all(r["size"] == np and r["sum"] == np * (np + 1) / 2 and r["tag"] == "x" for r in res)
    assert len({r["pid"] for r in res}) == np  # real, separate processes


def test_runs_under_horovodrun():
    res = run_ranks("tests.test_harness:body_allreduce", np=2, timeout=90, args=("h",), launcher="horovodrun")
    assert [r["sum"] for r in res] == [3.0, 3.0]


def test_failing_rank_is_reported_with_its_stderr():
    with pytest.raises(RankFailure) as info:
        run_ranks("tests.test_harness:body_fail_on_rank1", np=2, timeout=60)
    msg = str(info.value)
    assert "rank 1 of 2 failed" in msg
    assert "planted failure on rank 1" in msg
    assert "rank 1 about to fail" in msg


def test_planted_hang_fails_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks("tests.test_harness:body_hang", np=2, timeout=8)
    elapsed = time.monotonic() - t0
    assert elapsed < 8 + 10, elapsed
    assert "did not finish within 8 s" in str(info.value)


# ---------------------------------------------------------------------------------------------
# The warm start (tests._zygote): ranks forked from servers that have imported torch, Horovod and hvd_terngrad
def body_where():
    import sys

    import torch

    zygote = sys.modules.get("tests._zygote")
    return {"pid": os.getpid(), "hash": hash("terngrad"), "warm": bool(zygote and zygote.FORKED),
            "threads": torch.get_num_threads(), "sees_server": "HVDTG_ZYGOTE" in os.environ}


warm_only = pytest.mark.skipif(os.environ.get("HVDTG_TEST_ZYGOTE") == "0", reason="ranks start fresh here")


@warm_only
def test_ranks_start_warm_as_separate_processes_each_with_its_own_hash_seed():
    res = run_ranks("tests.test_harness:body_where", np=4, timeout=60)
    assert all(r["warm"] and not r["sees_server"] for r in res), res
    assert len({r["pid"] for r in res}) == 4
    assert all(r["threads"] == 1 for r in res)  # OMP_NUM_THREADS=1, as the harness sets it, read at import
    if "PYTHONHASHSEED" not in os.environ:  # fresh interpreters' sets of strings iterate in different orders
        assert len({r["hash"] for r in res}) == 4, res


def test_a_rank_whose_startup_environment_differs_starts_fresh():
    res = run_ranks("tests.test_harness:body_where", np=2, timeout=60, env={"OMP_NUM_THREADS": "2"})
    assert not any(r["warm"] for r in res) and all(r["threads"] == 2 for r in res), res


@warm_only
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_signal_to_the_process_mpirun_started_reaches_its_warm_rank(tmp_path, sig):
    """mpirun signals the process it started (SIGTERM on an abort, then SIGKILL): the rank forked for it
    dies of SIGTERM with it, and dies too where its stub was killed outright. No rank outlives its job."""
    import pickle
    import signal
    import subprocess
    import sys

    from tests.mpi_harness import ROOT, job_env

    (tmp_path / "spec.pkl").write_bytes(pickle.dumps({"target": "time:sleep", "args": (120,)}))
    stub = subprocess.Popen([sys.executable, "-m", "tests._rank_main", str(tmp_path)], cwd=ROOT,
                            env={**job_env(1), "OMPI_COMM_WORLD_RANK": "0"})
    pid_file, deadline = tmp_path / "rank0.pid", time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and stub.poll() is None, "the rank never started"
        time.sleep(0.05)
    rank = int(pid_file.read_text())
    assert rank != stub.pid
    stub.send_signal(getattr(signal, sig))
    assert stub.wait(timeout=30) == -getattr(signal, sig)
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"the rank outlived its stub's {sig}"
        time.sleep(0.05)
