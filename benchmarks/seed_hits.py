"""Where each seed's run reached the target against its own front end's FP32, results folder by results folder:
`L` at a later evaluation, `=` the same, `s` sooner, `-` one of them never. With a sign test over the seeds.

    python -m benchmarks.seed_hits results/time_to_accuracy_side_fast results/time_to_accuracy_noise_fast

Why: a run's FP32 and its other methods start from the same weights and see the same batches, so a seed's FP32
curve is the same in every run, and where it crosses the target early by luck, any method whose trajectory
parts from it (a coded step, a rounding) tends to cross later. Runs on the same seeds therefore repeat one
another's later and sooner hits (docs/notes/tta-history.md, "Fresh seeds"); they are one sample of those seeds,
not several. The sign test counts each seed once (its hits summed over the runs that have it), so that it
asks whether the method reaches the target later than FP32 on seeds in general.

Where a job trained both front ends' FP32, Horovod's is marked against DDP's (the row `fp32`): their
trajectories part only by the order in which each sums the floats, so that row is what parting alone does to
the hits, the null against which a method's own marks read (docs/notes/tta-history.md, "Fresh seeds").
"""
from __future__ import annotations

import math
from collections import defaultdict

from benchmarks.auto_kinds import read_results, with_fp32
from benchmarks.time_to_accuracy import reached_at, target

MARKS = {1: "L", 0: "=", -1: "s", None: "-"}


def hits(runs: list[dict]) -> dict:
    """(task, profile, method) -> {seed: +1 later than its front end's FP32 on the same seed, 0 the same
    evaluation, -1 sooner, None where either misses the target}, for every non-FP32 method of these runs and
    for Horovod's FP32 against DDP's, against their own target (benchmarks.time_to_accuracy.target)."""
    out: dict = defaultdict(dict)
    goals = {where: target(runs, *where) for where in {(r["task"], r["profile"]) for r in runs}}
    ddp_fp32 = {(r["task"], r["profile"], r["seed"]): r for r in runs if r["method"] == "ddp:fp32"}
    pairs = [(r, ddp_fp32.get((r["task"], r["profile"], r["seed"]))) for r in runs if r["method"] == "fp32"]
    for r, fp32 in [*with_fp32(runs), *((r, ref) for r, ref in pairs if ref is not None)]:
        if r["method"] == "local":
            continue
        where = (r["task"], r["profile"])
        goal = goals[where]
        a, b = (None, None) if goal is None else (reached_at(r, goal), reached_at(fp32, goal))
        out[(*where, r["method"])][r["seed"]] = None if a is None or b is None else (a[1] > b[1]) - (a[1] < b[1])
    return dict(out)


def sign_test(later: int, sooner: int) -> float:
    """Two-sided p-value of `later` against `sooner` where each is as likely (ties left out)."""
    n, k = later + sooner, min(later, sooner)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def table(named: list[tuple[str, list[dict]]]) -> str:
    """Markdown: per task, profile and method, a row per results folder with a mark per seed, then the seeds'
    votes (each seed's marks summed over the folders) and the sign test over them."""
    found: dict = defaultdict(dict)  # (task, profile, method) -> {folder: {seed: mark}}
    for name, runs in named:
        for key, by_seed in hits(runs).items():
            found[key][name] = by_seed
    lines = []
    for key, folders in sorted(found.items()):
        seeds = sorted({s for by_seed in folders.values() for s in by_seed})
        lines += [f"**{' '.join(key)}**, seeds {seeds[0]}-{seeds[-1]}", "",
                  "| results | " + " ".join(f"{s:>2}" for s in seeds) + " | later / same / sooner |",
                  "|---|---|---|"]
        votes: dict = defaultdict(int)
        for name, by_seed in folders.items():
            counts = [sum(m == v for m in by_seed.values()) for v in (1, 0, -1)]
            lines.append(f"| {name} | " + " ".join(f"{MARKS[by_seed[s]] if s in by_seed else ' ':>2}" for s in seeds)
                         + " | " + " / ".join(map(str, counts)) + " |")
            for s, m in by_seed.items():
                votes[s] += m or 0
        later, sooner = sum(v > 0 for v in votes.values()), sum(v < 0 for v in votes.values())
        lines += ["", f"Seeds later on balance: {later}, sooner: {sooner}, even: {len(votes) - later - sooner}; "
                      f"sign test over the seeds, p = {sign_test(later, sooner):.2f}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    print(table([(name, res["runs"]) for name, res in read_results(argv, __doc__)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
