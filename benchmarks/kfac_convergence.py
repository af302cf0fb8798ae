"""Time and epochs to a test-accuracy target: tuned SGD against SGD preconditioned by K-FAC, each run
a ``python -m hpcdl.train`` process (the one training application: the study measures what users run).

    python -m hpcdl.fetch_mnist                                             # once: real MNIST
    nice -n 5 .venv/bin/python benchmarks/kfac_convergence.py --dataset mnist                  # 1 rank
    .venv/bin/python benchmarks/kfac_convergence.py --dataset mnist --ranks 2                  # each run under mpirun
    .venv/bin/python benchmarks/kfac_convergence.py                                           # digits (a minute)

Every run trains the same model at the same global batch with momentum SGD (0.9) and a cosine
decay over the same budget, no warm-up; K-FAC runs add ``--kfac`` and its settings. The study sweeps
SGD's learning rate and K-FAC's learning rate, damping, update frequencies and skipped layers, with
several seeds, and runs SGD and K-FAC settings alternately within each seed (reversed on every other
seed, :func:`studies.interleaved`), so that a machine shared with other jobs slows both
alike. Test accuracy is measured several times per epoch (``--eval-every``); time is hpcdl.train's
training time (evaluation excluded). Results: benchmarks/results/kfac_convergence_<dataset>[_np<ranks>]
.{json,png}; the verdict pairs the best SGD setting with the best K-FAC setting seed by seed
(docs/kfac.md, "When K-FAC pays off"). Where a K-FAC step's time goes is benchmarks/kfac_overhead.py's.

The results are saved after every run; a run that fails is recorded as failed and the study goes on (exit 1
at the end). Ctrl-C or SIGTERM ends the study in one line, its runs and scratch folder with it; the same
command with ``--keep`` then runs only what is missing, keeping a recorded run only when its command is the
one the study would run now (otherwise one line names the setting that differs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from figures import figure, percent, results, save_json, table, times  # noqa: E402
from studies import (  # noqa: E402
    StudyStopped,
    TrainRun,
    add_results_arguments,
    check_flags,
    check_launch,
    check_mnist,
    first_reaching,
    interleaved,
    median_or_inf,
    parse_study_args,
    refuse_changed,
    run_train,
    session,
    stopped,
    train_command,
)

from hpcdl.persistence import outputs  # noqa: E402
from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import UsageError, run_main  # noqa: E402
from hpcdl.runtime.numbers import integer, real  # noqa: E402
from hpcdl.tools.fetch_mnist import DEFAULT_OUTPUT as DEFAULT_MNIST_DIR  # noqa: E402

TRAIN_EXAMPLES = {"digits": 1437, "mnist": 60_000, "cifar10": 50_000}  # digits: sklearn's set less its test fifth
__all__ = ["first_reaching", "interleaved", "median_or_inf"]  # the shared rules, re-exported for the tests


@dataclass(frozen=True)
class Setting:
    """One optimiser configuration of the sweep; K-FAC fields are unused for SGD."""

    lr: float
    kfac: bool = False
    damping: float = 0.01
    factor_freq: int = 1
    inv_freq: int = 10
    skip: tuple[str, ...] = ()
    kl_clip: float = 0.001

    @property
    def name(self) -> str:
        if not self.kfac:
            return f"SGD lr={self.lr:g}"
        skip = f" skip={'+'.join(self.skip)}" if self.skip else ""
        return f"K-FAC lr={self.lr:g} d={self.damping:g} f={self.factor_freq}/{self.inv_freq}{skip}"

    def flags(self) -> list[str]:
        """The hpcdl.train flags of this setting (the learning rate aside: it depends on the ranks)."""
        if not self.kfac:
            return []
        flags = ["--kfac", "--kfac-damping", repr(self.damping), "--kfac-factor-update-freq", str(self.factor_freq),
                 "--kfac-inv-update-freq", str(self.inv_freq), "--kfac-kl-clip", repr(self.kl_clip)]
        return flags + (["--kfac-skip-layers", *self.skip] if self.skip else [])


def parse_kfac_setting(text: str) -> Setting:
    """``lr=0.05,damping=0.01,factors=10,inverse=100[,skip=a+b][,kl_clip=0.001]``."""
    fields: dict[str, Any] = {"kfac": True}
    keys = {"lr": ("lr", float), "damping": ("damping", float), "factors": ("factor_freq", int),
            "inverse": ("inv_freq", int), "kl_clip": ("kl_clip", float)}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            if key == "skip":
                fields["skip"] = tuple(filter(None, value.split("+")))
            else:
                attribute, convert = keys[key]
                fields[attribute] = convert(value)
        except (KeyError, ValueError) as exc:
            raise UsageError(
                f"--kfac {text!r}: bad item {item!r} (keys: lr, damping, factors, inverse, skip, kl_clip)") from exc
    if "lr" not in fields:
        raise UsageError(f"--kfac {text!r}: lr= is required")
    return Setting(**fields)


@dataclass
class Recipe:
    model: str
    batch_size: int  # global batch, whatever the number of ranks
    weight_decay: float
    epochs: int
    target: float
    evals_per_epoch: int
    sgd_lrs: list[float]
    kfac: list[str] = field(default_factory=list)


RECIPES = {
    "digits": Recipe("digits_cnn", 32, 1e-4, 10, 0.97, 1, [0.02, 0.05], ["lr=0.02,damping=0.01,factors=1,inverse=10"]),
    # The MNIST grid was chosen with a one-seed pilot on this machine (docs/kfac.md, "When K-FAC pays off").
    "mnist": Recipe("mnist_cnn", 128, 5e-4, 3, 0.99, 4, [0.025, 0.05, 0.1],
                    ["lr=0.1,damping=0.1,factors=10,inverse=100",
                     "lr=0.1,damping=0.1,factors=10,inverse=100,skip=classifier.1"]),
    "cifar10": Recipe("resnet32", 128, 5e-4, 20, 0.80, 1, [0.1], ["lr=0.1,damping=0.01,factors=10,inverse=100"]),
}


# ---------------------------------------------------------------- one run: hpcdl.train's flags and metrics
def train_flags(setting: Setting, seed: int, recipe: Recipe, dataset: str, data_dir: Path | None,
                ranks: int, device: str = "auto") -> list[str]:
    """hpcdl.train's flags for one run. The global batch and peak rate are the recipe's on any number of
    ranks: each rank takes batch/ranks, and hpcdl.train scales --base-lr by the ranks."""
    steps_per_epoch = TRAIN_EXAMPLES[dataset] // recipe.batch_size
    flags = ["--dataset", dataset, "--model", recipe.model, "--epochs", str(recipe.epochs),
             "--batch-size", str(recipe.batch_size // ranks), "--base-lr", repr(setting.lr / ranks),
             "--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", repr(recipe.weight_decay),
             "--lr-schedule", "cosine", "--warmup-epochs", "0", "--seed", str(seed), "--device", device]
    if recipe.evals_per_epoch > 1:
        flags += ["--eval-every", str(max(1, round(steps_per_epoch / recipe.evals_per_epoch)))]
    if data_dir is not None:
        flags += ["--data-dir", str(data_dir)]
    return flags + setting.flags()


def outcome(run: TrainRun, seed: int, target: float) -> dict[str, Any]:
    """A run as the study records it: its accuracy curve and when it first reached ``target``; a run that failed
    is recorded as failed (its exit status and last lines), and the study goes on."""
    points = [{"epoch": float(r["epoch"]), "accuracy": r["test_accuracy"], "seconds": r["train_seconds"]}
              for r in run.rows]
    failed = run.returncode != 0 or not run.rows
    hit = None if failed else first_reaching(points, target)
    return {
        "seed": seed,
        "points": points,
        "epochs_to_target": None if hit is None else hit["epoch"],
        "seconds_to_target": None if hit is None else hit["seconds"],
        "final_accuracy": None if failed else points[-1]["accuracy"],
        "train_seconds": None if failed else points[-1]["seconds"],
        "wall_seconds": run.wall_seconds,  # the whole process: start-up, data, evaluation
        "steps": run.rows[-1]["global_step"] if run.rows else None,
        "command": run.command,
        "returncode": run.returncode,
        "failed": failed,
        "error": run.log_tail if failed else "",
    }


# ---------------------------------------------------------------- summaries and the verdict (pure, tested)
def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over seeds; a failed run never reached the target and counts as accuracy 0."""
    reached = [r for r in runs if r["epochs_to_target"] is not None]
    finished = [r for r in runs if not r.get("failed")]
    return {
        "reached": f"{len(reached)}/{len(runs)}",
        "failed": len(runs) - len(finished),
        "median_epochs_to_target": median_or_inf([r["epochs_to_target"] for r in runs]),
        "median_seconds_to_target": median_or_inf([r["seconds_to_target"] for r in runs]),
        "final_accuracy_mean": statistics.mean(r["final_accuracy"] or 0.0 for r in runs),
        "median_train_seconds_per_epoch": statistics.median(r["train_seconds"] / r["points"][-1]["epoch"]
                                                            for r in finished) if finished else None,
    }


def best(settings: dict[str, dict[str, Any]], kfac: bool) -> str | None:
    """The setting of one kind with the lowest median seconds to target (then epochs, then accuracy)."""
    names = [n for n, s in settings.items() if s["kfac"] == kfac]
    if not names:
        return None
    return min(names, key=lambda n: (settings[n]["median_seconds_to_target"], settings[n]["median_epochs_to_target"],
                                     -settings[n]["final_accuracy_mean"]))


def verdict(settings: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Per seed, the best K-FAC setting against the best SGD setting (they ran side by side)."""
    sgd_name, kfac_name = best(settings, False), best(settings, True)
    if sgd_name is None or kfac_name is None:
        return None
    sgd_runs = {r["seed"]: r for r in settings[sgd_name]["runs"]}
    pairs = []
    for k in settings[kfac_name]["runs"]:
        s = sgd_runs.get(k["seed"])
        if s is None:  # a study stopped before this seed's SGD run
            continue

        def ratio(key: str, k: dict = k, s: dict = s) -> float | None:
            return None if k[key] is None or s[key] is None else k[key] / s[key]

        pairs.append({"seed": k["seed"], "sgd_epochs": s["epochs_to_target"], "kfac_epochs": k["epochs_to_target"],
                      "sgd_seconds": s["seconds_to_target"], "kfac_seconds": k["seconds_to_target"],
                      "wall_ratio": ratio("seconds_to_target"), "epoch_ratio": ratio("epochs_to_target")})
    sgd_cost = settings[sgd_name]["median_train_seconds_per_epoch"]
    kfac_cost = settings[kfac_name]["median_train_seconds_per_epoch"]
    both = sgd_cost is not None and kfac_cost is not None  # None: every run of one of them failed
    fewer = all(p["kfac_epochs"] is not None and (p["sgd_epochs"] is None or p["kfac_epochs"] < p["sgd_epochs"])
                for p in pairs)
    return {
        "best_sgd": sgd_name,
        "best_kfac": kfac_name,
        "pairs": pairs,
        "median_wall_ratio": median_or_inf([p["wall_ratio"] for p in pairs]),
        "kfac_faster_in_wall_time": settings[kfac_name]["median_seconds_to_target"]
        < settings[sgd_name]["median_seconds_to_target"],
        "kfac_fewer_epochs_every_seed": fewer,
        # K-FAC pays off in wall time when its epochs to target are fewer than SGD's by more than
        # this factor: the ratio of their training costs per epoch.
        "cost_per_epoch_ratio": kfac_cost / sgd_cost if both else None,
        "break_even_epoch_ratio": sgd_cost / kfac_cost if both else None,
    }


# ---------------------------------------------------------------- results
def plot(report: dict[str, Any], out: Path) -> None:
    with figure(out, 1, 2, figsize=(11, 4.2), sharey=True) as (fig, axes):
        sgd_colours = iter(["tab:gray", "tab:blue", "tab:cyan", "tab:purple", "black"])
        kfac_colours = iter(["tab:orange", "tab:green", "tab:red", "tab:olive", "tab:brown", "tab:pink"])
        lowest = 1.0
        for name, setting in report["settings"].items():
            colour = next(kfac_colours if setting["kfac"] else sgd_colours, "black")
            for i, run in enumerate(setting["runs"]):
                accuracy = [p["accuracy"] for p in run["points"]]
                lowest = min([lowest, *accuracy])  # a failed run may have no point
                style = dict(color=colour, alpha=0.8, marker=".", linestyle="-" if setting["kfac"] else "--",
                             label=name if i == 0 else None)
                axes[0].plot([p["epoch"] for p in run["points"]], accuracy, **style)
                axes[1].plot([p["seconds"] for p in run["points"]], accuracy, **style)
        for ax in axes:
            ax.axhline(report["target"], color="tab:red", linestyle=":", linewidth=1)
            ax.grid(alpha=0.3)
        axes[0].set_ylim(max(lowest - 0.002, report["target"] - 0.03), 1.0 if report["target"] < 0.99 else 0.995)
        axes[0].set_xlabel("epoch")
        axes[1].set_xlabel(f"hpcdl.train's training seconds ({report['ranks']} rank(s) x {report['threads']} "
                           "thread(s))")
        axes[0].set_ylabel("test accuracy")
        axes[0].legend(loc="lower right", fontsize=7)
        fig.suptitle(f"{report['dataset']}: SGD vs K-FAC (python -m hpcdl.train), target {report['target']:.1%} "
                     f"(dotted), {len(report['seeds'])} seed(s) each")


def write(report: dict[str, Any], out: Path, png: bool = True) -> list[str]:
    """STEM.json (everything) and STEM.png (the study's end: ``png``), each replaced whole; returns the table
    printed."""
    save_json(out, report, indent=2)
    if png:
        plot(report, out)
    table = [f"{'setting':<58} reached  epochs  seconds   final  s/epoch"]
    for name, s in report["settings"].items():
        per_epoch = s["median_train_seconds_per_epoch"]
        table.append(f"{name:<58} {s['reached']:>7} {s['median_epochs_to_target']:>7.2f} "
                     f"{s['median_seconds_to_target']:>8.1f} {s['final_accuracy_mean']:>7.4f} "
                     + ("  failed" if per_epoch is None else f"{per_epoch:>8.1f}"))
    return table


# ---------------------------------------------------------------- the study
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog="benchmarks/kfac_convergence.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dataset", choices=sorted(RECIPES), default="digits")
    parser.add_argument("--data-dir", type=Path, default=None, help=f"MNIST IDX folder (default {DEFAULT_MNIST_DIR})")
    parser.add_argument("--epochs", type=integer(1), default=None, help="budget (default: the recipe's)")
    parser.add_argument("--target", type=real(0, low_open=True, high=1), default=None,
                        help="test accuracy to reach, a fraction (default: the recipe's)")
    parser.add_argument("--seeds", type=integer(0), nargs="+", default=[0, 1, 2])
    parser.add_argument("--batch-size", type=integer(1), default=None, help="global batch (default: the recipe's)")
    parser.add_argument("--evals-per-epoch", type=integer(1), default=None)
    parser.add_argument("--sgd-lrs", type=real(0, low_open=True), nargs="*", default=None,
                        help="SGD learning rates of the sweep")
    parser.add_argument("--kfac", nargs="*", default=None, metavar="lr=..,damping=..,factors=..,inverse=..[,skip=..]",
                        help="K-FAC settings of the sweep")
    parser.add_argument("--ranks", type=integer(1), default=1, help="ranks of each run (mpirun -np; default 1)")
    parser.add_argument("--threads", type=integer(1), default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="hpcdl.train's --device")
    add_results_arguments(parser, "kfac_convergence_", run_timeout=7200.0)
    return parse_study_args(parser, argv)


def recipe_of(args: argparse.Namespace) -> Recipe:
    base = RECIPES[args.dataset]
    return Recipe(base.model, args.batch_size or base.batch_size, base.weight_decay, args.epochs or base.epochs,
                  args.target or base.target, args.evals_per_epoch or base.evals_per_epoch,
                  base.sgd_lrs if args.sgd_lrs is None else args.sgd_lrs, base.kfac if args.kfac is None else args.kfac)


def study(args: argparse.Namespace, out: Path, scratch: Path, saved: dict[str, int]) -> dict[str, Any]:
    """Every (setting, seed) run, alternating; checks every run's flags (and --keep's runs) before the first starts,
    and saves STEM.json after every run (``saved["runs"]`` counts what is in them)."""
    recipe = recipe_of(args)
    if recipe.batch_size % args.ranks:
        raise UsageError(f"--batch-size {recipe.batch_size} is the global batch: it must divide by --ranks "
                         f"{args.ranks}")
    settings = [Setting(lr) for lr in recipe.sgd_lrs] + [parse_kfac_setting(text) for text in recipe.kfac]
    if not settings:
        raise UsageError("nothing to run: give --sgd-lrs or --kfac")
    data_dir = check_mnist(args.data_dir) if args.dataset == "mnist" else args.data_dir
    plan = interleaved([s for s in settings if not s.kfac], [s for s in settings if s.kfac], args.seeds)
    commands = {(s, seed): train_flags(s, seed, recipe, args.dataset, data_dir, args.ranks, args.device)
                for s, seed in plan}
    for flags in commands.values():
        check_flags(flags)
    check_launch(args.ranks, None, args.threads)
    runs: dict[Setting, list[dict[str, Any]]] = defaultdict(list)
    for setting, run in kept_runs(out, args) if args.keep else []:
        now = train_command(train_flags(setting, run["seed"], recipe, args.dataset, data_dir, args.ranks,
                                        args.device), args.ranks, None, args.threads)
        refuse_changed(out, f"{setting.name} seed {run['seed']}", run["command"], now)
        runs[setting].append(run)
    done = {(s, r["seed"]) for s, kept in runs.items() for r in kept}
    todo = [(s, seed) for s, seed in plan if (s, seed) not in done]
    print(f"{args.dataset}: {recipe.model}, global batch {recipe.batch_size}, {recipe.epochs} epochs, target "
          f"{recipe.target:.1%}, {args.ranks} rank(s) x {args.threads} thread(s); {len(todo)} runs of "
          f"python -m hpcdl.train" + (f" ({len(plan) - len(todo)} kept from {outputs.output_file(out, '.json')})"
                                      if args.keep else ""), flush=True)
    started = time.perf_counter()
    for n, (setting, seed) in enumerate(todo, 1):
        run = run_train(commands[setting, seed], scratch / f"run{n}", ranks=args.ranks, threads=args.threads,
                        timeout=args.run_timeout)
        result = outcome(run, seed, recipe.target)
        runs[setting].append(result)
        line = (f"FAILED (exit {result['returncode']}): {result['error'].splitlines()[-1] if result['error'] else ''}"
                if result["failed"] else
                f"final {result['final_accuracy']:.4f}, target at epoch {result['epochs_to_target']} / "
                f"{result['seconds_to_target']} s, {result['train_seconds']:.1f} s training")
        print(f"[{n}/{len(todo)}] {setting.name} seed {seed}: {line} (study {time.perf_counter() - started:.0f} s "
              "so far)", flush=True)
        write(report_of(args, recipe, plan, runs, started), out, png=False)
        saved["runs"] = sum(len(r) for r in runs.values())
    return report_of(args, recipe, plan, runs, started)


def kept_runs(out: Path, args: argparse.Namespace) -> list[tuple[Setting, dict[str, Any]]]:
    """The finished runs of an earlier (maybe interrupted) study at ``out``, each with its setting."""
    path = outputs.output_file(out, ".json")
    if not path.exists():
        return []
    try:
        report = json.loads(path.read_text())
        kept = [(Setting(**{**{k: v for k, v in fields.items() if k in Setting.__dataclass_fields__},
                            "skip": tuple(fields.get("skip", ()))}), run)
                for fields in report["settings"].values() for run in fields["runs"] if not run.get("failed")]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UsageError(f"--keep: {path} is not a results file of this study") from None
    if report.get("dataset") != args.dataset:
        raise UsageError(f"--keep: {path} holds a study of {report.get('dataset')}, not of {args.dataset}")
    return kept


def report_of(args: argparse.Namespace, recipe: Recipe, plan: Sequence[tuple[Setting, int]],
              runs: dict[Setting, list[dict[str, Any]]], started: float) -> dict[str, Any]:
    """The results file's content for the runs so far (every setting that has any, in the plan's order first)."""
    report: dict[str, Any] = {
        "dataset": args.dataset, "model": recipe.model, "target": recipe.target, "epochs": recipe.epochs,
        "batch_size": recipe.batch_size, "weight_decay": recipe.weight_decay, "momentum": 0.9,
        "schedule": "hpcdl.train --lr-schedule cosine --warmup-epochs 0", "evals_per_epoch": recipe.evals_per_epoch,
        "seeds": args.seeds, "ranks": args.ranks, "threads": args.threads, "device": args.device,
        "trainer": "python -m hpcdl.train",
        "order": [f"{s.name} seed {seed}" for s, seed in plan], "load_average_at_end": os.getloadavg(),
        "study_seconds": time.perf_counter() - started, "settings": {},
        "planned": len(plan), "finished": sum(not r.get("failed") for rs in runs.values() for r in rs),
    }
    ordered = list(dict.fromkeys([s for s, _ in plan] + list(runs)))
    for setting in ordered:
        if runs.get(setting):
            report["settings"][setting.name] = {**asdict(setting), "skip": list(setting.skip),
                                                **summarise(runs[setting]), "runs": runs[setting]}
    report["verdict"] = verdict(report["settings"])
    return report


def main(argv: Sequence[str] | None = None) -> int:
    saved = {"runs": 0}
    args = parse_args(argv)
    suffix = "" if args.ranks == 1 else f"_np{args.ranks}"
    out = outputs.results_stem(args.out, f"kfac_convergence_{args.dataset}{suffix}", (".json", ".png"),
                               refresh_results=args.refresh_results, force=args.force or args.keep, flag="--out")
    try:
        with session("kfac_convergence") as scratch:
            report = study(args, out, scratch, saved)
    except StudyStopped as stop:
        return stopped("kfac_convergence", stop, saved["runs"], out)
    print("\n".join(write(report, out)))
    v = report["verdict"]
    if v:
        ratio = v["cost_per_epoch_ratio"]
        cost = "" if ratio is None else f"K-FAC costs {ratio:.2f}x an SGD epoch; "
        print(f"best SGD: {v['best_sgd']}; best K-FAC: {v['best_kfac']}; K-FAC/SGD time to target per seed "
              f"(median): {v['median_wall_ratio']:.2f}x; {cost}fewer epochs in every seed: "
              f"{v['kfac_fewer_epochs_every_seed']}")
    failed = sum(s["failed"] for s in report["settings"].values())
    print(f"wrote {out}.json/.png" + (f"; {failed} run(s) FAILED (errors in the .json)" if failed else ""))
    return 1 if failed else 0


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

def _digits_table() -> str:
    r = results("kfac_convergence_digits")
    return table(["setting", f"seeds reaching {100 * r['target']:.0f} %", "median epochs", "median seconds",
                  "mean final accuracy"],
                 [(name, s["reached"], f"{s['median_epochs_to_target']:g}", f"{s['median_seconds_to_target']:.1f}",
                   f"{s['final_accuracy_mean']:.3f}") for name, s in r["settings"].items()])


def _digits_verdict() -> str:
    s = results("kfac_convergence_digits")["settings"]
    kfac = next(v for v in s.values() if v["kfac"])  # named by all its settings since the study runs hpcdl.train
    sgd, fast = s["SGD lr=0.02"], s["SGD lr=0.05"]
    return (f"K-FAC {kfac['median_epochs_to_target']:g} epochs ({kfac['median_seconds_to_target']:.1f} s) vs SGD "
            f"{sgd['median_epochs_to_target']:g} epochs ({sgd['median_seconds_to_target']:.1f} s); SGD at 2.5× the "
            f"lr: {fast['median_epochs_to_target']:g} epochs")


def _finite(value: float, form: str) -> str:
    """A median over seeds where a seed that never got there counts as infinite."""
    return format(value, form) if value != float("inf") else "not reached"


def _mnist_table() -> str:
    settings = results("kfac_convergence_mnist")["settings"]
    return table(["setting", "seeds reaching 99.0 %", "median epochs to 99.0 %", "median training s to 99.0 %",
                  "mean final accuracy", "training s / epoch"],
                 [(setting, s["reached"], _finite(s["median_epochs_to_target"], ".2f"),
                   _finite(s["median_seconds_to_target"], ".1f"), percent(s["final_accuracy_mean"]),
                   f"{s['median_train_seconds_per_epoch']:.1f}") for setting, s in settings.items()])


def _mnist_pairs() -> str:
    v = results("kfac_convergence_mnist")["verdict"]

    def epochs(value: float | None) -> str:
        return "not reached" if value is None else f"{value:g}"

    seeds = "; ".join(f"seed {p['seed']}: {epochs(p['sgd_epochs'])} vs {epochs(p['kfac_epochs'])} epochs, "
                      + ("-" if p["wall_ratio"] is None else times(p["wall_ratio"])) + " the training time"
                      for p in v["pairs"])
    return (f"{seeds}. Median: **{times(v['median_wall_ratio'])} the training time**; a K-FAC epoch cost "
            f"{times(v['cost_per_epoch_ratio'])} an SGD epoch (wall)")


def _budget(name: str) -> tuple[str, str]:
    s = results(name)["settings"]
    cells = []
    for kfac in (False, True):
        entry = next(e for e in s.values() if e["kfac"] == kfac)
        finals = [run["final_accuracy"] for run in entry["runs"]]
        cells.append(f"{percent(entry['final_accuracy_mean'])}, {sum(f >= 0.99 for f in finals)}/{len(finals)}")
    return cells[0], cells[1]


def _budgets() -> str:
    rows = [(f"{n} epoch{'s' if n > 1 else ''}", *_budget(f"kfac_convergence_mnist_budget{n}")) for n in (1, 2)]
    return table(["budget", "SGD lr 0.05: final accuracy (mean), seeds ≥ 99.0 %",
                  "K-FAC: final accuracy (mean), seeds ≥ 99.0 %"], rows)


def _profile() -> str:
    rows = []
    for name, e in results("kfac_convergence_mnist_profile")["settings"].items():
        ms = e["ms_per_step"]
        kfac_wall = sum(ms.get(p + "_wall", 0.0) for p in ("factors", "decompositions", "precondition"))
        rows.append((name, f"{ms['step_cpu']:.1f}", times(e.get("cost_vs_sgd_cpu", 1.0)),
                     f"{ms['forward_backward_cpu']:.1f}", f"{ms.get('kfac_step_cpu', 0.0):.1f}",
                     f"{ms.get('precondition_wall', 0.0):.1f} of {kfac_wall:.1f}"))
    return table(["setting", "CPU ms / step", "vs SGD", "forward+backward (CPU)", "K-FAC `step()` (CPU)",
                  "of which preconditioning (wall)"], rows)


def _kfac_gain() -> str:
    """How many points unskipped K-FAC ended above the best SGD, over every budget and rank count run."""
    gains = []
    for name in ("kfac_convergence_mnist", "kfac_convergence_mnist_np2", "kfac_convergence_mnist_budget1",
                 "kfac_convergence_mnist_budget2"):
        settings = results(name)["settings"].values()
        sgd = max(s["final_accuracy_mean"] for s in settings if not s["kfac"])
        kfac = max(s["final_accuracy_mean"] for s in settings if s["kfac"] and not s.get("skip"))
        gains.append(100 * (kfac - sgd))
    return f"{min(gains):.2f}–{max(gains):.2f} points"


def _profile_range() -> str:
    costs = [e["cost_vs_sgd_cpu"] for e in results("kfac_convergence_mnist_profile")["settings"].values() if e["kfac"]]
    return f"{min(costs):.1f}–{max(costs):.1f}×"


FIGURES = {
    "digits.table": _digits_table, "digits.verdict": _digits_verdict, "mnist1.table": _mnist_table,
    "mnist1.pairs": _mnist_pairs, "mnist.budgets": _budgets, "mnist.profile": _profile, "mnist.kfac_gain": _kfac_gain,
    "mnist.profile_range": _profile_range,
    "mnist1.wall": lambda: times(results("kfac_convergence_mnist")["verdict"]["median_wall_ratio"]),
    "mnist2.wall": lambda: times(results("kfac_convergence_mnist_np2")["verdict"]["median_wall_ratio"]),
    "mnist.profile_10_100": lambda: times(results("kfac_convergence_mnist_profile")["settings"]
                                          ["K-FAC lr=0.1 d=0.1 f=10/100"]["cost_vs_sgd_cpu"], 1),
}


if __name__ == "__main__":
    run_main(main, program="kfac_convergence")
