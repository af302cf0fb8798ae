"""Failure handling proven on real jobs: ``mpirun -np 2|4 python -m hpcdl.train`` with HPCDL_FAULT.

Each test injects one failure (hpcdl/runtime/faults.py) into a tiny digits run and checks what a user
paying for node-hours needs: the job ends promptly (timed from the moment the fault struck, which
the injector prints) with a non-zero exit and a message naming the rank; or, for a stop signal,
a checkpoint from which ``--resume`` reaches exactly the weights of an uninterrupted run; and no
failure ever leaves a corrupt newest checkpoint or overwrites a good one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.support.backends import BACKENDS, backend_param, needs_horovod
from tests.support.mpi_harness import PYTHON, mpi_env
from tests.support.reliability_runs import (
    BASE_FLAGS,
    BASE_RANKS,
    HARNESS_TIMEOUT,
    SHOW_HELP_FAILED,
    assert_usage_error,
    baseline_run,
    checkpoint_steps,
    copy_run,
    load_checkpoint,
    run_job,
    run_job_once_more_if,
    same_weights,
    signal_once_training,
)

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


PROMPT = 60  # seconds from the fault to the end of the whole job (the bound)


def report(job) -> float:
    """Seconds from the fault to the end of the job, printed for ``pytest -s`` (docs/reliability.md quotes them)."""
    seconds = job.seconds_after_fault()
    print(f"\n[{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}] job ended {seconds:.1f} s after the fault")
    return seconds


# ------------------------------------------------------------------ a rank dies

@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_rank_ends_the_job_within_60_seconds(backend: str, tmp_path: Path) -> None:
    """Rank 1 of 4 SIGKILLed at step 5 (a crashed node, the kernel's OOM killer)."""
    # mpirun's notice is the only message naming a killed rank: a run where mpirun failed to print
    # it is run again.
    job = run_job_once_more_if(lambda j: SHOW_HELP_FAILED in j.err, 4, tmp_path / "run", "--epochs", "1",
                               "--backend", backend, fault="1:5:kill", timeout=180)
    assert job.rc != 0, job.tail()
    assert report(job) < PROMPT, job.tail()
    assert re.search(r"process rank 1 with PID \d+ on node \S+ exited on signal 9 \(Killed\)", job.err), job.tail()
    assert checkpoint_steps(job.output_dir) == []  # 11 steps per epoch on 4 ranks: none was due
    # A rank whose torch.distributed peer vanished before mpirun ended it says so in one line. The ranks share
    # mpirun's stderr, which forwards what each writes in pieces: two ranks' lines can land inside each other, so
    # each rank's line is counted by its parts, not read as a line of the output.
    gone = job.err.count("another rank of the job is gone")
    said = re.findall(r"hpcdl\.train: rank \d stops: another rank of the job is gone \(", job.err)
    assert len(said) == gone and job.err.count("); aborting the whole job") >= gone, job.tail()


def test_exception_on_one_rank_aborts_the_whole_job(tmp_path: Path) -> None:
    """A Python exception on rank 1 of 4: it prints its traceback and one line, then MPI_Abort ends everyone."""
    job = run_job(4, tmp_path / "run", "--epochs", "1", fault="1:5:exception", timeout=180)
    assert job.rc != 0, job.tail()
    assert report(job) < PROMPT, job.tail()
    line = "hpcdl.train: rank 1 failed with RuntimeError: injected fault on rank 1 at step 5; aborting the whole job"
    assert line in job.err.splitlines(), job.tail()
    assert "Traceback" in job.err  # an exception is a bug somewhere: its traceback is kept
    # Open MPI's own "MPI_ABORT was invoked on rank 1" banner is not asserted: mpirun prints it
    # through show_help, which a loaded machine once failed with "ORTE_ERROR_LOG: Out of resource"
    # (a CI run); our line above is what the user is promised.


def test_out_of_memory_on_one_rank_ends_the_job_in_one_line(tmp_path: Path) -> None:
    job = run_job(2, tmp_path / "run", "--epochs", "1", fault="1:3:oom", timeout=150)
    assert job.rc != 0, job.tail()
    assert report(job) < PROMPT, job.tail()
    line = "hpcdl.train: rank 1 failed with out of memory: injected fault on rank 1 at step 3; aborting the whole job"
    assert line in job.err.splitlines(), job.tail()
    assert "Traceback" not in job.err  # running out of memory is not a bug: the line says it all


# ------------------------------------------------------------------ a rank freezes

@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_rank_is_named_and_the_job_ends_within_60_seconds(backend: str, tmp_path: Path) -> None:
    """Rank 1 of 4 SIGSTOPped at step 5 with --stall-timeout 10: no launcher notices; the watchdog does (under
    torch.distributed before Gloo's own timeout, which is set past the watchdog's verdict)."""
    # One retry on a harness timeout, as in the rank-0 case below (see there).
    job = run_job_once_more_if(lambda j: j.rc == HARNESS_TIMEOUT, 4, tmp_path / "run", "--epochs", "1",
                               "--stall-timeout", "10", "--backend", backend, fault="1:5:stop", timeout=120)
    assert job.rc != 0, job.tail()
    assert 10 <= report(job) < PROMPT, job.tail()
    # Rank 1 is always named; on a starved machine a slow live rank may be named beside it.
    assert re.search(r"hpcdl: stall: no training step completed for \d+ s \(step 4\); rank (\d, )*1(, \d)* went silent "
                     r"\(no heartbeat for \d+ s", job.err), job.tail()


@needs_horovod
def test_frozen_rank_ends_the_job_with_horovod_dynamic_process_sets(tmp_path: Path) -> None:
    """With HOROVOD_DYNAMIC_PROCESS_SETS=1 a frozen peer leaves every live rank's main thread
    blocked in Horovod *holding the GIL*, so no Python watchdog can run (found with gdb after this
    very case hung a CI run). faulthandler's backstop, which needs no GIL, must end the job."""
    job = run_job(2, tmp_path / "run", "--epochs", "1", "--stall-timeout", "4", fault="1:5:stop", timeout=150,
                  env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert job.rc not in (0, 124), job.tail()
    backstop = 4 + 10 + 5  # timeout + grace + margin (hpcdl/runtime/watchdog.py)
    assert report(job) < backstop + 30, job.tail()
    # Whichever spoke: the Python watchdog's diagnosis, or faulthandler's dump of the blocked threads.
    assert "went silent" in job.err or f"Timeout (0:00:{backstop})!" in job.err, job.tail()


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_rank_0_is_named_by_the_others(backend: str, tmp_path: Path) -> None:
    """The rank that would diagnose is itself the frozen one: the other ranks end the job (under torch.distributed
    too: the watchdog runs over MPI whichever backend averages the gradients)."""
    # Runs that hit the harness timeout here were first blamed on a starved watchdog thread; the
    # cause was Horovod holding the GIL (docs/reliability.md). The one retry on a harness timeout
    # stays as a guard for a truly overloaded machine; a broken watchdog fails both attempts.
    job = run_job_once_more_if(lambda j: j.rc == HARNESS_TIMEOUT, 2, tmp_path / "run", "--epochs", "1",
                               "--stall-timeout", "4", "--backend", backend, fault="0:5:stop", timeout=90)
    assert job.rc != 0, job.tail()
    assert report(job) < PROMPT, job.tail()
    assert re.search(r"stall: rank 1 completed no step for \d+ s and rank 0 went silent", job.err), job.tail()


def test_hung_rank_that_stays_alive_is_named_with_where_it_hangs(tmp_path: Path) -> None:
    """Rank 1's main thread blocks (a hung data loader) while its process, and heartbeats, live on."""
    job = run_job(2, tmp_path / "run", "--epochs", "1", "--stall-timeout", "4", fault="1:5:hang", timeout=150)
    assert job.rc != 0, job.tail()
    assert report(job) < PROMPT, job.tail()
    assert "alive but stuck: rank 1 in 'data' after step 4 (the other ranks wait in a collective)" in job.err, job.tail()


# ------------------------------------------------------------------ stop signals and exact resume

@pytest.mark.parametrize("stopped_under, resumed_under", [
    backend_param("horovod", "horovod", id="horovod"),
    backend_param("torch", "horovod", id="torch-then-horovod"),
    backend_param("horovod", "torch", id="horovod-then-torch"),
])
def test_sigterm_checkpoints_and_resume_ends_with_the_uninterrupted_weights(
        stopped_under: str, resumed_under: str, tmp_path_factory, tmp_path: Path) -> None:
    """SIGTERM to rank 1 alone at step 30 (mid-epoch 2): every rank stops at the same step, rank 0
    checkpoints, all exit 0; --resume then ends bit-identical to the run that was never stopped (a Horovod run),
    also when the stopped run and its resume average gradients with different backends (on 2 ranks both add the
    same two numbers, so the weights agree to the bit)."""
    reference = baseline_run(tmp_path_factory)
    run_dir = tmp_path / "run"
    # --log-every 1: the stop flag is exchanged after every step (by default, every 50 steps and at an epoch's end)
    stopped = run_job(BASE_RANKS, run_dir, *BASE_FLAGS, "--keep-checkpoints", "2", "--log-every", "1",
                      "--backend", stopped_under, fault="1:30:term")
    assert stopped.rc == 0, stopped.tail()
    assert (f"hpcdl: SIGTERM received by rank 1: checkpoint written at step 30; continue with --resume --output-dir "
            f"{run_dir}") in stopped.out
    assert checkpoint_steps(run_dir) == [22, 30] and not (run_dir / "summary.json").exists()

    # The watchdog runs with a short timeout here too: heartbeats must not disturb training.
    resumed = run_job(BASE_RANKS, run_dir, "--resume", *BASE_FLAGS, "--keep-checkpoints", "2", "--stall-timeout", "15",
                      "--backend", resumed_under)
    assert resumed.rc == 0, resumed.tail()
    assert f"resuming from {run_dir / 'checkpoints' / 'ckpt-000000030.pt'}" in resumed.out
    assert checkpoint_steps(run_dir) == [30, 44]  # keep-K: 22 was pruned when 44 was written
    final, expected = load_checkpoint(run_dir, 44), load_checkpoint(reference, 44)
    assert same_weights(final["model"], expected["model"])
    momentum = [s["momentum_buffer"] for s in final["optimizer"]["state"].values()]
    expected_momentum = [s["momentum_buffer"] for s in expected["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, expected_momentum, strict=True))
    # The interrupted epoch's metrics cover all of it, as if never interrupted.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reference_rows = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    for row, ref in zip(rows, reference_rows, strict=True):
        for key in ("epoch", "global_step", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "lr"):
            assert row[key] == pytest.approx(ref[key], rel=1e-12), key
    assert json.loads((run_dir / "summary.json").read_text())["epochs"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigusr1_to_mpirun_reaches_every_rank_and_checkpoints(backend: str, tmp_path: Path) -> None:
    """What a user does by hand (kill -USR1 <mpirun>) and Slurm's --signal does: Open MPI forwards it."""
    run_dir = tmp_path / "run"
    cmd = ["mpirun", "-np", "2", "--bind-to", "none", PYTHON, "-m", "hpcdl.train", "--output-dir", str(run_dir),
           "--no-progress", "--epochs", "15", "--backend", backend]
    rc, out, err = signal_once_training(cmd, mpi_env({"HPCDL_FAULT": ""}), signal.SIGUSR1)
    assert rc == 0, out[-2000:] + err[-2000:]
    assert "mpirun: Forwarding signal 10 to job" in err
    assert re.search(r"hpcdl: SIGUSR1 received by all 2 ranks: (checkpoint written at step \d+|stopped after epoch \d+)",
                     out), out
    assert "epoch  15/15" not in out and not (run_dir / "summary.json").exists()
    steps = checkpoint_steps(run_dir)
    assert steps and 22 <= steps[-1] < 15 * 22


# ------------------------------------------------------------------ checkpoints that survive

@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_during_a_checkpoint_write_keeps_the_previous_one(backend: str, tmp_path_factory,
                                                                 tmp_path: Path) -> None:
    """Rank 0 SIGKILLed half-way through writing the checkpoint of step 44: the newest complete
    checkpoint (22) stays the newest, and --resume from it reaches the uninterrupted run's weights (a Horovod
    run's: on 2 ranks both backends add the same two numbers)."""
    reference = baseline_run(tmp_path_factory)
    run_dir = tmp_path / "run"
    killed = run_job(BASE_RANKS, run_dir, *BASE_FLAGS, "--backend", backend, fault="0:44:killsave")
    assert killed.rc != 0, killed.tail()
    assert checkpoint_steps(run_dir) == [22]
    leftovers = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".ckpt-000000044.pt.tmp-")]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0  # the half-written file is really there

    resumed = run_job(BASE_RANKS, run_dir, "--resume", *BASE_FLAGS, "--backend", backend)
    assert resumed.rc == 0, resumed.tail()
    assert f"resuming from {run_dir / 'checkpoints' / 'ckpt-000000022.pt'}" in resumed.out
    assert "skipping" not in resumed.err  # the temporary file was never a candidate
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["ckpt-000000022.pt", "ckpt-000000044.pt"]
    assert same_weights(load_checkpoint(run_dir, 44)["model"], load_checkpoint(reference, 44)["model"])


def test_truncated_newest_checkpoint_resume_uses_the_previous_one(tmp_path_factory, tmp_path: Path) -> None:
    """A newest checkpoint cut short (copied by hand, a file system that lost its tail)."""
    reference = baseline_run(tmp_path_factory)
    run_dir = copy_run(reference, tmp_path / "run")
    newest = run_dir / "checkpoints" / "ckpt-000000044.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    job = run_job(BASE_RANKS, run_dir, "--resume", *BASE_FLAGS)
    assert job.rc == 0, job.tail()
    assert "hpcdl: skipping checkpoint: ckpt-000000044.pt is unreadable" in job.err
    assert "hpcdl: set ckpt-000000044.pt aside as ckpt-000000044.pt.unreadable" in job.err
    assert f"resuming from {run_dir / 'checkpoints' / 'ckpt-000000022.pt'}" in job.out
    assert (run_dir / "checkpoints" / "ckpt-000000044.pt.unreadable").exists()
    # Epoch 2 trained again from the end of epoch 1 gives exactly the lost checkpoint back.
    assert same_weights(load_checkpoint(run_dir, 44)["model"], load_checkpoint(reference, 44)["model"])


# ------------------------------------------------------------------ non-finite values

def test_nonfinite_steps_are_skipped_then_a_streak_stops_the_run_without_saving(tmp_path: Path) -> None:
    """NaN loss on rank 1 at step 3 (skipped: training goes on), then from step 25 on with
    --max-nonfinite-steps 3: a clear stop at step 27. The checkpoint of step 22 stays the newest."""
    run_dir = tmp_path / "run"
    job = run_job(BASE_RANKS, run_dir, *BASE_FLAGS, "--max-nonfinite-steps", "3", fault="1:3:nan,1:25-44:nan")
    assert_usage_error(job, "loss or gradients were non-finite for 3 consecutive steps (up to step 27)",
                       "Checkpoints were not overwritten")
    skipped = re.findall(r"^step (\d+): non-finite gradients, update skipped$", job.out, re.M)
    assert skipped == ["3", "25", "26"], job.tail()
    assert checkpoint_steps(run_dir) == [22]
    state = load_checkpoint(run_dir, 22)
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert state["progress"]["nonfinite_streak"] == 0  # step 3's NaN did not carry over


def test_every_run_here_left_no_process_behind(tmp_path_factory) -> None:
    """The failures above end whole jobs: no rank of theirs may survive (a stopped one least of all)."""
    time.sleep(1)
    pattern = f"{PYTHON} -m hpcdl.train --output-dir {tmp_path_factory.getbasetemp()}"
    mine = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert mine == [], f"left-over ranks: {mine}"
