"""Every command README, docs/ and the study documents print runs as printed: the paths they name exist,
the modules they start with ``python -m`` import, and a command that needs the virtual environment says so.

Commands that only make sense elsewhere (inside a container image, on a cluster's scratch folder) are
recognised by what they run in, never by a list of exceptions per document.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

from hpcdl.training import config as training_config
from hpcdl.training.config import parse_config

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "benchmarks" / "results").glob("*.md"))]
TOP = ("hpcdl", "kfac", "benchmarks", "launch", "scripts", "tests", "docs", "containers", ".ci", "examples")
# A repository path in prose or code: starts at a top-level folder, not inside another path or a URL.
_TOPS = "|".join(re.escape(t) for t in TOP)
PATH = re.compile(rf"(?<![\w/.$~-])((?:{_TOPS})/[\w./-]*[\w/])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# Commands run by another Python than .venv's: inside an image, a Python the command names itself, a script.
# ("$@": a line of a script, not one a reader types)
ELSEWHERE = re.compile(r"apptainer|singularity|ch-run|\bexec\b|PYTHON=|\$PYTHON|conda|\"\$@\"")
# What a reader types: optional VAR=value words, timeout/nice, then a launcher or Python itself.
COMMAND = re.compile(r"^(\w+=\S*\s+)*((timeout|nice)(\s+-\w+)?(\s+\S*\d\S*)?\s+)*"
                     r"(mpirun|mpiexec|srun|ibrun|(\S*/)?python3?)\b")
BARE = re.compile(r"(?<![\w/.$-])python3?\s+(-m\s+(hpcdl|kfac|pytest)\b|benchmarks/)")
# Folders a command will create (its outputs), named as what to pass, not as what exists.
WRITES = re.compile(r"--(out|output|output-dir|name)[\s=]+$")


def anchors(document: Path) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", FENCE.sub("", document.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def names(document: Path) -> str:
    return str(document.relative_to(REPO)) if document.is_relative_to(REPO) else str(document)


def commands(text: str) -> list[str]:
    """Commands in fenced code and inline code spans (comments cut off): what a reader copies and runs."""
    lines = [line for block in FENCE.findall(text) for line in block.replace("\\\n", " ").splitlines()]
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


def train_arguments(command: str) -> list[str] | None:
    """The flags a printed ``... -m hpcdl.train FLAGS`` command gives; ``--flag ...`` (a value left to the
    reader) becomes ``--flag x`` and a trailing ``...`` is dropped. None if it is not such a command."""
    if not re.search(r"-m\s+hpcdl\.train\b", command) or ELSEWHERE.search(command) or "<" in command:
        return None
    words = shlex.split(command)
    words = words[words.index("hpcdl.train") + 1:]
    return [("x" if w == "..." else w) for i, w in enumerate(words)
            if w != "..." or (i > 0 and words[i - 1].startswith("--"))]


@pytest.mark.parametrize("document", DOCUMENTS, ids=names)
def test_every_printed_train_command_parses_without_a_deprecated_flag(document: Path) -> None:
    """Each hpcdl.train command is one hpcdl.train's own parser accepts, in today's flag names."""
    for command in commands(document.read_text()):
        arguments = train_arguments(command)
        if arguments is None or "--help" in arguments:
            continue
        said = io.StringIO()
        # A fresh set of noted flags: the note comes once per process, and an earlier test may have had it.
        with contextlib.redirect_stderr(said), mock.patch.object(training_config, "NOTED", set()):
            parse_config(arguments)  # a renamed or unknown flag, or a value out of range, raises here
        assert "deprecated" not in said.getvalue(), f"{names(document)}: {command}: {said.getvalue().strip()}"


def test_the_checks_can_fail(tmp_path: Path) -> None:
    text = ("run `python -m hpcdl.nothing_here` on tests/test_host_sync.py, then\n\n```\n"
            "OMP_NUM_THREADS=2 timeout 60 mpirun -np 2 python benchmarks/x.py   # comment\n```\n")
    assert "tests/test_host_sync.py" in PATH.findall(text) and not (REPO / "tests/test_host_sync.py").exists()
    assert importlib.util.find_spec(MODULE.findall(text)[0]) is None
    assert [c for c in commands(text) if BARE.search(c)] == [
        "OMP_NUM_THREADS=2 timeout 60 mpirun -np 2 python benchmarks/x.py", "python -m hpcdl.nothing_here"]
    assert train_arguments("mpirun -np 2 .venv/bin/python -m hpcdl.train --data-dir ... --epochs 2 ...") == [
        "--data-dir", "x", "--epochs", "2"]
    old = tmp_path / "old.md"
    old.write_text("```\nmpirun -np 2 .venv/bin/python -m hpcdl.train --damping 0.1\n```\n")
    with pytest.raises(AssertionError, match="deprecated"):
        test_every_printed_train_command_parses_without_a_deprecated_flag(old)

