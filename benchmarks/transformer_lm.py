"""Your own model with hpcdl: the transformer language model of examples/transformer_lm.py, K-FAC against AdamW.

    .venv/bin/python benchmarks/transformer_lm.py                        # 2 ranks, to validation loss 2.45
    .venv/bin/python benchmarks/transformer_lm.py --ranks 2 --target 2.45 --refresh-results

Each method is one ``python -m hpcdl.train --task examples.transformer_lm:task`` run on N ranks of the same
epochs, seed and global batch, stopped by ``--target-metric`` at the stated validation loss (nats per
character) or at the last epoch. The results file holds, per method, the training time to the target (the
run's ``time_to_target_seconds``: training only, evaluations excluded), the epochs and steps to it, and the
best validation loss, beside the machine's load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from figures import results, save_json, table  # noqa: E402
from studies import check_launch, run_train  # noqa: E402

from hpcdl.persistence import outputs  # noqa: E402
from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import run_main  # noqa: E402
from hpcdl.runtime.numbers import integer  # noqa: E402

TASK = "examples.transformer_lm:task"
# The two methods' flags (the same global batch, epochs and seed; each one's rate tuned by hand on this task).
METHODS = {
    "kfac": ["--kfac", "--optimizer", "sgd", "--base-lr", "0.05"],
    "adamw": ["--optimizer", "adamw", "--base-lr", "0.002"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog="benchmarks/transformer_lm.py", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=integer(1, 64), default=2, help="world size (default 2)")
    parser.add_argument("--target", type=float, default=2.45, help="validation loss to reach (default 2.45)")
    parser.add_argument("--epochs", type=integer(1, 1000), default=12, help="epochs at most (default 12)")
    parser.add_argument("--output", type=Path, default=None,
                        help="results file (default: a new folder under runs/bench/; --refresh-results replaces "
                             "benchmarks/results/transformer_lm.json)")
    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    check_launch(args.ranks)
    return args


def train(method: str, args: argparse.Namespace, workdir: Path) -> dict:
    flags = ["--task", TASK, *METHODS[method], "--epochs", str(args.epochs), "--batch-size", "16", "--seed", "1",
             "--target-metric", str(args.target)]
    print(" ".join(flags), flush=True)
    run = run_train(flags, workdir / method, ranks=args.ranks, timeout=1800, required=f"the {method} run")
    summary, rows = run.summary, run.rows
    reached = next((row for row in rows if row["test_loss"] <= args.target), None)
    return dict(flags=METHODS[method], seconds_to_target=summary["time_to_target_seconds"],
                epochs_to_target=reached["epoch"] if reached else None,
                steps_to_target=reached["global_step"] if reached else None,
                best_test_loss=summary["best"]["value"], train_seconds=summary["train_seconds"],
                losses=[row["test_loss"] for row in rows])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stem = outputs.results_stem(outputs.given_stem(args.output, (".json",)), "transformer_lm",
                                (".json",), refresh_results=args.refresh_results, force=args.force)
    with tempfile.TemporaryDirectory(prefix="transformer-lm-") as tmp:
        runs = {method: train(method, args, Path(tmp)) for method in METHODS}
    for method, run in runs.items():
        print(f"{method}: validation loss {args.target} in {run['seconds_to_target']} s "
              f"({run['epochs_to_target']} epochs); best {run['best_test_loss']:.3f}")
    load = os.getloadavg()
    output = save_json(stem, dict(task=TASK, ranks=args.ranks, target=args.target, epochs=args.epochs,
                                  global_batch=16 * args.ranks, load_average=load, cores=os.cpu_count(), runs=runs))
    print(f"wrote {output}")
    return 0


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

def _run(method: str) -> str:
    data = results("transformer_lm")
    run = data["runs"][method]
    if run["seconds_to_target"] is None:
        return f"not reached in {data['epochs']} epochs (best {run['best_test_loss']:.3f})"
    return f"{run['seconds_to_target']:.0f} s ({run['epochs_to_target']} epochs)"


def _table() -> str:
    data = results("transformer_lm")
    rows = [(method, " ".join(run["flags"]), _run(method), f"{run['best_test_loss']:.3f}",
             ", ".join(f"{loss:.3f}" for loss in run["losses"])) for method, run in data["runs"].items()]
    return table(["method", "flags", f"to validation loss {data['target']:g}", "best validation loss",
                  "validation loss after each epoch"], rows)


def _load() -> str:
    data = results("transformer_lm")
    return f"{data['load_average'][1]:.1f} on {data['cores']} cores"


FIGURES = {"lm.target": lambda: f"{results('transformer_lm')['target']:g}", "lm.kfac": lambda: _run("kfac"),
           "lm.adamw": lambda: _run("adamw"), "lm.table": _table, "lm.load": _load}


if __name__ == "__main__":
    run_main(main, program="transformer_lm")
