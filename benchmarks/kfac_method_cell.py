"""The large-batch cell (MNIST, batch 4096, ``--kfac-preset large-batch``) with each K-FAC method, interleaved.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/kfac_method_cell.py --seeds 0 1 2 --refresh-results
    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/kfac_method_cell.py --dry-run   # the commands only
    .venv/bin/python -m hpcdl.tools.vcluster up --nodes 2 --name lbone --rate 1gbit    # 2 virtual nodes, then:
    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/kfac_method_cell.py --ranks 2 --vcluster lbone \
        --first-order muon --seeds 0 1 2 --refresh-results                              # the 2 x 1 cell

kfac_large_batch.py's ``--target-cell`` run of hpcdl's K-FAC (its tuned rate and warm-up, one rank, one thread,
one run at a time), once per ``--kfac-methods`` entry (``--kfac-method`` added to the preset's flags), seed by
seed and method by method within a seed, so that a change in the shared machine's load falls on every method
alike; ``--first-order`` adds first-order methods at their tuned settings to each seed's round, and
``--variants`` each K-FAC method again with other preset values (flags after the preset's). Results:
``<out>.json`` (kfac_large_batch's format, the methods named ``kfac-<method>``) and the markdown table on stdout:
steps and training seconds to 98.5 % and 99 %, final accuracy, seconds a step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import kfac_large_batch as study
import studies
import torch
from figures import percent, results, table, times
from torch import nn

from hpcdl.persistence import outputs
from hpcdl.runtime.errors import UsageError, run_main
from hpcdl.runtime.numbers import integer

BF16 = "+bf16-statistics"  # a K-FAC run's name suffix: its statistics from inputs rounded to bfloat16
BF16_FLAGS = "--kfac-impl kfac_method_cell:bf16_statistics"  # and what such a run adds to the preset's flags
TUNING = "kfac_large_batch_tune.json"  # the committed tuning study: hpcdl K-FAC's rate and warm-up at batch 4096


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kfac-methods", nargs="+", choices=("eigen", "inverse", "newton"),
                        default=["eigen", "newton", "inverse"])
    parser.add_argument("--statistics", nargs="+", choices=("same", "bf16"), default=["same"],
                        help="each K-FAC method with its factor statistics as the model computes (same) and/or from "
                             "inputs rounded to bfloat16 (bf16: statistics_dtype, through --kfac-impl "
                             "kfac_method_cell:bf16_statistics; named kfac-<method>+bf16-statistics)")
    parser.add_argument("--variants", nargs="+", default=[], metavar="NAME=FLAGS",
                        help="each K-FAC method again with these hpcdl.train flags after the preset's (named "
                             "kfac-<method>+NAME), e.g. 'examples-512=--kfac-factor-examples 512': a preset value "
                             "tried beside today's in the same rounds")
    parser.add_argument("--first-order", nargs="*", default=[], choices=("muon", "lamb", "lars", "adamw", "sgd"),
                        help="first-order methods run beside K-FAC in each seed's round, at their tuned settings")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--ranks", type=int, default=1, help="ranks of every run (one thread each)")
    parser.add_argument("--vcluster", default=None, metavar="NAME",
                        help="run on this virtual cluster, one rank a node (hpcdl.tools.vcluster up)")
    parser.add_argument("--data-dir", default=None, help="MNIST's IDX files (default: hpcdl.fetch_mnist's)")
    parser.add_argument("--evals-per-epoch", type=integer(1), default=4,
                        help="test-set evaluations an epoch (14: every step at batch 4096), the grain of the time to "
                             "98.5 %%; evaluation is excluded from the training seconds")
    parser.add_argument("--out", type=Path, default=None,
                        help="results stem (default: runs/bench/; benchmarks/results with --refresh-results)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs' commands and exit")
    outputs.add_arguments(parser)
    own = parser.parse_args(argv)
    variants = variant_flags(own.variants)
    results = outputs.checkout_results()
    if results is None:
        raise UsageError(f"no benchmarks/results here to read {TUNING} from: run from a source checkout")
    stem = f"kfac_methods_{own.ranks}x1" if own.vcluster else "kfac_methods_1host"
    out = None if own.dry_run else outputs.results_stem(
        own.out, stem, (".json",), refresh_results=own.refresh_results, force=own.force, flag="--out")
    flags = ["--target-cell", "--tuned-from", str(results / TUNING), "--methods", "kfac", *own.first_order,
             "--jobs", "1", "--threads", "1", "--ranks", str(own.ranks),
             "--evals-per-epoch", str(own.evals_per_epoch)]
    flags += ["--vcluster", own.vcluster] if own.vcluster else []
    args = study.parse_args(flags + (["--data-dir", own.data_dir] if own.data_dir else []))
    tuning = study.load_outcomes(args.tuned_from)
    tuned = {c.method: c for c in study.tuned_settings(tuning, study.tuning_seed(tuning, args.tuned_from))
             if c.batch == 4096}
    missing = sorted({"kfac", *own.first_order} - tuned.keys())
    if missing:
        raise UsageError(f"{TUNING} tuned no setting at batch 4096 for {', '.join(missing)}")
    # A round per seed: each K-FAC method once per suffix (its flags after the preset's; --statistics bf16 is one
    # more variant), named kfac-<method><suffix>, then the first-order methods.
    extras = {BF16 if s == "bf16" else "": BF16_FLAGS if s == "bf16" else "" for s in own.statistics}
    extras.update({f"+{name}": flags for name, flags in variants.items()})
    kfac_names = [f"kfac-{m}{suffix}" for m in own.kfac_methods for suffix in extras]
    plan = [(seed, name) for seed in own.seeds for name in kfac_names + list(own.first_order)]

    def cell_args(name: str) -> argparse.Namespace:
        if not name.startswith("kfac-"):
            return args
        method, plus, variant = name.removeprefix("kfac-").partition("+")
        return argparse.Namespace(**{**vars(args), "kfac_flags": f"--kfac-method {method} {extras[plus + variant]}"})

    def cell(seed: int, name: str) -> study.Cell:
        setting = tuned["kfac" if name.startswith("kfac-") else name]
        return study.Cell(setting.method, 4096, setting.lr, seed, setting.warmup)

    if own.dry_run:
        for seed, name in plan:
            print(" ".join(study.train_command(cell(seed, name), cell_args(name), Path("/tmp") / name)))
        return 0
    assert out is not None
    studies.check_launch(own.ranks, own.vcluster, 1)
    for seed, name in plan:
        studies.check_flags(study.train_flags(cell(seed, name), cell_args(name)))
    meta = dict(load_before=os.getloadavg()[0], argv=sys.argv[1:] if argv is None else argv,
                kfac_preset=study.RECORDED_PRESET, epochs=args.epochs, jobs=1, threads=1, ranks=own.ranks,
                vcluster=own.vcluster, link_rate=studies.link_rate(own.vcluster), planned=len(plan),
                settings={name: {"lr": tuned[name].lr, "warmup": tuned[name].warmup}
                          for name in ("kfac", *own.first_order)})
    start = time.perf_counter()
    outcomes: list[study.Outcome] = []
    with studies.session("kfac_method_cell") as scratch:
        for seed, name in plan:
            (outcome,) = study.run_cells([cell(seed, name)], cell_args(name), scratch / name)
            outcomes.append(replace(outcome, cell=replace(outcome.cell, method=name)))
            study.write_results(outcomes, out, meta)
    meta.update(load_after=os.getloadavg()[0], seconds=time.perf_counter() - start)
    study.write_results(outcomes, out, meta)
    print("\n".join(study.markdown(outcomes)))
    return 0 if all(o.returncode == 0 for o in outcomes) else 1


def variant_flags(given: list[str]) -> dict[str, str]:
    """``--variants NAME=FLAGS ...`` as {NAME: FLAGS}; a name is one word, not bf16-statistics (--statistics')."""
    variants: dict[str, str] = {}
    for entry in given:
        name, _, flags = entry.partition("=")
        if not name or not flags.strip() or any(c.isspace() or c in "+=" for c in name) or \
                f"+{name}" == BF16 or name in variants:
            raise UsageError(f"--variants {entry!r}: give NAME=FLAGS, a new one-word NAME (not bf16-statistics) "
                             "and hpcdl.train flags, e.g. 'examples-512=--kfac-factor-examples 512'")
        variants[name] = flags.strip()
    return variants


def bf16_statistics(config: Any, model: nn.Module, current_lr: Any, scaler: Any) -> Any:
    """``--kfac-impl kfac_method_cell:bf16_statistics``: hpcdl's K-FAC with ``statistics_dtype=torch.bfloat16``,
    a preconditioner setting no hpcdl.train flag offers."""
    from hpcdl.training.optimizers import build_preconditioner

    return build_preconditioner(replace(config, kfac_impl="hpcdl"), model, current_lr, scaler,
                                statistics_dtype=torch.bfloat16)


# ---- the figures docs quote (benchmarks/figures.py) ----------------------------------------------------------

METHODS_RESULTS, DECOMPOSITION_RESULTS = "kfac_methods_1host", "kfac_decomposition_time_cpu"


def _per_step(method: str) -> dict[int, float]:
    """Seed -> training seconds a step of the run of ``method``."""
    runs = [r for r in results(METHODS_RESULTS)["runs"] if r["method"] == f"kfac-{method}" and r["epochs"]]
    return {r["seed"]: r["epochs"][-1]["train_seconds"] / r["epochs"][-1]["global_step"] for r in runs}


def step_ratio(method: str) -> float:
    """Median over seeds of ``method``'s seconds a step over eigen's in the same seed (the runs were interleaved)."""
    mine, eigen = _per_step(method), _per_step("eigen")
    return statistics.median(mine[s] / eigen[s] for s in mine.keys() & eigen.keys())


def _rows() -> dict[str, dict]:
    return {r["method"].removeprefix("kfac-"): r for r in results(METHODS_RESULTS)["summary"]}


def _steps(value: float | None) -> str:
    return "not reached" if value is None else f"{value:g}"


def _cell_table() -> str:
    def row(method: str, r: dict) -> list:
        each = ", ".join(percent(a) for a in r["final_accuracy"])
        seconds = r["seconds_98.5"] and round(r["seconds_98.5"])
        ratio = times(step_ratio(method)) if method != "eigen" else "1"
        return [method, r["seeds"], f"{percent(r['median_final'])} ({each})", _steps(r["steps_98.5"]),
                _steps(seconds), _steps(r["steps_99.0"]), f"{r['seconds_per_step']:.2f}", ratio]

    return table(["method", "seeds", "final accuracy (median; each)", "steps to 98.5 %", "seconds to 98.5 %",
                  "steps to 99 %", "seconds a step", "step / eigen's (same seed)"],
                 [row(m, r) for m, r in _rows().items()])


def _cell_short() -> str:
    rows = _rows()
    newton, eigen = rows["newton"], rows["eigen"]
    return (f"newton {_steps(newton['steps_98.5'])} steps to 98.5 % against eigen's {_steps(eigen['steps_98.5'])}, "
            f"final {percent(newton['median_final'])} against {percent(eigen['median_final'])}, its step "
            f"{times(step_ratio('newton'))} eigen's ({newton['seeds']} seed(s), medians)")


def _decomposition_short() -> str:
    rows = results(DECOMPOSITION_RESULTS)["rows"]
    warm = [r["ms"]["newton warm"] / r["ms"]["eigen"] for r in rows if r["n"] >= 256]
    chol = [r["ms"]["cholesky"] / r["ms"]["eigen"] for r in rows if r["n"] >= 256]
    return (f"n = 256 to 2,048, one thread: newton (warm) {times(min(warm))}-{times(max(warm))} `eigh`'s time, "
            f"Cholesky {times(min(chol))}-{times(max(chol))}")


TWO_BY_ONE = "kfac_methods_2x1"  # 2 virtual nodes x 1 rank (1 thread, 1 Gbit/s), each method beside Muon


def _against(other: str = "muon", name: str = TWO_BY_ONE) -> dict[str, tuple[float, float, int]]:
    """Per method of results file ``name``: the median over seeds of its training seconds to 98.5 % over
    ``other``'s in the same seed's round (a miss counts as beyond the budget), the median of its seconds a step
    over ``other``'s (same seed), and the seeds."""
    runs = study.outcomes_of(results(name))
    by_seed: dict[int, dict[str, study.Outcome]] = {}
    for o in runs:
        by_seed.setdefault(o.cell.seed, {})[o.cell.method] = o
    ratios: dict[str, tuple[float, float, int]] = {}
    for method in dict.fromkeys(o.cell.method for o in runs if o.cell.method != other):
        pairs = [(seed[method], seed[other]) for seed in by_seed.values() if method in seed and other in seed]
        times_to = []
        for mine, theirs in pairs:
            a, b = mine.to_target(0.985), theirs.to_target(0.985)
            times_to.append(float("inf") if a is None else 0.0 if b is None else a[1] / b[1])
        steps = [(mine.seconds_per_step or 0.0) / (theirs.seconds_per_step or 1.0) for mine, theirs in pairs]
        ratios[method] = (studies.median_or_inf(times_to), statistics.median(steps), len(pairs))
    return ratios


def _two_by_one_table(name: str = TWO_BY_ONE) -> str:
    rows = {r["method"]: r for r in results(name)["summary"]}
    against = _against(name=name)

    def row(method: str, r: dict) -> list:
        each = ", ".join(percent(a) for a in r["final_accuracy"])
        time_ratio, step_ratio_, _ = against.get(method, (1.0, 1.0, 0))
        return [method, r["seeds"], f"{percent(r['median_final'])} ({each})", _steps(r["steps_98.5"]),
                _steps(r["seconds_98.5"] and round(r["seconds_98.5"], 1)), f"{r['seconds_per_step']:.2f}",
                times(step_ratio_) if method != "muon" else "1", times(time_ratio) if method != "muon" else "1"]

    return table(["method", "seeds", "final accuracy (median; each)", "steps to 98.5 %", "seconds to 98.5 %",
                  "seconds a step", "step / Muon's", "time to 98.5 % / Muon's"],
                 [row(m, r) for m, r in rows.items()])


def _two_by_one_short(name: str = TWO_BY_ONE) -> str:
    against = _against(name=name)
    parts = [f"{method.removeprefix('kfac-')} {times(ratio)}" for method, (ratio, _, _) in against.items()]
    seeds = max(n for _, _, n in against.values())
    return f"time to 98.5 % over Muon's on 2 nodes x 1 rank: {', '.join(parts)} ({seeds} seeds, medians)"


EVERY_STEP = "kfac_methods_2x1_every_step"  # the same cell, evaluated after every step (--evals-per-epoch 14)
MORE_SEEDS = "kfac_methods_2x1_every_step_seeds345"  # seeds 3-5 of it, eigen and inverse beside Muon


def _rounds(*names: str) -> dict[int, dict[str, study.Outcome]]:
    """Seed -> method -> its run, over the results files ``names`` (each seed's round in one file)."""
    by_seed: dict[int, dict[str, study.Outcome]] = {}
    for name in names:
        for o in study.outcomes_of(results(name)):
            by_seed.setdefault(o.cell.seed, {})[o.cell.method] = o
    return by_seed


def _every_step_seeds(*names: str) -> str:
    """Per seed, each method's steps to 98.5 % and its time over Muon's (the runs of one round)."""
    by_seed = _rounds(*names)
    rows = []
    for seed, runs in sorted(by_seed.items()):
        muon = runs["muon"].to_target(0.985)
        for method, o in runs.items():
            reached = o.to_target(0.985)
            if method == "muon" or reached is None or muon is None:
                continue
            rows.append([seed, method.removeprefix("kfac-"), reached[0], muon[0], times(reached[0] / muon[0]),
                         times((o.seconds_per_step or 0.0) / (runs["muon"].seconds_per_step or 1.0)),
                         times(reached[1] / muon[1])])
    return table(["seed", "method", "steps to 98.5 %", "Muon's", "steps / Muon's", "step / Muon's",
                  "time to 98.5 % / Muon's"], rows)


def _six_seed_ratios() -> dict[str, list[float]]:
    """Method -> its time to 98.5 % over Muon's on the every-step 2 x 1 cell, seed by seed (seeds 0-5 pooled)."""
    by_seed = _rounds(EVERY_STEP, MORE_SEEDS)
    ratios: dict[str, list[float]] = {}
    for method in ("kfac-eigen", "kfac-inverse"):
        for _, runs in sorted(by_seed.items()):
            mine, muon = runs[method].to_target(0.985), runs["muon"].to_target(0.985)
            ratio = float("inf") if mine is None else 0.0 if muon is None else mine[1] / muon[1]
            ratios.setdefault(method.removeprefix("kfac-"), []).append(ratio)
    return ratios


def _six_seeds() -> str:
    ratios = _six_seed_ratios()
    parts = [f"{method} {times(studies.median_or_inf(each))} ({', '.join(f'{r:.2f}' for r in each)})"
             for method, each in ratios.items()]
    return (f"time to 98.5 % over Muon's on 2 nodes x 1 rank, seeds 0-{len(ratios['inverse']) - 1}: "
            + "; ".join(parts) + " (medians; each seed's ratio in seed order)")


def _six_seeds_short() -> str:
    ratios = _six_seed_ratios()
    ahead = sum(mine < theirs for mine, theirs in zip(ratios["inverse"], ratios["eigen"], strict=True))
    return (f"inverse {times(studies.median_or_inf(ratios['inverse']))}, eigen "
            f"{times(studies.median_or_inf(ratios['eigen']))} Muon's time, inverse ahead of eigen in {ahead} of "
            f"{len(ratios['inverse'])} seeds")


BF16_STATISTICS = "kfac_methods_2x1_bf16_statistics"  # inverse with and without statistics_dtype=bfloat16


VARIANTS = "kfac_methods_2x1_variants"  # inverse at the preset, at 512 statistics examples and at clip 0.005
SWEEP = "kfac_preset_sweep_1host"  # single changes to the preset, one host, each run stopped at 98.5 %
YIELDING = "kfac_methods_2x1_yield"  # the preset beside Muon with Open MPI yielding while it waits (seeds 0-5)
MEMORY_KEPT = "kfac_methods_2x1_malloc"  # the same round with freed blocks of every size kept (hpcdl.runtime.allocator)
NHWC = "kfac_methods_2x1_nhwc"  # the same round with both models in NHWC (--channels-last auto on a CPU)
BUCKETS = "kfac_methods_2x1_buckets"  # the same round with K-FAC's statistics in buckets of 0.25 MB (kfac.exchange)


def _sweep() -> str:
    """Per variant: its steps to 98.5 % seed by seed, and the mean over those seeds of its steps minus the
    preset's (same seed: same initial model and batches)."""
    by_seed = _rounds(SWEEP)
    rows = []
    for method in dict.fromkeys(m for _, runs in sorted(by_seed.items()) for m in runs):
        steps = {seed: runs[method].to_target(0.985) for seed, runs in sorted(by_seed.items()) if method in runs}
        each = ", ".join(f"{seed}: {_steps(reached and reached[0])}" for seed, reached in steps.items())
        paired = [reached[0] - preset[0] for seed, reached in steps.items()
                  if reached and (preset := by_seed[seed]["kfac-inverse"].to_target(0.985))]
        missed = len(steps) - len(paired)
        change = "0" if method == "kfac-inverse" else f"{statistics.mean(paired):+.1f}" if paired else "-"
        rows.append([method.removeprefix("kfac-inverse").removeprefix("+") or "the preset", each,
                     change + (f" ({missed} not reached)" if missed else "")])
    return table(["variant", "steps to 98.5 % (seed: steps)", "steps - the preset's (mean, same seeds)"], rows)


def _bf16_statistics() -> str:
    """The bf16-statistics runs against the same method's float32-statistics runs of the same seed's round."""
    by_seed = _rounds(BF16_STATISTICS)
    same, rounded = "kfac-inverse", f"kfac-inverse{BF16}"
    rows = []
    for seed, runs in sorted(by_seed.items()):
        cells = []
        for name in (rounded, same):
            reached = runs[name].to_target(0.985)
            cells += [_steps(reached and reached[0]), percent(runs[name].final_accuracy or 0.0)]
        rows.append([seed, *cells])
    return table(["seed", "steps to 98.5 %, bf16 statistics", "final accuracy, bf16 statistics",
                  "steps to 98.5 %, float32 statistics", "final accuracy, float32 statistics"], rows)


def _bf16_statistics_short() -> str:
    runs = _rounds(BF16_STATISTICS).values()
    steps = [(r[f"kfac-inverse{BF16}"].to_target(0.985), r["kfac-inverse"].to_target(0.985)) for r in runs]
    same = sum(a is not None and b is not None and a[0] == b[0] for a, b in steps)
    return f"the same steps to 98.5 % as float32 statistics in {same} of {len(steps)} seeds"


FIGURES = {"methods.cell.table": _cell_table, "methods.cell.short": _cell_short,
           "methods.decomposition.short": _decomposition_short, "methods.2x1.table": _two_by_one_table,
           "methods.2x1.short": _two_by_one_short,
           "methods.2x1.every_step.table": lambda: _two_by_one_table(EVERY_STEP),
           "methods.2x1.every_step.short": lambda: _two_by_one_short(EVERY_STEP),
           "methods.2x1.every_step.seeds": lambda: _every_step_seeds(EVERY_STEP),
           "methods.2x1.more_seeds.seeds": lambda: _every_step_seeds(MORE_SEEDS),
           "methods.2x1.six_seeds": _six_seeds, "methods.2x1.six_seeds.short": _six_seeds_short,
           "methods.2x1.bf16_statistics": _bf16_statistics,
           "methods.2x1.bf16_statistics.short": _bf16_statistics_short,
           "methods.2x1.variants.table": lambda: _two_by_one_table(VARIANTS),
           "methods.2x1.variants.seeds": lambda: _every_step_seeds(VARIANTS),
           "methods.2x1.variants.short": lambda: _two_by_one_short(VARIANTS), "methods.sweep.table": _sweep,
           "methods.2x1.yield.table": lambda: _two_by_one_table(YIELDING),
           "methods.2x1.yield.seeds": lambda: _every_step_seeds(YIELDING),
           "methods.2x1.yield.short": lambda: _two_by_one_short(YIELDING),
           "methods.2x1.malloc.table": lambda: _two_by_one_table(MEMORY_KEPT),
           "methods.2x1.malloc.seeds": lambda: _every_step_seeds(MEMORY_KEPT),
           "methods.2x1.malloc.short": lambda: _two_by_one_short(MEMORY_KEPT),
           "methods.2x1.nhwc.table": lambda: _two_by_one_table(NHWC),
           "methods.2x1.nhwc.seeds": lambda: _every_step_seeds(NHWC),
           "methods.2x1.nhwc.short": lambda: _two_by_one_short(NHWC),
           "methods.2x1.buckets.table": lambda: _two_by_one_table(BUCKETS),
           "methods.2x1.buckets.seeds": lambda: _every_step_seeds(BUCKETS),
           "methods.2x1.buckets.short": lambda: _two_by_one_short(BUCKETS)}


if __name__ == "__main__":
    run_main(main, program="kfac_method_cell")
