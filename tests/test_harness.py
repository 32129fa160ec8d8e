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
