"""What transport="auto"'s trial kept, and how each run then trained: over the runs of one or more
benchmarks.time_to_accuracy results, per task, profile and auto method, the kind kept (coded, or the plan in
fp32 or fp16), on how many seeds, and the run's training time against its own front end's FP32 on the same
seed in the same job (FP32's seconds over the run's: above 1.0x, faster).

    python -m benchmarks.auto_kinds results/time_to_accuracy_side_fast results/time_to_accuracy_noise_fast

Where the kinds train alike, the trial's verdict costs nothing whichever it keeps; where one kind trains
slower than another, how often the trial keeps it is what the verdict costs (docs/notes/tta-history.md, "The
trial's noise"). The trial's own step noise is shown where the results record it (AutoPlan.summary).
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def kept_kind(auto: dict) -> str:
    """The kind a run's auto kept, from its summary: "coded", "coded (<transport>)", or the plan's wire."""
    if auto["kept"] is None:
        return "coded"
    tried = auto["tried"][auto["kept"]]
    if "uncoded" not in tried:  # every group coded with one transport
        return f"coded ({tried['transport']})"
    return tried["uncoded"] + ("" if not tried["coding"] else " (some groups coded)")


def fp32_of(method: str) -> str:
    """The FP32 method of a method's front end."""
    return "ddp:fp32" if method.startswith("ddp:") else "fp32"


def with_fp32(runs: list[dict]):
    """(run, its front end's FP32 run on the same task, profile and seed) for every other run that has one."""
    ref = {(r["task"], r["profile"], r["method"], r["seed"]): r for r in runs}
    for r in runs:
        fp32 = ref.get((r["task"], r["profile"], fp32_of(r["method"]), r["seed"]))
        if fp32 is not None and fp32 is not r:
            yield r, fp32


def rows(results: list[dict]) -> dict:
    """(task, profile, method, kind) -> [(FP32's training seconds over the run's, the trial's noise or None)],
    over every auto run whose FP32 ran in the same results, on the same seed."""
    out = defaultdict(list)
    for res in results:
        for r, fp32 in with_fp32(res["runs"]):
            if not r.get("auto"):
                continue
            key = (r["task"], r["profile"], r["method"], kept_kind(r["auto"]))
            out[key].append((fp32["seconds"] / r["seconds"], r["auto"].get("step_noise")))
    return dict(out)


def table(found: dict) -> str:
    """Markdown: a row per task, profile, auto method and kind kept."""
    lines = ["| task | profile | method | kept | seeds | training time against FP32, median (range) | trial's "
             "noise, median |", "|---|---|---|---|---:|---|---:|"]
    for (task, profile, method, kind), got in sorted(found.items()):
        ratios = [x for x, _ in got]
        noise = [n for _, n in got if n is not None]
        lines.append(f"| {task} | {profile} | {method} | {kind} | {len(got)} | {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) | "
                     + (f"{100 * statistics.median(noise):.1f}%" if noise else "-") + " |")
    return "\n".join(lines)


def read_results(argv, doc: str) -> list[tuple[str, dict]]:
    """The results named on a command line (folders, or their time_to_accuracy.json): (folder name, results)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="results folders (or their time_to_accuracy.json)")
    paths = [Path(p) / "time_to_accuracy.json" if Path(p).is_dir() else Path(p) for p in ap.parse_args(argv).results]
    return [(p.parent.name, json.loads(p.read_text())) for p in paths]


def main(argv=None) -> int:
    print(table(rows([res for _, res in read_results(argv, __doc__)])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
