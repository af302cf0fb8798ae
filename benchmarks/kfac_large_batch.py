"""Accuracy against global batch within a fixed epoch budget: SGD, LAMB/LARS, hpcdl's K-FAC and kfac-pytorch's.

    python -m hpcdl.fetch_mnist                                                 # once: real MNIST
    .venv/bin/python benchmarks/kfac_large_batch.py --install-kfac-pytorch     # once: kfac-pytorch, outside the repo
    nice -n 5 .venv/bin/python benchmarks/kfac_large_batch.py --reduced         # batch 128 and 4096, 1 seed
    nice -n 5 .venv/bin/python benchmarks/kfac_large_batch.py --target-cell     # batch 4096, 3 seeds, best rates
    nice -n 5 .venv/bin/python benchmarks/kfac_large_batch.py                   # the full grid (hours on 2 cores)
    nice -n 5 .venv/bin/python benchmarks/kfac_large_batch.py --tune --methods ...  # the same tuning budget for each

Every run is ``python -m hpcdl.train`` itself: the same model, data, data order per seed, schedule, evaluation and
clocks for every method, which differ only in their flags (:func:`train_flags`). The recipe and why each choice
was made: benchmarks/results/kfac_large_batch.md; kfac-pytorch inside hpcdl.train and its damping carried over:
docs/kfac.md. kfac-pytorch is not a dependency of hpcdl: it lives in a site folder outside the repository
(benchmarks/kfac_pytorch_adapter.py), first on its runs' PYTHONPATH only. Results: ``<out>.json`` (the summary rows
and every run's curve) and ``<out>.png``, saved after every run; Ctrl-C or SIGTERM ends the study in one line, and
``--keep`` then runs only what is missing (studies.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import kfac_pytorch_adapter
import studies
from figures import figure, save_json, table
from kfac_pytorch_adapter import (  # noqa: F401 - the plugins --kfac-impl names as kfac_large_batch:...
    kfac_pytorch_native_preconditioner,
    kfac_pytorch_preconditioner,
)

from hpcdl.persistence import outputs
from hpcdl.runtime.console import RankZeroParser
from hpcdl.runtime.errors import UsageError, run_main
from hpcdl.runtime.numbers import integer, real
from hpcdl.tools.fetch_mnist import DEFAULT_OUTPUT as DEFAULT_MNIST_DIR
from hpcdl.training.config import parse_config, seed_value

REPO = Path(__file__).resolve().parents[1]
TARGETS = (0.985, 0.99)
METHODS = ("sgd", "lamb", "lars", "kfac", "kfac-pytorch", "kfac-pytorch-native", "adamw", "muon", "soap")
# Methods that are an --optimizer of hpcdl.train alone (no K-FAC): Muon and LAMB/LARS are timm's, SOAP is
# pytorch-optimizer's (Adam in the eigenbasis of Shampoo's factors), AdamW is torch's.
FIRST_ORDER = ("sgd", "lamb", "lars", "adamw", "muon", "soap")
FULL_BATCHES = (128, 512, 2048, 4096, 8192)
REDUCED_BATCHES = (128, 4096)
# Peak learning rates swept per method (the rate after warm-up, for the global batch), around the best
# rates of the batch-4096 sweeps in docs/kfac.md (SGD diverged at 0.1, LAMB at 0.16, LARS fell to 95.7 % at 80).
FULL_LRS = {"sgd": (0.0125, 0.025, 0.05), "lamb": (0.02, 0.04, 0.06, 0.08, 0.11), "lars": (10.0, 20.0, 40.0),
            "kfac": (0.2, 0.4, 0.8), "kfac-pytorch": (0.2,), "kfac-pytorch-native": (0.1, 0.2, 0.4),
            "adamw": (0.002, 0.004, 0.008), "muon": (0.01, 0.02, 0.04), "soap": (0.002, 0.004, 0.008)}
# The reduced grid checks each method at its best batch-4096 rate of those sweeps (one seed, no sweep).
REDUCED_LRS = {"sgd": (0.05,), "lamb": (0.06,), "lars": (40.0,), "kfac": (0.4,), "kfac-pytorch": (0.2,),
               "kfac-pytorch-native": (0.2,), "adamw": (0.008,), "muon": (0.02,), "soap": (0.008,)}  # --tune's picks
# The batch-128 study's rates (docs/kfac.md); LARS has none measured there, so it is left out at 128.
BATCH_128_LRS = {"sgd": (0.05,), "lamb": (0.005,), "kfac": (0.1,), "kfac-pytorch": (0.1,),
                 "kfac-pytorch-native": (0.1,)}
DEFAULT_METHODS = ("sgd", "lamb", "lars", "kfac", "kfac-pytorch-native")
# kfac-pytorch with its own README's damping and clip, not carried over (the carried-over ones diverged).
NATIVE_FLAGS = ("--kfac-damping", "0.003", "--kfac-kl-clip", "0.001")
KFAC_DAMPING = 0.1  # hpcdl's convention (docs/kfac.md): the batch-128 study's best, and the large-batch preset's
SMALL_KFAC = dict(factors=10, inverse=100, damping=KFAC_DAMPING, kl_clip=0.001)  # the batch-128 study's
_PRESET = parse_config(["--kfac-preset", "large-batch"])  # what --kfac-preset large-batch sets
LARGE_KFAC = dict(factors=_PRESET.kfac_factor_update_freq, inverse=_PRESET.kfac_inv_update_freq,
                  damping=_PRESET.kfac_damping, kl_clip=_PRESET.kfac_kl_clip)
# Today's preset as a results file records it (meta["kfac_preset"]); a file written under earlier values records
# those (and, where its runs carry another name, a "label"), so that its runs stay named by the preset of their time.
RECORDED_PRESET = dict(LARGE_KFAC, factor_examples=_PRESET.kfac_factor_examples, momentum=_PRESET.momentum,
                       fraction=_PRESET.kfac_grad_worker_fraction, method=_PRESET.kfac_method)
MNIST_TRAIN_EXAMPLES = 60_000
# kfac-pytorch at large batches: its best measured frequencies (98.33 / 98.57 % at 4096 with the ramp; at
# 5/5 without the ramp it ended at 97.26 %, and at batch 128 without the ramp at 88.24 %).
KFAC_PYTORCH_LARGE_FREQUENCIES = dict(factors=1, inverse=10)


def kfac_settings(batch: int) -> dict[str, float]:
    """hpcdl K-FAC's (factor, inverse) frequencies, damping and KL clip at ``batch``: the batch-128 study's
    up to 512, the large-batch preset's above."""
    return SMALL_KFAC if batch <= 512 else LARGE_KFAC


MICRO_BATCH = 4096  # per backward pass; larger global batches accumulate (--batches-per-allreduce)


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    method: str
    batch: int
    lr: float
    seed: int
    warmup: float | None = None  # warm-up epochs; None: the study's --warmup-epochs (files before --tune)

    @property
    def name(self) -> str:
        warmup = "" if self.warmup is None else f"-w{self.warmup:g}"
        return f"{self.method}-b{self.batch}-lr{self.lr:g}{warmup}-s{self.seed}"


@dataclass
class Outcome:
    cell: Cell
    returncode: int
    epochs: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl rows
    wall_seconds: float = 0.0  # the whole process, start-up and evaluation included
    command: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def final_accuracy(self) -> float | None:
        return self.epochs[-1]["test_accuracy"] if self.epochs and self.returncode == 0 else None

    @property
    def best_accuracy(self) -> float | None:
        values = [e["test_accuracy"] for e in self.epochs if e.get("test_accuracy") is not None]
        return max(values) if values else None

    def to_target(self, target: float) -> tuple[int, float] | None:
        """(steps, training seconds) at the first evaluation at or above ``target``."""
        for row in self.epochs:
            if (row.get("test_accuracy") or 0.0) >= target:
                return int(row["global_step"]), float(row["train_seconds"])
        return None

    @property
    def seconds_per_step(self) -> float | None:
        if not self.epochs:
            return None
        return float(self.epochs[-1]["train_seconds"]) / max(int(self.epochs[-1]["global_step"]), 1)


# ---- running the grid ---------------------------------------------------------------------------


def train_flags(cell: Cell, args: argparse.Namespace) -> list[str]:
    """hpcdl.train's flags for one cell: the study's whole recipe (methods differ only here)."""
    micro = min(cell.batch, args.micro_batch)
    if cell.batch % micro:
        raise UsageError(f"global batch {cell.batch} is not a multiple of {micro}")
    accumulate = cell.batch // micro
    if micro % args.ranks:
        raise UsageError(f"{micro} examples a pass do not split over {args.ranks} ranks")
    flags = [
        "--dataset", args.dataset, "--model", args.model,
        "--epochs", str(args.epochs), "--batch-size", str(micro // args.ranks),
        "--batches-per-allreduce", str(accumulate), "--test-batch-size", "1000",
        # the rate is per rank and backward pass, scaled by ranks x accumulation: the peak for the whole batch
        "--base-lr", repr(cell.lr / accumulate / args.ranks), "--lr-schedule", "cosine",
        "--warmup-epochs", str(args.warmup_epochs if cell.warmup is None else cell.warmup),
        "--warmup-start-factor", "1.0" if cell.method == "kfac" else "0.1",  # why: results/kfac_large_batch.md
        "--weight-decay", "5e-4", "--seed", str(cell.seed),
        "--device", "cpu", "--log-every", "1000",
        "--stall-timeout", "0",
    ]
    if args.backend:
        flags += ["--backend", args.backend]
    if args.dataset == "mnist" and args.evals_per_epoch > 1:  # time to target at a finer grain than an epoch
        flags += ["--eval-every", str(max(1, round(MNIST_TRAIN_EXAMPLES // cell.batch / args.evals_per_epoch)))]
    if args.data_dir:
        flags += ["--data-dir", str(args.data_dir)]
    if args.max_steps:
        flags += ["--max-steps", str(args.max_steps)]
    if cell.method in FIRST_ORDER:
        flags += ["--optimizer", cell.method, "--momentum", "0.9"]  # SGD's, LARS's and Muon's; the Adams ignore it
    else:
        settings = kfac_settings(cell.batch)
        preset = cell.method == "kfac" and settings is LARGE_KFAC
        if cell.method != "kfac" and settings is LARGE_KFAC:
            settings = {**settings, **KFAC_PYTORCH_LARGE_FREQUENCIES}
        flags += ["--optimizer", "sgd"]
        if preset:  # the documented preset itself (its momentum too), not a copy of its values
            flags += ["--kfac-preset", "large-batch"]
        else:
            flags += ["--momentum", "0.9", "--kfac", "--kfac-factor-update-freq", str(settings["factors"]),
                      "--kfac-inv-update-freq", str(settings["inverse"])]
        if cell.method == "kfac-pytorch-native":
            flags += NATIVE_FLAGS
        elif not preset or args.damping is not None or args.kl_clip is not None:
            flags += ["--kfac-damping", repr(settings["damping"] if args.damping is None else args.damping),
                      "--kfac-kl-clip", repr(settings["kl_clip"] if args.kl_clip is None else args.kl_clip)]
    if cell.method == "kfac":
        flags += shlex.split(args.kfac_flags)  # last: given flags win over the preset
    if cell.method == "kfac-pytorch":
        flags += ["--kfac-impl", "kfac_large_batch:kfac_pytorch_preconditioner"]
    if cell.method == "kfac-pytorch-native":
        flags += ["--kfac-impl", "kfac_large_batch:kfac_pytorch_native_preconditioner"]
    return flags


def train_command(cell: Cell, args: argparse.Namespace, output_dir: Path) -> list[str]:
    """The whole command line of one cell's run (what --dry-run prints and the results record)."""
    return studies.train_command([*train_flags(cell, args), "--output-dir", str(output_dir), "--no-progress"],
                                 args.ranks, args.vcluster, args.threads)


def starter(cell: Cell, args: argparse.Namespace, scratch: Path) -> Callable[[], studies.StartedRun]:
    """Starts one cell's run in ``scratch``; kfac-pytorch's site goes first on PYTHONPATH, so that its
    ``kfac`` shadows the repository's, and benchmarks/ is there for --kfac-impl's plugins."""
    paths = [str(args.kfac_pytorch_site)] if cell.method.startswith("kfac-pytorch") else []
    return lambda: studies.start_train(train_flags(cell, args), scratch / cell.name, ranks=args.ranks,
                                       threads=args.threads, env={"PYTHONWARNINGS": "ignore"},
                                       python_path=[*paths, str(REPO / "benchmarks")], vcluster=args.vcluster)


def run_cells(cells: Sequence[Cell], args: argparse.Namespace, scratch: Path,
              after_each: Callable[[list[Outcome]], None] = lambda _: None) -> list[Outcome]:
    """Run every cell in ``scratch``, ``--jobs`` at a time, printing one line per finished run (``after_each``
    saves); a failed run is an outcome like any other (recorded as failed), never the end of the study."""
    outcomes: list[Outcome] = []
    if cells:
        starters = [starter(cell, args, scratch) for cell in cells]
        for index, run in studies.run_pool(starters, args.jobs, args.run_timeout):
            cell = cells[index]
            outcome = Outcome(cell, run.returncode, epochs=run.rows, wall_seconds=run.wall_seconds,
                              command=run.command, error=run.log_tail)
            outcomes.append(outcome)
            reached = "  ".join(
                f"{t:.1%}: " + (f"{r[0]} steps {r[1]:.0f} s" if (r := outcome.to_target(t)) else "-") for t in TARGETS)
            final = outcome.final_accuracy
            print(f"[{len(outcomes)}/{len(cells)}] {cell.name}: "
                  + (f"final {final:.2%}  {reached}  ({outcome.wall_seconds:.0f} s)" if final is not None
                     else f"FAILED rc={outcome.returncode}: {outcome.error}"), flush=True)
            after_each(outcomes)
    return outcomes


# ---- the grids ----------------------------------------------------------------------------------


def reduced_cells(methods: Sequence[str], batches: Sequence[int] = REDUCED_BATCHES, seed: int = 0) -> list[Cell]:
    """The larger batches at each method's REDUCED_LRS, the smallest at its batch-128 rate (where it has one)."""
    small, *large = sorted(batches)
    cells = [Cell(m, b, lr, seed) for b in large for m in methods for lr in REDUCED_LRS[m]]  # the question first
    return cells + [Cell(m, small, lr, seed) for m in methods for lr in BATCH_128_LRS.get(m, ())]


def full_cells(methods: Sequence[str], batches: Sequence[int], seeds: Sequence[int]) -> list[Cell]:
    return [Cell(m, b, lr, s) for s in seeds for b in batches for m in methods for lr in FULL_LRS[m]]


# --tune: every method gets the same budget, K-FAC included: its rate and one more hyperparameter, the same one for
# all (the warm-up length: the epochs of the linear ramp from 0.1x, or for hpcdl's K-FAC, which holds the peak, of
# the hold before the cosine decay), two values each, on one seed; then the best of those four on the other seeds.
# The rates: each earlier method's best batch-4096 rate of the sweeps above and the next step up (a longer warm-up
# may carry a larger one); the new methods' from a pilot of one epoch at three rates each (kfac_large_batch_modern.md).
TUNE_WARMUPS = (0.5, 1.0)
TUNE_LRS = {"sgd": (0.05, 0.07), "lamb": (0.06, 0.08), "lars": (40.0, 56.0), "kfac": (0.4, 0.8),
            "kfac-pytorch": (0.2, 0.4), "kfac-pytorch-native": (0.2, 0.4),
            "adamw": (0.004, 0.008), "muon": (0.01, 0.02), "soap": (0.004, 0.008)}


def tune_cells(methods: Sequence[str], batches: Sequence[int], seed: int) -> list[Cell]:
    """The first phase of --tune: every method at each of its TUNE_LRS and each of TUNE_WARMUPS."""
    return [Cell(m, b, lr, seed, w) for b in batches for m in methods for lr in TUNE_LRS[m] for w in TUNE_WARMUPS]


def tuned_settings(outcomes: Sequence[Outcome], seed: int) -> list[Cell]:
    """Per (method, batch), the tuning run at ``seed`` with the best final accuracy (a failed run counts as 0), ties
    broken by the shorter time to 98.5 %: the setting the other seeds then run."""
    best: dict[tuple[str, int], Outcome] = {}

    def score(o: Outcome) -> tuple[float, float]:
        reached = o.to_target(TARGETS[0])
        return (o.final_accuracy or 0.0, -(reached[1] if reached else float("inf")))

    for o in outcomes:
        key = (o.cell.method, o.cell.batch)
        if o.cell.seed == seed and (key not in best or score(o) > score(best[key])):
            best[key] = o
    return [o.cell for o in best.values()]


def tuning_seed(outcomes: Sequence[Outcome], source: Path) -> int:
    """The seed a --tune results file tuned on (its first phase, whatever --seeds it was given): the one with
    more than one setting of some method; UsageError (one line) for a file that tuned nothing."""
    settings: dict[int, set[tuple[str, int, float, float | None]]] = {}
    for o in outcomes:
        settings.setdefault(o.cell.seed, set()).add((o.cell.method, o.cell.batch, o.cell.lr, o.cell.warmup))
    seeds = [seed for seed, cells in settings.items() if len(cells) > len({c[:2] for c in cells})]
    if len(seeds) != 1:
        raise UsageError(f"--tuned-from {source} is not the results of a --tune study (no single seed holds several "
                         "settings of a method)")
    return seeds[0]


def most_accurate(outcomes: Sequence[Outcome], most_seeds: bool = False) -> dict[tuple[str, int], dict[str, Any]]:
    """(method, batch) -> its summary row with the best median final accuracy (a failed run counts as 0); with
    ``most_seeds``, among its rows run on the most seeds (after --tune: the tuned setting)."""
    best: dict[tuple[str, int], tuple[tuple[int, float], dict[str, Any]]] = {}
    for row in summarise(outcomes):
        key, score = (row["method"], row["batch"]), (row["seeds"] if most_seeds else 0, row["median_final"])
        if key not in best or score > best[key][0]:
            best[key] = (score, row)
    return {key: row for key, (_, row) in best.items()}


def best_rates(outcomes: Sequence[Outcome], batch: int) -> dict[str, float]:
    """Per method, the rate of its most accurate setting at ``batch``."""
    return {method: row["lr"] for (method, at), row in most_accurate(outcomes).items() if at == batch}


# ---- summaries, files and the plot --------------------------------------------------------------


def summarise(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per (method, batch, rate, warm-up): medians over seeds."""
    groups: dict[tuple[str, int, float, float | None], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.cell.method, o.cell.batch, o.cell.lr, o.cell.warmup), []).append(o)
    rows = []
    for (method, batch, lr, warmup), runs in sorted(groups.items(), key=lambda g: (*g[0][:3], g[0][3] or -1.0)):
        row: dict[str, Any] = dict(method=method, batch=batch, lr=lr, seeds=len(runs),
                                   final_accuracy=[o.final_accuracy for o in runs],
                                   median_final=statistics.median(o.final_accuracy or 0.0 for o in runs),
                                   seconds_per_step=_median_of_measured([o.seconds_per_step for o in runs]))
        if warmup is not None:
            row["warmup"] = warmup
        for target in TARGETS:
            hits = [o.to_target(target) for o in runs]
            reached = [h for h in hits if h]
            key = f"{target * 100:.1f}"
            row[f"reached_{key}"] = f"{len(reached)}/{len(runs)}"
            for at, what in enumerate(("steps", "seconds")):  # a miss counts as beyond the budget: None past half
                median = studies.median_or_inf([h and h[at] for h in hits])
                row[f"{what}_{key}"] = None if math.isinf(median) else median
        rows.append(row)
    return rows


def _median_of_measured(values: Sequence[float | None]) -> float | None:
    """A measurement's median over the runs that measured it (a run that failed before its first evaluation has no
    time per step)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


# What a run's curve keeps of each metrics.jsonl row: all the summaries, the plot and --keep read.
CURVE = ("epoch", "global_step", "train_seconds", "test_accuracy")


def curve(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: row[key] for key in CURVE if key in row} for row in rows]


def write_results(outcomes: Sequence[Outcome], out: Path, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """<out>.json: the summary rows and every run's curve."""
    rows = summarise(outcomes)
    runs = [dict(asdict(o.cell), returncode=o.returncode, epochs=curve(o.epochs), wall_seconds=o.wall_seconds,
                 error=o.error, command=" ".join(o.command)) for o in outcomes]
    save_json(out, dict(meta=meta, summary=rows, runs=runs))
    return rows


def plot(outcomes: Sequence[Outcome], out: Path, title: str) -> None:
    import matplotlib.ticker

    batches = sorted({o.cell.batch for o in outcomes})
    colours = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:purple", "tab:green", "tab:red", "tab:brown",
                                 "tab:olive", "tab:cyan", "tab:pink"), strict=True))
    best_final: dict[str, dict[int, float]] = {}
    with figure(out, 1, len(batches) + 1, figsize=(5 * (len(batches) + 1), 4), squeeze=False, dpi=110) \
            as (fig, axes):
        for ax, batch in zip(axes[0], batches, strict=False):
            for o in outcomes:
                if o.cell.batch != batch or not o.epochs:
                    continue
                xs = [float(e["train_seconds"]) for e in o.epochs]
                ys = [100 * (e.get("test_accuracy") or 0.0) for e in o.epochs]
                first_seed = o.cell.seed == min(x.cell.seed for x in outcomes
                                                if x.cell == replace(o.cell, seed=x.cell.seed))
                label = f"{o.cell.method} lr {o.cell.lr:g}" + (f" wu {o.cell.warmup:g}" if o.cell.warmup else "")
                ax.plot(xs, ys, marker="o", ms=3, color=colours.get(o.cell.method, "tab:gray"), alpha=0.8,
                        label=label if first_seed else None)
                best = best_final.setdefault(o.cell.method, {})
                best[batch] = max(best.get(batch, 0.0), o.final_accuracy or 0.0)
            for target in TARGETS:
                ax.axhline(100 * target, color="grey", lw=0.6, ls=":")
            ax.set(title=f"global batch {batch}", xlabel="training seconds (evaluation excluded)",
                   ylabel="test accuracy (%)", ylim=(96.0 if batch <= 512 else 85.0, 99.6))
            ax.legend(fontsize=6)
        ax = axes[0][-1]
        for method, finals in best_final.items():
            xs = sorted(finals)
            ax.plot(xs, [100 * finals[b] for b in xs], marker="o", color=colours.get(method, "tab:gray"),
                    label=method)
        ax.set(xscale="log", title="best final accuracy by global batch", xlabel="global batch",
               ylabel="test accuracy (%)", ylim=(90.0, 99.6))
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)


def best_rows(outcomes: Sequence[Outcome], batch: int = 4096) -> dict[str, dict[str, Any]]:
    """Per method, its summary row at ``batch`` run on the most seeds (the tuned one, after --tune), then the
    most accurate."""
    return {method: row for (method, at), row in most_accurate(outcomes, most_seeds=True).items() if at == batch}


def verdict(outcomes: Sequence[Outcome], batch: int = 4096) -> list[str]:
    """The issue's targets at ``batch``, as lines of text (medians over the seeds run)."""
    rows = [r for r in summarise(outcomes) if r["batch"] == batch]
    if not rows:
        return []
    best = best_rows(outcomes, batch)
    lines = [f"batch {batch}: best rate per method (median of {max(r['seeds'] for r in rows)} seed(s)):"]
    for method, r in best.items():
        warmup = f" wu {r['warmup']:g}" if "warmup" in r else ""
        lines.append(f"  {method:13s} lr {r['lr']:<6g}{warmup} final {100 * (r['median_final'] or 0):.2f} %  "
                     f"98.5 %: {r['reached_98.5']} ({_fmt(r['seconds_98.5'])} s)  "
                     f"99.0 %: {r['reached_99.0']} ({_fmt(r['seconds_99.0'])} s)  "
                     f"{1000 * (r['seconds_per_step'] or 0):.0f} ms/step")
    kfac = best.get("kfac")
    if kfac:
        lines.insert(0, beats_kfac(kfac, [r for m, r in best.items() if m != "kfac"]))  # kfac-pytorch included
    first_order = [best[m] for m in FIRST_ORDER if m in best]
    if kfac and first_order:
        fo = max(first_order, key=lambda r: (r["seconds_98.5"] is not None, -(r["seconds_98.5"] or 0),
                                             r["median_final"] or 0))
        lines.append(f"  K-FAC >= 99.0 % (median): {'met' if (kfac['median_final'] or 0) >= 0.99 else 'NOT met'}")
        if fo["seconds_98.5"] is None:
            lines.append(f"  best first-order ({fo['method']}) never reached 98.5 % (best median final "
                         f"{100 * (fo['median_final'] or 0):.2f} %)")
        elif kfac["seconds_98.5"] is not None:
            ratio = kfac["seconds_98.5"] / fo["seconds_98.5"]
            met = "met" if ratio <= 0.6 else "NOT met"
            lines.append(f"  K-FAC time to 98.5 % / {fo['method']}'s: {ratio:.2f}x ({met} against 0.6x)")
    variants = [best[m] for m in ("kfac-pytorch", "kfac-pytorch-native") if m in best]
    theirs = max(variants, key=lambda r: r["median_final"] or 0) if variants else None
    if kfac and theirs:
        lines.append(f"  vs {theirs['method']}: final {100 * (kfac['median_final'] or 0):.2f} % vs "
                     f"{100 * (theirs['median_final'] or 0):.2f} %, {1000 * (kfac['seconds_per_step'] or 0):.0f} vs "
                     f"{1000 * (theirs['seconds_per_step'] or 0):.0f} ms/step")
    return lines


def beats_kfac(kfac: dict[str, Any], others: Sequence[dict[str, Any]]) -> str:
    """The verdict's first line: every method more accurate than hpcdl's K-FAC (median final) or faster to 98.5 %
    (median training seconds), or that none is."""
    def faster(r: dict[str, Any]) -> bool:
        mine, theirs = r["seconds_98.5"], kfac["seconds_98.5"]
        return mine is not None and (theirs is None or mine < theirs)

    beaters = [r for r in others if (r["median_final"] or 0) > (kfac["median_final"] or 0) or faster(r)]
    if not beaters:
        return (f"no method beats hpcdl's K-FAC: it is the most accurate ({100 * (kfac['median_final'] or 0):.2f} %) "
                f"and the first to 98.5 % ({_fmt(kfac['seconds_98.5'])} s)")
    return "; ".join(f"{r['method']} beats K-FAC: final {100 * (r['median_final'] or 0):.2f} % vs "
                     f"{100 * (kfac['median_final'] or 0):.2f} %, 98.5 % in {_fmt(r['seconds_98.5'])} s vs "
                     f"{_fmt(kfac['seconds_98.5'])} s" for r in beaters)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = RankZeroParser(prog="benchmarks/kfac_large_batch.py",
                            description=__doc__.split("\n\n")[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--reduced", action="store_true", help="batch 128 (known rates) and 4096 (two rates), one seed")
    mode.add_argument("--target-cell", action="store_true",
                      help="batch 4096 (or --batches), --seeds, each method at its best batch-4096 rate in "
                           "--rates-from (or --lrs)")
    mode.add_argument("--tune", action="store_true",
                      help="the same tuning budget for every method: TUNE_LRS x TUNE_WARMUPS on the first of --seeds, "
                           "then each method's best setting on the other seeds (batch 4096, or --batches)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS),
                        help="kfac-pytorch: its K-FAC with our damping carried over (did not learn at 4096); "
                             "kfac-pytorch-native: with its README's damping and clip")
    parser.add_argument("--batches", nargs="+", type=integer(1), default=None,
                        help=f"global batches (default: {FULL_BATCHES}; --reduced: {REDUCED_BATCHES})")
    parser.add_argument("--seeds", nargs="+", type=seed_value, default=[0, 1, 2])
    parser.add_argument("--lrs", nargs="+", default=[], metavar="METHOD=LR",
                        help="the target cell's rate per method, instead of --rates-from")
    parser.add_argument("--rates-from", type=Path,
                        help="a results .json whose best batch-4096 rates the target cell uses")
    parser.add_argument("--tuned-from", type=Path,
                        help="a --tune results .json: the target cell runs each method's tuned rate and warm-up")
    parser.add_argument("--epochs", type=integer(1), default=5)
    parser.add_argument("--warmup-epochs", type=real(0), default=0.5)
    parser.add_argument("--evals-per-epoch", type=integer(1), default=4,
                        help="test-set evaluations per epoch (MNIST; hpcdl.train --eval-every), for the time to target")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--model", default="mnist_cnn")
    parser.add_argument("--data-dir", type=Path, default=None, help=f"MNIST's IDX files (default {DEFAULT_MNIST_DIR})")
    parser.add_argument("--kfac-pytorch-site", type=Path, default=kfac_pytorch_adapter.DEFAULT_SITE,
                        help="directory holding kfac-pytorch's installed `kfac` package (outside the repository)")
    parser.add_argument("--jobs", type=integer(1), default=2, help="runs at a time (each gets --threads threads)")
    parser.add_argument("--threads", type=integer(1), default=1)
    parser.add_argument("--ranks", type=integer(1), default=1,
                        help="ranks of each run (the global batch is split over them; under mpirun)")
    parser.add_argument("--vcluster", default=None, metavar="NAME",
                        help="run each job on this virtual cluster (launch/mpirun.sh --vcluster), e.g. 2 nodes over "
                             "a 1 Gbit/s link")
    parser.add_argument("--backend", choices=("horovod", "torch"), default=None,
                        help="what averages every method's gradients (default: hpcdl.train's, Horovod where installed)")
    parser.add_argument("--damping", type=real(0, low_open=True), default=None,
                        help="hpcdl's and (carried over) kfac-pytorch's (default: the preset's; 0.1 up to 512)")
    parser.add_argument("--kl-clip", type=real(0, low_open=True), default=None,
                        help="hpcdl's and (carried over) kfac-pytorch's (default: the preset's, or 0.001 up to 512)")
    parser.add_argument("--kfac-flags", default="", metavar="FLAGS",
                        help="hpcdl.train flags added to hpcdl's K-FAC runs, for ablations (e.g. \"--momentum 0.9\"); "
                             "the results name what they change")
    parser.add_argument("--micro-batch", type=integer(1), default=MICRO_BATCH,
                        help="examples per backward pass; larger global batches accumulate")
    parser.add_argument("--max-steps", type=integer(1), default=None, help="cut every run short (wiring checks)")
    studies.add_results_arguments(parser, "kfac_large_batch", run_timeout=3600.0)
    parser.add_argument("--dry-run", action="store_true", help="print the runs' commands and exit")
    parser.add_argument("--report", nargs="+", metavar="JSON[@BATCHES]",
                        help="no runs: the markdown table, verdict and plot (--out) of these results files together; "
                             "FILE@128,512 takes only those global batches of FILE")
    parser.add_argument("--install-kfac-pytorch", nargs="?", const=kfac_pytorch_adapter.SOURCE, metavar="SOURCE",
                        help="pip-install kfac-pytorch (a local checkout or a pip URL; default: its public source at "
                             "the commit the results used) into --kfac-pytorch-site and exit")
    args = studies.parse_study_args(parser, argv)
    check_inputs(args)
    if args.install_kfac_pytorch or args.report:
        return args
    if args.dataset == "mnist":
        args.data_dir = args.data_dir or DEFAULT_MNIST_DIR
        if not args.dry_run:
            studies.check_mnist(args.data_dir)
    wants_kfac_pytorch = any(m.startswith("kfac-pytorch") for m in args.methods)
    if wants_kfac_pytorch and not args.dry_run and not (args.kfac_pytorch_site / "kfac").is_dir():
        parser.error(f"no kfac-pytorch in {args.kfac_pytorch_site}: run with --install-kfac-pytorch first, "
                     "or leave kfac-pytorch out of --methods")
    return args


def check_inputs(args: argparse.Namespace) -> None:
    """One line for what would otherwise fail hours later: the files read, the flags passed on, --lrs' values."""
    for source in args.report or []:
        name, _, only = source.partition("@")
        if only and not all(part.isdigit() and int(part) > 0 for part in only.split(",")):
            raise UsageError(f"--report {source}: FILE@BATCHES takes global batches such as FILE@128,512")
        results_file(Path(name), "--report")
    if args.rates_from is not None:
        results_file(args.rates_from, "--rates-from")
    if args.tuned_from is not None:
        results_file(args.tuned_from, "--tuned-from")
    for item in args.lrs:
        method, _, value = item.partition("=")
        try:
            real(0, low_open=True)(value)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--lrs {item}: {exc}") from None
    try:
        parse_config(shlex.split(args.kfac_flags))
    except (ValueError, UsageError) as exc:  # shlex's unbalanced quote; hpcdl.train's refusal of every K-FAC run
        raise UsageError(f"--kfac-flags {args.kfac_flags!r}: {exc}") from None


def results_file(path: Path, flag: str) -> None:
    """UsageError unless ``path`` is a results .json of this study."""
    try:
        runs = json.loads(path.read_text())["runs"]
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{flag} {path} is not a results file of this study (JSON with a \"runs\" list)") from None
    if not isinstance(runs, list):
        raise UsageError(f"{flag} {path} is not a results file of this study (JSON with a \"runs\" list)")


def output_stem(args: argparse.Namespace) -> Path:
    """Where this study writes (hpcdl.persistence.outputs' rule: benchmarks/results only with --refresh-results)."""
    suffix = ("" if args.report else "_reduced" if args.reduced else "_target" if args.target_cell
              else "_tune" if args.tune else "")
    return outputs.results_stem(args.out, f"kfac_large_batch{suffix}", (".png",) if args.report else
                                (".json", ".png"), refresh_results=args.refresh_results,
                                force=args.force or args.keep, flag="--out")


def target_rates(args: argparse.Namespace) -> dict[str, float]:
    rates: dict[str, float] = {}
    if args.rates_from:
        rates.update(best_rates(load_outcomes(args.rates_from), 4096))
    for item in args.lrs:
        method, _, value = item.partition("=")
        if method not in METHODS or not value:
            raise UsageError(f"--lrs takes METHOD=LR with METHOD in {METHODS} (got {item})")
        rates[method] = float(value)
    missing = [m for m in args.methods if m not in rates]
    if missing:
        raise UsageError(f"no rate for {', '.join(missing)}: give --lrs or --rates-from")
    return rates


def load_outcomes(path: Path) -> list[Outcome]:
    return outcomes_of(json.loads(path.read_text()))


def selected(source: str, read: Callable[[str], dict[str, Any]]) -> list[Outcome]:
    """The runs of results file ``FILE``, or of ``FILE@B1,B2`` those at global batches B1 and B2 (``read``: a file's
    JSON by its name)."""
    name, _, only = source.partition("@")
    batches = {int(b) for b in only.split(",")} if only else None
    return [o for o in outcomes_of(read(name)) if batches is None or o.cell.batch in batches]


def outcomes_of(results: dict[str, Any]) -> list[Outcome]:
    """The runs of a results file; hpcdl K-FAC runs at other settings than :func:`kfac_settings`'s (or the preset
    of their time's, meta["kfac_preset"]) are named by them (damping, KL clip, decompositions every N steps, a ramp)."""
    recorded = results.get("meta", {}).get("kfac_preset") or {}
    outcomes = []
    for r in results["runs"]:
        command, method = r.get("command", "").split(), r["method"]
        if method == "kfac" and "hpcdl.train" in command:
            then = preset_of_their_time(recorded) if r["batch"] > 512 else None
            flags = command
            if then is not None and "large-batch" in command:  # the preset's flag meant its values of then
                at = command.index("large-batch")
                flags = command[:at - 1] + then + command[at + 1:]
            name = recorded.get("label", "kfac") if r["batch"] > 512 else "kfac"
            method = kfac_label(flags, r["batch"], then, name)
        cell = Cell(method, r["batch"], r["lr"], r["seed"], r.get("warmup"))
        outcomes.append(Outcome(cell, r["returncode"], r["epochs"],
                                r.get("wall_seconds", 0.0), command, r.get("error", "")))
    return outcomes


def preset_of_their_time(recorded: dict[str, Any]) -> list[str] | None:
    """The flags --kfac-preset large-batch stood for when a results file was written (its meta["kfac_preset"]), or
    None when that is today's preset (or the record is empty or absent)."""
    values = {key: value for key, value in recorded.items() if key != "label"}
    return None if not values or values == RECORDED_PRESET else preset_flags(values)


def preset_flags(values: dict[str, Any]) -> list[str]:
    """hpcdl.train's flags for the preset's values as a results file records them (RECORDED_PRESET's keys; an
    absent key is a value the preset of that time did not set)."""
    names = dict(factors="--kfac-factor-update-freq", inverse="--kfac-inv-update-freq", damping="--kfac-damping",
                 kl_clip="--kfac-kl-clip", factor_examples="--kfac-factor-examples", momentum="--momentum",
                 fraction="--kfac-grad-worker-fraction", method="--kfac-method")
    flags = ["--kfac"]
    for key, flag in names.items():
        if values.get(key) is not None:
            flags += [flag, str(values[key])]
    return flags


# What a K-FAC run's label names when it differs from the study's own settings for its batch.
LABELS = {"kfac_factor_examples": "stats of {} examples", "momentum": "momentum {}", "kfac_damping": "d {}",
          "kfac_kl_clip": "clip {}", "kfac_inv_update_freq": "inv every {}",
          "kfac_factor_update_freq": "factors every {}", "kfac_factor_decay": "decay {}", "weight_decay": "wd {}",
          "kfac_grad_worker_fraction": "fraction {}", "kfac_method": "{}"}


def kfac_label(command: Sequence[str], batch: int, preset_flags: Sequence[str] | None = None,
               name: str = "kfac") -> str:
    """``name`` ("kfac", or a results file's label for its runs), plus what an hpcdl K-FAC run's settings (its
    command, by hpcdl.train's parser) have apart from the study's at ``batch``: the preset above 512 (``preset_flags``:
    what it stood for in the run's time, when not today's), the batch-128 study's settings up to it."""
    config = parse_config(list(command[command.index("hpcdl.train") + 1:]))
    if batch > 512:
        reference_flags = list(preset_flags) if preset_flags is not None else ["--kfac-preset", "large-batch"]
    else:
        small = kfac_settings(batch)
        reference_flags = ["--kfac", "--kfac-factor-update-freq", str(small["factors"]),
                           "--kfac-inv-update-freq", str(small["inverse"]), "--kfac-damping", repr(small["damping"]),
                           "--kfac-kl-clip", repr(small["kl_clip"])]
    reference = parse_config([*reference_flags, "--weight-decay", "5e-4"])
    parts = [name]
    for name, text in LABELS.items():
        value = getattr(config, name)
        if value != getattr(reference, name):
            parts.append(text.format("all" if value is None else value if isinstance(value, str) else f"{value:g}"))
    if config.warmup_start_factor not in (None, 1.0):
        parts.append(f"ramp from {config.warmup_start_factor:g}x")
    return " ".join(parts)


def method_order(method: str) -> int:
    return METHODS.index(method) if method in METHODS else len(METHODS)


def kept_outcomes(out: Path) -> list[Outcome]:
    """The successful runs of an earlier (possibly interrupted) study at ``out``."""
    path = outputs.output_file(out, ".json")
    return [o for o in load_outcomes(path) if o.returncode == 0] if path.exists() else []


def check_kept(kept: Sequence[Outcome], args: argparse.Namespace) -> None:
    """Refuses (studies.refuse_changed) a kept run whose recorded command is not the one this study would run for it
    now; runs the study can no longer name (ablations labelled by their --kfac-flags) are carried as they are."""
    for outcome in kept:
        if outcome.cell.method in METHODS:
            studies.refuse_changed(args.out, outcome.cell.name, outcome.command,
                                   train_command(outcome.cell, args, Path("run")))


def markdown(outcomes: Sequence[Outcome]) -> list[str]:
    """The summary as a markdown table's lines (medians over seeds; times are training seconds, evaluation excluded)."""
    rows = []
    for r in sorted(summarise(outcomes), key=lambda r: (r["batch"], method_order(r["method"]), r["method"], r["lr"])):
        each = ", ".join("failed" if a is None else f"{100 * a:.2f}" for a in r["final_accuracy"])
        to = [f"not reached ({r[f'reached_{k}']})" if r[f"steps_{k}"] is None
              else f"{r[f'steps_{k}']:.0f} / {r[f'seconds_{k}']:.0f} ({r[f'reached_{k}']})" for k in ("98.5", "99.0")]
        rate = f"{r['lr']:g}" + (f" (warm-up {r['warmup']:g})" if "warmup" in r else "")
        rows.append((r["batch"], r["method"], rate, r["seeds"], f"{100 * (r['median_final'] or 0):.2f} % ({each})",
                     *to, f"{r['seconds_per_step'] or 0:.2f}"))
    return table(["global batch", "method", "peak lr", "seeds", "final accuracy (median; each seed)",
                  "steps / s to 98.5 %", "steps / s to 99.0 %", "s per step"], rows).strip("\n").split("\n")


def report(sources: Sequence[str], out: Path) -> int:
    """The table, verdict and plot of results files together; ``FILE@128,512`` takes only those batches of FILE."""
    def read(name: str) -> dict[str, Any]:
        return json.loads(Path(name).read_text())

    outcomes = [o for source in sources for o in selected(source, read)]
    print("\n".join(markdown(outcomes)))
    print("\n".join(verdict(outcomes)))
    loads = [read(source.partition("@")[0])["meta"] for source in sources]
    low, high = min(m["load_before"] for m in loads), max(m.get("load_after", m["load_before"]) for m in loads)
    plot(outcomes, out, f"MNIST mnist_cnn, 5 epochs, 1 rank, CPU; load average {low:.0f}-{high:.0f} (shared machine)")
    print(f"plot: {outputs.output_file(out, '.png')}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.install_kfac_pytorch:
        return kfac_pytorch_adapter.install(args.install_kfac_pytorch, args.kfac_pytorch_site)
    if args.report:
        return report(args.report, output_stem(args))
    if args.reduced:
        cells = reduced_cells(args.methods, args.batches or REDUCED_BATCHES, args.seeds[0])
    elif args.target_cell and args.tuned_from:
        tuning = load_outcomes(args.tuned_from)
        tuned = {c.method: c for c in tuned_settings(tuning, tuning_seed(tuning, args.tuned_from))}
        missing = [m for m in args.methods if m not in tuned]
        if missing:
            raise UsageError(f"--tuned-from {args.tuned_from} has no tuning runs of {', '.join(missing)}")
        cells = [Cell(m, b, tuned[m].lr, s, tuned[m].warmup) for b in args.batches or (4096,) for s in args.seeds
                 for m in args.methods]
    elif args.target_cell:
        rates = target_rates(args)
        cells = [Cell(m, b, rates[m], s) for b in args.batches or (4096,) for s in args.seeds for m in args.methods]
    elif args.tune:
        cells = tune_cells(args.methods, args.batches or (4096,), args.seeds[0])
    else:
        cells = full_cells(args.methods, args.batches or FULL_BATCHES, args.seeds)
    if args.dry_run:
        scratch = Path(tempfile.gettempdir()) / "kfac_large_batch"
        for cell in cells:
            print(" ".join(train_command(cell, args, scratch / cell.name)))
        return 0
    for cell in cells:  # every run's flags, by hpcdl.train's own parser, before the first run
        studies.check_flags(train_flags(cell, args))
    studies.check_launch(args.ranks, args.vcluster, args.threads)
    args.out = output_stem(args)
    kept = kept_outcomes(args.out) if args.keep else []
    check_kept(kept, args)
    load = os.getloadavg()[0]
    print(f"{len(cells)} runs, {args.jobs} at a time, {args.threads} thread(s) each; load average {load:.1f}",
          flush=True)
    start = time.perf_counter()
    meta: dict[str, Any] = dict(
        epochs=args.epochs, warmup_epochs=args.warmup_epochs, dataset=args.dataset, model=args.model, jobs=args.jobs,
        threads=args.threads, load_before=load, max_steps=args.max_steps, damping=args.damping, kl_clip=args.kl_clip,
        evals_per_epoch=args.evals_per_epoch, ranks=args.ranks, vcluster=args.vcluster, backend=args.backend,
        kfac_preset=RECORDED_PRESET,
        argv=sys.argv[1:] if argv is None else list(argv), planned=len(cells))
    if kept:  # the kept runs' own provenance (argv, load, seconds) stays beside this run's
        meta["kept_from"] = json.loads(outputs.output_file(args.out, ".json").read_text()).get("meta", {})
    done = {o.cell for o in kept}
    todo = [c for c in cells if c not in done]
    if args.keep:
        print(f"{len(cells) - len(todo)} of them already in {outputs.output_file(args.out, '.json')}", flush=True)
    saved = {"runs": len(kept)}

    def save(outcomes: Sequence[Outcome]) -> None:
        write_results(outcomes, args.out, meta)
        saved["runs"] = len(outcomes)

    try:
        with studies.session("kfac_large_batch") as scratch:
            outcomes = kept + run_cells(todo, args, scratch, lambda new: save(kept + new))  # saved as they end
            if args.tune:  # the second phase: each method's best setting on the other seeds
                chosen = [Cell(c.method, c.batch, c.lr, s, c.warmup) for c in tuned_settings(outcomes, args.seeds[0])
                          for s in args.seeds[1:]]
                first = list(outcomes)
                meta["planned"] = len(cells) + len(chosen)
                outcomes = first + run_cells([c for c in chosen if c not in done], args, scratch,
                                             lambda new: save(first + new))
    except studies.StudyStopped as stop:
        return studies.stopped("kfac_large_batch", stop, saved["runs"], args.out)
    meta.update(load_after=os.getloadavg()[0], seconds=time.perf_counter() - start)
    write_results(outcomes, args.out, meta)
    where = f"{args.ranks} ranks on {args.vcluster}" if args.vcluster else f"{args.ranks} rank(s)"
    plot(outcomes, args.out, f"{args.dataset} {args.model}, {args.epochs} epochs, {where}, CPU, {args.jobs} runs at a "
                             f"time; load average {meta['load_before']:.1f} -> {meta['load_after']:.1f}")
    for batch in sorted({o.cell.batch for o in outcomes}, reverse=True):
        for line in verdict(outcomes, batch):
            print(line)
    print(f"results: {args.out}.{{json,png}} ({meta['seconds']:.0f} s)")  # each <stem><suffix>
    return 0 if all(o.returncode == 0 for o in outcomes) else 1


if __name__ == "__main__":
    run_main(main, program="kfac_large_batch")
