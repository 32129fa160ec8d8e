"""Synthetic training throughput with FP32, fp16 or TernGrad gradients (in the style of Horovod's
pytorch_synthetic_benchmark.py), on CPU-sized versions of the paper's model families.

    horovodrun -np 2 python benchmarks/synthetic.py --model alexnet --compression terngrad

Models (3x32x32 inputs, 10 classes):
    alexnet    AlexNet-style, FC-heavy: two small convs, then 1600 -> 2048 -> 2048 -> 10 (7.5 M parameters)
    vgg        VGG-A-style: 8 conv layers 64 .. 256, two 512-wide FC layers (3.7 M)
    googlenet  GoogLeNet-style, conv-heavy: inception blocks, global pooling, one FC (0.35 M)
    mlp        3072 -> 2048 -> 2048 -> 10 (10.5 M)
    wide       3072 -> 4096 -> 10 (12.6 M), little compute: for transport sweeps at batch size 4
    tiny       3072 -> 128 -> 10, for smoke tests
Prints img/sec per worker (mean +- 1.96 sigma over iterations) and in total, as Horovod's benchmark does,
and for every method the gradient bytes each worker sends per step.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import timeit
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hvd_terngrad  # noqa: E402

COMPRESSIONS = ("fp32", "fp16", "terngrad")


class AlexNetS(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.fc1 = nn.Linear(64 * 5 * 5, 2048)
        self.fc2 = nn.Linear(2048, 2048)
        self.fc3 = nn.Linear(2048, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


class VGGAS(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = [64, "M", 128, "M", 256, 256, "M", 256, 256, "M", 256, 256, "M"]
        layers, c = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(256, 512), nn.ReLU(inplace=True), nn.Linear(512, 512),
                                        nn.ReLU(inplace=True), nn.Linear(512, 10))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class Inception(nn.Module):
    def __init__(self, c_in, c1, c3r, c3, c5r, c5, cp):
        super().__init__()
        self.b1 = nn.Conv2d(c_in, c1, 1)
        self.b3 = nn.Sequential(nn.Conv2d(c_in, c3r, 1), nn.ReLU(inplace=True), nn.Conv2d(c3r, c3, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(c_in, c5r, 1), nn.ReLU(inplace=True), nn.Conv2d(c5r, c5, 5, padding=2))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c_in, cp, 1))

    def forward(self, x):
        return F.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], 1))


class GoogLeNetS(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(inplace=True))
        self.i3a = Inception(64, 32, 48, 64, 8, 16, 16)
        self.i3b = Inception(128, 64, 64, 96, 16, 48, 32)
        self.i4a = Inception(240, 96, 48, 104, 8, 24, 32)
        self.i4b = Inception(256, 80, 56, 112, 12, 32, 32)
        self.fc = nn.Linear(256, 10)

    def forward(self, x):
        x = self.i3b(self.i3a(self.stem(x)))
        x = F.max_pool2d(x, 2)
        x = F.max_pool2d(self.i4b(self.i4a(x)), 2)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 2048), nn.ReLU(inplace=True),
                                 nn.Linear(2048, 2048), nn.ReLU(inplace=True), nn.Linear(2048, 10))

    def forward(self, x):
        return self.net(x)


class FC(nn.Module):
    """3072 -> hidden -> 10: `wide` (4096, 12.6 M parameters, communication-bound) and `tiny` (128, smoke tests)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.ReLU(inplace=True),
                                 nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)


MODELS = {"alexnet": AlexNetS, "vgg": VGGAS, "googlenet": GoogLeNetS, "mlp": MLP,
          "wide": functools.partial(FC, 4096), "tiny": functools.partial(FC, 128)}


def build_optimizer(model, compression: str, optimizer: str, seed: int = 0, transport: str = "allgather"):
    base = torch.optim.SGD(model.parameters(), lr=0.01)
    named = list(model.named_parameters())
    if compression == "fp32":
        return hvd.DistributedOptimizer(base, named_parameters=named), None
    if compression == "fp16":
        return hvd.DistributedOptimizer(base, named_parameters=named, compression=hvd.Compression.fp16), None
    if optimizer == "stock":
        tg = hvd_terngrad.TernGrad(named, seed=seed, transport=transport)
        return hvd.DistributedOptimizer(base, named_parameters=named, compression=tg), tg
    tg = hvd_terngrad.TernGrad(seed=seed, transport=transport)
    return hvd_terngrad.DistributedOptimizer(base, named_parameters=named, compression=tg), tg


def bytes_per_step(model, compression: str, tg) -> float:
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    if compression == "fp32":
        return dense
    if compression == "fp16":
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


def benchmark(model_name: str, batch_size: int, warmup: int, per_iter: int, iters: int, compression: str,
              optimizer: str = "hvd_terngrad", log=print, iface: str | None = None,
              transport: str = "allgather", between=None) -> dict:
    """Timed training steps: `iters` timings of `per_iter` steps each after `warmup` steps. between(), if
    given, runs after each timing, outside it (every rank calls it)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; allowed: {', '.join(COMPRESSIONS)}")
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; allowed: {', '.join(MODELS)}")
    torch.manual_seed(0)
    model = MODELS[model_name]()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt, tg = build_optimizer(model, compression, optimizer, transport=transport)
    data = torch.randn(batch_size, 3, 32, 32)
    target = torch.randint(0, 10, (batch_size,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    timeit.timeit(step, number=warmup)
    tx0, rx0 = iface_bytes(iface)
    img_secs, phases = [], []
    for _ in range(iters):
        t = timeit.timeit(step, number=per_iter)
        img_secs.append(batch_size * per_iter / t)
        if between is not None:
            # its barriers add a few hundred bytes to the wire counts; leaving out what crosses the wire
            # meanwhile would also leave out the tail of the last step, still in the kernel's socket buffers
            between()
        if tg is not None:
            last = tg.stats.last
            phases.append((last.time_encode, last.time_comm, last.time_decode))
        if log is not None and hvd.rank() == 0:
            log(f"Iter: {img_secs[-1]:.1f} img/sec per worker")
    tx1, rx1 = iface_bytes(iface)
    mean = statistics.mean(img_secs)
    conf = 1.96 * (statistics.stdev(img_secs) if len(img_secs) > 1 else 0.0)
    res = {"model": model_name, "compression": compression, "optimizer": optimizer, "workers": hvd.size(),
           "transport": transport if compression == "terngrad" else None,
           "batch_size": batch_size, "img_sec_per_worker": mean, "img_sec_conf": conf,
           "img_sec_total": mean * hvd.size(), "step_seconds": batch_size / mean,
           "step_seconds_median": statistics.median(batch_size / v for v in img_secs),
           "params": sum(p.numel() for p in model.parameters()),
           "bytes_per_step": bytes_per_step(model, compression, tg),
           "wire_tx_per_step": (tx1 - tx0) / (iters * per_iter), "wire_rx_per_step": (rx1 - rx0) / (iters * per_iter)}
    if phases:
        res["time_encode"], res["time_comm"], res["time_decode"] = (statistics.mean(p[i] for p in phases)
                                                                    for i in range(3))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="alexnet", choices=sorted(MODELS))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-warmup-batches", type=int, default=3)
    ap.add_argument("--num-batches-per-iter", type=int, default=5)
    ap.add_argument("--num-iters", type=int, default=5)
    ap.add_argument("--compression", default="terngrad", choices=COMPRESSIONS)
    ap.add_argument("--optimizer", default="hvd_terngrad", choices=("hvd_terngrad", "stock"),
                    help="for terngrad: hvd_terngrad.DistributedOptimizer or the stock one with compression=")
    ap.add_argument("--transport", default="allgather", choices=("allgather", "summed", "summed-int8", "auto"),
                    help="TernGrad transport (see docs/wire-format.md)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--iface", help="count this interface's bytes over the timed steps (e.g. eth0 in an emulated node)")
    ap.add_argument("--json", help="append the result as one JSON line (rank 0)")
    ap.add_argument("--compute-probe", type=int, default=0, metavar="K",
                    help="also time steps of the same model without communication (all workers at once), for "
                         "benchmarks/perf_model.py validate: K after each timed iteration, outside its timing")
    args = ap.parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads)
    if hvd.rank() == 0:
        print(f"Model: {args.model}, batch size: {args.batch_size}, compression: {args.compression}, "
              f"workers: {hvd.size()}")
    probe = between = None
    if args.compute_probe:
        from benchmarks.calibrate import ComputeProbe

        probe = ComputeProbe(args.model, args.batch_size, casts=args.compression == "fp16")

        def between():
            for _ in range(args.compute_probe):
                probe.step()
    r = benchmark(args.model, args.batch_size, args.num_warmup_batches, args.num_batches_per_iter, args.num_iters,
                  args.compression, args.optimizer, iface=args.iface, transport=args.transport, between=between)
    if probe is not None:
        r["compute_probe"] = probe.result(mean=True)  # against the mean step time
    if hvd.rank() == 0:
        print(f"Img/sec per worker: {r['img_sec_per_worker']:.1f} +-{r['img_sec_conf']:.1f}")
        conf_total = r["img_sec_conf"] * hvd.size()
        print(f"Total img/sec on {hvd.size()} worker(s): {r['img_sec_total']:.1f} +-{conf_total:.1f}")
        print(f"Gradient bytes sent per worker per step: {r['bytes_per_step']:,.0f}")
        if args.iface:
            print(f"Wire bytes per step on {args.iface} (rank 0): sent {r['wire_tx_per_step']:,.0f}, "
                  f"received {r['wire_rx_per_step']:,.0f}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
