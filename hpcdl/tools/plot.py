"""Plot loss and accuracy curves of one or more runs: ``python -m hpcdl.plot RUN_DIR... [-o curves.png]``.

Reads each run's ``metrics.jsonl`` and draws train/test loss and test accuracy against the epoch,
and test accuracy against wall time (the time-to-accuracy view HPC users compare). A ``--task`` run without
an accuracy shows its first metric instead (its test loss when it has none). With ``--phases`` it draws
where each rank's step goes instead: one stacked bar per rank and run, the mean seconds of every phase
from the run's ``summary.json`` (hpcdl.training.phases), so that a slow rank or a phase that does not
shrink with more ranks shows at a glance.

Like every tool around training, it refuses with one line what it cannot do well: a run directory
that is missing or holds no epochs yet, a metrics file with a malformed line, and an output file
that exists (``--force`` replaces it) or is one of the repository's committed figures.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from hpcdl.persistence import outputs
from hpcdl.persistence.atomic import write_atomically
from hpcdl.runtime.errors import UsageError, run_main

PROGRAM = "hpcdl.plot"
REQUIRED = ("epoch", "train_loss", "test_loss", "test_accuracy", "elapsed_seconds")


def score_key(row: dict[str, Any]) -> str:
    """What the accuracy panels show: test_accuracy, or a task's first metric, or its test loss when it has none
    (a row without test_loss is an incomplete row, named as missing test_accuracy as before)."""
    if "test_accuracy" in row or "test_loss" not in row:
        return "test_accuracy"
    return next((key for key in row if key.startswith("test_") and key != "test_loss"), "test_loss")


def required(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(score_key(row) if key == "test_accuracy" else key for key in REQUIRED)
FORMATS = (".png", ".pdf", ".svg")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like every hpcdl program, not usage + error
        raise UsageError(f"{message} (see --help)")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every epoch row of a run, checked: each line an object with a number for each plotted key."""
    if not run_dir.exists():
        raise UsageError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is a file, not a run directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir} has no metrics.jsonl (is it an hpcdl run directory? a run writes it after its "
                         "first epoch)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is unreadable ({exc})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}, line {number}: not JSON ({exc.msg}, column {exc.colno})") from None
        if not isinstance(row, dict):
            raise UsageError(f"{path}, line {number}: expected an object with {', '.join(REQUIRED)}")
        keys = required(row)
        missing = [key for key in keys if key not in row]
        if missing:
            raise UsageError(f"{path}, line {number}: missing {', '.join(dict.fromkeys(missing))}")
        # null is how a run writes a value that was not finite (hpcdl.persistence.metrics): drawn as a gap
        wrong = [key for key in dict.fromkeys(keys) if not _number(row[key], nullable=key != "epoch")]
        if wrong:
            raise UsageError(f"{path}, line {number}: {', '.join(f'{k}={row[k]!r}' for k in wrong)} is not a number")
        rows.append({**row, **{key: math.nan for key in keys if row[key] is None}})
    if not rows:
        raise UsageError(f"{path} has no epochs yet; nothing to plot")
    return rows


def _number(value: Any, nullable: bool) -> bool:
    return (value is None and nullable) or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _positive(values: list[float]) -> bool:
    return any(math.isfinite(v) and v > 0 for v in values)


def plot_runs(run_dirs: Sequence[Path], output: Path, labels: Sequence[str] | None = None) -> Path:
    """Draw the runs (all read and checked before anything is drawn) and write ``output`` atomically."""
    runs = [(labels[i] if labels else run_dir.name, read_metrics(run_dir)) for i, run_dir in enumerate(run_dirs)]
    import matplotlib.pyplot as plt

    fig = draw(runs)
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=output.suffix.lstrip("."))
    plt.close(fig)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(output, lambda handle: handle.write(image.getvalue()))
    except OSError as exc:
        raise UsageError(str(exc) if str(exc).startswith("cannot write") else f"cannot write {output}: {exc}") from None
    return output


def draw(runs: Sequence[tuple[str, list[dict[str, Any]]]]) -> Any:
    """The figure of ``(label, rows)`` runs. Every row is a marker on its line, so that a run of one row (a single
    evaluation, or one epoch) shows as a point instead of a line of zero length, which draws nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_time) = plt.subplots(1, 3, figsize=(15, 4.2))
    all_losses: list[float] = []
    scores = sorted({score_key(rows[0]) for _, rows in runs})
    name = ", ".join(key.removeprefix("test_").replace("_", " ") for key in scores)
    for label, rows in runs:
        score = score_key(rows[0])
        epochs = [r["epoch"] for r in rows]
        losses = [r["train_loss"] for r in rows], [r["test_loss"] for r in rows]
        all_losses += losses[0] + losses[1]
        (line,) = ax_loss.plot(epochs, losses[0], marker=".", label=f"{label} train")
        ax_loss.plot(epochs, losses[1], "--", marker=".", color=line.get_color(), label=f"{label} test")
        ax_acc.plot(epochs, [r[score] for r in rows], marker=".", color=line.get_color(), label=label)
        ax_time.plot([r["elapsed_seconds"] for r in rows], [r[score] for r in rows], marker=".",
                     color=line.get_color(), label=label)
    # A log axis needs a positive value to show; a diverged run (NaN, inf) is drawn where it is finite.
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss", yscale="log" if _positive(all_losses) else "linear")
    ax_acc.set(xlabel="epoch", ylabel=f"test {name}", title=f"test {name}")
    ax_time.set(xlabel="wall time (s)", ylabel=f"test {name}", title=f"time to {name}")
    for ax in (ax_loss, ax_acc, ax_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def read_phases(run_dir: Path) -> dict[str, Any]:
    """The finished run's per-rank phase seconds (``summary.json``'s step_phases), checked."""
    path = run_dir / "summary.json"
    if not path.is_file():
        raise UsageError(f"{run_dir} has no summary.json (a run writes it when it finishes); --phases needs one")
    try:
        phases = json.loads(path.read_text()).get("step_phases", {}).get("phases")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path} is unreadable ({exc})") from None
    if not phases or "step" not in phases:
        raise UsageError(f"{path} has no step_phases (written by hpcdl.train since phases are recorded)")
    return phases


def draw_phases(runs: Sequence[tuple[str, dict[str, Any]]]) -> Any:
    """One stacked horizontal bar per (run, rank): mean seconds per phase, phases with no time left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in next(iter(runs))[1] if n != "step"]
    bars = [(f"{label} rank {r}", {n: phases[n]["mean_per_rank"][r] for n in names if n in phases})
            for label, phases in runs for r in range(len(phases["step"]["mean_per_rank"]))]
    shown = [n for n in names if any(seconds.get(n, 0.0) > 0 for _, seconds in bars)]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * len(bars)))
    colors = [plt.get_cmap("tab20")(k % 20) for k in range(20)]
    for k, name in enumerate(shown):
        lefts = [sum(seconds.get(n, 0.0) for n in shown[:k]) * 1e3 for _, seconds in bars]
        widths = [seconds.get(name, 0.0) * 1e3 for _, seconds in bars]
        ax.barh([b for b, _ in bars], widths, left=lefts, color=colors[k % len(colors)], label=name)
    ax.invert_yaxis()
    ax.set(xlabel="ms per step (mean)", title="where each rank's step goes")
    ax.legend(fontsize=7, ncol=min(6, len(shown)), loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.5 / len(bars)))
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def plot_phases(run_dirs: Sequence[Path], output: Path, labels: Sequence[str] | None = None) -> Path:
    runs = [(labels[i] if labels else run_dir.name, read_phases(run_dir)) for i, run_dir in enumerate(run_dirs)]
    import matplotlib.pyplot as plt

    fig = draw_phases(runs)
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=output.suffix.lstrip("."), bbox_inches="tight")
    plt.close(fig)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(output, lambda handle: handle.write(image.getvalue()))
    except OSError as exc:
        raise UsageError(f"cannot write {output}: {exc}") from None
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog=f"python -m {PROGRAM}", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    parser.add_argument("-o", "--output", type=Path,
                        help=f"figure to write, {'/'.join(FORMATS)} (default: curves.png in the first run)")
    parser.add_argument("--labels", nargs="+", help="legend labels, one per run")
    parser.add_argument("--force", action="store_true", help="replace the output file if it exists")
    parser.add_argument("--phases", action="store_true",
                        help="draw each rank's step by phase from summary.json (default output: phases.png)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        raise UsageError(f"--labels needs one label per run directory ({len(args.runs)}), got {len(args.labels)}")
    output = args.output or args.runs[0] / ("phases.png" if args.phases else "curves.png")
    if output.suffix.lower() not in FORMATS:
        raise UsageError(f"-o {output}: the figure's format comes from its suffix; use one of {', '.join(FORMATS)}")
    for run_dir in args.runs:  # every run checked before the output is considered
        read_phases(run_dir) if args.phases else read_metrics(run_dir)
    outputs.check_outputs([output], force=args.force, flag="-o")
    print((plot_phases if args.phases else plot_runs)(args.runs, output, args.labels))
    return 0


def main_cli() -> None:
    """The command line: ``python -m hpcdl.plot``."""
    run_main(main, program=PROGRAM)
