"""What recording a step's phases costs when no trace is taken: hpcdl.train's loop with its phase clock
against the same loop with a clock that records nothing, side by side in one process.

    .venv/bin/python benchmarks/phase_overhead.py --refresh-results

The two clocks alternate epoch by epoch on the same job (synthetic 16x16 images, resnet20, batch 16: small
steps, where a fixed cost per phase weighs most), after a warm-up epoch; the ratio of the medians is the
figure (docs/training.md, "Where a step goes"). Results go to runs/bench/ unless --refresh-results.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from figures import results, save_json, times

from hpcdl.persistence import outputs
from hpcdl.runtime.console import RankZeroParser
from hpcdl.runtime.errors import run_main
from hpcdl.runtime.numbers import integer
from hpcdl.training.config import parse_config
from hpcdl.training.job import opened
from hpcdl.training.loop import train_one_epoch
from hpcdl.training.phases import StepPhases


class SilentPhases(StepPhases):
    """The loop's phase clock with every call a no-op: the loop as if phases were never recorded."""

    def data_wait_begins(self) -> None:
        pass

    def begin_step(self) -> None:
        pass

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def end_step(self) -> None:
        pass


def measure(epochs: int, scratch: Path) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    config = parse_config(["--dataset", "synthetic", "--model", "resnet20", "--synthetic-shape", "3", "16", "16",
                           "--synthetic-size", "512", "--batch-size", "16", "--no-progress", "--epochs", "1000",
                           "--output-dir", str(scratch / "run"), "--stall-timeout", "0"])
    seconds: dict[str, list[float]] = {"recorded": [], "silent": []}
    with opened(config) as job:
        trainer = job.trainer
        clocks = {"recorded": trainer.phases, "silent": SilentPhases()}
        train_one_epoch(trainer)  # warm-up
        for epoch in range(2 * epochs):
            kind = ("recorded", "silent")[epoch % 2]
            trainer.phases = clocks[kind]
            trainer.state.progress.epoch, trainer.state.progress.step_in_epoch = epoch + 1, 0
            start = time.perf_counter()
            train_one_epoch(trainer)
            seconds[kind].append(time.perf_counter() - start)
            print(f"[phase_overhead] epoch {epoch + 1}/{2 * epochs} {kind}: {seconds[kind][-1]:.2f} s", flush=True)
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = RankZeroParser(prog="benchmarks/phase_overhead.py", description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=integer(1), default=6, help="epochs with each clock (default 6)")
    parser.add_argument("--out", type=Path, help="results path without suffix (default runs/bench/phase_overhead)")
    parser.add_argument("--refresh-results", action="store_true")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    stem = outputs.results_stem(args.out, "phase_overhead", (".json",), refresh_results=args.refresh_results,
                                force=args.force, flag="--out")
    with tempfile.TemporaryDirectory(prefix="phase_overhead-") as tmp:
        seconds = measure(args.epochs, Path(tmp))
    ratio = statistics.median(seconds["recorded"]) / statistics.median(seconds["silent"])
    report = dict(kind="phase_overhead", steps_per_epoch=32, seconds=seconds, ratio=ratio)
    print(f"recorded / silent, median epoch: {ratio:.3f}; wrote {save_json(stem, report)}")
    return 0


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

def _overhead() -> str:
    """The loop with its phase clock over the loop with a silent one (median epochs, side by side)."""
    r = results("phase_overhead")
    return f"{times(r['ratio'], 3)} (resnet20, batch 16, {len(r['seconds']['recorded'])} epochs each)"


FIGURES = {"phases.overhead": _overhead}


if __name__ == "__main__":
    run_main(main, program="phase_overhead")
