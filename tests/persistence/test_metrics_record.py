"""The run's metrics record on a resume: rows of steps after the checkpoint were trained and then discarded,
so they go, at once and atomically; every later row replaces any of its step or after."""

from __future__ import annotations

import json
from pathlib import Path

from hpcdl.persistence.metrics import RunRecord


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def written(run_dir: Path, steps: list[int], run_id: str = "r1") -> Path:
    record = RunRecord(run_dir, active=True, kept_through=None, run_id=run_id)
    for step in steps:
        record.log_epoch({"epoch": round(step / 22, 4), "global_step": step, "test_accuracy": step / 100})
    record.close()
    return run_dir


def test_a_resume_drops_the_rows_after_its_checkpoint_before_training(tmp_path: Path) -> None:
    run = written(tmp_path, [5, 10, 15, 20, 22, 25, 30])  # checkpoint at 22; crashed after 30
    resumed = RunRecord(run, active=True, kept_through=22, run_id="r1")
    assert [r["global_step"] for r in rows_of(run)] == [5, 10, 15, 20, 22]  # on disk before any new row
    assert [r["global_step"] for r in resumed.history] == [5, 10, 15, 20, 22]
    assert resumed.purge_step == 23  # TensorBoard hides the discarded steps' events too
    # on another world size the same steps fall at other fractional epochs: a label match would keep both rows
    resumed.log_epoch({"epoch": 1.0682, "global_step": 25, "test_accuracy": 0.5})
    resumed.close()
    assert [(r["global_step"], r["epoch"]) for r in rows_of(run)][-2:] == [(22, 1.0), (25, 1.0682)]
    assert len(list((run / "tensorboard").iterdir())) >= 1


def test_a_resume_with_no_checkpoint_keeps_no_row_and_a_new_run_reads_nothing(tmp_path: Path) -> None:
    run = written(tmp_path / "a", [5, 10])
    assert RunRecord(run, active=True, kept_through=None).history == []  # a new run (checkpoints refused earlier)
    assert (run / "metrics.jsonl").read_text().count("\n") == 2
    RunRecord(run, active=True, kept_through=0)  # --resume found no checkpoint: starts from step 0
    assert rows_of(run) == []


def test_a_row_of_a_step_already_recorded_replaces_it_and_what_followed(tmp_path: Path) -> None:
    record = RunRecord(tmp_path, active=True, kept_through=None, run_id="r1")
    for step in (5, 10, 15):
        record.log_epoch({"epoch": step / 22, "global_step": step})
    record.log_epoch({"epoch": 10 / 22, "global_step": 10, "again": True})
    record.close()
    assert [(r["global_step"], r.get("again")) for r in rows_of(tmp_path)] == [(5, None), (10, True)]


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    written(tmp_path, [5, 30])
    RunRecord(tmp_path, active=False, kept_through=5)
    assert [r["global_step"] for r in rows_of(tmp_path)] == [5, 30]
