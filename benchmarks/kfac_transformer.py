"""K-FAC against AdamW on examples/transformer_lm.py in wall time: does K-FAC reach AdamW's final validation loss
in at most AdamW's time?

    .venv/bin/python benchmarks/kfac_transformer.py --seeds 1 2 3 --refresh-results

Per seed, one run at a time on one process (batch 32, the global batch of transformer_lm.py's 2 x 16): AdamW for
--epochs epochs (its final validation loss is the target), then each K-FAC variant stopped by ``--target-metric`` at
that loss. Reported per run: training seconds to the target (``time_to_target_seconds``: evaluations excluded),
steps to it, seconds per step (training seconds over steps) and K-FAC's phases per step (summary.json's
``step_phases``: the statistics in the hooks are their own phase). The variants: K-FAC at the defaults (factors
every step from every position, decompositions every 10) on SGD at benchmarks/transformer_lm.py's rate, and on
AdamW at AdamW's rate (K-FAC's direction, AdamW's update, as in issue 44's nanoGPT runs): at the defaults, with
the factors' statistics from 8 of the 32 sequences (``--kfac-factor-examples 8``: 512 of 2,048 positions), and
with that and factors every 10 steps, decompositions every 50 (issue 44's "level" frequencies).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from figures import results, save_json
from studies import check_launch, run_train

from hpcdl.persistence import outputs
from hpcdl.runtime.console import RankZeroParser
from hpcdl.runtime.errors import run_main
from hpcdl.runtime.numbers import integer

TASK = "examples.transformer_lm:task"
BATCH = 32
ADAMW = ["--optimizer", "adamw", "--base-lr", "0.002"]
KFAC = ["--kfac", "--optimizer", "sgd", "--base-lr", "0.05"]  # benchmarks/transformer_lm.py's rates
KFAC_ADAMW = ["--kfac", *ADAMW]  # K-FAC's directions, AdamW's update
VARIANTS = {
    "kfac": KFAC,
    "kfac on adamw": KFAC_ADAMW,
    "kfac on adamw, statistics of 8 sequences": [*KFAC_ADAMW, "--kfac-factor-examples", "8"],
    "kfac on adamw, 8 sequences, factors every 10, decompositions every 50": [
        *KFAC_ADAMW, "--kfac-factor-examples", "8", "--kfac-factor-update-freq", "10", "--kfac-inv-update-freq", "50"],
}


def flags(method: list[str], seed: int, epochs: int, target: float | None) -> list[str]:
    chosen = ["--task", TASK, *method, "--epochs", str(epochs), "--batch-size", str(BATCH), "--seed", str(seed),
              "--device", "cpu", "--log-every", "1000"]
    return chosen if target is None else [*chosen, "--target-metric", f"{target:.6f}"]


def outcome(run: Any, method: list[str], target: float | None) -> dict[str, Any]:
    summary = run.summary
    steps = summary["global_steps"]
    reached = next((row for row in run.rows if target is not None and row["test_loss"] <= target), None)
    phases = summary.get("step_phases", {}).get("phases", {})
    return dict(flags=method, train_seconds=summary["train_seconds"], steps=steps,
                seconds_per_step=summary["train_seconds"] / max(steps, 1),
                seconds_to_target=summary.get("time_to_target_seconds") if target is not None else None,
                steps_to_target=reached["global_step"] if reached else None,
                final_loss=run.rows[-1]["test_loss"], losses=[row["test_loss"] for row in run.rows],
                phase_ms_per_step={name: round(1000 * p["mean_per_rank"][0], 2) for name, p in phases.items()})


def one_seed(seed: int, epochs: int, workdir: Path) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    adamw = run_train(flags(ADAMW, seed, epochs, None), workdir / f"adamw-{seed}", timeout=3600,
                      required=f"the AdamW run of seed {seed}")
    runs["adamw"] = outcome(adamw, ADAMW, None)
    target = runs["adamw"]["final_loss"]
    print(f"[kfac_transformer] seed {seed}: AdamW {runs['adamw']['train_seconds']:.1f} s to {target:.4f}", flush=True)
    for k, (name, method) in enumerate(VARIANTS.items()):
        run = run_train(flags(method, seed, epochs, target), workdir / f"kfac{k}-{seed}", timeout=3600,
                        required=f"the {name} run of seed {seed}")
        runs[name] = outcome(run, method, target)
        r = runs[name]
        print(f"[kfac_transformer] seed {seed}: {name}: {r['seconds_to_target']} s to the target "
              f"({r['steps_to_target']} steps), step {r['seconds_per_step'] / runs['adamw']['seconds_per_step']:.2f}x "
              f"AdamW's", flush=True)
    return dict(seed=seed, target=target, runs=runs)


def summarise(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per K-FAC variant, medians over seeds: step time over AdamW's, time to target over AdamW's time."""
    out = {}
    for name in VARIANTS:
        ratios = [s["runs"][name]["seconds_per_step"] / s["runs"]["adamw"]["seconds_per_step"] for s in seeds]
        times = [s["runs"][name]["seconds_to_target"] / s["runs"]["adamw"]["train_seconds"]
                 if s["runs"][name]["seconds_to_target"] is not None else None for s in seeds]
        reached = [t for t in times if t is not None]
        out[name] = dict(step_ratio=statistics.median(ratios), time_ratio_per_seed=times,
                         time_ratio=statistics.median(reached) if len(reached) == len(times) else None)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = RankZeroParser(prog="benchmarks/kfac_transformer.py", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=integer(0), nargs="+", default=[1])
    parser.add_argument("--epochs", type=integer(1, 1000), default=12)
    parser.add_argument("--out", type=Path, default=None,
                        help="results stem (default: a folder under runs/bench/; --refresh-results replaces "
                             "benchmarks/results/kfac_transformer.json)")
    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    stem = outputs.results_stem(args.out, "kfac_transformer", (".json",), refresh_results=args.refresh_results,
                                force=args.force, flag="--out")
    check_launch(1)
    done: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kfac-transformer-") as tmp:
        for seed in args.seeds:
            done.append(one_seed(seed, args.epochs, Path(tmp)))
            report = dict(kind="kfac_transformer", task=TASK, batch=BATCH, epochs=args.epochs, seeds=args.seeds,
                          command=f"benchmarks/kfac_transformer.py --seeds {' '.join(map(str, args.seeds))} "
                                  f"--epochs {args.epochs}", load_average=os.getloadavg(), cores=os.cpu_count(),
                          summary=summarise(done), per_seed=done)
            save_json(stem, report)  # kept as it goes
    for name, s in report["summary"].items():
        print(f"{name}: step {s['step_ratio']:.2f}x AdamW's; time to AdamW's final loss "
              f"{s['time_ratio_per_seed']} of AdamW's time")
    print(f"wrote {outputs.output_file(stem, '.json')}")
    return 0


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

LEAN = "kfac on adamw, 8 sequences, factors every 10, decompositions every 50"


def _time_ratios(variant: str) -> str:
    ratios = results("kfac_transformer")["summary"][variant]["time_ratio_per_seed"]
    return ", ".join("not reached" if r is None else f"{r:.2f}" for r in ratios)


FIGURES = {"kt.lean.times": lambda: _time_ratios(LEAN), "kt.defaults.times": lambda: _time_ratios("kfac on adamw"),
           "kt.lean.step": lambda: f"{results('kfac_transformer')['summary'][LEAN]['step_ratio']:.2f}×"}


if __name__ == "__main__":
    run_main(main, program="kfac_transformer")
