"""Every record says exactly what was trained: after a crash and a resume on another world size, after a
stop by --max-steps inside an epoch, and with skipped non-finite updates (issue 30, item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.reliability_runs import checkpoint_steps, run_job

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

FLAGS = ("--epochs", "2", "--seed", "5", "--eval-every", "5", "--log-every", "5", "--stall-timeout", "0")


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_crash_and_a_resume_on_another_world_size_leave_one_row_per_trained_step(tmp_path: Path) -> None:
    """2 ranks (22 steps an epoch) evaluate every 5 steps and crash at step 35, after the rows of steps 25 and
    30 were written but long after the checkpoint of step 22; 1 rank (44 steps an epoch) takes over from it."""
    run_dir = tmp_path / "run"
    crashed = run_job(2, run_dir, *FLAGS, fault="0:35:kill")
    assert crashed.rc != 0 and checkpoint_steps(run_dir) == [22], crashed.tail()
    assert [r["global_step"] for r in rows_of(run_dir)][-2:] == [25, 30]  # the rows that are now wrong

    resumed = run_job(1, run_dir, *FLAGS, "--resume")
    assert resumed.rc == 0, resumed.tail()
    rows = rows_of(run_dir)
    steps = [r["global_step"] for r in rows]
    assert steps == [5, 10, 15, 20, 22, *range(25, 66, 5), 66], steps  # each step once, in order
    for key in ("epoch", "train_seconds", "elapsed_seconds", "images_seen"):
        values = [r[key] for r in rows]
        assert values == sorted(values), f"{key} runs backwards: {values}"
    assert [r["world_size"] for r in rows] == [2] * 5 + [1] * 10
    assert rows[5]["epoch"] == pytest.approx(1 + 3 / 44, abs=1e-4)  # step 25 on one rank: 3 steps of 44 in

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_sizes"] == [1, 2] and summary["world_size"] == 1
    assert "world size 2 -> 1" in summary["resumed_with_changes"]
    first, second = summary["segments"]
    assert (first["world_size"], first["global_batch"], first["first_step"], first["last_step"]) == (2, 64, 1, 22)
    assert (second["world_size"], second["global_batch"], second["first_step"], second["last_step"]) == (1, 32, 23, 66)
    assert first["images"] == 22 * 64 and second["images"] == 44 * 32  # the crashed steps 23-34 count nowhere
    assert summary["images_seen"] == first["images"] + second["images"]
    for segment in (first, second):
        assert segment["images_per_second"] == pytest.approx(segment["images"] / segment["train_seconds"])


def test_max_steps_inside_an_epoch_and_skipped_updates_are_recorded_as_they_happened(tmp_path: Path) -> None:
    """1 rank, 44 steps an epoch, stopped by --max-steps 30; steps 3, 7 and 8 have a NaN loss (updates skipped)."""
    run_dir = tmp_path / "run"
    job = run_job(1, run_dir, "--epochs", "2", "--max-steps", "30", "--log-every", "5", "--seed", "5",
                  fault="0:3:nan,0:7-8:nan")
    assert job.rc == 0, job.tail()
    rows = rows_of(run_dir)
    assert len(rows) == 1
    row = rows[0]
    assert row["global_step"] == 30 and row["epoch"] == pytest.approx(30 / 44, abs=1e-4)  # not "epoch 1"
    assert row["images_seen"] == 30 * 32 and row["skipped_steps"] == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "max_steps"
    assert summary["epochs"] == 0 and summary["epochs_trained"] == pytest.approx(30 / 44, abs=1e-4)
    assert summary["global_steps"] == 30 and summary["images_seen"] == 30 * 32
    assert summary["skipped_steps"] == 3
    assert job.out.count("non-finite gradients, update skipped") == 3
