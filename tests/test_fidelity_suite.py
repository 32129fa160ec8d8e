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


def test_a_diverging_run_is_recorded_not_fatal(tmp_path):
    """A TernGrad run whose gradients turn NaN ends as a diverged run (final NaN) and the report still comes out."""
    import dataclasses

    data = fidelity_suite.Data(fidelity_suite.TASKS["digits"])
    data.task = dataclasses.replace(data.task, lr=1e6)  # diverges within a few steps
    r = fidelity_suite.train(data, "terngrad", 2, 0, steps_cap=6)
    assert math.isnan(r["final"]) and "non-finite" in r["diverged"]
    rows = fidelity_suite.summarize([r, fidelity_suite.train(data, "fp32", 2, 0, steps_cap=6)])
    assert {row["method"]: row["diverged"] for row in rows}["terngrad"] == 1
    assert "1 (1 diverged)" in fidelity_suite.table(rows)


def test_set_changes_a_recipe_and_records_it(tmp_path, monkeypatch):
    """--set TASK.FIELD=VALUE changes that task's recipe for the invocation; each run records its recipe."""
    import pytest

    monkeypatch.setattr(fidelity_suite, "TASKS", dict(fidelity_suite.TASKS))  # --set writes to the table
    assert fidelity_suite.main(["--smoke", "--tasks", "digits", "--methods", "fp32,terngrad", "--set",
                                "digits.clip_norm=0.5", "--set", "digits.lr=0.02", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "fidelity_suite.json").read_text())
    assert [(r["recipe"]["clip_norm"], r["recipe"]["lr"], r["recipe"]["epochs"]) for r in runs] == [(0.5, 0.02, 8)] * 2
    for bad in ("digits.nope=1", "mnist.lr=1", "digits.lr"):
        with pytest.raises(SystemExit):
            fidelity_suite.main(["--smoke", "--set", bad, "--out", str(tmp_path)])
