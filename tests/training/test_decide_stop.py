"""Why a run stops after an epoch: its own limits come before a signal that arrived in the same epoch.

A signal in the last epoch must not leave a finished run looking interrupted: it would write no
summary, and its resume (Slurm's requeue) finds the limit reached and writes nothing either.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from hpcdl.training.config import TrainConfig
from hpcdl.training.loop import EpochResult
from hpcdl.training.runstate import Progress
from hpcdl.training.train import decide_stop


def job(epoch: int, epochs: int, step: int = 10, max_steps: int | None = None) -> SimpleNamespace:
    progress = Progress(epoch=epoch, epochs_completed=epoch, global_step=step)
    config = dataclasses.replace(TrainConfig(), epochs=epochs, max_steps=max_steps)
    return SimpleNamespace(state=SimpleNamespace(progress=progress), config=config)


def result(signal: str | None) -> EpochResult:
    stop = SimpleNamespace(name=signal) if signal else None
    return EpochResult(train={}, images=0, seconds=0.0, complete=True, stop=stop)  # type: ignore[arg-type]


@pytest.mark.parametrize(("state", "signal", "expected"), [
    (job(4, 4), "SIGUSR1", "epochs"),             # the signal came as the run finished: finished
    (job(2, 4, step=8, max_steps=8), "SIGTERM", "max_steps"),
    (job(2, 4), "SIGUSR1", "SIGUSR1"),            # mid-run: stop, checkpoint, resume later
    (job(2, 4), None, None),
    (job(4, 4), None, "epochs"),
])
def test_the_runs_own_limit_comes_before_a_signal(state, signal, expected) -> None:
    assert decide_stop(state, result(signal)) == expected  # type: ignore[arg-type]
