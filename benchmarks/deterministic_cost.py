"""What bit-identical runs cost: hpcdl.train with ``--deterministic on`` against ``off``, side by side.

    .venv/bin/python benchmarks/deterministic_cost.py                  # 3 ranks, resnet20, 3 pairs
    .venv/bin/python benchmarks/deterministic_cost.py --ranks 2 3 4 --pairs 4 --refresh-results

``on`` reduces every gradient tensor in its own allreduce (no Horovod tensor fusion, whose timing-
dependent buffer layout changes the summation order from 3 ranks on); ``off`` is Horovod's fused
default. For each world size the two run in alternating pairs (AB BA AB ...) on synthetic data; a
pair's ratio is the images/s of the second epoch (warm-up excluded), on / off; the median over
pairs is reported. The machine's load average is recorded beside the figures.
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

from figures import results, save_json, times  # noqa: E402
from studies import check_launch, run_train  # noqa: E402

from hpcdl.persistence import outputs  # noqa: E402
from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import run_main  # noqa: E402
from hpcdl.runtime.numbers import integer  # noqa: E402

SUFFIXES = (".json",)  # the files it writes, each <stem><suffix> (hpcdl.persistence.outputs.output_file)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog="benchmarks/deterministic_cost.py", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=integer(1, 64), nargs="+", default=[3], help="world sizes (default 3)")
    parser.add_argument("--pairs", type=integer(1, 100), default=3, help="alternating pairs per world size (default 3)")
    parser.add_argument("--steps", type=integer(1, 10_000), default=12, help="steps per epoch (default 12)")
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--output", type=Path, default=None,
                        help="results file (default: a new folder under runs/bench/; --refresh-results replaces "
                             "benchmarks/results/deterministic_cost.json)")
    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    for ranks in args.ranks:
        check_launch(ranks)
    return args


def images_per_second(ranks: int, mode: str, steps: int, model: str, workdir: Path) -> float:
    out = workdir / f"np{ranks}-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    batch = 16
    run = run_train(["--dataset", "synthetic", "--synthetic-size", str(steps * batch * ranks), "--model", model,
                     "--batch-size", str(batch), "--epochs", "2", "--warmup-epochs", "0", "--log-every", str(steps),
                     "--deterministic", mode], out, ranks=ranks, timeout=600,
                    required=f"hpcdl.train --deterministic {mode} on {ranks} ranks")
    return float(run.rows[-1]["images_per_second"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stem = outputs.results_stem(outputs.given_stem(args.output, SUFFIXES), "deterministic_cost",
                                SUFFIXES, refresh_results=args.refresh_results, force=args.force)
    rows = []
    with tempfile.TemporaryDirectory(prefix="deterministic-cost-") as tmp:
        for ranks in args.ranks:
            ratios, speeds = [], {"on": [], "off": []}
            for pair in range(args.pairs):
                order = ("on", "off") if pair % 2 == 0 else ("off", "on")
                got = {mode: images_per_second(ranks, mode, args.steps, args.model, Path(tmp)) for mode in order}
                for mode in got:
                    speeds[mode].append(got[mode])
                ratios.append(got["on"] / got["off"])
                print(f"{ranks} ranks, pair {pair + 1}: on {got['on']:.1f} img/s, off {got['off']:.1f} img/s, "
                      f"ratio {ratios[-1]:.3f}", flush=True)
            rows.append(dict(ranks=ranks, ratio_median=statistics.median(ratios), ratios=ratios, **{
                f"images_per_second_{mode}": values for mode, values in speeds.items()}))
            print(f"{ranks} ranks: deterministic / fused = {statistics.median(ratios):.3f} (median of {args.pairs})")
    load = os.getloadavg()
    print(f"load average during the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    output = save_json(stem, dict(model=args.model, steps=args.steps, load_average=load, cores=os.cpu_count(),
                                  rows=rows))
    print(f"wrote {output}")
    return 0


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

def _pairs() -> str:
    ratios = results("deterministic_cost")["rows"][0]["ratios"]
    return f"{min(ratios):.3f}–{max(ratios):.3f}×"


FIGURES = {"deterministic.ratio": lambda: times(results("deterministic_cost")["rows"][0]["ratio_median"], 3),
           "deterministic.pairs": _pairs}


if __name__ == "__main__":
    run_main(main, program="deterministic_cost")
