"""What every accuracy study does the same way, written once: run ``python -m hpcdl.train`` (the one
training application, so a study measures what users run), read its metrics back, alternate the
contenders so that a shared machine's load hits both alike, and find when a target was first reached.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hpcdl.training.config import TrainConfig, parse_config

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


@dataclass
class TrainRun:
    """One ``hpcdl.train`` process: its command, exit status, metrics rows and summary."""

    command: list[str]
    returncode: int
    rows: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl, one per evaluation
    summary: dict[str, Any] | None = None  # summary.json (None when the run did not finish)
    wall_seconds: float = 0.0
    log_tail: str = ""  # the last lines of its output, when it failed


def check_flags(flags: Sequence[str]) -> TrainConfig:
    """hpcdl.train's own parser on a study's flags: a bad one is a one-line UsageError before any run."""
    return parse_config(list(flags))


def train_command(flags: Sequence[str], ranks: int = 1, vcluster: str | None = None, threads: int = 1) -> list[str]:
    """``python -m hpcdl.train FLAGS``, under ``mpirun -np RANKS`` for more than one rank, or on the nodes of a
    virtual cluster through launch/mpirun.sh."""
    if vcluster is not None:
        return ["bash", str(REPO / "launch" / "mpirun.sh"), "--vcluster", vcluster, "-np", str(ranks), "--threads",
                str(threads), "--", *flags]
    command = [sys.executable, "-m", "hpcdl.train", *flags]
    return command if ranks == 1 else ["mpirun", "-np", str(ranks), "--bind-to", "none", *command]


@dataclass
class StartedRun:
    """An ``hpcdl.train`` process under way: what :func:`finish_train` needs to collect it."""

    command: list[str]
    output_dir: Path
    proc: subprocess.Popen[bytes]
    start: float

    @property
    def log(self) -> Path:
        return self.output_dir.parent / f"{self.output_dir.name}.log"  # not with_suffix: names hold dots (lr0.4)


def start_train(flags: Sequence[str], output_dir: Path, *, ranks: int = 1, threads: int = 1,
                env: dict[str, str] | None = None, python_path: Sequence[str] = (),
                vcluster: str | None = None) -> StartedRun:
    """Start hpcdl.train into ``output_dir``, its log to ``output_dir``.log; ``python_path`` goes before the
    repository on PYTHONPATH (a plugin's package that must shadow one of ours, e.g. kfac-pytorch's ``kfac``)."""
    command = train_command([*flags, "--output-dir", str(output_dir), "--no-progress"], ranks, vcluster, threads)
    run_env = dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {}))
    run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [*python_path, str(REPO), run_env.get("PYTHONPATH", "")]))
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log = output_dir.parent / f"{output_dir.name}.log"
    # The run's parent folder as working directory: `python -m` puts it first on sys.path, never the
    # caller's. The log is a file, never a pipe nobody reads.
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=output_dir.parent, env=run_env, stdout=out, stderr=subprocess.STDOUT)
    return StartedRun(command, output_dir, proc, time.perf_counter())


def finish_train(started: StartedRun, timeout: float) -> TrainRun:
    """Wait for the run (killed ``timeout`` seconds after its start) and read back what it wrote."""
    killed = ""
    try:
        returncode = started.proc.wait(timeout=max(timeout - (time.perf_counter() - started.start), 1.0))
    except subprocess.TimeoutExpired:
        started.proc.kill()
        started.proc.wait()
        returncode, killed = -9, f"(killed after {timeout:.0f} s)"
    run = TrainRun(started.command, returncode, wall_seconds=time.perf_counter() - started.start)
    metrics, summary = started.output_dir / "metrics.jsonl", started.output_dir / "summary.json"
    if metrics.exists():
        run.rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if summary.exists():
        run.summary = json.loads(summary.read_text())
    if returncode != 0:
        lines = started.log.read_text(errors="replace").strip().splitlines()[-3:]
        run.log_tail = "\n".join([*lines, killed] if killed else lines)
    return run


def run_train(flags: Sequence[str], output_dir: Path, *, ranks: int = 1, threads: int = 1,
              timeout: float = 3600.0, env: dict[str, str] | None = None) -> TrainRun:
    """Run hpcdl.train into ``output_dir`` and read back what it wrote; its log goes to ``output_dir``.log."""
    return finish_train(start_train(flags, output_dir, ranks=ranks, threads=threads, env=env), timeout)


def run_pool(starters: Sequence[Callable[[], StartedRun]], jobs: int, timeout: float) -> Iterator[tuple[int, TrainRun]]:
    """Run ``jobs`` at a time, yielding (index in ``starters``, its TrainRun) as each ends: a slow run never
    holds a free slot, and a caller can save after every run."""
    pending = list(enumerate(starters))
    running: list[tuple[int, StartedRun]] = []
    while pending or running:
        while pending and len(running) < jobs:
            index, starter = pending.pop(0)
            running.append((index, starter()))
        while True:
            ended = next((n for n, (_, r) in enumerate(running)
                          if r.proc.poll() is not None or time.perf_counter() - r.start > timeout), None)
            if ended is not None:
                break
            time.sleep(0.5)
        index, started = running.pop(ended)
        yield index, finish_train(started, timeout)


def interleaved(first: Sequence[T], second: Sequence[T], seeds: Sequence[int]) -> list[tuple[T, int]]:
    """The two kinds of contender alternating within each seed, the order reversed on every other seed.

    Neighbouring runs see nearly the same load from other jobs, so per-seed pairs stay fair even
    when the machine's load drifts during a study.
    """
    mixed: list[T] = []
    for i in range(max(len(first), len(second))):
        mixed += [*first[i:i + 1], *second[i:i + 1]]
    plan: list[tuple[T, int]] = []
    for n, seed in enumerate(seeds):
        plan += [(item, seed) for item in (mixed if n % 2 == 0 else mixed[::-1])]
    return plan


def first_reaching(points: Sequence[dict[str, float]], target: float, key: str = "accuracy") -> dict[str, float] | None:
    """The first point (in training order) whose ``key`` reaches ``target``; None if none does.

    A later dip below the target does not undo the first hit: a user stopping at the target would
    have stopped there.
    """
    return next((p for p in points if p[key] >= target), None)


def median_or_inf(values: Sequence[float | None]) -> float:
    """Median where a run that never reached the target counts as 'more than the budget' (inf)."""
    return statistics.median([math.inf if v is None else v for v in values])
