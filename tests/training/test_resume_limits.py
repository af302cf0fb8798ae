"""A limit a resumed run has already passed means no further training, said in one line.

A run stopped by SIGTERM in its second epoch (step 49 of 44 per epoch) is resumed with a lower
--max-steps and with --epochs 1: each resume trains no step, writes no checkpoint and says which
limit was reached; a limit above the stopping point still trains on to it exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.reliability_runs import checkpoint_steps, copy_run, run_job

pytestmark = pytest.mark.processes

FLAGS = ("--epochs", "2", "--seed", "3", "--log-every", "5", "--stall-timeout", "0")


@pytest.fixture(scope="module")
def stopped_in_epoch_two(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    job = run_job(1, run_dir, *FLAGS, fault="0:48:term")
    assert job.rc == 0, job.tail()
    assert checkpoint_steps(run_dir)[-1] == 49, job.tail()  # the stop is taken at the next log point
    return run_dir


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != "lock"}


@pytest.mark.parametrize(("limit", "line"), [
    (("--max-steps", "20"), "--max-steps 20 already reached; no further training"),
    (("--max-steps", "49"), "--max-steps 49 already reached; no further training"),
    (("--epochs", "1"), "--epochs 1 already reached; no further training"),
])
def test_a_limit_already_passed_trains_no_further(stopped_in_epoch_two: Path, tmp_path: Path,
                                                  limit: tuple[str, str], line: str) -> None:
    run_dir = copy_run(stopped_in_epoch_two, tmp_path / "run")
    before = files_of(run_dir)
    job = run_job(1, run_dir, *FLAGS, *limit, "--resume")  # the later --epochs wins
    assert job.rc == 0, job.tail()
    said = [text for text in job.out.splitlines() if "already reached" in text]
    assert len(said) == 1 and said[0].endswith(line) and "is at step 49 (1 epoch(s) completed)" in said[0], job.tail()
    assert "epoch   2/1" not in job.out and "Traceback" not in job.err
    assert files_of(run_dir) == before  # nothing trained, nothing written


def test_a_limit_above_the_stop_trains_on_to_it_exactly(stopped_in_epoch_two: Path, tmp_path: Path) -> None:
    run_dir = copy_run(stopped_in_epoch_two, tmp_path / "run")
    job = run_job(1, run_dir, *FLAGS, "--max-steps", "53", "--resume")
    assert job.rc == 0, job.tail()
    assert checkpoint_steps(run_dir)[-1] == 53
