"""Where a rank's training step goes: host seconds per named phase, and a trace of chosen steps.

Every step is cut into the phases below; each is a ``torch.profiler.record_function`` range (free
unless a profiler records) timed with ``time.perf_counter`` (no device sync: on a GPU a phase is the
time to queue its work unless ``--profile-steps`` is recording, when the device is synchronised at
each phase's end so that the trace and the seconds tell the same story; the preconditioner's phases are
then synchronised too). K-FAC's own phases come from the preconditioner's ``timings``
(kfac.preconditioner.PHASES), taken out of the phase they ran in (its statistics run inside forward's
and backward's hooks: ``statistics_in_forward`` says how much in forward). Per evaluation point and for
the whole run each rank keeps the median and mean seconds of every phase; the ranks' figures are
gathered so that the slowest and the fastest rank are named (docs/training.md, "Where a step goes").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcdl.runtime.errors import UsageError

# The loop's own phases, in the order a step runs them; K-FAC's follow, prefixed "kfac.".
LOOP_PHASES = ("data", "forward", "backward", "allreduce", "kfac", "optimizer")
KFAC_PHASES = ("statistics", "factor_reduction", "factors", "decompositions", "sharing", "precondition")
# The breakdown's phases: backward without K-FAC's statistics, "kfac" the preconditioner's step outside
# its named phases (bookkeeping), every K-FAC phase on its own.
PHASES = ("data", "forward", "backward", "allreduce", *(f"kfac.{p}" for p in KFAC_PHASES), "kfac.other", "optimizer")
STEP = "hpcdl.step"  # the profiler range of one whole step


def parse_profile_steps(text: str) -> tuple[int, int]:
    """'A:B' (global steps, 1-based, inclusive) -> (A, B); one line naming the flag otherwise."""
    first, sep, last = text.partition(":")
    try:
        window = (int(first), int(last) if sep else int(first))
    except ValueError:
        raise UsageError(f"--profile-steps must be FIRST:LAST global steps (e.g. 10:12), got {text!r}") from None
    if window[0] < 1 or window[1] < window[0]:
        raise UsageError(f"--profile-steps must be FIRST:LAST with 1 <= FIRST <= LAST, got {text!r}")
    return window


class StepPhases:
    """Seconds per phase of every step on this rank; ``take()`` returns the steps since the last take."""

    def __init__(self, preconditioner: Any = None, device: torch.device | None = None) -> None:
        self.preconditioner = preconditioner
        self.device = device
        self._synchronise = False
        self._current: dict[str, float] = {}
        self._kfac_before: dict[str, float] = {}
        self._forward_statistics_before = 0.0
        self._steps: list[list[float]] = []  # per step since the last take: seconds per PHASES, then the step
        self._all: list[list[float]] = []  # every step of this session
        self._step_start = 0.0
        self._step_range: Any = None
        self._data_start = time.perf_counter()

    @property
    def synchronise(self) -> bool:
        """Set while a trace records, so that seconds on a GPU are the device's (the preconditioner's too)."""
        return self._synchronise

    @synchronise.setter
    def synchronise(self, value: bool) -> None:
        self._synchronise = value
        if self.preconditioner is not None and hasattr(self.preconditioner, "synchronise_timings"):
            self.preconditioner.synchronise_timings = value

    def data_wait_begins(self) -> None:
        """The loop asks its data iterator for the next batch now."""
        self._data_start = time.perf_counter()

    def begin_step(self) -> None:
        now = time.perf_counter()
        self._current = {"data": now - self._data_start}
        self._step_start = self._data_start
        self._kfac_before = dict(self._kfac_timings())
        self._forward_statistics_before = self._forward_statistics()
        self._step_range = torch.profiler.record_function(STEP)
        self._step_range.__enter__()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        with torch.profiler.record_function(f"hpcdl.{name}"):
            yield
            if self.synchronise and self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - start

    def end_step(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        current = self._current
        after = self._kfac_timings()
        kfac = {p: after.get(p, 0.0) - self._kfac_before.get(p, 0.0) for p in KFAC_PHASES}
        in_forward = self._forward_statistics() - self._forward_statistics_before
        row = {
            "data": current.get("data", 0.0),
            "forward": current.get("forward", 0.0) - in_forward,
            "backward": current.get("backward", 0.0) - (kfac["statistics"] - in_forward),
            "allreduce": current.get("allreduce", 0.0),
            **{f"kfac.{p}": kfac[p] for p in KFAC_PHASES},
            "kfac.other": current.get("kfac", 0.0) - sum(kfac[p] for p in KFAC_PHASES if p != "statistics"),
            "optimizer": current.get("optimizer", 0.0),
        }
        self._steps.append([row[p] for p in PHASES] + [time.perf_counter() - self._step_start])
        self._all.append(self._steps[-1])
        self._current = {}

    def _forward_statistics(self) -> float:
        return float(getattr(self.preconditioner, "statistics_in_forward", 0.0))

    def _kfac_timings(self) -> dict[str, float]:
        timings = getattr(self.preconditioner, "timings", None)
        return dict(timings) if timings else {}

    def take(self) -> np.ndarray:
        """(steps, len(PHASES) + 1) seconds of the steps since the last take; the last column is the step."""
        steps = np.asarray(self._steps, dtype=np.float64).reshape(-1, len(PHASES) + 1)
        self._steps = []
        return steps

    def session(self) -> np.ndarray:
        """Every step of this session (since the process started or resumed), as :meth:`take` shapes them."""
        return np.asarray(self._all, dtype=np.float64).reshape(-1, len(PHASES) + 1)


@dataclass
class PhaseBreakdown:
    """Every rank's median and mean seconds per phase over a run of steps (``None`` before any step)."""

    steps: int
    median: dict[str, list[float]]  # phase (and "step") -> per rank
    mean: dict[str, list[float]]

    def to_json(self) -> dict[str, Any]:
        """Per phase: median on the slowest and the fastest rank and which ranks those are; means per rank."""
        out: dict[str, Any] = {"steps": self.steps, "phases": {}}
        for name, per_rank in self.median.items():
            slowest, fastest = int(np.argmax(per_rank)), int(np.argmin(per_rank))
            out["phases"][name] = {
                "median_slowest": per_rank[slowest], "slowest_rank": slowest,
                "median_fastest": per_rank[fastest], "fastest_rank": fastest,
                "median_per_rank": per_rank, "mean_per_rank": self.mean[name],
            }
        return out


def breakdown(steps: np.ndarray, comm: Any) -> PhaseBreakdown:
    """Collective: gather every rank's per-phase medians and means of ``steps`` (its rows since the last call)."""
    names = [*PHASES, "step"]
    if len(steps):
        mine = (np.median(steps, axis=0).tolist(), steps.mean(axis=0).tolist())
    else:
        mine = ([0.0] * len(names), [0.0] * len(names))
    gathered = comm.allgather((len(steps), mine))
    median = {n: [g[1][0][k] for g in gathered] for k, n in enumerate(names)}
    mean = {n: [g[1][1][k] for g in gathered] for k, n in enumerate(names)}
    return PhaseBreakdown(min(g[0] for g in gathered), median, mean)


class TraceWindow:
    """A torch.profiler trace of global steps FIRST..LAST on this rank (``traces/rank<r>.json``, Perfetto and
    chrome://tracing open it), and Horovod's timeline of the same steps when Horovod runs the job."""

    def __init__(self, window: tuple[int, int] | None, out_dir: Path, rank: int, phases: StepPhases,
                 hvd: Any = None) -> None:
        self.window, self.out_dir, self.rank, self.phases, self.hvd = window, out_dir, rank, phases, hvd
        self._profiler: torch.profiler.profile | None = None
        self.written: list[Path] = []

    def before_step(self, step: int) -> None:
        """Start recording at the window's first step (from its data wait on when :meth:`after_step` saw the
        step before)."""
        if self.window is None or not self.window[0] <= step <= self.window[1] or self._profiler is not None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and self.phases.device is not None and self.phases.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        self._profiler.__enter__()
        self.phases.synchronise = True
        if self.hvd is not None:
            self.hvd.start_timeline(str(self.out_dir / "horovod_timeline.json"))

    def after_step(self, step: int) -> None:
        if self._profiler is not None and self.window is not None and step >= self.window[1]:
            self.close()
        elif self.window is not None and step + 1 == self.window[0]:
            self.before_step(step + 1)

    def close(self) -> None:
        """End the trace (the run ended inside the window too) and write it."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        self.phases.synchronise = False
        profiler.__exit__(None, None, None)
        if self.hvd is not None:
            self.hvd.stop_timeline()
        path = self.out_dir / f"rank{self.rank}.json"
        profiler.export_chrome_trace(str(path))
        self.written.append(path)
