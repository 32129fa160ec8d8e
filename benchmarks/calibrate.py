"""Measure the performance model's host and link inputs on an emulated cluster, without training.

    python -m benchmarks.calibrate --nodes 2,4,8 --profiles ethernet-1g,fast     # -> results/calibration.json
    python -m benchmarks.sweep --calibrate ...                                    # the same, inside the sweep

On every (profile, N) cluster, one job of N ranks measures:
- compute: forward + backward + SGD update of each model, all N ranks at once and no communication, each
  step started by a barrier and timed as its slowest rank, as a synchronous step is; and when, within
  backward, each parameter's gradient is ready (the moment a Horovod hook could send it). The N
  emulated nodes share this machine's cores, so this is the compute time a worker of that cluster sees;
  on a real cluster it equals the 1-worker time (benchmarks/perf_model.py measure). Each sweep job also
  takes such steps between its timed iterations (synthetic.py --compute-probe, ComputeProbe), and the
  model uses those: this machine's speed moves between jobs. An fp16 job's probe also times
  Compression.fp16's casts of every gradient, with training's allocations.
- codec: each transport's encode (stats, ternarize, pack) and decode (into the gradient) of buckets of 256K to
  16M elements, for each transport, all ranks at once (for the sharded transports also the owner's reply);
  and Horovod's fp16 compression (two casts).
- collectives: the time of each collective the transports use (Horovod Average/Sum allreduce of fp32 and
  fp16, Horovod allgather and alltoall of uint8, the int8 mpi4py Sum allreduce), for five or six payload
  sizes, 16 calls each, each a large and a small tensor fused into one call as in training (an alltoall: one
  tensor, as Horovod does not fuse them), with nothing else running. Each is fitted to t = a + x / B, where
  x is the collective's bandwidth term in bytes (allreduce 2 (N-1)/N * bytes, allgather (N-1) * bytes per
  worker, alltoall (N-1)/N * bytes, as in hvd_terngrad/commcost.py), so a is the per-call latency and B
  the effective bandwidth the link, MPI and the host's TCP stack together give;
  and, at every size, how long the call takes beside compute on the worker's core and how much it slows
  that compute (the main thread's rate of matrix products, against alone).

None of the sweep's models or payload sizes is an input of the fit, so validating the model against the
sweep (benchmarks/perf_model.py validate) tests it on data it was not fitted to.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.models import build, synthetic_batch
from hvd_terngrad.commcost import allgather_bytes, allreduce_bytes, alltoall_bytes

# Per-worker payload bytes of each collective: spans the sweep's range (tens of kB of scalers and pass-through
# floats, up to the 50 MB fp32 gradient of `wide`) without copying any of its sizes. Time per byte is not
# linear between 8 and 50 MB on the emulated clusters, so the allreduces get a point in between.
SIZES = {
    "allreduce_fp32": [2**14, 2**18, 2**21, 2**23, 3 * 2**23, 3 * 2**24],
    "allreduce_fp16": [2**14, 2**18, 2**21, 2**23, 2**24, 3 * 2**23],
    "allgather_u8": [2**12, 2**16, 2**19, 2**21, 3 * 2**20],
    "allreduce_int8": [2**14, 2**18, 2**21, 2**23, 3 * 2**22],
    "alltoall_u8": [2**12, 2**16, 2**19, 2**21, 3 * 2**20],
}
CODEC_SIZES = [2**18, 2**20, 2**22, 2**24]  # elements per bucket
DEFAULT_WORKLOADS = "alexnet:32,vgg:32,googlenet:32,mlp:32,wide:4"


def bandwidth_bytes(kind: str, nbytes: float, n: int) -> float:
    """The bytes term of hvd_terngrad/commcost.py for one call of `kind` with `nbytes` per worker."""
    if kind.startswith("alltoall"):
        return alltoall_bytes(nbytes, n)
    return allgather_bytes(nbytes, n) if kind.startswith("allgather") else allreduce_bytes(nbytes, n)


def fit(points: list[tuple[float, float]]) -> dict:
    """Least squares of t = a + x / B, weighted by 1/t (relative error), a >= 0."""
    w = [1.0 / t for _, t in points]
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * x for wi, (x, _) in zip(w, points))
    st = sum(wi * wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * wi * x * x for wi, (x, _) in zip(w, points))
    sxt = sum(wi * wi * x * t for wi, (x, t) in zip(w, points))
    den = sw * sxx - sx * sx
    slope = (sw * sxt - sx * st) / den
    a = (st - slope * sx) / sw
    if a < 0:  # through the origin
        a, slope = 0.0, sxt / sxx
    if slope <= 0:  # times that do not grow with size (noise on a busy machine): a latency, no bandwidth term
        a, slope = st / sw, 0.0
    worst = max(abs((a + x * slope) / t - 1) for x, t in points)
    return {"latency_s": a, "bandwidth_Bps": 1.0 / slope if slope > 0 else float("inf"), "worst_fit_error": worst}


# ---------------------------------------------------------------------------------------------- rank side
def slowest(v: list, mean: bool = False, per_step: bool = False) -> float | list:
    """Median (or mean) over steps of the slowest rank's time (a synchronous step waits for it); v holds one
    value or one list of values per step. per_step: the slowest rank's values, step by step, instead.
    Collective: every rank calls it."""
    import horovod.torch as hvd
    import torch

    allv = hvd.allgather(torch.tensor([v], dtype=torch.float64), name="cal.slowest").max(dim=0).values
    if per_step:
        return allv.tolist()
    res = allv.mean(dim=0) if mean else allv.median(dim=0).values
    return res.tolist() if res.dim() else res.item()


class ComputeProbe:
    """Forward, backward and SGD update of a fresh model on every rank at once, no communication, one
    step per call: each step starts at a barrier and counts as its slowest rank. Also when, after backward
    starts, each parameter's gradient is ready (when a Horovod hook could send it). Collective: every rank
    makes the same calls. Its steps can be interleaved with a timed run (benchmarks/synthetic.py
    --compute-probe), so that both see the machine at the same speed: a worker's compute can switch between
    speeds for seconds at a time (docs/performance-model.md).

    casts=True also times, after backward and outside the step's time, Horovod's Compression.fp16 on every
    gradient as training does it: a cast to fp16 of each, then a cast back set into p.grad. With
    training's allocations these casts cost several times what the same casts cost on reused buffers, as
    fresh pages fault in."""

    def __init__(self, name: str, batch: int, warmup: int = 2, casts: bool = False):
        import torch

        self.model = build(name)
        self.params = [pn for pn, _ in self.model.named_parameters()]
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x, self.y = synthetic_batch(batch, name)
        self.stamp: dict = {}
        for pname, prm in self.model.named_parameters():
            prm.register_post_accumulate_grad_hook(
                lambda _p, pname=pname, stamp=self.stamp: stamp.__setitem__(pname, time.perf_counter()))
        self.casts = casts
        self.steps, self.fwds, self.backs, self.ready, self.enc, self.dec = [], [], [], [], [], []
        for _ in range(warmup):
            self.step(record=False)

    def step(self, record: bool = True) -> None:
        import horovod.torch as hvd
        import torch.nn.functional as F

        hvd.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(self.x), self.y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        cast = 0.0
        if self.casts:
            import torch

            grads = [p.grad for p in self.model.parameters()][::-1]  # in backward's order, as the hooks run
            enc, dec, halves = [], [], []
            for g in grads:
                c0 = time.perf_counter()
                halves.append(g.type(torch.float16))
                enc.append(time.perf_counter() - c0)
            for g, h in zip(grads, halves):
                c0 = time.perf_counter()
                g.set_(h.type(torch.float32))
                dec.append(time.perf_counter() - c0)
            del grads, halves
            enc, dec = enc[::-1], dec[::-1]
            cast = time.perf_counter() - t2
        self.opt.step()
        if record:
            self.steps.append(time.perf_counter() - t0 - cast)
            self.fwds.append(t1 - t0)
            self.backs.append(t2 - t1)
            self.ready.append([self.stamp[pn] - t1 for pn in self.params])
            if self.casts:
                self.enc.append(enc)
                self.dec.append(dec)

    def result(self, mean: bool = False) -> dict:
        """Median (or mean, to set against a mean step time) over steps of the slowest rank's times, and
        each step's slowest time."""
        out = {"step": slowest(self.steps, mean), "forward": slowest(self.fwds, mean),
               "backward": slowest(self.backs, mean), "ready": dict(zip(self.params, slowest(self.ready, mean)))}
        out["step_samples"] = slowest(self.steps, per_step=True)
        if self.casts:  # seconds per gradient: the cast to fp16 (in the hook) and back (in synchronize)
            out["fp16_casts"] = {"encode": self._split(self.enc, mean), "decode": self._split(self.dec, mean)}
        return out

    def _split(self, per_step: list, mean: bool) -> dict:
        """The slowest rank's total per step, split over the gradients by their average shares. (The sum of
        each gradient's slowest time would add up every rank's worst moments: with two ranks on a core, a
        time slice lands in some rank's cast of almost every gradient.)"""
        import horovod.torch as hvd
        import torch

        total = slowest([sum(v) for v in per_step], mean)
        avg = hvd.allreduce(torch.tensor(per_step, dtype=torch.float64).mean(dim=0), op=hvd.Average,
                            name="cal.casts").tolist()
        whole = sum(avg) or 1.0
        return {pn: total * a / whole for pn, a in zip(self.params, avg)}


def measure_compute(name: str, batch: int, reps: int) -> dict:
    """ComputeProbe's result over `reps` steps in a row, after two warm-up steps. Collective."""
    probe = ComputeProbe(name, batch)
    for _ in range(reps):
        probe.step()
    return probe.result()


def measure_codec(reps: int) -> dict:
    """Each transport's main-thread codec work on one bucket, as the pipeline runs it, and Compression.fp16's
    two casts, all ranks at once: seconds against bucket elements. encode (the codes in the transport's
    layout), owner (the sharded transports: this rank's shard of every rank's codes into its reply) and decode
    (what the collective delivered into the gradient). What this rank receives comes from one exchange of the
    same gradient through every rank's pipeline in this process (loopback collectives). The cost per element
    depends on the size (caches, and the page faults of fresh allocations), so four sizes make a curve.
    Collective."""
    import horovod.torch as hvd
    import torch

    from hvd_terngrad.transports import TRANSPORTS

    out = {"fp16": _measure_casts(reps)}
    for tname in TRANSPORTS:
        t, pts = TRANSPORTS[tname], []
        for m in CODEC_SIZES:
            grad, out_grad = torch.randn(m), torch.empty(m)
            got = _received(tname, grad, hvd.size(), hvd.rank())
            coder = _coder(tname, hvd.size(), hvd.rank())
            enc, own, dec = [], [], []
            for i in range(reps + 1):
                hvd.barrier()
                t0 = time.perf_counter()
                items = [coder.prepare("cal", grad)]
                payload = t.encode(coder, items)
                t1 = time.perf_counter()
                if "alltoall" in got:
                    t.owner_reply(got["alltoall"].view(hvd.size(), -1), payload, "cal")
                t2 = time.perf_counter()
                t.decode(coder, items, got["result"], outs=[out_grad])
                t3 = time.perf_counter()
                if i:
                    enc.append(t1 - t0)
                    own.append(t2 - t1)
                    dec.append(t3 - t2)
            pts.append((m, slowest(enc), slowest(own), slowest(dec)))
        out[tname] = {"encode": [(m, e) for m, e, _, _ in pts], "decode": [(m, d) for m, _, _, d in pts]}
        if "alltoall" in got:
            out[tname]["owner"] = [(m, o) for m, _, o, _ in pts]
    return out


def _measure_casts(reps: int) -> dict:
    """Compression.fp16's two casts of a bucket, all ranks at once. Collective."""
    import horovod.torch as hvd
    import torch

    enc, dec = [], []
    for m in CODEC_SIZES:
        grad, out_grad = torch.randn(m), torch.empty(m)
        e, d = [], []
        for i in range(reps + 1):
            hvd.barrier()
            t0 = time.perf_counter()
            half = grad.type(torch.float16)
            t1 = time.perf_counter()
            out_grad.set_(half.type(torch.float32))
            t2 = time.perf_counter()
            if i:
                e.append(t1 - t0)
                d.append(t2 - t1)
        enc.append((m, slowest(e)))
        dec.append((m, slowest(d)))
    return {"encode": enc, "decode": dec}


def _coder(tname: str, n: int, rank: int):
    from hvd_terngrad import TernGradConfig
    from hvd_terngrad.coder import Coder

    return Coder(TernGradConfig(num_threads=1, transport=tname), rank, n)


def _received(tname: str, grad, n: int, rank: int) -> dict:
    """What rank `rank` receives when every one of n ranks sends `grad` through the pipeline with transport
    `tname`, from one exchange over loopback collectives: {"result": the transport's last collective's output,
    "alltoall": the code shards (sharded transports)}."""
    from hvd_terngrad import TernGradConfig
    from hvd_terngrad.collectives.loopback import LoopbackCollectives, LoopbackWorld
    from hvd_terngrad.pipeline import Pipeline, exchange

    got = {}

    class Tap(LoopbackCollectives):
        def wait(self, handle, what):
            res = super().wait(handle, what)
            got["alltoall" if handle.kind == "alltoall" else "result"] = res.clone()
            return res

    world = LoopbackWorld(n)
    comms = [(Tap if r == rank else LoopbackCollectives)(world, r) for r in range(n)]
    pipes = [Pipeline(TernGradConfig(num_threads=1, transport=tname), c) for c in comms]
    exchange(pipes, "cal", [[("cal", grad)]] * n, decode_ranks=())
    return got


def _starter(kind: str, nbytes: int, transport):
    """start(i) for one `kind` call of `nbytes` per worker as training makes it: a tensor and a small one (a
    bias, a scaler vector) fused into one call, which goes through Horovod's fusion buffer (two copies a
    single tensor skips). It returns the handles; the int8 sum is a blocking call and returns none."""
    import horovod.torch as hvd
    import torch

    if kind == "allreduce_int8":
        buf = torch.zeros(nbytes, dtype=torch.int8)

        def blocking_sum(_i):
            transport.wait(transport.int8_sum_async_(buf, name="cal.int8"), "the calibration's int8 sum")
            return []
        return blocking_sum
    if kind == "allgather_u8":
        bufs = [torch.zeros(nbytes - 64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)]
        return lambda i: [hvd.allgather_async(b, name=f"cal.ag.{i}.{j}") for j, b in enumerate(bufs)]
    if kind == "alltoall_u8":  # a sharded bucket's codes: one call, never fused
        n = hvd.size()
        buf = torch.zeros(nbytes // n * n, dtype=torch.uint8)
        return lambda i: [hvd.alltoall_async(buf, name=f"cal.a2a.{i}")]
    dt = torch.float32 if kind == "allreduce_fp32" else torch.float16
    width = 4 if dt == torch.float32 else 2
    bufs = [torch.zeros(nbytes // width - 16, dtype=dt), torch.zeros(16, dtype=dt)]
    return lambda i: [hvd.allreduce_async_(b, name=f"cal.ar.{i}.{j}", op=hvd.Average) for j, b in enumerate(bufs)]


def _work_rate(until) -> float:
    """Matrix products per second on the main thread until until() is true."""
    import torch

    a = torch.randn(192, 192)
    t0, k = time.perf_counter(), 0
    while not until():
        torch.mm(a, a)
        k += 1
    return k / (time.perf_counter() - t0)


def measure_collective(kind: str, comm_reps: int, beside_reps: int, alone_rate: float, transport) -> dict:
    """One collective's seconds against bytes per worker, alone (the mean: a shaped link's tail drops stall
    TCP for a retransmission timeout now and then, and a training step pays for them) and, except for the
    blocking int8 sum, beside compute on this worker's core together with how much it slows that compute (the
    main thread's rate of matrix products, against alone). MPI over TCP progresses only when Horovod's thread
    gets the core, which a computing main thread holds for its time slice: a call waits on that once per
    message exchange, so the stretch depends on size (docs/performance-model.md). Collective."""
    import horovod.torch as hvd

    n = hvd.size()
    pts, beside, cpu = [], [], []
    for nbytes in SIZES[kind]:
        start = _starter(kind, nbytes, transport)
        ts = []
        for i in range(comm_reps + 1):
            hvd.barrier()  # then time the call alone
            t0 = time.perf_counter()
            for h in start(i):
                hvd.synchronize(h)
            if i:
                ts.append(time.perf_counter() - t0)
        pts.append((nbytes, slowest(ts, mean=True)))
        if kind == "allreduce_int8":  # a blocking call in the main thread: nothing runs beside it
            continue
        durs, rates = [], []
        for i in range(beside_reps):
            hvd.barrier()
            t0 = time.perf_counter()
            hs = start(-1 - i)
            rates.append(_work_rate(lambda hs=hs: all(hvd.poll(h) for h in hs)))
            durs.append(time.perf_counter() - t0)
            for h in hs:
                hvd.synchronize(h)
        beside.append((nbytes, slowest(durs, mean=True)))
        cpu.append((nbytes, slowest([max(0.0, min(1.0, 1.0 - sum(rates) / len(rates) / alone_rate))], mean=True)))
    entry = {"points": pts, **fit([(bandwidth_bytes(kind, b, n), s) for b, s in pts])}
    if beside:
        entry.update({"beside_compute_points": beside, "cpu_fraction_points": cpu,
                      "stretch_beside_compute": max(1.0, beside[-1][1] / pts[-1][1]), "cpu_fraction": cpu[-1][1]})
    else:
        entry.update({"stretch_beside_compute": 1.0, "cpu_fraction": 1.0})
    return entry


def _rank_main(args) -> None:
    """One rank of the calibration job: compute, codec and collectives, written by rank 0."""
    import horovod.torch as hvd
    import torch

    from hvd_terngrad.collectives.horovod import HorovodCollectives

    hvd.init()
    torch.set_num_threads(1)
    out = {"nodes": hvd.size(), "compute": {}, "codec": {}, "collectives": {}}
    for spec in args.workloads.split(","):
        name, _, bs = spec.partition(":")
        out["compute"][spec] = measure_compute(name, int(bs), args.compute_reps)
    out["codec"] = measure_codec(args.codec_reps)
    transport = HorovodCollectives()
    hvd.barrier()
    t_end = time.perf_counter() + 0.5
    alone = _work_rate(lambda: time.perf_counter() > t_end)
    for kind in SIZES:
        out["collectives"][kind] = measure_collective(kind, args.comm_reps, args.beside_reps, alone, transport)
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------- launcher
def calibrate(cluster, workloads: str = DEFAULT_WORKLOADS, timeout: float = 900, quick: bool = False) -> dict:
    """Run the probe job on an EmulatedCluster and return its measurements."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = Path(f.name)
    reps = ["--compute-reps", "3", "--comm-reps", "2", "--codec-reps", "3", "--beside-reps", "1"] if quick else []
    try:
        res = cluster.run([sys.executable, "-m", "benchmarks.calibrate", "--rank-probe", "--json", str(path),
                           "--workloads", workloads, *reps], timeout=timeout)
        if res.returncode != 0 or not path.read_text().strip():
            raise RuntimeError(f"calibration on {cluster.describe()} failed (exit {res.returncode}):\n"
                               f"{res.stdout[-3000:]}")
        out = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
    out["profile"] = cluster.profile.name
    return out


def summary(cal: dict) -> str:
    parts = [f"{k.split('_', 1)[1]} {v['latency_s'] * 1e3:.2f} ms + {v['bandwidth_Bps'] / 1e6:.0f} MB/s"
             for k, v in cal["collectives"].items()]
    comp = ", ".join(f"{k} {v['step'] * 1e3:.0f} ms" for k, v in cal["compute"].items())
    return f"{cal['profile']} N={cal['nodes']}: " + "; ".join(parts) + f" | compute {comp}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="2,4,8")
    ap.add_argument("--profiles", default="ethernet-1g,fast")
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="model:batch pairs")
    ap.add_argument("--out", default="results/calibration.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank-probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--compute-reps", type=int, default=8)
    ap.add_argument("--codec-reps", type=int, default=10)
    ap.add_argument("--comm-reps", type=int, default=16)
    ap.add_argument("--beside-reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rank_probe:
        _rank_main(args)
        return 0
    from benchmarks.cluster import PROFILES, ClusterUnavailable, EmulatedCluster

    results = []
    try:
        for prof in args.profiles.split(","):
            for n in (int(v) for v in args.nodes.split(",")):
                with EmulatedCluster(n, PROFILES[prof]) as c:
                    results.append(calibrate(c, args.workloads, quick=args.quick))
                print(summary(results[-1]), flush=True)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"calibration": results}, indent=1))
    except ClusterUnavailable as exc:
        print(f"calibrate: cannot emulate a cluster here: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
