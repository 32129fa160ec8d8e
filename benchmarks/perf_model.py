"""Performance model: step time = compute + codec + communication - overlap, from measured parts.

    python -m benchmarks.sweep --calibrate                  # sweep, with this model's inputs measured per cluster
    python -m benchmarks.perf_model validate results/sweep.json results/transports/sweep.json
    python -m benchmarks.perf_model extrapolate             # 1..512 GPUs, the paper's two clusters -> results/
    python -m benchmarks.perf_model measure                 # compute per model, one worker -> results/compute.json

Two uses, one decomposition:

- The emulated cluster (validate): the calibrated timeline of benchmarks/timeline.py, whose inputs
  benchmarks/calibrate.py measures on the cluster itself.
- Real clusters (extrapolate): compute from published per-GPU throughput, the codec at a GPU's bandwidth,
  and hvd_terngrad/commcost.py's link formulas (ring allreduce, allgather, summed sums, the scaler
  allreduce; hierarchical with several GPUs per node). Overlap: communication hides behind backward up to
  the backward time.

`validate --link-only` applies the real-cluster formulas to the emulated cluster instead (1-worker compute
scaled by N/cores, the probed link), for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.models import build, synthetic_batch
from benchmarks.timeline import Host, host_step_seconds
from hvd_terngrad.auto import plan
from hvd_terngrad.commcost import Link
from hvd_terngrad.methods import Split, comm_seconds, parse_method, split_of


@dataclass(frozen=True)
class Codec:
    moments_Bps: float  # bytes of fp32 gradient per second
    encode_Bps: float
    decode4_Bps: float  # fp32 output bytes per second, 4 ranks

    def seconds(self, coded: int, n: int, sharded: bool = False) -> float:
        b = 4.0 * coded
        # decode reads n/4 bytes per rank and writes 4 per element: scale the 4-rank figure by traffic. A
        # sharded transport's decode does not grow with n: the owner sums n slices of 1/n of the codes each,
        # and every rank decodes the owners' replies once
        dec = b / self.decode4_Bps * (1.0 if sharded else (16 + n) / 20)
        return b / self.moments_Bps + b / self.encode_Bps + dec


# transport="auto" in the model: the coded gradient as one group, as the model sends every other method, coded
# with the transport of least link time among those auto may pick, or sent as FP32, by hvd_terngrad.auto.plan
AUTO_CODED = ("terngrad", "terngrad:summed", "terngrad:sharded")


def auto_seconds(s: Split, n: int, backward: float, link: Link, codec: Codec | None, hier=None) -> tuple[float, float]:
    """(link seconds, codec seconds) of transport="auto"'s plan, as hvd_terngrad.auto makes it, the window being
    the backward time."""
    coded = {m: comm_seconds(m, Split(s.coded, s.tensors, 0), n, link, hier) for m in AUTO_CODED}
    best = min(coded, key=coded.get)
    costs = {"floats": (comm_seconds("fp32", Split(0, 0, s.floats), n, link, hier),) * 2 + (0.0,),
             "coded": (comm_seconds("fp32", Split(0, 0, s.coded), n, link, hier), coded[best],
                       codec.seconds(s.coded, n, sharded="sharded" in best) if codec else 0.0)}
    chosen = plan(costs, backward)
    return (sum(c if k in chosen else u for k, (u, c, _) in costs.items()),
            sum(costs[k][2] for k in chosen))


def step_seconds(method: str, s: Split, n: int, compute: float, backward: float, link: Link, codec: Codec | None,
                 hier=None) -> dict:
    if method == "terngrad:auto" and n > 1:
        comm, cod = auto_seconds(s, n, backward, link, codec, hier)
    else:
        comm = comm_seconds(method, s, n, link, hier)
        cod = (codec.seconds(s.coded, n, sharded="sharded" in method)
               if (codec and method.startswith("terngrad") and n > 1) else 0.0)
    overlap = min(comm, backward) if n > 1 else 0.0
    return {"compute": compute, "codec": cod, "comm": comm, "overlap": overlap,
            "total": compute + cod + comm - overlap}


# ---------------------------------------------------------------------------------------------
def measure(models: list[str], batch: int, reps: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for m in models:
        model = build(m)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = synthetic_batch(batch, m)
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


def validate_host(sweep: dict, hosts: dict, overlap: bool = True) -> list[dict]:
    out = []
    for r in sweep["rows"]:
        host = hosts.get((r["profile"], r["nodes"]))
        probe = r.get("compute_probe")  # measured by the same job between its timed iterations
        if host is None or (probe is None and f"{r['model']}:{r['batch_size']}" not in host.compute):
            continue
        method = parse_method(r.get("method") or r["compression"]).name
        if method == "local":  # no exchange: nothing for the model to predict beyond the compute it measured
            continue
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
        method = parse_method(r.get("method") or r["compression"]).name
        if method == "local":
            continue
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
# The codec on a GPU at 0.6 x the P100's memory bandwidth (732 GB/s): each pass streams the gradient once.
GPU_CODEC = Codec(440e9, 440e9, 440e9)


def extrapolate(out_dir: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [2**k for k in range(10)]  # 1 .. 512
    methods = {"fp32": "FP32", "terngrad": "TernGrad allgather", "terngrad:summed": "TernGrad summed",
               "terngrad:sharded": "TernGrad sharded", "terngrad:sharded-ternary": "TernGrad sharded-ternary",
               "terngrad:sharded-ternary:hier": "TernGrad sharded-ternary, hierarchical",
               "terngrad:auto": "TernGrad auto"}
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
                "summed_beats_allgather_from_gpus": cross, "from_nodes": nodes,
                **{f"speedup_{meth}_512": curves[meth][-1] / curves["fp32"][-1]
                   for meth in methods if ":sharded" in meth},
                "speedup_terngrad:auto_512": curves["terngrad:auto"][-1] / curves["fp32"][-1],
                "auto_min_over_gpus": min(a / f for a, f in zip(curves["terngrad:auto"][1:], curves["fp32"][1:]))}
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
                print("validate: no calibration (run benchmarks.calibrate or benchmarks.sweep --calibrate), "
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
    print(extrapolation_table(summary))
    return 0


def extrapolation_table(summary: dict) -> str:
    """Each transport's throughput over FP32's at 512 GPUs, per model and cluster."""
    lines = ["| model / cluster | allgather | summed | sharded | sharded-ternary | sharded-ternary, hierarchical | "
             "auto | auto, lowest at 2-512 GPUs | summed beats allgather from |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for k, v in summary.items():
        frm = ("never (<= 512)" if v["from_nodes"] is None
               else f"{v['summed_beats_allgather_from_gpus']} GPUs ({v['from_nodes']} nodes)")
        lines.append(f"| {k} | {v['speedup_terngrad_512']:.1f}x | {v['speedup_summed_512']:.1f}x | "
                     f"{v['speedup_terngrad:sharded_512']:.1f}x | {v['speedup_terngrad:sharded-ternary_512']:.1f}x | "
                     f"{v['speedup_terngrad:sharded-ternary:hier_512']:.1f}x | {v['speedup_terngrad:auto_512']:.2f}x | "
                     f"{v['auto_min_over_gpus']:.2f}x | {frm} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
