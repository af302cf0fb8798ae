"""Time and epochs to a test-accuracy target: tuned SGD against SGD preconditioned by K-FAC.

    python -m hpcdl.fetch_mnist                                             # once: real MNIST into ~/.cache/hpcdl/mnist
    nice -n 5 .venv/bin/python benchmarks/kfac_convergence.py --dataset mnist                  # 1 rank
    OMPI_MCA_mpi_yield_when_idle=1 timeout 1800 mpirun -np 2 --bind-to none \\
        .venv/bin/python benchmarks/kfac_convergence.py --dataset mnist --threads 1           # 2 ranks (Horovod)
    .venv/bin/python benchmarks/kfac_convergence.py                                           # digits (seconds)

Every run uses the same model, global batch, data order (per seed), momentum SGD, cosine
learning-rate decay per iteration over the same budget; K-FAC only adds the preconditioner
between the gradient allreduce and the optimizer's step. The study sweeps SGD's learning rate and
K-FAC's learning rate, damping, update frequencies and skipped layers, with several seeds, and
runs SGD and K-FAC settings alternately within each seed (reversed on every other seed), so that
a machine shared with other jobs slows both alike. Test accuracy is measured several times per
epoch; training time (wall, process CPU, main-thread CPU) is clocked with evaluation excluded, and
each training step is split into phases (forward+backward, allreduce wait, K-FAC factors,
decompositions, preconditioning, optimizer). Results: benchmarks/results/kfac_convergence_<dataset>
[_np<ranks>].{json,csv,png}; the verdict is the per-seed pairing of the best SGD setting with the
best K-FAC setting (docs/kfac.md, "When K-FAC pays off").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after PYTHONPATH, so PYTHONPATH=DIR can point at another copy of kfac/

from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import EXIT_USAGE, UsageError  # noqa: E402
from hpcdl.runtime.numbers import integer, real  # noqa: E402
from hpcdl.training.models import build_model  # noqa: E402

DEFAULT_MNIST_DIR = Path.home() / ".cache" / "hpcdl" / "mnist"
PHASES = ("forward_backward", "allreduce", "factors", "decompositions", "precondition", "optimizer")


@dataclass(frozen=True)
class Setting:
    """One optimiser configuration of the sweep; K-FAC fields are unused for SGD."""

    lr: float
    kfac: bool = False
    damping: float = 0.01
    factor_freq: int = 1
    inv_freq: int = 10
    skip: tuple[str, ...] = ()
    method: str = "eigen"
    kl_clip: float = 0.001

    @property
    def name(self) -> str:
        if not self.kfac:
            return f"SGD lr={self.lr:g}"
        extras = "".join(
            [f" skip={'+'.join(self.skip)}" if self.skip else "", f" {self.method}" if self.method != "eigen" else ""]
        )
        return f"K-FAC lr={self.lr:g} d={self.damping:g} f={self.factor_freq}/{self.inv_freq}{extras}"


def parse_kfac_setting(text: str) -> Setting:
    """``lr=0.05,damping=0.01,factors=10,inverse=100[,skip=a+b][,method=inverse][,kl_clip=0.001]``."""
    fields: dict[str, Any] = {"kfac": True}
    keys = {
        "lr": ("lr", float),
        "damping": ("damping", float),
        "factors": ("factor_freq", int),
        "inverse": ("inv_freq", int),
        "method": ("method", str),
        "kl_clip": ("kl_clip", float),
    }
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
                f"--kfac {text!r}: bad item {item!r} (keys: lr, damping, factors, inverse, skip, method, kl_clip)"
            ) from exc
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
    "mnist": Recipe(
        "mnist_cnn",
        128,
        5e-4,
        3,
        0.99,
        4,
        [0.025, 0.05, 0.1],
        ["lr=0.1,damping=0.1,factors=10,inverse=100", "lr=0.1,damping=0.1,factors=10,inverse=100,skip=classifier.1"],
    ),
    "cifar10": Recipe("resnet32", 128, 5e-4, 20, 0.80, 1, [0.1], ["lr=0.1,damping=0.01,factors=10,inverse=100"]),
}


# ---------------------------------------------------------------- time to target (pure, tested)
def first_reaching(points: Sequence[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first evaluation point whose accuracy reaches ``target`` (None if none does).

    Points are in training order; a later dip below the target does not undo the first hit, as a
    user who stops at the target would have stopped there.
    """
    return next((p for p in points if p["accuracy"] >= target), None)


def median_or_inf(values: Sequence[float | None]) -> float:
    """Median where a run that never reached the target counts as 'more than the budget' (inf)."""
    return statistics.median([math.inf if v is None else v for v in values])


# ---------------------------------------------------------------- ranks and data
class Ranks:
    """One process, or Horovod + mpi4py under mpirun/srun (detected from the launcher)."""

    def __init__(self) -> None:
        self.size, self.rank, self.hvd = 1, 0, None
        from hpcdl.runtime import launcher

        if (launcher.first_number(launcher.SIZE_VARS) or 1) > 1:
            from hpcdl.runtime import world

            w = world.init()
            import horovod.torch as hvd

            self.size, self.rank, self.hvd, self.comm = w.size, w.rank, hvd, world.comm()

    def sum(self, value: int) -> int:
        return value if self.size == 1 else int(self.comm.allreduce(value))

    def max(self, value: float) -> float:
        if self.size == 1:
            return value
        from mpi4py import MPI

        return float(self.comm.allreduce(value, op=MPI.MAX))

    def print(self, *args: Any) -> None:
        if self.rank == 0:
            print(*args, flush=True)


def check_mnist_folder(data_dir: Path) -> None:
    """Refuse with one line when there is no MNIST folder, saying how to get one (hpcdl.data.mnist
    checks the files inside it, with the same advice)."""
    if not data_dir.is_dir():
        raise UsageError(
            f"MNIST not found in {data_dir} (no folder); fetch it with: python -m hpcdl.fetch_mnist --output {data_dir}"
        )


def load(
    dataset: str, data_dir: Path | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """The whole dataset as normalised float tensors, read once through hpcdl.data's registry: the study
    indexes batches itself, so every rank and every run sees exactly the same examples in the same order
    for a seed. A dataset with a crop/flip augmentation (CIFAR-10) gets one fixed draw of it."""
    from hpcdl.data import REGISTRY, TensorSplits, read_dataset
    from hpcdl.data.augment import Normalizer, pad_crop_flip

    if dataset == "mnist":
        data_dir = data_dir or DEFAULT_MNIST_DIR
        check_mnist_folder(data_dir)
    data = read_dataset(dataset, None if data_dir is None else str(data_dir))
    assert isinstance(data, TensorSplits)
    info = REGISTRY[dataset]
    normalize = Normalizer(info.norm, torch.device("cpu"), channels_last=False)
    train_images = data.train.images
    if info.crop_padding:
        train_images = pad_crop_flip(train_images, info.crop_padding, torch.Generator().manual_seed(0))
    return (normalize(train_images), data.train.labels, normalize(data.test.images), data.test.labels,
            data.num_classes, int(train_images.shape[1]))


# ---------------------------------------------------------------- one training run
class Clock:
    """Wall, process-CPU and main-thread-CPU seconds, accumulated only while running.

    Process CPU counts every thread of the process (Horovod's background thread, MPI polling);
    the main thread's CPU is the computation itself. On a shared machine wall time grows with the
    other jobs' load, CPU time much less.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.wall = self.cpu = self.thread = 0.0

    def _now(self) -> tuple[float, float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter(), time.process_time(), time.thread_time()

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        end = self._now()
        self.wall += end[0] - self._start[0]
        self.cpu += end[1] - self._start[1]
        self.thread += end[2] - self._start[2]


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, ranks: Ranks) -> float:
    """Exact test accuracy: each rank counts its disjoint shard, the counts are summed."""
    model.eval()
    correct = 0
    with torch.no_grad():
        shard_x, shard_y = x[ranks.rank :: ranks.size], y[ranks.rank :: ranks.size]
        for start in range(0, len(shard_y), 1000):
            correct += int((model(shard_x[start : start + 1000]).argmax(1) == shard_y[start : start + 1000]).sum())
    model.train()
    return ranks.sum(correct) / len(y)


def preconditioner(setting: Setting, model: torch.nn.Module, lr: Any) -> Any:
    """The K-FAC preconditioner a setting asks for (None for plain SGD); ``lr`` is a number or a schedule."""
    if not setting.kfac:
        return None
    from kfac import KFACPreconditioner

    return KFACPreconditioner(model, factor_update_freq=setting.factor_freq, inv_update_freq=setting.inv_freq,
                              damping=setting.damping, kl_clip=setting.kl_clip, lr=lr,
                              skip_layers=list(setting.skip), method=setting.method)


def train_run(
    setting: Setting,
    seed: int,
    recipe: Recipe,
    data: tuple,
    ranks: Ranks,
    device: torch.device,
    on_point: Callable[[dict[str, float]], None],
) -> dict[str, Any]:

    x_train, y_train, x_test, y_test, num_classes, channels = data
    torch.manual_seed(seed)  # same initial weights on every rank (and broadcast below anyway)
    model = build_model(recipe.model, num_classes, channels).to(device)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=setting.lr, momentum=0.9, weight_decay=recipe.weight_decay)
    if ranks.hvd is not None:
        ranks.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = ranks.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    steps_per_epoch = len(y_train) // recipe.batch_size  # the last partial batch is dropped
    total_steps = recipe.epochs * steps_per_epoch

    def lr_factor(step: int) -> float:  # cosine decay over the whole budget, per iteration
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / total_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    pre = preconditioner(setting, model, lambda step: setting.lr * lr_factor(step))
    eval_at = {
        round(k * steps_per_epoch / recipe.evals_per_epoch)
        for k in range(1, recipe.epochs * recipe.evals_per_epoch + 1)
    }
    order = torch.Generator().manual_seed(seed)
    clock, eval_seconds = Clock(device), 0.0
    phases: dict[str, float] = defaultdict(float)
    points: list[dict[str, float]] = []
    sync = device.type == "cuda"
    perm = torch.empty(0, dtype=torch.long)
    clock.start()
    for step in range(total_steps):
        if step % steps_per_epoch == 0:
            perm = torch.randperm(len(y_train), generator=order)
        batch = perm[(step % steps_per_epoch) * recipe.batch_size :][: recipe.batch_size][ranks.rank :: ranks.size]
        xb, yb = x_train[batch], y_train[batch]
        t0 = time.perf_counter()
        optimizer.zero_grad()  # Horovod's wrapper takes no set_to_none; torch defaults to it anyway
        F.cross_entropy(model(xb), yb).backward()
        if sync:
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        if ranks.hvd is not None:
            optimizer.synchronize()
        t2 = time.perf_counter()
        if pre is not None:
            pre.step()
        if sync:
            torch.cuda.synchronize(device)
        t3 = time.perf_counter()
        if ranks.hvd is not None:
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        scheduler.step()
        if sync:
            torch.cuda.synchronize(device)
        t4 = time.perf_counter()
        phases["forward_backward"] += t1 - t0
        phases["allreduce"] += t2 - t1
        phases["kfac_step"] += t3 - t2
        phases["optimizer"] += t4 - t3
        if step + 1 in eval_at:
            clock.stop()
            started = time.perf_counter()
            accuracy = evaluate(model, x_test, y_test, ranks)
            eval_seconds += time.perf_counter() - started
            point = {
                "epoch": (step + 1) / steps_per_epoch,
                "accuracy": accuracy,
                "seconds": ranks.max(clock.wall),
                "cpu_seconds": ranks.max(clock.cpu),
                "thread_seconds": ranks.max(clock.thread),
            }
            points.append(point)
            on_point(point)
            clock.start()
    clock.stop()
    if pre is not None:  # split K-FAC's own time into its phases
        for phase in ("factors", "decompositions", "precondition"):
            phases[phase] = pre.timings.get(phase, 0.0)
    phases.pop("kfac_step", None)
    hit = first_reaching(points, recipe.target)
    return {
        "seed": seed,
        "points": points,
        "epochs_to_target": None if hit is None else hit["epoch"],
        "seconds_to_target": None if hit is None else hit["seconds"],
        "cpu_seconds_to_target": None if hit is None else hit["cpu_seconds"],
        "final_accuracy": points[-1]["accuracy"],
        "train_seconds": clock.wall,
        "eval_seconds": eval_seconds,
        "ms_per_step": {phase: 1000 * phases.get(phase, 0.0) / total_steps for phase in PHASES},
        "steps": total_steps,
    }


# ---------------------------------------------------------------- where a step's time goes
def profile_steps(
    settings: list[Setting], recipe: Recipe, data: tuple, ranks: Ranks, device: torch.device, rounds: int
) -> dict[str, Any]:
    """Milliseconds per training step and phase for each setting, settings alternating round by round.

    Each round runs every setting for one whole inverse-update cycle (the largest ``inverse`` of the
    K-FAC settings), so the decompositions are amortised exactly as in training; round 0 is a warm-up.
    Besides wall time, the main thread's CPU time is recorded per phase: other jobs on the machine
    inflate wall time, hardly CPU time. K-FAC's own phases come from ``pre.timings`` (wall); its CPU
    time is measured for ``pre.step()`` as a whole.
    """

    x_train, y_train, _, _, num_classes, channels = data
    cycle = max([s.inv_freq for s in settings if s.kfac] + [1])
    states = []
    for setting in settings:
        torch.manual_seed(0)
        model = build_model(recipe.model, num_classes, channels).to(device)
        optimizer: Any = torch.optim.SGD(
            model.parameters(), lr=setting.lr * 0.1, momentum=0.9, weight_decay=recipe.weight_decay
        )
        if ranks.hvd is not None:
            optimizer = ranks.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        pre = preconditioner(setting, model, setting.lr * 0.1)
        states.append((setting, model, optimizer, pre))
    batches = torch.Generator().manual_seed(0)
    per_round: dict[str, list[dict[str, float]]] = defaultdict(list)
    sync = device.type == "cuda"

    def now() -> tuple[float, float]:
        if sync:
            torch.cuda.synchronize(device)
        return time.perf_counter(), time.thread_time()

    for round_ in range(rounds + 1):
        for setting, model, optimizer, pre in states if round_ % 2 == 0 else states[::-1]:
            totals: dict[str, float] = defaultdict(float)
            kfac_before = dict(pre.timings) if pre is not None else {}
            for _ in range(cycle):
                index = torch.randint(len(y_train), (recipe.batch_size,), generator=batches)[ranks.rank :: ranks.size]
                t0 = now()
                optimizer.zero_grad()
                F.cross_entropy(model(x_train[index]), y_train[index]).backward()
                t1 = now()
                if ranks.hvd is not None:
                    optimizer.synchronize()
                t2 = now()
                if pre is not None:
                    pre.step()
                t3 = now()
                if ranks.hvd is not None:
                    with optimizer.skip_synchronize():
                        optimizer.step()
                else:
                    optimizer.step()
                t4 = now()
                for name, (a, b) in (
                    ("forward_backward", (t0, t1)),
                    ("allreduce", (t1, t2)),
                    ("kfac_step", (t2, t3)),
                    ("optimizer", (t3, t4)),
                ):
                    totals[f"{name}_wall"] += b[0] - a[0]
                    totals[f"{name}_cpu"] += b[1] - a[1]
            if round_ == 0:
                continue
            row = {key: 1000 * ranks.max(value) / cycle for key, value in totals.items()}
            if pre is not None:
                for phase in ("factors", "decompositions", "precondition"):
                    row[f"{phase}_wall"] = 1000 * ranks.max(pre.timings[phase] - kfac_before.get(phase, 0.0)) / cycle
            per_round[setting.name].append(row)
    report: dict[str, Any] = {"cycle_steps": cycle, "rounds": rounds, "settings": {}}
    for setting, *_ in states:
        rows = per_round[setting.name]
        keys = sorted({key for row in rows for key in row})
        medians = {key: statistics.median(row.get(key, 0.0) for row in rows) for key in keys}
        medians["step_wall"] = statistics.median(
            sum(
                v
                for k, v in row.items()
                if k.endswith("_wall")
                and k.split("_wall")[0] in ("forward_backward", "allreduce", "kfac_step", "optimizer")
            )
            for row in rows
        )
        medians["step_cpu"] = statistics.median(sum(v for k, v in row.items() if k.endswith("_cpu")) for row in rows)
        report["settings"][setting.name] = {**asdict(setting), "skip": list(setting.skip), "ms_per_step": medians}
    sgd = next((v["ms_per_step"] for v in report["settings"].values() if not v["kfac"]), None)
    if sgd is not None:
        for entry in report["settings"].values():
            entry["cost_vs_sgd_wall"] = entry["ms_per_step"]["step_wall"] / sgd["step_wall"]
            entry["cost_vs_sgd_cpu"] = entry["ms_per_step"]["step_cpu"] / sgd["step_cpu"]
    return report


def write_profile(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    phases = ["forward_backward", "allreduce", "factors", "decompositions", "precondition", "optimizer"]
    lines = [
        "setting,step_cpu_ms,step_wall_ms,cost_vs_sgd_cpu,cost_vs_sgd_wall," + ",".join(f"{p}_wall_ms" for p in phases)
    ]
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * len(report["settings"])))
    for row, (name, entry) in enumerate(report["settings"].items()):
        ms = entry["ms_per_step"]
        lines.append(
            ",".join(
                [
                    name,
                    f"{ms['step_cpu']:.2f}",
                    f"{ms['step_wall']:.2f}",
                    f"{entry.get('cost_vs_sgd_cpu', 1):.3f}",
                    f"{entry.get('cost_vs_sgd_wall', 1):.3f}",
                    *[f"{ms.get(p + '_wall', 0.0):.2f}" for p in phases],
                ]
            )
        )
        left = 0.0
        for colour, phase in zip(
            ["tab:gray", "tab:purple", "tab:blue", "tab:red", "tab:orange", "tab:green"], phases, strict=True
        ):
            width = ms.get(phase + "_wall", 0.0)
            ax.barh(row, width, left=left, color=colour, label=phase if row == 0 or entry["kfac"] else None)
            left += width
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="lower right")
    ax.set_yticks(range(len(report["settings"])), list(report["settings"]), fontsize=7)
    ax.set_xlabel(f"wall ms per training step (median of {report['rounds']} rounds of {report['cycle_steps']} steps)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    out.with_suffix(".csv").write_text("\n".join(lines) + "\n")
    return lines


# ---------------------------------------------------------------- the study
def interleaved(settings: list[Setting], seeds: Sequence[int]) -> list[tuple[Setting, int]]:
    """SGD and K-FAC settings alternating within each seed, the order reversed on every other seed.

    Neighbouring runs see nearly the same load from other jobs, so per-seed pairs are fair even
    when the machine's load drifts during the study.
    """
    sgd = [s for s in settings if not s.kfac]
    kfac = [s for s in settings if s.kfac]
    mixed: list[Setting] = []
    for i in range(max(len(sgd), len(kfac))):
        mixed += sgd[i : i + 1] + kfac[i : i + 1]
    plan = []
    for n, seed in enumerate(seeds):
        plan += [(s, seed) for s in (mixed if n % 2 == 0 else mixed[::-1])]
    return plan


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    reached = [r for r in runs if r["epochs_to_target"] is not None]
    phases = {p: statistics.median(r["ms_per_step"][p] for r in runs) for p in PHASES}
    return {
        "reached": f"{len(reached)}/{len(runs)}",
        "median_epochs_to_target": median_or_inf([r["epochs_to_target"] for r in runs]),
        "median_seconds_to_target": median_or_inf([r["seconds_to_target"] for r in runs]),
        "median_cpu_seconds_to_target": median_or_inf([r["cpu_seconds_to_target"] for r in runs]),
        "final_accuracy_mean": statistics.mean(r["final_accuracy"] for r in runs),
        "median_train_seconds_per_epoch": statistics.median(
            r["train_seconds"] / r["points"][-1]["epoch"] for r in runs
        ),
        "median_cpu_seconds_per_epoch": statistics.median(
            r["points"][-1]["cpu_seconds"] / r["points"][-1]["epoch"] for r in runs
        ),
        "median_ms_per_step": phases,
    }


def best(settings: dict[str, dict[str, Any]], kfac: bool) -> str | None:
    """The setting of one kind with the lowest median seconds to target (then epochs, then accuracy)."""
    names = [n for n, s in settings.items() if s["kfac"] == kfac]
    if not names:
        return None
    return min(
        names,
        key=lambda n: (
            settings[n]["median_seconds_to_target"],
            settings[n]["median_epochs_to_target"],
            -settings[n]["final_accuracy_mean"],
        ),
    )


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

        pairs.append(
            {
                "seed": k["seed"],
                "sgd_epochs": s["epochs_to_target"],
                "kfac_epochs": k["epochs_to_target"],
                "sgd_seconds": s["seconds_to_target"],
                "kfac_seconds": k["seconds_to_target"],
                "wall_ratio": ratio("seconds_to_target"),
                "cpu_ratio": ratio("cpu_seconds_to_target"),
                "epoch_ratio": ratio("epochs_to_target"),
            }
        )
    sgd_cost = settings[sgd_name]["median_train_seconds_per_epoch"]
    kfac_cost = settings[kfac_name]["median_train_seconds_per_epoch"]
    fewer = all(
        p["kfac_epochs"] is not None and (p["sgd_epochs"] is None or p["kfac_epochs"] < p["sgd_epochs"]) for p in pairs
    )
    return {
        "best_sgd": sgd_name,
        "best_kfac": kfac_name,
        "pairs": pairs,
        "median_wall_ratio": median_or_inf([p["wall_ratio"] for p in pairs]),
        "median_cpu_ratio": median_or_inf([p["cpu_ratio"] for p in pairs]),
        "kfac_faster_in_wall_time": settings[kfac_name]["median_seconds_to_target"]
        < settings[sgd_name]["median_seconds_to_target"],
        "kfac_fewer_epochs_every_seed": fewer,
        # K-FAC pays off in wall time when its epochs to target are fewer than SGD's by more than
        # this factor: the ratio of their training costs per epoch.
        "cost_per_epoch_ratio": kfac_cost / sgd_cost,
        "break_even_epoch_ratio": sgd_cost / kfac_cost,
    }


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
            epochs = [p["epoch"] for p in run["points"]]
            accuracy = [p["accuracy"] for p in run["points"]]
            lowest = min(lowest, *accuracy)
            style = dict(
                color=colour,
                alpha=0.8,
                marker=".",
                linestyle="-" if setting["kfac"] else "--",
                label=name if i == 0 else None,
            )
            axes[0].plot(epochs, accuracy, **style)
            axes[1].plot([p["seconds"] for p in run["points"]], accuracy, **style)
    for ax in axes:
        ax.axhline(report["target"], color="tab:red", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(max(lowest - 0.002, report["target"] - 0.03), 1.0 if report["target"] < 0.99 else 0.995)
    axes[0].set_xlabel("epoch")
    axes[1].set_xlabel(
        f"training seconds (evaluation excluded; {report['ranks']} rank(s) x {report['threads']} thread(s))"
    )
    axes[0].set_ylabel("test accuracy")
    axes[0].legend(loc="lower right", fontsize=7)
    fig.suptitle(
        f"{report['dataset']}: SGD vs K-FAC, target {report['target']:.1%} (dotted), {len(report['seeds'])} seeds each"
    )
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def write(report: dict[str, Any], out: Path) -> list[str]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=lambda v: None) + "\n")
    header = [
        "setting",
        "seed",
        "epochs_to_target",
        "seconds_to_target",
        "cpu_seconds_to_target",
        "final_accuracy",
        "train_seconds",
        "eval_seconds",
        *[f"ms_{p}" for p in PHASES],
    ]
    rows = [",".join(header)]
    for name, s in report["settings"].items():
        for r in s["runs"]:
            values = [
                name,
                r["seed"],
                r["epochs_to_target"],
                r["seconds_to_target"],
                r["cpu_seconds_to_target"],
                r["final_accuracy"],
                r["train_seconds"],
                r["eval_seconds"],
                *[r["ms_per_step"][p] for p in PHASES],
            ]
            rows.append(",".join("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in values))
    out.with_suffix(".csv").write_text("\n".join(rows) + "\n")
    plot(report, out)
    table = [f"{'setting':<58} reached  epochs  seconds  cpu s   final  s/epoch"]
    for name, s in report["settings"].items():
        table.append(
            f"{name:<58} {s['reached']:>7} {s['median_epochs_to_target']:>7.2f} {s['median_seconds_to_target']:>8.1f} "
            f"{s['median_cpu_seconds_to_target']:>6.1f} {s['final_accuracy_mean']:>7.4f} "
            f"{s['median_train_seconds_per_epoch']:>8.1f}"
        )
    return table


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog="benchmarks/kfac_convergence.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dataset", choices=sorted(RECIPES), default="digits")
    parser.add_argument("--data-dir", type=Path, default=None, help=f"MNIST IDX folder (default {DEFAULT_MNIST_DIR})")
    parser.add_argument("--epochs", type=integer(1), default=None, help="budget (default: the recipe's)")
    parser.add_argument(
        "--target", type=real(0, low_open=True, high=1), default=None,
        help="test accuracy to reach, a fraction (default: the recipe's)"
    )
    parser.add_argument("--seeds", type=integer(0), nargs="+", default=[0, 1, 2])
    parser.add_argument("--batch-size", type=integer(1), default=None, help="global batch (default: the recipe's)")
    parser.add_argument("--evals-per-epoch", type=integer(1), default=None)
    parser.add_argument(
        "--sgd-lrs", type=real(0, low_open=True), nargs="*", default=None,
        help="SGD learning rates of the sweep",
    )
    parser.add_argument(
        "--kfac",
        nargs="*",
        default=None,
        metavar="lr=..,damping=..,factors=..,inverse=..[,skip=..]",
        help="K-FAC settings of the sweep",
    )
    parser.add_argument(
        "--threads", type=integer(1), default=None,
        help="torch threads per rank (default 1, or the rank's share of cores)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument(
        "--profile-rounds",
        type=integer(0),
        default=0,
        help="instead of the study: time each setting's steps by phase for this many alternating rounds",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    return args


def kfac_source() -> str:
    """Which kfac/ the study ran (its folder, and the commit that last changed it when in this repository)."""
    import subprocess

    import kfac

    folder = Path(kfac.__file__).resolve().parent
    if folder.parent != REPO:
        return str(folder)
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run(
        [*git, "log", "-1", "--format=%h", "--", "kfac"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "kfac"], capture_output=True, text=True).stdout.strip()
    return f"{folder} at {commit or 'unknown commit'}{' with uncommitted changes' if dirty else ''}"


def study(args: argparse.Namespace, ranks: Ranks) -> dict[str, Any]:
    base = RECIPES[args.dataset]
    recipe = Recipe(
        base.model,
        args.batch_size or base.batch_size,
        base.weight_decay,
        args.epochs or base.epochs,
        args.target or base.target,
        args.evals_per_epoch or base.evals_per_epoch,
        base.sgd_lrs if args.sgd_lrs is None else args.sgd_lrs,
        base.kfac if args.kfac is None else args.kfac,
    )
    if recipe.batch_size % ranks.size:
        raise UsageError(
            f"--batch-size {recipe.batch_size} is the global batch: it must divide by the {ranks.size} ranks"
        )
    settings = [Setting(lr) for lr in recipe.sgd_lrs] + [parse_kfac_setting(text) for text in recipe.kfac]
    if not settings:
        raise UsageError("nothing to run: give --sgd-lrs or --kfac")
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    torch.set_num_threads(args.threads or (1 if ranks.size == 1 else torch.get_num_threads()))
    x_train, y_train, x_test, y_test, num_classes, channels = load(args.dataset, args.data_dir)
    data = (x_train.to(device), y_train.to(device), x_test.to(device), y_test.to(device), num_classes, channels)
    if args.profile_rounds:
        ranks.print(f"{args.dataset}: per-phase step times, {len(settings)} settings, {args.profile_rounds} rounds")
        profile = profile_steps(settings, recipe, data, ranks, device, args.profile_rounds)
        return {
            "dataset": args.dataset,
            "model": recipe.model,
            "batch_size": recipe.batch_size,
            "ranks": ranks.size,
            "threads": torch.get_num_threads(),
            "kfac_source": kfac_source(),
            "load_average_at_end": os.getloadavg(),
            **profile,
        }

    plan = interleaved(settings, args.seeds)
    ranks.print(
        f"{args.dataset}: {len(y_train)} train / {len(y_test)} test images, {recipe.model}, "
        f"global batch {recipe.batch_size}, {recipe.epochs} epochs, target {recipe.target:.1%}, "
        f"{ranks.size} rank(s) x {torch.get_num_threads()} thread(s) "
        f"on {device.type}; {len(plan)} runs"
    )
    runs: dict[Setting, list[dict[str, Any]]] = defaultdict(list)
    started = time.perf_counter()
    for n, (setting, seed) in enumerate(plan, 1):
        label = f"[{n}/{len(plan)}] {setting.name} seed {seed}"

        def on_point(p: dict[str, float], label: str = label) -> None:
            ranks.print(
                f"{label} epoch {p['epoch']:.2f}: accuracy {p['accuracy']:.4f}  train {p['seconds']:.1f} s "
                f"(cpu {p['cpu_seconds']:.1f} s)"
            )

        run = train_run(setting, seed, recipe, data, ranks, device, on_point)
        runs[setting].append(run)
        ranks.print(
            f"{label}: done, {run['train_seconds']:.1f} s training + {run['eval_seconds']:.1f} s evaluation "
            f"(study {time.perf_counter() - started:.0f} s so far)"
        )
    report: dict[str, Any] = {
        "dataset": args.dataset,
        "model": recipe.model,
        "target": recipe.target,
        "epochs": recipe.epochs,
        "batch_size": recipe.batch_size,
        "weight_decay": recipe.weight_decay,
        "momentum": 0.9,
        "schedule": "cosine per iteration",
        "evals_per_epoch": recipe.evals_per_epoch,
        "seeds": args.seeds,
        "ranks": ranks.size,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "kfac_source": kfac_source(),
        "order": [f"{s.name} seed {seed}" for s, seed in plan],
        "load_average_at_end": os.getloadavg(),
        "study_seconds": time.perf_counter() - started,
        "settings": {},
    }
    for setting in settings:
        report["settings"][setting.name] = {
            **asdict(setting),
            "skip": list(setting.skip),
            **summarise(runs[setting]),
            "runs": runs[setting],
        }
    report["verdict"] = verdict(report["settings"])
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ranks = None
    try:
        args = parse_args(argv)
        ranks = Ranks()
        report = study(args, ranks)
    except UsageError as exc:
        if ranks is None or ranks.rank == 0:
            print(f"kfac_convergence: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if ranks.rank == 0:
        suffix = ("" if ranks.size == 1 else f"_np{ranks.size}") + ("_profile" if args.profile_rounds else "")
        out = args.out or REPO / "benchmarks" / "results" / f"kfac_convergence_{args.dataset}{suffix}"
        if args.profile_rounds:
            print("\n".join(write_profile(report, out)))
            print(f"wrote {out}.json/.csv/.png")
            return 0
        print("\n".join(write(report, out)))
        v = report["verdict"]
        if v:
            print(
                f"best SGD: {v['best_sgd']}; best K-FAC: {v['best_kfac']}; K-FAC/SGD time to target per seed (median): "
                f"wall {v['median_wall_ratio']:.2f}x, cpu {v['median_cpu_ratio']:.2f}x; "
                f"K-FAC costs {v['cost_per_epoch_ratio']:.2f}x "
                f"an SGD epoch; fewer epochs in every seed: {v['kfac_fewer_epochs_every_seed']}"
            )
        print(f"wrote {out}.json/.csv/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
