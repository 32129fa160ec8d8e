"""The API reference: HTML from the public modules' docstrings, by pdoc, into build/api/ (make docs).

    python scripts/api_reference.py [OUT]

Why pdoc: it reads the docstrings and annotations as they are, Google-style sections (Args, Returns, Raises,
Attributes) included, with no configuration and no site to keep; mkdocstrings renders the same docstrings
but needs a MkDocs site (mkdocs.yml, a theme, a nav) around one reference. The guide and the design pages stay
Markdown in docs/.
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# what a user imports: the front ends, their options, the session and pipeline under them, the errors, the stats
MODULES = ("hvd_terngrad", "hvd_terngrad.config", "hvd_terngrad.compression", "hvd_terngrad.optimizer",
           "hvd_terngrad.ddp", "hvd_terngrad.session", "hvd_terngrad.pipeline", "hvd_terngrad.errors",
           "hvd_terngrad.stats")
# the entry points whose docstrings must name their arguments (and, for functions, what they return)
ENTRY_POINTS = ("compression.TernGrad", "optimizer.DistributedOptimizer", "ddp.TernGradState", "ddp.terngrad_hook",
                "ddp.bf16_hook", "ddp.in_launch_order", "session.Session", "config.TernGradConfig",
                "config.TernGradConfig.recommended", "pipeline.Pipeline")


def build(out: pathlib.Path) -> list[pathlib.Path]:
    """Render MODULES into `out`; the pages written."""
    import warnings

    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="google")
    with warnings.catch_warnings():
        # the package imports these two when first used (they import Horovod), where pdoc looks for them at
        # import: their modules' pages have them
        warnings.filterwarnings("ignore", r"Found '(TernGrad|DistributedOptimizer)' in hvd_terngrad.__all__")
        pdoc.pdoc(*MODULES, output_directory=out)
    return sorted(out.rglob("*.html"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = pathlib.Path(argv[0]) if argv else ROOT / "build" / "api"
    pages = build(out)
    print(f"{len(pages)} pages in {out} (open {out / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
