"""Run state under mpirun: what a resume takes from the checkpoint and what from the flags, finished runs,
models that cannot take the input, Ctrl-C, and results that cannot be written (issue 15)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.mpi_harness import kill_tree, mpi_env
from tests.support.reliability_runs import (
    BASE_FLAGS,
    BASE_RANKS,
    assert_usage_error,
    baseline_run,
    checkpoint_steps,
    copy_run,
    load_checkpoint,
    run_job,
)

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


REPO = Path(__file__).resolve().parents[2]


def files_of(run_dir: Path) -> dict[str, tuple[int, bytes]]:
    """Every file's modification time and bytes (the lock of a live run excluded)."""
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(run_dir.rglob("*"))
            if p.is_file() and "lock" not in p.name}


def test_resume_applies_a_changed_weight_decay_and_records_it(tmp_path_factory, tmp_path: Path) -> None:
    run_dir = copy_run(baseline_run(tmp_path_factory), tmp_path / "run")
    job = run_job(BASE_RANKS, run_dir, "--epochs", "3", "--seed", "11", "--weight-decay", "0.003", "--resume")
    assert job.rc == 0, job.tail()
    assert "resuming with changed flags: --epochs 2 -> 3; --weight-decay 0.0001 -> 0.003" in job.out
    newest = load_checkpoint(run_dir, checkpoint_steps(run_dir)[-1])
    assert {g["weight_decay"] for g in newest["optimizer"]["param_groups"]} == {0.003}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "--weight-decay 0.0001 -> 0.003" in summary["resumed_with_changes"]
    assert summary["epochs"] == 3 and summary["config"]["weight_decay"] == 0.003


def test_resume_with_another_model_is_refused_naming_it(tmp_path_factory, tmp_path: Path) -> None:
    run_dir = copy_run(baseline_run(tmp_path_factory), tmp_path / "run")
    before = files_of(run_dir)
    job = run_job(BASE_RANKS, run_dir, *BASE_FLAGS, "--model", "resnet20", "--resume")
    assert_usage_error(job, "cannot resume", "--model digits_cnn (checkpoint) vs resnet20 (now)")
    assert files_of(run_dir) == before


def test_resuming_a_finished_run_says_so_and_rewrites_nothing(tmp_path_factory, tmp_path: Path) -> None:
    run_dir = copy_run(baseline_run(tmp_path_factory), tmp_path / "run")
    before = files_of(run_dir)
    job = run_job(BASE_RANKS, run_dir, *BASE_FLAGS, "--resume")
    assert job.rc == 0, job.tail()
    assert "already finished (stopped by epochs after 2 epoch(s)); nothing to do" in job.out
    assert files_of(run_dir) == before
    assert json.loads((run_dir / "summary.json").read_text())["stop_reason"] == "epochs"


def test_a_model_that_cannot_take_the_input_gets_one_line(tmp_path: Path) -> None:
    job = run_job(BASE_RANKS, tmp_path / "run", "--model", "vgg11", "--epochs", "1")
    assert_usage_error(job, "--model vgg11 cannot take digits's 1x8x8 images", "choose a model made for this input")
    assert not checkpoint_steps(tmp_path / "run") if (tmp_path / "run" / "checkpoints").exists() else True


def test_ctrl_c_to_one_rank_checkpoints_names_it_and_exits_130(tmp_path: Path) -> None:
    """SIGINT to rank 1 alone: every rank stops at the next log point, rank 0 writes a checkpoint, exit 130."""
    run_dir = tmp_path / "run"
    cmd = ["mpirun", "-np", "2", "--bind-to", "none", sys.executable, "-m", "hpcdl.train", "--output-dir",
           str(run_dir), "--no-progress", "--epochs", "40", "--log-every", "5", "--seed", "11"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=mpi_env({"HPCDL_FAULT": ""}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not checkpoint_steps(run_dir) and time.time() < deadline:  # a first epoch is done: training runs
            time.sleep(0.5)
        ranks = subprocess.run(["pgrep", "-f", f"hpcdl.train --output-dir {run_dir}"], capture_output=True,
                               text=True).stdout.split()
        rank1 = [int(p) for p in ranks if "OMPI_COMM_WORLD_RANK=1" in Path(f"/proc/{p}/environ").read_bytes()
                 .decode(errors="replace").replace("\0", " ")]
        assert len(rank1) == 1, ranks
        os.kill(rank1[0], signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 130, err[-3000:]
    # mid-epoch, or (when the signal lands in the epoch's last steps, as on a quiet machine) at its end,
    # after the epoch's own checkpoint
    assert re.search(r"SIGINT received by rank 1: (checkpoint written at step \d+|stopped after epoch \d+)", out), \
        out[-2000:]
    newest = torch.load(sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert newest["progress"]["stop_reason"] == "SIGINT"
    assert "Traceback" not in err


def test_an_unreadable_metrics_file_on_resume_gets_one_line(tmp_path_factory, tmp_path: Path) -> None:
    run_dir = copy_run(baseline_run(tmp_path_factory), tmp_path / "run")
    before = checkpoint_steps(run_dir)
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").mkdir()  # in the way of both reading and the atomic replace
    job = run_job(BASE_RANKS, run_dir, "--epochs", "3", "--seed", "11", "--resume")
    assert_usage_error(job, "metrics.jsonl is unreadable (IsADirectoryError")
    assert checkpoint_steps(run_dir) == before


def test_a_failed_results_write_is_one_line_on_every_rank_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """Disk full while replacing metrics.jsonl: a StorageError naming the path, the old file intact, no temporary."""
    import errno

    import pytest
    from mpi4py import MPI

    from hpcdl.persistence.metrics import RunRecord
    from hpcdl.runtime.errors import StorageError
    from hpcdl.training.train import write_results

    record = RunRecord(tmp_path, active=True, kept_through=None, run_id="r1")
    record.log_epoch({"epoch": 1, "test_loss": 0.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def full_disk(fd: int) -> None:  # the data were written to the temporary; the disk fills on flushing them
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", full_disk)
        with pytest.raises(StorageError, match="could not write results: cannot write .*metrics.jsonl: No space left"):
            write_results(lambda: record.log_epoch({"epoch": 2, "test_loss": 0.4}), MPI.COMM_SELF, tmp_path)
    record.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
