"""Metrics: exact cross-rank sums, and the run directory's record (rank 0 only).

Ranks accumulate sums and counts locally (loss summed over examples, correct predictions,
examples); :func:`allreduce_sums` adds them over ranks in float64, so the averages are exactly
those of one process over the whole data, even when shards are uneven.

The run directory gets ``metrics.jsonl`` (one JSON object per epoch), TensorBoard event files
under ``tensorboard/``, and ``summary.json`` at the end.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch


class Sums:
    """Running per-rank sums, e.g. ``sums.add(loss=3.2, correct=5, count=8)``."""

    def __init__(self) -> None:
        self.values: dict[str, float] = defaultdict(float)

    def add(self, **values: float | torch.Tensor) -> None:
        for key, value in values.items():
            self.values[key] += float(value)

    def reduced(self, comm) -> dict[str, float]:
        return allreduce_sums(dict(self.values), comm)


def allreduce_sums(values: dict[str, float], comm) -> dict[str, float]:
    """Sum each value over all ranks (every rank must pass the same keys)."""
    from mpi4py import MPI

    keys = sorted(values)
    local = np.array([values[k] for k in keys], dtype=np.float64)
    total = np.empty_like(local)
    comm.Allreduce(local, total, op=MPI.SUM)
    return dict(zip(keys, total.tolist()))


class RunRecord:
    """Writes the run directory's metrics; a no-op object on ranks other than 0."""

    def __init__(self, output_dir: Path, active: bool, resume: bool) -> None:
        self.active = active
        self.path = output_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        self.writer = None
        if not active:
            return
        if resume and self.path.exists():
            self.history = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))

    def log_epoch(self, row: dict[str, Any]) -> None:
        if not self.active:
            return
        # A resumed run may repeat an epoch that was interrupted: the newer row replaces it.
        self.history = [r for r in self.history if r["epoch"] != row["epoch"]] + [row]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.history))
        for key, value in row.items():
            if key != "epoch" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, row["epoch"])
        self.writer.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.active:
            atomic_write_text(self.path.parent / "summary.json", json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def atomic_write_text(path: Path, text: str) -> None:
    """Replace a small file atomically (a kill mid-write leaves the previous version)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)
