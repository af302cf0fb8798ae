"""Command-line configuration for ``python -m hpcdl.train``: every flag, written once.

Each field of :class:`TrainConfig` is one flag: its default, help text, accepted values and range
live on the field and nowhere else. ``PRESETS`` holds only what a dataset's recipe changes from
those defaults (``--dataset cifar10`` alone is the course's ResNet-32 recipe); flags given on the
command line win over both. :func:`to_argv` turns a configuration back into flags, which
tests/training/test_config.py uses to prove that every flag round-trips.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcdl.data import DATASETS
from hpcdl.runtime.console import print0
from hpcdl.runtime.errors import UsageError
from hpcdl.runtime.numbers import AT_LEAST_1, FRACTION, NON_NEGATIVE, POSITIVE, UNIT_INTERVAL_OPEN_TOP, Range
from hpcdl.training import backend as backends
from hpcdl.training.phases import parse_profile_steps

# What each dataset's recipe changes from TrainConfig's defaults (which are the digits recipe).
PRESETS: dict[str, dict[str, Any]] = {
    "digits": {},
    "mnist": dict(model="mnist_cnn", epochs=10, batch_size=64, warmup_epochs=0.5, weight_decay=5e-4),
    "cifar10": dict(model="resnet32", epochs=100, batch_size=128, base_lr=0.1, lr_schedule="step",
                    lr_decay=[35, 75, 90], warmup_epochs=5.0, weight_decay=5e-4, workers=2),
    "imagenet": dict(model="resnet50", epochs=90, base_lr=0.0125, lr_schedule="step",
                     lr_decay=[30, 60, 80], warmup_epochs=5.0, weight_decay=5e-5, workers=4),
    "synthetic": dict(model="resnet32", epochs=1, batch_size=64, base_lr=0.1, lr_schedule="step",
                      warmup_epochs=0.0, weight_decay=5e-4),
}
# What ``--kfac-preset`` changes, over the dataset's preset (given flags win). large-batch: K-FAC on, with
# the settings measured at a global batch of 4096 on MNIST (benchmarks/results/kfac_large_batch.md): factors
# every step (the default) from 256 examples dealt over the ranks, decompositions every 2nd step, the
# gradient-worker fraction that moves the fewest bytes (auto), damping 0.003, a KL clip ten times the
# default's, and momentum 0.5 (a preconditioned step needs less of it than SGD's 0.9). Each halving alone kept
# the one-host steps to 98.5 %, and together they take what does not divide over ranks (the largest
# decomposition, the wait for it) out of half the steps (benchmarks/results/kfac_large_batch_modern.md). The
# inverse method (Cholesky inverses, factored Tikhonov damping) reached 98.5 % before eigen in every seed of
# the 2 x 1 cell (six) and in fewer steps in every seed on one host (three), at the same damping
# (benchmarks/results/kfac_methods.md).
KFAC_PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    "large-batch": dict(kfac=True, kfac_inv_update_freq=2, kfac_factor_examples=256, kfac_grad_worker_fraction="auto",
                        kfac_damping=0.003, kfac_kl_clip=0.01, momentum=0.5, kfac_method="inverse"),
}
# Flags renamed to read like kfac-pytorch's (inv/factor update frequency, a kfac_ prefix, an on/off switch of
# their own): the old name still parses, with a one-line note, and a checkpoint saved under it still resumes.
RENAMED = {"kfac_cov_update_freq": "kfac_factor_update_freq", "damping": "kfac_damping", "kl_clip": "kfac_kl_clip",
           "factor_decay": "kfac_factor_decay"}
# ``--kfac-update-freq N`` was both the switch (N > 0) and the decomposition frequency.
OLD_SWITCH = "kfac_update_freq"
NOTED: set[str] = set()  # renamed flags already noted in this process


BACKENDS = ("horovod", "torch")


def default_backend() -> str:
    """horovod where it is installed (hpcdl's default), else torch: an install without Horovod still trains."""
    return "horovod" if importlib.util.find_spec("horovod") is not None else "torch"


# Seeds are mixed as signed 64-bit integers (hpcdl.data.order.mix_seed): the largest one they can hold.
SEED_MAX = 2**63 - 1


def seed_value(text: str) -> int:
    """A ``--seed``, checked as an integer (a float comparison would let 2**63 pass as 2**63 - 1)."""
    value = int(text)  # a ValueError is argparse's "invalid int value"
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63 - 1] (got {text})")
    return value


seed_value.__name__ = "int"


def flag(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, choices: Sequence[str] | None = None,
         nargs: str | int | None = None, valid: Range | None = None, metavar: str | Sequence[str] | None = None,
         group: str = "run control", bare: str | None = None) -> Any:
    """A TrainConfig field that is also a command-line flag (``--field-name``).

    ``bare``: the value of the flag given alone, for choice flags that read as switches (``--amp``).
    """
    meta = dict(help=help, parse=parse, choices=choices, nargs=nargs, valid=valid, metavar=metavar, group=group,
                bare=bare)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


DATA, MODEL, SPEED, KFAC = "data", "model and optimisation", "speed (GPU)", "K-FAC (kfac.KFACPreconditioner)"



def fraction_or_auto(text: str) -> float | str:
    """An argparse type: 'auto', or a fraction in (0, 1]."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # refused below, with the same words
    if not FRACTION.contains(value):
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1] or auto (got {text})")
    return value


fraction_or_auto.__name__ = "fraction"


def profile_steps_value(text: str) -> str:
    """An argparse type: FIRST:LAST (hpcdl.training.phases.parse_profile_steps), kept as written."""
    try:
        parse_profile_steps(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--profile-steps must be ")) from None
    return text

@dataclass
class TrainConfig:
    # data
    task: str | None = flag(None, "your own model, data and loss: package.module:function returning an "
                                  "hpcdl.training.task.Task (docs/training.md, \"Your own model\"); replaces "
                                  "--dataset and --model", parse=str, group=DATA)
    dataset: str = flag("digits", "digits and synthetic are built in; others read --data-dir", choices=DATASETS,
                        group=DATA)
    data_dir: str | None = flag(None, "dataset folder: cifar-10-batches-py, MNIST's IDX files, ImageNet's train/ and "
                                      "val/, or packed shards (python -m hpcdl.pack)", parse=str, group=DATA)
    synthetic_shape: list[int] = flag([3, 32, 32], "synthetic image shape", parse=int, nargs=3,
                                      metavar=("C", "H", "W"), valid=AT_LEAST_1, group=DATA)
    synthetic_classes: int = flag(10, "synthetic classes", parse=int, valid=Range(2), group=DATA)
    synthetic_size: int = flag(2048, "synthetic training samples", parse=int, valid=AT_LEAST_1, group=DATA)
    workers: int = flag(0, "data-loading worker processes per rank", parse=int, valid=NON_NEGATIVE, group=DATA)
    decode: str = flag("auto", "where JPEGs are decoded: auto is gpu on CUDA, else cpu",
                       choices=("auto", "cpu", "gpu"), group=DATA)
    # model and optimisation
    model: str = flag("digits_cnn", "digits_cnn, mnist_cnn, mnist_resnet, resnet20/32/44/56/110, a torchvision "
                                    "model name, or package.module:function(num_classes, in_channels) returning "
                                    "your own nn.Module", parse=str, group=MODEL)
    epochs: int = flag(15, "epochs to train", parse=int, valid=AT_LEAST_1, group=MODEL)
    batch_size: int = flag(32, "per rank, per backward pass", parse=int, valid=AT_LEAST_1, group=MODEL)
    test_batch_size: int = flag(256, "per rank, evaluation", parse=int, valid=AT_LEAST_1, group=MODEL)
    base_lr: float = flag(0.02, "learning rate for one rank's batch; scaled by the world size", parse=float,
                          valid=POSITIVE, group=MODEL)
    optimizer: str = flag("sgd", "update rule; lars, lamb and muon are timm's, soap is pytorch-optimizer's (for large "
                                 "global batches)", choices=("sgd", "adam", "adamw", "lars", "lamb", "muon", "soap"),
                          group=MODEL)
    momentum: float = flag(0.9, "momentum of SGD, LARS and Muon", parse=float, valid=Range(0, 1, high_open=True),
                           group=MODEL)
    nesterov: bool = flag(False, "Nesterov momentum (SGD)", group=MODEL)
    weight_decay: float = flag(1e-4, "L2 weight decay", parse=float, valid=Range(0, 1), group=MODEL)
    label_smoothing: float = flag(0.0, "label smoothing of the cross-entropy", parse=float,
                                  valid=UNIT_INTERVAL_OPEN_TOP, group=MODEL)
    warmup_epochs: float = flag(1.0, "linear per-step warm-up from --base-lr to the scaled rate", parse=float,
                                valid=NON_NEGATIVE, group=MODEL)
    warmup_start_factor: float | None = flag(None, "start the warm-up at this fraction of the scaled rate instead "
                                                   "of at --base-lr (Goyal et al.; works on one rank too)",
                                             parse=float, valid=FRACTION, group=MODEL)
    lr_schedule: str = flag("cosine", "after warm-up: --lr-decay milestones, or cosine", choices=("step", "cosine"),
                            group=MODEL)
    lr_decay: list[int] = flag([], "epochs at which the rate is multiplied by 0.1", parse=int, nargs="*",
                               valid=AT_LEAST_1, group=MODEL)
    batches_per_allreduce: int = flag(1, "local gradient accumulation steps", parse=int, valid=AT_LEAST_1, group=MODEL)
    fp16_allreduce: bool = flag(False, "compress gradients to fp16 for the allreduce", group=MODEL)
    use_adasum: bool = flag(False, "Horovod's Adasum instead of averaging", group=MODEL)
    backend: str = flag(default_backend(), "what averages the gradients: horovod (DistributedOptimizer) or torch "
                                           "(torch.distributed DDP: NCCL on GPUs, Gloo on CPUs); MPI starts and "
                                           "coordinates the ranks under both (docs/cluster.md: which to choose)",
                        choices=BACKENDS, group=MODEL)
    # speed
    device: str = flag("auto", "auto takes this rank's GPU when CUDA sees one; cuda makes a missing GPU an error",
                       choices=("auto", "cuda", "cpu"), group=SPEED)
    amp: str = flag("off", "mixed precision: bf16 (no loss scaling), fp16 (GradScaler, CUDA only), auto (bf16 where "
                           "supported, else fp16); a bare --amp means auto", choices=("off", "auto", "bf16", "fp16"),
                    bare="auto", group=SPEED)
    channels_last: str = flag("auto", "NHWC memory format for convolutional models (CPU and CUDA); auto keeps NCHW "
                                      "for a model whose forward cannot take NHWC; a bare --channels-last means on",
                              choices=("auto", "on", "off"), bare="on", group=SPEED)
    deterministic: str = flag("auto", "bit-identical runs: on fixes the allreduce's summation order (no tensor fusion)"
                                      " and, on CUDA, takes deterministic kernels (cuDNN); auto is on for CPU runs; a "
                                      "bare --deterministic means on", choices=("auto", "on", "off"), bare="on",
                              group=SPEED)
    cudnn_benchmark: bool = flag(True, "let cuDNN pick the fastest kernels for the fixed input shape", group=SPEED)
    compile: bool = flag(False, "torch.compile the model (measured in benchmarks/train_throughput.py)", group=SPEED)
    log_every: int = flag(50, "steps between reading metrics back from the device (and checking for a stop signal)",
                          parse=int, valid=AT_LEAST_1, group=SPEED)
    # K-FAC
    kfac: bool = flag(False, "precondition the gradients with K-FAC (kfac.KFACPreconditioner)", group=KFAC)
    kfac_inv_update_freq: int = flag(10, "steps between the factors' eigendecompositions (kfac-pytorch: "
                                         "inv_update_steps)", parse=int, valid=AT_LEAST_1, group=KFAC)
    kfac_factor_update_freq: int = flag(1, "steps between factor updates (kfac-pytorch: factor_update_steps)",
                                        parse=int, valid=AT_LEAST_1, group=KFAC)
    kfac_damping: float = flag(0.01, "Tikhonov damping in kfac's batch-independent convention (docs/kfac.md)",
                               parse=float, valid=POSITIVE, group=KFAC)
    kfac_kl_clip: float = flag(0.001, "KL clip of the preconditioned step", parse=float, valid=POSITIVE, group=KFAC)
    kfac_factor_examples: int | None = flag(None, "examples per step, over all ranks and backward passes, whose "
                                                  "statistics update the factors (default: all); a few hundred cut "
                                                  "the cost of convolutions' factors at large batches", parse=int,
                                            valid=AT_LEAST_1, group=KFAC)
    kfac_factor_decay: float = flag(0.95, "running-average decay of the factors", parse=float,
                                    valid=UNIT_INTERVAL_OPEN_TOP, group=KFAC)
    kfac_skip_layers: list[str] = flag([], "module names (model.named_modules) or class names whose layers K-FAC "
                                           "leaves to the optimizer, e.g. classifier.1", parse=str, nargs="*",
                                       group=KFAC)
    kfac_preset: str = flag("none", "large-batch: K-FAC on with the settings measured for large global batches "
                                    "(docs/kfac.md); flags given win", choices=tuple(KFAC_PRESETS), group=KFAC)
    kfac_impl: str = flag("hpcdl", "K-FAC implementation: hpcdl (kfac/), or module:function returning another "
                                   "(a benchmark's plugin point, docs/kfac.md)", parse=str, group=KFAC)
    kfac_grad_worker_fraction: float | str = flag(1.0, "KAISA: share of ranks that precondition each layer, or auto: "
                                                  "the one that moves the fewest bytes per step (docs/kfac.md)",
                                                  parse=fraction_or_auto, group=KFAC)
    kfac_comm_precision: str = flag("same", "precision K-FAC's decompositions and preconditioned gradients travel "
                                            "in: same as the model, or bf16 (half their bytes; factor statistics are "
                                            "summed in the model's precision; docs/kfac.md)",
                                    choices=("same", "bf16"), group=KFAC)
    kfac_factor_precision: str = flag("same", "precision K-FAC's factor statistics are summed over ranks in: same "
                                              "as the model, or bf16 (half their bytes; needs --backend torch; "
                                              "docs/kfac.md)", choices=("same", "bf16"), group=KFAC)
    kfac_conv_approx: str = flag("expand", "how a convolution's positions enter its K-FAC factors: expand (KFC) or "
                                           "reduce (K-FAC-reduce: cheaper A statistics; docs/kfac.md)",
                                 choices=("expand", "reduce"), group=KFAC)
    kfac_method: str = flag("eigen", "how K-FAC decomposes its factors: eigen (exact damped solve), inverse (Cholesky "
                                     "inverses, factored Tikhonov damping) or newton (the same inverses from matrix "
                                     "products: for GPUs; docs/kfac.md)", choices=("eigen", "inverse", "newton"),
                             group=KFAC)
    # run control
    output_dir: str | None = flag(None, "run directory (default: a new runs/<time>-<id>)", parse=str)
    resume: bool = flag(False, "continue from the newest valid checkpoint in --output-dir")
    seed: int = flag(42, "seed of initial weights, data order and augmentation (0 to 2**63 - 1)", parse=seed_value)
    max_steps: int | None = flag(None, "stop after this many optimizer steps", parse=int, valid=AT_LEAST_1)
    target_accuracy: float | None = flag(None, "stop once test accuracy (a fraction) reaches this", parse=float,
                                         valid=FRACTION)
    target_metric: float | None = flag(None, "with --task: stop once the task's deciding metric (Task.best) reaches "
                                             "this value in its direction", parse=float)
    eval_every: int | None = flag(None, "also evaluate every this many optimizer steps, mid-epoch too (rows with a "
                                        "fractional epoch in metrics.jsonl; --target-accuracy can stop there); "
                                        "default: at each epoch's end", parse=int, valid=AT_LEAST_1)
    keep_checkpoints: int = flag(3, "checkpoints kept in <output-dir>/checkpoints", parse=int, valid=AT_LEAST_1)
    stall_timeout: float = flag(300.0, "end the job when no step completes for this many seconds (0 disables)",
                                parse=float, valid=NON_NEGATIVE)
    max_nonfinite_steps: int = flag(5, "stop after this many consecutive steps with non-finite loss or gradients",
                                    parse=int, valid=AT_LEAST_1)
    progress: bool = flag(True, "tqdm progress bar on rank 0 (--no-progress: epoch lines only)")
    profile_steps: str | None = flag(None, "FIRST:LAST global steps to trace on every rank (torch.profiler; "
                                           "<output-dir>/traces/rank<r>.json opens in Perfetto; Horovod's timeline "
                                           "beside it)", parse=profile_steps_value)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """argparse from the fields. Every default is SUPPRESS: defaults come from the dataclass and the preset."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcdl.train", argument_default=argparse.SUPPRESS, allow_abbrev=False,
        description="Data-parallel training with Horovod (run under mpirun/srun/ibrun for several ranks). "
                    "Unset flags take the dataset's preset, then the defaults shown.",
    )
    groups: dict[str, Any] = {}
    for f in FIELDS.values():
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        help_text = f"{meta['help']} (default: {default})"
        if isinstance(default, bool):
            group.add_argument(option_name(f.name), action=argparse.BooleanOptionalAction, help=help_text)
            continue
        kwargs: dict[str, Any] = dict(help=help_text, metavar=meta["metavar"])
        if meta["choices"] is not None:
            kwargs.update(choices=meta["choices"], metavar=None)
        if meta["parse"] is not None:
            kwargs["type"] = meta["parse"]
        if meta["nargs"] is not None:
            kwargs["nargs"] = meta["nargs"]
        if meta["bare"] is not None:
            kwargs.update(nargs="?", const=meta["bare"])
        group.add_argument(option_name(f.name), **kwargs)
    for old, new in RENAMED.items():
        parser.add_argument(option_name(old), dest=new, type=FIELDS[new].metadata["parse"], action=_Renamed,
                            help=argparse.SUPPRESS)
    parser.add_argument(option_name(OLD_SWITCH), dest="kfac", type=int, action=_Renamed, help=argparse.SUPPRESS)
    return parser


def renamed_note(old: str) -> str:
    """The one line a renamed flag prints: what to write instead."""
    new = "--kfac --kfac-inv-update-freq N (0: leave --kfac out)" if old == OLD_SWITCH else option_name(RENAMED[old])
    return f"hpcdl.train: {option_name(old)} is deprecated, use {new}"


class _Renamed(argparse.Action):
    """A renamed flag: sets the new field(s) and prints :func:`renamed_note` on rank 0's stderr."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        old = (option_string or "").lstrip("-").replace("-", "_")
        if old not in NOTED:  # once per process: a study re-parsing saved commands says it once
            NOTED.add(old)
            print0(renamed_note(old), file=sys.stderr)
        if self.dest != "kfac":
            setattr(namespace, self.dest, values)
            return
        if values < 0:
            raise UsageError(f"{option_name(OLD_SWITCH)} must be >= 0 (got {values})")
        namespace.kfac = values > 0
        if values > 0:
            namespace.kfac_inv_update_freq = values


def current_names(saved: dict[str, Any]) -> dict[str, Any]:
    """A configuration saved as a dict (a checkpoint's header, a results file) under today's field names."""
    config = {RENAMED.get(name, name): value for name, value in saved.items() if name != OLD_SWITCH}
    if OLD_SWITCH in saved:
        config["kfac"] = saved[OLD_SWITCH] > 0
        default = FIELDS["kfac_inv_update_freq"].default
        config["kfac_inv_update_freq"] = saved[OLD_SWITCH] if saved[OLD_SWITCH] > 0 else default
    return config


def parse_config(argv: Sequence[str] | None = None, task: str | None = None) -> TrainConfig:
    """Flags, then the dataset's preset for what was not given, then the defaults; validated. Raises UsageError.
    ``task``: the label of a task given in Python (:func:`hpcdl.training.api.run`), recorded as ``--task`` is."""
    parser = build_parser()
    # argparse would print usage and exit 2: make it one line through the same path as every usage error.
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))  # type: ignore[method-assign]
    given = vars(parser.parse_args(argv))
    if task is not None:
        given["task"] = task
    dataset = given.get("dataset", FIELDS["dataset"].default)
    if given.get("lr_decay") and "lr_schedule" not in given:
        given["lr_schedule"] = "step"  # milestones mean a step schedule, whatever the preset's
    refuse_task_conflicts(given)
    config = TrainConfig(**{**PRESETS[dataset], **KFAC_PRESETS[given.get("kfac_preset", "none")], **given})
    validate(config)
    return config


# What a task brings itself: these flags would be ignored beside --task, so they are refused with it.
TASK_CONFLICTS = ("dataset", "data_dir", "synthetic_shape", "synthetic_classes", "synthetic_size", "decode", "model",
                  "label_smoothing", "target_accuracy")


def refuse_task_conflicts(given: dict[str, Any]) -> None:
    """--task brings its own data, model and loss: a flag that chooses one of those too is refused, not ignored."""
    if given.get("task") is not None:
        clash = [option_name(name) for name in TASK_CONFLICTS if name in given]
        if clash:
            raise UsageError(f"--task brings its own model, data and loss: leave out {', '.join(clash)} "
                             "(put them in the task's function)")
        if given.get("compile"):
            raise UsageError("--compile cannot be combined with --task yet: its warm-up compiles on a batch of images")
    elif given.get("target_metric") is not None:
        raise UsageError("--target-metric needs --task (built-in models stop with --target-accuracy)")


def to_argv(config: TrainConfig) -> list[str]:
    """Flags that parse back to ``config`` (every field spelled out)."""
    argv: list[str] = []
    for name in FIELDS:
        value = getattr(config, name)
        if config.task is not None and name in TASK_CONFLICTS:
            continue  # a task's run leaves them at their defaults, and --task refuses them
        argv += flag_words(name, value)
    return argv


def flag_words(name: str, value: Any) -> list[str]:
    """One flag's value as the command line's words: a switch on or off (--no-...), a list as several words, None
    left out (the default of every optional flag: leaving it out gives it back). str of a float is its repr: the
    words parse back to the same value."""
    option = option_name(name)
    if isinstance(value, bool):
        return [option if value else "--no-" + option[2:]]
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [option, *map(str, value)]
    return [option, str(value)]


def check_amp_device(amp: str, device_type: str) -> None:
    """fp16 needs CUDA; called here for --device cpu and again by the job once ``--device auto`` has chosen."""
    if amp == "fp16" and device_type != "cuda":
        raise UsageError("--amp fp16 needs CUDA (its GradScaler); on CPU use --amp bf16")


def validate(c: TrainConfig) -> None:
    """Every value in its range (finite), then the combinations that cannot work; one line naming the flag."""
    for name, f in FIELDS.items():
        valid: Range | None = f.metadata["valid"]
        value = getattr(c, name)
        if valid is None or value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if not valid.contains(float(item)):
                raise UsageError(f"{option_name(name)} must be {valid} (got {item})")
    if sorted(set(c.lr_decay)) != list(c.lr_decay):
        raise UsageError(f"--lr-decay takes strictly increasing epoch numbers, e.g. 35 75 90 (got {c.lr_decay})")
    if c.lr_decay and c.lr_schedule != "step":
        raise UsageError("--lr-decay milestones need --lr-schedule step (cosine has none; leave --lr-schedule out)")
    if c.warmup_start_factor is not None and c.warmup_epochs == 0:
        raise UsageError("--warmup-start-factor needs --warmup-epochs > 0 (there is no warm-up to start)")
    if c.nesterov and (c.optimizer != "sgd" or c.momentum == 0):
        raise UsageError("--nesterov needs --optimizer sgd and a non-zero --momentum")
    if c.dataset == "synthetic" and c.synthetic_shape[1] != c.synthetic_shape[2]:
        raise UsageError(f"--synthetic-shape must be square, C H H (got {' '.join(map(str, c.synthetic_shape))})")
    if c.resume and not c.output_dir:
        raise UsageError("--resume needs --output-dir (the run directory to continue)")
    if c.device == "cpu":
        check_amp_device(c.amp, "cpu")
    if c.compile and c.kfac:
        raise UsageError("--compile cannot be combined with --kfac: K-FAC reads each layer through module hooks, "
                         "which a compiled graph does not run")
    if c.kfac and c.optimizer in ("muon", "soap"):
        raise UsageError(f"--optimizer {c.optimizer} cannot be combined with --kfac: "
                         + ("Muon sets every singular value of the step to 1, which undoes K-FAC's curvature scaling "
                            "and its KL clip" if c.optimizer == "muon" else "SOAP already preconditions with "
                            "Kronecker factors of its own (Shampoo's), so K-FAC in front would precondition twice"))
    if c.use_adasum and c.kfac:
        raise UsageError("--use-adasum cannot be combined with --kfac: Horovod's Adasum optimizer takes its step "
                         "inside backward, before K-FAC could precondition the gradient")
    backends.named(c.backend).check_flags(c)  # what the chosen backend cannot run
    check_kfac_preset(c)


def check_kfac_preset(c: TrainConfig) -> None:
    """A preset is one recipe: flags that would leave only part of it in force are refused, not half-applied."""
    if c.kfac_preset == "none":
        return
    if not c.kfac:
        momentum = KFAC_PRESETS[c.kfac_preset].get("momentum", c.momentum)
        raise UsageError(f"--kfac-preset {c.kfac_preset} is a K-FAC recipe (its momentum {momentum:g} is for "
                         "preconditioned steps) and K-FAC is turned off; leave the preset out for first-order training")
    if c.warmup_start_factor is not None and c.warmup_start_factor < 1:
        raise UsageError(f"--kfac-preset {c.kfac_preset} holds the peak rate through the warm-up: "
                         f"--warmup-start-factor {c.warmup_start_factor:g} would ramp it, and with momentum a ramp "
                         "defeats the KL clip (docs/kfac.md); leave --warmup-start-factor out")


def warmup_start_factor(c: TrainConfig) -> float | None:
    """The warm-up's start factor the run means: a K-FAC preset holds the peak rate through the warm-up on any world
    size (check_kfac_preset refuses a ramp asked for), since the ramp from --base-lr to N x --base-lr that N ranks
    would otherwise take defeats its KL clip; else --warmup-start-factor's (None: the schedule's default ramp)."""
    if c.kfac_preset != "none" and c.warmup_start_factor is None:
        return 1.0
    return c.warmup_start_factor


@dataclass(frozen=True)
class BatchUnits:
    """A run's batch in its three units, multiplied out here only: ``per_pass`` examples in one forward and backward
    on one rank (--batch-size), ``passes`` of them accumulated per step (--batches-per-allreduce), on ``ranks``."""

    per_pass: int
    passes: int
    ranks: int

    @classmethod
    def of(cls, config: TrainConfig | dict[str, Any], ranks: int) -> BatchUnits:
        """The units of a configuration (or of one saved as a dict, a checkpoint's) on ``ranks`` ranks."""
        given = config if isinstance(config, dict) else vars(config)
        return cls(given["batch_size"], given["batches_per_allreduce"], ranks)

    @property
    def per_rank_step(self) -> int:
        """Examples one rank takes in one optimizer step."""
        return self.per_pass * self.passes

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step, all ranks."""
        return self.ranks * self.per_rank_step
