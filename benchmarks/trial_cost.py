"""What transport="auto"'s trial costs in steps to the target, with no clock: FP32 against FP32 whose trial steps
are coded, in the fidelity suite's simulator (bit for bit the optimizer's exchange), seed by seed.

    python -m benchmarks.trial_cost --task ncf --seeds 0-15 --workers 4      # about 6 min, on one core
    python -m benchmarks.trial_cost --task ncf --seeds 0-47 --jobs 2         # the seeds in 2 processes
    python -m benchmarks.trial_cost --task ncf --seeds 0-15 --jobs 2 --offset 92   # the trial 92 steps later

Auto codes the coded turns of its trial, its pruning step and its verdict's step, then keeps what was fastest
(its first PLAN_STEP steps, which measure the codec, send FP32; the coded kind, pruned after the first pair of
rounds where it is far behind, as on NCF, takes no more turns: --unpruned keeps it in every round).
On the fast profile it keeps fp32 or fp16, so what is left of its cost after the trial's time is what those
coded steps do to the model. Here all the other steps are FP32 (the trial's fp16 steps too: their scaled average
stays within fp16's rounding of FP32's), and the coded steps are the paper's TernGrad, as `terngrad:auto`
codes them. Each run evaluates 8 times an epoch, as benchmarks.time_to_accuracy does; the target is the FP32
runs' mean final metric less 0.5 pp. Prints, per seed, the step at which each reached it, and how many seeds
reached it later or sooner with the trial; then the mean over the seeds of the trial's metric less FP32's at
each of the first evaluations, where a dip shows even when it has healed before the target. --offset moves
the trial's coded steps that many steps later (the steps before them FP32), to measure a trial that starts
once training has settled; --measured-coded codes the first PLAN_STEP steps too, as auto did before it rehearsed
the codec on FP32 steps (hvd_terngrad.pipeline.Pipeline.rehearse).
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks.fidelity_suite import TASKS, Data, train
from benchmarks.time_to_accuracy import EVALS_PER_EPOCH
from hvd_terngrad.auto import PLAN_STEP, AutoPlan
from hvd_terngrad.transports.uncoded import WIRES


def coded_steps(measured_coded: bool = False, pruned: bool = True) -> set[int]:
    """The steps auto codes every group on, where the model leaves every group uncoded and it tries its plan in
    each wire (AutoPlan: the trial's coded turns, the pruning step, the verdict step; pruned: the coded kind
    tried no more after the first pair, as NCF's is on the fast link; measured_coded: the measured steps too)."""
    auto = AutoPlan()
    auto._try([(set(), None, wire) for wire in WIRES], codes_all=False)
    trial = auto.trial
    if pruned:
        trial.left = [k for k in trial.order if k]
    return {s for s in range(trial.verdict_step + 1)
            if (measured_coded and s < PLAN_STEP) or (s >= PLAN_STEP and trial.kind(s) in (0, None))}


def run(data: Data, seed: int, workers: int, coded: set[int]) -> list[tuple[int, float]]:
    """One simulated training of the suite's recipe, the steps in `coded` coded by the paper's TernGrad (none:
    FP32); its curve of (step, test metric)."""
    method = "terngrad" if coded else "fp32"
    return train(data, method, workers, seed, coded=coded, evals_per_epoch=EVALS_PER_EPOCH)["curve"]


def _pair(job: tuple) -> tuple[list, list]:
    """One seed's two runs (FP32, then with the trial's steps coded); in a process of its own with --jobs."""
    task, seed, workers, coded = job
    torch.set_num_threads(1)
    data = Data(TASKS[task])
    return run(data, seed, workers, set()), run(data, seed, workers, coded)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="ncf", choices=[t for t in TASKS if TASKS[t].metric == "acc"])
    ap.add_argument("--seeds", default="0-15", help="first-last")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1, help="processes, a seed each at a time")
    ap.add_argument("--offset", type=int, default=0, help="the trial's coded steps this many steps later")
    ap.add_argument("--measured-coded", action="store_true", help="the measured steps (the first PLAN_STEP) "
                    "coded too, as auto coded them before it rehearsed the codec on FP32 steps")
    ap.add_argument("--unpruned", action="store_true", help="the coded kind tried in every pair of rounds, as "
                    "before the trial pruned the kinds far behind after the first pair (auto.PRUNE)")
    args = ap.parse_args(argv)
    first, last = map(int, args.seeds.split("-"))
    seeds = range(first, last + 1)
    coded = {s + args.offset for s in coded_steps(args.measured_coded, pruned=not args.unpruned)}
    print(f"{args.task}, {args.workers} workers, coded steps {sorted(coded)}", flush=True)
    todo = [(args.task, s, args.workers, coded) for s in seeds]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            pairs = list(pool.map(_pair, todo))
    else:
        pairs = list(map(_pair, todo))
    curves = dict(zip(seeds, pairs))
    target = statistics.mean(fp32[-1][1] for fp32, _ in curves.values()) - 0.5
    never = 10 ** 9

    def reached(curve):
        return next((s for s, m in curve if m >= target), never)

    later = sooner = 0
    for seed, (fp32, trial) in curves.items():
        a, b = reached(fp32), reached(trial)
        later, sooner = later + (b > a), sooner + (b < a)
        print(f"seed {seed}: target reached at step {a if a < never else '-'} (FP32), "
              f"{b if b < never else '-'} (trial coded); final {fp32[-1][1]:.2f}, {trial[-1][1]:.2f}")
    print(f"target {target:.2f}: with the trial coded, later on {later} seeds, sooner on {sooner}, of {len(curves)}; "
          f"median steps {statistics.median(reached(f) for f, _ in curves.values())} (FP32), "
          f"{statistics.median(reached(t) for _, t in curves.values())} (trial coded)")
    print("trial coded less FP32, mean over the seeds, at each evaluation's step: " + mean_gap(curves.values()))


def mean_gap(pairs, evaluations: int = 10) -> str:
    """The mean of (trial's metric - FP32's) over the (FP32 curve, trial curve) pairs at each of the first
    evaluations, as "step:difference" in pp."""
    gaps: dict[int, list[float]] = {}
    for fp32, trial in pairs:
        for (step, a), (_, b) in zip(fp32[:evaluations], trial[:evaluations]):
            gaps.setdefault(step, []).append(b - a)
    return " ".join(f"{step}:{statistics.mean(g):+.2f}" for step, g in sorted(gaps.items()))


if __name__ == "__main__":
    main()
