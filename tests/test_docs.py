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
