"""results/README.md: each folder and file under results/, the command that wrote it, and the pages that cite it.

    python -m benchmarks.results_index            # writes results/README.md
    python -m benchmarks.results_index --check    # exit 1 where results/README.md is not what this writes

The command comes from the folder itself: a `*.cmd` file beside the results (the exact commands, as run), else
what its JSON records (the time-to-accuracy benchmark's tasks, profiles, nodes, seeds and methods; the sweep's
models, profiles, node counts and methods), else the page that cites it says how it was made. A folder no page
cites is listed as such: a candidate to fold into another or to delete.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = [p for d in ("hvd_terngrad", "benchmarks", "tests", "examples", "scripts") for p in sorted((ROOT / d).rglob("*"))
        if p.suffix in (".py", ".sh")] + [ROOT / "Makefile"]


def _join(values) -> str:
    return ",".join(str(v) for v in sorted(set(values), key=lambda v: (str(type(v)), v)))


# The JSON a benchmark writes beside its results, and how its command reads back from it: the module, the key of
# its records, and each flag with the record field whose values it joins. A flag the JSON also records at its
# top (the time-to-accuracy job's nodes) takes that value.
FROM_JSON = (
    ("time_to_accuracy.json", "benchmarks.time_to_accuracy", "runs",
     (("tasks", "task"), ("profiles", "profile"), ("nodes", "workers"), ("seeds", "seed"), ("methods", "method"))),
    ("sweep.json", "benchmarks.sweep", "rows",
     (("models", "model"), ("profiles", "profile"), ("nodes", "nodes"), ("methods", "method"))),
)


def _from_json(data: dict, module: str, key: str, flags, out: str) -> str:
    rows = data.get(key, [])
    if not rows:
        return ""
    args = " ".join(f"--{flag} {data[flag] if flag in data else _join(r[field] for r in rows)}"
                    for flag, field in flags)
    return f"python -m {module} {args} --out {out}"


def command(entry: Path) -> str:
    """The command that wrote `entry` (a folder or a file under results/), or '' where only its page says."""
    rel = entry.relative_to(ROOT).as_posix()
    if entry.is_dir():
        cmds = sorted(entry.glob("*.cmd"))
        if cmds:
            return "; ".join(line for c in cmds for line in c.read_text().splitlines()
                             if line.strip() and not line.startswith("#"))
        for name, module, key, flags in FROM_JSON:
            if (entry / name).exists():
                try:
                    return _from_json(json.loads((entry / name).read_text()), module, key, flags, rel)
                except (ValueError, KeyError, TypeError):
                    return ""
    return ""


def citing(entry: Path) -> list[str]:
    """The pages (and code) that name `entry`'s path."""
    rel = entry.relative_to(ROOT).as_posix()
    pat = re.compile(re.escape(rel) + r"(?![\w-])")
    return [p.relative_to(ROOT).as_posix() for p in PAGES + CODE if pat.search(p.read_text(errors="replace"))]


def render() -> str:
    lines = ["# results/", "",
             "What each folder and file here holds is on the page that cites it; the command is the one that wrote",
             "it, from a `.cmd` file beside it or from what its JSON records (`python -m benchmarks.results_index`",
             "writes this page; `tests/test_docs.py` checks it is current). Each figure on a page names its",
             "machine and CPU.", "",
             "| path | written by | cited in |", "|---|---|---|"]
    for entry in sorted(p for p in RESULTS.iterdir() if p.name != "README.md" and not p.name.startswith(".")):
        cmd = command(entry)
        pages = citing(entry)
        cmd_cell = f"`{cmd}`" if cmd else "the citing page says"
        lines.append(f"| `{entry.name}{'/' if entry.is_dir() else ''}` | {cmd_cell} | "
                     f"{', '.join(pages) if pages else '**no page**'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    text = render()
    target = RESULTS / "README.md"
    if args.check:
        if not target.exists() or target.read_text() != text:
            print("results/README.md is not current: python -m benchmarks.results_index", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
