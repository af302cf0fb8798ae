"""Metrics: exact cross-rank sums kept on the device, and the run directory's record (rank 0 only).

Ranks accumulate sums (loss summed over examples, correct predictions) as device tensors, so a
training step never waits for the GPU to report a number; the host reads them once per log
interval. :func:`allreduce_sums` adds them over ranks in float64, so the averages are exactly those
of one process over the whole data, even when shards are uneven.

The run directory gets ``metrics.jsonl`` (one JSON object per epoch), TensorBoard event files
under ``tensorboard/``, and ``summary.json`` at the end. Every file is strict JSON: a non-finite
number is written as null, never as the NaN that JSON parsers reject.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcdl.persistence.atomic import write_text_atomically
from hpcdl.runtime.coordination import GlooComm
from hpcdl.runtime.errors import UsageError


class DeviceSums:
    """Per-rank running sums of loss, correct predictions and examples, on the device.

    With ``skip_nonfinite`` a batch whose loss is not finite is left out (training: that step's update
    was skipped, and its NaN would hide the epoch's real loss); evaluation keeps every batch, so that
    a diverged model shows as a non-finite test loss.
    """

    def __init__(self, device: torch.device, skip_nonfinite: bool = False) -> None:
        self.device = device
        self.skip_nonfinite = skip_nonfinite
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, count: int) -> None:
        batch = torch.stack((loss_sum.detach().double(), correct.double(), torch.full_like(self.totals[0], count)))
        if self.skip_nonfinite:
            batch = torch.where(torch.isfinite(batch[0]), batch, torch.zeros_like(batch))
        self.totals += batch

    def read(self) -> dict[str, float]:
        """This rank's sums as numbers: waits for the device, so call it once per log interval."""
        loss, correct, count = self.totals.tolist()
        return {"loss": loss, "correct": correct, "count": count}

    def reduced(self, comm) -> dict[str, float]:
        return allreduce_sums(self.read(), comm)


def allreduce_sums(values: dict[str, float], comm) -> dict[str, float]:
    """Sum each value over all ranks (every rank must pass the same keys)."""
    keys = sorted(values)
    local = np.array([values[k] for k in keys], dtype=np.float64)
    total = np.empty_like(local)
    if isinstance(comm, GlooComm):  # a job without MPI: hpcdl.runtime.coordination
        comm.Allreduce(local, total)
    else:
        from mpi4py import MPI

        comm.Allreduce(local, total, op=MPI.SUM)
    return dict(zip(keys, total.tolist(), strict=True))


def averages(sums: dict[str, float]) -> tuple[float, float]:
    """(mean loss, accuracy) of allreduced sums."""
    count = max(sums["count"], 1.0)
    return sums["loss"] / count, sums["correct"] / count


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, so that json.dumps(allow_nan=False) succeeds."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def to_json(value: Any, indent: int | None = None) -> str:
    return json.dumps(json_safe(value), indent=indent, allow_nan=False)


class RunRecord:
    """Writes the run directory's metrics; a no-op object on ranks other than 0.

    ``kept_through``: None for a new run; on a resume, the step of the checkpoint it continues from.
    Rows of later steps were trained and then discarded (a crash after the checkpoint): they are
    removed at once, atomically, as are TensorBoard's events of those steps (``purge_step``), so
    that every record holds each step once, as trained by the run that goes on.
    """

    def __init__(self, output_dir: Path, active: bool, kept_through: int | None, run_id: str = "") -> None:
        self.active = active
        self.run_id = run_id
        self.path = output_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        self.writer: Any = None
        self.purge_step = None if kept_through is None else kept_through + 1
        if not active:
            return
        if kept_through is not None and self.path.exists():
            try:
                rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise UsageError(f"{self.path} is unreadable ({type(exc).__name__}: {exc}); move it away to resume "
                                 "without the earlier epochs' rows") from None
            self.history = [r for r in rows if _step_of(r) <= kept_through]
            if len(self.history) < len(rows):
                write_text_atomically(self.path, "".join(to_json(r) + "\n" for r in self.history), run_id or None)

    def log_epoch(self, row: dict[str, Any]) -> None:
        if not self.active:
            return
        if self.writer is None:  # opened on first use: a run that trains nothing writes nothing
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"), purge_step=self.purge_step)
        row = {**row, "run_id": self.run_id}
        if isinstance(row.get("global_step"), int):  # one row per step: a row of this step or later was gone back on
            self.history = [r for r in self.history if _step_of(r) < row["global_step"]]
        self.history.append(row)
        write_text_atomically(self.path, "".join(to_json(r) + "\n" for r in self.history), self.run_id or None)
        for key, value in row.items():  # against the optimizer step: an --eval-every row's epoch is fractional
            if key != "global_step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, row.get("global_step", row["epoch"]))
        self.writer.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.active:
            text = to_json({**summary, "run_id": self.run_id}, 2) + "\n"
            write_text_atomically(self.path.parent / "summary.json", text, self.run_id or None)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _step_of(row: dict[str, Any]) -> int:
    """A row's optimizer step; rows of files from before steps were recorded count as step 0 (kept)."""
    step = row.get("global_step")
    return step if isinstance(step, int) else 0
