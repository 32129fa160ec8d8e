"""scripts/gpu_check.sh, the one command for a machine with a GPU: its CPU-only paths run in CI so that it
cannot rot while no GPU is at hand."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run the real check")
def test_without_a_gpu_the_check_says_so_and_runs_nothing(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "no CUDA GPU is visible to torch" in res.stderr, res.stderr
    assert not list(tmp_path.iterdir())


def test_the_cpu_path_checks_identity_and_trains(tmp_path):
    from scripts import gpu_check

    assert gpu_check.main(["--allow-cpu", "--epochs", "8", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["identity"]["ok"] and report["identity"]["checked"] >= 20, report["identity"]
    assert report["training"]["ok"] and report["training"]["terngrad"]["test_accuracy"] > 0.8, report["training"]
    assert "skipped: no GPU" in report["cuda_tests"] and "overall: **ok**" in (tmp_path / "report.md").read_text()
