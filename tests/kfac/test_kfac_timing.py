"""kfac.timing: each phase's seconds exclude the phases nested in it; the hooks' forward part is kept apart.

A fake clock makes the accounting exact (no speed is measured here). The preconditioner-level accounting (the
hooks inside forward and backward, the step breakdown) is test_kfac_phase_accounting.py's.
"""

from __future__ import annotations

import pytest
import torch

from kfac import timing
from kfac.timing import PhaseTimer


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing, "perf_counter", lambda: now[0])
    return now


def test_a_phase_excludes_the_phases_nested_in_it(clock) -> None:
    timer = PhaseTimer(lambda: torch.device("cpu"))
    with timer.phase("decompositions"):
        clock[0] += 1.0
        with timer.phase("sharing"):
            clock[0] += 4.0
            with timer.phase("sharing"):  # a phase nested in itself counts once
                clock[0] += 2.0
        clock[0] += 0.5
    with timer.phase("precondition"):
        clock[0] += 3.0
    assert dict(timer.seconds) == {"decompositions": 1.5, "sharing": 6.0, "precondition": 3.0}


def test_a_phase_that_raises_is_still_counted(clock) -> None:
    timer = PhaseTimer(lambda: None)
    with pytest.raises(RuntimeError), timer.phase("factors"):
        clock[0] += 2.0
        raise RuntimeError("a failing step")
    with timer.phase("factors"):
        clock[0] += 1.0
    assert timer.seconds["factors"] == 3.0


def test_the_hooks_are_statistics_and_their_forward_part_is_kept_apart(clock) -> None:
    timer = PhaseTimer(lambda: None)
    with timer.hook("forward"):
        clock[0] += 2.0
    with timer.hook("backward"):
        clock[0] += 5.0
    with timer.phase("factors"), timer.hook("backward"):
        clock[0] += 1.0
    assert timer.seconds["statistics"] == 8.0 and timer.in_forward == 2.0 and timer.seconds["factors"] == 0.0


def test_a_recording_profiler_sees_each_phase_by_name() -> None:
    timer = PhaseTimer(lambda: None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile, \
            timer.phase("precondition"):
        torch.ones(3).sum()
    assert "kfac.precondition" in {event.name for event in profile.events()}
    assert timing.PHASES == ("statistics", "factor_reduction", "factors", "decompositions", "sharing", "precondition")


def test_synchronise_waits_only_for_a_gpu(monkeypatch) -> None:
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    for device in (torch.device("cpu"), None):
        timer = PhaseTimer(lambda device=device: device)
        timer.synchronise = True
        with timer.phase("factors"):
            pass
    assert waited == []
    gpu = PhaseTimer(lambda: torch.device("cuda", 0))
    with gpu.phase("factors"):  # not asked to synchronise
        pass
    gpu.synchronise = True
    with gpu.phase("factors"):
        pass
    assert waited == [torch.device("cuda", 0)] * 2  # on entry and on exit
