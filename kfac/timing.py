"""PhaseTimer: where the preconditioner's step goes, in seconds per phase.

For the trainer's step breakdown and the benchmarks. On a GPU a phase's host seconds are the time to launch its
work, not to finish it. Two ways to see the device's side:

- ``synchronise``: each phase waits for the device before and after, so that its seconds include its kernels and
  copies. Simple and what a trace wants, but each wait also stalls the host's launches of the work around the
  phase (forward's and backward's kernels between the hooks): a step timed so is slower than a real one, and the
  difference belongs to no phase.
- ``device_events``: each phase records a CUDA event on its stream when it starts and when it ends, without
  waiting; :meth:`PhaseTimer.settle` waits once and adds each phase's span on the device (exclusive of the phases
  nested in it) to ``seconds``. The step runs as it would untimed, so a phase's seconds are the device time its
  kernels took or held the stream idle (its host work, where the host was the bottleneck). For benchmarks.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch

# The phases of the preconditioner's ``step()``, in the order they run.
PHASES = ("statistics", "factor_reduction", "factors", "decompositions", "sharing", "precondition")


def _event() -> Any:
    """A CUDA event that can time (a function, so that the tests can hand out their own)."""
    return torch.cuda.Event(enable_timing=True)


def _profiled(name: str) -> AbstractContextManager[Any]:
    """The phase as a ``kfac.<name>`` range for torch.profiler when one is recording (else nothing)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"kfac.{name}")
    return contextlib.nullcontext()


@dataclass
class _Span:
    """A phase timed on the device: its events, whether it is (or is nested in) a hook's work in forward, the
    spans nested in it (indices), whether settle() has counted it."""

    name: str
    start: Any
    in_forward: bool
    end: Any = None
    children: list[int] = field(default_factory=list)
    settled: bool = False


class PhaseTimer:
    """Seconds per phase in ``seconds``, each exclusive of the phases nested in it: the host's, or with
    ``device_events`` the device's once :meth:`settle` ran. ``statistics`` includes the capture hooks' work inside
    forward and backward; ``in_forward`` is the part of it that ran in forward. ``device()``: where the work runs
    (the model's: it may move after the preconditioner is built), or None."""

    def __init__(self, device: Callable[[], torch.device | None]) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.in_forward = 0.0
        self.synchronise = False
        self.device_events = False
        self._device = device
        self._open: list[float] = []  # per open phase, the seconds of the phases nested in it
        self._spans: list[_Span] = []  # the phases timed on the device since the last settle()
        self._open_spans: list[int] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the phase's seconds to ``seconds`` and name it ``kfac.<name>`` for torch.profiler when one is
        recording. With ``synchronise`` on a GPU the device is waited for on entry (earlier work is not this
        phase's) and on exit (this phase's kernels and copies are); with ``device_events`` the phase's span on the
        device is recorded, for :meth:`settle`."""
        if self._timing_events():
            with self._device_span(name, in_forward=False):
                yield
            return
        device = self._synchronised_device()
        if device is not None:
            torch.cuda.synchronize(device)
        start = perf_counter()
        self._open.append(0.0)
        try:
            with _profiled(name):
                yield
        finally:
            if device is not None:
                torch.cuda.synchronize(device)
            elapsed = perf_counter() - start
            nested = self._open.pop()
            self.seconds[name] += elapsed - nested
            if self._open:
                self._open[-1] += elapsed

    @contextmanager
    def hook(self, where: str) -> Iterator[None]:
        """The capture hooks' work, inside ``where`` ("forward" or "backward"): the statistics phase."""
        if self._timing_events():  # the forward part is counted when the spans settle
            with self._device_span("statistics", in_forward=where == "forward"):
                yield
            return
        before = self.seconds["statistics"]
        with self.phase("statistics"):
            yield
        if where == "forward":
            self.in_forward += self.seconds["statistics"] - before

    def settle(self) -> None:
        """Wait for the device and add the phases it timed since the last call (``device_events``) to ``seconds``.
        Called between steps; a phase still open is added by a later call."""
        done = [i for i, s in enumerate(self._spans) if s.end is not None and not s.settled]
        for i in done:
            self._spans[i].end.synchronize()
        seconds = {i: s.start.elapsed_time(s.end) / 1e3 for i, s in enumerate(self._spans) if s.end is not None}
        for i in done:
            span = self._spans[i]
            own = seconds[i] - sum(seconds[c] for c in span.children)
            self.seconds[span.name] += own
            if span.name == "statistics" and span.in_forward:
                self.in_forward += own
            span.settled = True
        if not self._open_spans:
            self._spans = []

    @contextmanager
    def _device_span(self, name: str, in_forward: bool) -> Iterator[None]:
        parent = self._open_spans[-1] if self._open_spans else None
        in_forward = in_forward or (parent is not None and self._spans[parent].in_forward)
        span = _Span(name, _event(), in_forward)
        span.start.record()
        index = len(self._spans)
        self._spans.append(span)
        if parent is not None:
            self._spans[parent].children.append(index)
        self._open_spans.append(index)
        try:
            with _profiled(name):
                yield
        finally:
            end = _event()
            end.record()
            span.end = end
            self._open_spans.pop()

    def _timing_events(self) -> bool:
        return self.device_events and self._cuda_device() is not None

    def _cuda_device(self) -> torch.device | None:
        device = self._device()
        return device if device is not None and device.type == "cuda" else None

    def _synchronised_device(self) -> torch.device | None:
        return self._cuda_device() if self.synchronise else None
