"""The module map of docs/architecture.md, drawn from the code: each module of hvd_terngrad/, its size, its
largest class, and which of the package's modules it imports (when imported, and when first used).

    python scripts/module_map.py            rewrite the map in docs/architecture.md
    python scripts/module_map.py --check    exit 1 where the page's map is not the code's, or a rule is broken
    python scripts/module_map.py --sizes    the modules and their largest classes by lines, largest first

The rules the page states, checked here: no front end imports another, and the pipeline names no implementation
of the Collectives protocol. Imports under `if TYPE_CHECKING:` are annotations only and count for neither.
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hvd_terngrad"
PAGE = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- module map: python scripts/module_map.py -->"
END = "<!-- end of the module map -->"
FRONT_ENDS = ("compression", "optimizer", "ddp")  # each with the modules under it
IMPLEMENTATIONS = ("collectives.horovod", "collectives.distributed", "collectives.loopback")
# what the pipeline may name of them: the world of copies of one rank that transport="auto" rehearses coding on
MIRROR = ("collectives.loopback", "MirrorCollectives")


def modules() -> dict[str, pathlib.Path]:
    """Every module by its name under the package ("ddp.hook"; a package by its folder: "ddp")."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name or "(package)"] = path
    return out


def _targets(node: ast.AST, known: dict) -> list[tuple[str, str | None]]:
    """(module, name) for what an import statement takes from the package: a name imported from a package that
    is a module of its own counts as that module; a private name from the package itself is a C++ extension."""
    if isinstance(node, ast.Import):
        pairs = [(a.name, None) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        pairs = [(f"{node.module}.{a.name}", None) if _short(f"{node.module}.{a.name}") in known
                 or (node.module == "hvd_terngrad" and a.name.startswith("_")) else (node.module, a.name)
                 for a in node.names]
    else:
        return []
    return [(_short(m), n) for m, n in pairs if m == "hvd_terngrad" or m.startswith("hvd_terngrad.")]


def _short(module: str) -> str:
    return "(package)" if module == "hvd_terngrad" else module[len("hvd_terngrad."):]


def imports(path: pathlib.Path, known: dict) -> tuple[set[str], set[str], set[tuple[str, str | None]]]:
    """(modules imported when this one is, modules imported only inside its functions, every (module, name))."""
    tree = ast.parse(path.read_text())
    now, later, pairs = set(), set(), set()

    def walk(node, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            found = _targets(child, known)
            pairs.update(found)
            (later if lazy else now).update(m for m, _ in found)
            walk(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return now, later - now, pairs


def largest_class(path: pathlib.Path) -> tuple[str, int]:
    classes = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(path.read_text()))
               if isinstance(n, ast.ClassDef)]
    return max(classes, key=lambda c: c[1], default=("", 0))


def _front_end(name: str) -> str | None:
    return next((f for f in FRONT_ENDS if name == f or name.startswith(f + ".")), None)


def table() -> tuple[str, list[str]]:
    """The map as markdown, and the rules it breaks."""
    known = modules()
    rows = ["| module | largest class | imports | imports when used |", "|---|---|---|---|"]
    broken = []
    for name, path in known.items():
        now, later, pairs = imports(path, known)
        now.discard(name)
        fmt = lambda s: ", ".join(sorted(s)) or "-"  # noqa: E731
        rows.append(f"| `{name}` | {largest_class(path)[0] or '-'} | {fmt(now)} | {fmt(later)} |")
        mine = _front_end(name)
        for other in now | later:
            theirs = _front_end(other)
            if mine and theirs and theirs != mine:
                broken.append(f"the front end {name} imports the front end {other}")
        if name == "pipeline":
            broken += [f"the pipeline imports {m}.{n or ''}, an implementation of Collectives"
                       for m, n in sorted(pairs, key=str) if m in IMPLEMENTATIONS and (m, n) != MIRROR]
    return "\n".join(rows), broken


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where the page is stale or a rule is broken")
    ap.add_argument("--sizes", action="store_true", help="print the sizes of modules and classes, largest first")
    args = ap.parse_args(argv)
    if args.sizes:
        sizes = [(len(p.read_text().splitlines()), name, *largest_class(p)) for name, p in modules().items()]
        for lines, name, cls, n in sorted(sizes, reverse=True):
            print(f"{lines:5d}  {name:28s} {cls} ({n})" if cls else f"{lines:5d}  {name}")
        return 0
    text, broken = table()
    page = PAGE.read_text()
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    fresh = f"{head}{BEGIN}\n{text}\n{END}{tail}"
    for rule in broken:
        print(f"module_map: {rule}", file=sys.stderr)
    if args.check:
        if fresh != page:
            print("module_map: docs/architecture.md's map is not the code's: python scripts/module_map.py",
                  file=sys.stderr)
        return int(fresh != page or bool(broken))
    PAGE.write_text(fresh)
    return int(bool(broken))


if __name__ == "__main__":
    sys.exit(main())
