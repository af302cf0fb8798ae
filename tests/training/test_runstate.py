"""hpcdl.runstate's rules on their own: checkpoint format, what a resume may change, when a run is finished."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import TrainConfig
from hpcdl.training.runstate import (
    FORMAT,
    FORMAT_VERSION,
    MUST_MATCH,
    Progress,
    check_format,
    finished,
    pause_after,
    resume_changes,
)

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier



def saved(**changes) -> dict:
    return dataclasses.asdict(dataclasses.replace(TrainConfig(), **changes))


def test_a_file_of_another_program_or_version_gets_one_line() -> None:
    check_format({"format": FORMAT, "format_version": FORMAT_VERSION}, Path("c.pt"))
    for state, words in [({"model": {}}, "is not an hpcdl.train checkpoint"),
                         ([1, 2], "is not an hpcdl.train checkpoint"),
                         ({"format": FORMAT, "format_version": 1}, "has checkpoint format 1")]:
        with pytest.raises(UsageError, match=words) as caught:
            check_format(state, Path("c.pt"))
        assert "\n" not in str(caught.value)


def test_what_must_match_is_refused_naming_each_mismatch() -> None:
    with pytest.raises(UsageError) as caught:
        resume_changes(saved(model="resnet20", optimizer="adam"), TrainConfig())
    message = str(caught.value)
    assert "--model resnet20 (checkpoint) vs digits_cnn (now)" in message
    assert "--optimizer adam (checkpoint) vs sgd (now)" in message
    assert set(MUST_MATCH) >= {"dataset", "model", "optimizer"}


def test_what_may_change_is_listed() -> None:
    now = dataclasses.replace(TrainConfig(), weight_decay=5e-4, epochs=30, resume=True, output_dir="x")
    changes = resume_changes(saved(), now)
    assert "--weight-decay 0.0001 -> 0.0005" in changes and "--epochs 15 -> 30" in changes
    assert not any(c.startswith(("--resume", "--output-dir")) for c in changes)


@pytest.mark.parametrize("reason, flags, extended", [
    ("epochs", dict(epochs=15), False), ("epochs", dict(epochs=20), True),
    ("max_steps", dict(max_steps=100, epochs=20), False), ("max_steps", dict(max_steps=200, epochs=20), True),
    ("max_steps", dict(max_steps=None, epochs=20), True),
    ("target_accuracy", dict(target_accuracy=0.9, epochs=20), False),
    ("target_accuracy", dict(target_accuracy=0.99, epochs=20), True),
    ("target_accuracy", dict(target_accuracy=None, epochs=20), True),
    ("SIGTERM", dict(epochs=20), True),
])
def test_a_finished_run_trains_further_only_when_its_stop_condition_was_extended(reason: str, flags: dict,
                                                                                  extended: bool) -> None:
    progress = Progress(epochs_completed=15, global_step=100, best_accuracy=0.95, stop_reason=reason)
    reached = finished(dataclasses.replace(TrainConfig(), **flags), progress)
    assert (reached is None) is extended
    assert extended or reached == reason  # the limit it stopped at is the one still reached


@pytest.mark.parametrize("flags, reason", [
    (dict(epochs=20, max_steps=50), "max_steps"),   # a lower limit than the one it stopped at: still finished
    (dict(epochs=10), "epochs"),
    (dict(epochs=20, target_accuracy=0.5), "target_accuracy"),  # the target comes first, as after an evaluation
    (dict(epochs=15, max_steps=100, target_accuracy=0.9), "target_accuracy"),
])
def test_every_limit_of_the_flags_counts_whichever_the_run_stopped_at(flags: dict, reason: str) -> None:
    progress = Progress(epochs_completed=15, global_step=100, best_accuracy=0.95, stop_reason="SIGTERM")
    assert finished(dataclasses.replace(TrainConfig(), **flags), progress) == reason


@pytest.mark.parametrize("step, in_epoch, max_steps, eval_every, pause", [
    (10, 10, None, None, False), (22, 22, None, None, True),   # the epoch's end (22 steps)
    (7, 7, 7, None, True), (8, 8, 7, None, True),             # --max-steps (and past it)
    (15, 15, None, 5, True), (16, 16, None, 5, False),        # --eval-every's points count global steps
    (27, 5, None, 9, True),
])
def test_the_loop_pauses_where_a_limit_or_an_evaluation_may_fall(step: int, in_epoch: int, max_steps: int | None,
                                                                 eval_every: int | None, pause: bool) -> None:
    assert pause_after(step, in_epoch, 22, max_steps, eval_every) is pause


def test_a_finished_run_names_the_flags_of_its_kind_and_its_summary() -> None:
    """A task's finished run is raised by --target-metric (it refuses --target-accuracy, which was named)."""
    from hpcdl.training.runstate import closing_words, limit_flags

    assert limit_flags(TrainConfig()) == "--epochs, --max-steps or --target-accuracy"
    task = dataclasses.replace(TrainConfig(), task="tests.support.tasks:tiny_regression")
    assert limit_flags(task) == "--epochs, --max-steps or --target-metric"
    progress = Progress(epochs_completed=2, global_step=44, stop_reason="epochs",
                        best={"metric": "test_iou", "goal": "max", "value": 0.8125, "step": 22})
    assert closing_words(dataclasses.replace(task, epochs=2), progress) == \
        "--epochs 2 reached at step 44; best test_iou 0.8125 at step 22"
