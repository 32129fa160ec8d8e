"""Long run: many TernGrad steps of a small model, reporting resident memory (RSS) growth per rank.

    horovodrun -np 2 python -m benchmarks.soak --steps 10000

RSS is read from /proc/self/statm after a warm-up; growth per step over the rest of the run shows leaks
(a leak of one gradient-sized buffer per step would be ~100 KB/step here).
"""
from __future__ import annotations

import argparse
import os
import time

import horovod.torch as hvd
import torch

import hvd_terngrad


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(steps: int, front: str = "hvd_terngrad", warmup: int = 200, samples: int = 20) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    named = list(model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if front == "stock":
        tg = hvd_terngrad.TernGrad(named, min_numel=256)
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=tg)
    else:
        tg = hvd_terngrad.TernGrad(min_numel=256)
        opt = hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    trace = []
    t0 = time.perf_counter()
    every = max(1, (steps - warmup) // samples)
    for step in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= warmup and (step - warmup) % every == 0:
            trace.append((step, rss_bytes()))
    trace.append((steps, rss_bytes()))
    (s0, r0), (s1, r1) = trace[0], trace[-1]
    return {"steps": steps, "front": front, "rss_start": r0, "rss_end": r1, "rss_max": max(r for _, r in trace),
            "growth_per_step": (r1 - r0) / max(1, s1 - s0), "seconds": time.perf_counter() - t0,
            "history_len": len(tg.stats.history)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--front", default="hvd_terngrad", choices=("hvd_terngrad", "stock"))
    args = ap.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    r = soak(args.steps, args.front)
    rows = hvd.allgather_object(r)
    if hvd.rank() == 0:
        print(f"{args.steps} steps, {hvd.size()} ranks, {args.front}: {r['seconds']:.1f} s")
        print("| rank | RSS after warm-up | RSS at end | max | growth per step |")
        print("|---:|---:|---:|---:|---:|")
        for i, q in enumerate(rows):
            print(f"| {i} | {q['rss_start'] / 2**20:.1f} MiB | {q['rss_end'] / 2**20:.1f} MiB | "
                  f"{q['rss_max'] / 2**20:.1f} MiB | {q['growth_per_step']:.1f} B |")


if __name__ == "__main__":
    main()
