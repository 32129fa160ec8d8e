"""The emulated cluster (benchmarks/cluster.py): a 2-node smoke run, cleanup on exit and on Ctrl-C, and that
it never touches namespaces it did not create. Skipped, with the reason, where root or netns are missing."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.cluster import PROFILES, ClusterUnavailable, EmulatedCluster, check_support

ROOT = Path(__file__).resolve().parent.parent

try:
    check_support()
    REASON = None
except ClusterUnavailable as exc:
    REASON = str(exc)

# timed runs: on the container job's pytest worker, so never beside its image build (make test runs two workers)
pytestmark = [pytest.mark.mpi, pytest.mark.xdist_group("container"),
              pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster: {REASON}")]


def _namespaces() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_two_node_smoke_run_over_a_shaped_link(tmp_path):
    foreign = f"foreign-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        with EmulatedCluster(2, PROFILES["ethernet-1g"]) as c:
            mine = {c.ns(0), c.ns(1)}
            assert mine <= _namespaces()
            probe = c.probe(seconds=1.0)
            assert 80 < probe["bandwidth_MBps"] < 130  # 1 Gbit/s = 125 MB/s
            out = tmp_path / "r.jsonl"
            res = c.run([sys.executable, "-m", "benchmarks.synthetic", "--model", "tiny", "--method", "terngrad",
                         "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
                         "--iface", "eth0", "--json", str(out), "--compute-probe", "1"], timeout=120)
            assert res.returncode == 0, res.stdout[-3000:]
            row = json.loads(out.read_text())
            assert row["workers"] == 2 and row["img_sec_total"] > 0
            # the compute probe took its steps between the timed iterations
            cp = row["compute_probe"]
            # each part is its slowest rank's, so the parts may sum past the step when two ranks are slowest
            assert 0 < cp["forward"] <= cp["step"] and 0 < cp["backward"] <= cp["step"]
            assert set(cp["ready"]) == {"net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"}
            assert all(0 < t <= cp["backward"] * 1.01 for t in cp["ready"].values())
            # the codes crossed the shaped link: at least the allgathered records of the coded tensor
            assert row["wire_tx_per_step"] >= row["bytes_per_step"] * 0.5
        assert not (mine & _namespaces())  # cleaned up
        assert foreign in _namespaces()  # never touched
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=False)


def test_ctrl_c_cleans_up():
    before = _namespaces()
    marker = f"6{os.getpid() % 1000:03d}"  # a sleep length no other process uses: the ranks' command
    proc = subprocess.Popen([sys.executable, "benchmarks/cluster.py", "run", "--nodes", "2", "--profile", "fast",
                             "--", "sleep", marker], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    # its own namespaces only (EmulatedCluster's tag starts with its pid): another test's cluster may come up
    # at the same time, under pytest's parallel workers, and go down on its own schedule
    prefix = f"hvdtg-{proc.pid % 10000:04d}"

    def own():
        return {n for n in _namespaces() - before if n.startswith(prefix)}

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not own():
        time.sleep(0.2)
    created = own()
    assert created, "the cluster never came up"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert not (created & _namespaces())
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    tag = next(iter(created)).split("-")[1]
    assert f"tgb{tag}" not in links and f"tgh{tag}" not in links
    deadline = time.monotonic() + 5  # the job's processes (mpirun, orted, the ranks) are gone too
    while True:
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        left = [line for line in ps.splitlines() if f"hvdtg-cluster-{tag}-" in line or line == f"sleep {marker}"]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, left


def test_refuses_clearly_without_root():
    if os.geteuid() != 0:
        pytest.skip("already not root")
    # cluster.py uses the standard library only; the system python is reachable by an unprivileged user
    py = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py,
                          str(ROOT / "benchmarks" / "cluster.py"), "probe"], cwd="/", capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2
    assert "needs root" in res.stderr


def test_calibration_probe_measures_every_input_of_the_model():
    from benchmarks.calibrate import SIZES, calibrate
    from benchmarks.timeline import Host, host_step_seconds

    with EmulatedCluster(2, PROFILES["fast"]) as c:
        cal = calibrate(c, "tiny:8", timeout=300, quick=True)
    assert cal["nodes"] == 2 and cal["profile"] == "fast"
    comp = cal["compute"]["tiny:8"]
    assert 0 < comp["forward"] < comp["step"] and 0 < comp["backward"] < comp["step"]
    assert set(comp["ready"]) == {"net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"}
    assert comp["ready"]["net.3.weight"] <= comp["ready"]["net.1.weight"]  # backward order
    assert set(cal["collectives"]) == set(SIZES)
    for kind, v in cal["collectives"].items():
        assert [b for b, _ in v["points"]] == SIZES[kind] and all(t > 0 for _, t in v["points"])
        assert v["bandwidth_Bps"] > 0 and v["latency_s"] >= 0 and 0 <= v["cpu_fraction"] <= 1
        if kind != "allreduce_int8":  # measured beside compute at every size
            assert [b for b, _ in v["beside_compute_points"]] == SIZES[kind]
            assert all(t > 0 for _, t in v["beside_compute_points"])
            assert all(0 <= f <= 1 for _, f in v["cpu_fraction_points"])
    assert set(cal["codec"]) == {"allgather", "summed", "summed-int8", "fp16", "sharded", "sharded-ternary"}
    assert all(t > 0 for t in ("sharded", "sharded-ternary") for _, t in cal["codec"][t]["owner"])
    host = Host.from_json(cal)
    for method in ("fp32", "fp16", "terngrad", "terngrad:summed", "terngrad:summed-int8", "terngrad:sharded",
                   "terngrad:sharded-ternary"):
        st = host_step_seconds(method, "tiny", 8, host)
        assert st["total"] >= st["compute"] > 0


def test_nodes_are_pinned_to_cores_round_robin():
    cpus = sorted(os.sched_getaffinity(0))
    with EmulatedCluster(3, PROFILES["fast"]) as c:
        res = c.run(["/bin/sh", "-c", 'echo "rank $OMPI_COMM_WORLD_RANK cpus $(taskset -pc $$ | cut -d: -f2)"'],
                    timeout=60)
    assert res.returncode == 0, res.stdout
    got = dict(line.split(" cpus ") for line in res.stdout.splitlines() if line.startswith("rank "))
    assert {int(k.split()[1]): v.strip() for k, v in got.items()} == {i: str(cpus[i % len(cpus)]) for i in range(3)}


def test_a_sweep_with_keep_going_records_a_job_past_its_timeout_and_goes_on(tmp_path):
    """--keep-going: a job that runs past --timeout is a failure in sweep.json and sweep.md, and the sweep ends
    normally (here every job does, so there is no row and no plot)."""
    from benchmarks.sweep import main as sweep

    assert sweep(["--models", "tiny", "--methods", "local,terngrad", "--profiles", "ethernet-1g", "--nodes", "2",
                  "--quick", "--keep-going", "--timeout", "1", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "sweep.json").read_text())
    assert out["rows"] == [] and [f["method"] for f in out["failures"]] == ["local", "terngrad"]
    assert all("exceeded 1 s" in f["reason"] for f in out["failures"])
    md = (tmp_path / "sweep.md").read_text()
    assert "* tiny ethernet-1g N=2 terngrad: job on the emulated cluster exceeded 1 s" in md


def test_a_sweep_puts_every_method_beside_the_no_exchange_ceiling(tmp_path):
    from benchmarks.sweep import main as sweep

    assert sweep(["--models", "tiny", "--methods", "local,terngrad", "--profiles", "ethernet-1g", "--nodes", "2",
                  "--quick", "--out", str(tmp_path)]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "sweep.json").read_text())["rows"]}
    local, tern = rows["local"], rows["terngrad"]
    assert local["bytes_per_step"] == 0 and local["optimizer"] == "none"
    # no gradient crosses the link; only Horovod's own coordination does
    assert local["wire_tx_per_step"] < 0.1 * tern["wire_tx_per_step"]
    assert 0 < local["main_cpu_seconds_per_step"] <= local["cpu_seconds_per_step"]
    assert 0 < tern["main_cpu_seconds_per_step"] <= tern["cpu_seconds_per_step"]
    assert tern["cpu_encode"] > 0 and tern["cpu_decode"] > 0 and "cpu_encode" not in local
    table = (tmp_path / "sweep.md").read_text()
    share = tern["img_sec_total"] / local["img_sec_total"]
    assert f"| tiny | ethernet-1g | 2 | terngrad | {tern['img_sec_total']:.0f} | {share:.0%} of " in table


def test_make_trains_main_job_streams_rank_0s_report_from_the_emulated_link(tmp_path):
    """make train's cluster path: the job's lines come as they are printed, tagged as horovodrun tags them, so
    rank0_report shows rank 0's report; the table gives each method's time to FP32's accuracy."""
    job = subprocess.Popen(
        f"set -o pipefail; {sys.executable} -m benchmarks.cluster run --stream --tag-output --timeout 240 --nodes 2 "
        f"-- {sys.executable} -m examples.train_digits --epochs 2 --json {tmp_path / 'res.json'} 2>&1 "
        f"| {sys.executable} scripts/rank0_report.py {tmp_path / 'logs'}",
        shell=True, executable="/bin/bash", cwd=ROOT, stdout=subprocess.PIPE, text=True)
    first = job.stdout.readline()  # the cluster's line comes before the job ends
    assert first.startswith("cluster: 2 nodes, ethernet-1g") and job.poll() is None
    out = first + job.stdout.read()
    assert job.wait(timeout=300) == 0, out[-3000:]
    assert "time to FP32's accuracy" in out and "[1,0]<stdout>" not in out and "| terngrad | 2 |" in out
    assert "terngrad: parameters agree across 2 workers" in out
    res = json.loads((tmp_path / "res.json").read_text())
    assert [h["seconds"] for h in res[0]["history"]] == sorted(h["seconds"] for h in res[0]["history"])
    assert "time to FP32" in (tmp_path / "logs" / "rank0.log").read_text()  # the untagged per-rank log
