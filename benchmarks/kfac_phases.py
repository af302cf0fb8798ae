"""Where K-FAC's and Muon's steps go, rank by rank: the batch-4096 MNIST cell traced on a virtual cluster.

    .venv/bin/python -m hpcdl.tools.vcluster up --nodes 2 --name lb --rate 1gbit
    .venv/bin/python benchmarks/kfac_phases.py --vcluster lb --ranks 2 \
        --out benchmarks/results/kfac_phases_2x1 --refresh-results
    .venv/bin/python benchmarks/kfac_phases.py --vcluster lb --ranks 4 \
        --out benchmarks/results/kfac_phases_2x2 --refresh-results

Three runs one after another, one thread per rank, each of --steps steps with --profile-steps on its last
two: K-FAC with the large-batch preset (256 factor examples a step dealt over the ranks, decompositions every
2nd step, fraction auto), K-FAC with the preset's earlier values (512 examples, decompositions every step,
fraction 1: what results/kfac_large_batch_2x1.json's meta records), and Muon at its tuned rate. Each run's
summary.json phases (per rank) go to <out>.json and a stacked bar per rank to <out>.png (hpcdl.plot --phases);
the traces stay in the runs' folders under --keep (default: removed). ``--spinning`` adds K-FAC and Muon again
right after each, with Open MPI spinning while it waits (``OMPI_MCA_mpi_yield_when_idle=0``; hpcdl.train asks it to
yield, hpcdl.runtime.world): what that choice is worth where no core is spare. ``--malloc-default`` adds them again
with glibc's malloc at its defaults (``HPCDL_MALLOC_TUNING=0``; hpcdl.train keeps freed memory,
hpcdl.runtime.allocator): what the page faults of re-mapped activation buffers cost. ``--one-bucket`` adds K-FAC
again with all its factor statistics in one bucket (``bucket_cap_mb`` 25, kfac/'s earlier default, through the
``--kfac-impl kfac_phases:one_bucket`` plugin): what starting the buckets during backward saves. ``--rounds N``
runs the whole plan N times, for effects smaller than one machine's spread between runs: every round's phases are
kept, the traces and the plot are the first round's.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from figures import RESULTS, results, save_json, table
from kfac_large_batch import preset_flags
from studies import check_mnist, link_rate, run_train
from torch import nn

from hpcdl.persistence import outputs
from hpcdl.runtime.console import RankZeroParser
from hpcdl.runtime.errors import UsageError, run_main
from hpcdl.runtime.numbers import integer
from hpcdl.tools.plot import plot_phases
from hpcdl.training.config import default_backend

GLOBAL_BATCH = 4096
RATES = {"kfac": 0.4, "muon": 0.02}  # the tuned peak rates of the large-batch study (kfac_large_batch.REDUCED_LRS)


def earlier_preset() -> list[str]:
    """The flags of the preset's earlier values: those the 2 x 1 cell's first results file ran under (its meta)."""
    return preset_flags(json.loads((RESULTS / "kfac_large_batch_2x1.json").read_text())["meta"]["kfac_preset"])


SPINNING = {"OMPI_MCA_mpi_yield_when_idle": "0"}  # Open MPI's own default where it counts no more ranks than slots
MALLOC_DEFAULT = {"HPCDL_MALLOC_TUNING": "0"}  # glibc's malloc as it comes: large blocks mapped and unmapped each time
ONE_BUCKET = ["--kfac-impl", "kfac_phases:one_bucket"]  # its run gets this folder on PYTHONPATH


Plan = dict[str, tuple[list[str], dict[str, str]]]


def one_bucket(config: Any, model: nn.Module, current_lr: Any, scaler: Any) -> Any:
    """``--kfac-impl kfac_phases:one_bucket``: hpcdl's K-FAC with every layer's statistics in one bucket, started
    when backward ends (``bucket_cap_mb`` 25 MB, above mnist_cnn's 0.9 MB), a setting no hpcdl.train flag offers."""
    from hpcdl.training.optimizers import build_preconditioner

    return build_preconditioner(replace(config, kfac_impl="hpcdl"), model, current_lr, scaler, bucket_cap_mb=25.0)


def runs(ranks: int, spinning: bool = False, malloc_default: bool = False, one: bool = False) -> Plan:
    """Label -> (flags, environment) of each run, in the order they run: a method's twins right after it
    (``one``: K-FAC with one bucket, K-FAC's alone)."""
    kfac = ["--optimizer", "sgd", "--kfac-preset", "large-batch", "--warmup-start-factor", "1.0",
            "--base-lr", repr(RATES["kfac"] / ranks)]
    muon = ["--optimizer", "muon", "--momentum", "0.9", "--base-lr", repr(RATES["muon"] / ranks)]
    twins = [("MPI spinning", SPINNING)] * spinning + [("glibc malloc defaults", MALLOC_DEFAULT)] * malloc_default
    plan: Plan = {"K-FAC": (kfac, {})}
    plan.update({f"K-FAC, {twin}": (kfac, env) for twin, env in twins})
    if one:
        plan["K-FAC, one bucket"] = ([*kfac, *ONE_BUCKET], {})
    plan.update({"K-FAC, earlier preset": ([*kfac, *earlier_preset()], {}), "Muon": (muon, {})})
    plan.update({f"Muon, {twin}": (muon, env) for twin, env in twins})
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    parser = RankZeroParser(prog="benchmarks/kfac_phases.py", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=integer(1), default=2)
    parser.add_argument("--vcluster", help="run on this virtual cluster's nodes (launch/mpirun.sh --vcluster)")
    parser.add_argument("--backend", choices=("horovod", "torch"), default=None,
                        help="what averages the gradients in every run (default: hpcdl.train's)")
    parser.add_argument("--steps", type=integer(4), default=14)
    parser.add_argument("--spinning", action="store_true",
                        help="also K-FAC and Muon with Open MPI spinning while it waits "
                             "(OMPI_MCA_mpi_yield_when_idle=0)")
    parser.add_argument("--malloc-default", action="store_true",
                        help="also K-FAC and Muon with glibc's malloc at its defaults (HPCDL_MALLOC_TUNING=0)")
    parser.add_argument("--one-bucket", action="store_true",
                        help="also K-FAC with all its factor statistics in one bucket, started when backward ends")
    parser.add_argument("--data-dir", type=Path, default=Path.home() / ".cache" / "hpcdl" / "mnist")
    parser.add_argument("--rounds", type=integer(1), default=1,
                        help="run the whole plan this many times; the traces and plot are the first round's, and "
                             "every round's phases go to the results' 'rounds' (one machine's noise, seen)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--keep", type=Path, help="keep the runs (and their traces) in this folder")
    parser.add_argument("--out", type=Path, help="results path without suffix (default runs/bench/kfac_phases)")
    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    if GLOBAL_BATCH % args.ranks:
        raise UsageError(f"--ranks {args.ranks} does not divide the global batch {GLOBAL_BATCH}")
    stem = outputs.results_stem(args.out, "kfac_phases", (".json", ".png"), refresh_results=args.refresh_results,
                                force=args.force, flag="--out")
    check_mnist(args.data_dir)
    scratch = Path(tempfile.mkdtemp(prefix="kfac_phases-")) if args.keep is None else args.keep
    common = ["--dataset", "mnist", "--data-dir", str(args.data_dir), "--model", "mnist_cnn",
              "--batch-size", str(GLOBAL_BATCH // args.ranks), "--epochs", "1", "--max-steps", str(args.steps),
              "--device", "cpu", "--log-every", "1000", "--stall-timeout", "0", "--test-batch-size", "1000",
              "--profile-steps", f"{args.steps - 1}:{args.steps}",
              *(["--backend", args.backend] if args.backend else [])]
    rounds: list[dict[str, dict]] = []
    dirs: list[Path] = []
    try:
        plan = runs(args.ranks, args.spinning, args.malloc_default, args.one_bucket)
        for r in range(args.rounds):
            report: dict[str, dict] = {}
            for k, (label, (flags, env)) in enumerate(plan.items()):
                out = scratch / f"round{r}" / f"run{k}"
                print(f"[kfac_phases] round {r + 1} of {args.rounds}, {label}: {args.ranks} rank(s), "
                      f"{args.steps} steps", flush=True)
                plugin = [str(Path(__file__).resolve().parent)] if ONE_BUCKET[1] in flags else []
                run = run_train([*common, *flags], out, ranks=args.ranks, vcluster=args.vcluster,
                                timeout=args.timeout, env=env, python_path=plugin, required=f"the {label} run")
                summary = run.summary
                report[label] = dict(step_phases=summary["step_phases"],
                                     seconds_per_step=summary["train_seconds"] / summary["global_steps"])
                dirs += [out] if r == 0 else []
            rounds.append(report)
        save_json(stem, dict(kind="kfac_phases", ranks=args.ranks, vcluster=args.vcluster,
                             link_rate=link_rate(args.vcluster), spinning=args.spinning,
                             malloc_default=args.malloc_default, one_bucket=args.one_bucket,
                             backend=args.backend or default_backend(), steps=args.steps, runs=rounds[0],
                             **({"rounds": rounds} if args.rounds > 1 else {})))
        plot_phases(dirs, outputs.output_file(stem, ".png"), list(rounds[0]))
    finally:
        if args.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {stem}.json and {stem}.png")
    return 0


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

def _table(name: str) -> str:
    """Per phase, each run's median seconds on its slowest rank (phases under half a millisecond left out)."""
    runs = results(name)["runs"]
    phases = [p for p in next(iter(runs.values()))["step_phases"]["phases"]
              if any(run["step_phases"]["phases"][p]["median_slowest"] >= 0.0005 for run in runs.values())]
    return table(["phase (ms, median, slowest rank)", *runs],
                 [(p, *(f"{1000 * run['step_phases']['phases'][p]['median_slowest']:.0f}" for run in runs.values()))
                  for p in phases])


def _gap(name: str) -> str:
    """Per rank, K-FAC's mean milliseconds in each phase minus Muon's: the phases tile the step, so each column
    adds up to the rank's step gap (the last row), phase by phase (rows under half a millisecond on every rank
    left out; their sum is in "the rest")."""
    runs = results(name)["runs"]
    kfac, muon = runs["K-FAC"]["step_phases"]["phases"], runs["Muon"]["step_phases"]["phases"]
    ranks = range(len(kfac["step"]["mean_per_rank"]))

    def gap(phase: str, rank: int) -> float:
        return 1000 * (kfac[phase]["mean_per_rank"][rank] - muon[phase]["mean_per_rank"][rank])

    phases = [p for p in kfac if p != "step"]
    shown = [p for p in phases if any(abs(gap(p, r)) >= 0.5 for r in ranks)]
    rest = [sum(gap(p, r) for p in phases if p not in shown) for r in ranks]
    rows = [(p, *(f"{gap(p, r):+.0f}" for r in ranks)) for p in shown]
    rows.append(("the rest", *(f"{x:+.0f}" for x in rest)))
    rows.append(("**step**", *(f"**{gap('step', r):+.0f}**" for r in ranks)))
    return table(["K-FAC − Muon (ms, mean over steps)", *(f"rank {r}" for r in ranks)], rows)


def _twin_steps(name: str, twin: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(Muon's, K-FAC's) median step on the slowest rank in ms, each as (the run, its ``twin``)."""
    runs = results(name)["runs"]

    def step(label: str) -> float:
        return 1000 * runs[label]["step_phases"]["phases"]["step"]["median_slowest"]

    muon, kfac = ((step(method), step(f"{method}, {twin}")) for method in ("Muon", "K-FAC"))
    return muon, kfac


def _yield(name: str) -> str:
    """Each method's median step on the slowest rank, Open MPI yielding against spinning (a --spinning trace)."""
    (muon, muon_spin), (kfac, kfac_spin) = _twin_steps(name, "MPI spinning")
    return (f"Muon's step {muon:.0f} ms with Open MPI yielding against {muon_spin:.0f} ms spinning "
            f"({muon_spin / muon:.2f}×), K-FAC's {kfac:.0f} against {kfac_spin:.0f} ms ({kfac_spin / kfac:.2f}×)")


def _malloc(name: str) -> str:
    """Each method's median step on the slowest rank, freed memory kept against glibc's defaults (--malloc-default)."""
    (muon, muon_glibc), (kfac, kfac_glibc) = _twin_steps(name, "glibc malloc defaults")
    return (f"Muon's step {muon:.0f} ms with freed memory kept against {muon_glibc:.0f} ms with glibc's defaults "
            f"({muon_glibc / muon:.2f}×), K-FAC's {kfac:.0f} against {kfac_glibc:.0f} ms ({kfac_glibc / kfac:.2f}×)")


def _bucket_rows(name: str) -> list[tuple[float, float, float, float, float]]:
    """Per round: K-FAC's wait for the gradients' allreduce with the default buckets and with one bucket, then
    the step of each and Muon's (ms, median over steps, slowest rank)."""
    data = results(name)

    def ms(run: dict, phase: str) -> float:
        return 1000 * run["step_phases"]["phases"][phase]["median_slowest"]

    return [(ms(r["K-FAC"], "allreduce"), ms(r["K-FAC, one bucket"], "allreduce"), ms(r["K-FAC"], "step"),
             ms(r["K-FAC, one bucket"], "step"), ms(r["Muon"], "step")) for r in data.get("rounds", [data["runs"]])]


def _buckets(name: str) -> str:
    """The rounds of a --one-bucket trace, each round's step difference (a pair run one after the other), and
    the medians over the rounds."""
    rows = [(*row, row[2] - row[3]) for row in _bucket_rows(name)]
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]

    def cells(row: Sequence[float], bold: str = "") -> list[str]:
        return [f"{bold}{x:.1f}{bold}" for x in row[:2]] + [f"{bold}{x:.0f}{bold}" for x in row[2:5]] + \
            [f"{bold}{row[5]:+.0f}{bold}"]

    shown = [[str(k), *cells(row)] for k, row in enumerate(rows, 1)] + [["median", *cells(medians, "**")]]
    return table(["round", "K-FAC's wait for the gradients, buckets (ms)", "the same, one bucket (ms)",
                  "K-FAC's step, buckets (ms)", "K-FAC's step, one bucket (ms)", "Muon's step (ms)",
                  "step, buckets − one bucket (ms)"], shown)


def _buckets_short(name: str) -> str:
    rows = _bucket_rows(name)
    wait, wait_one = (statistics.median(row[k] for row in rows) for k in (0, 1))
    gained = [row[3] - row[2] for row in rows]
    return (f"K-FAC waited {wait:.1f} ms a step for the gradients' allreduce with its statistics in buckets of the "
            f"default cap, against {wait_one:.1f} ms with one bucket, and its step was {statistics.median(gained):.0f} "
            f"ms shorter (shorter in {sum(g > 0 for g in gained)} of {len(rows)} rounds; medians, slowest rank)")


FIGURES = {"phases.2x1": lambda: _table("kfac_phases_2x1"), "phases.2x1.yield": lambda: _yield("kfac_phases_2x1"),
           "phases.2x1.malloc": lambda: _malloc("kfac_phases_2x1"),
           "phases.2x1.buckets": lambda: _buckets("kfac_phases_2x1_buckets"),
           "phases.2x1.buckets.short": lambda: _buckets_short("kfac_phases_2x1_buckets"),
           "phases.2x2": lambda: _table("kfac_phases_2x2"),
           "phases.2x1.torch": lambda: _table("kfac_phases_2x1_torch"),
           "phases.2x2.torch": lambda: _table("kfac_phases_2x2_torch"),
           "phases.2x2.gap": lambda: _gap("kfac_phases_2x2"),
           "phases.2x2.gap.torch": lambda: _gap("kfac_phases_2x2_torch")}


if __name__ == "__main__":
    run_main(main, program="kfac_phases")
