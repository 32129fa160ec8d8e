"""benchmarks/time_to_accuracy.py: the target, the time to it and the speedups from recorded runs, and a real
2-rank job of its worker."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import time_to_accuracy as T
from tests.mpi_harness import free_port

ROOT = Path(__file__).resolve().parent.parent


def _run(method, seed, curve, task="lenet", profile="ethernet-1g"):
    return {"task": task, "profile": profile, "method": method, "seed": seed, "workers": 4,
            "curve": curve, "final": curve[-1][2], "seconds": curve[-1][0]}


RUNS = [
    _run("ddp:fp32", 0, [(0, 0, 10.0), (10, 5, 90.0), (20, 10, 97.0)]),
    _run("fp32", 0, [(0, 0, 10.0), (30, 5, 90.0), (60, 10, 97.0)]),
    _run("ddp:powersgd", 0, [(0, 0, 10.0), (6, 5, 96.4), (12, 10, 96.6)]),
    _run("terngrad", 0, [(0, 0, 10.0), (4, 5, 96.6), (8, 10, 97.2)]),
    _run("terngrad", 1, [(0, 0, 10.0), (5, 5, 96.0), (9, 10, 96.8)]),
    _run("fp16", 0, [(0, 0, 10.0), (5, 5, 80.0), (9, 10, 95.0)]),  # never reaches 96.5
]


def test_the_target_is_fp32s_mean_final_less_half_a_point_and_time_is_the_first_evaluation_there():
    goal = T.target(RUNS, "lenet", "ethernet-1g")
    assert goal == pytest.approx(96.5)
    assert T.time_to(RUNS[0], goal) == 20 and T.time_to(RUNS[2], goal) == 12 and T.time_to(RUNS[5], goal) is None
    lm = _run("ddp:fp32", 0, [(0, 0, 5.0), (10, 5, 2.05), (20, 10, 2.0)], task="charlm")
    assert T.target([lm], "charlm", "ethernet-1g") == pytest.approx(2.02)  # bits per character: +1%
    assert T.time_to(lm, 2.02) == 20


def test_a_jobs_order_turns_with_the_seed_so_each_method_takes_every_place():
    methods = ["fp32", "ddp:fp32", "terngrad"]
    orders = [T._in_turn(methods, seed) for seed in range(3)]
    assert orders[0] == methods and orders[1] == ["ddp:fp32", "terngrad", "fp32"]
    assert all(sorted(o) == sorted(methods) for o in orders)
    assert {o.index("terngrad") for o in orders} == {0, 1, 2}


def test_summary_takes_medians_over_seeds_and_compares_with_fp32_and_the_best_peer():
    rows = {r["method"]: r for r in T.summarize(RUNS)}
    tg = rows["terngrad"]
    assert (tg["tta"], tg["tta_min"], tg["tta_max"], tg["reached"]) == (6.5, 4, 9, 2)  # seeds at 4 and 9 s
    assert tg["vs_fp32"] == pytest.approx(20 / 6.5)  # against the faster FP32 (DDP's)
    assert tg["vs_peer"] == pytest.approx(12 / 6.5)  # PowerSGD: the fastest that is not TernGrad
    assert rows["fp16"]["tta"] is None and rows["fp16"]["reached"] == 0
    text = T.table(list(rows.values()))
    assert "not reached" in text and "lenet on ethernet-1g: 96.50" in text


def test_the_ceiling_is_local_at_the_faster_fp32s_step_to_the_target_and_no_peer():
    """local's clock at the step where DDP FP32 (the faster FP32) first reached 96.5 in the same seed: step 10
    for seed 0 (8 s), step 5 for seed 1 (3 s). It is neither FP32 nor a peer; its metric is not reported."""
    fp32 = [_run("ddp:fp32", 0, [(0, 0, 10.0), (10, 5, 90.0), (20, 10, 97.0)]),
            _run("ddp:fp32", 1, [(0, 0, 10.0), (9, 5, 96.6), (19, 10, 97.0)]),
            _run("fp32", 0, [(0, 0, 10.0), (30, 5, 96.9), (60, 10, 97.0)]),
            _run("fp32", 1, [(0, 0, 10.0), (30, 5, 90.0), (60, 10, 97.0)])]
    local = [_run("local", 0, [(0, 0, 10.0), (4, 5, 99.0), (8, 10, 99.0)]),
             _run("local", 1, [(0, 0, 10.0), (3, 5, 50.0), (7, 10, 50.0)])]
    tg = [_run("terngrad", s, [(0, 0, 10.0), (6, 5, 96.6), (12, 10, 97.0)]) for s in (0, 1)]
    goal = T.target(fp32, "lenet", "ethernet-1g")
    assert goal == pytest.approx(96.5)
    assert T.ceiling_times(fp32 + local, goal, "ddp:fp32") == [8, 3]
    rows = {r["method"]: r for r in T.summarize(fp32 + local + tg + [_run("ddp:bf16", 0, [(0, 0, 10.0),
                                                                                          (9, 5, 96.7)])])}
    ceiling, fp32_row = rows["local"], rows["ddp:fp32"]
    assert (ceiling["tta"], ceiling["tta_min"], ceiling["tta_max"], ceiling["final"]) == (5.5, 3, 8, None)
    assert fp32_row["tta"] == pytest.approx(14.5)  # seeds at 20 and 9 s; Horovod's is 30 and 60
    assert ceiling["vs_fp32"] == pytest.approx(14.5 / 5.5)  # the most any compression buys here
    assert rows["terngrad"]["vs_peer"] == pytest.approx(9 / 6)  # bf16 is the best peer, not the ceiling
    assert rows["terngrad"]["of_ceiling"] == pytest.approx(5.5 / 6) and ceiling["of_ceiling"] == 1.0
    text = T.table(list(rows.values()))
    assert "| local: no exchange, at FP32's steps (ceiling) | 5.5 | 3.0–8.0 | 2/2 |  |" in text
    assert "the most any compression can buy here" in text


def test_without_fp32_reaching_the_target_the_ceiling_has_no_time():
    fp32 = _run("ddp:fp32", 0, [(0, 0, 10.0), (10, 5, 97.0)])
    local = _run("local", 0, [(0, 0, 10.0), (4, 5, 99.0)])
    assert T.ceiling_times([fp32, local], 98.0, "ddp:fp32") == [None]
    rows = {r["method"]: r for r in T.summarize([local])}  # no FP32 run: no target, no ceiling
    assert rows["local"]["tta"] is None and rows["local"]["reached"] == 0


@pytest.mark.mpi
def test_the_worker_trains_every_kind_of_method_on_two_ranks(tmp_path):
    """A few steps of each kind (DDP, PowerSGD, Horovod, TernGrad on both, the no-exchange ceiling) in one 2-rank
    job: a curve each."""
    out = tmp_path / "runs.jsonl"
    methods = "ddp:fp32,ddp:powersgd,fp16,terngrad:noclip:ef:block64,ddp:terngrad:sharded-ternary,local"
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT),
           "OMPI_MCA_mpi_yield_when_idle": "1"}  # as tests/mpi_harness.py: a job beside others
    res = subprocess.run([str(Path(sys.executable).parent / "horovodrun"), "-np", "2", sys.executable, "-m",
                          "benchmarks.time_to_accuracy", "worker", "--task", "lenet", "--seed", "0", "--methods",
                          methods, "--max-steps", "24", "--json", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["method"] for r in runs] == methods.split(",")
    for r in runs:
        assert r["steps"] == 24 and r["seconds"] > 0 and r["workers"] == 2
        clocks = [c[0] for c in r["curve"]]
        assert clocks == sorted(clocks) and len(clocks) == 3 and r["curve"][-1][1] == 24  # start, step 15, end
        assert r["final"] > r["curve"][0][2] + 20  # 24 steps of LeNet-5 learn: from chance to well above it


def test_the_main_jobs_table_on_localhost_adds_the_cost_models_step_on_1_gbit():
    from examples.train_digits import link_ms, table

    def run(method, seconds):
        return {"method": method, "final_acc": 97.0, "bytes_per_step": 1000, "ratio": 1.0, "seconds": seconds,
                "steps": 100, "history": [{"seconds": seconds, "test_acc": 97.0}]}

    text = table([run("fp32", 1.0), run("terngrad", 2.0)], 2, free_link=True)
    assert "| step here | predicted on 1 Gbit/s |" in text and "link is free" in text
    # FP32 sends 16x the coded bytes (this small CNN's latency terms and float tensors narrow the gap)
    assert link_ms("fp32", 2) > 2 * link_ms("terngrad", 2) > 0
    assert f"| 10.0 ms | {10 + link_ms('fp32', 2):.1f} ms |" in text
    assert "predicted" not in table([run("fp32", 1.0)], 2)


def test_the_trial_cost_benchmark_codes_the_steps_auto_codes():
    """benchmarks.trial_cost codes the steps auto codes where it tries its plan in each wire: the coded turn of
    each round (first, or last in the second round of a pair), the pruning step after the first pair and the
    verdict step, read from AutoPlan itself, so that the benchmark follows the trial when it changes; pruned
    (the default), the coded turns of the first pair only; with measured_coded, the measured steps too."""
    from benchmarks.trial_cost import coded_steps
    from hvd_terngrad.auto import PLAN_STEP, TRIAL_PAIRS
    from hvd_terngrad.transports.uncoded import WIRES

    kinds = 1 + len(WIRES)
    pruning = PLAN_STEP + 2 * kinds
    first = {PLAN_STEP, pruning - 1}  # the first pair's coded turns, then the pruning step
    later = {pruning + 1 + r * kinds + (kinds - 1 if r % 2 else 0) for r in range(2 * TRIAL_PAIRS - 2)}
    assert coded_steps(pruned=False) == first | {pruning} | later | {pruning + 1 + 2 * (TRIAL_PAIRS - 1) * kinds}
    verdict = pruning + 1 + 2 * (TRIAL_PAIRS - 1) * (kinds - 1)
    assert coded_steps() == first | {pruning, verdict}
    assert coded_steps(measured_coded=True) == set(range(PLAN_STEP)) | first | {pruning, verdict}


def test_the_trial_cost_benchmark_averages_the_gap_at_each_evaluation():
    """mean_gap: the trial's metric less FP32's at each evaluation, averaged over the seeds, the first ten only."""
    from benchmarks.trial_cost import mean_gap

    fp32 = [(s, 40.0 + s / 46) for s in range(0, 46 * 12, 46)]
    dipped = [(s, m - (2.0 if s == 92 else 0.0)) for s, m in fp32]
    gap = mean_gap([(fp32, dipped), (fp32, fp32)])
    assert gap.split()[:3] == ["0:+0.00", "46:+0.00", "92:-1.00"] and len(gap.split()) == 10, gap


def test_auto_kinds_pairs_each_auto_run_with_its_front_ends_fp32_by_the_kind_kept(tmp_path, capsys):
    """benchmarks.auto_kinds: an auto run against its own front end's FP32 on the same seed, grouped by the kind
    its trial kept (the coded kind, a plan's wire, every group coded with one transport); runs without their
    FP32 are left out."""
    from benchmarks import auto_kinds

    def auto(kept, tried=({"coding": [], "transport": None, "uncoded": "fp32"},
                          {"coding": [], "transport": None, "uncoded": "fp16"}), noise=None):
        return {"kept": kept, "tried": list(tried)} | ({} if noise is None else {"step_noise": noise})

    def run(method, seed, seconds, a=None):
        return {"task": "lenet", "profile": "fast", "method": method, "seed": seed, "seconds": seconds} | (
            {"auto": a} if a else {})

    runs = [run("ddp:fp32", 0, 10.0), run("ddp:terngrad:auto", 0, 12.5, auto(None, noise=0.1)),
            run("ddp:fp32", 1, 9.0), run("ddp:terngrad:auto", 1, 9.0, auto(0, noise=0.2)),
            run("fp32", 0, 8.0), run("terngrad:auto", 0, 5.0, auto(1)),
            run("terngrad:auto", 1, 5.0, auto(0, [{"coding": "every group", "transport": "allgather"}])),
            run("terngrad:auto", 2, 7.0, auto(0, [{"coding": ["bucket.0"], "transport": None, "uncoded": "fp16"}]))]
    (tmp_path / "time_to_accuracy.json").write_text(json.dumps({"runs": runs}))
    found = auto_kinds.rows([{"runs": runs}])
    assert found == {("lenet", "fast", "ddp:terngrad:auto", "coded"): [(0.8, 0.1)],
                     ("lenet", "fast", "ddp:terngrad:auto", "fp32"): [(1.0, 0.2)],
                     ("lenet", "fast", "terngrad:auto", "fp16"): [(1.6, None)]}  # seeds 1, 2: no FP32 of theirs
    assert auto_kinds.kept_kind(runs[6]["auto"]) == "coded (allgather)"
    assert auto_kinds.kept_kind(runs[7]["auto"]) == "fp16 (some groups coded)"
    assert auto_kinds.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| lenet | fast | ddp:terngrad:auto | coded | 1 | 0.80x (0.80-0.80) | 10.0% |" in out, out
    assert "| lenet | fast | terngrad:auto | fp16 | 1 | 1.60x (1.60-1.60) | - |" in out, out


def test_seed_hits_marks_each_seeds_hit_against_its_fp32_and_counts_each_seed_once(tmp_path, capsys):
    """benchmarks.seed_hits: per results folder, each seed's run hit the target (FP32's final less 0.5 pp, here
    96.5) at a later, the same or a sooner evaluation than its front end's FP32 on that seed; the sign test
    counts a seed once, its marks summed over the folders. Horovod's FP32 is marked against DDP's: the null,
    two trajectories parted only by the order of their float sums."""
    from benchmarks import seed_hits

    def curve(hit_step):  # reaches 97 at hit_step (None: never)
        return [(0, 0, 10.0), (1, 5, 97.0 if hit_step == 5 else 90.0), (2, 10, 97.0 if hit_step else 95.0)]

    def job(auto_hits):
        runs = [_run("ddp:fp32", s, curve(10), profile="fast") for s in range(3)]
        return runs + [_run("ddp:terngrad:auto", s, curve(h), profile="fast") for s, h in enumerate(auto_hits)]

    first, second = job([None, 5, 10]), job([None, 10, 5])
    first.append(_run("fp32", 1, curve(5), profile="fast"))
    assert seed_hits.hits(first) == {("lenet", "fast", "ddp:terngrad:auto"): {0: None, 1: -1, 2: 0},
                                     ("lenet", "fast", "fp32"): {1: -1}}
    assert seed_hits.sign_test(7, 2) == pytest.approx(92 / 512) and seed_hits.sign_test(0, 0) == 1.0
    for name, runs in (("one", first), ("two", second)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "time_to_accuracy.json").write_text(json.dumps({"runs": runs}))
    assert seed_hits.main([str(tmp_path / "one"), str(tmp_path / "two")]) == 0
    out = capsys.readouterr().out
    assert "| one |  -  s  = | 0 / 1 / 1 |" in out and "| two |  -  =  s | 0 / 1 / 1 |" in out, out
    assert "Seeds later on balance: 0, sooner: 2, even: 1; sign test over the seeds, p = 0.50" in out, out
    assert "**lenet fast fp32**, seeds 1-1" in out and "| one |  s | 0 / 0 / 1 |" in out, out
