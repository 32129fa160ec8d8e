"""benchmarks.allreduce_dtypes on two real ranks: every library and dtype it times runs (gloo's fp16 and bf16
sums, Horovod's fp16), and rank 0 prints a median a round for each."""
import contextlib
import io
import re

from tests.mpi_harness import free_port, run_ranks


def body_allreduce_dtypes(port: int) -> str:
    from benchmarks import allreduce_dtypes

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        allreduce_dtypes.main(["--numel", "1000", "--reps", "3", "--rounds", "2", "--port", str(port)])
    return out.getvalue()


def test_every_library_and_dtype_is_timed_in_each_round():
    from benchmarks.allreduce_dtypes import KINDS

    first, second = run_ranks("tests.test_allreduce_dtypes:body_allreduce_dtypes", np=2, timeout=120,
                              args=(free_port(),))
    assert second == ""  # rank 0 alone reports
    assert first.startswith("allreduce of 1,000 values on 2 ranks, median ms of 3, by round:")
    rows = first.splitlines()[1:]
    assert [tuple(row.split()[:2]) for row in rows] == list(KINDS)
    for row in rows:
        ms = [float(x) for x in row.split()[2:]]
        assert len(ms) == 2 and all(x > 0 for x in ms), row
        assert re.fullmatch(r"\s+\S+\s+\S+(\s+\d+\.\d\d){2}", row)
