"""Time and epochs to a test-accuracy target: tuned SGD against SGD preconditioned by K-FAC, each run
a ``python -m hpcdl.train`` process (the one training application: the study measures what users run).

    python -m hpcdl.fetch_mnist                                             # once: real MNIST into ${XDG_CACHE_HOME:-~/.cache}/hpcdl/mnist
    nice -n 5 .venv/bin/python benchmarks/kfac_convergence.py --dataset mnist                  # 1 rank
    .venv/bin/python benchmarks/kfac_convergence.py --dataset mnist --ranks 2                  # each run under mpirun
    .venv/bin/python benchmarks/kfac_convergence.py                                           # digits (a minute)

Every run trains the same model at the same global batch with momentum SGD (0.9) and a cosine
decay over the same budget, no warm-up; K-FAC runs add ``--kfac`` and its settings. The study sweeps
SGD's learning rate and K-FAC's learning rate, damping, update frequencies and skipped layers, with
several seeds, and runs SGD and K-FAC settings alternately within each seed (reversed on every other
seed, :func:`hpcdl.bench.studies.interleaved`), so that a machine shared with other jobs slows both
alike. Test accuracy is measured several times per epoch (``--eval-every``); time is hpcdl.train's
training time (evaluation excluded). Results: benchmarks/results/kfac_convergence_<dataset>[_np<ranks>]
.{json,csv,png}; the verdict pairs the best SGD setting with the best K-FAC setting seed by seed
(docs/kfac.md, "When K-FAC pays off"). Where a K-FAC step's time goes is benchmarks/kfac_overhead.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from hpcdl.bench.studies import (  # noqa: E402
    TrainRun,
    check_flags,
    first_reaching,
    interleaved,
    median_or_inf,
    run_train,
)
from hpcdl.run import outputs  # noqa: E402
from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import EXIT_USAGE, UsageError  # noqa: E402
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
    """A finished run as the study records it: its accuracy curve and when it first reached ``target``."""
    if run.returncode != 0 or not run.rows:
        raise RuntimeError(f"{' '.join(run.command)} failed ({run.returncode}): {run.log_tail}")
    points = [{"epoch": float(r["epoch"]), "accuracy": r["test_accuracy"], "seconds": r["train_seconds"]}
              for r in run.rows]
    hit = first_reaching(points, target)
    return {
        "seed": seed,
        "points": points,
        "epochs_to_target": None if hit is None else hit["epoch"],
        "seconds_to_target": None if hit is None else hit["seconds"],
        "final_accuracy": points[-1]["accuracy"],
        "train_seconds": points[-1]["seconds"],
        "wall_seconds": run.wall_seconds,  # the whole process: start-up, data, evaluation
        "steps": run.rows[-1]["global_step"],
        "command": run.command,
    }


# ---------------------------------------------------------------- summaries and the verdict (pure, tested)
def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    reached = [r for r in runs if r["epochs_to_target"] is not None]
    return {
        "reached": f"{len(reached)}/{len(runs)}",
        "median_epochs_to_target": median_or_inf([r["epochs_to_target"] for r in runs]),
        "median_seconds_to_target": median_or_inf([r["seconds_to_target"] for r in runs]),
        "final_accuracy_mean": statistics.mean(r["final_accuracy"] for r in runs),
        "median_train_seconds_per_epoch": statistics.median(r["train_seconds"] / r["points"][-1]["epoch"]
                                                            for r in runs),
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
        s = sgd_runs[k["seed"]]

        def ratio(key: str, k: dict = k, s: dict = s) -> float | None:
            return None if k[key] is None or s[key] is None else k[key] / s[key]

        pairs.append({"seed": k["seed"], "sgd_epochs": s["epochs_to_target"], "kfac_epochs": k["epochs_to_target"],
                      "sgd_seconds": s["seconds_to_target"], "kfac_seconds": k["seconds_to_target"],
                      "wall_ratio": ratio("seconds_to_target"), "epoch_ratio": ratio("epochs_to_target")})
    sgd_cost = settings[sgd_name]["median_train_seconds_per_epoch"]
    kfac_cost = settings[kfac_name]["median_train_seconds_per_epoch"]
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
        "cost_per_epoch_ratio": kfac_cost / sgd_cost,
        "break_even_epoch_ratio": sgd_cost / kfac_cost,
    }


# ---------------------------------------------------------------- results
def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    sgd_colours = iter(["tab:gray", "tab:blue", "tab:cyan", "tab:purple", "black"])
    kfac_colours = iter(["tab:orange", "tab:green", "tab:red", "tab:olive", "tab:brown", "tab:pink"])
    lowest = 1.0
    for name, setting in report["settings"].items():
        colour = next(kfac_colours if setting["kfac"] else sgd_colours, "black")
        for i, run in enumerate(setting["runs"]):
            accuracy = [p["accuracy"] for p in run["points"]]
            lowest = min(lowest, *accuracy)
            style = dict(color=colour, alpha=0.8, marker=".", linestyle="-" if setting["kfac"] else "--",
                         label=name if i == 0 else None)
            axes[0].plot([p["epoch"] for p in run["points"]], accuracy, **style)
            axes[1].plot([p["seconds"] for p in run["points"]], accuracy, **style)
    for ax in axes:
        ax.axhline(report["target"], color="tab:red", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(max(lowest - 0.002, report["target"] - 0.03), 1.0 if report["target"] < 0.99 else 0.995)
    axes[0].set_xlabel("epoch")
    axes[1].set_xlabel(f"hpcdl.train's training seconds ({report['ranks']} rank(s) x {report['threads']} thread(s))")
    axes[0].set_ylabel("test accuracy")
    axes[0].legend(loc="lower right", fontsize=7)
    fig.suptitle(f"{report['dataset']}: SGD vs K-FAC (python -m hpcdl.train), target {report['target']:.1%} "
                 f"(dotted), {len(report['seeds'])} seed(s) each")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def write(report: dict[str, Any], out: Path) -> list[str]:
    """STEM.json (everything), STEM.csv (one row per run), STEM.png; returns the table printed."""
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=lambda v: None) + "\n")
    header = ["setting", "seed", "epochs_to_target", "seconds_to_target", "final_accuracy", "train_seconds",
              "wall_seconds"]
    rows = [",".join(header)]
    for name, s in report["settings"].items():
        for r in s["runs"]:
            values = [name, *(r[key] for key in header[1:])]
            rows.append(",".join("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in values))
    out.with_suffix(".csv").write_text("\n".join(rows) + "\n")
    plot(report, out)
    table = [f"{'setting':<58} reached  epochs  seconds   final  s/epoch"]
    for name, s in report["settings"].items():
        table.append(f"{name:<58} {s['reached']:>7} {s['median_epochs_to_target']:>7.2f} "
                     f"{s['median_seconds_to_target']:>8.1f} {s['final_accuracy_mean']:>7.4f} "
                     f"{s['median_train_seconds_per_epoch']:>8.1f}")
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
    parser.add_argument("--run-timeout", type=real(0, low_open=True), default=7200.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=None,
                        help="results stem: STEM.json/.csv/.png (default: a new folder under runs/bench/; "
                             "--refresh-results replaces benchmarks/results/kfac_convergence_*)")
    outputs.add_arguments(parser)
    return parser.parse_args(argv)


def check_data(dataset: str, data_dir: Path | None) -> Path | None:
    """The dataset folder a run reads, refused with one line before any run when MNIST's is missing or
    incomplete (hpcdl.data reads the files and says how to fetch them)."""
    if dataset != "mnist":
        return data_dir
    data_dir = data_dir or DEFAULT_MNIST_DIR
    if not data_dir.is_dir():
        raise UsageError(f"MNIST not found in {data_dir} (no folder); fetch it with: "
                         f"python -m hpcdl.fetch_mnist --output {data_dir}")
    from hpcdl.data.mnist import load_mnist

    load_mnist(data_dir)
    return data_dir


def recipe_of(args: argparse.Namespace) -> Recipe:
    base = RECIPES[args.dataset]
    return Recipe(base.model, args.batch_size or base.batch_size, base.weight_decay, args.epochs or base.epochs,
                  args.target or base.target, args.evals_per_epoch or base.evals_per_epoch,
                  base.sgd_lrs if args.sgd_lrs is None else args.sgd_lrs, base.kfac if args.kfac is None else args.kfac)


def study(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Every (setting, seed) run, alternating; checks every run's flags before the first starts."""
    recipe = recipe_of(args)
    if recipe.batch_size % args.ranks:
        raise UsageError(f"--batch-size {recipe.batch_size} is the global batch: it must divide by --ranks "
                         f"{args.ranks}")
    settings = [Setting(lr) for lr in recipe.sgd_lrs] + [parse_kfac_setting(text) for text in recipe.kfac]
    if not settings:
        raise UsageError("nothing to run: give --sgd-lrs or --kfac")
    data_dir = check_data(args.dataset, args.data_dir)
    plan = interleaved([s for s in settings if not s.kfac], [s for s in settings if s.kfac], args.seeds)
    commands = {(s, seed): train_flags(s, seed, recipe, args.dataset, data_dir, args.ranks, args.device)
                for s, seed in plan}
    for flags in commands.values():
        check_flags(flags)
    print(f"{args.dataset}: {recipe.model}, global batch {recipe.batch_size}, {recipe.epochs} epochs, target "
          f"{recipe.target:.1%}, {args.ranks} rank(s) x {args.threads} thread(s); {len(plan)} runs of "
          "python -m hpcdl.train", flush=True)
    runs: dict[Setting, list[dict[str, Any]]] = defaultdict(list)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kfac_convergence-") as scratch:
        for n, (setting, seed) in enumerate(plan, 1):
            run = run_train(commands[setting, seed], Path(scratch) / f"run{n}", ranks=args.ranks,
                            threads=args.threads, timeout=args.run_timeout)
            result = outcome(run, seed, recipe.target)
            runs[setting].append(result)
            print(f"[{n}/{len(plan)}] {setting.name} seed {seed}: final {result['final_accuracy']:.4f}, "
                  f"target at epoch {result['epochs_to_target']} / {result['seconds_to_target']} s, "
                  f"{result['train_seconds']:.1f} s training (study {time.perf_counter() - started:.0f} s so far)",
                  flush=True)
    report: dict[str, Any] = {
        "dataset": args.dataset, "model": recipe.model, "target": recipe.target, "epochs": recipe.epochs,
        "batch_size": recipe.batch_size, "weight_decay": recipe.weight_decay, "momentum": 0.9,
        "schedule": "hpcdl.train --lr-schedule cosine --warmup-epochs 0", "evals_per_epoch": recipe.evals_per_epoch,
        "seeds": args.seeds, "ranks": args.ranks, "threads": args.threads, "device": args.device,
        "trainer": "python -m hpcdl.train",
        "order": [f"{s.name} seed {seed}" for s, seed in plan], "load_average_at_end": os.getloadavg(),
        "study_seconds": time.perf_counter() - started, "settings": {},
    }
    for setting in settings:
        report["settings"][setting.name] = {**asdict(setting), "skip": list(setting.skip),
                                            **summarise(runs[setting]), "runs": runs[setting]}
    report["verdict"] = verdict(report["settings"])
    return report


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        suffix = "" if args.ranks == 1 else f"_np{args.ranks}"
        out = outputs.results_stem(args.out, f"kfac_convergence_{args.dataset}{suffix}", (".json", ".csv", ".png"),
                                   refresh_results=args.refresh_results, force=args.force, flag="--out")
        report = study(args, out)
    except UsageError as exc:
        print(f"kfac_convergence: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    print("\n".join(write(report, out)))
    v = report["verdict"]
    if v:
        print(f"best SGD: {v['best_sgd']}; best K-FAC: {v['best_kfac']}; K-FAC/SGD time to target per seed "
              f"(median): {v['median_wall_ratio']:.2f}x; K-FAC costs {v['cost_per_epoch_ratio']:.2f}x an SGD epoch; "
              f"fewer epochs in every seed: {v['kfac_fewer_epochs_every_seed']}")
    print(f"wrote {out}.json/.csv/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
