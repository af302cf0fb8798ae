"""benchmarks/studies.py: how every accuracy study runs hpcdl.train and reads it back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hpcdl.runtime.errors import UsageError
from tests.support.scripts import load_benchmark

studies = load_benchmark("studies")


def test_the_command_is_hpcdl_train_and_several_ranks_go_through_hpcdl_s_launcher() -> None:
    """Several ranks, with or without a virtual cluster, through launch/mpirun.sh: a bare mpirun refused root and
    more ranks than cores, and a study of such runs recorded "final 0.00 %" for each (issue 38, kind 5)."""
    assert studies.train_command(["--epochs", "1"]) == [sys.executable, "-m", "hpcdl.train", "--epochs", "1"]
    mpirun_sh = str(studies.REPO / "launch" / "mpirun.sh")
    assert studies.train_command(["--epochs", "1"], ranks=2, threads=3) == [
        "bash", mpirun_sh, "-np", "2", "--threads", "3", "--", "--epochs", "1"]
    assert studies.train_command(["--epochs", "1"], ranks=4, vcluster="lb") == [
        "bash", mpirun_sh, "--vcluster", "lb", "-np", "4", "--threads", "1", "--", "--epochs", "1"]


@pytest.mark.processes
def test_the_launch_is_checked_before_the_first_run() -> None:
    """A virtual cluster that does not exist is one line before any run, not a failure of each run."""
    studies.check_launch(2)  # this machine: fine
    with pytest.raises(UsageError, match="launch/mpirun.sh refuses --vcluster nosuch -np 2.*nosuch"):
        studies.check_launch(2, "nosuch")


@pytest.mark.processes
def test_a_two_rank_run_goes_through_the_launcher_as_root_and_trains(tmp_path: Path) -> None:
    """Also how a run's metrics and summary are read back (the same reading at any number of ranks: one run
    proves both; single-rank runs are read back in test_a_failed_run_keeps_its_one_line_error_and_no_rows here
    and in the studies' end-to-end tests)."""
    run = studies.run_train(["--epochs", "1", "--max-steps", "2"], tmp_path / "run", ranks=2, timeout=300)
    assert run.returncode == 0, run.log_tail
    assert run.command[:2] == ["bash", str(studies.REPO / "launch" / "mpirun.sh")]
    assert run.summary is not None and run.summary["world_size"] == 2
    # a run's metrics and summary are read back
    assert [row["global_step"] for row in run.rows] == [2]
    assert run.summary["global_steps"] == 2 and run.wall_seconds > 0


def test_a_recorded_command_differs_from_now_s_by_the_settings_named() -> None:
    """--keep's question (issue 38, kind 2): the same training, whatever the launcher's spelling and output folder."""
    now = studies.train_command(["--epochs", "1", "--output-dir", "/tmp/b", "--no-progress"], ranks=2)
    same = "mpirun -np 2 --bind-to none /x/python -m hpcdl.train --epochs=1 --output-dir /tmp/a --no-progress"
    assert studies.differing_settings(same, now) == []
    assert studies.differing_settings(same + " --stall-timeout 0 --keep-checkpoints 1", now) == []  # trains the same
    trial = same.replace("--epochs=1", "--epochs 1 --max-steps 2")
    assert studies.differing_settings(trial, now) == ["--max-steps 2, now none"]
    assert studies.differing_settings(same.replace("-np 2", "-np 1"), now) == ["ranks 1, now 2"]
    assert studies.differing_settings("python -m hpcdl.train --epochs 0", now)[-1].startswith(
        "its command no longer parses")


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
    with pytest.raises(UsageError, match=r"^the trial run failed \(exit 2\): .*--epochs must be >= 1"):
        studies.run_train(["--epochs", "0"], tmp_path / "again", timeout=120, required="the trial run")


@pytest.mark.parametrize("state", ["missing", "incomplete"])
def test_every_mnist_study_refuses_a_missing_or_incomplete_folder_in_one_line(tmp_path: Path, state: str) -> None:
    """kfac_large_batch, kfac_phases and kfac_traffic only looked for the training images' file: an empty one
    passed, and every run failed later."""
    folder = tmp_path / "mnist"
    if state == "incomplete":
        folder.mkdir()
        (folder / "train-images-idx3-ubyte").write_bytes(b"")
    with pytest.raises(UsageError, match="hpcdl.fetch_mnist") as refused:
        studies.check_mnist(folder)
    assert "\n" not in str(refused.value)
