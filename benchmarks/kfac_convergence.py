"""Epochs and seconds to a test-accuracy target: SGD against SGD preconditioned by K-FAC.

    .venv/bin/python benchmarks/kfac_convergence.py                       # digits, the README figure
    .venv/bin/python benchmarks/kfac_convergence.py --dataset cifar10 --data-dir ~/data/cifar-10-batches-py \\
        --epochs 20 --target 0.80                                         # CIFAR-10 with resnet32

Same model, data order, optimizer, learning-rate schedule (cosine over the budget, per
iteration) and budget for every run; K-FAC only adds the preconditioner between backward and the
optimizer step. Each setting runs with several seeds; the script reports
the median epoch (and wall-clock seconds of training, evaluation excluded) at which test accuracy
first reaches the target, and plots accuracy against epochs and against seconds.
Digits are scikit-learn's 8x8 handwritten digits (hpcdl.data, fixed held-out split), one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcdl.data import load_dataset  # noqa: E402
from hpcdl.models import build_model  # noqa: E402
from kfac import KFACPreconditioner  # noqa: E402

RECIPES = {
    # model, batch size, learning rate, weight decay
    "digits": dict(model="digits_cnn", batch_size=32, weight_decay=1e-4),
    "cifar10": dict(model="resnet32", batch_size=128, weight_decay=5e-4),
}


def evaluate(model: torch.nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    model.train()
    return correct / total


def train(args: argparse.Namespace, data, name: str, lr: float, kfac: bool, seed: int) -> dict:
    recipe = RECIPES[args.dataset]
    torch.manual_seed(seed)
    model = build_model(recipe["model"], data.num_classes, data.channels)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=recipe["weight_decay"])
    order = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(data.train, batch_size=recipe["batch_size"], shuffle=True, generator=order, num_workers=args.workers)
    total_steps = args.epochs * len(train_loader)

    def lr_factor(step: int) -> float:  # cosine decay over the whole budget, per iteration
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / total_steps)) if args.schedule == "cosine" else 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    pre = None
    if kfac:  # K-FAC's KL clip follows the same schedule, as a callable of its step count
        pre = KFACPreconditioner(
            model, factor_update_freq=args.factor_update_freq, inv_update_freq=args.inv_update_freq,
            damping=args.damping, kl_clip=args.kl_clip, lr=lambda step: lr * lr_factor(step),
        )
    test_loader = DataLoader(data.test, batch_size=512, num_workers=args.workers)
    accuracy, seconds, elapsed = [], [], 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        for x, y in train_loader:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            if pre is not None:
                pre.step()
            optimizer.step()
            scheduler.step()
        elapsed += time.perf_counter() - start
        accuracy.append(evaluate(model, test_loader))
        seconds.append(elapsed)
        print(f"{name:<22} seed {seed} epoch {epoch + 1:>3}: test accuracy {accuracy[-1]:.3f} ({elapsed:.1f} s)", flush=True)
    hit = next((i for i, a in enumerate(accuracy) if a >= args.target), None)
    return {
        "accuracy": accuracy,
        "seconds": seconds,
        "epochs_to_target": None if hit is None else hit + 1,
        "seconds_to_target": None if hit is None else seconds[hit],
    }


def summarise(runs: list[dict]) -> dict:
    epochs = [r["epochs_to_target"] for r in runs]
    secs = [r["seconds_to_target"] for r in runs]
    reached = [e for e in epochs if e is not None]
    return {
        "reached": f"{len(reached)}/{len(runs)}",
        # a run that never reached the target counts as "more than the budget" (inf) in the median
        "median_epochs_to_target": statistics.median([e if e is not None else float("inf") for e in epochs]),
        "median_seconds_to_target": statistics.median([s if s is not None else float("inf") for s in secs]),
        "final_accuracy_mean": statistics.mean(r["accuracy"][-1] for r in runs),
    }


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    colours = ["tab:gray", "tab:green", "tab:blue", "tab:orange"]
    for colour, (name, setting) in zip(colours, report["settings"].items()):
        for i, run in enumerate(setting["runs"]):
            epochs = range(1, len(run["accuracy"]) + 1)
            label = name if i == 0 else None
            axes[0].plot(epochs, run["accuracy"], color=colour, alpha=0.8, label=label, marker=".")
            axes[1].plot(run["seconds"], run["accuracy"], color=colour, alpha=0.8, label=label, marker=".")
    for ax in axes:
        ax.axhline(report["target"], color="tab:red", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    low = max(0.0, min(min(r["accuracy"]) for s in report["settings"].values() for r in s["runs"]) - 0.02)
    axes[0].set_ylim(max(low, report["target"] - 0.25), 1.0)
    axes[0].set_xlabel("epoch")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("training seconds, log scale" + (" (1 CPU thread)" if report["threads"] == 1 else ""))
    axes[0].set_ylabel("test accuracy")
    axes[0].legend(loc="lower right")
    fig.suptitle(f"{report['dataset']}: SGD vs K-FAC, target {report['target']:.0%} (dashed), {len(report['seeds'])} seeds each")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=sorted(RECIPES), default="digits")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of every run")
    parser.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    parser.add_argument("--sgd-extra-lr", type=float, default=0.05, help="also run SGD at this learning rate (0: no)")
    parser.add_argument("--damping", type=float, default=0.01)
    parser.add_argument("--kl-clip", type=float, default=0.001)
    parser.add_argument("--factor-update-freq", type=int, default=1)
    parser.add_argument("--inv-update-freq", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.out = args.out or REPO / "benchmarks" / "results" / f"kfac_convergence_{args.dataset}"
    torch.set_num_threads(args.threads)
    data = load_dataset(args.dataset, args.data_dir, seed=0)

    settings = {f"SGD lr={args.lr}": (args.lr, False)}
    if args.sgd_extra_lr:
        settings[f"SGD lr={args.sgd_extra_lr}"] = (args.sgd_extra_lr, False)
    settings[f"K-FAC lr={args.lr}"] = (args.lr, True)
    report = {"dataset": args.dataset, "target": args.target, "epochs": args.epochs, "seeds": args.seeds, "schedule": args.schedule,
              "threads": args.threads, "kfac": {"damping": args.damping, "kl_clip": args.kl_clip,
              "factor_update_freq": args.factor_update_freq, "inv_update_freq": args.inv_update_freq}, "settings": {}}
    for name, (lr, kfac) in settings.items():
        runs = [train(args, data, name, lr, kfac, seed) for seed in args.seeds]
        report["settings"][name] = {"lr": lr, "kfac": kfac, **summarise(runs), "runs": runs}

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["setting,reached,median_epochs_to_target,median_seconds_to_target,final_accuracy_mean"]
    for name, s in report["settings"].items():
        lines.append(f"{name},{s['reached']},{s['median_epochs_to_target']},{s['median_seconds_to_target']:.1f},{s['final_accuracy_mean']:.4f}")
    args.out.with_suffix(".csv").write_text("\n".join(lines) + "\n")
    plot(report, args.out)
    print("\n".join(lines))
    print(f"wrote {args.out}.json/.csv/.png")


if __name__ == "__main__":
    main()
