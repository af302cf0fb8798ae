"""The commands README and the examples print are ones a reader can run as printed (docs/training.md's form)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from hpcdl.data.registry import REGISTRY

REPO = Path(__file__).resolve().parents[2]


def train_commands(text: str) -> list[list[str]]:
    lines = text.replace("\\\n", " ").splitlines()
    return [shlex.split(line.split(" #")[0]) for line in lines if "-m hpcdl.train" in line]


def test_every_readme_training_command_gives_a_dataset_read_from_disk_its_data_dir() -> None:
    """README's one-rank MNIST line had no --data-dir: it failed as printed."""
    commands = train_commands((REPO / "README.md").read_text())
    assert commands
    for words in commands:
        if "--dataset" in words:
            dataset = words[words.index("--dataset") + 1]
            if REGISTRY[dataset].needs_data_dir:
                assert "--data-dir" in words, " ".join(words)


def test_the_examples_docstrings_print_the_docs_command_form() -> None:
    """``mpirun -np N .venv/bin/python -m hpcdl.train --task examples.X:f ... --output-dir runs/...``, as
    docs/training.md prints them (they said bare ``python``)."""
    for example in sorted((REPO / "examples").glob("[!_]*.py")):
        lines = [line.strip() for line in example.read_text().splitlines() if "-m hpcdl.train" in line]
        for line in lines:
            assert re.match(r"mpirun -np \d+ \.venv/bin/python -m hpcdl\.train --task examples\.\w+:\w+ ", line), line
            assert "--output-dir runs/" in line and f"examples.{example.stem}:" in line, line
