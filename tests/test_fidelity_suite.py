"""The fidelity suite's CI slice: every task and method runs a few simulated steps and is reported."""
import json
import math

from benchmarks import fidelity_suite


def test_smoke_slice_runs_every_task_and_method(tmp_path):
    assert fidelity_suite.main(["--smoke", "--jobs", "2", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "fidelity_suite.json").read_text())
    assert {(r["task"], r["method"]) for r in runs} == {(t, m) for t in fidelity_suite.TASKS
                                                         for m in fidelity_suite.METHODS}
    assert all(math.isfinite(r["final"]) and r["steps"] == 6 and r["workers"] == 2 for r in runs)
    table = (tmp_path / "fidelity_suite.md").read_text()
    assert all(f"| {t} | 2 | terngrad |" in table for t in fidelity_suite.TASKS)
    assert all((tmp_path / f"fidelity_{t}.png").stat().st_size > 0 for t in fidelity_suite.TASKS)
    # every method of a task starts from the same initialization: FP32 and TernGrad differ only by the exchange
    first = {(r["task"], r["method"]): r["curve"] for r in runs}
    assert all(len(c) >= 1 for c in first.values())
