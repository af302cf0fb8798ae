"""PhaseTimer: where the preconditioner's step goes, in host seconds per phase.

For the trainer's step breakdown and the benchmarks. On a GPU a phase's seconds are the time to launch its work,
not to finish it, unless ``synchronise`` is set: then each phase waits for the device before and after, so that its
seconds include its kernels and copies (at the price of the overlap, which is why it is off unless a trace or a
benchmark asks for it).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

import torch

# The phases of the preconditioner's ``step()``, in the order they run.
PHASES = ("statistics", "factor_reduction", "factors", "decompositions", "sharing", "precondition")


class PhaseTimer:
    """Host seconds per phase in ``seconds``, each exclusive of the phases nested in it. ``statistics`` includes
    the capture hooks' work inside forward and backward; ``in_forward`` is the part of it that ran in forward.
    ``device()``: where the work runs (the model's: it may move after the preconditioner is built), or None."""

    def __init__(self, device: Callable[[], torch.device | None]) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.in_forward = 0.0
        self.synchronise = False
        self._device = device
        self._open: list[float] = []  # per open phase, the seconds of the phases nested in it

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the phase's seconds to ``seconds`` and name it ``kfac.<name>`` for torch.profiler when one is
        recording. With ``synchronise`` on a GPU the device is waited for on entry (earlier work is not this
        phase's) and on exit (this phase's kernels and copies are)."""
        device = self._synchronised_device()
        if device is not None:
            torch.cuda.synchronize(device)
        start = perf_counter()
        self._open.append(0.0)
        profiled = torch.autograd._profiler_enabled()
        try:
            with torch.profiler.record_function(f"kfac.{name}") if profiled else contextlib.nullcontext():
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
        before = self.seconds["statistics"]
        with self.phase("statistics"):
            yield
        if where == "forward":
            self.in_forward += self.seconds["statistics"] - before

    def _synchronised_device(self) -> torch.device | None:
        device = self._device() if self.synchronise else None
        return device if device is not None and device.type == "cuda" else None
