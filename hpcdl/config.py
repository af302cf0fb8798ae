"""Command-line configuration for ``python -m hpcdl.train``.

Flags follow the course's command line (``--data-dir --base-lr --batch-size --epochs
--kfac-update-freq --model --lr-decay``). Flags left unset take the preset of the chosen dataset,
so ``python -m hpcdl.train`` alone trains the digits CNN and ``--dataset cifar10`` alone is the
course's ResNet-32 recipe. The result is a plain dataclass that is saved in every checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from hpcdl.data import DATASETS
from hpcdl.errors import UsageError

# Per-dataset recipes: what the flags default to when not given.
PRESETS: dict[str, dict[str, Any]] = {
    "digits": dict(model="digits_cnn", epochs=15, batch_size=32, base_lr=0.02, lr_schedule="cosine",
                   lr_decay=[], warmup_epochs=1.0, weight_decay=1e-4, workers=0),
    "mnist": dict(model="mnist_cnn", epochs=10, batch_size=64, base_lr=0.02, lr_schedule="cosine",
                  lr_decay=[], warmup_epochs=0.5, weight_decay=5e-4, workers=0),
    "cifar10": dict(model="resnet32", epochs=100, batch_size=128, base_lr=0.1, lr_schedule="step",
                    lr_decay=[35, 75, 90], warmup_epochs=5.0, weight_decay=5e-4, workers=2),
    "imagenet": dict(model="resnet50", epochs=90, batch_size=32, base_lr=0.0125, lr_schedule="step",
                     lr_decay=[30, 60, 80], warmup_epochs=5.0, weight_decay=5e-5, workers=4),
    "synthetic": dict(model="resnet32", epochs=1, batch_size=64, base_lr=0.1, lr_schedule="step",
                      lr_decay=[], warmup_epochs=0.0, weight_decay=5e-4, workers=0),
}


@dataclass
class TrainConfig:
    # data
    dataset: str = "digits"
    data_dir: str | None = None
    synthetic_shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    synthetic_classes: int = 10
    synthetic_size: int = 2048
    workers: int = 0
    # model and optimisation
    model: str = "digits_cnn"
    epochs: int = 15
    batch_size: int = 32
    test_batch_size: int = 256
    base_lr: float = 0.02
    optimizer: str = "sgd"
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    label_smoothing: float = 0.0
    warmup_epochs: float = 1.0
    lr_schedule: str = "cosine"
    lr_decay: list[int] = field(default_factory=list)
    batches_per_allreduce: int = 1
    fp16_allreduce: bool = False
    use_adasum: bool = False
    amp: bool = False
    # K-FAC
    kfac_update_freq: int = 0
    kfac_cov_update_freq: int = 1
    damping: float = 0.01
    kl_clip: float = 0.001
    factor_decay: float = 0.95
    kfac_grad_worker_fraction: float = 1.0
    # run control
    output_dir: str | None = None
    resume: bool = False
    seed: int = 42
    max_steps: int | None = None
    target_accuracy: float | None = None
    keep_checkpoints: int = 3
    stall_timeout: float = 300.0
    max_nonfinite_steps: int = 5
    progress: bool = True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdl.train",
        description="Data-parallel training with Horovod (run under mpirun/srun/ibrun for several ranks).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data")
    d.add_argument("--dataset", choices=DATASETS, default="digits", help="digits is embedded; others read --data-dir")
    d.add_argument("--data-dir", help="cifar-10-batches-py folder (or its parent), or ImageNet root with train/ and val/")
    d.add_argument("--synthetic-shape", type=int, nargs=3, default=[3, 32, 32], metavar=("C", "H", "W"))
    d.add_argument("--synthetic-classes", type=int, default=10)
    d.add_argument("--synthetic-size", type=int, default=2048, help="synthetic training samples")
    d.add_argument("--workers", type=int, help="DataLoader worker processes per rank (preset)")

    m = p.add_argument_group("model and optimisation (unset values come from the dataset preset)")
    m.add_argument("--model", help="digits_cnn, resnet20/32/44/56/110, or a torchvision model name")
    m.add_argument("--epochs", type=int)
    m.add_argument("--batch-size", type=int, help="per rank, per backward pass")
    m.add_argument("--test-batch-size", type=int, default=256)
    m.add_argument("--base-lr", type=float, help="learning rate for one rank's batch; scaled by world size")
    m.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd")
    m.add_argument("--momentum", type=float, default=0.9)
    m.add_argument("--nesterov", action="store_true")
    m.add_argument("--weight-decay", type=float)
    m.add_argument("--label-smoothing", type=float, default=0.0)
    m.add_argument("--warmup-epochs", type=float, help="linear per-step warm-up from base-lr to the scaled lr")
    m.add_argument("--lr-schedule", choices=("step", "cosine"), help="after warm-up: --lr-decay milestones or cosine")
    m.add_argument("--lr-decay", type=int, nargs="*", help="epochs at which the lr is multiplied by 0.1")
    m.add_argument("--batches-per-allreduce", type=int, default=1, help="local gradient accumulation steps")
    m.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the allreduce")
    m.add_argument("--use-adasum", action="store_true", help="Adasum instead of averaging")
    m.add_argument("--amp", action="store_true", help="mixed precision: bf16 autocast on CPU, fp16 + GradScaler on CUDA")

    k = p.add_argument_group("K-FAC (kfac.KFACPreconditioner)")
    k.add_argument("--kfac-update-freq", type=int, default=0, help="steps between eigendecompositions; 0 disables K-FAC")
    k.add_argument("--kfac-cov-update-freq", type=int, default=1, help="steps between factor updates")
    k.add_argument("--damping", type=float, default=0.01,
                   help="Tikhonov damping in kfac's batch-independent convention (docs/kfac.md maps kfac-pytorch's)")
    k.add_argument("--kl-clip", type=float, default=0.001)
    k.add_argument("--factor-decay", type=float, default=0.95)
    k.add_argument("--kfac-grad-worker-fraction", type=float, default=1.0)

    r = p.add_argument_group("run control")
    r.add_argument("--output-dir", help="run directory (default runs/<timestamp>)")
    r.add_argument("--resume", action="store_true", help="continue from the latest valid checkpoint in --output-dir")
    r.add_argument("--seed", type=int, default=42)
    r.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    r.add_argument("--target-accuracy", type=float, help="stop once test accuracy (fraction) reaches this")
    r.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints kept in <output-dir>/checkpoints")
    r.add_argument("--stall-timeout", type=float, default=300.0,
                   help="end the job if no step completes for this many seconds (0 disables)")
    r.add_argument("--max-nonfinite-steps", type=int, default=5,
                   help="stop after this many consecutive steps with non-finite loss or gradients")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar (epoch lines only)")
    return p


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse flags, fill unset ones from the dataset preset, and validate. Raises UsageError."""
    parser = build_parser()
    # argparse prints usage and exits 2 on bad flags; make that a UsageError (one line, rank 0 only).
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))  # type: ignore[method-assign]
    args = vars(parser.parse_args(argv))
    preset = PRESETS[args["dataset"]]
    for key, value in preset.items():
        if args.get(key) is None:
            args[key] = value
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in args.items() if k in known})
    validate(config)
    return config


def validate(c: TrainConfig) -> None:
    """Reject values that cannot work, with the flag named."""
    positive = {"--epochs": c.epochs, "--batch-size": c.batch_size, "--test-batch-size": c.test_batch_size,
                "--batches-per-allreduce": c.batches_per_allreduce, "--keep-checkpoints": c.keep_checkpoints,
                "--synthetic-size": c.synthetic_size, "--synthetic-classes": c.synthetic_classes,
                "--max-nonfinite-steps": c.max_nonfinite_steps}
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})")
    if c.base_lr <= 0:
        raise UsageError(f"--base-lr must be positive (got {c.base_lr})")
    if c.workers < 0:
        raise UsageError("--workers must be 0 or more")
    if c.max_steps is not None and c.max_steps < 1:
        raise UsageError("--max-steps must be at least 1")
    if c.target_accuracy is not None and not 0 < c.target_accuracy <= 1:
        raise UsageError("--target-accuracy is a fraction in (0, 1], e.g. 0.95")
    if not 0 <= c.label_smoothing < 1:
        raise UsageError("--label-smoothing must be in [0, 1)")
    if c.warmup_epochs < 0 or c.weight_decay < 0 or c.stall_timeout < 0:
        raise UsageError("--warmup-epochs, --weight-decay and --stall-timeout cannot be negative")
    if any(m <= 0 for m in c.lr_decay) or sorted(c.lr_decay) != list(c.lr_decay):
        raise UsageError("--lr-decay takes increasing positive epoch numbers, e.g. 35 75 90")
    if c.kfac_update_freq < 0 or c.kfac_cov_update_freq < 1:
        raise UsageError("--kfac-update-freq must be >= 0 and --kfac-cov-update-freq >= 1")
    if not 0 < c.kfac_grad_worker_fraction <= 1:
        raise UsageError("--kfac-grad-worker-fraction must be in (0, 1]")
    if not 0 <= c.factor_decay < 1 or c.damping <= 0:
        raise UsageError("--factor-decay must be in [0, 1) and --damping positive")
    if c.dataset == "synthetic" and min(c.synthetic_shape) < 1:
        raise UsageError("--synthetic-shape values must be positive")
    if c.resume and not c.output_dir:
        raise UsageError("--resume needs --output-dir (the run directory to continue)")
