"""The median step of each method on a fidelity-suite task (and its mean, p90 and p99), with TernGrad's phase
times: where a front end's own time goes, beside Horovod's and DDP's FP32.

    python -m benchmarks.cluster run --nodes 4 --profile fast -- \\
        python -m benchmarks.step_probe --task ncf --methods fp32,float,terngrad:auto,ddp:fp32,ddp:terngrad:auto

Methods are named as everywhere (hvd_terngrad/methods.py), plus `float`: hvd_terngrad's optimizer with every
tensor left in float, nothing coded (the front end's own cost), `ddp:python`: DDP FP32 through torch's own
Python `allreduce_hook` (what any Python hook costs against DDP's C++ allreduce), and `ddp:fp16c`: DDP with
torch's built-in fp16 compression hook, in C++ (what half the bytes buy DDP with no Python on the way). Three
suffixes on a Horovod TernGrad method (or `float`) change one of its costs, to measure it, not to train
with: `+unchecked` leaves its float averages unchecked (on_nonfinite="propagate"), `+naps` makes its waits
nap 1 ms between polls from the start, and `+spins` makes them spin to the end, as hvd.synchronize() does,
where they spin 20 ms and then nap (hvd_terngrad.collectives). A method named twice runs twice;
`fp32,terngrad:auto,terngrad:auto+unchecked,terngrad:auto+unchecked,terngrad:auto,fp32` puts them side by
side in one job, each order both ways. --interleave builds every method first and then takes one step of each
in turn, so that the machine's drift over a job (its steps moved by 10-20% between methods run one after
another) falls on every method alike. --uncoded fp32|fp16|bf16 puts transport="auto"'s plan with every group
uncoded in that wire in force from the first planned step, untried (the wire's own cost, beside Horovod's fp16
or FP32, without the trial's choice; bf16 on the DDP hook alone); on one method, the suffix `+coded`, `+fp32`,
`+fp16` or `+bf16` puts that kind of the trial in force for it alone (every group coded as the model says, or
every group uncoded in the wire), so that `ddp:fp32,ddp:terngrad:auto+coded,ddp:terngrad:auto+fp32,
ddp:terngrad:auto+bf16 --interleave` times each
kind auto can keep, side by side, over more steps than its trial has. Each method trains --steps steps on a
fixed batch per rank; the median is over all but the first --warmup (50). Rank 0 prints a line per method;
--early N adds each method's first N steps, one by one (where a trial's steps and a first step's set-up cost
show).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from contextlib import contextmanager

from benchmarks.cluster import init_gloo

SUFFIXES = ("+unchecked", "+naps", "+spins")
WIRES = ("fp32", "fp16", "bf16")  # transports.uncoded.UNCODED's names, kept here so that this module needs no torch
KINDS = ("+coded", *("+" + w for w in WIRES))  # auto's kind forced (any front end's transport="auto"; bf16: DDP's)
EXTRA = ("float", "ddp:python", "ddp:fp16c")  # the methods this probe adds to hvd_terngrad.methods


def build(method: str, model, data):
    """(module to call, optimizer, TernGrad's compressor or hook state or None)."""
    import torch

    import hvd_terngrad
    from hvd_terngrad.methods import build_ddp, build_optimizer, parse_method

    method, suffixes = _suffixes(method)
    options = {"on_nonfinite": "propagate"} if "+unchecked" in suffixes else {}
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if method in ("ddp:python", "ddp:fp16c"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        module = torch.nn.parallel.DistributedDataParallel(model)
        if method == "ddp:python":
            module.register_comm_hook(None, default_hooks.allreduce_hook)
        else:  # torch's fp16 compression in C++: what a C++ path buys the hook's fp16 plan
            module._register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.FP16_COMPRESS)
        return module, torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9), None
    if method == "float":
        tg = hvd_terngrad.TernGrad(min_numel=2**62, **options)
        return model, hvd_terngrad.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                        compression=tg), tg
    m = parse_method(method)
    if m.ddp:
        return build_ddp(m, model, 0.01, 0, momentum=0.9, exclude=(data.task.classifier,))
    opt, tg = build_optimizer(m, model, sgd, 0, exclude=(data.task.classifier,), **options)
    return model, opt, tg


def _suffixes(method: str) -> tuple[str, list[str]]:
    base, *rest = method.split("+")
    return base, [f"+{s}" for s in rest]


def _ours(m) -> bool:
    """Whether a parsed method is hvd_terngrad's optimizer (what the suffixes change)."""
    return m.compression == "terngrad" and not (m.ddp or m.stock)


def check_methods(methods: list[str]) -> None:
    """ValueError naming the first method that is not known, or whose suffixes are unknown or on a method they
    do not change."""
    from hvd_terngrad.methods import parse_method

    for method in methods:
        base, suffixes = _suffixes(method)
        m = None if base in EXTRA else parse_method(base)
        kinds = [x for x in suffixes if x in KINDS]
        suffixes = [x for x in suffixes if x not in KINDS]
        if any(x not in SUFFIXES for x in suffixes):
            raise ValueError(f"{method}: the suffixes are {', '.join(SUFFIXES + KINDS)}")
        if suffixes and (base.startswith("ddp:") and m is None or m is not None and not _ours(m)):
            raise ValueError(f"{method}: {', '.join(SUFFIXES)} go on hvd_terngrad's optimizer only")
        if len(kinds) > 1 or kinds and (m is None or m.transport != "auto"):
            raise ValueError(f"{method}: one of {', '.join(KINDS)}, on a method with transport auto")


@contextmanager
def _waits(method: str):
    """For this method's steps: with +naps, hvd_terngrad's waits nap 1 ms between polls from the first poll on;
    with +spins, they spin to the end (hvd.synchronize()'s way)."""
    import hvd_terngrad.collectives as coll

    suffixes = _suffixes(method)[1]
    if "+naps" not in suffixes and "+spins" not in suffixes:
        yield
        return
    saved = coll._SPIN_S, coll._POLLS_PER_CLOCK, coll._NAP_FRACTION, coll._NAP_MAX_S
    if "+naps" in suffixes:
        coll._SPIN_S, coll._POLLS_PER_CLOCK, coll._NAP_FRACTION, coll._NAP_MAX_S = 0.0, 1, 1e-9, 1e-3
    else:
        coll._SPIN_S = float("inf")
    try:
        yield
    finally:
        coll._SPIN_S, coll._POLLS_PER_CLOCK, coll._NAP_FRACTION, coll._NAP_MAX_S = saved


class Wide:
    """--task wide: four 2048×2048 layers and a classifier (16.8M parameters: three of DDP's 25 MB buckets) on
    a fixed random batch of 8 a rank. The step's time only, where a pass over a bucket costs more than an op's
    dispatch: a stand-in for a large model, which the fidelity suite has not."""

    class task:  # noqa: N801  (as fidelity_suite's Task)
        name, batch, classifier = "wide", 8, "4.*"

    def model(self):
        import torch

        return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)], torch.nn.Linear(2048, 10))

    def loss(self, net, idx):
        import torch

        g = torch.Generator().manual_seed(int(idx[0]))
        x, y = torch.randn(len(idx), 2048, generator=g), torch.randint(0, 10, (len(idx),), generator=g)
        return torch.nn.functional.cross_entropy(net(x), y)


_FORCED = [None]  # the kind forced on the step running now (_Run.step): "coded", a wire, or None


def _force_kinds() -> None:
    """From now on, an AutoPlan planning on the step of a method with a kind forced (KINDS, --uncoded) puts
    that kind in force at once, untried; the others plan and try as they would."""
    import hvd_terngrad.auto as auto

    trial = auto.AutoPlan._plan

    def plan(self, size, link, int8):
        kind = _FORCED[0]
        if kind is None:
            return trial(self, size, link, int8)
        self._try([(set(), None, "fp32" if kind == "coded" else kind)], codes_all=False)
        self.kept, self.steps = (None if kind == "coded" else 0), self.trial.verdict_step

    auto.AutoPlan._plan = plan


class _Run:
    """One method's model, optimizer and step times."""

    def __init__(self, method: str, data, hvd, uncoded=None):
        import torch

        torch.manual_seed(0)
        model = data.model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.method, self.data = method, data
        kinds = [x[1:] for x in _suffixes(method)[1] if x in KINDS]
        self.kind = kinds[0] if kinds else uncoded  # auto's kind forced (_force_kinds), or None
        self.net, self.opt, self.tg = build(method, model, data)
        self.times, self.cpu = [], []

    def step(self, idx) -> None:
        _FORCED[0] = self.kind
        with _waits(self.method):
            t0, c0 = time.perf_counter(), (time.thread_time(), time.process_time())
            self.opt.zero_grad()
            self.data.loss(self.net, idx).backward()
            self.opt.step()
            self.times.append(time.perf_counter() - t0)
            self.cpu.append((time.thread_time() - c0[0], time.process_time() - c0[1]))

    def report(self, args) -> str:
        """Rank 0's line: the step's median, mean and tail past the warm-up, its CPU, and TernGrad's phases."""
        steps, cpus = self.times[args.warmup:], self.cpu[args.warmup:]  # past the first steps' warm-up
        q = statistics.quantiles(steps, n=100)
        line = (f"{args.task} {self.method}: median step {1e3 * statistics.median(steps):.2f} ms, mean "
                f"{1e3 * statistics.mean(steps):.2f} ms, p90 / p99 {1e3 * q[89]:.2f} / {1e3 * q[98]:.2f} ms; "
                f"CPU a step {1e3 * statistics.mean(c[0] for c in cpus):.2f} ms in the training thread, "
                f"{1e3 * statistics.mean(c[1] for c in cpus):.2f} ms in the process")
        stats = getattr(self.tg, "stats", None)
        if stats is not None and stats.history:
            h = stats.history[-len(steps):]  # the same steps (the history keeps the last 1,000)
            line += "; TernGrad's encode / waits / decode " + " / ".join(
                f"{1e3 * statistics.mean(getattr(s, k) for s in h):.2f}" for k in
                ("time_encode", "time_comm", "time_decode")) + " ms"
        auto = getattr(getattr(self.tg, "pipeline", None), "auto", None)
        if auto is not None:
            line += f"; auto {auto.summary()}"
        if getattr(self.tg, "native", False):
            line += "; the DDP hook's C++ path"
        if args.early:
            line += f"\n  its first {args.early} steps (ms): " + " ".join(f"{1e3 * t:.1f}" for t in
                                                                      self.times[:args.early])
        return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="ncf", help="a fidelity-suite task, or `wide` (Wide)")
    ap.add_argument("--methods", default="fp32,float,terngrad:auto")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50, help="the first steps, left out of every figure")
    ap.add_argument("--interleave", action="store_true", help="build every method first, then take one step "
                    "of each in turn: the machine's drift over a job then falls on all of them alike")
    ap.add_argument("--early", type=int, default=0, help="also print each method's first N steps, one by one")
    ap.add_argument("--uncoded", choices=WIRES,
                    help="auto: every group uncoded in this wire, untried (bf16: the DDP hook's)")
    ap.add_argument("--spin-s", type=float, help="how long a bounded wait spins before it naps "
                    "(hvd_terngrad.collectives._SPIN_S), to measure that choice")
    args = ap.parse_args(argv)
    if args.steps < args.warmup + 2:  # a median and quantiles need two steps past the warm-up
        ap.error(f"--steps {args.steps}: at least --warmup + 2 ({args.warmup + 2})")
    methods = args.methods.split(",")
    try:
        check_methods(methods)
    except ValueError as exc:
        ap.error(str(exc))
    _force_kinds()  # where a method has no kind forced, auto plans its trial as it would
    if args.spin_s is not None:
        import hvd_terngrad.collectives

        hvd_terngrad.collectives._SPIN_S = args.spin_s

    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    from benchmarks.fidelity_suite import TASKS, Data

    hvd.init()
    torch.set_num_threads(1)
    init_gloo(hvd)
    data = Wide() if args.task == "wide" else Data(TASKS[args.task])
    idx = torch.arange(data.task.batch * hvd.rank(), data.task.batch * (hvd.rank() + 1))
    for group in [methods] if args.interleave else [[method] for method in methods]:
        runs = [_Run(method, data, hvd, args.uncoded) for method in group]
        for _ in range(args.steps):
            for run in runs:  # interleaved: one step of each method in turn
                run.step(idx)
        if hvd.rank() == 0:
            print("\n".join(run.report(args) for run in runs), flush=True)
        del runs  # DDP modules before their process group (an abort at exit otherwise)
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
