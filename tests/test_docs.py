"""The documentation's cross-references resolve: every relative link in README.md and docs/ names a file that
exists and, with an anchor, a heading there; every place the code cites a page by section (`docs/page.md,
"Title"`) finds that title on the page, as a heading or a paragraph's bold lead. Measurements live in docs/ and
the code points to them, so a page split or a heading renamed must not leave the pointers behind."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "notes").glob("*.md"))]
SOURCES = [p for d in ("hvd_terngrad", "benchmarks", "examples", "tests", "csrc", "scripts")
           for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".cpp", ".h", ".sh")
           and p.name != "test_docs.py"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CITE = re.compile(r"docs/((?:notes/)?[\w.-]+\.md)[,:]?\s+\"([^\"]+)\"")


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def headings(page: pathlib.Path) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", page.read_text(), re.M)]


def titles(page: pathlib.Path) -> set[str]:
    """What the code may cite a section of `page` by: a heading, or its part before a colon ("Auto on the
    emulated cluster" for "Auto on the emulated cluster: not yet never slower than FP32"), or a paragraph's
    bold lead ("**One average a group.** ...")."""
    heads = headings(page)
    leads = [m.group(1).rstrip(".:").strip() for m in re.finditer(r"\*\*([^*]+)\*\*", page.read_text())]
    return {words(t) for t in heads + [h.split(": ")[0] for h in heads] + leads}


def words(text: str) -> str:
    return " ".join(text.split())


def test_the_slug_is_githubs():
    assert slug("Auto on `fast`: five seeds, side by side") == "auto-on-fast-five-seeds-side-by-side"
    assert slug("The DDP hook in C++") == "the-ddp-hook-in-c"
    assert slug("NCF's later hits under `auto`: the trial's first coded steps") == \
        "ncfs-later-hits-under-auto-the-trials-first-coded-steps"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_finds_its_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file")
        elif anchor and file.suffix == ".md" and anchor not in {slug(h) for h in headings(file)}:
            broken.append(f"{target}: no such heading in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_section_the_code_cites_is_on_its_page():
    missing = []
    for src in SOURCES:
        # a citation can run over lines of comments or a docstring: join them without the comment marks
        text = words(re.sub(r"^\s*(#|//)\s?", "", src.read_text(errors="replace"), flags=re.M))
        for page, title in CITE.findall(text):
            doc = ROOT / "docs" / page
            if not doc.exists() or words(title) not in titles(doc):
                missing.append(f"{src.relative_to(ROOT)}: docs/{page}, {title!r}")
    assert not missing, "\n".join(missing)


def test_the_results_index_is_current():
    """results/README.md lists every folder under results/ with its command and the pages citing it, as
    benchmarks/results_index.py writes it: a folder added, moved or no longer cited shows there."""
    from benchmarks import results_index

    assert results_index.main(["--check"]) == 0, "python -m benchmarks.results_index"


def test_the_module_map_is_the_codes():
    """docs/architecture.md's module map is what scripts/module_map.py draws from the code, and the rules the page
    states hold: no front end imports another; the pipeline names no Collectives implementation but the mirror."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("module_map", ROOT / "scripts" / "module_map.py")
    module_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module_map)
    assert module_map.table()[1] == []
    assert module_map.main(["--check"]) == 0, "python scripts/module_map.py"


NUMBERS = {w: i for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                                       "ten", "eleven", "twelve"))}


def _count(word: str) -> int:
    return int(word) if word.isdigit() else NUMBERS[word]


def _protocol_methods(protocol) -> list[str]:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]


def test_the_constants_the_docs_quote_are_the_codes():
    """Numbers the pages state about the code, read from the code: a wait's spin, the operations of the codec and
    collectives protocols, and every default of the guide's options table (each TernGradConfig field has a row)."""
    import ast
    import dataclasses

    from hvd_terngrad import collectives
    from hvd_terngrad.codec import Backend
    from hvd_terngrad.config import TernGradConfig

    readme, arch = (ROOT / "docs" / "guide.md").read_text(), (ROOT / "docs" / "architecture.md").read_text()
    spin = re.search(r"A wait yields the core for its first (\d+) ms", readme)
    assert spin and int(spin[1]) == round(collectives._SPIN_S * 1000)
    ops = re.search(r"`codec\.Backend`\s+\((\w+) operations", arch)
    assert ops and _count(ops[1]) == len(_protocol_methods(Backend))
    ops = re.search(r"`collectives\.Collectives`\s+\((\w+)\s+non-blocking operations, `poll`, and a `wait`", arch)
    assert ops and _count(ops[1]) == len([m for m in _protocol_methods(collectives.Collectives) if m.endswith("_async")
                                          or m.endswith("_async_")])
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", readme, flags=re.M))
    wrong = []
    for f in dataclasses.fields(TernGradConfig):
        assert f.name in rows, f"docs/guide.md's options table has no row for {f.name}"
        cell = rows[f.name].split(":")[0].strip()
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        try:
            quoted = ast.literal_eval(cell)
        except (ValueError, SyntaxError):  # prose ("torch's"): it says what None means
            if default is not None:
                wrong.append(f"{f.name}: docs/guide.md says {cell!r}, the default is {default!r}")
            continue
        if quoted != default:
            wrong.append(f"{f.name}: docs/guide.md says {cell!r}, the default is {default!r}")
    assert not wrong, wrong


def test_the_api_reference_builds_and_the_entry_points_name_their_arguments(tmp_path):
    """pdoc renders the public modules (scripts/api_reference.py, make docs); each entry point's docstring has
    an Args section, and a function's a Returns section, which the reference renders as such."""
    import importlib
    import importlib.util
    import inspect

    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" / "api_reference.py")
    api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api)
    pages = {p.relative_to(tmp_path).as_posix() for p in api.build(tmp_path)}
    assert {m.replace(".", "/") + ".html" for m in api.MODULES} <= pages
    missing = []
    for path in api.ENTRY_POINTS:
        module, *names = path.split(".")
        obj = importlib.import_module(f"hvd_terngrad.{module}")
        for name in names:
            obj = getattr(obj, name)
        doc = inspect.getdoc(obj) or ""
        if "Args:" not in doc and not (inspect.isclass(obj) and "Attributes:" in doc):  # a dataclass's fields
            missing.append(f"{path}: Args")
        if (inspect.isfunction(obj) or inspect.ismethod(obj)) and "Returns:" not in doc:
            missing.append(f"{path}: Returns")
    assert not missing, missing
    page = (tmp_path / "hvd_terngrad" / "compression.html").read_text()
    assert "named_parameters" in page and "Raises" in page
