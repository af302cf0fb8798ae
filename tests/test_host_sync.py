"""No host synchronisation inside a training step: the torch profiler finds no scalar read-back
(``aten::item`` / ``aten::_local_scalar_dense``, what ``.item()``, ``float(t)`` and ``bool(t)`` do, and
what would make the host wait for a GPU) outside the log points the loop marks.

On CPU nothing actually waits, but the same operators run: a read-back that crept into the step
shows up here as it would in a CUDA trace.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hpcdl.config import parse_config
from hpcdl.job import opened
from hpcdl.loop import LOG_POINT, train_one_epoch

READ_BACKS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")


def inside_fused_adam(event) -> bool:
    """Fused Adam's CPU kernel reads its step counter with item(); its CUDA kernel reads it on the device."""
    while event is not None:
        if event.name.startswith("aten::_fused_adam"):
            return True
        event = event.cpu_parent
    return False


def read_backs_outside_log_points(flags: list[str], tmp_path: Path) -> tuple[list[str], int, int]:
    config = parse_config(["--dataset", "synthetic", "--model", "resnet20", "--synthetic-shape", "3", "16", "16",
                           "--synthetic-size", "256", "--batch-size", "16", "--no-progress",
                           "--output-dir", str(tmp_path / "run"), *flags])
    with opened(config) as job, profile(activities=[ProfilerActivity.CPU]) as trace:
        train_one_epoch(job)
    events = trace.events()
    windows = [(e.time_range.start, e.time_range.end) for e in events if e.name == LOG_POINT]
    reads = [e for e in events if e.name in READ_BACKS and not inside_fused_adam(e)]
    outside = [f"{e.name} at {e.time_range.start}" for e in reads
               if not any(start <= e.time_range.start <= end for start, end in windows)]
    return outside, len(reads), len(windows)


@pytest.mark.parametrize("flags", [[], ["--amp", "bf16", "--channels-last", "on"], ["--batches-per-allreduce", "2"],
                                   ["--optimizer", "adamw"]], ids=["fp32", "bf16-channels-last", "accumulation",
                                                                   "adamw"])
def test_no_read_back_between_log_points(flags: list[str], tmp_path: Path) -> None:
    outside, reads, windows = read_backs_outside_log_points(["--log-every", "5", *flags], tmp_path)
    steps = 16 // (2 if "--batches-per-allreduce" in flags else 1)
    assert windows == -(-steps // 5) + 1  # every 5 steps and at the epoch's end, then the epoch's sums
    assert reads > 0  # the log points do read (so the test sees read-backs when they happen)
    assert outside == []


def test_the_test_sees_a_read_back_inside_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .item() slipped into the step is caught (the test can fail)."""
    import hpcdl.loop

    original = hpcdl.loop.nonfinite_flag

    def syncing(parameters: list[torch.Tensor]) -> torch.Tensor:
        flag = original(parameters)
        flag.item()
        return flag

    monkeypatch.setattr(hpcdl.loop, "nonfinite_flag", syncing)
    outside, _, _ = read_backs_outside_log_points(["--log-every", "5"], tmp_path)
    assert len(outside) >= 16
