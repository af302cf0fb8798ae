"""NHWC (channels_last) against NCHW on CPU cores: hpcdl.train's step for hpcdl's own models, side by side.

    .venv/bin/python benchmarks/cpu_layout.py                          # every case, 3 pairs, 1 thread
    .venv/bin/python benchmarks/cpu_layout.py --cases mnist_cnn resnet32 --pairs 4 --refresh-results

What ``--channels-last auto`` decides on a CPU (docs/training.md): each case runs ``hpcdl.train`` on synthetic data
of its dataset's shape with ``--channels-last on`` and ``off`` in alternating pairs (AB BA AB ...), one rank,
``--threads`` threads; a run's step is its second epoch's seconds over its steps (the first warms up). A pair's
ratio is off's step over on's (above 1: NHWC is faster); the median over pairs is reported, with the machine's
load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from figures import results, save_json, table, times  # noqa: E402
from studies import run_train  # noqa: E402

from hpcdl.persistence import outputs  # noqa: E402
from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import run_main  # noqa: E402
from hpcdl.runtime.numbers import integer  # noqa: E402

SUFFIXES = (".json",)  # the files it writes, each <stem><suffix> (hpcdl.persistence.outputs.output_file)
# case -> (what it stands for, hpcdl.train flags): each dataset's default model and batch, and the large-batch
# cell's per-rank share with K-FAC (benchmarks/kfac_method_cell.py: 2 ranks x 2048).
CASES: dict[str, tuple[str, list[str]]] = {
    "digits_cnn": ("digits' default job (8x8, batch 32)",
                   ["--model", "digits_cnn", "--synthetic-shape", "1", "8", "8", "--batch-size", "32"]),
    "mnist_cnn": ("MNIST's default (28x28, batch 64)",
                  ["--model", "mnist_cnn", "--synthetic-shape", "1", "28", "28", "--batch-size", "64"]),
    "mnist_cnn_kfac_2048": ("the large-batch cell's rank (batch 2048, --kfac-preset large-batch)",
                            ["--model", "mnist_cnn", "--synthetic-shape", "1", "28", "28", "--batch-size", "2048",
                             "--kfac-preset", "large-batch"]),
    "mnist_resnet": ("mnist_resnet (28x28, batch 64)",
                     ["--model", "mnist_resnet", "--synthetic-shape", "1", "28", "28", "--batch-size", "64"]),
    "resnet32": ("CIFAR-10's default (32x32x3, batch 128)",
                 ["--model", "resnet32", "--synthetic-shape", "3", "32", "32", "--batch-size", "128"]),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog="benchmarks/cpu_layout.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="default: all")
    parser.add_argument("--pairs", type=integer(1, 100), default=3, help="alternating pairs per case (default 3)")
    parser.add_argument("--steps", type=integer(1, 10_000), default=10, help="steps per epoch (default 10)")
    parser.add_argument("--threads", type=integer(1, 256), default=1, help="threads of the one rank (default 1)")
    parser.add_argument("--output", type=Path, default=None,
                        help="results file (default: a new folder under runs/bench/; --refresh-results replaces "
                             "benchmarks/results/cpu_layout.json)")
    outputs.add_arguments(parser)
    return parser.parse_args(argv)


def step_seconds(case: str, layout: str, args: argparse.Namespace, workdir: Path) -> float:
    """hpcdl.train's seconds a step in its second epoch, with ``--channels-last layout``."""
    flags = CASES[case][1]
    batch = int(flags[flags.index("--batch-size") + 1])
    out = workdir / f"{case}-{layout}"
    shutil.rmtree(out, ignore_errors=True)
    run = run_train(["--dataset", "synthetic", *flags, "--synthetic-size", str(args.steps * batch), "--epochs", "2",
                     "--warmup-epochs", "0", "--test-batch-size", str(min(batch, 256)), "--device", "cpu",
                     "--workers", "0", "--channels-last", layout], out, threads=args.threads, timeout=1800,
                    required=f"{case} with --channels-last {layout}")
    return float(run.rows[-1]["epoch_seconds"]) / args.steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stem = outputs.results_stem(outputs.given_stem(args.output, SUFFIXES), "cpu_layout", SUFFIXES,
                                refresh_results=args.refresh_results, force=args.force)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpu-layout-") as tmp:
        for case in args.cases:
            ratios, steps = [], {"on": [], "off": []}
            for pair in range(args.pairs):
                order = ("off", "on") if pair % 2 == 0 else ("on", "off")
                got = {layout: step_seconds(case, layout, args, Path(tmp)) for layout in order}
                for layout in got:
                    steps[layout].append(got[layout])
                ratios.append(got["off"] / got["on"])
                print(f"{case}, pair {pair + 1}: NCHW {1000 * got['off']:.1f} ms, NHWC {1000 * got['on']:.1f} ms a "
                      f"step, {ratios[-1]:.2f}x", flush=True)
            rows.append(dict(case=case, about=CASES[case][0], flags=CASES[case][1],
                             speedup_median=statistics.median(ratios), speedups=ratios,
                             step_seconds_nchw=steps["off"], step_seconds_nhwc=steps["on"]))
            print(f"{case}: NHWC {statistics.median(ratios):.2f}x NCHW's speed (median of {args.pairs})", flush=True)
    load = os.getloadavg()
    print(f"load average during the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    output = save_json(stem, dict(steps=args.steps, threads=args.threads, pairs=args.pairs, load_average=load,
                                  cores=os.cpu_count(), rows=rows))
    print(f"wrote {output}")
    return 0


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

def _rows() -> list[dict]:
    return results("cpu_layout")["rows"]


def _table() -> str:
    return table(["case", "NCHW step", "NHWC step", "NHWC's speed / NCHW's (median of pairs)"], [
        (row["about"], f"{1000 * statistics.median(row['step_seconds_nchw']):.1f} ms",
         f"{1000 * statistics.median(row['step_seconds_nhwc']):.1f} ms", times(row["speedup_median"]))
        for row in _rows()])


def _range() -> str:
    speedups = [row["speedup_median"] for row in _rows()]
    return f"{min(speedups):.2f}–{max(speedups):.2f}×"


FIGURES = {"layout.table": _table, "layout.range": _range}


if __name__ == "__main__":
    run_main(main, program="cpu_layout")
