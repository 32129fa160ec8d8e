"""Time to accuracy on the emulated cluster: how long each method takes to train a model as good as FP32's.

    python -m benchmarks.time_to_accuracy                      # lenet and ncf, 4 nodes, ethernet-1g and fast, 2 seeds
    python -m benchmarks.time_to_accuracy --tasks lenet --profiles ethernet-1g --seeds 0 --methods ddp:fp32,terngrad
    python -m benchmarks.time_to_accuracy --report-only        # the table and plots again from --out's JSON

Real training on real data (the fidelity suite's tasks and recipes, benchmarks/fidelity_suite.py), one rank
per emulated node (benchmarks/cluster.py). One job per (profile, task, seed) trains every method in turn, from
the same initial weights and the same batches; the order turns with the seed (_in_turn). The clock is rank
0's and covers the training steps only: at each evaluation it stops, rank 0 evaluates, every rank meets at a
barrier, and it starts again.

The target is FP32's final metric (the mean over DDP's and Horovod's FP32 and over the seeds) minus 0.5 pp
for accuracy, or plus 1% for bits per character. A run's time to target is the clock at the first evaluation
that reaches it. Each method's figure is the median over the seeds, with their range; a method that misses
the target on any seed is reported as such.

The ceiling: `local` trains in the same job with no exchange at all (each rank steps on its own gradient; one
one-element allreduce a step keeps the ranks in step). Its own metric means nothing, but its clock at the step
where FP32 first reached the target is how soon any method could get there if it converged step for step as
FP32 does and moving gradients cost nothing. Its row's "vs FP32" is thus the most any compression can buy on
this cluster and task, and every method's "of ceiling" is that ideal time over its own.

Why these tasks: the network has to matter. On one core per node, lenet (LeNet-5 on MNIST, 0.43 M
parameters) computes a step in about 4 ms and an FP32 allreduce of its 1.7 MB takes about 20 ms at 1 Gbit/s;
ncf (NeuMF on implicit feedback, 0.10 M parameters) computes in under 1 ms, so its steps are latency and
bytes. The char LM and the ResNet compute 30-45 ms a step for 0.7-1 MB of gradient; there the link hardly
matters, and `--tasks charlm` measures that case.

Writes --out/time_to_accuracy.json (every run: recipe, curve of (seconds, step, metric), bytes),
time_to_accuracy.md and tta_<task>.png (metric against wall-clock time, a line per method and seed).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cluster import init_gloo
from hvd_terngrad.methods import target_from

METHODS = ("local", "ddp:fp32", "fp32", "fp16", "ddp:bf16", "ddp:powersgd", "ddp:powersgd4", "terngrad",
           "terngrad:noclip:ef:block64", "terngrad:sharded-ternary", "terngrad:sharded-ternary:noclip:ef:block64",
           "ddp:terngrad:sharded-ternary", "ddp:terngrad:sharded-ternary:noclip:ef:block64")
FP32 = ("ddp:fp32", "fp32")
CEILING = "local"  # no exchange: its clock at FP32's steps to the target (module docstring)
EVALS_PER_EPOCH = 8


# ---------------------------------------------------------------------------------------------- on the ranks
def _timed_run(data, method: str, seed: int, rank: int, size: int, max_steps: int | None = None) -> dict:
    """One method's training on this rank; on rank 0 its curve of (training seconds, step, metric)."""
    import horovod.torch as hvd
    import torch

    from benchmarks.fidelity_suite import base_optimizer, plan, schedule
    from hvd_terngrad.methods import build_ddp, build_optimizer, parse_method, powersgd_start

    task, m = data.task, parse_method(method)
    torch.manual_seed(seed)
    model = data.model()
    per_epoch, total = plan(task, data.n_train, size)
    total = total if max_steps is None else min(total, max_steps)
    exclude = (task.classifier,)  # the recipe's: the classifier stays in float under TernGrad
    if m.ddp:
        net, opt, tg = build_ddp(m, model, task.lr, seed, exclude=exclude, powersgd_start=powersgd_start(total),
                                 optimizer=lambda params: base_optimizer(task, params))
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt, tg = build_optimizer(m, model, base_optimizer(task, model.parameters()), seed, exclude=exclude)
        net = model
    sched = schedule(getattr(opt, "base", opt), task, total)  # local's lockstep wrapper: the SGD it steps
    g = torch.Generator().manual_seed(10_000 + seed)  # the same batches on every rank and for every method
    every = max(1, per_epoch // EVALS_PER_EPOCH)
    clock, step, curve = 0.0, 0, [(0.0, 0, data.evaluate(model) if rank == 0 else None)]
    while step < total:
        order = torch.randperm(data.n_train, generator=g)
        for b in range(min(per_epoch, total - step)):
            idx = order[b * task.batch * size: (b + 1) * task.batch * size].view(size, task.batch)[rank]
            t0 = time.perf_counter()
            opt.zero_grad()
            data.loss(net, idx).backward()
            opt.step()
            sched.step()
            clock += time.perf_counter() - t0
            step += 1
            if step % every == 0 or step == total:  # off the clock: rank 0 evaluates, then all meet
                curve.append((clock, step, data.evaluate(model) if rank == 0 else None))
                hvd.allreduce(torch.zeros(1), name="tta.barrier")
    auto = tg.pipeline.auto if tg is not None and m.transport == "auto" else None
    return {"method": method, "seed": seed, "steps": total, "seconds": clock, "final": curve[-1][2],
            "curve": curve, "powersgd_start": powersgd_start(total) if m.compression == "powersgd" else None,
            "auto": None if auto is None else auto.summary(),  # transport="auto": what it tried and kept
            "cpp_hook": getattr(tg, "native", None)}  # the DDP hook: whether its C++ path averaged at the end


def worker(args) -> int:
    """Every rank: each method in turn; rank 0 appends a JSON line per run to --json."""
    import dataclasses
    import gc

    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    from benchmarks.fidelity_suite import TASKS, Data

    hvd.init()
    torch.set_num_threads(1)
    init_gloo(hvd)
    data = Data(TASKS[args.task])
    for method in args.methods.split(","):
        run = _timed_run(data, method, args.seed, hvd.rank(), hvd.size(), args.max_steps)
        if hvd.rank() == 0:
            run.update(task=args.task, workers=hvd.size(), recipe=dataclasses.asdict(data.task))
            print(f"{args.task} seed {args.seed} {method}: {run['final']:.2f} after {run['seconds']:.1f} s",
                  flush=True)
            with open(args.json, "a") as f:
                f.write(json.dumps(run) + "\n")
    dist.barrier()
    gc.collect()  # the DDP models before their process group (an abort at exit otherwise)
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------- report
def _lower_is_better(task: str) -> bool:
    from benchmarks.fidelity_suite import TASKS

    return TASKS[task].metric != "acc"


def target(runs: list[dict], task: str, profile: str) -> float | None:
    """target_from FP32's final metric (the mean over the FP32 methods and seeds)."""
    finals = [r["final"] for r in runs if (r["task"], r["profile"], r["method"]) in
              {(task, profile, m) for m in FP32} and math.isfinite(r["final"])]
    if not finals:
        return None
    ref = statistics.mean(finals)
    return target_from(ref, _lower_is_better(task))


def reached_at(run: dict, goal: float) -> tuple[float, int] | None:
    """(clock, step) at the first evaluation that reaches `goal`, or None."""
    lower = _lower_is_better(run["task"])
    for seconds, step, metric in run["curve"]:
        if metric is not None and math.isfinite(metric) and (metric <= goal if lower else metric >= goal):
            return seconds, step
    return None


def time_to(run: dict, goal: float) -> float | None:
    """The clock at the first evaluation that reaches `goal`, or None."""
    at = reached_at(run, goal)
    return None if at is None else at[0]


def ceiling_times(here: list[dict], goal: float | None, fp32: str) -> list[float | None]:
    """Per seed of the ceiling's runs: its clock at the step where `fp32` first reached `goal` in the same job
    (every method of a job evaluates at the same steps); None where that seed's FP32 did not reach it."""
    times = []
    for run in (r for r in here if r["method"] == CEILING):
        ref = next((r for r in here if r["method"] == fp32 and r["seed"] == run["seed"]), None)
        at = None if ref is None or goal is None else reached_at(ref, goal)
        clock = {step: seconds for seconds, step, _ in run["curve"]}
        times.append(None if at is None else clock.get(at[1]))
    return times


def summarize(runs: list[dict]) -> list[dict]:
    """Per (task, profile, method): time to target (median and range over seeds), final metric, speedups."""
    rows = []
    for task, profile in sorted({(r["task"], r["profile"]) for r in runs}):
        goal = target(runs, task, profile)
        here = [r for r in runs if (r["task"], r["profile"]) == (task, profile)]
        methods = [m for m in METHODS if any(r["method"] == m for r in here)]
        methods += sorted({r["method"] for r in here} - set(methods))
        mine = {m: [r for r in here if r["method"] == m] for m in methods}
        group = [_row(task, profile, m, goal, mine[m], [time_to(r, goal) if goal is not None else None
                                                        for r in mine[m]]) for m in methods if m != CEILING]
        if CEILING in mine:  # timed at the faster FP32's steps, the FP32 that _speedups divides by
            fp32 = min((r for r in group if r["method"] in FP32 and r["tta"] is not None), key=lambda r: r["tta"],
                       default=None)
            times = ceiling_times(here, goal, fp32["method"]) if fp32 else [None] * len(mine[CEILING])
            group.insert(methods.index(CEILING), _row(task, profile, CEILING, goal, mine[CEILING], times))
        _speedups(group)
        rows += group
    return rows


def _row(task: str, profile: str, method: str, goal: float | None, mine: list[dict],
         times: list[float | None]) -> dict:
    reached = [t for t in times if t is not None]
    return {"task": task, "profile": profile, "method": method, "target": goal, "seeds": len(mine),
            "reached": len(reached), "tta": statistics.median(reached) if len(reached) == len(mine) else None,
            "tta_min": min(reached, default=None), "tta_max": max(reached, default=None),
            # the ceiling's model learns alone on rank 0's batches: its metric says nothing
            "final": None if method == CEILING else statistics.mean(r["final"] for r in mine),
            "seconds": statistics.median(r["seconds"] for r in mine)}


def _speedups(rows: list[dict]) -> None:
    """Each row's speedup against the faster FP32 and against the fastest method that is not TernGrad, and the
    ceiling's time over its own."""
    def best(pick):
        times = [r["tta"] for r in rows if pick(r["method"]) and r["tta"] is not None]
        return min(times, default=None)

    fp32 = best(lambda m: m in FP32)
    peer = best(lambda m: "terngrad" not in m and m not in FP32 and m != CEILING)
    ceiling = best(lambda m: m == CEILING)
    for r in rows:
        ok = r["tta"] is not None
        r["vs_fp32"] = fp32 / r["tta"] if ok and fp32 else None
        r["vs_peer"] = peer / r["tta"] if ok and peer else None
        r["of_ceiling"] = ceiling / r["tta"] if ok and ceiling else None


def table(rows: list[dict]) -> str:
    def f(v, spec):
        return "" if v is None else format(v, spec)

    def times(v):
        return f"{f(v, '.2f')}{'×' if v else ''}"

    lines = ["| task | profile | method | time to target (s), median | range | reached | final | training (s) | "
             "vs FP32 | vs best peer | of ceiling |", "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        span = f"{r['tta_min']:.1f}–{r['tta_max']:.1f}" if r["reached"] else ""
        tta = f(r["tta"], ".1f") or "not reached"
        name = "local: no exchange, at FP32's steps (ceiling)" if r["method"] == CEILING else r["method"]
        lines.append(f"| {r['task']} | {r['profile']} | {name} | {tta} | {span} | "
                     f"{r['reached']}/{r['seeds']} | {f(r['final'], '.2f')} | {r['seconds']:.1f} | "
                     f"{times(r['vs_fp32'])} | {times(r['vs_peer'])} | {f(r['of_ceiling'], '.2f')} |")
    targets = sorted({(r["task"], r["profile"], r["target"]) for r in rows if r["target"] is not None})
    lines += ["", "Targets: " + "; ".join(f"{t} on {p}: {g:.2f}" for t, p, g in targets) + "."]
    if any(r["method"] == CEILING for r in rows):
        lines += ["", "The ceiling trains with no exchange; its time is its clock at the step where the faster FP32 "
                  "first reached the target. Its \"vs FP32\" is the most any compression can buy here; \"of "
                  "ceiling\" is its time over each method's."]
    return "\n".join(lines)


def plot(runs: list[dict], out: Path, rows: list[dict]) -> None:
    """A figure per task, a panel per profile: each run's metric against its clock, the target, and the ceiling's
    time to it as a vertical line (its own metric is not plotted: it says nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.fidelity_suite import TASKS, YLABEL

    for task in sorted({r["task"] for r in runs}):
        profiles = sorted({r["profile"] for r in runs if r["task"] == task})
        fig, axes = plt.subplots(1, len(profiles), figsize=(6.5 * len(profiles), 4.2), squeeze=False)
        for ax, profile in zip(axes[0], profiles):
            here = [r for r in runs if (r["task"], r["profile"]) == (task, profile) and r["method"] != CEILING]
            colors = {}  # tab20: up to 20 methods in colours of their own (the default cycle has 10)
            for r in here:
                c = colors.setdefault(r["method"], plt.get_cmap("tab20")(len(colors) % 20))
                pts = [(s, v) for s, _, v in r["curve"] if v is not None]
                ax.plot(*zip(*pts), color=c, lw=1.2, alpha=0.85, label=r["method"] if r["seed"] == min(
                    x["seed"] for x in here if x["method"] == r["method"]) else None,
                    ls="-" if "terngrad" in r["method"] else "--")
            goal = target(runs, task, profile)
            if goal is not None:
                ax.axhline(goal, color="k", lw=0.8, ls=":", label="target")
            for r in rows:
                if (r["task"], r["profile"], r["method"]) == (task, profile, CEILING) and r["tta"] is not None:
                    ax.axvline(r["tta"], color="grey", lw=1.0, ls="-.", label="no exchange, FP32's steps (ceiling)")
            ax.set_title(f"{task}, {here[0]['workers']} nodes, {profile}")
            ax.set_xlabel("training wall-clock (s), evaluation excluded")
            ax.set_ylabel(YLABEL[TASKS[task].metric])
            lo = [v for r in here for _, _, v in r["curve"][len(r["curve"]) // 3:] if v is not None]
            if lo and not _lower_is_better(task):
                ax.set_ylim(max(0.0, min(lo) - 2), max(lo) + 1)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=6.5)
        fig.tight_layout()
        fig.savefig(out / f"tta_{task}.png", dpi=100)
        plt.close(fig)


def report(runs: list[dict], out: Path, failures: list[dict]) -> str:
    rows = summarize(runs)
    text = table(rows)
    if failures:
        text += "\n\nFailed jobs (their error's end in time_to_accuracy.json):\n\n" + "\n".join(
            f"* {f['task']} {f['profile']} seed {f['seed']}: {f['reason']}" for f in failures)
    (out / "time_to_accuracy.md").write_text(text + "\n")
    if runs:
        plot(runs, out, rows)
    return text


# ---------------------------------------------------------------------------------------------- driver
def _job(cluster, task: str, seed: int, methods: str, timeout: float) -> tuple[list[dict], str | None]:
    """One job on the cluster: its runs, and the reason it failed (None when it did not)."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        path = Path(f.name)
    argv = [sys.executable, "-m", "benchmarks.time_to_accuracy", "worker", "--task", task, "--seed", str(seed),
            "--methods", methods, "--json", str(path)]
    try:
        res = cluster.run(argv, timeout=timeout)
        reason = None if res.returncode == 0 else (f"exit {res.returncode}: {_error_line(res.stdout)}\n"
                                                   f"{res.stdout[-3000:]}")
    except TimeoutError as exc:
        reason = str(exc)[-3000:]
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.unlink(missing_ok=True)
    return runs, reason


def _in_turn(methods: list[str], seed: int) -> list[str]:
    """The order in which a job trains its methods: rotated by the seed. A job's processes carry state from one
    method to the next (the allocator, threads, process groups), and a slow spell of the machine lasts longer
    than one run; over the seeds, each method takes a different place, so neither falls on one method alone."""
    k = seed % len(methods)
    return methods[k:] + methods[:k]


def _error_line(output: str) -> str:
    """The line that says what went wrong: the last that names an error, else the last one."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    named = [line for line in lines if "Error:" in line or "error:" in line]
    return (named or lines or ["no output"])[-1][-300:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="one job's ranks (the driver starts them on the cluster)")
    w.add_argument("--task", required=True)
    w.add_argument("--seed", type=int, required=True)
    w.add_argument("--methods", required=True)
    w.add_argument("--json", required=True)
    w.add_argument("--max-steps", type=int, help="stop there (a smoke test), whatever the recipe says")
    ap.add_argument("--tasks", default="lenet,ncf")
    ap.add_argument("--profiles", default="ethernet-1g,fast")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per job (one task, seed and profile)")
    ap.add_argument("--out", default="results/time_to_accuracy")
    ap.add_argument("--append", action="store_true", help="keep --out's runs, replacing those run again")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        return worker(args)
    from benchmarks.cluster import PROFILES, ClusterUnavailable, EmulatedCluster
    from hvd_terngrad.methods import parse_method

    methods = args.methods.split(",")
    for m in methods:
        parse_method(m)  # a bad name fails now
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = json.loads((out / "time_to_accuracy.json").read_text()) if args.append or args.report_only else {}
    runs, failures = saved.get("runs", []), saved.get("failures", [])
    if not args.report_only:
        try:
            for profile in args.profiles.split(","):
                with EmulatedCluster(args.nodes, PROFILES[profile]) as cluster:
                    for task in args.tasks.split(","):
                        for seed in [int(s) for s in args.seeds.split(",")]:
                            new, reason = _job(cluster, task, seed, ",".join(_in_turn(methods, seed)), args.timeout)
                            for r in new:
                                r["profile"] = profile
                                print(f"{profile:>11} {task} seed {seed} {r['method']:<44} final {r['final']:.2f}, "
                                      f"{r['seconds']:.1f} s of training", flush=True)
                            key = {(r["task"], r["profile"], r["method"], r["seed"]) for r in new}
                            runs = [r for r in runs if (r["task"], r["profile"], r["method"], r["seed"]) not in key]
                            runs += new
                            # a job that ran through supersedes an earlier failure of the same task and seed
                            failures = [f for f in failures if reason or (f["task"], f["profile"], f["seed"]) !=
                                        (task, profile, seed)]
                            if reason:
                                failures.append({"task": task, "profile": profile, "seed": seed,
                                                 "reason": reason.splitlines()[0], "error": reason})
                                print(f"{profile} {task} seed {seed}: FAILED, {reason.splitlines()[0]}")
                            (out / "time_to_accuracy.json").write_text(json.dumps(
                                {"nodes": args.nodes, "runs": runs, "failures": failures}))
        except ClusterUnavailable as exc:
            print(f"time_to_accuracy: cannot emulate a cluster here: {exc}", file=sys.stderr)
            return 2
    print(report(runs, out, failures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
