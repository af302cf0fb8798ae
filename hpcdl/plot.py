"""Plot loss and accuracy curves of one or more runs: ``python -m hpcdl.plot RUN_DIR... [-o curves.png]``.

Reads each run's ``metrics.jsonl`` and draws train/test loss and test accuracy against the epoch,
and test accuracy against wall time (the time-to-accuracy view HPC users compare).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from hpcdl.errors import UsageError, run_main


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir} has no metrics.jsonl (is it an hpcdl run directory?)")
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is malformed: {exc}") from exc


def plot_runs(run_dirs: Sequence[Path], output: Path, labels: Sequence[str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_time) = plt.subplots(1, 3, figsize=(15, 4.2))
    for index, run_dir in enumerate(run_dirs):
        rows = read_metrics(run_dir)
        label = labels[index] if labels else run_dir.name
        epochs = [r["epoch"] for r in rows]
        (line,) = ax_loss.plot(epochs, [r["train_loss"] for r in rows], label=f"{label} train")
        ax_loss.plot(epochs, [r["test_loss"] for r in rows], "--", color=line.get_color(), label=f"{label} test")
        ax_acc.plot(epochs, [r["test_accuracy"] for r in rows], color=line.get_color(), label=label)
        ax_time.plot([r["elapsed_seconds"] for r in rows], [r["test_accuracy"] for r in rows],
                     color=line.get_color(), label=label)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss", yscale="log")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    ax_time.set(xlabel="wall time (s)", ylabel="test accuracy", title="time to accuracy")
    for ax in (ax_loss, ax_acc, ax_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcdl.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    parser.add_argument("-o", "--output", type=Path, help="PNG to write (default: curves.png in the first run)")
    parser.add_argument("--labels", nargs="+", help="legend labels, one per run")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        raise UsageError("--labels needs one label per run directory")
    output = args.output or args.runs[0] / "curves.png"
    print(plot_runs(args.runs, output, args.labels))
    return 0


if __name__ == "__main__":
    run_main(main, program="hpcdl.plot")
