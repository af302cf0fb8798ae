"""Shared pieces of the job tests (tests/runtime/test_reliability.py, tests/training/test_bad_input.py and others).

Every job is a real ``mpirun -np N python -m hpcdl.train`` on the embedded digits data, kept tiny
(1-4 epochs of 11-22 steps) because most of its time is Python start-up. One uninterrupted
2-rank run (:func:`baseline_run`), and the same run with an evaluation every 5 steps
(:func:`eval_every_run`), are made once per test process and read (or copied) by the tests that
need them, instead of training again for each.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.support.mpi_harness import REPO, kill_tree, run_train

# The uninterrupted reference: 2 ranks x batch 32 on digits = 22 steps per epoch, checkpoints at 22 and 44.
BASE_RANKS = 2
BASE_FLAGS = ("--epochs", "2", "--seed", "11")
STEPS_PER_EPOCH = {2: 22, 4: 11}
FAULT_LINE = re.compile(r"injecting fault '(\w+)' on rank (\d+) at step (\d+) \(t=([\d.]+)\)")


@dataclass
class Job:
    """A finished job: its result, when it ended, and when its injected fault struck (if any)."""

    result: subprocess.CompletedProcess[str]
    ended_at: float
    seconds: float
    output_dir: Path

    @property
    def rc(self) -> int:
        return self.result.returncode

    @property
    def out(self) -> str:
        return self.result.stdout

    @property
    def err(self) -> str:
        return self.result.stderr

    def tail(self, chars: int = 3000) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.out[-chars:]}\n--- stderr\n{self.err[-chars:]}"

    def seconds_after_fault(self) -> float:
        """Wall time from the first injected fault to the end of the whole job."""
        found = FAULT_LINE.findall(self.out)
        assert found, "the fault was never injected:\n" + self.tail()
        return self.ended_at - min(float(t) for *_, t in found)


def run_job(nprocs: int, output_dir: Path, *flags: str, fault: str | None = None, timeout: float = 180,
            env: dict[str, str] | None = None) -> Job:
    extra = dict(env or {})
    extra["HPCDL_FAULT"] = fault or ""
    start = time.time()
    result = run_train(nprocs, output_dir, *flags, timeout=timeout, env=extra)
    ended = time.time()
    return Job(result, ended, ended - start, Path(output_dir))


# The job ran into the harness timeout: only a badly overloaded machine does that to a job whose
# watchdog works (a broken watchdog fails the second run too).
HARNESS_TIMEOUT = 124
# mpirun could not print its own notice (its show_help failed under load, seen once in CI).
SHOW_HELP_FAILED = "ORTE_ERROR_LOG: Out of resource in file ../../../orte/util/show_help.c"


def run_job_once_more_if(spoilt: Callable[[Job], bool], nprocs: int, output_dir: Path, *flags: str,
                         **kwargs) -> Job:
    """run_job, and once more in a fresh directory when ``spoilt`` says the machine, not hpcdl,
    spoilt the first run. The assertions then apply to the second run unchanged."""
    job = run_job(nprocs, output_dir, *flags, **kwargs)
    if spoilt(job):
        job = run_job(nprocs, output_dir.with_name(output_dir.name + "-again"), *flags, **kwargs)
    return job


def signal_once_training(cmd: list[str], env: dict[str, str], sig: signal.Signals,
                         marker: str = "epoch   1/15") -> tuple[int, str, str]:
    """Start a launcher (mpirun, torchrun), send ``sig`` to the launcher itself once its output shows
    ``marker`` (training under way), and wait for it: (returncode, stdout, stderr). A launcher still up
    120 s after the signal is killed with everything below it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            start_new_session=True)
    seen = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(marker):
                os.kill(proc.pid, sig)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
    return proc.returncode, "".join(seen) + out, err


_baseline: dict[str, Path] = {}


def baseline_run(tmp_path_factory) -> Path:
    """The uninterrupted reference run (made once per test process; copy it, never change it)."""
    if "run" not in _baseline:
        run_dir = tmp_path_factory.mktemp("baseline") / "run"
        job = run_job(BASE_RANKS, run_dir, *BASE_FLAGS)
        assert job.rc == 0, job.tail()
        assert checkpoint_steps(run_dir) == [22, 44]
        _baseline["run"] = run_dir
    return _baseline["run"]


# The reference run again with an evaluation every 5 steps (rows at 5, 10, 15, 20, 22, 25, ...), metrics read back
# every 5 steps, and no stall watchdog: read by the --eval-every and stop-at-an-evaluation tests.
EVAL_EVERY_FLAGS = (*BASE_FLAGS, "--eval-every", "5", "--log-every", "5", "--stall-timeout", "0")
_eval_every: dict[str, Job] = {}


def eval_every_run(tmp_path_factory) -> Job:
    """The uninterrupted run of EVAL_EVERY_FLAGS (made once per test process; read it, never change it)."""
    if "job" not in _eval_every:
        job = run_job(BASE_RANKS, tmp_path_factory.mktemp("eval-every") / "run", *EVAL_EVERY_FLAGS)
        assert job.rc == 0, job.tail()
        _eval_every["job"] = job
    return _eval_every["job"]


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Global steps of the checkpoint files in a run directory, oldest first."""
    return sorted(int(p.name[5:14]) for p in (run_dir / "checkpoints").glob("ckpt-*.pt"))


def load_checkpoint(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"ckpt-{step:09d}.pt", map_location="cpu", weights_only=True)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-identical model states (same keys, same values)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error: " in line]


def assert_usage_error(job: Job, *fragments: str) -> str:
    """The bad-input contract: exactly one ``error:`` line (rank 0's), exit status 2, no traceback, no abort."""
    lines = error_lines(job.err)
    assert job.rc == 2, job.tail()
    assert len(lines) == 1, job.tail()
    assert lines[0].startswith("hpcdl.train: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "Traceback" not in job.err and "MPI_ABORT" not in job.err, job.tail()
    return lines[0]
