"""scripts/rank0_report.py: horovodrun's tagged output becomes rank 0's report and one log per rank."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "rank0_report.py"

TAGGED = """\
[1,0]<stdout>:digits CNN, 2 workers[1,0]<stdout>:
[1,1]<stderr>:UserWarning: something only rank 1 says
[1,0]<stdout>:progress fp32 epoch 1/2
[1,0]<stdout>:fp32 epoch 2/2
[1,0]<stdout>:
[1,0]<stdout>:| table |
[1,1]<stderr>:Traceback (most recent call last):
[1,1]<stderr>:ValueError: bad
Primary job  terminated normally, but 1 process returned a non-zero exit code.
"""


def test_report_shows_rank_0_untagged_and_keeps_every_rank_in_its_log(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], input=TAGGED, capture_output=True,
                         text=True, timeout=30, check=True)
    lines = res.stdout.splitlines()
    assert lines[:6] == ["digits CNN, 2 workers", "fp32 epoch 1/2", "fp32 epoch 2/2", "", "| table |",
                         "[rank 1] Traceback (most recent call last):"]  # not a terminal: progress printed as is
    assert "[rank 1] ValueError: bad" in lines and "Primary job  terminated normally" in res.stdout
    assert "UserWarning" not in res.stdout and "<stdout>" not in res.stdout
    rank1 = (tmp_path / "rank1.log").read_text()
    assert "[stderr] UserWarning: something only rank 1 says" in rank1 and "[stderr] ValueError: bad" in rank1
    assert (tmp_path / "rank0.log").read_text().startswith("digits CNN, 2 workers\nfp32 epoch 1/2\n")  # no marker
    assert "Primary job" in (tmp_path / "launcher.log").read_text()
