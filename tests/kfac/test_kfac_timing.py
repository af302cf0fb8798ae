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


class FakeEvent:
    """A CUDA event on a fake device clock: recorded at the clock's time, waited for by synchronize()."""

    def __init__(self, clock: list[float], waits: list[str]) -> None:
        self.clock, self.waits, self.time = clock, waits, None

    def record(self) -> None:
        self.time = self.clock[0]

    def synchronize(self) -> None:
        self.waits.append("event")

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.time - self.time) * 1e3  # milliseconds, as torch.cuda.Event's


@pytest.fixture
def device_clock(monkeypatch):
    """A timer on events of a fake device, the device's clock (advanced by the test, as kernels would), and every
    wait for the device."""
    now, waits = [0.0], []
    monkeypatch.setattr(timing, "_event", lambda: FakeEvent(now, waits))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append("device"))
    monkeypatch.setattr(timing, "perf_counter", lambda: 0.0)  # the host's clock must not count
    timer = PhaseTimer(lambda: torch.device("cuda", 0))
    timer.device_events = True
    return timer, now, waits


def test_device_events_time_each_phase_on_the_device_without_waiting_until_settled(device_clock) -> None:
    timer, now, waits = device_clock
    with timer.phase("decompositions"):
        now[0] += 1.0
        with timer.phase("sharing"):
            now[0] += 4.0
            with timer.phase("sharing"):
                now[0] += 2.0
        now[0] += 0.5
    with timer.hook("forward"):
        now[0] += 3.0
    with timer.hook("backward"):
        now[0] += 0.25
    assert waits == [] and sum(timer.seconds.values()) == 0.0  # nothing waited for, nothing read yet
    timer.settle()
    assert dict(timer.seconds) == {"decompositions": 1.5, "sharing": 6.0, "statistics": 3.25}
    assert timer.in_forward == 3.0 and waits and set(waits) == {"event"}
    timer.settle()  # settled spans are not counted twice
    assert timer.seconds["sharing"] == 6.0 and timer.in_forward == 3.0


def test_a_phase_open_at_settle_is_counted_by_the_next_settle(device_clock) -> None:
    timer, now, _ = device_clock
    with timer.hook("forward"):
        now[0] += 1.0
        with timer.phase("factor_reduction"):
            now[0] += 2.0
        timer.settle()  # the nested phase is done, its hook is not
        assert dict(timer.seconds) == {"factor_reduction": 2.0}
        now[0] += 0.5
    timer.settle()
    assert dict(timer.seconds) == {"factor_reduction": 2.0, "statistics": 1.5} and timer.in_forward == 1.5


def test_device_events_leave_a_cpu_model_on_the_host_clock(clock, monkeypatch) -> None:
    monkeypatch.setattr(timing, "_event", lambda: pytest.fail("an event was made for a CPU model"))
    timer = PhaseTimer(lambda: torch.device("cpu"))
    timer.device_events = True
    with timer.phase("factors"):
        clock[0] += 2.0
    assert timer.seconds["factors"] == 2.0
    timer.settle()
    assert timer.seconds["factors"] == 2.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_events_time_real_kernels() -> None:
    timer = PhaseTimer(lambda: torch.device("cuda"))
    timer.device_events = True
    x = torch.randn(2048, 2048, device="cuda")
    with timer.phase("precondition"):
        for _ in range(20):
            x = x @ x / 2048
    timer.settle()
    assert timer.seconds["precondition"] > 0.0
