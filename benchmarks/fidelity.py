"""Fidelity: test accuracy of TernGrad against FP32 on digits, several seeds, with ablations.

    horovodrun -np 4 python -m benchmarks.fidelity [--seeds 0,1,2] [--epochs 12] [--json out.json]

Every method trains the same CNN (examples/digits.DigitsCNN, through examples/train_digits.run) from the same
initialization per seed; the table gives the mean and spread of the final test accuracy over seeds and the gap
to FP32 in points.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import horovod.torch as hvd
import torch

from examples.digits import DigitsCNN
from examples.train_digits import run

DEFAULT_METHODS = "fp32,terngrad,terngrad:noclip,terngrad:noshare"


def fidelity(methods: list[str], seeds: list[int], epochs: int, lr: float = 0.05) -> dict:
    out = {}
    for m in methods:
        out[m] = [run(m, seed=s, epochs=epochs, lr=lr, log=None, net=DigitsCNN)["final_acc"] for s in seeds]
    return out


def summarize(acc: dict) -> list[dict]:
    base = statistics.mean(acc["fp32"]) if "fp32" in acc else None
    rows = []
    for m, vals in acc.items():
        mean = statistics.mean(vals)
        rows.append({"method": m, "mean_acc": mean, "min": min(vals), "max": max(vals), "runs": vals,
                     "gap_pp": None if base is None else mean - base})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = summarize(fidelity(args.methods.split(","), seeds, args.epochs))
    if hvd.rank() == 0:
        print(f"digits CNN, {hvd.size()} workers, {args.epochs} epochs, seeds {seeds}")
        print("| method | mean test acc | min | max | gap to FP32 |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            gap = "" if r["gap_pp"] is None else f"{r['gap_pp']:+.2f} pp"
            print(f"| {r['method']} | {r['mean_acc']:.2f}% | {r['min']:.2f}% | {r['max']:.2f}% | {gap} |")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
