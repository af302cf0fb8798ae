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
    resume_changes,
    stop_condition_extended,
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
    ("max_steps", dict(max_steps=100), False), ("max_steps", dict(max_steps=200), True),
    ("max_steps", dict(max_steps=None), True),
    ("target_accuracy", dict(target_accuracy=0.9), False), ("target_accuracy", dict(target_accuracy=0.99), True),
    ("SIGTERM", {}, True),
])
def test_a_finished_run_trains_further_only_when_its_stop_condition_was_extended(reason: str, flags: dict,
                                                                                  extended: bool) -> None:
    progress = Progress(epochs_completed=15, global_step=100, best_accuracy=0.95, stop_reason=reason)
    assert stop_condition_extended({}, dataclasses.replace(TrainConfig(), **flags), progress) is extended
