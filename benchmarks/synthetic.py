"""Synthetic training throughput with FP32, fp16 or TernGrad gradients (in the style of Horovod's
pytorch_synthetic_benchmark.py), on the models of benchmarks/models.py.

    horovodrun -np 2 python -m benchmarks.synthetic --model alexnet --method terngrad

Methods are named as in hvd_terngrad/methods.py (fp32, fp16, terngrad, terngrad:summed, terngrad:stock, ...).
Prints img/sec per worker (mean +- 1.96 sigma over iterations) and in total, as Horovod's benchmark does,
and for every method the gradient bytes each worker sends per step and the CPU time rank 0 spends on one
(all its threads: where nodes share cores, what one worker spends is taken from the others).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from benchmarks.cluster import init_gloo
from benchmarks.models import MODELS, build, synthetic_batch
from hvd_terngrad.methods import Method, build_ddp, build_optimizer, parse_method


def bytes_per_step(model, method: Method, tg) -> float:
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    if method.compression == "local":
        return 0.0
    if method.compression == "powersgd":  # rank r: P and Q of each matrix (r (rows + columns)), vectors as they are
        return sum(4 * method.rank * (p.shape[0] + p.numel() // p.shape[0]) if p.dim() > 1
                   else p.numel() * p.element_size() for p in model.parameters())
    if method.compression == "fp32":
        return dense
    if method.compression in ("fp16", "bf16"):
        return dense / 2
    return tg.stats.last.bytes_sent


def iface_bytes(iface: str | None) -> tuple[int, int]:
    """(tx, rx) byte counters of a network interface, or (0, 0) when none is given or it does not exist."""
    if not iface:
        return 0, 0
    base = Path("/sys/class/net") / iface / "statistics"
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except OSError:
        return 0, 0


def benchmark(model_name: str, batch_size: int, warmup: int, per_iter: int, iters: int, method: Method,
              log=print, iface: str | None = None, between=None) -> dict:
    """Timed training steps: `iters` timings of `per_iter` steps each after `warmup` steps (for transport="auto"
    at least until its verdict). between(), if given, runs after each timing, outside it (every rank calls
    it)."""
    model = build(model_name)
    if method.ddp:  # DDP broadcasts rank 0's parameters itself
        net, opt, tg = build_ddp(method, model, 0.01)
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt, tg = build_optimizer(method, model, torch.optim.SGD(model.parameters(), lr=0.01))
        net = model
    data, target = synthetic_batch(batch_size, model_name)

    def step():
        opt.zero_grad()
        F.cross_entropy(net(data), target).backward()
        opt.step()

    if method.transport == "auto":  # its measurement and trial are not its steady state: warm up past its verdict
        from hvd_terngrad.auto import LAST_VERDICT_STEP

        warmup = max(warmup, LAST_VERDICT_STEP + 1)
    timeit.timeit(step, number=warmup)
    tx0, rx0 = iface_bytes(iface)
    img_secs, phases = [], []
    cpu = main_cpu = 0.0  # CPU time over the timed steps: all threads (Horovod's and MPI's too), this one
    for _ in range(iters):
        c0, m0 = time.process_time(), time.thread_time()
        t = timeit.timeit(step, number=per_iter)
        cpu += time.process_time() - c0
        main_cpu += time.thread_time() - m0
        img_secs.append(batch_size * per_iter / t)
        if between is not None:
            # its barriers add a few hundred bytes to the wire counts; leaving out what crosses the wire
            # meanwhile would also leave out the tail of the last step, still in the kernel's socket buffers
            between()
        if tg is not None:
            last = tg.stats.last
            phases.append((last.time_encode, last.time_comm, last.time_decode,
                           last.cpu_encode, last.cpu_comm, last.cpu_decode))
        if log is not None and hvd.rank() == 0:
            log(f"Iter: {img_secs[-1]:.1f} img/sec per worker")
    tx1, rx1 = iface_bytes(iface)
    mean = statistics.mean(img_secs)
    conf = 1.96 * (statistics.stdev(img_secs) if len(img_secs) > 1 else 0.0)
    res = {"model": model_name, "method": method.name, "compression": method.compression,
           "optimizer": method.optimizer, "workers": hvd.size(),
           "transport": method.transport if method.compression == "terngrad" else None,
           "batch_size": batch_size, "img_sec_per_worker": mean, "img_sec_conf": conf,
           "img_sec_total": mean * hvd.size(), "step_seconds": batch_size / mean,
           "step_seconds_median": statistics.median(batch_size / v for v in img_secs),
           "cpu_seconds_per_step": cpu / (iters * per_iter),
           "main_cpu_seconds_per_step": main_cpu / (iters * per_iter),
           "params": sum(p.numel() for p in model.parameters()),
           "bytes_per_step": bytes_per_step(model, method, tg),
           "wire_tx_per_step": (tx1 - tx0) / (iters * per_iter), "wire_rx_per_step": (rx1 - rx0) / (iters * per_iter)}
    auto = tg.pipeline.auto if tg is not None and method.transport == "auto" else None
    if auto is not None:  # what transport="auto" tried and kept
        res["auto"] = auto.summary()
    if phases:
        keys = ("time_encode", "time_comm", "time_decode", "cpu_encode", "cpu_comm", "cpu_decode")
        res.update({k: statistics.mean(p[i] for p in phases) for i, k in enumerate(keys)})
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="alexnet", choices=sorted(MODELS))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-warmup-batches", type=int, default=3)
    ap.add_argument("--num-batches-per-iter", type=int, default=5)
    ap.add_argument("--num-iters", type=int, default=5)
    ap.add_argument("--method", default="terngrad", type=parse_method,
                    help="fp32, fp16, terngrad or terngrad:<modifiers>, or local (no exchange: the ceiling) "
                         "(hvd_terngrad/methods.py)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--iface", help="count this interface's bytes over the timed steps (e.g. eth0 in an emulated node)")
    ap.add_argument("--json", help="append the result as one JSON line (rank 0)")
    ap.add_argument("--compute-probe", type=int, default=0, metavar="K",
                    help="also time steps of the same model without communication (all workers at once), for "
                         "benchmarks/perf_model.py validate: K after each timed iteration, outside its timing")
    args = ap.parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads)
    if args.method.ddp:  # Horovod keeps the ranks; DDP's gradients travel over torch.distributed (gloo)
        init_gloo(hvd)
    if hvd.rank() == 0:
        print(f"Model: {args.model}, batch size: {args.batch_size}, method: {args.method.name}, "
              f"workers: {hvd.size()}")
    probe = between = None
    if args.compute_probe:
        from benchmarks.calibrate import ComputeProbe

        probe = ComputeProbe(args.model, args.batch_size, casts=args.method.compression == "fp16")

        def between():
            for _ in range(args.compute_probe):
                probe.step()
    r = benchmark(args.model, args.batch_size, args.num_warmup_batches, args.num_batches_per_iter, args.num_iters,
                  args.method, iface=args.iface, between=between)
    if probe is not None:
        r["compute_probe"] = probe.result(mean=True)  # against the mean step time
    if hvd.rank() == 0:
        print(f"Img/sec per worker: {r['img_sec_per_worker']:.1f} +-{r['img_sec_conf']:.1f}")
        conf_total = r["img_sec_conf"] * hvd.size()
        print(f"Total img/sec on {hvd.size()} worker(s): {r['img_sec_total']:.1f} +-{conf_total:.1f}")
        print(f"Gradient bytes sent per worker per step: {r['bytes_per_step']:,.0f}")
        print(f"CPU time per step (rank 0): {r['cpu_seconds_per_step'] * 1e3:.1f} ms, of which the training "
              f"thread {r['main_cpu_seconds_per_step'] * 1e3:.1f} ms")
        if args.iface:
            print(f"Wire bytes per step on {args.iface} (rank 0): sent {r['wire_tx_per_step']:,.0f}, "
                  f"received {r['wire_rx_per_step']:,.0f}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
    if args.method.ddp:  # every rank done, then the DDP models before their process group (an abort at exit else)
        import gc

        import torch.distributed as dist

        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
