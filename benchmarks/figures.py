"""Every figure README, docs/ and the study documents quote, computed from benchmarks/results/.

    .venv/bin/python benchmarks/figures.py            # rewrite each marked figure and table from the results files
    .venv/bin/python benchmarks/figures.py --check    # exit 1 naming each figure that differs (tests/docs runs it)

A figure whose results file cannot give it (a study interrupted before the runs it needs) is one line naming
the figure and the document, and exit 1, like a figure that differs; the document keeps its text.

A document marks a figure as ``<!--fig:NAME-->99.30 %<!--/fig-->`` (a table the same way, on lines of its
own). NAME is a key of the ``FIGURES`` of one of :data:`STUDIES`: each study computes its own figures from its
results files, in its module (or in ``<study>_figures.py`` beside it). The text between the markers is the
figure's value and nothing else. So a figure is written once, by its study, and one edited by hand fails
``--check``; the prose around it stays the author's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hpcdl.persistence.atomic import write_text_atomically
from hpcdl.persistence.outputs import output_file

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
MARKER = re.compile(r"<!--fig:([\w.\-]+)-->(.*?)<!--/fig-->", re.DOTALL)
# The modules whose FIGURES the documents quote.
STUDIES = ("train_throughput_figures", "deterministic_cost", "phase_overhead", "kfac_overhead", "kfac_eigen_scaling",
           "kfac_convergence", "kfac_large_batch_figures", "kfac_phases", "kfac_traffic", "loader_throughput",
           "transformer_lm", "network", "gpu_figures", "kfac_transformer", "kfac_method_cell", "kfac_gpu", "cpu_layout")
READ: set[str] = set()  # the results files the figures computed so far have read (tests/docs checks each is needed)


def documents() -> list[Path]:
    """Where figures may be quoted."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(RESULTS.glob("*.md"))]


@functools.cache
def catalogue() -> dict[str, Callable[[], str]]:
    """Every study's figures by name."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    figures: dict[str, Callable[[], str]] = {}
    for study in STUDIES:
        own = importlib.import_module(study).FIGURES
        if twice := figures.keys() & own.keys():
            raise SystemExit(f"benchmarks/{study}: figures {sorted(twice)} are defined by another study too")
        figures.update(own)
    return figures


@functools.cache
def results(name: str) -> Any:
    """benchmarks/results/<name>.json."""
    READ.add(f"{name}.json")
    return json.loads((RESULTS / f"{name}.json").read_text())


def times(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}×"


def percent(fraction: float, digits: int = 2) -> str:
    return f"{100 * fraction:.{digits}f} %"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n" + "\n".join(lines) + "\n"


def save_json(stem: Path, report: Any, indent: int = 1) -> Path:
    """A study's results file ``stem``.json, replaced whole and atomically: a study stopped while saving keeps the
    file it saved last."""
    path = output_file(stem, ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(report, indent=indent) + "\n")
    return path


@contextlib.contextmanager
def figure(stem: Path, *grid: int, dpi: int = 120, **options: Any) -> Iterator[tuple[Any, Any]]:
    """A study's plot: ``plt.subplots(*grid, **options)`` drawn off-screen (no display on a cluster node); on
    leaving, laid out, saved as ``stem``.png and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **options)
    yield fig, axes
    fig.tight_layout()
    fig.savefig(output_file(stem, ".png"), dpi=dpi)
    plt.close(fig)


def refreshed(text: str, where: str) -> tuple[str, list[str]]:
    """``text`` with every marked figure recomputed, and one line per figure that differed."""
    changes: list[str] = []
    figures = catalogue()

    def replace(match: re.Match[str]) -> str:
        name, old = match.group(1), match.group(2)
        if name not in figures:
            raise SystemExit(f"{where}: unknown figure {name!r} (the studies define {len(figures)})")
        try:
            new = figures[name]()
        except Exception as exc:  # noqa: BLE001 - a results file cut short or of another shape: one line, named
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            changes.append(f"{where}: {name} cannot be computed from the results files in {RESULTS} ({what}); "
                           "is one of them from an interrupted or unfinished study?")
            return match.group(0)  # left as it is
        if new != old:
            changes.append(f"{where}: {name} is {old.strip()!r}, the results files give {new.strip()!r}")
        return f"<!--fig:{name}-->{new}<!--/fig-->"

    return MARKER.sub(replace, text), changes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any figure differs")
    args = parser.parse_args(argv)
    differ = []
    for path in documents():
        text = path.read_text()
        new, changes = refreshed(text, str(path.relative_to(REPO)))
        differ += changes
        if changes and not args.check:
            path.write_text(new)
    print("\n".join(differ) if differ else f"every figure equals its results file ({len(catalogue())} defined)")
    return 1 if differ and args.check else 0


if __name__ == "__main__":
    sys.modules.setdefault("figures", sys.modules["__main__"])  # the studies' `from figures import ...`: this one
    sys.exit(main())
