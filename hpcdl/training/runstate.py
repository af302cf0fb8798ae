"""Run state: what a checkpoint holds, its format, and what resuming means. Described here once.

A checkpoint (``<run>/checkpoints/ckpt-<step>.pt``, written by :class:`hpcdl.persistence.checkpointer.Checkpointer`
from the stateful parts of :class:`TrainState`) is a dict with:

==================  ===========================================================================
``format``          ``"hpcdl.train checkpoint"`` (a file from another program is refused)
``format_version``  :data:`FORMAT_VERSION` (a file of another version is refused, one line)
``run_id``          the run that wrote it
``global_step``     optimizer steps taken (also the file name)
``world_size``      ranks that wrote it (a resume on another size rescales, see below)
``config``          the whole :class:`~hpcdl.training.config.TrainConfig` of that run, as a dict
``progress``        :class:`Progress`: epoch, position in it, best accuracy, timings, stop reason
``model``           rank 0's model state (parameters are identical on every rank)
``optimizer``       the optimizer state (momentum buffers, Adam moments)
``scaler``          the fp16 GradScaler state, or None
``kfac``            the K-FAC preconditioner state, or None
``rng``             every rank's torch/CUDA/Python random state (exact mid-epoch continuation)
==================  ===========================================================================

Resuming (``--resume``) is defined by three lists. :data:`MUST_MATCH`: fields that change what is
being trained; a mismatch is refused with one line naming each. Everything else MAY change: the
new value is applied to the restored state (an optimizer hyperparameter is written into the
restored param groups) and recorded in the run's ``resumed_with_changes``, as is a change of world
size (the run's ``segments`` keep each world size's share of the training apart).

When a run is finished is decided here and nowhere else: :func:`finished` (a limit of the flags
reached, :data:`FINAL_REASONS`), asked after every evaluation and by every resume, and
:func:`pause_after` (the steps after which the loop must stop to evaluate, since a limit or an
evaluation point may be reached there).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcdl.persistence import checkpoint_files
from hpcdl.persistence.checkpointer import Checkpointer, Stateful, load_parts, set_rng_state
from hpcdl.runtime.console import print0
from hpcdl.runtime.errors import StorageError, UsageError, agree, rank0_then_all
from hpcdl.training.config import BatchUnits, TrainConfig, current_names, option_name
from hpcdl.training.task import one_line

FORMAT = "hpcdl.train checkpoint"
FORMAT_VERSION = 2
MUST_MATCH = ("task", "dataset", "model", "optimizer", "synthetic_shape", "synthetic_classes")
FINAL_REASONS = ("epochs", "max_steps", "target_accuracy", "target_metric")
# Flags that are also optimizer hyperparameters: a resume writes their new values into the restored param groups.
OPTIMIZER_FIELDS = ("weight_decay", "momentum", "nesterov")


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0  # the epoch being trained (or next to train)
    step_in_epoch: int = 0  # optimizer steps already taken in that epoch
    global_step: int = 0
    best_accuracy: float = 0.0
    time_to_target: float | None = None
    train_seconds: float = 0.0  # training time so far (evaluation and checkpoints excluded), all sessions
    elapsed_seconds: float = 0.0  # wall time of training and evaluation so far, all sessions
    images_seen: int = 0  # training images, all ranks, all sessions
    epochs_completed: int = 0
    nonfinite_streak: int = 0
    epoch_sums: dict[str, float] = field(default_factory=dict)  # of a part-trained epoch, all ranks
    last_test: dict[str, float] = field(default_factory=dict)  # test loss and accuracy after the last epoch
    stop_reason: str | None = None  # epochs, max_steps, target_accuracy, a signal name; None while running
    resumed_with_changes: list[str] = field(default_factory=list)
    skipped_steps: int = 0  # optimizer steps whose update was skipped for non-finite gradients, all sessions
    # The training in stretches of one world size and global batch (a resume elsewhere starts the next): each
    # {world_size, global_batch, first_step, last_step, images, train_seconds}, so that no speed blends two.
    segments: list[dict[str, Any]] = field(default_factory=list)
    # The best evaluation by the run's deciding metric (test_accuracy, or a task's): {metric, goal, value, step}.
    best: dict[str, Any] = field(default_factory=dict)

    def begin_segment(self, world_size: int, global_batch: int) -> None:
        """This session trains on ``world_size`` ranks: continue the last segment if it had the same, else start one."""
        last = self.segments[-1] if self.segments else None
        if last is None or (last["world_size"], last["global_batch"]) != (world_size, global_batch):
            self.segments.append(dict(world_size=world_size, global_batch=global_batch, first_step=self.global_step + 1,
                                      last_step=self.global_step, images=0, train_seconds=0.0))

    def add_training(self, images: int, seconds: float) -> None:
        """Count a part of an epoch just trained, in the run's totals and in the current segment."""
        self.images_seen += images
        self.train_seconds += seconds
        if self.segments:
            segment = self.segments[-1]
            segment.update(last_step=self.global_step, images=segment["images"] + images,
                           train_seconds=segment["train_seconds"] + seconds)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in dataclasses.asdict(Progress(**state)).items():
            setattr(self, key, value)


@dataclass
class TrainState:
    """The stateful parts of a training run: everything a checkpoint holds besides its header."""

    model: nn.Module  # the bare model (not the compiled wrapper)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    preconditioner: Any  # kfac.KFACPreconditioner or None
    progress: Progress = field(default_factory=Progress)

    def parts(self) -> dict[str, Stateful | None]:
        """The parts under their names in the checkpoint file."""
        return {"progress": self.progress, "model": self.model, "optimizer": self.optimizer, "scaler": self.scaler,
                "kfac": self.preconditioner}


def save(state: TrainState, checkpointer: Checkpointer, config: TrainConfig) -> None:
    """Write the checkpoint of ``state`` (collective; StorageError on every rank when the write fails)."""
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": dataclasses.asdict(config)}
    checkpointer.save(state.parts(), header, state.progress.global_step)


def keep_best(progress: Progress, checkpointer: Checkpointer) -> None:
    """When the checkpoint just written is of the best evaluation so far (by the run's deciding metric: test
    accuracy, or a task's ``best``), make it the run's ``best.pt`` too (rank 0; a failure is one line on all)."""
    if progress.best.get("step") != progress.global_step:
        return
    directory, comm = checkpointer.directory, checkpointer.comm

    def link() -> None:
        try:
            checkpoint_files.keep_as_best(directory, progress.global_step)
        except OSError as exc:
            raise StorageError(f"could not keep the best checkpoint ({exc}); the checkpoints are intact") from exc

    rank0_then_all(link, comm)


def read_latest(checkpointer: Checkpointer) -> dict[str, Any] | None:
    """The newest readable checkpoint of this run, format checked, on every rank (None: there is none); its
    configuration under today's flag names (a run saved under renamed flags resumes)."""
    saved = checkpointer.read_latest(check_format)
    if saved is not None:
        saved["config"] = current_names(saved["config"])
    return saved


def check_format(state: Any, path: Path | None) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not an hpcdl.train checkpoint (written by another program or an hpcdl "
                         f"before checkpoint format {FORMAT_VERSION}); move it away or use another --output-dir")
    if state.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{path} has checkpoint format {state.get('format_version')}, this hpcdl reads format "
                         f"{FORMAT_VERSION}; resume it with the hpcdl version that wrote it")


def resume_changes(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """What differs between the checkpoint's configuration and this one; UsageError for what may not."""
    now = dataclasses.asdict(config)
    mismatches = [f"{option_name(k)} {saved.get(k)} (checkpoint) vs {now[k]} (now)" for k in MUST_MATCH
                  if saved.get(k) != now[k]]
    if mismatches:
        raise UsageError("cannot resume: the checkpoint was trained with " + "; ".join(mismatches)
                         + " (use another --output-dir for a different run)")
    ignore = {"resume", "output_dir"}
    return [f"{option_name(k)} {saved.get(k)} -> {now[k]}" for k in now
            if k not in ignore and k in saved and saved[k] != now[k]]


def finished(config: TrainConfig, progress: Progress) -> str | None:
    """Which limit of the flags ``progress`` has reached (one of :data:`FINAL_REASONS`), or None to train on.

    The one rule: after an evaluation it says whether the run stops for good; on a resume, whether
    there is anything left to train (a run is trained further exactly when its flags were raised).
    """
    if config.target_accuracy is not None and progress.best_accuracy >= config.target_accuracy:
        return "target_accuracy"
    if config.target_metric is not None and target_reached(progress.best, config.target_metric):
        return "target_metric"
    if config.max_steps is not None and progress.global_step >= config.max_steps:
        return "max_steps"
    if progress.epochs_completed >= config.epochs:
        return "epochs"
    return None


def target_met(config: TrainConfig, progress: Progress) -> bool:
    """Whether the run's --target-accuracy or --target-metric (whichever it has) is reached."""
    if config.target_accuracy is not None and progress.best_accuracy >= config.target_accuracy:
        return True
    return config.target_metric is not None and target_reached(progress.best, config.target_metric)


def target_reached(best: dict[str, Any], target: float) -> bool:
    """Whether the best evaluation so far reached ``target`` in its metric's direction."""
    value = best.get("value")
    return value is not None and (value >= target if best.get("goal") == "max" else value <= target)


def limit_flags(config: TrainConfig) -> str:
    """The flags that let a finished run train further: a task's target is --target-metric (it refuses
    --target-accuracy), a built-in model's --target-accuracy."""
    target = "--target-metric" if config.task is not None else "--target-accuracy"
    return f"--epochs, --max-steps or {target}"


def closing_words(config: TrainConfig, progress: Progress) -> str:
    """Why a finished run stopped, and its best evaluation, for the run's last line."""
    limit = {"epochs": f"--epochs {config.epochs} reached", "max_steps": f"--max-steps {config.max_steps} reached",
             "target_accuracy": f"--target-accuracy {config.target_accuracy} reached",
             "target_metric": f"--target-metric {config.target_metric} reached"}.get(
        str(progress.stop_reason), str(progress.stop_reason))
    best = progress.best
    if best.get("value") is None:
        return f"{limit} at step {progress.global_step}"
    return (f"{limit} at step {progress.global_step}; best {best['metric']} {best['value']:.4g} at step "
            f"{best['step']}")


def describe_limit(reason: str, config: TrainConfig, progress: Progress) -> str:
    """The flag behind a :func:`finished` reason, for the line that says a run trains no further."""
    if reason == "target_metric":
        return f"--target-metric {config.target_metric:g} already reached (best {progress.best.get('value')})"
    if reason == "target_accuracy":
        return f"--target-accuracy {config.target_accuracy:g} already reached (best {progress.best_accuracy:.4f})"
    return f"--max-steps {config.max_steps} already reached" if reason == "max_steps" else \
        f"--epochs {config.epochs} already reached"


def pause_after(step: int, step_in_epoch: int, steps_per_epoch: int, max_steps: int | None,
                eval_every: int | None) -> bool:
    """True when the loop must stop after optimizer step ``step`` (``step_in_epoch`` of its epoch, counted from 1)
    to evaluate: the epoch's end, --max-steps, or an --eval-every point, where :func:`finished` may say stop."""
    return (step_in_epoch >= steps_per_epoch or (max_steps is not None and step >= max_steps)
            or (eval_every is not None and step % eval_every == 0))


def restore(state: TrainState, saved: dict[str, Any], config: TrainConfig, rank: int, world_size: int,
            where: Path) -> None:
    """Load ``saved`` into ``state`` on every rank; apply and record what the flags changed."""
    changes = resume_changes(saved["config"], config)
    parts = {name: part for name, part in state.parts().items() if name != "progress"}

    def load() -> None:
        try:
            load_parts(parts, saved)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise UsageError(f"the checkpoint in {where} does not fit this model: {one_line(exc)}") from exc

    agree(load)
    # A changed flag takes effect on the restored state, in the groups that had the flag's old value (a task's
    # group of its own, such as no weight decay on norms, keeps its value).
    for name in OPTIMIZER_FIELDS:
        old, new = saved["config"].get(name), getattr(config, name)
        for group in state.optimizer.param_groups:
            if name in group and old != new and group[name] == old:
                group[name] = new
    state.progress.load_state_dict(saved["progress"])
    if changes:
        print0("resuming with changed flags: " + "; ".join(changes))
    old = saved["config"]
    saved_batch = BatchUnits.of(old, saved["world_size"]).global_batch
    batch = BatchUnits.of(config, world_size).global_batch
    if saved["world_size"] != world_size:
        changes.append(f"world size {saved['world_size']} -> {world_size}")
    state.progress.resumed_with_changes = state.progress.resumed_with_changes + changes
    if saved["world_size"] == world_size and saved_batch == batch:
        set_rng_state(saved["rng"][rank])
    else:
        print0(f"checkpoint was written by {saved['world_size']} rank(s) with global batch {saved_batch}, resuming on "
               f"{world_size} with global batch {batch}: learning rate rescaled, position in the epoch kept by "
               "sample count (an exact continuation needs the same ranks and batch size)")
        state.progress.step_in_epoch = state.progress.step_in_epoch * saved_batch // batch
