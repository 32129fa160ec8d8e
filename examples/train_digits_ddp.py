"""The main job on PyTorch DDP, no Horovod: the digits FC-heavy net (examples/digits.WideDigitsNet) with DDP's own
allreduce, then with TernGrad's hook.

    torchrun --nproc_per_node 2 -m examples.train_digits_ddp          # make train-ddp
    torchrun --nproc_per_node 2 -m examples.train_digits_ddp --methods fp32,bf16,terngrad --epochs 6

Methods: fp32 (DDP's default allreduce), fp16 and bf16 (DDP's built-in compress hooks; bf16 through
hvd_terngrad.ddp.bf16_hook, which DDP also takes on gloo), powersgd (DDP's PowerSGD hook, rank 1, 2 steps of
warm-up, through hvd_terngrad.ddp.InLaunchOrder: chained as it is, it can abort a gloo job), terngrad
(hvd_terngrad.ddp.terngrad_hook, the paper's defaults) and terngrad-recommended (TernGradConfig.recommended()).
Every worker trains on its shard; rank 0 prints each epoch's test accuracy and, at the end, a table and whether
every worker holds the same parameters.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from examples.digits import WideDigitsNet, accuracy, load_data
from hvd_terngrad import TernGradConfig
from hvd_terngrad.ddp import InLaunchOrder, TernGradState, bf16_hook, in_launch_order

METHODS = ("fp32", "fp16", "bf16", "powersgd", "terngrad", "terngrad-recommended")


def wrap(method: str, model: torch.nn.Module, seed: int):
    """The DDP model of `method`, and its TernGrad state (or None)."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if method == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif method == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, random_seed=seed)
        ddp.register_comm_hook(InLaunchOrder(powerSGD_hook.powerSGD_hook, state), in_launch_order)
    elif method.startswith("terngrad"):
        cfg = TernGradConfig.recommended(seed=seed) if method == "terngrad-recommended" else TernGradConfig(seed=seed)
        state = TernGradState(model.named_parameters(), config=cfg)
        state.register(ddp)  # terngrad_hook, with its C++ path in front where it is built
        return ddp, state
    return ddp, None


def run(method: str, epochs: int, batch_size: int, lr: float, seed: int) -> dict:
    (xtr, ytr), (xte, yte) = load_data()
    rank, size = dist.get_rank(), dist.get_world_size()
    xs, ys = xtr[rank::size], ytr[rank::size]
    torch.manual_seed(seed)
    model = WideDigitsNet()
    ddp, state = wrap(method, model, seed)  # DDP broadcasts rank 0's parameters
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    steps = torch.tensor((len(ys) + batch_size - 1) // batch_size)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    t0, acc = time.perf_counter(), 0.0
    for epoch in range(epochs):
        perm = torch.randperm(len(ys), generator=g)
        for s in range(int(steps)):
            idx = perm[s * batch_size:(s + 1) * batch_size]
            opt.zero_grad()
            F.cross_entropy(ddp(xs[idx]), ys[idx]).backward()
            opt.step()
        acc = accuracy(model, xte, yte)
        if rank == 0:
            print(f"{method:<21} epoch {epoch + 1:2d}/{epochs}  test acc {acc:6.2f}%", flush=True)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sent = state.stats.last.bytes_sent if state is not None else None
    return {"method": method, "final_acc": acc, "seconds": time.perf_counter() - t0, "bytes_sent": sent,
            "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="fp32,terngrad", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    if "RANK" not in os.environ:
        ap.error("launch it with torchrun, e.g. torchrun --nproc_per_node 2 -m examples.train_digits_ddp")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    size = dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"digits, FC-heavy net, on DDP, {size} workers, {args.epochs} epochs, batch {args.batch_size}/worker\n",
              flush=True)
    results = [run(m, args.epochs, args.batch_size, args.lr, args.seed) for m in methods]
    digests = [None] * size
    dist.all_gather_object(digests, [r["digest"] for r in results])
    if dist.get_rank() == 0:
        print("\n| method | workers | final test acc | TernGrad bytes/step sent per worker | train time |\n"
              "|---|---:|---:|---:|---:|")
        for r in results:
            sent = f"{r['bytes_sent']:,}" if r["bytes_sent"] is not None else "-"
            print(f"| {r['method']} | {size} | {r['final_acc']:.2f}% | {sent} | {r['seconds']:.1f} s |")
        for k, r in enumerate(results):
            same = len({d[k] for d in digests}) == 1
            print(f"{r['method']}: parameters {'agree' if same else 'DIFFER'} across {size} workers", flush=True)
    dist.barrier()
    gc.collect()  # the DDP models and their hook states, before their process group goes
    dist.destroy_process_group()
    if any(len({d[k] for d in digests}) != 1 for k in range(len(results))):
        raise SystemExit("train_digits_ddp: the workers' parameters differ")


if __name__ == "__main__":
    main()
