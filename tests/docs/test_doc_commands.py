"""Every command README, docs/ and the study documents print runs as printed: the paths they name exist,
the modules they start with ``python -m`` import, and a command that needs the virtual environment says so.

Commands that only make sense elsewhere (inside a container image, on a cluster's scratch folder) are
recognised by what they run in, never by a list of exceptions per document.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "benchmarks" / "results").glob("*.md"))]
TOP = ("hpcdl", "kfac", "benchmarks", "launch", "scripts", "tests", "docs", "containers", ".ci")
# A repository path in prose or code: starts at a top-level folder, not inside another path or a URL.
PATH = re.compile(r"(?<![\w/.$~-])((?:%s)/[\w./-]*[\w/])" % "|".join(re.escape(t) for t in TOP))
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# Commands run by another Python than .venv's: inside an image, a Python the command names itself, a script.
ELSEWHERE = re.compile(r"apptainer|singularity|ch-run|\bexec\b|PYTHON=|\$PYTHON|conda|\"\$@\"")  # "$@": a script's own line
# What a reader types: optional VAR=value words, timeout/nice, then a launcher or Python itself.
COMMAND = re.compile(r"^(\w+=\S*\s+)*((timeout|nice)(\s+-\w+)?(\s+\S*\d\S*)?\s+)*(mpirun|mpiexec|srun|ibrun|python3?)\b")
BARE = re.compile(r"(?<![\w/.$-])python3?\s+(-m\s+(hpcdl|kfac|pytest)\b|benchmarks/)")
# Folders a command will create (its outputs), named as what to pass, not as what exists.
WRITES = re.compile(r"--(out|output|output-dir|name)[\s=]+$")


def anchors(document: Path) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", FENCE.sub("", document.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def names(document: Path) -> str:
    return str(document.relative_to(REPO))


def commands(text: str) -> list[str]:
    """Commands in fenced code and inline code spans (comments cut off): what a reader copies and runs."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    spans = lines + INLINE.findall(FENCE.sub("", text))
    return [c for c in (span.split(" #")[0].strip() for span in spans) if COMMAND.match(c)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=names)
def test_every_path_named_exists(document: Path) -> None:
    text = document.read_text()
    missing = []
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        after = text[match.end():match.end() + 2]
        if (any(c in path for c in "*{<") or "..." in path or after.startswith(("{", ".{", "*", "<"))
                or WRITES.search(text[max(0, match.start() - 16):match.start()])):
            continue
        if not (REPO / path).exists():
            missing.append(path)
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        linked = (document.parent / file).resolve() if file else document
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            missing.append(target)
    assert missing == [], f"{names(document)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=names)
def test_every_python_m_module_imports(document: Path) -> None:
    modules = set(MODULE.findall(document.read_text()))
    absent = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert absent == [], f"{names(document)} starts modules that do not exist: {absent}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=names)
def test_commands_say_which_python(document: Path) -> None:
    """A copied ``python -m hpcdl...`` or ``python benchmarks/...`` needs .venv's Python: it says so."""
    bare = [c for c in commands(document.read_text()) if BARE.search(c) and not ELSEWHERE.search(c)]
    assert bare == [], f"{names(document)}: write .venv/bin/python (or run these inside the image): {bare}"


def test_the_checks_can_fail(tmp_path: Path) -> None:
    text = ("run `python -m hpcdl.nothing_here` on tests/test_host_sync.py, then\n\n```\n"
            "OMP_NUM_THREADS=2 timeout 60 mpirun -np 2 python benchmarks/x.py   # comment\n```\n")
    assert "tests/test_host_sync.py" in PATH.findall(text) and not (REPO / "tests/test_host_sync.py").exists()
    assert importlib.util.find_spec(MODULE.findall(text)[0]) is None
    assert [c for c in commands(text) if BARE.search(c)] == [
        "OMP_NUM_THREADS=2 timeout 60 mpirun -np 2 python benchmarks/x.py", "python -m hpcdl.nothing_here"]
