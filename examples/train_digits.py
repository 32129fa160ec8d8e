"""Train an FC-heavy net on scikit-learn's digits (real data, bundled) with Horovod: FP32, then TernGrad.

    horovodrun -np 2 python -m examples.train_digits            # the README's main command (make train)
    horovodrun -np 4 python -m examples.train_digits --methods fp32,terngrad,terngrad:noclip --epochs 15

Methods are named as everywhere in this project (hvd_terngrad/methods.py): fp32, fp16, terngrad, and
terngrad with modifiers such as :stock (the stock hvd.DistributedOptimizer), :noclip, :noshare, :ef, :summed.

The net (examples/digits.WideDigitsNet, 3.2 M parameters, nearly all in two wide FC layers) is one whose exchange
costs more than its compute on a 1 Gbit/s link, the case TernGrad is for. Each worker trains on its shard of the
training split; every epoch rank 0 prints the test accuracy, the bytes this worker sent per step and the
compression ratio. At the end a side-by-side table compares methods.
`make train` pipes this through scripts/rank0_report.py, which shows rank 0's lines without horovodrun's
tags (the epoch lines as one progress bar per method on a terminal) and keeps each rank's output in
build/train-logs/.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from examples.digits import WideDigitsNet, accuracy, load_data
from hvd_terngrad.commcost import Link
from hvd_terngrad.methods import build_optimizer, comm_seconds, parse_method, split_of, target_from


def dense_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _say(msg: str) -> None:
    print(msg, flush=True)  # through horovodrun's pipe: unflushed lines would all come at the end


def run(method: str, seed: int = 0, epochs: int = 10, batch_size: int = 32, lr: float = 0.05,
        progress: bool = False, log=_say, net=WideDigitsNet) -> dict:
    """Train one method in an hvd.init()-ed process; returns per-epoch accuracy and traffic figures. `net` makes
    the model (the fidelity benchmark trains the smaller DigitsCNN)."""
    how = parse_method(method)
    (xtr, ytr), (xte, yte) = load_data()
    rank, size = hvd.rank(), hvd.size()
    xs, ys = xtr[rank::size], ytr[rank::size]
    torch.manual_seed(seed)
    model = net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt, tg = build_optimizer(how, model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), seed=seed)

    steps = (len(ys) + batch_size - 1) // batch_size
    steps = hvd.allreduce(torch.tensor(steps), op=hvd.Min, name=f"steps.{method}.{seed}").item()
    history = []
    clock = 0.0  # training only: the evaluations after each epoch are off the clock
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for epoch in range(epochs):
        perm = torch.randperm(len(ys), generator=g)
        sent = ratio = 0.0
        t0 = time.perf_counter()
        for s in range(steps):
            idx = perm[s * batch_size:(s + 1) * batch_size]
            opt.zero_grad()
            F.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
            if tg is not None:
                last = tg.stats.last
                sent += last.bytes_sent
                ratio += last.ratio
            else:
                nb = dense_bytes(model) // (2 if how.compression == "fp16" else 1)
                sent += nb
                ratio += dense_bytes(model) / nb
        hvd.allreduce(torch.zeros(1), name=f"epoch.{method}.{seed}")  # the epoch ends when every rank's does
        clock += time.perf_counter() - t0
        acc = accuracy(model, xte, yte)
        history.append({"epoch": epoch + 1, "test_acc": acc, "bytes_per_step": sent / steps, "ratio": ratio / steps,
                        "seconds": clock})
        if rank == 0 and log is not None:
            done = (epoch + 1) * 20 // epochs
            msg = (f"{method:<16} epoch {epoch + 1:2d}/{epochs} [{'#' * done}{'.' * (20 - done)}]  test acc "
                   f"{acc:6.2f}%  bytes/step {sent / steps:9,.0f}  ratio {ratio / steps:4.1f}x")
            # all but the last epoch as progress lines: one bar, redrawn in place, on a terminal
            log(("progress " if progress and epoch + 1 < epochs else "") + msg)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"method": method, "seed": seed, "history": history, "final_acc": history[-1]["test_acc"],
            "bytes_per_step": history[-1]["bytes_per_step"], "ratio": history[-1]["ratio"],
            "seconds": clock, "steps": steps * epochs, "dense_bytes": dense_bytes(model),
            "param_checksum": float(params.double().sum()),
            "param_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest()}


def time_to_fp32(results: list[dict]) -> tuple[float | None, dict]:
    """FP32's accuracy less 0.5 pp (the target; None without an fp32 run), and per method the training time
    to the first epoch at or above it (None where none is)."""
    ref = next((r["final_acc"] for r in results if r["method"] == "fp32"), None)
    if ref is None:
        return None, {}
    goal = target_from(ref)
    return goal, {r["method"]: next((h["seconds"] for h in r["history"] if h["test_acc"] >= goal), None)
                  for r in results}


def link_ms(method: str, size: int) -> float:
    """One step's exchange on 1 Gbit/s Ethernet by the cost model (hvd_terngrad.methods.comm_seconds), with no
    overlap: shown beside a run on localhost, where the link is free. auto is taken as the allgather."""
    how = parse_method(method)
    name = how.compression if how.compression != "terngrad" or how.transport in ("allgather", "auto") \
        else f"terngrad:{how.transport}"
    return comm_seconds(name, split_of(WideDigitsNet()), size, Link()) * 1e3


def verdict(results: list[dict], free_link: bool) -> str:
    """What the table says about the link: each TernGrad method's time to FP32's accuracy against FP32's."""
    goal, reach = time_to_fp32(results)
    if goal is None:
        return ""
    ref = reach.get("fp32")
    lines = []
    for m, t in reach.items():
        if not m.startswith("terngrad"):
            continue
        if t is None:
            lines.append(f"{m} did not reach FP32's accuracy less 0.5 pp ({goal:.2f}%) in these epochs.")
        elif ref:
            lines.append(f"{m} reached FP32's accuracy less 0.5 pp in {t:.1f} s of training against FP32's "
                         f"{ref:.1f} s: {ref / t:.2f}x {'sooner' if t <= ref else 'the speed'}.")
    where = ("The workers shared this machine over localhost, where the link is free, so coding costs more than "
             "it saves: run it on an emulated 1 Gbit/s link (make train as root, with network namespaces) to see "
             "the exchange." if free_link else
             f"This net sends {results[0]['dense_bytes']:,} bytes of fp32 gradient a worker a step, which cost "
             "more on this link than its compute; on a model whose exchange is cheap (the fast link, or a few "
             "hundred KB a step) TernGrad's coding does not pay: docs/time-to-accuracy.md.")
    return "\n".join(lines + [where])


def table(results: list[dict], workers: int, free_link: bool = False) -> str:
    goal, reach = time_to_fp32(results)
    more = " step here | predicted on 1 Gbit/s |" if free_link else ""
    rows = ["| method | workers | final test acc | bytes/step sent per worker | ratio | train time | "
            "time to FP32's accuracy |" + more, "|---|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * free_link]
    for r in results:
        t = reach.get(r["method"])
        to = "" if goal is None else ("not reached" if t is None else f"{t:.1f} s")
        step = 1e3 * r["seconds"] / r["steps"]
        rows.append(f"| {r['method']} | {workers} | {r['final_acc']:.2f}% | {r['bytes_per_step']:,.0f} | "
                    f"{r['ratio']:.1f}x | {r['seconds']:.1f} s | {to} |"
                    + (f" {step:.1f} ms | {step + link_ms(r['method'], workers):.1f} ms |" if free_link else ""))
    if goal is not None:
        rows.append(f"\nTimes are training only (evaluation off the clock); FP32's accuracy less 0.5 pp: "
                    f"{goal:.2f}%, checked after each epoch.")
    if free_link:
        rows.append("The workers ran on localhost, where the link is free. 'predicted on 1 Gbit/s' adds to each "
                    "step here the exchange the cost model gives for 1 Gbit/s Ethernet (hvd_terngrad/commcost.py), "
                    "with no overlap.")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="fp32,terngrad", help="comma-separated method names (hvd_terngrad/methods.py)")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--free-link", action="store_true",
                    help="the workers share a machine (no emulated link): add the cost model's 1 Gbit/s step")
    args = ap.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        try:
            parse_method(m)
        except ValueError as exc:
            ap.error(str(exc))
    if hvd.rank() == 0:
        print(f"digits, FC-heavy net, {hvd.size()} workers, {args.epochs} epochs, batch {args.batch_size}/worker\n",
              flush=True)
    results = [run(m, seed=args.seed, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, progress=True)
               for m in methods]
    # every worker must end with the same parameters: compare their digests
    digests = hvd.allgather_object([r["param_sha256"] for r in results], name="train_digits.params")
    if hvd.rank() == 0:
        print("\n" + table(results, hvd.size(), args.free_link), flush=True)
        print(verdict(results, args.free_link), flush=True)
        for k, r in enumerate(results):
            same = len({d[k] for d in digests}) == 1
            print(f"{r['method']}: parameters {'agree' if same else 'DIFFER'} across {hvd.size()} workers "
                  f"(sha256 {r['param_sha256'][:16]})", flush=True)
        if any(len({d[k] for d in digests}) != 1 for k in range(len(results))):
            raise SystemExit("train_digits: the workers' parameters differ")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
