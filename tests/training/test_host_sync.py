"""No host synchronisation inside a training step.

Two witnesses, both restricted to what happens outside the log points the loop marks:

* the torch profiler: no scalar read-back operator (``aten::item`` / ``aten::_local_scalar_dense``,
  what ``.item()``, ``float(t)`` and ``bool(t)`` run, in Python or inside other operators);
* a spy on the Python methods that copy a tensor's values to the host (``item``, ``tolist``,
  ``cpu``, ``numpy``, ``bool()``, ``float()``, ``int()``): on a GPU each of them waits for the device.

On CPU nothing actually waits, but the same calls happen: a read-back that crept into the step
shows up here as it would in a CUDA trace.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hpcdl.training.config import parse_config
from hpcdl.training.job import opened
from hpcdl.training.loop import LOG_POINT, train_one_epoch

READ_BACKS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")


def inside_fused_adam(event) -> bool:
    """Fused Adam's CPU kernel reads its step counter with item(); its CUDA kernel reads it on the device."""
    while event is not None:
        if event.name.startswith("aten::_fused_adam"):
            return True
        event = event.cpu_parent
    return False


SPIED = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
LOG_POINT_FUNCTIONS = {"judge", "read", "reduced"}  # what the loop calls at a log point


class PythonReadBacks:
    """Records each call of a SPIED tensor method made while ``active``, and whether a log point made it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active = False
        self.calls: list[tuple[str, bool]] = []
        for name in SPIED:
            monkeypatch.setattr(torch.Tensor, name, self.spy(name, getattr(torch.Tensor, name)))

    def spy(self, name: str, method):
        def spied(tensor, *args, **kwargs):
            if self.active:
                frame, at_log_point = sys._getframe(1), False
                while frame is not None and not at_log_point:
                    at_log_point = frame.f_code.co_name in LOG_POINT_FUNCTIONS
                    frame = frame.f_back
                self.calls.append((name, at_log_point))
            return method(tensor, *args, **kwargs)

        return spied


def read_backs_outside_log_points(flags: list[str], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], int, int]:
    config = parse_config(["--dataset", "synthetic", "--model", "resnet20", "--synthetic-shape", "3", "16", "16",
                           "--synthetic-size", "256", "--batch-size", "16", "--no-progress",
                           "--output-dir", str(tmp_path / "run"), *flags])
    spy = PythonReadBacks(monkeypatch)
    with opened(config) as job, profile(activities=[ProfilerActivity.CPU]) as trace:
        spy.active = True
        train_one_epoch(job.trainer)
        spy.active = False
    events = trace.events()
    windows = [(e.time_range.start, e.time_range.end) for e in events if e.name == LOG_POINT]
    reads = [e for e in events if e.name in READ_BACKS and not inside_fused_adam(e)]
    outside = [f"{e.name} at {e.time_range.start}" for e in reads
               if not any(start <= e.time_range.start <= end for start, end in windows)]
    outside += [f"Tensor.{name}()" for name, at_log_point in spy.calls if not at_log_point]
    return outside, len(reads) + len(spy.calls), len(windows)


@pytest.mark.parametrize("flags", [[], ["--amp", "bf16", "--channels-last", "on"], ["--batches-per-allreduce", "2"],
                                   ["--optimizer", "adamw"]], ids=["fp32", "bf16-channels-last", "accumulation",
                                                                   "adamw"])
def test_no_read_back_between_log_points(flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outside, reads, windows = read_backs_outside_log_points(["--log-every", "5", *flags], tmp_path, monkeypatch)
    steps = 16 // (2 if "--batches-per-allreduce" in flags else 1)
    assert windows == -(-steps // 5) + 1  # every 5 steps and at the epoch's end, then the epoch's sums
    assert reads > 0  # the log points do read (so the test sees read-backs when they happen)
    assert outside == []


@pytest.mark.parametrize("read_back, caught_as", [("item", "aten::item"), ("tolist", "Tensor.tolist()")])
def test_the_test_sees_a_read_back_inside_a_step(read_back: str, caught_as: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-back slipped into the step is caught (the test can fail): .item() by the profiler and the spy,
    .tolist() (no operator the profiler sees on CPU) by the spy."""
    import hpcdl.training.loop
    original = hpcdl.training.loop.nonfinite_flag

    def syncing(parameters: list[torch.Tensor]) -> torch.Tensor:
        flag = original(parameters)
        getattr(flag, read_back)()
        return flag

    monkeypatch.setattr(hpcdl.training.loop, "nonfinite_flag", syncing)
    outside, _, _ = read_backs_outside_log_points(["--log-every", "5"], tmp_path, monkeypatch)
    assert sum(entry.startswith(caught_as) for entry in outside) == 16, outside
