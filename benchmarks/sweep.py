"""Throughput sweep on emulated clusters: {models} x {fp32, fp16, terngrad} x {ethernet-1g, fast} x {2, 4} nodes.

    python -m benchmarks.sweep                 # the full sweep (about 12 minutes on 2 cores)
    python -m benchmarks.sweep --calibrate     # and the performance model's inputs per cluster (16 minutes)
    python -m benchmarks.sweep --quick         # fewer iterations
    python -m benchmarks.sweep --models alexnet --nodes 2,4,8 --profiles ethernet-1g --methods fp32,terngrad:summed

Every configuration runs in the same sweep, so the ratios are side by side. Writes into --out (default
results/): sweep.json (every run, the probed links, wire-byte counters, with --calibrate the
calibration of every cluster and each run's compute probe), sweep.png (throughput against
nodes, one panel per profile, in the manner of the paper's Figure 5) and sweep.md (speedup table with
TernGrad's per-phase time).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.calibrate import calibrate, summary
from benchmarks.cluster import PROFILES, ClusterUnavailable, EmulatedCluster
from hvd_terngrad.methods import parse_method


def run_one(cluster: EmulatedCluster, model: str, method: str, args) -> dict:
    """One synthetic.py job of `method` (hvd_terngrad/methods.py) on the cluster; its result row."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        out = Path(f.name)
    argv = [sys.executable, "-m", "benchmarks.synthetic", "--model", model, "--method", method,
            "--batch-size", str(args.batch_size), "--num-warmup-batches", str(args.warmup),
            "--num-batches-per-iter", str(args.per_iter), "--num-iters", str(args.iters), "--iface", "eth0",
            "--json", str(out)] + (["--compute-probe", "1"] if args.calibrate else [])
    t0 = time.perf_counter()
    hier = "hier" in parse_method(method).options  # registers process sets after hvd.init()
    res = cluster.run(argv, timeout=args.timeout, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"} if hier else None)
    try:
        if res.returncode != 0 or not out.read_text().strip():
            raise RuntimeError(f"{model}/{method} on {cluster.describe()} failed (exit {res.returncode}):\n"
                               f"{res.stdout[-3000:]}")
        row = json.loads(out.read_text().strip().splitlines()[-1])
    finally:
        out.unlink(missing_ok=True)
    row.update({"profile": cluster.profile.name, "nodes": cluster.nodes, "ranks_per_node": cluster.ranks_per_node,
                "method": method,
                "wall_seconds": time.perf_counter() - t0})
    return row


def run_recorded(cluster: EmulatedCluster, model: str, method: str, args, rows: list, failures: list) -> str:
    """run_one, its row added to rows; with --keep-going a job that failed or ran past --timeout goes to
    failures instead of ending the sweep. The progress line."""
    where = f"{cluster.profile.name:>11} N={cluster.nodes} {model:>9} {method:>8}"
    try:
        row = run_one(cluster, model, method, args)
    except (RuntimeError, TimeoutError) as exc:
        if not args.keep_going:
            raise
        reason = str(exc).splitlines()[0]
        failures.append({"model": model, "method": method, "profile": cluster.profile.name, "nodes": cluster.nodes,
                         "reason": reason, "error": str(exc)[-3000:]})
        return f"{where}: FAILED, {reason}"
    rows.append(row)
    return (f"{where}: {row['img_sec_total']:8.1f} img/s (+-{row['img_sec_conf'] * cluster.nodes:.1f}), "
            f"wire {row['wire_tx_per_step']:,.0f} B/step")


def _method(r: dict) -> str:
    return parse_method(r.get("method") or r["compression"]).name


def _index(rows: list[dict]) -> dict:
    """Rows by (model, profile, nodes, method)."""
    return {(r["model"], r["profile"], r["nodes"], _method(r)): r for r in rows}


def transport_table(rows: list[dict]) -> str:
    """img/s of each TernGrad transport side by side, and which one wins."""
    methods = sorted({_method(r) for r in rows if r["compression"] == "terngrad"})
    if len(methods) < 2:
        return ""
    idx = _index(rows)
    keys = sorted({(r["model"], r["profile"], r["nodes"]) for r in rows})
    lines = ["| model | profile | nodes | " + " | ".join(f"{m} img/s" for m in methods) + " | fastest |",
             "|---|---|---:|" + "---:|" * len(methods) + "---|"]
    for k in keys:
        vals = {m: idx[(*k, m)]["img_sec_total"] for m in methods if (*k, m) in idx}
        if not vals:
            continue
        best = max(vals, key=vals.get)
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(
            f"{vals[m]:.0f}" if m in vals else "" for m in methods) + f" | {best} |")
    return "\n".join(lines)


def speedup_table(rows: list[dict]) -> str:
    """Every TernGrad method against FP32 and fp16 of its own front end (Horovod's, or DDP's for ddp: methods)
    at the same point, with its step's phases; a blank where that baseline did not run."""
    idx = _index(rows)
    lines = ["| model | profile | nodes | method | FP32 img/s | fp16 img/s | TernGrad img/s | TernGrad/FP32 | "
             "TernGrad/fp16 | TernGrad step: encode / comm / decode / rest (ms) | "
             "wire bytes/step/node: FP32 / TernGrad |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|---|"]

    def fmt(value, spec, suffix=""):
        return "" if value is None else f"{value:{spec}}{suffix}"

    for (model, prof, n, m), t in sorted(idx.items()):
        if t["compression"] != "terngrad":
            continue
        front = "ddp:" if m.startswith("ddp:") else ""
        f32, f16 = idx.get((model, prof, n, front + "fp32")), idx.get((model, prof, n, front + "fp16"))
        v32, v16 = (b["img_sec_total"] if b else None for b in (f32, f16))
        mine = t["img_sec_total"]
        step = t["step_seconds"] * 1e3
        enc, com, dec = (t.get(k, 0.0) * 1e3 for k in ("time_encode", "time_comm", "time_decode"))
        rest = step - enc - com - dec
        lines.append(
            f"| {model} | {prof} | {n} | {m} | {fmt(v32, '.0f')} | {fmt(v16, '.0f')} | {mine:.0f} | "
            f"{fmt(v32 and mine / v32, '.2f', 'x')} | {fmt(v16 and mine / v16, '.2f', 'x')} | "
            f"{enc:.1f} / {com:.1f} / {dec:.1f} / {rest:.1f} | "
            f"{fmt(f32 and f32['wire_tx_per_step'], ',.0f')} / {t['wire_tx_per_step']:,.0f} |")
    return "\n".join(lines)


def ceiling_table(rows: list[dict]) -> str:
    """Every method against `local` (no gradient exchange) on the same cluster: the share of that ceiling it
    reaches, and the CPU time a worker spends on a step (for TernGrad also its coding's: statistics, codes,
    owners' replies, decoding; the last step of each timing). Where nodes share cores, CPU a worker spends
    beyond local's is compute taken from the others."""
    idx = _index(rows)
    lines = ["| model | profile | nodes | method | img/s | share of local | CPU ms/step/worker: training thread + "
             "others | CPU beyond local | of which TernGrad's coding |",
             "|---|---|---:|---|---:|---:|---|---:|---:|"]
    for (model, prof, n, m), r in sorted(idx.items()):
        top = idx.get((model, prof, n, "local"))
        if top is None or m == "local" or "cpu_seconds_per_step" not in r:
            continue
        cpu, base = r["cpu_seconds_per_step"] * 1e3, top["cpu_seconds_per_step"] * 1e3
        main = r.get("main_cpu_seconds_per_step", 0.0) * 1e3
        split = f"{cpu:.0f}: {main:.0f} + {cpu - main:.0f}" if main else f"{cpu:.0f}"
        coding = f"{(r['cpu_encode'] + r['cpu_decode']) * 1e3:.0f}" if "cpu_encode" in r else ""
        lines.append(f"| {model} | {prof} | {n} | {m} | {r['img_sec_total']:.0f} | "
                     f"{r['img_sec_total'] / top['img_sec_total']:.0%} of {top['img_sec_total']:.0f} | "
                     f"{split} | {cpu - base:+.0f} | {coding} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def plot(rows: list[dict], probes: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({r["profile"] for r in rows})
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(profiles), figsize=(6 * len(profiles), 4.5), squeeze=False)
    styles = {"local": ("+:", "no exchange (ceiling)"), "fp32": ("o-", "FP32"), "fp16": ("s--", "fp16"),
              "terngrad": ("^-", "TernGrad"),
              "terngrad:summed": ("v:", "TernGrad summed"), "terngrad:summed-int8": ("d:", "TernGrad int8"),
              "terngrad:auto": ("x-.", "TernGrad auto")}
    colors = dict(zip(models, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, prof in zip(axes[0], profiles):
        for m in models:
            for comp, (style, label) in styles.items():
                pts = sorted((r["nodes"], r["img_sec_total"]) for r in rows
                             if r["profile"] == prof and r["model"] == m and _method(r) == comp)
                if pts:
                    ax.plot(*zip(*pts), style, color=colors[m], label=f"{m} {label}")
        bw = probes.get(prof, {}).get("bandwidth_MBps")
        ax.set_title(f"{prof}" + (f" (measured {bw:,.0f} MB/s per link)" if bw else ""))
        ax.set_xlabel("nodes (1 worker each)")
        ax.set_ylabel("training throughput, img/s (all workers)")
        ax.set_xticks(sorted({r["nodes"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("Synthetic training throughput on emulated clusters (CPU workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="alexnet,vgg,googlenet,mlp")
    ap.add_argument("--methods", default="fp32,fp16,terngrad",
                    help="fp32, fp16, terngrad, or terngrad:<modifiers> (hvd_terngrad/methods.py); local for the "
                         "ceiling")
    ap.add_argument("--profiles", default="ethernet-1g,fast")
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--ranks-per-node", type=int, default=1,
                    help="ranks on every emulated node, sharing its link (as GPUs of one machine)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--per-iter", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="1 warm-up batch, 2 iterations of 2 batches")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="results")
    ap.add_argument("--keep-going", action="store_true",
                    help="a run that fails is recorded (sweep.json's failures, and sweep.md) and the sweep goes on")
    ap.add_argument("--calibrate", action="store_true",
                    help="on every cluster, first measure the performance model's inputs (benchmarks/calibrate.py) "
                         "into sweep.json, for benchmarks/perf_model.py validate")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.per_iter, args.iters = 1, 2, 2
    models = args.models.split(",")
    comps = [parse_method(m).name for m in args.methods.split(",")]
    profiles = args.profiles.split(",")
    nodes = [int(n) for n in args.nodes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total = len(models) * len(comps) * len(profiles) * len(nodes)
    from tqdm import tqdm

    rows, probes, cals, failures = [], {}, [], []
    bar = tqdm(total=total, desc="sweep", ascii=True, file=sys.stdout)
    try:
        for prof in profiles:
            for n in nodes:
                with EmulatedCluster(n, PROFILES[prof], ranks_per_node=args.ranks_per_node) as c:
                    if prof not in probes:
                        probes[prof] = c.probe() if n >= 2 else {}
                        bar.write(f"{prof}: {json.dumps(probes[prof])}")
                    if args.calibrate and n >= 2:
                        cals.append(calibrate(c, ",".join(f"{m}:{args.batch_size}" for m in models)))
                        bar.write(summary(cals[-1]))
                    for m in models:
                        for comp in comps:
                            bar.write(run_recorded(c, m, comp, args, rows, failures))
                            bar.update(1)
                            (out / "sweep.json").write_text(json.dumps(
                                {"probes": probes, "rows": rows, **({"calibration": cals} if cals else {}),
                                 **({"failures": failures} if failures else {})}, indent=1))
    except ClusterUnavailable as exc:
        print(f"sweep: cannot emulate a cluster here: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    table = speedup_table(rows)
    ttable = transport_table(rows)
    if ttable:
        table += "\n\nTernGrad transports:\n\n" + ttable
    ctable = ceiling_table(rows)
    if ctable:
        table += "\n\nAgainst no exchange (`local`), and the CPU time of a step:\n\n" + ctable
    if failures:
        table += "\n\nFailed runs (--keep-going; the error's end in sweep.json):\n\n" + "\n".join(
            f"* {f['model']} {f['profile']} N={f['nodes']} {f['method']}: {f['reason']}"
            for f in failures)
    (out / "sweep.md").write_text(table + "\n")
    if rows:
        plot(rows, probes, out / "sweep.png")
    print("\n" + table)
    print(f"\nwrote {out / 'sweep.json'}, {out / 'sweep.md'}, {out / 'sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
