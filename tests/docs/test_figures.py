"""Every figure README, docs/ and the study documents quote equals what its results file gives, and every
committed results file is one a figure reads or a document names.

Figures are marked ``<!--fig:NAME-->value<!--/fig-->`` and each study computes its own NAMEs from
benchmarks/results/ (benchmarks/figures.py gathers them); a value edited by hand, or a results file replaced,
fails here until ``.venv/bin/python benchmarks/figures.py`` has written the documents again.
"""

from __future__ import annotations

import importlib
import itertools
import re
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def figures() -> Any:
    """benchmarks/figures.py as the studies import it (one module, so that a test's RESULTS is theirs too), the
    studies imported here: their imports (torch, MPI) look up libraries with ldconfig, a process the fast tier
    refuses inside a test."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.append(str(REPO / "benchmarks"))
    module = importlib.import_module("figures")
    module.catalogue()
    return module


def test_every_marked_figure_equals_its_results_file(figures: Any) -> None:
    differ = []
    for path in figures.documents():
        differ += figures.refreshed(path.read_text(), str(path.relative_to(REPO)))[1]
    assert differ == [], "run .venv/bin/python benchmarks/figures.py (and check the change is meant)"


def test_every_figure_a_study_defines_is_quoted(figures: Any) -> None:
    quoted = {m.group(1) for path in figures.documents() for m in figures.MARKER.finditer(path.read_text())}
    assert sorted(set(figures.catalogue()) - quoted) == []


def expanded(text: str) -> set[str]:
    """The words of ``text``, with a shell brace pattern (``net_1gbit_n{2,3}.json``) standing for each name."""
    words = set()
    for word in re.findall(r"[\w.{},]+", text):
        parts = re.split(r"\{([^{}]*)\}", word)
        choices = [[part] if n % 2 == 0 else part.split(",") for n, part in enumerate(parts)]
        words |= {"".join(pick) for pick in itertools.product(*choices)}
    return words


def test_every_committed_results_file_is_read_by_a_figure_or_named_by_a_document(figures: Any) -> None:
    for path in figures.documents():
        figures.refreshed(path.read_text(), str(path.relative_to(REPO)))
    named = set().union(*(expanded(path.read_text()) for path in figures.documents()))
    unneeded = [p.name for p in sorted(figures.RESULTS.iterdir())
                if p.suffix != ".md" and p.name not in figures.READ and p.name not in named]
    assert unneeded == [], "nothing reads these results files: remove them, or name them where they matter"


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| [")]


def assert_every_figure_marked(rows: list[str], document: str, figures: Any) -> None:
    for row in rows:
        assert figures.MARKER.search(row), row
        unmarked = figures.MARKER.sub("", row)
        # a measured figure is a number with a unit of speed, time, ratio or accuracy; the targets
        # a row names (99.0 %, 98.5 %) are conditions, not measurements
        loose = [f for f in re.findall(r"\d+(?:\.\d+)?\s*(?:×|x\b|%|ms\b|s\b|img/s)", unmarked)
                 if f not in ("99.0 %", "98.5 %")]
        assert loose == [], f"figures outside a marker in {document}: {loose}"


def test_the_results_index_quotes_each_study_with_marked_figures(figures: Any) -> None:
    index = REPO / "benchmarks" / "results" / "README.md"
    rows = table_rows(index.read_text())
    assert len(rows) >= 8
    studies = {p.name for p in index.parent.glob("*.md")} - {"README.md"}
    linked = {m for row in rows for m in re.findall(r"\]\((\w+\.md)", row)}
    assert studies <= linked, f"a study document without a line in the results index: {studies - linked}"
    assert_every_figure_marked(rows, "the results index", figures)


def test_readme_s_headlines_link_their_study_and_mark_every_figure(figures: Any) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Results"):]
    assert "(benchmarks/results/README.md)" in section
    rows = table_rows(section[:section.index("\n## ", 1)])
    assert len(rows) >= 4
    assert all(re.search(r"\]\(benchmarks/results/\w+\.md", row) for row in rows), rows
    assert_every_figure_marked(rows, "README", figures)


def test_a_figure_edited_by_hand_fails(figures: Any) -> None:
    readme = (REPO / "README.md").read_text()
    match = figures.MARKER.search(readme)
    assert match is not None
    name, value = match.group(1), match.group(2)
    edited = readme[:match.start(2)] + re.sub(r"\d", lambda d: str((int(d.group()) + 1) % 10), value, count=1) \
        + readme[match.end(2):]
    fixed, differ = figures.refreshed(edited, "README.md")
    assert len(differ) == 1 and name in differ[0]
    assert fixed == readme  # writing the documents puts the results file's figure back


def test_check_exits_1_on_a_wrong_figure_and_names_it(figures: Any, tmp_path: Path, monkeypatch, capsys) -> None:
    document = tmp_path / "study.md"
    document.write_text("ratio <!--fig:lb.ratio985-->0.10×<!--/fig--> of LARS's time\n")
    monkeypatch.setattr(figures, "documents", lambda: [document])
    monkeypatch.setattr(figures, "REPO", tmp_path)
    assert figures.main(["--check"]) == 1
    assert "lb.ratio985 is '0.10×'" in capsys.readouterr().out
    assert "0.10×" in document.read_text()  # --check changes nothing
    assert figures.main([]) == 0 and "0.10×" not in document.read_text()


def test_an_unknown_figure_is_one_line(figures: Any) -> None:
    with pytest.raises(SystemExit, match="unknown figure 'no.such'"):
        figures.refreshed("<!--fig:no.such-->1<!--/fig-->", "x.md")


def test_a_results_file_of_an_interrupted_study_is_one_line_naming_the_figure_and_document(
        figures: Any, tmp_path: Path, monkeypatch) -> None:
    """A study stopped before the runs a figure needs (here: the traffic count without its verdict and ranks)
    used to end --check in a KeyError traceback naming neither (issue 38, kind 7)."""
    interrupted = {"kind": "count", "runs": []}  # what a stopped count phase would hold
    (tmp_path / "kfac_traffic_count.json").write_text(__import__("json").dumps(interrupted))
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    figures.results.cache_clear()
    try:
        text = "before <!--fig:traffic.model_check-->old<!--/fig--> after"
        new, lines = figures.refreshed(text, "benchmarks/results/kfac_traffic.md")
    finally:
        figures.results.cache_clear()
    assert new == text and len(lines) == 1
    assert lines[0].startswith("benchmarks/results/kfac_traffic.md: traffic.model_check cannot be computed")
    assert "KeyError" in lines[0] and "\n" not in lines[0]
