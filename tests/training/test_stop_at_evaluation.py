"""A stop signal that lands on an evaluation point evaluates before it checkpoints (issue 38, kind 4).

The loop pauses after every ``--eval-every`` step to evaluate; a SIGTERM or SIGUSR1 that is noticed at
that pause used to checkpoint and exit first, and the resume starts after that step: its row was lost
for good (and a Slurm requeue lost one on every notice). Each test stops a real job with a real signal
(``HPCDL_FAULT``'s ``term``/``usr1``: the process signals itself just before the step, so the stop is
noticed exactly at the evaluation point after it), resumes it, and compares its metrics rows with those
of a run never stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.reliability_runs import EVAL_EVERY_FLAGS, checkpoint_steps, eval_every_run, run_job

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

# digits on 2 ranks x 32: 22 steps an epoch, evaluations at steps 5, 10, 15, 20, 22 (the epoch's end), 25, ...
FLAGS = EVAL_EVERY_FLAGS  # 2 epochs, --eval-every 5, --log-every 5, no watchdog
# What a row says about the training itself (its clocks and world size differ between sessions by nature).
TRAINING_FIELDS = ("epoch", "global_step", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "lr",
                   "images_seen", "skipped_steps")
EVALUATION_STEPS = [5, 10, 15, 20, 22, 25, 30, 35, 40, 44]


def training_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{key: row[key] for key in TRAINING_FIELDS} for row in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """The rows of the run never stopped (shared with test_train_jobs' --eval-every test)."""
    rows = training_rows(eval_every_run(tmp_path_factory).output_dir)
    assert [r["global_step"] for r in rows] == EVALUATION_STEPS
    return rows


def test_sigterm_at_an_evaluation_point_evaluates_then_checkpoints(tmp_path: Path, uninterrupted) -> None:
    run_dir = tmp_path / "run"
    stopped = run_job(2, run_dir, *FLAGS, fault="0:10:term")  # noticed after step 10, an evaluation point
    assert stopped.rc == 0, stopped.tail()
    assert "SIGTERM received by rank 0" in stopped.out and checkpoint_steps(run_dir) == [10], stopped.tail()
    assert training_rows(run_dir) == uninterrupted[:2]  # the row of step 10 is there before the resume

    resumed = run_job(2, run_dir, *FLAGS, "--resume")
    assert resumed.rc == 0, resumed.tail()
    assert training_rows(run_dir) == uninterrupted  # every row, each once, equal to a run never stopped


def test_sigusr1_at_an_evaluation_point_then_a_resume_on_one_rank_keeps_every_row(tmp_path: Path,
                                                                                   uninterrupted) -> None:
    """Resumed on 1 rank with --batches-per-allreduce 2: the same global batch of 64, trained bit for bit as the
    2 ranks did (hpcdl.training.loop.micro_batches), so the rows after the resume are the same too; only the test
    loss, a sum over the test set in shards of one rank instead of two, may differ in its last bits."""
    run_dir = tmp_path / "run"
    stopped = run_job(2, run_dir, *FLAGS, fault="1:15:usr1")
    assert stopped.rc == 0, stopped.tail()
    assert "SIGUSR1 received by rank 1" in stopped.out and checkpoint_steps(run_dir) == [15], stopped.tail()

    resumed = run_job(1, run_dir, *FLAGS, "--batches-per-allreduce", "2", "--resume")
    assert resumed.rc == 0, resumed.tail()
    rows = training_rows(run_dir)
    assert [r["global_step"] for r in rows] == EVALUATION_STEPS, rows
    for row, reference in zip(rows, uninterrupted, strict=True):
        assert row["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-6)
        assert {**row, "test_loss": None} == {**reference, "test_loss": None}


def test_a_stop_at_max_steps_is_the_runs_end_with_its_evaluation(tmp_path: Path) -> None:
    """A signal noticed at --max-steps' step (inside an epoch) used to leave an interrupted run whose resume found
    the limit reached and trained, evaluated and summarised nothing; now the run ends there, finished."""
    run_dir = tmp_path / "run"
    job = run_job(2, run_dir, "--epochs", "2", "--seed", "5", "--max-steps", "13", "--stall-timeout", "0",
                  fault="0:13:term")
    assert job.rc == 0, job.tail()
    assert [r["global_step"] for r in training_rows(run_dir)] == [13]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "max_steps" and summary["final_accuracy"] is not None
