"""hpcdl.bench.studies: how every accuracy study runs hpcdl.train and reads it back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hpcdl.bench import studies
from hpcdl.runtime.errors import UsageError


def test_the_command_is_hpcdl_train_under_mpirun_only_for_several_ranks() -> None:
    assert studies.train_command(["--epochs", "1"]) == [sys.executable, "-m", "hpcdl.train", "--epochs", "1"]
    assert studies.train_command(["--epochs", "1"], ranks=2)[:3] == ["mpirun", "-np", "2"]


def test_bad_flags_are_refused_by_hpcdl_train_s_own_parser() -> None:
    with pytest.raises(UsageError, match="--epochs must be >= 1"):
        studies.check_flags(["--epochs", "0"])


def test_contenders_alternate_and_reverse_on_every_other_seed() -> None:
    assert studies.interleaved(["a", "b"], ["k"], [0, 1]) == [
        ("a", 0), ("k", 0), ("b", 0), ("b", 1), ("k", 1), ("a", 1)]
    assert studies.interleaved([], ["k"], [5]) == [("k", 5)]


@pytest.mark.processes
def test_a_failed_run_keeps_its_one_line_error_and_no_rows(tmp_path: Path) -> None:
    run = studies.run_train(["--epochs", "0"], tmp_path / "run", timeout=120)
    assert run.returncode == 2 and run.rows == [] and run.summary is None
    assert "--epochs must be >= 1" in run.log_tail


@pytest.mark.processes
def test_a_run_s_metrics_and_summary_are_read_back(tmp_path: Path) -> None:
    run = studies.run_train(["--epochs", "1", "--max-steps", "3"], tmp_path / "run", timeout=300)
    assert run.returncode == 0, run.log_tail
    assert [row["global_step"] for row in run.rows] == [3] and run.summary is not None
    assert run.summary["global_steps"] == 3 and run.wall_seconds > 0
