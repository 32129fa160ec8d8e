"""Performance model: step time = compute + codec + communication - overlap, from measured parts.

    python benchmarks/sweep.py --calibrate                  # sweep, with this model's inputs measured per cluster
    python benchmarks/perf_model.py validate results/sweep.json results/transports/sweep.json
    python benchmarks/perf_model.py extrapolate             # 1..512 GPUs, the paper's two clusters -> results/
    python benchmarks/perf_model.py measure                 # compute per model, one worker -> results/compute.json

Two uses, one decomposition:

- The emulated cluster (validate). Its N nodes share this machine's cores and TCP stack, so the inputs
  are measured on it, without training (benchmarks/calibrate.py): compute of N workers at once and when
  each gradient is ready within backward; the engine's encode/decode per transport; and each collective's
  time against payload size, alone and beside compute, plus how much it slows that compute.
  host_step_seconds() replays a step as a timeline: gradients become ready, one Horovod channel runs the
  collectives in order (fusing the waiting requests of one collective, dtype and reduce op, as Horovod
  does), TernGrad buckets share scalers, encode and send their codes, and synchronize() decodes. A
  collective runs at its measured pace beside compute, at its size, while backward runs or the main thread
  encodes or decodes. The overlap is what the timeline hides behind that work.
- Real clusters (extrapolate): compute from published per-GPU throughput, the codec at the GPU goal's
  bandwidth, and hvd_terngrad/commcost.py's link formulas (ring allreduce, allgather, summed sums, the
  scaler allreduce; hierarchical with several GPUs per node). Overlap: communication hides behind backward
  up to the backward time.

`validate --link-only` applies the real-cluster formulas to the emulated cluster instead (1-worker compute
scaled by N/cores, the probed link), for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hvd_terngrad import TernGradConfig  # noqa: E402
from hvd_terngrad.commcost import Link, allgather_time, allreduce_time  # noqa: E402
from hvd_terngrad.optimizer import plan_buckets  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Split:
    coded: int  # elements TernGrad codes
    tensors: int  # coded tensors
    floats: int  # elements that pass through in float

    @property
    def total(self) -> int:
        return self.coded + self.floats


@dataclass(frozen=True)
class Codec:
    stats_Bps: float  # bytes of fp32 gradient per second
    encode_Bps: float
    decode4_Bps: float  # fp32 output bytes per second, 4 ranks

    def seconds(self, coded: int, n: int) -> float:
        b = 4.0 * coded
        # decode reads n/4 bytes per rank and writes 4 per element: scale the 4-rank figure by traffic
        dec = b / self.decode4_Bps * (16 + n) / 20
        return b / self.stats_Bps + b / self.encode_Bps + dec


def split_of(model: torch.nn.Module) -> Split:
    cfg = TernGradConfig()
    coded = tensors = floats = 0
    for name, p in model.named_parameters():
        if cfg.compresses(name, p.numel()):
            coded, tensors = coded + p.numel(), tensors + 1
        else:
            floats += p.numel()
    return Split(coded, tensors, floats)


def comm_seconds(method: str, s: Split, n: int, link: Link, hier: tuple[int, Link] | None = None) -> float:
    """Communication per step. hier = (GPUs per node, intra-node link): reduce inside nodes over the fast
    link, exchange between nodes over `link`, broadcast back inside nodes."""
    if n <= 1:
        return 0.0
    g, intra = hier if hier else (1, link)
    g = min(g, n)
    m = max(1, n // g)  # nodes
    if method in ("fp32", "fp16"):
        width = 4 if method == "fp32" else 2
        inside = 2 * allreduce_time(width * s.total, g, intra) if g > 1 else 0.0
        return inside + allreduce_time(width * s.total, m, link)
    floats = allreduce_time(4 * s.floats, n, link) if s.floats else 0.0
    scalers = allreduce_time(16 * s.tensors, n, link)
    if method == "terngrad":  # allgather: nodes exchange the codes of all their GPUs
        inside = allgather_time(s.coded / 4, g, intra) if g > 1 else 0.0
        return inside + allgather_time(g * (s.coded / 4 + 24 * s.tensors), m, link) + scalers + floats
    if method in ("terngrad:summed", "terngrad:summed-int8"):
        width = 2 if method == "terngrad:summed" else 1
        inside = 2 * allreduce_time(width * s.coded, g, intra) if g > 1 else 0.0
        return inside + allreduce_time(width * s.coded, m, link) + scalers + floats
    raise ValueError(f"unknown method {method!r}")


def step_seconds(method: str, s: Split, n: int, compute: float, backward: float, link: Link, codec: Codec | None,
                 hier=None) -> dict:
    comm = comm_seconds(method, s, n, link, hier)
    cod = codec.seconds(s.coded, n) if (codec and method.startswith("terngrad") and n > 1) else 0.0
    overlap = min(comm, backward) if n > 1 else 0.0
    return {"compute": compute, "codec": cod, "comm": comm, "overlap": overlap,
            "total": compute + cod + comm - overlap}


# ---------------------------------------------------------------------------------------------
def measure(models: list[str], batch: int, reps: int) -> dict:
    from benchmarks.synthetic import MODELS

    torch.set_num_threads(1)
    out = {}
    for m in models:
        torch.manual_seed(0)
        model = MODELS[m]()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
        fw = bw = up = 0.0
        for i in range(reps + 2):
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            t1 = time.perf_counter()
            opt.zero_grad()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if i >= 2:
                fw, bw, up = fw + t1 - t0, bw + t2 - t1, up + t3 - t2
        s = split_of(model)
        out[m] = {"forward": fw / reps, "backward": bw / reps, "update": up / reps,
                  "step": (fw + bw + up) / reps, "batch": batch, "coded": s.coded, "tensors": s.tensors,
                  "floats": s.floats}
        print(f"{m:>10}: step {out[m]['step'] * 1e3:.1f} ms (backward {out[m]['backward'] * 1e3:.1f} ms)", flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# The emulated cluster as measured by benchmarks/calibrate.py: N nodes that share this machine's cores and
# TCP stack. Compute and codec times are those of N workers running at once; each collective's time is read
# off its measured curve (piecewise linear through the measured payload sizes, extended by the last
# segment's slope), which keeps the token-bucket burst of small messages and the TCP losses of large ones
# that a single latency + bandwidth pair averages away.
class Curve:
    """Seconds against size, through measured points; below the smallest size the time stays flat (a call's
    fixed cost), or with origin=True falls to 0 in proportion (work per element)."""

    def __init__(self, points: list[tuple[float, float]], origin: bool = False):
        self.pts = sorted((float(b), float(t)) for b, t in points)
        if origin:
            self.pts.insert(0, (0.0, 0.0))

    def __call__(self, nbytes: float) -> float:
        pts = self.pts
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)


@dataclass(frozen=True)
class Host:
    """One calibrated (profile, N) cluster."""

    nodes: int
    compute: dict  # "model:batch" -> {"step": s, "backward": s}
    codec: dict  # transport -> {"encode": Curve, "decode": Curve} of seconds against bucket elements
    curves: dict  # collective kind -> Curve of seconds against bytes per worker
    beside: dict = field(default_factory=dict)  # collective kind -> Curve of its seconds beside compute
    cpu: dict = field(default_factory=dict)  # collective kind -> Curve of how much it slows compute (0..1)

    @classmethod
    def from_json(cls, cal: dict) -> Host:
        codec = {t: {k: Curve(pts, origin=True) for k, pts in v.items()} for t, v in cal["codec"].items()}
        colls = cal["collectives"]
        return cls(cal["nodes"], cal["compute"], codec, {k: Curve(v["points"]) for k, v in colls.items()},
                   {k: Curve(v["beside_compute_points"]) for k, v in colls.items() if "beside_compute_points" in v},
                   {k: Curve(v["cpu_fraction_points"]) for k, v in colls.items() if "cpu_fraction_points" in v})

    def beside_compute(self, kind: str, nbytes: float, alone: float) -> tuple[float, float]:
        """(stretch >= 1, cpu_fraction 0..1) of a `kind` call of `nbytes` that takes `alone` seconds by itself,
        as measured at its size; a kind not measured beside compute neither slows nor is slowed."""
        r = max(1.0, self.beside[kind](nbytes) / alone) if kind in self.beside else 1.0
        f = min(1.0, max(0.0, self.cpu[kind](nbytes))) if kind in self.cpu else 0.0
        return r, f


FUSION_BYTES = 64 << 20  # Horovod's default fusion threshold


def _params_of(model: str) -> list[tuple[str, int]]:
    from benchmarks.synthetic import MODELS

    torch.manual_seed(0)
    return [(n, p.numel()) for n, p in MODELS[model]().named_parameters()]


def host_step_seconds(method: str, model: str, batch: int, host: Host, overlap: bool = True,
                      bucket_bytes: int = 4 << 20, compute: dict | None = None, trace: list | None = None) -> dict:
    """One training step on a calibrated host, as a timeline.

    Backward hands gradients over at their measured ready times. One Horovod channel runs collectives one
    at a time in submission order, fusing the requests that are waiting when it frees up and share a
    collective, dtype and reduce op (looking past others, up to 64 MB), so communication overlaps the rest
    of backward, at the measured pace of a collective of its size beside compute, slowing backward by the
    measured share it takes. FP32/fp16: each gradient is submitted when ready.
    TernGrad (hvd_terngrad.DistributedOptimizer): pass-through floats are allreduced when ready; a bucket,
    once all its gradients are ready, sends its scalers (Max allreduce), is encoded on the main thread at the
    first backward hook after they return, or in synchronize() (delaying backward if it is still running),
    then sends its codes (allgather or fp16 sum);
    synchronize() encodes what is left, then decodes the buckets in order as their codes arrive (int8 sums
    are a blocking MPI call there). Collectives in flight while the main thread encodes or decodes after
    backward run at their pace beside compute too.
    overlap=False runs every collective after backward instead. `trace`, a list, receives each
    (fused) collective as (start, end, kind, bytes, end of backward so far)."""
    comp = compute or host.compute[f"{model}:{batch}"]
    fwd, bwd = comp["forward"], comp["backward"]
    update = max(0.0, comp["step"] - fwd - bwd)
    ready = comp.get("ready") or {}
    params = _params_of(model)
    t_ready = {n: fwd + (ready.get(n, bwd) if overlap else bwd) for n, _ in params}
    curves = host.curves
    transport = method.partition(":")[2] or "allgather"
    codec = host.codec.get(transport) if method.startswith("terngrad") else None

    # [submit time, seq, kind, bytes, done callback, fusion key]: Horovod fuses waiting requests of one
    # collective, dtype and reduce op (the key), looking past others, up to 64 MB (an allgather's output)
    queue: list[list] = []
    seq = [0]

    def submit(t, kind, nbytes, done=None, fuse=None):
        queue.append([t, seq[0], kind, nbytes, done, fuse])
        seq[0] += 1

    state = {"bwd_end": fwd + bwd, "main_free": 0.0, "comm": 0.0, "codec": 0.0, "decoded": 0}
    stalls: list[tuple[float, float]] = []  # main-thread codec work after backward
    done_at: dict = {}

    def in_order(costs: list[float]) -> None:
        """synchronize() takes the results in order (done_at[("sent", k)]): each, once it has arrived and
        the main thread is free, costs costs[k] of main-thread work beside the collectives still in flight."""
        while state["decoded"] < len(costs) and ("sent", state["decoded"]) in done_at:
            k = state["decoded"]
            t0 = max(state["bwd_end"], state["main_free"], done_at[("sent", k)])
            stalls.append((t0, t0 + costs[k]))
            state["main_free"] = t0 + costs[k]
            state["decoded"] += 1

    if not method.startswith("terngrad"):
        width = 4 if method == "fp32" else 2
        kind = "allreduce_fp32" if method == "fp32" else "allreduce_fp16"
        cast = host.codec.get("fp16") if method == "fp16" else None
        # the job's own probe times the casts with training's allocations (fresh pages fault in); the
        # calibration's curves, on reused buffers, are the fallback
        casts = comp.get("fp16_casts") if method == "fp16" else None
        decs = []  # synchronize() takes the handles in the order the hooks made them, and casts each back

        def cast_back(i):
            def done(t):
                done_at[("sent", i)] = t
                in_order(decs)
            return done

        for n, numel in sorted(params, key=lambda q: t_ready[q[0]]):
            t = t_ready[n] + state["bwd_end"] - (fwd + bwd)
            d = 0.0
            if cast:  # Compression.fp16 casts in the hook (backward waits) and back in synchronize()
                if casts:
                    c, d = casts["encode"][n], casts["decode"][n]
                else:
                    c, d = cast["encode"](numel), cast["decode"](numel)
                state["bwd_end"] += c
                state["codec"] += c + d
                t += c
            decs.append(d)
            submit(t, kind, width * numel, cast_back(len(decs) - 1), fuse="average")
        buckets, elems_of = [], []
    else:
        groups, floats = plan_buckets([(n, numel, 4) for n, numel in params], TernGradConfig(), bucket_bytes)
        for i in floats:
            n, numel = params[i]
            submit(t_ready[n], "allreduce_fp32", 4 * numel, fuse="average")
        buckets = [[params[i] for i in g] for g in groups]
        elems_of = [sum(e for _, e in members) for members in buckets]

        hooks = sorted(set(t_ready.values()))

        def next_poll(t):
            """The optimizer looks at returned scalers from backward hooks and in synchronize(): the first
            hook at or after t (hooks move later as backward is delayed), else the end of backward."""
            shift = state["bwd_end"] - (fwd + bwd)
            return next((h + shift for h in hooks if h + shift >= t and h + shift < state["bwd_end"]),
                        max(t, state["bwd_end"]))

        def after_scaler(b):
            elems = elems_of[b]

            def done(t):
                t0 = max(next_poll(t), state["main_free"])
                enc = codec["encode"](elems)
                state["codec"] += enc
                if t0 < state["bwd_end"]:  # encoded from a backward hook: backward waits for it
                    state["bwd_end"] += enc
                else:  # in synchronize(): collectives in flight meanwhile run beside compute
                    stalls.append((t0, t0 + enc))
                state["main_free"] = t0 + enc
                done_at[("encoded", b)] = t0 + enc
                if transport == "allgather":
                    tensors = len(buckets[b])
                    submit(t0 + enc, "allgather_u8", (elems + 3) // 4 + 24 * tensors, sent(b), fuse="gather")
                elif transport == "summed":
                    submit(t0 + enc, "allreduce_fp16", 2 * elems, sent(b), fuse="sum")
                drain()
            return done

        def sent(b):
            def done(t):
                done_at[("sent", b)] = t
                drain()
            return done

        def drain():
            """synchronize() encodes every bucket, then decodes them in order as their codes arrive: each decode
            is main-thread work beside the collectives still in flight."""
            if transport != "summed-int8" and all(("encoded", b) in done_at for b in range(len(buckets))):
                in_order(decodes)

        decodes = [codec["decode"](e) for e in elems_of]
        if transport != "summed-int8":  # (its decodes follow its blocking sums, below)
            state["codec"] += sum(decodes)
        for b, members in enumerate(buckets):
            submit(max(t_ready[n] for n, _ in members), "allreduce_fp32", 16 * len(members), after_scaler(b),
                   fuse="max")

    chan = 0.0
    last_end = 0.0
    while queue:
        queue.sort(key=lambda q: (q[0], q[1]))
        t, _, kind, nbytes, done, fuse = queue.pop(0)
        start = max(chan, t)
        dones = [done]
        if fuse:  # fuse what is waiting when the channel frees up
            scale = host.nodes if kind.startswith("allgather") else 1
            i = 0
            while i < len(queue) and queue[i][0] <= start:
                q = queue[i]
                if q[5] == fuse and q[2] == kind and (nbytes + q[3]) * scale <= FUSION_BYTES:
                    nbytes += q[3]
                    dones.append(q[4])
                    queue.pop(i)
                else:
                    i += 1
        cost = curves[kind](nbytes)
        state["comm"] += cost
        chan = start + cost
        r, f = host.beside_compute(kind, nbytes, cost)
        if start < state["bwd_end"]:
            # beside backward the call runs `stretch` times slower, and slows backward by `cpu_fraction`
            beside = min(cost * r, state["bwd_end"] - start)  # seconds of the call spent beside backward
            state["bwd_end"] += f * beside
            chan = start + beside + (cost - beside / r)
        for s0, s1 in sorted(stalls):  # main-thread codec work after backward slows the call the same way
            if s1 > start and s0 < chan:
                chan += (min(s1, chan) - max(s0, start)) * (1 - 1 / r)
        last_end = max(last_end, chan)
        if trace is not None:
            trace.append((start, chan, kind, nbytes, state["bwd_end"]))
        for done in dones:
            if done is not None:
                done(chan)
    t = max(state["bwd_end"], state["main_free"])
    if transport == "summed-int8":  # synchronize(): a blocking int8 sum, then the decode, per bucket
        for b, elems in enumerate(elems_of):
            cost = curves["allreduce_int8"](elems)
            dec = codec["decode"](elems)
            state["comm"] += cost
            state["codec"] += dec
            t = max(t, done_at[("encoded", b)]) + cost + dec
    t = max(t, last_end, state["main_free"]) + update
    busy = comp["step"] + state["codec"] + state["comm"]
    return {"compute": comp["step"], "codec": state["codec"], "comm": state["comm"], "overlap": busy - t,
            "total": t}


def validate_host(sweep: dict, hosts: dict, overlap: bool = True) -> list[dict]:
    out = []
    for r in sweep["rows"]:
        host = hosts.get((r["profile"], r["nodes"]))
        probe = r.get("compute_probe")  # measured by the same job between its timed iterations
        if host is None or (probe is None and f"{r['model']}:{r['batch_size']}" not in host.compute):
            continue
        method = r.get("method") or r["compression"]
        method = "terngrad" if method == "terngrad:allgather" else method
        p = host_step_seconds(method, r["model"], r["batch_size"], host, overlap, compute=probe)
        meas = r["step_seconds"]
        out.append({"model": r["model"], "profile": r["profile"], "nodes": r["nodes"], "method": method,
                    "predicted_ms": p["total"] * 1e3, "measured_ms": meas * 1e3,
                    "error": p["total"] / meas - 1,  # (predicted - measured) / measured
                    "parts_ms": {k: v * 1e3 for k, v in p.items() if k != "total"}})
    return out


def load_codec(path: Path) -> Codec:
    rows = json.loads(path.read_text())["cpu"]
    r = min((r for r in rows if r["threads"] == 1), key=lambda r: abs(r["n"] - 16 * 2**20))
    return Codec(r["stats"] * 1e9, r["encode"] * 1e9, r["decode"] * 1e9)


def validate(sweep: dict, compute: dict, codec: Codec, cores: int) -> list[dict]:
    out = []
    for r in sweep["rows"]:
        c = compute.get(r["model"])
        if c is None:
            continue
        probe = sweep["probes"][r["profile"]]
        link = Link(probe["bandwidth_MBps"] * 1e6, (probe.get("rtt_ms") or 0.05) / 2e3)
        n = r["nodes"]
        share = max(1.0, n / cores)
        method = r.get("method") or r["compression"]
        method = "terngrad" if method == "terngrad:allgather" else method
        s = Split(c["coded"], c["tensors"], c["floats"])
        scale = r["batch_size"] / c["batch"]
        p = step_seconds(method, s, n, c["step"] * scale * share, c["backward"] * scale * share, link, codec)
        p_codec = p["codec"] * share
        pred = p["total"] - p["codec"] + p_codec
        out.append({"model": r["model"], "profile": r["profile"], "nodes": n, "method": method,
                    "predicted_ms": pred * 1e3, "measured_ms": r["step_seconds"] * 1e3,
                    "error": pred / r["step_seconds"] - 1})
    return out


# ---------------------------------------------------------------------------------------------
# The paper's three networks. Parameters: AlexNet 61.0 M (Krizhevsky et al., NIPS 2012), GoogLeNet 6.8 M
# (Szegedy et al., CVPR 2015, Table 1), VGG-A 132.9 M (Simonyan & Zisserman, ICLR 2015, Table 2).
# Per-GPU throughput: TensorFlow's published benchmarks (tensorflow.org/performance/benchmarks, May 2017,
# one Tesla P100, synthetic ImageNet): AlexNet 2987 img/s at batch 512, VGG16 154 img/s at batch 64,
# InceptionV3 142 img/s at batch 64. VGG-A and GoogLeNet are not in that table; they are scaled from VGG16
# and InceptionV3 by forward operation counts (Canziani et al., "An Analysis of Deep Neural Network Models
# for Practical Applications", 2016: VGG-16 15.5, VGG-11/A 7.6, Inception-v3 5.7, GoogLeNet 1.5 G-ops).
PAPER_MODELS = {
    "AlexNet": {"params": 61.0e6, "fc_share": 58.6 / 61.0, "img_s": 2987.0, "batch": 512},
    "GoogLeNet": {"params": 6.8e6, "fc_share": 1.0 / 6.8, "img_s": 142.0 * 5.7 / 1.5, "batch": 64},
    "VGG-A": {"params": 132.9e6, "fc_share": 123.6 / 132.9, "img_s": 154.0 * 15.5 / 7.6, "batch": 64},
}
# The paper's two clusters (Figure 5): 1 Gbps Ethernet between nodes with PCIe inside them, and 100 Gbps
# InfiniBand between nodes with NVLink inside them; 128 nodes x 4 GPUs = 512 GPUs.
CLUSTERS = {
    "1 Gbps Ethernet + PCIe": {"inter": Link(125e6, 50e-6), "intra": Link(12e9, 10e-6), "gpus_per_node": 4},
    "100 Gbps InfiniBand + NVLink": {"inter": Link(12.5e9, 5e-6), "intra": Link(80e9, 5e-6), "gpus_per_node": 4},
}
GPU_CODEC = Codec(440e9, 440e9, 440e9)  # 0.6 x P100 memory bandwidth (732 GB/s), the codec issue's GPU goal


def extrapolate(out_dir: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [2**k for k in range(10)]  # 1 .. 512
    methods = {"fp32": "FP32", "terngrad": "TernGrad allgather", "terngrad:summed": "TernGrad summed"}
    fig, axes = plt.subplots(len(CLUSTERS), len(PAPER_MODELS), figsize=(15, 8), squeeze=False)
    summary = {}
    for i, (cname, cl) in enumerate(CLUSTERS.items()):
        for j, (mname, m) in enumerate(PAPER_MODELS.items()):
            s = Split(int(m["params"] * 0.999), 20, int(m["params"] * 0.001))
            compute = m["batch"] / m["img_s"]
            backward = compute * 2 / 3
            ax = axes[i][j]
            curves = {}
            for meth, label in methods.items():
                ys = []
                for n in gpus:
                    t = step_seconds(meth, s, n, compute, backward, cl["inter"], GPU_CODEC,
                                     hier=(cl["gpus_per_node"], cl["intra"]))["total"]
                    ys.append(n * m["batch"] / t)
                curves[meth] = ys
                ax.plot(gpus, ys, marker="o", ms=3, label=label)
            ax.plot(gpus, [n * m["img_s"] for n in gpus], "k:", lw=1, label="linear")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{mname} — {cname}", fontsize=9)
            ax.set_xlabel("GPUs")
            ax.set_ylabel("img/s")
            ax.grid(alpha=0.3)
            cross = next((n for n, a, b in zip(gpus, curves["terngrad"], curves["terngrad:summed"]) if b > a), None)
            nodes = None if cross is None else max(1, cross // cl["gpus_per_node"])
            summary[f"{mname} / {cname}"] = {
                "speedup_terngrad_512": curves["terngrad"][-1] / curves["fp32"][-1],
                "speedup_summed_512": curves["terngrad:summed"][-1] / curves["fp32"][-1],
                "summed_beats_allgather_from_gpus": cross, "from_nodes": nodes}
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Performance model: training throughput, 1 to 512 GPUs (4 per node)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "perf_model.png", dpi=110)
    (out_dir / "perf_model.json").write_text(json.dumps(summary, indent=1))
    return summary


def validation_table(rows: list[dict]) -> str:
    parts = any("parts_ms" in r for r in rows)
    lines = ["| model | profile | nodes | method | predicted step (ms) | measured (ms) | error (pred/meas - 1) |"
             + (" compute / codec / comm (ms) |" if parts else ""),
             "|---|---|---:|---|---:|---:|---:|" + ("---|" if parts else "")]
    for r in rows:
        flag = "" if abs(r["error"]) <= 0.15 else " **"
        line = (f"| {r['model']} | {r['profile']} | {r['nodes']} | {r['method']} | {r['predicted_ms']:.1f} | "
                f"{r['measured_ms']:.1f} | {r['error']:+.0%}{flag} |")
        if parts:
            q = r["parts_ms"]
            line += f" {q['compute']:.0f} / {q['codec']:.1f} / {q['comm']:.0f} |"
        lines.append(line)
    ok = sum(abs(r["error"]) <= 0.15 for r in rows)
    errs = sorted(abs(r["error"]) for r in rows)
    lines.append(f"\nwithin +-15%: {ok} of {len(rows)}; median |error| {errs[len(errs) // 2]:.0%}, "
                 f"worst {errs[-1]:.0%}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("measure")
    p.add_argument("--models", default="alexnet,vgg,googlenet,mlp,wide")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="results/compute.json")
    p = sub.add_parser("validate")
    p.add_argument("sweep", nargs="+")
    p.add_argument("--compute", default="results/compute.json")
    p.add_argument("--codec", default="docs/codec-bench.json")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--calibration", nargs="*", default=None,
                   help="calibration JSON files (benchmarks/calibrate.py, or a sweep run with --calibrate); "
                        "they replace, for the clusters they cover, each sweep file's own 'calibration' entries")
    p.add_argument("--link-only", action="store_true",
                   help="the link-probe model: 1-worker compute scaled by N/cores, probed link bandwidth")
    p.add_argument("--no-overlap", action="store_true", help="start every collective after backward")
    p.add_argument("--markdown", help="also write the table here")
    p = sub.add_parser("extrapolate")
    p.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        res = measure(args.models.split(","), args.batch_size, args.reps)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        return 0
    if args.cmd == "validate":
        sweeps = [json.loads(Path(path).read_text()) for path in args.sweep]
        rows = []
        if args.link_only:
            compute = json.loads(Path(args.compute).read_text())
            codec = load_codec(Path(args.codec))
            for sw in sweeps:
                rows += validate(sw, compute, codec, args.cores)
        else:
            extra = [c for path in args.calibration or [] for c in json.loads(Path(path).read_text())["calibration"]]
            if not extra and not all(sw.get("calibration") for sw in sweeps):
                print("validate: no calibration (run benchmarks/calibrate.py or sweep.py --calibrate), "
                      "or pass --link-only", file=sys.stderr)
                return 2
            for sw in sweeps:  # each sweep's rows against its own clusters' calibration
                hosts = {(c["profile"], c["nodes"]): Host.from_json(c) for c in sw.get("calibration", []) + extra}
                rows += validate_host(sw, hosts, not args.no_overlap)
        text = validation_table(rows)
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text + "\n")
        return 0
    summary = extrapolate(Path(args.out))
    print("| model / cluster | TernGrad allgather / FP32 at 512 GPUs | summed / FP32 at 512 | "
          "summed beats allgather from |")
    print("|---|---:|---:|---|")
    for k, v in summary.items():
        frm = ("never (<= 512)" if v["from_nodes"] is None
               else f"{v['summed_beats_allgather_from_gpus']} GPUs ({v['from_nodes']} nodes)")
        print(f"| {k} | {v['speedup_terngrad_512']:.1f}x | {v['speedup_summed_512']:.1f}x | {frm} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
